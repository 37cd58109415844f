"""`deployrl bench update`: wall time, peak memory and backpropagated tokens of the update phase.

Same model, same synthetic rollout batch, same machine, in one run: the update phase of
full-trajectory GRPO, DAPO, S-GRPO and PS-PPO with each cutoff strategy at one token budget B,
for several longest completion lengths T_max. The update phase is what `Trainer.learn` does
between rollout and weight sync, through the learner's public stages: `prepare` (the no-grad
pass and the cutoff plan) and `update` (one PPO epoch, one mini-batch, so one optimizer step).

PS-PPO runs with the law's inputs from the trainer (`ps:<law>`: a no-grad pass over every token
first) and from the engine (`ps:<law>:engine`, `algo.ps.proxies=engine`: no trainer pass past a
row's cutoff; with one epoch the no-grad pass is fused into the graded one). The synthetic
batch carries engine statistics (entropy, sum p^2, top 16 tokens) drawn at random, like its tokens;
what an engine spends computing them is part of sampling, not of the update.

Fairness choices:
* every method sees the same batch: per prompt group, K completions of random tokens with
  lengths drawn uniformly in [T_max/2, T_max] (seeded), rewards 0/1 with both values present;
* DC is off for all methods (correction none), so only the objective and the cutoff law differ;
* micro-batching is the trainer's: rows sorted by length and packed up to micro_batch_tokens,
  so a long full-trajectory row runs alone while short prefixes share a micro-batch;
* each (method, T_max, repeat) runs in a fresh process: model loading, the rollout engine's
  copy of the weights and AdamW's state (allocated by a step on zero gradients, which leaves
  the weights unchanged) all happen before the measured phase, as does a short warm-up
  forward and backward; repeats are interleaved across methods and reported as medians.

Random tokens carry no signal, so the heuristic and optimized laws come out nearly flat here:
they keep whole completions or nothing, and with few rows the realized backpropagated tokens
(and the time) vary a lot from draw to draw around the expected K x B per group. The cutoff
draws change with the repeat; the table shows expected and realized tokens side by side and
a note where they differ by more than a quarter.

Peak memory is `PeakMemory`: on CPU the peak resident set size above the level at entry,
after freed heap memory has been handed back to the OS (`malloc_trim`), so memory that the
set-up freed cannot be reused unseen by the update. On CUDA (`--device`, `model.device`) it is
`torch.cuda.max_memory_allocated` above the level at entry, and the timer waits for the card.
"""

from __future__ import annotations

import ctypes
import gc
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from deployrl.algo._checks import check_non_negative, check_positive
from deployrl.commands.bench.measure import (
    PeakMemory,
    device_name,
    in_fresh_process,
    median,
    synchronize,
    table,
)
from deployrl.cpu import this_cpu
from deployrl.registry import unknown_name_error
from deployrl.settings.command_line import CommandLine, Flag
from deployrl.settings.config import TrainConfig
from deployrl.settings.docs import key_help, setting
from deployrl.settings.model import Device
from deployrl.settings.parsing import build, nest

T_MAX = (512, 1024, 2048, 4096)
# the full-trajectory baselines as the papers run them: a no-grad pass for logp_old, then the update
GRPO = {"algo.ps.strategy": "full", "algo.ps.proxies": "trainer", "algo.aggregation": "seq_mean_token_mean",
        "algo.eps_high": 0.2}
DAPO = {**GRPO, "algo.aggregation": "token_mean", "algo.eps_high": 0.28}


def ps_method(strategy: str, proxies: str = "trainer") -> dict[str, Any]:
    """A budgeted cutoff strategy on the DAPO objective (the trainer's default objective)."""
    return {**DAPO, "algo.ps.strategy": strategy, "algo.ps.proxies": proxies}


def matched(method: dict[str, Any]) -> dict[str, Any]:
    """`method` with the trainer computing on the weights of an FP8 engine (model.match_engine): the
    weights rounded once per update, straight-through."""
    return {**method, "model.match_engine": True, "rollout.engine": "hf:fp8"}


