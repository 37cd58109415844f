"""`deployrl bench engines`: the llama.cpp engine decoding one completion at a time against
continuous batching, tokens per second side by side, in one run.

For each completion length and K, the same prompts are sampled with the same seeds by the engine
with `parallel=1` (one completion per llama_decode call, the prompt evaluated once and reused: the
sequential path) and with `parallel=P` (up to P completions of one or several prompts per call).
The two runs alternate `--repeats` times and the medians are printed, with the share of
completions that came out identical and the largest log-probability difference before the first
different token (llama.cpp's kernels are not batch-invariant: docs/engines.md).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from statistics import median

import torch


def _ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",")]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="deployrl bench engines", description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", default="llamacpp:q4_1", help="a llamacpp engine spec (default llamacpp:q4_1)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts of the default task per call (default 4)")
    parser.add_argument("-k", type=_ints, default=[1, 4, 8, 16], help="completions per prompt (default 1,4,8,16)")
    parser.add_argument("--tokens", type=_ints, default=[32, 256], help="max new tokens (default 32,256)")
    parser.add_argument("--parallel", type=int, default=32, help="completions decoded together when batched (default 32)")
    parser.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: every CPU)")
    parser.add_argument("--repeats", type=int, default=2, help="alternating runs of each path (default 2)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the numbers to PATH")
    args = parser.parse_args(argv)
    if not args.engine.startswith("llamacpp"):
        parser.error(f"--engine must be a llamacpp engine, got {args.engine!r}")
    for name in ("prompts", "parallel", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be >= 1")
    return args


def agreement(one, batched) -> tuple[float, float]:
    """(share of identical completions, max |logp difference| over the tokens before a row's first difference)."""
    width = min(one.completion_ids.shape[1], batched.completion_ids.shape[1])
    same = one.mask[:, :width] & batched.mask[:, :width]
    same &= one.completion_ids[:, :width] == batched.completion_ids[:, :width]
    same &= same.long().cumprod(dim=1).bool()
    identical = sum(a == b for a, b in zip(one.completions(), batched.completions())) / len(one.finish_reasons)
    gap = (one.logp_inf[:, :width] - batched.logp_inf[:, :width]).abs()[same]
    return identical, float(gap.max()) if gap.numel() else 0.0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from deployrl.config import default_task
    from deployrl.engines import make_engine
    from deployrl.engines.base import SamplingParams
    from deployrl.models import end_token_ids, load_model, load_tokenizer, resolve_model
    from deployrl.prompts import encode_prompts
    from deployrl.tasks import load_task

    torch.set_num_threads(1)  # the sampler's small ops; llama.cpp has its own threads
    source = resolve_model("smollm2-135m")
    tokenizer = load_tokenizer(source)
    model = load_model(source).eval()
    prompts = encode_prompts(tokenizer, [e.prompt for e in load_task(default_task()).examples[: args.prompts]])
    engine = make_engine(args.engine, model, source, end_token_ids(tokenizer, model), threads=args.threads,
                         parallel=args.parallel)
    threads = engine.runtime.threads
    print(f"{args.engine} on SmolLM2-135M-Instruct, {len(prompts)} prompts of the default task, {threads} threads,"
          f" {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; medians of {args.repeats} alternating runs")
    header = (f"{'new tokens':>10} {'K':>3} {'tokens':>7} {'sequential tok/s':>17} {'batched tok/s':>14}"
              f" {'ratio':>6} {'identical':>10} {'max |dlogp| before':>19}")
    print(header)
    print("-" * len(header))
    rows = []
    for max_new in args.tokens:
        for k in args.k:
            params = SamplingParams(n=k, max_new_tokens=max_new, seed=0)
            speeds = {1: [], args.parallel: []}
            batches = {}
            for _ in range(args.repeats):
                for parallel in speeds:
                    engine.parallel = parallel
                    batches[parallel] = engine.generate(prompts, params)
                    speeds[parallel].append(batches[parallel].timing["tokens_per_s"])
            one, batched = batches[1], batches[args.parallel]
            identical, gap = agreement(one, batched)
            row = {
                "max_new_tokens": max_new, "k": k, "tokens": int(one.mask.sum()),
                "sequential_tokens_per_s": median(speeds[1]), "batched_tokens_per_s": median(speeds[args.parallel]),
                "identical": identical, "max_logp_gap_before_difference": gap,
            }
            row["ratio"] = row["batched_tokens_per_s"] / row["sequential_tokens_per_s"]
            rows.append(row)
            print(f"{max_new:>10} {k:>3} {row['tokens']:>7} {row['sequential_tokens_per_s']:>17.1f}"
                  f" {row['batched_tokens_per_s']:>14.1f} {row['ratio']:>5.2f}x {identical:>9.0%} {gap:>19.4f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"engine": args.engine, "threads": threads, "parallel": args.parallel,
                                         "prompts": len(prompts), "rows": rows}, indent=2))
    return 0
