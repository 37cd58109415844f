"""`deployrl bench variance`: how good is each cutoff law's gradient at an equal token budget?

On real rollouts of the run's model and engine (any `deployrl train` config plus overrides), for
each cutoff strategy and budget B it reports

* the relative variance E||G_hat - G||^2 / ||G||^2 of the prefix-sampled gradient G_hat around
  the full-trajectory gradient G, exactly (closed form below) and by Monte Carlo over the
  trainer's own cutoff draws;
* the mean cosine similarity cos(G_hat, G) over those draws;
* the tokens kept per completion.

The heuristic and optimized laws are solved from the trainer's proxies (a no-grad pass over
every token) and, as ``heuristic:engine`` and ``optimized:engine``, from the statistics the
rollout engine reported while sampling (`algo.ps.proxies=engine`): its entropy, sum p^2 and top m
tokens per sampled distribution, gamma without ||h||. The optimized one is measured at each m of
`--top-m` (one sampling at the largest m; a smaller m keeps the first m of each top list).

The gradient is that of the trainer's loss at the sampling policy with respect to the output
head W [V, D], through the head (for tied embeddings the input-embedding path is left out). Its
per-token pieces are g_t = a_t (e_{o_t} - p_t) h_t^T with a_t = d loss / d logp_t, so every
inner product g_s . g_t is known without forming a [V, D] matrix per token:

    g_s . g_t = a_s a_t (h_s . h_t) ([o_s = o_t] - p_s(o_t) - p_t(o_s) + p_s . p_t).

With those N x N inner products K, a draw with unbiasing weights c [N] (0 where dropped) has
G_hat - G = sum_t (c_t - 1) g_t, so ||G_hat - G||^2 = (c - 1)^T K (c - 1) and
cos = c^T K 1 / sqrt(c^T K c * 1^T K 1). For a prefix law (one U per completion, token t kept
iff U <= xi_t, xi non-increasing) E[(c_s - 1)(c_t - 1)] = 1 / max(xi_s, xi_t) - 1 for two
tokens of one completion and 0 across completions; for S-GRPO's independent tokens it is
(1 / xi_t - 1) on the diagonal only.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from deployrl.algo._checks import check_positive
from deployrl.algo.logprobs import SamplingView, processed_logits
from deployrl.algo.losses import batch_denominator
from deployrl.algo.prefix import STRATEGIES, cutoff_law, engine_proxies, law_weights, sample_plan
from deployrl.commands.bench.measure import table
from deployrl.cpu import this_cpu
from deployrl.registry import unknown_name_error
from deployrl.settings.command_line import CommandLine, Flag
from deployrl.settings.docs import setting
from deployrl.settings.parsing import ConfigError, split_config_items

BUDGETS = (32, 64, 128, 256)
SAMPLED = ("uniform", "temporal", "heuristic", "optimized", "sgrpo", "heuristic:engine", "optimized:engine")
TOP_M = (4, 16, 64)
# Without a config file: the embedded default's one-digit arithmetic, worked step by step (long
# completions, and a reward SmolLM2-135M earns often enough for groups to disagree; two-digit
# terms scored 0 of 32 in a round we tried), no mismatch correction.
TASK_DEFAULTS = (
    "task.instruction=Solve it step by step and end with the final number.",
    "rollout.max_new_tokens=256",
    "algo.correction=none",
    "algo.ps.xi_min=0.01",
)
# Always: groups with equal rewards carry no gradient; no logging or evaluation.
BENCH_SETTINGS = ("algo.dynamic_sampling=drop", "tensorboard=false", "eval.num_prompts=0", "model.lora.rank=0")


def head_gradient_gram(
    hidden: torch.Tensor, head: torch.Tensor, tokens: torch.Tensor, coef: torch.Tensor,
    view: SamplingView, chunk: int = 512,
) -> torch.Tensor:
    """K [N, N] float64: inner products of the per-token output-head gradients g_t.

    hidden [N, D] the states that predict tokens [N] (long) through head [V, D]; coef [N] = a_t.
    Probabilities are recomputed per chunk of `chunk` tokens, so no [N, V] tensor is held.
    """
    n = hidden.shape[0]
    starts = list(range(0, n, chunk))

    def probs(start: int) -> torch.Tensor:  # [c, V]
        return processed_logits(hidden[start:start + chunk] @ head.T, view).softmax(dim=-1)

    overlap = torch.empty(n, n, dtype=torch.float64)  # (e_s - p_s) . (e_t - p_t)
    for i in starts:
        p_i = probs(i)
        rows = slice(i, i + chunk)
        for j in starts:
            p_j = p_i if j == i else probs(j)
            cols = slice(j, j + chunk)
            block = (p_i @ p_j.T).double()
            block -= p_i[:, tokens[cols]].double()  # p_s(o_t)
            block -= p_j[:, tokens[rows]].double().T  # p_t(o_s)
            block += (tokens[rows, None] == tokens[None, cols]).double()
            overlap[rows, cols] = block
    states = hidden.double()
    a = coef.double()
    return overlap * (states @ states.T) * (a[:, None] * a[None, :])


def exact_variance(gram: torch.Tensor, xi: torch.Tensor, row: torch.Tensor, independent: bool) -> float:
    """E||G_hat - G||^2 for inclusion probabilities xi [N] of tokens in completions row [N]."""
    xi = xi.double()
    if independent:
        return float(((1 / xi - 1) * gram.diagonal()).sum())
    same = row[:, None] == row[None, :]
    cov = torch.where(same, 1 / torch.maximum(xi[:, None], xi[None, :]) - 1, torch.zeros((), dtype=torch.float64))
    return float((cov * gram).sum())


def draw_errors(gram: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(||G_hat - G||^2 [R], cos(G_hat, G) [R]) for R draws of unbiasing weights [R, N]."""
    c = weights.double()
    full = gram.sum(dim=1)  # K 1
    err = c - 1
    sq_error = ((err @ gram) * err).sum(dim=1)
    norm_hat = ((c @ gram) * c).sum(dim=1).clamp(min=0).sqrt()
    cosine = (c @ full) / (norm_hat * full.sum().sqrt()).clamp(min=1e-300)
    return sq_error, cosine