# Method name -> config overrides (dotted keys of TrainConfig).
METHODS: dict[str, dict[str, Any]] = {
    "grpo": GRPO,
    "dapo": DAPO,
    "sgrpo": ps_method("sgrpo"),
    "ps:uniform": ps_method("uniform"),
    "ps:temporal": ps_method("temporal"),
    "ps:heuristic": ps_method("heuristic"),
    "ps:optimized": ps_method("optimized"),
    "ps:temporal:engine": ps_method("temporal", "engine"),
    "ps:optimized:engine": ps_method("optimized", "engine"),
}
DEFAULT_METHODS = tuple(METHODS)
METHODS |= {  # asked for by name: what model.match_engine costs the update
    "grpo:matched": matched(GRPO),
    "ps:optimized:engine:matched": matched(ps_method("optimized", "engine")),
}
TOP_M = 16  # top tokens per position in the synthetic engine statistics
REFERENCE = "grpo"  # ratios are taken to full-trajectory GRPO


@dataclass(frozen=True)
class Settings:
    """What every measurement shares (besides the model and T_max)."""

    budget: float = setting(128.0, "PS-PPO / S-GRPO token budget B: expected backpropagated tokens per completion")
    groups: int = setting(1, "prompt groups in the batch")
    group_size: int = setting(4, "completions per prompt (K)")
    prompt_tokens: int = setting(64, "tokens of each (random) prompt")
    micro_batch_tokens: int = setting(2048, lambda: f"{key_help(TrainConfig, 'algo.micro_batch_tokens')}"
                                                    " (algo.micro_batch_tokens)")
    seed: int = setting(0, "seed of the synthetic batch; the cutoff draws use seed + repeat")
    threads: int | None = setting(None, "torch threads per measurement; None: torch's default")
    device: str = setting("auto", lambda: f"{key_help(TrainConfig, 'model.device')} (model.device)")
    autocast: str = setting("auto", lambda: f"{key_help(TrainConfig, 'model.autocast')} (model.autocast)")

    def xi_min(self, t_max: int) -> float:
        """The trainer's default floor 0.02, lowered so that it spends at most half the budget.

        The config requires xi_min x max_new_tokens <= B; at half the budget the cutoff law still
        has room to take its shape instead of sitting on the floor.
        """
        return min(0.02, self.budget / (2 * t_max))


def config_overrides(
    model_dir: str, method: str, t_max: int, settings: Settings, output_dir: str, repeat: int = 0
) -> dict[str, Any]:
    """The dotted TrainConfig overrides of one measurement; the trainer's seed (its cutoff draws)
    changes with the repeat, so that repeats average over draws as well as over machine noise."""
    return {
        "model.name": model_dir,
        "model.lora.rank": 0,  # the update of every weight: what PS-PPO's savings were measured on
        "model.device": settings.device,
        "model.autocast": settings.autocast,
        "task.size": settings.groups,  # the task is only needed by the constructor: keep it small
        "rollout.engine": "hf:fp32",
        "rollout.prompts_per_step": settings.groups,
        "rollout.group_size": settings.group_size,
        "rollout.max_new_tokens": t_max,
        "rollout.context_length": settings.prompt_tokens + t_max,
        "algo.correction": "none",
        "algo.ppo_epochs": 1,
        "algo.mini_batches": 1,
        "algo.micro_batch_tokens": settings.micro_batch_tokens,
        "algo.ps.budget": settings.budget,
        "algo.ps.xi_min": settings.xi_min(t_max),
        **METHODS[method],
        "seed": settings.seed + repeat,
        "output_dir": output_dir,
        "tensorboard": False,
        "eval.num_prompts": 0,
    }


def prepare_model(spec: str, layers: int, directory: str) -> dict[str, Any]:
    """Save model `spec` truncated to its first `layers` decoder layers (0: all) as an HF folder.

    Every measurement process then loads the same safetensors folder as `model.name`.
    """
    from deployrl.models.loading import load_model, load_tokenizer, resolve_model

    quiet_transformers()
    source = resolve_model(spec)
    model = load_model(source, "fp32")
    decoder = getattr(model, model.base_model_prefix)
    total = len(decoder.layers)
    if layers:
        if layers > total:
            raise ValueError(f"--layers {layers}: {spec} has only {total} decoder layers")
        decoder.layers = decoder.layers[:layers]
        model.config.num_hidden_layers = layers
        if getattr(model.config, "layer_types", None):  # per-layer attention kinds, where the config has them
            model.config.layer_types = model.config.layer_types[:layers]
    model.save_pretrained(directory)
    load_tokenizer(source).save_pretrained(directory)
    config = model.config
    return {
        "layers": config.num_hidden_layers, "of_layers": total, "vocab": config.vocab_size,
        "hidden": config.hidden_size, "parameters": sum(p.numel() for p in model.parameters()),
    }


