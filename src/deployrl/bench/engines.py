"""`deployrl bench engines`: the llama.cpp engine decoding one completion at a time against
continuous batching, or several engines against each other, tokens per second side by side, in one run.

For each completion length and K, the same prompts are sampled with the same seeds by the engine
with `parallel=1` (one completion per llama_decode call, the prompt evaluated once and reused: the
sequential path) and with `parallel=P` (up to P completions of one or several prompts per call).
The two runs alternate `--repeats` times and the medians are printed, with the share of
completions that came out identical and the largest log-probability difference before the first
different token (llama.cpp's kernels are not batch-invariant: docs/engines.md).

With `--compare` (engine specs, e.g. llamacpp:q4_1,hf:bf16,vllm:bf16) each engine is built from the
same trainer model and samples the same prompts with the same seeds, the engines taking turns
`--repeats` times; the medians are printed side by side with each engine's ratio to the first.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from statistics import median
from typing import Optional

import torch

from deployrl.algo._checks import check_positive
from deployrl.configcli import CommandLine, Flag
from deployrl.engines import parse_engine_spec
from deployrl.engines.base import SamplingParams


@dataclass(frozen=True)
class EnginesBenchConfig:
    engine: str = "llamacpp:q4_1"  # a llamacpp engine spec
    compare: tuple[str, ...] = ()  # engine specs to compare instead (any kind)
    prompts: int = 4  # prompts of the default task per call
    k: tuple[int, ...] = (1, 4, 8, 16)  # completions per prompt
    tokens: tuple[int, ...] = (32, 256)  # max new tokens
    parallel: int = 32  # completions decoded together when batched
    threads: Optional[int] = None  # llama.cpp threads, vLLM's bound cores; None: every CPU
    repeats: int = 2  # alternating runs of each path
    json: Optional[str] = None  # also write the numbers here

    def __post_init__(self) -> None:
        for spec in self.compare:
            parse_engine_spec(spec)
        if not self.compare and parse_engine_spec(self.engine)[0] != "llamacpp":
            raise ValueError(f"engine must be a llamacpp engine, got {self.engine!r}")
        for name in ("k", "tokens"):
            if not getattr(self, name) or min(getattr(self, name)) < 1:
                raise ValueError(f"{name} must list positive integers, got {list(getattr(self, name))}")
        for name in ("prompts", "parallel", "repeats"):
            check_positive(name, getattr(self, name))
        if self.threads is not None:
            check_positive("threads", self.threads)


FLAGS = (
    Flag("--engine", "engine", "a llamacpp engine spec"),
    Flag("--compare", "compare", "engine specs to compare side by side, e.g. llamacpp:q4_1,vllm:bf16", many=True),
    Flag("--prompts", "prompts", "prompts of the default task per call"),
    Flag("-k", "k", "completions per prompt, e.g. 1,4,8", many=True),
    Flag("--tokens", "tokens", "max new tokens, e.g. 32,256", many=True),
    Flag("--parallel", "parallel", "completions decoded together when batched"),
    Flag("--threads", "threads", "llama.cpp threads, vLLM's bound cores (None: every CPU)"),
    Flag("--repeats", "repeats", "alternating runs of each path"),
    Flag("--json", "json", "also write the numbers to this path"),
)


def agreement(one, batched) -> tuple[float, float]:
    """(share of identical completions, max |logp difference| over the tokens before a row's first difference)."""
    width = min(one.completion_ids.shape[1], batched.completion_ids.shape[1])
    same = one.mask[:, :width] & batched.mask[:, :width]
    same &= one.completion_ids[:, :width] == batched.completion_ids[:, :width]
    same &= same.long().cumprod(dim=1).bool()
    identical = sum(a == b for a, b in zip(one.completions(), batched.completions())) / len(one.finish_reasons)
    gap = (one.logp_inf[:, :width] - batched.logp_inf[:, :width]).abs()[same]
    return identical, float(gap.max()) if gap.numel() else 0.0


def take_turns(samplers: dict[str, Callable], config: EnginesBenchConfig) -> Iterator:
    """For each (max new tokens, K) of `config`: every sampler (SamplingParams -> RolloutBatch) runs
    `config.repeats` times, the samplers taking turns; yields (max new tokens, K, median tokens/s
    per sampler, the last batch per sampler)."""
    for max_new in config.tokens:
        for k in config.k:
            params = SamplingParams(n=k, max_new_tokens=max_new, seed=0)
            speeds = {name: [] for name in samplers}
            batches = {}
            for _ in range(config.repeats):
                for name, sample in samplers.items():
                    batches[name] = sample(params)
                    speeds[name].append(batches[name].timing["tokens_per_s"])
            yield max_new, k, {name: median(values) for name, values in speeds.items()}, batches


def main(argv: list[str] | None = None) -> int:
    config, _ = CommandLine("deployrl bench engines", EnginesBenchConfig, __doc__.split("\n\n")[0], FLAGS).parse(argv)
    from deployrl.config import default_task
    from deployrl.engines import make_engine
    from deployrl.models import end_token_ids, load_model, load_tokenizer, resolve_model
    from deployrl.prompts import encode_prompts
    from deployrl.tasks import load_task

    torch.set_num_threads(1)  # the sampler's small ops; llama.cpp has its own threads
    source = resolve_model("smollm2-135m")
    tokenizer = load_tokenizer(source)
    model = load_model(source).eval()
    prompts = encode_prompts(tokenizer, [e.prompt for e in load_task(default_task()).examples[: config.prompts]])
    eos = end_token_ids(tokenizer, model)
    if config.compare:
        return compare_engines(config, model, source, eos, prompts)
    engine = make_engine(config.engine, model, source, eos, threads=config.threads,
                         parallel=config.parallel)
    threads = engine.runtime.threads
    print(f"{config.engine} on SmolLM2-135M-Instruct, {len(prompts)} prompts of the default task, {threads} threads,"
          f" {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; medians of {config.repeats} alternating runs")
    header = (f"{'new tokens':>10} {'K':>3} {'tokens':>7} {'sequential tok/s':>17} {'batched tok/s':>14}"
              f" {'ratio':>6} {'identical':>10} {'max |dlogp| before':>19}")
    print(header)
    print("-" * len(header))
    def sample_with(parallel: int):
        def sample(params):
            engine.parallel = parallel
            return engine.generate(prompts, params)
        return sample

    rows = []
    samplers = {"sequential": sample_with(1), "batched": sample_with(config.parallel)}
    for max_new, k, rates, batches in take_turns(samplers, config):
        identical, gap = agreement(batches["sequential"], batches["batched"])
        row = {
            "max_new_tokens": max_new, "k": k, "tokens": int(batches["sequential"].mask.sum()),
            "sequential_tokens_per_s": rates["sequential"], "batched_tokens_per_s": rates["batched"],
            "identical": identical, "max_logp_gap_before_difference": gap,
        }
        row["ratio"] = row["batched_tokens_per_s"] / row["sequential_tokens_per_s"]
        rows.append(row)
        print(f"{max_new:>10} {k:>3} {row['tokens']:>7} {row['sequential_tokens_per_s']:>17.1f}"
              f" {row['batched_tokens_per_s']:>14.1f} {row['ratio']:>5.2f}x {identical:>9.0%} {gap:>19.4f}", flush=True)
    if config.json:
        Path(config.json).write_text(json.dumps({"engine": config.engine, "threads": threads, "parallel": config.parallel,
                                         "prompts": len(prompts), "rows": rows}, indent=2))
    return 0


def compare_engines(config: EnginesBenchConfig, model, source, eos: list[int], prompts: list[list[int]]) -> int:
    """Tokens/s of each engine in `config.compare` on the same prompts and seeds, side by side."""
    from deployrl.engines import make_engine

    engines, load_s = {}, {}
    for spec in config.compare:
        start = time.perf_counter()
        engines[spec] = make_engine(spec, model, source, eos, threads=config.threads, parallel=config.parallel)
        load_s[spec] = time.perf_counter() - start
    print(f"SmolLM2-135M-Instruct, {len(prompts)} prompts of the default task, threads {config.threads or 'all'},"
          f" parallel {config.parallel}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f};"
          f" medians of {config.repeats} runs, the engines taking turns")
    print("engine start (s): " + ", ".join(f"{spec} {seconds:.1f}" for spec, seconds in load_s.items()))
    first = config.compare[0]
    header = f"{'new tokens':>10} {'K':>3} " + " ".join(f"{spec + ' tok/s':>22}" for spec in config.compare)
    header += " " + " ".join(f"{spec + ' / ' + first:>30}" for spec in config.compare[1:])
    print(header)
    print("-" * len(header))
    rows = []
    samplers = {spec: partial(engine.generate, prompts) for spec, engine in engines.items()}
    for max_new, k, rates, batches in take_turns(samplers, config):
        rows.append({"max_new_tokens": max_new, "k": k, "tokens_per_s": rates,
                     "tokens": {spec: int(batch.mask.sum()) for spec, batch in batches.items()}})
        print(f"{max_new:>10} {k:>3} " + " ".join(f"{rates[spec]:>22.1f}" for spec in config.compare) + " "
              + " ".join(f"{rates[spec] / rates[first]:>29.2f}x" for spec in config.compare[1:]), flush=True)
    if config.json:
        Path(config.json).write_text(json.dumps({"engines": list(config.compare), "start_s": load_s,
                                                 "threads": config.threads, "parallel": config.parallel,
                                                 "prompts": len(prompts), "rows": rows}, indent=2))
    return 0