def loss_coefficients(trainer, rollouts, old) -> torch.Tensor:
    """a [B, T] = d loss / d logp_t at the sampling policy, for the trainer's own loss."""
    learner, mask = trainer.learner, rollouts.batch.mask
    advantages, weights = learner.correction.token_terms(
        learner.group_advantages(rollouts), old.logp, rollouts.batch.logp_inf, mask.bool())
    logp = old.logp.clone().requires_grad_(True)
    out = learner.loss(logp, old.logp, advantages, mask, weights,
                       denominator=batch_denominator(trainer.config.algo.aggregation, mask))
    (grad,) = torch.autograd.grad(out.loss, logp)
    return grad


def collect_groups(trainer, groups: int, max_rounds: int):
    """Sample steps until `groups` prompt groups with unequal rewards are gathered."""
    from deployrl.training.rollout import Rollouts

    parts = []
    for round_ in range(max_rounds):
        parts.append(trainer.rollout.collect(trainer.stream, step=round_))  # new prompts and seeds each round
        kept = sum(len(p.examples) for p in parts)
        print(f"sampling round {round_ + 1}: mean reward {float(parts[-1].sampled_rewards.mean()):.2f},"
              f" {kept} of {groups} groups with unequal rewards", file=sys.stderr, flush=True)
        if kept >= groups:
            break
    parts = [p for p in parts if p.examples]
    if not parts:
        raise SystemExit(f"no prompt group with unequal rewards in {max_rounds} rounds: the gradient is zero")
    return Rollouts.cat(parts)


def law_inputs(strategies, top_m, rollouts, old, metric: str) -> list[tuple[str, str, dict]]:
    """(row name, strategy, proxies) of each law measured: trainer proxies for a plain strategy,
    the engine's (at each m of `top_m`, for optimized) for one marked ``:engine``."""
    batch, success = rollouts.batch, rollouts.successes()
    laws = []
    for name in strategies:
        strategy, _, source = name.partition(":")
        if not source:
            laws.append((name, strategy, old.proxies()))
            continue
        sweep = STRATEGIES.get(strategy).uses_uncertainty  # u is made of the top m tokens
        for m in top_m if sweep else top_m[-1:]:
            stats = batch.stats | {key: batch.stats[key][..., :m] for key in ("top_ids", "top_logp")}
            label = f"{name} m={m}" if sweep else name
            laws.append((label, strategy, engine_proxies(batch.logp_inf, stats, batch.mask, success, metric)))
    return laws


