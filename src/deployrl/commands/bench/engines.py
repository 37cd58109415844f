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
`--lora-rank R` gives the model LoRA adapters of rank R (B drawn small, as after some training);
each engine then runs once per `--lora-serving` way (adapter: beside the base; merged: folded into
it, vllm only), and the median seconds of a weight sync are printed too.
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

from deployrl.algo._checks import check_non_negative, check_positive
from deployrl.commands.bench.measure import timed
from deployrl.cpu import this_cpu
from deployrl.engines import (
    ENGINES,
    LoraServing,
    engine_help,
    engine_kind,
    lora_serving_help,
    parse_engine_spec,
    serves_lora,
)
from deployrl.engines.base import SamplingParams
from deployrl.settings.command_line import CommandLine, Flag
from deployrl.settings.docs import setting


@dataclass(frozen=True)
class EnginesBenchConfig:
    """`deployrl bench engines`: one engine one completion at a time against batched, or several side by side."""

    engine: str = setting("llamacpp:q4_1", lambda: "the engine timed one completion at a time against batched (a"
                          f" {' or '.join(_rebatching())} engine), {engine_help()}")
    compare: tuple[str, ...] = setting((), lambda: "engine specs to compare side by side instead, e.g."
                                       f" llamacpp:q4_1,hf:bf16; each {engine_help()}")
    prompts: int = setting(4, "prompts of the default task per call")
    k: tuple[int, ...] = setting((1, 4, 8, 16), "completions per prompt, e.g. 1,4,8")
    tokens: tuple[int, ...] = setting((32, 256), "max new tokens, e.g. 32,256")
    parallel: int = setting(32, "completions decoded together when batched")
    threads: Optional[int] = setting(None, "llama.cpp threads, vLLM's bound cores; None: every CPU")
    repeats: int = setting(2, "alternating runs of each path")
    lora_rank: int = setting(0, "with compare: LoRA adapters of this rank on the model; 0: none")
    lora_serving: tuple[str, ...] = setting(tuple(LoraServing.names()), lambda: "with lora_rank: each way an engine"
                                            f" holds them, of {lora_serving_help()}")
    json: Optional[str] = setting(None, "also write the numbers to this path")

    def __post_init__(self) -> None:
        for spec in self.compare:
            parse_engine_spec(spec)
        if not self.compare and not engine_kind(self.engine).rebatches:
            raise ValueError(f"engine must be a {' or '.join(_rebatching())} engine (its batch width changes between"
                             f" calls), got {self.engine!r}")
        for name in ("k", "tokens"):
            if not getattr(self, name) or min(getattr(self, name)) < 1:
                raise ValueError(f"{name} must list positive integers, got {list(getattr(self, name))}")
        for name in ("prompts", "parallel", "repeats"):
            check_positive(name, getattr(self, name))
        if self.threads is not None:
            check_positive("threads", self.threads)
        check_non_negative("lora_rank", self.lora_rank)
        for serving in self.lora_serving:
            LoraServing.get("lora serving", serving)
        if self.lora_rank and not self.compare:
            raise ValueError("lora_rank applies to --compare: name the engines to compare")

    def variants(self) -> list[tuple[str, str, str]]:
        """(label, engine spec, lora serving) of each compared engine: one per serving way with
        adapters that the engine can hold (merged: vllm), else one."""
        if not self.lora_rank:
            return [(spec, spec, LoraServing.ADAPTER.value) for spec in self.compare]
        return [(f"{spec}/{serving}", spec, serving) for spec in self.compare for serving in self.lora_serving
                if serves_lora(spec, serving)]


FLAGS = (
    Flag("--engine", "engine"),
    Flag("--compare", "compare", many=True),
    Flag("--prompts", "prompts"),
    Flag("-k", "k", many=True),
    Flag("--tokens", "tokens", many=True),
    Flag("--parallel", "parallel"),
    Flag("--threads", "threads"),
    Flag("--repeats", "repeats"),
    Flag("--lora-rank", "lora_rank"),
    Flag("--lora-serving", "lora_serving", many=True),
    Flag("--json", "json"),
)


def _rebatching() -> list[str]:
    """The engine kinds whose batch width may change between calls (the sequential-vs-batched comparison)."""
    return [name for name in ENGINES if ENGINES.get(name).rebatches]


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
                    speeds[name].append(batches[name].timing.tokens_per_s)
            yield max_new, k, {name: median(values) for name, values in speeds.items()}, batches