def quiet_transformers() -> None:
    """No loading and saving progress bars: they would bury the benchmark's own output."""
    from transformers.utils import logging

    logging.disable_progress_bar()


def synthetic_rollouts(examples: list, vocab: int, t_max: int, settings: Settings):
    """A Rollouts of `groups` x K rows of random tokens, lengths uniform in [T_max/2, T_max].

    Seeded by (seed, T_max): every method gets the same batch at a given T_max. Rewards are
    0/1 with K//2 ones per group, so no group has zero variance; logp_inf is uniform in [-3, 0];
    the engine statistics are those of a random distribution per token over TOP_M random tokens
    and a tail.
    """
    from deployrl.engines.base import RolloutBatch
    from deployrl.training.rollout import Rollouts

    g, k = settings.groups, settings.group_size
    rows = g * k
    gen = torch.Generator().manual_seed(settings.seed * 100_003 + t_max)
    prompts = torch.randint(0, vocab, (g, settings.prompt_tokens), generator=gen)  # [G, P]
    lengths = torch.randint(t_max // 2, t_max + 1, (rows,), generator=gen)  # [B]
    mask = torch.arange(t_max)[None, :] < lengths[:, None]  # [B, T]
    completion_ids = torch.randint(0, vocab, (rows, t_max), generator=gen) * mask
    logp_inf = -3 * torch.rand(rows, t_max, generator=gen) * mask
    rewards = torch.stack([(torch.randperm(k, generator=gen) < k // 2).float() for _ in range(g)])  # [G, K]
    top = (2 * torch.randn(rows, t_max, TOP_M + 1, generator=gen)).log_softmax(dim=-1).sort(dim=-1, descending=True).values
    probs = top.exp()
    stats = {
        "entropy": torch.special.entr(probs).sum(dim=-1) * mask, "sum_p2": probs.square().sum(dim=-1) * mask,
        "top_ids": torch.randint(0, vocab, (rows, t_max, TOP_M), generator=gen) * mask[..., None],
        "top_logp": top[..., :TOP_M] * mask[..., None],
    }
    batch = RolloutBatch(
        prompt_ids=[prompts[row // k].tolist() for row in range(rows)],
        completion_ids=completion_ids,
        logp_inf=logp_inf,
        mask=mask,
        finish_reasons=["length" if n == t_max else "stop" for n in lengths.tolist()],
        semantics="processed",
        group_size=k,
        stats=stats,
    )
    return Rollouts(batch, examples[:g], rewards, [""] * rows, rewards)


def release_freed_memory() -> None:
    """Collect garbage and return freed heap pages to the OS (glibc), so the measured phase's
    RSS must grow for every byte it uses instead of silently reusing what set-up freed."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: RSS deltas may then undercount
        pass


def warm_up(trainer, rollouts) -> None:
    """Allocate AdamW's state and run the kernels once, outside the measurement.

    The optimizer step sees zero gradients: with weight decay 0 the update is exactly zero,
    so the weights do not change; only the state tensors (exp_avg, exp_avg_sq) come to exist.
    """
    from deployrl.models.loading import token_logprobs

    assert trainer.config.optim.weight_decay == 0, "a zero-gradient step must not move the weights"
    optimizer = trainer.learner.optimizer
    for p in trainer.model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    batch = rollouts.batch
    short = batch.mask[:1, :16]  # [1, 16]: a few tokens of the first row
    token_logprobs(trainer.model, batch.prompt_ids[:1], batch.completion_ids[:1, :16], short).logp.sum().backward()
    optimizer.zero_grad(set_to_none=True)


def measure_one(model_dir: str, method: str, t_max: int, settings: dict[str, Any], repeat: int = 0) -> dict[str, Any]:
    """Build a Trainer for `method`, time and measure one update phase on the synthetic batch."""
    from deployrl.engines.base import trainer_view
    from deployrl.settings.config import TrainConfig
    from deployrl.settings.parsing import build
    from deployrl.training.trainer import Trainer

    s = Settings(**settings)
    quiet_transformers()
    if s.threads:
        torch.set_num_threads(s.threads)
    with tempfile.TemporaryDirectory(prefix="deployrl-bench-") as output_dir:
        overrides = config_overrides(model_dir, method, t_max, s, output_dir, repeat)
        config = build(TrainConfig, nest(overrides), origin="deployrl bench update")
        trainer = Trainer(config)
        rollouts = synthetic_rollouts(trainer.task.examples, trainer.model.config.vocab_size, t_max, s)
        batch, learner = rollouts.batch, trainer.learner
        view = trainer_view(batch.semantics, config.rollout.sampling(seed=0))
        warm_up(trainer, rollouts)
        release_freed_memory()
        device = trainer.world.device
        with PeakMemory(device) as memory:  # Trainer.learn's learn phase, everything before the weight sync
            start = time.perf_counter()
            learned = learner.learn(rollouts, view)
            synchronize(device)
            end = time.perf_counter()
        trainer.logger.close()
    prompts = settings["prompt_tokens"] * settings["groups"]
    plan, update, seconds = learned.prepared.plan, learned.update, learned.seconds
    old_tokens = 0 if learned.prepared.old is None else int(learned.prepared.known.sum()) + prompts  # its extent
    return {
        "method": method, "t_max": t_max, "repeat": repeat, "seconds": end - start, "old_pass_s": seconds["old_pass"],
        "plan_s": seconds["plan"], "measure_s": seconds["measure"], "graded_s": seconds["update"] - update.optimizer_s,
        "optimizer_s": update.optimizer_s, "peak_bytes": memory.peak, "old_pass_tokens": old_tokens,
        "tokens_graded": update.tokens_graded, "tokens_expected": float(plan.expected_tokens),
        "tokens_total": float(batch.mask.sum()),
        "graded_pass_tokens": update.graded_pass_tokens, "micro_batches": update.micro_batches,
        "threads": torch.get_num_threads(), "xi_min": s.xi_min(t_max), "device": device_name(device),
    }


def summary_rows(results: list[dict[str, Any]], methods: list[str], t_maxes: list[int]) -> list[list[Any]]:
    """One row per (T_max, method): medians over repeats, ratios to the reference's medians."""

    def values(t_max: int, method: str, key: str) -> list[float]:
        return [r[key] for r in results if r["t_max"] == t_max and r["method"] == method]

    def med(t_max: int, method: str, key: str) -> float:
        return median(values(t_max, method, key))

    def model_tokens(t_max: int, method: str) -> float:
        return med(t_max, method, "old_pass_tokens") + med(t_max, method, "graded_pass_tokens")

    rows = []
    for t_max in t_maxes:
        ref_s, ref_mem = med(t_max, REFERENCE, "seconds"), med(t_max, REFERENCE, "peak_bytes")
        for method in methods:
            seconds, peak = med(t_max, method, "seconds"), med(t_max, method, "peak_bytes")
            mean_s, ref_mean = (float(np.mean(values(t_max, m, "seconds"))) for m in (method, REFERENCE))
            ideal = model_tokens(t_max, REFERENCE) / max(model_tokens(t_max, method), 1)
            rows.append([
                t_max, method, seconds, ref_s / seconds, mean_s, ref_mean / mean_s, ideal,
                peak / 2**20, peak / ref_mem if ref_mem else float("nan"),
                int(med(t_max, method, "tokens_graded")), round(med(t_max, method, "tokens_expected")),
                int(med(t_max, method, "tokens_total")),
                int(med(t_max, method, "graded_pass_tokens")), int(med(t_max, method, "micro_batches")),
                med(t_max, method, "old_pass_s"), med(t_max, method, "plan_s"), med(t_max, method, "graded_s"),
                med(t_max, method, "optimizer_s"),
            ])
    return rows


def draw_notes(results: list[dict[str, Any]], methods: list[str], t_maxes: list[int]) -> list[str]:
    """Where the median draw backpropagated far from the expected tokens (by over a quarter), its
    time says more about that draw than about the method: a flat cutoff law keeps whole
    completions or nothing, and with few rows the draws barely average out."""
    notes = []
    for t_max in t_maxes:
        for method in methods:
            mine = [r for r in results if r["t_max"] == t_max and r["method"] == method]
            kept, expected = median([r["tokens_graded"] for r in mine]), median([r["tokens_expected"] for r in mine])
            if abs(kept - expected) > 0.25 * expected:
                notes.append(
                    f"note: {method} at T_max {t_max} backpropagated {kept:.0f} tokens in the median draw against"
                    f" {expected:.0f} expected; raise --repeats or --groups for its average cost"
                )
    return notes


HEADERS = [
    "T_max", "method", "update s", "speed-up vs grpo", "mean s", "mean speed-up", "ideal", "peak MB", "memory vs grpo",
    "tokens backprop",
    "expected backprop", "tokens total", "graded-pass tokens", "micro-batches", "no-grad pass s", "plan s", "graded s",
    "optimizer s",
]


@dataclass(frozen=True)
class UpdateBenchConfig(Settings):
    """`deployrl bench update`: the shared Settings, plus which measurements and how."""

    model: str = setting("smollm2-135m", "model spec (alias, HF directory or .gguf file)")
    layers: int = setting(4, "keep the first N decoder layers (0: all)")
    t_max: tuple[int, ...] = setting(T_MAX, "longest completion lengths")
    methods: tuple[str, ...] = setting(DEFAULT_METHODS, f"methods to measure, from: {', '.join(METHODS)} (ratios need"
                                                       f" {REFERENCE})")
    repeats: int = setting(3, "measurements per (method, T_max); medians are shown")
    json: Optional[str] = setting(None, "write settings and every raw measurement here")
    same_process: bool = setting(False, "measure in this process instead of a fresh one each time: quicker, but one"
                                        " measurement's freed memory can hide the next one's peak (for smoke tests)")

    def __post_init__(self) -> None:
        check_non_negative("layers", self.layers)
        check_positive("repeats", self.repeats)
        if self.threads is not None:
            check_positive("threads", self.threads)
        if not self.t_max or min(self.t_max) < 2:
            raise ValueError(f"t_max must list lengths >= 2, got {list(self.t_max)}")
        for method in self.methods:
            if method not in METHODS:
                raise unknown_name_error("method", method, list(METHODS))
        for t_max in self.t_max:  # every measurement's TrainConfig is checked now, not in its own process
            for method in self.methods:
                overrides = config_overrides("model", method, t_max, self, "output")
                build(TrainConfig, nest(overrides), origin=f"{method} at T_max {t_max}")

    @property
    def settings(self) -> Settings:
        return Settings(**{f.name: getattr(self, f.name) for f in fields(Settings)})


FLAGS = (
    Flag("--model", "model"),
    Flag("--layers", "layers"),
    Flag("--t-max", "t_max", many=True),
    Flag("--methods", "methods", many=True),
    Flag("--budget", "budget"),
    Flag("--groups", "groups"),
    Flag("--group-size", "group_size"),
    Flag("--prompt-tokens", "prompt_tokens"),
    Flag("--micro-batch-tokens", "micro_batch_tokens"),
    Flag("--repeats", "repeats"),
    Flag("--threads", "threads"),
    Flag("--device", "device"),
    Flag("--autocast", "autocast"),
    Flag("--seed", "seed"),
    Flag("--json", "json"),
    Flag("--same-process", "same_process", const=True),
)


def main(argv: list[str] | None = None) -> int:
    config, _ = CommandLine(
        "deployrl bench update", UpdateBenchConfig,
        "Update-phase wall time, peak memory and backpropagated tokens of full GRPO, DAPO, S-GRPO and"
        " PS-PPO (each cutoff strategy) on one synthetic rollout batch per T_max, through the trainer's"
        " own prepare / update (one PPO epoch, one optimizer step), the PS-PPO laws with the trainer's proxies and"
        " (:engine) with the engine's, no trainer pass past a cutoff,"
        " DC off for all. Each measurement runs in a fresh process; the table shows medians over"
        " repeats and ratios to full GRPO (speed-up = grpo seconds / method seconds; memory = method"
        " peak / grpo peak), on the trainer's device (--device).",
        FLAGS,
    ).parse(argv)
    settings = config.settings

    def call(function: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        if config.same_process:
            return globals()[function](**kwargs)
        return in_fresh_process(f"{__name__}:{function}", kwargs)

    with tempfile.TemporaryDirectory(prefix="deployrl-bench-model-") as model_dir:
        model = call("prepare_model", {"spec": config.model, "layers": config.layers, "directory": model_dir})
        device = Device.get("device", config.device).resolve()
        print(
            f"hardware: {this_cpu().describe()}, {config.threads or torch.get_num_threads()} torch threads, torch {torch.__version__},"
            f" trainer on {device_name(device)}"
        )
        print(
            f"model: {config.model}, {model['layers']} of {model['of_layers']} decoder layers, vocab {model['vocab']},"
            f" hidden {model['hidden']}, {model['parameters'] / 1e6:.3g}M parameters, fp32,"
            f" autocast {config.autocast}"
        )
        print(
            f"batch: {settings.groups} group(s) x K={settings.group_size}, prompt {settings.prompt_tokens} tokens,"
            f" completion lengths uniform in [T_max/2, T_max], batch seed {settings.seed},"
            f" cutoff draws seeded {settings.seed} + repeat"
        )
        print(
            f"update: 1 PPO epoch, 1 mini-batch, micro_batch_tokens={settings.micro_batch_tokens}, correction none"
            f" (DC off), budget B={settings.budget:g}, xi_min=min(0.02, B/(2 T_max)), {config.repeats} repeat(s),"
            f" {'one process' if config.same_process else 'a fresh process per measurement'}"
        )
        for method in config.methods:
            print(f"  {method}: " + " ".join(f"{k}={v}" for k, v in METHODS[method].items()))
        results = []
        total = config.repeats * len(config.t_max) * len(config.methods)
        for repeat in range(config.repeats):  # interleaved, so slow spells of the machine hit every method
            for t_max in config.t_max:
                for method in config.methods:
                    result = call("measure_one", {
                        "model_dir": model_dir, "method": method, "t_max": t_max, "settings": asdict(settings),
                        "repeat": repeat,
                    })
                    results.append(result)
                    print(
                        f"[{len(results)}/{total}] repeat {repeat + 1}, T_max {t_max}, {method}:"
                        f" {result['seconds']:.3g} s, {result['peak_bytes'] / 2**20:.0f} MB",
                        file=sys.stderr,
                    )
    print()
    print(table(HEADERS, summary_rows(results, config.methods, config.t_max)))
    print(
        "\nspeed-up: grpo median seconds / method median seconds; mean speed-up: the same with means over repeats (a flat"
        " law keeps whole completions or nothing, so its median draw can be free: the mean over draws is its cost);"
        " memory: method median peak / grpo median peak;"
        " tokens backprop: completion tokens in the loss (median draw); expected backprop: their expectation, sum of xi;"
        " graded-pass tokens: prefix tokens + each group's prompt once per micro-batch, fed to the graded forward and backward;"
        " ideal: the speed-up if time were proportional to the tokens through the model (no-grad pass + graded pass);"
        " no-grad pass s: over every token (ps:<law>, grpo, dapo, sgrpo), over the prefixes up to each cutoff"
        " (:engine with several epochs), none (:engine, one epoch: fused into the graded pass)."
    )
    for note in draw_notes(results, config.methods, config.t_max):
        print(note)
    if config.json is not None:
        Path(config.json).write_text(json.dumps({
            "settings": asdict(settings), "model": {**model, "spec": config.model}, "methods": config.methods,
            "t_max": config.t_max, "repeats": config.repeats, "torch": torch.__version__, "cpu": this_cpu().describe(),
            "measurements": results,
        }, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