def measure(trainer, budgets, strategies, draws: int, groups: int, max_rounds: int, seed: int,
            top_m: tuple[int, ...] = TOP_M) -> dict:
    """All the benchmark's numbers for one trainer (model, engine, task)."""
    from deployrl.engines.base import trainer_view
    from deployrl.models.loading import completion_hidden, output_head

    cfg = trainer.config
    trainer.rollout.top_m = max(top_m)  # the engine reports its statistics for the :engine laws
    rollouts = collect_groups(trainer, groups, max_rounds)
    batch = rollouts.batch
    view = trainer_view(batch.semantics, cfg.rollout.sampling(seed=0))
    learner, k = trainer.learner, batch.group_size
    old = learner.passes.old_pass(rollouts, view, proxies=("entropy", "grad_norm", "uncertainty"))
    coef = loss_coefficients(trainer, rollouts, old)
    real = batch.mask.bool()
    row = torch.arange(real.shape[0])[:, None].expand_as(real)[real]
    with torch.no_grad():
        hidden = completion_hidden(trainer.model, batch.prompt_ids, batch.completion_ids, batch.mask)
        gram = head_gradient_gram(
            hidden[real], output_head(trainer.model).detach(), batch.completion_ids[real], coef[real],
            view,
        )
    full_sq = float(gram.sum())
    lengths = batch.mask.sum(dim=1).float()
    generator = torch.Generator().manual_seed(seed)
    results = []
    laws = law_inputs(strategies, top_m, rollouts, old, cfg.algo.ps.uncertainty)
    for budget in budgets:
        for name, strategy, proxies in laws:
            xi_groups = cutoff_law(strategy, batch.mask, k, float(budget), cfg.algo.ps.xi_min,
                                   law_weights(strategy, proxies, k))
            xi = xi_groups.repeat_interleave(k, dim=0)[real]
            independent = STRATEGIES.get(strategy).independent_tokens
            plans = [sample_plan(strategy, xi_groups, batch.mask, generator) for _ in range(draws)]
            sq_error, cosine = draw_errors(gram, torch.stack([p.weights[real] for p in plans]))
            kept = torch.stack([p.keep.sum(dim=1).float() for p in plans]).mean()  # per completion
            results.append({
                "budget": budget, "strategy": name,
                "rel_variance": exact_variance(gram, xi, row, independent) / full_sq,
                "rel_variance_mc": float(sq_error.mean()) / full_sq,
                "rel_variance_mc_se": float(sq_error.std() / math.sqrt(draws)) / full_sq,
                "cosine": float(cosine.mean()),
                "kept_per_completion": float(kept),
            })
    return {
        "completions": int(real.shape[0]), "groups": len(rollouts.examples), "tokens": int(real.sum()),
        "mean_length": float(lengths.mean()), "max_length": int(lengths.max()),
        "reward_mean": float(rollouts.rewards.mean()), "draws": draws, "results": results,
    }


def report(numbers: dict, budgets) -> str:
    by = {(r["budget"], r["strategy"]): r for r in numbers["results"]}
    strategies = list(dict.fromkeys(r["strategy"] for r in numbers["results"]))
    headers = ["strategy"] + [f"B={b}" for b in budgets]
    variance = [["full"] + [0.0] * len(budgets)] + [
        [s] + [f"{by[b, s]['rel_variance']:.3f} ({by[b, s]['rel_variance_mc']:.3f}±{by[b, s]['rel_variance_mc_se']:.3f})"
               for b in budgets] for s in strategies
    ]
    cosine = [["full"] + [1.0] * len(budgets)] + [[s] + [by[b, s]["cosine"] for b in budgets] for s in strategies]
    kept = [["full"] + [numbers["mean_length"]] * len(budgets)] + [
        [s] + [by[b, s]["kept_per_completion"] for b in budgets] for s in strategies
    ]
    return "\n\n".join([
        "Relative variance E||G_hat - G||^2 / ||G||^2, exact (Monte Carlo ± s.e.):\n" + table(headers, variance),
        "Mean cosine similarity to the full-trajectory gradient:\n" + table(headers, cosine),
        "Tokens kept per completion (mean over draws):\n" + table(headers, kept),
    ])