def main(argv: list[str] | None = None) -> int:
    config, _ = CommandLine("deployrl bench engines", EnginesBenchConfig, __doc__.split("\n\n")[0], FLAGS).parse(argv)
    from deployrl.engines import make_engine
    from deployrl.models.loading import end_token_ids, load_model, load_tokenizer, resolve_model
    from deployrl.settings.config import default_task
    from deployrl.tasks import load_task
    from deployrl.tasks.prompts import encode_prompts

    torch.set_num_threads(1)  # the sampler's small ops; llama.cpp has its own threads
    source = resolve_model("smollm2-135m")
    tokenizer = load_tokenizer(source)
    model = load_model(source).eval()
    prompts = encode_prompts(tokenizer, [e.prompt for e in load_task(default_task()).examples[: config.prompts]])
    eos = end_token_ids(tokenizer, model)
    if config.compare:
        if config.lora_rank:
            add_trained_lora(model, config.lora_rank)
        return compare_engines(config, model, source, eos, prompts)
    engine = make_engine(config.engine, model, source, eos, threads=config.threads,
                         parallel=config.parallel)
    threads = engine.runtime.threads
    print(f"{config.engine} on SmolLM2-135M-Instruct, {len(prompts)} prompts of the default task, {threads} threads,"
          f" {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; medians of {config.repeats} alternating runs")
    print(f"machine: {this_cpu().describe()}")
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


def add_trained_lora(model, rank: int) -> None:
    """LoRA adapters of `rank` on the default targets, B drawn small (std 1e-3) so that they change the
    model as a few training steps do (B = 0, peft's start, would let an engine skip them unnoticed)."""
    from deployrl.models.lora import add_lora
    from deployrl.settings.config import LORA_TARGETS

    add_lora(model, rank, 2.0 * rank, 0.0, LORA_TARGETS)
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(0)
        for name, parameter in model.named_parameters():
            if ".lora_B." in name:
                parameter.normal_(0, 1e-3)


def compare_engines(config: EnginesBenchConfig, model, source, eos: list[int], prompts: list[list[int]]) -> int:
    """Tokens/s of each engine in `config.compare` on the same prompts and seeds, side by side (and
    with adapters, the seconds of a weight sync)."""
    from deployrl.engines import make_engine

    engines, load_s, sync_s = {}, {}, {}
    for label, spec, serving in config.variants():
        start = time.perf_counter()
        engines[label] = make_engine(spec, model, source, eos, threads=config.threads, parallel=config.parallel,
                                     lora_serving=serving)
        load_s[label] = time.perf_counter() - start
        if config.lora_rank:
            sync_s[label] = median(timed(partial(engines[label].sync, model.state_dict()))[1] for _ in range(3))
    labels = list(engines)
    print(f"SmolLM2-135M-Instruct{f' + LoRA rank {config.lora_rank}' if config.lora_rank else ''}, {len(prompts)}"
          f" prompts of the default task, threads {config.threads or 'all'}, parallel {config.parallel},"
          f" {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; medians of {config.repeats} runs,"
          " the engines taking turns")
    print(f"machine: {this_cpu().describe()}")
    print("engine start (s): " + ", ".join(f"{label} {seconds:.1f}" for label, seconds in load_s.items()))
    if sync_s:
        print("weight sync (s, median of 3): " + ", ".join(f"{label} {seconds:.3f}" for label, seconds in sync_s.items()))
    first = labels[0]
    header = f"{'new tokens':>10} {'K':>3} " + " ".join(f"{label + ' tok/s':>22}" for label in labels)
    header += " " + " ".join(f"{label + ' / ' + first:>30}" for label in labels[1:])
    print(header)
    print("-" * len(header))
    rows = []
    samplers = {label: partial(engine.generate, prompts) for label, engine in engines.items()}
    for max_new, k, rates, batches in take_turns(samplers, config):
        rows.append({"max_new_tokens": max_new, "k": k, "tokens_per_s": rates,
                     "tokens": {label: int(batch.mask.sum()) for label, batch in batches.items()}})
        print(f"{max_new:>10} {k:>3} " + " ".join(f"{rates[label]:>22.1f}" for label in labels) + " "
              + " ".join(f"{rates[label] / rates[first]:>29.2f}x" for label in labels[1:]), flush=True)
    if config.json:
        Path(config.json).write_text(json.dumps({"cpu": this_cpu().describe(), "cpu_class": this_cpu().cls.value,
                                                 "engines": labels, "start_s": load_s, "sync_s": sync_s,
                                                 "lora_rank": config.lora_rank, "threads": config.threads,
                                                 "parallel": config.parallel, "prompts": len(prompts), "rows": rows},
                                                indent=2))
    return 0