@dataclass(frozen=True)
class VarianceBenchConfig:
    """The benchmark's own settings; the run's are a `deployrl train` config and overrides."""

    budgets: tuple[int, ...] = setting(BUDGETS, "token budgets B per completion")
    strategies: tuple[str, ...] = setting(SAMPLED, f"cutoff strategies, from: {', '.join(SAMPLED)}")
    groups: int = setting(4, "prompt groups with unequal rewards to gather")
    max_rounds: int = setting(8, "sampling steps at most to gather them")
    draws: int = setting(512, "cutoff draws per strategy and budget")
    top_m: tuple[int, ...] = setting(TOP_M, "m of the :engine laws' top-m distributions (optimized:engine gets one"
                                            " row per m)")
    seed: int = setting(0, "seed of the cutoff draws")
    json: Optional[str] = setting(None, "also write every number as JSON to this path")

    def __post_init__(self) -> None:
        for budget in self.budgets:
            check_positive("budgets", budget)
        for strategy in self.strategies:
            if strategy not in SAMPLED:
                raise unknown_name_error("sampled cutoff strategy", strategy, list(SAMPLED))
        for name in ("groups", "max_rounds", "draws"):
            check_positive(name, getattr(self, name))
        if not self.top_m:
            raise ValueError("top_m must list at least one m")
        for m in self.top_m:
            check_positive("top_m", m)


FLAGS = (
    Flag("--budgets", "budgets", many=True),
    Flag("--strategies", "strategies", many=True),
    Flag("--groups", "groups"),
    Flag("--max-rounds", "max_rounds"),
    Flag("--draws", "draws"),
    Flag("--top-m", "top_m", many=True),
    Flag("--seed", "seed"),
    Flag("--json", "json"),
)


def main(argv: list[str] | None = None) -> int:
    command_line = CommandLine(
        "deployrl bench variance", VarianceBenchConfig,
        "Gradient variance and cosine similarity to the full-trajectory gradient of each cutoff law"
        " (uniform, temporal, heuristic, optimized, S-GRPO; heuristic and optimized also from the engine's"
        " proxies) at equal token budgets, on real rollouts of"
        " a run's model and engine. The gradient is the loss's gradient with respect to the output-head"
        " matrix, computed exactly from per-token inner products (see the module docstring).",
        FLAGS, train_items=(
            "[config.yaml] [key=value ...]", "a `deployrl train` config and overrides (default: the embedded model and"
            " engine on one-digit arithmetic worked step by step, up to 256 tokens)",
        ),
    )
    bench, args = command_line.parse(argv)

    from deployrl.settings.config import load_config
    from deployrl.training.trainer import Trainer

    with tempfile.TemporaryDirectory() as run_dir:
        try:
            path, overrides = split_config_items(args.items)
            defaults = [*BENCH_SETTINGS, *(() if path else TASK_DEFAULTS)]  # a config file keeps its own task
            config = load_config(path, [*defaults, f"output_dir={run_dir}", *overrides])
        except ConfigError as err:
            command_line.fail(err)
        trainer = Trainer(config)
        numbers = measure(trainer, bench.budgets, bench.strategies, bench.draws, bench.groups, bench.max_rounds,
                          bench.seed, tuple(sorted(bench.top_m)))
        task_name = trainer.task.name
        trainer.logger.close()
    print(
        f"{config.model.name} sampled by {config.rollout.engine}, task {task_name}:"
        f" {numbers['groups']} groups x {config.rollout.group_size} completions, {numbers['tokens']} tokens"
        f" (mean length {numbers['mean_length']:.0f}, max {numbers['max_length']}), mean reward"
        f" {numbers['reward_mean']:.2f}; {bench.draws} draws per cell; {this_cpu().describe()},"
        f" torch {torch.__version__}\n"
    )
    print(report(numbers, bench.budgets))
    if bench.json:
        Path(bench.json).write_text(json.dumps({"config": path and str(path), "overrides": overrides, **numbers}, indent=2))
    return 0
