"""The learner: everything the trainer's model computes from a step's rollouts.

    learn       one step's learn phase: the PS-PPO order prepares (cutoff plan and no-grad pass),
                the correction measures the discrepancy, the update, the discrepancy again if the
                update computed logp_old itself
    old_pass    no-grad pass: logp_old, logp_ref and the cutoff law's proxies over the full
                completions, or logp_old and logp_ref over each row's prefix up to its cutoff
    plan        the PS-PPO cutoff plan: which prefix of each completion is backpropagated
    update      PPO epochs over mini-batches; the graded pass sees each row's kept prefix only;
                each micro-batch's advantages and weights come from the mismatch correction

The order (`algo.ps.proxies`, ps_orders.py) decides how far the no-grad pass runs: over every
token (``trainer``), over each row's prefix, or not at all (``engine``; logp_old is then the
graded pass's own log-probs, detached). The correction (algo/corrections.py) owns the tolerance
and lambda; the learner holds both for the run, and a checkpoint keeps the correction's state.

Choices: the cutoff plan is drawn once per step and reused by every PPO epoch and mini-batch;
the graded pass feeds each row only up to its cutoff, and the positions past it keep
logp = logp_old (ratio 1) with weight 0, so every loss keeps full-length [B, T] tensors and its
denominator counts all real tokens (the unbiasedness condition of PS-PPO).

Rows go through the model in micro-batches of `algo.micro_batch_tokens` (`micro_batches`), one
runner for both passes (`Learner.micro_batch_plans`, `Learner.run_micro_batches`). Under torchrun
the model is sharded with FSDP2; each rank computes a share of the rows and every rank makes the
same number of model calls (`rank_schedule`), since each call is a collective.
"""

from __future__ import annotations

import copy
import functools
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, TypeVar

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from deployrl.algo.advantages import broadcast_to_tokens, compute_advantages
from deployrl.algo.corrections import CORRECTIONS, Correction, Measured
from deployrl.algo.losses import LossOutputs, batch_denominator, policy_loss
from deployrl.algo.prefix import (
    PrefixPlan, cutoff_law, engine_proxies, grad_norm_proxy, group_stats, law_weights, sample_plan,
)
from deployrl.algo.logprobs import SamplingView
from deployrl.config import OptimConfig, TrainConfig
from deployrl.distributed import World, all_reduce_sum, all_reduce_tensor, balanced_shares, gather_in_order, shard
from deployrl.models import DTYPES, Scorer, decoder_blocks, has_dropout, shares_prompts, token_logprobs
from deployrl.ps_orders import PS_ORDERS, Prepared
from deployrl.rollout import Rollouts

T = TypeVar("T")


@dataclass
class OldPass:
    """The trainer's no-grad pass over the full completions; the proxies it was asked for."""

    logp: torch.Tensor  # [B, T] logp_old
    logp_ref: Optional[torch.Tensor]  # [B, T] reference policy, when the KL term is on
    entropy: Optional[torch.Tensor] = None  # [B, T]
    grad_norm: Optional[torch.Tensor] = None  # [B, T] gamma
    uncertainty: Optional[torch.Tensor] = None  # [G, T] reward uncertainty u

    def proxies(self) -> dict[str, torch.Tensor]:
        """The cutoff-law proxies by name (algo.prefix.CutoffStrategy.proxies), those computed."""
        named = {"entropy": self.entropy, "grad_norm": self.grad_norm, "uncertainty": self.uncertainty}
        return {name: value for name, value in named.items() if value is not None}


@dataclass
class SkippedUpdate:
    """An optimizer update left out because its loss or gradient norm was not finite."""

    rows: list[int]  # the rows of the offending micro-batches (all of the mini-batch if none is)
    loss: float
    grad_norm: float


@dataclass
class UpdateResult:
    """What the update did; means over the optimizer updates (losses) and micro-batches."""

    loss: float
    grad_norm: float
    clip_fraction: float
    approx_kl_old: float  # k3 estimate of KL(pi_old || pi) on the graded tokens
    ratio_mean: float
    kl_ref: Optional[float]  # k-estimate of KL(pi || pi_ref), when the KL term is on
    tokens_graded: float  # kept tokens backpropagated, per epoch
    graded_pass_tokens: float  # prompts (once per group and call) + kept tokens, per epoch
    micro_batches: float  # model calls of the graded pass, per epoch
    applied: int  # optimizer updates applied
    optimizer_s: float  # seconds in gradient clipping and optimizer steps, all epochs
    logp_old: torch.Tensor  # [B, T] the logp_old the loss used: given, or the graded pass's (0 past each cutoff)
    skipped: list[SkippedUpdate] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        metrics = {
            "loss": self.loss, "grad_norm": self.grad_norm, "clip_fraction": self.clip_fraction,
            "approx_kl_old": self.approx_kl_old, "ratio_mean": self.ratio_mean,
            "ps/tokens_graded": self.tokens_graded, "ps/graded_pass_tokens": self.graded_pass_tokens,
            "ps/micro_batches": self.micro_batches,
            "optim/updates": float(self.applied), "optim/skipped_updates": float(len(self.skipped)),
            "time/optimizer": self.optimizer_s,
        }
        if self.kl_ref is not None:
            metrics["kl_ref"] = self.kl_ref
        return metrics


def micro_batches(
    rows: list[int], prompt_tokens: list[int], completion_tokens: list[int], token_budget: int,
    groups: Optional[list[int]] = None,
) -> list[list[int]]:
    """`rows` packed greedily into micro-batches of at most `token_budget` tokens (a row alone may exceed it).

    A micro-batch costs its rows' completion tokens plus, once per group it holds, the group's
    prompt tokens: the rows of a group share their prompt (models.completion_hidden). With
    `groups=None` every row is its own group. Groups go in order of their longest row and rows by
    length within a group, so that a micro-batch holds whole groups of similar lengths.
    """
    group = groups if groups is not None else list(range(len(completion_tokens)))
    longest: dict[int, int] = {}
    for row in rows:
        longest[group[row]] = max(longest.get(group[row], 0), completion_tokens[row])
    batches, current, held, used = [], [], set(), 0
    for row in sorted(rows, key=lambda r: (longest[group[r]], group[r], completion_tokens[r])):
        cost = completion_tokens[row] + (0 if group[row] in held else prompt_tokens[row])
        if current and used + cost > token_budget:
            batches.append(current)
            current, held, used = [], set(), 0
            cost = completion_tokens[row] + prompt_tokens[row]
        current.append(row)
        held.add(group[row])
        used += cost
    if current:
        batches.append(current)
    return batches


def rank_schedule(plans: list[list[T]], rank: int) -> Iterator[Optional[T]]:
    """Rank `rank`'s micro-batches `plans[rank]`, then None until the rank with the most is done:
    at a None the rank makes a filler call, so that every rank makes as many (FSDP collectives)."""
    mine = plans[rank]
    for call in range(max(len(plan) for plan in plans)):
        yield mine[call] if call < len(mine) else None


def lr_lambda(cfg: OptimConfig, total_steps: int):
    """Warmup then constant or cosine decay, as a LambdaLR multiplier of the step."""

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        if not cfg.decays:
            return 1.0
        progress_ = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress_, 1.0)))

    return factor


def _mean(values: list[float]) -> float:
    return float(np.mean(values)) if values else 0.0


@dataclass
class Tally:
    """What an update did so far: per optimizer update, per micro-batch, and the work done."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)  # of the applied updates
    skipped: list[SkippedUpdate] = field(default_factory=list)
    diagnostics: dict[str, list[torch.Tensor]] = field(default_factory=lambda: defaultdict(list))  # [] each
    work: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("graded", "fed", "calls"), 0))
    optimizer_s: float = 0.0


@dataclass
class Learned:
    """One step's learn phase, before the weight sync."""

    prepared: Prepared
    measured: Measured
    update: UpdateResult
    seconds: dict[str, float]  # old_pass, plan, measure, update


class Learner:
    """The trainer's model with its reference copy (KL term), optimizer, scheduler, the generator of
    the cutoff draws, the mismatch correction and the PS-PPO order; sharded over the ranks of `world`
    when distributed."""

    def __init__(self, config: TrainConfig, model: nn.Module, world: World) -> None:
        self.config, self.model, self.world = config, model, world
        algo, optim = config.algo, config.optim
        ref_model = copy.deepcopy(model).eval().requires_grad_(False) if algo.kl_coef > 0 else None
        # every use of the weights goes through these calls (what FSDP needs)
        self.scorer = Scorer(model)
        self.ref_scorer = Scorer(ref_model) if ref_model is not None else None
        if world.distributed:
            for scorer in filter(None, (self.scorer, self.ref_scorer)):
                shard(scorer, decoder_blocks(scorer.model), world, DTYPES[config.model.dtype])
        trainable = [p for p in model.parameters() if p.requires_grad]  # with LoRA, the adapters only
        # fused: one kernel per step and no temporaries (on CPU, the 4-layer SmolLM2 shape's step took
        # 0.03 s against the per-tensor loop's 0.13 s: docs/results.md §1)
        self.optimizer = torch.optim.AdamW(
            trainable, lr=optim.lr, betas=(optim.beta1, optim.beta2), weight_decay=optim.weight_decay, fused=True
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(optim, config.steps))
        self.generator = torch.Generator().manual_seed(config.seed)
        self.dropout = has_dropout(model)
        self.correction: Correction = CORRECTIONS.get(algo.correction)(algo.correction_cap, algo.dc)
        self.order = PS_ORDERS.get(algo.ps.proxies)
        # the loss of the paper with this run's settings, bound once
        self.loss: Callable[..., LossOutputs] = functools.partial(
            policy_loss, eps_low=algo.eps_low, eps_high=algo.eps_high, dual_clip=algo.dual_clip,
            aggregation=algo.aggregation, max_length=config.rollout.max_new_tokens, kl_coef=algo.kl_coef,
            kl_estimator=algo.kl_estimator,
        )

    def learn(self, rollouts: Rollouts, view: SamplingView) -> Learned:
        """A step's learn phase up to the weight sync: prepare (order), measure, update, measure; with
        the seconds of each (old_pass, plan, measure, update)."""
        prepared = self.order.prepare(self, rollouts, view, self.correction)
        seconds, start = dict(prepared.seconds), time.perf_counter()
        measured = self._measure(rollouts, prepared, prepared.old.logp) if prepared.old is not None else None
        middle = time.perf_counter()
        update = self.update(rollouts, prepared.plan, view, prepared.old, prepared.known)
        end = time.perf_counter()
        if measured is None:  # a fused update: its own logp_old
            measured = self._measure(rollouts, prepared, update.logp_old)
        seconds |= {"measure": middle - start + time.perf_counter() - end, "update": end - middle}
        return Learned(prepared, measured, update, seconds)

    def _measure(self, rollouts: Rollouts, prepared: Prepared, logp_old: torch.Tensor) -> Measured:
        """The batch's discrepancy as the order measures it, handed to the correction."""
        measured = self.order.measure(rollouts, prepared, logp_old, self.config.algo.dc.signal)
        self.correction.measure(measured)
        return measured

    def micro_batch_plans(
        self, units: list[int], prompt_tokens: list[int], completion_tokens: list[int], groups: Optional[list[int]],
    ) -> list[list[list[int]]]:
        """Every rank's micro-batches of `units` (rows or groups, indexing the token lists): shares
        balanced by tokens, each packed by `micro_batches`."""
        costs = [prompt_tokens[u] + completion_tokens[u] for u in units]
        return [micro_batches([units[i] for i in share], prompt_tokens, completion_tokens,
                              self.config.algo.micro_batch_tokens, groups)
                for share in balanced_shares(costs, self.world.size)]

    def run_micro_batches(self, plans: list[list[list[int]]], call: Callable[[list[int]], None],
                          backward: bool = False) -> None:
        """`call` on each of this rank's micro-batches; a filler call of each scorer in use where
        another rank has more (FSDP's collectives pair up across ranks)."""
        scorers = [self.scorer] if backward else list(filter(None, (self.scorer, self.ref_scorer)))
        for micro in rank_schedule(plans, self.world.rank):
            if micro is not None:
                call(micro)
                continue
            for scorer in scorers:
                self._filler_call(scorer, backward)

    @torch.no_grad()
    def old_pass(
        self, rollouts: Rollouts, view: SamplingView, proxies: Optional[tuple[str, ...]] = None,
        cutoffs: Optional[torch.Tensor] = None,
    ) -> OldPass:
        """logp_old (and logp_ref, `proxies`) over the full completions, in micro-batches; with
        `cutoffs` [B], over each row's first cutoffs[row] tokens only (the rest stays 0).

        `proxies` (default: those the configured order has the trainer compute) are among entropy,
        grad_norm and uncertainty. For grad_norm and uncertainty the micro-batches hold whole groups
        and the output head runs per group, so that u and the token statistics share its
        probabilities. Each rank computes a share of the rows (of the groups) balanced by tokens;
        the results are gathered.
        """
        cfg, k = self.config, rollouts.batch.group_size
        batch = rollouts.batch if cutoffs is None else rollouts.batch.prefixes(cutoffs)
        if not batch.mask.any():  # every row cut at 0: nothing to compute (the same on every rank)
            zeros = torch.zeros(rollouts.batch.mask.shape)
            return OldPass(logp=zeros, logp_ref=zeros.clone() if self.ref_scorer is not None else None)
        proxies = self.order.trainer_proxies(cfg.algo.ps.strategy) if proxies is None else proxies
        by_group = bool({"grad_norm", "uncertainty"} & set(proxies))
        lengths = [len(p) + int(n) for p, n in zip(batch.prompt_ids, batch.mask.sum(dim=1).tolist())]
        unit_rows = [list(range(g * k, (g + 1) * k)) for g in range(len(rollouts.examples))] if by_group else [
            [row] for row in range(len(lengths))
        ]
        prompt_tokens = [len(batch.prompt_ids[rows[0]]) for rows in unit_rows]
        completion_tokens = [sum(lengths[r] for r in rows) - p for rows, p in zip(unit_rows, prompt_tokens)]
        groups = [rows[0] // k for rows in unit_rows] if shares_prompts(self.model) else None
        plans = self.micro_batch_plans(list(range(len(unit_rows))), prompt_tokens, completion_tokens, groups)
        parts: dict[str, list[torch.Tensor]] = defaultdict(list)
        self.run_micro_batches(plans, lambda units: self._old_micro_batch(
            rollouts, batch, view, [r for unit in units for r in unit_rows[unit]], units, proxies, parts))
        row_orders = [[r for micro in plan for unit in micro for r in unit_rows[unit]] for plan in plans]
        return self._gather_old(parts, row_orders, [[u for micro in plan for u in micro] for plan in plans],
                                batch.mask.shape[1] if cutoffs is None else rollouts.batch.mask.shape[1], by_group,
                                "entropy" in proxies)

    def _old_micro_batch(self, rollouts: Rollouts, batch, view: SamplingView, rows: list[int], units: list[int],
                         proxies: tuple[str, ...], parts: dict[str, list[torch.Tensor]]) -> None:
        """The no-grad pass over `rows` (whole groups `units` when the law's group proxies are asked for)."""
        cfg, k = self.config, batch.group_size
        with_entropy, success = "entropy" in proxies, rollouts.successes()  # [G, K]
        index = torch.tensor(rows)
        prompts, completions, mask = [batch.prompt_ids[r] for r in rows], batch.completion_ids[index], batch.mask[index]
        if {"grad_norm", "uncertainty"} & set(proxies):
            chunk = max(1, cfg.model.chunk_tokens // k)

            def reduce(hidden: torch.Tensor, head: torch.Tensor) -> list:
                on = hidden.device
                return [group_stats(hidden[i * k:(i + 1) * k], head, completions[i * k:(i + 1) * k].to(on),
                                    mask[i * k:(i + 1) * k].to(on), success[g].to(on), cfg.algo.ps.uncertainty, view,
                                    chunk, with_entropy=with_entropy)
                        for i, g in enumerate(units)]

            stats = self.scorer(prompts, completions, mask, reduce)
            for name in ("logp", "entropy", "sum_p2", "hidden_norm"):
                parts[name] += [getattr(group, name) for group in stats]
            parts["uncertainty"] += [group.uncertainty[None] for group in stats]
        else:
            stats = token_logprobs(self.scorer, prompts, completions, mask, view, cfg.model.chunk_tokens, with_entropy)
            parts["logp"].append(stats.logp)
            parts["entropy"].append(stats.entropy)
        if self.ref_scorer is not None:
            parts["logp_ref"].append(
                token_logprobs(self.ref_scorer, prompts, completions, mask, view, cfg.model.chunk_tokens).logp
            )

    def _gather_old(self, parts: dict[str, list[torch.Tensor]], row_orders: list[list[int]],
                    unit_orders: list[list[int]], width: int, by_group: bool, with_entropy: bool) -> OldPass:
        """The OldPass of every rank's `parts`, rows (units) in global order, [B, width]."""

        def gathered(name: str, orders: list[list[int]] = row_orders) -> Optional[torch.Tensor]:
            """The global [rows, width] tensor of this rank's pieces (None when the pass did not compute it)."""
            pieces = parts.get(name)
            if not pieces or pieces[0] is None:
                return None
            local = torch.cat([nn.functional.pad(t.cpu(), (0, width - t.shape[1])) for t in pieces])
            return gather_in_order(local, orders, self.world)[:, :width]

        logp = gathered("logp")
        old = OldPass(logp=logp, logp_ref=gathered("logp_ref"), entropy=gathered("entropy") if with_entropy else None)
        if by_group:
            old.grad_norm = grad_norm_proxy(logp, gathered("sum_p2"), gathered("hidden_norm"))
            old.uncertainty = gathered("uncertainty", unit_orders)
        return old

    def _filler_call(self, scorer: Scorer, backward: bool = False) -> None:
        """A one-token call of `scorer` whose result is zero, for a rank with fewer micro-batches than
        another: FSDP's collectives must pair up across ranks. With `backward` it is backpropagated."""
        token = torch.zeros(1, 1, dtype=torch.long)
        out = scorer([[0]], token, torch.ones(1, 1, dtype=torch.bool), lambda hidden, head: (hidden.sum() + head.sum()) * 0)
        if backward:
            out.backward()

    def group_advantages(self, rollouts: Rollouts) -> torch.Tensor:
        """Each row's group advantage on its real tokens, [B, T] (0 at padding)."""
        advantages = compute_advantages(self.config.algo.advantage, rollouts.rewards).reshape(-1)
        return broadcast_to_tokens(advantages, rollouts.batch.mask)

    def fusable(self) -> bool:
        """Whether an update could take logp_old from its own graded pass (detached) instead of a no-grad
        pass before it: one PPO epoch, one mini-batch, no KL term, no dropout (dropout would make that
        logp_old, and delta, noisier than the policy's). The order decides whether it does."""
        algo = self.config.algo
        return algo.ppo_epochs == 1 and algo.mini_batches == 1 and algo.kl_coef == 0 and not self.dropout

    def engine_proxies(self, rollouts: Rollouts) -> dict[str, torch.Tensor]:
        """The cutoff law's proxies from the engine's per-token statistics ({} if the law needs none)."""
        ps, batch = self.config.algo.ps, rollouts.batch
        if not self.order.engine_proxies(ps.strategy):
            return {}
        return engine_proxies(batch.logp_inf, batch.stats, batch.mask, rollouts.successes(), ps.uncertainty)

    def plan(self, rollouts: Rollouts, proxies: dict[str, torch.Tensor]) -> PrefixPlan:
        """The PS-PPO plan: the configured law, solved from `proxies` (trainer's or engine's), and one draw."""
        ps, mask, k = self.config.algo.ps, rollouts.batch.mask, rollouts.batch.group_size
        xi = cutoff_law(ps.strategy, mask, k, ps.budget, ps.xi_min, law_weights(ps.strategy, proxies, k))
        return sample_plan(ps.strategy, xi, mask, self.generator)

    def update(
        self, rollouts: Rollouts, plan: PrefixPlan, view: SamplingView, old: Optional[OldPass] = None,
        known: Optional[torch.Tensor] = None,
    ) -> UpdateResult:
        """PPO epochs over mini-batches; the graded pass sees each row's kept prefix only.

        `old` holds logp_old (and logp_ref) at least where `known` [B, T] (default: up to each row's
        cutoff); None (a fused update) takes logp_old from the graded pass itself, detached: the ratio
        is 1 and the gradient that of the clipped surrogate at pi_old = pi, as with one epoch and one
        mini-batch. Advantages and weights come from the correction (`Correction.token_terms`).

        An optimizer update whose loss or gradient norm is not finite is skipped (`optimizer_step`);
        the scheduler steps only when at least one update was applied. Each rank backpropagates a
        share of every mini-batch's rows, balanced by kept tokens; losses are normalised by the whole
        mini-batch, and FSDP sums the ranks' gradients.
        """
        algo = self.config.algo
        if old is None and (algo.ppo_epochs, algo.mini_batches) != (1, 1):
            raise ValueError("an update without logp_old needs one PPO epoch and one mini-batch")
        graded, tally = GradedPass(self, rollouts, plan, view, old, known), Tally()
        self.model.train()
        for _ in range(algo.ppo_epochs):
            order = torch.randperm(len(plan.cutoffs), generator=self.generator).tolist()
            for part in range(algo.mini_batches):
                mini = sorted(order[part::algo.mini_batches])
                if mini:
                    self.optimizer.zero_grad(set_to_none=True)
                    loss, nonfinite_rows = graded.backward(mini, tally)
                    self.optimizer_step(loss, nonfinite_rows or mini, tally)
        if tally.grad_norms:
            self.scheduler.step()
        self.model.eval()
        return graded.result(tally)

    def optimizer_step(self, loss: float, rows: list[int], tally: Tally) -> None:
        """Clip and step on the accumulated gradients, or skip a non-finite update (`rows` reported; weights
        and optimizer state untouched). `loss` is this rank's; NaN on any rank skips on every rank."""
        loss = all_reduce_sum([loss], self.world)[0]
        tally.losses.append(loss)
        # clip_grad_norm_ in two halves, so that the norm is checked before anything changes
        total_norm = torch.nn.utils.get_total_norm([p.grad for p in self.model.parameters() if p.grad is not None])
        norm = float(total_norm.full_tensor() if isinstance(total_norm, DTensor) else total_norm)
        if not (math.isfinite(loss) and math.isfinite(norm)):
            self.optimizer.zero_grad(set_to_none=True)
            tally.skipped.append(SkippedUpdate(sorted(rows), loss, norm))
            return
        started = time.perf_counter()
        if self.config.optim.grad_clip > 0:
            torch.nn.utils.clip_grads_with_norm_(self.model.parameters(), self.config.optim.grad_clip, total_norm)
        tally.grad_norms.append(norm)
        self.optimizer.step()
        tally.optimizer_s += time.perf_counter() - started


class GradedPass:
    """The graded pass of one update: each row fed up to its cutoff, the step's tensors bound once.

    Positions past a row's cutoff keep logp = logp_old (ratio 1) with weight 0, so every loss keeps
    full-length [B, T] tensors and its denominator counts all real tokens (PS-PPO's unbiasedness).
    """

    def __init__(self, learner: Learner, rollouts: Rollouts, plan: PrefixPlan, view: SamplingView,
                 old: Optional[OldPass], known: Optional[torch.Tensor]) -> None:
        self.learner, self.rollouts, self.plan, self.view, self.old = learner, rollouts, plan, view, old
        batch = rollouts.batch
        self.cutoffs = plan.cutoffs.tolist()
        fed = torch.arange(batch.mask.shape[1])[None, :] < plan.cutoffs[:, None]  # [B, T] positions the pass sees
        self.known = known if known is not None else batch.mask.bool() & fed
        self.logp_old = old.logp if old is not None else torch.zeros(batch.mask.shape)
        self.advantages = learner.group_advantages(rollouts)  # once per step
        self.prompt_tokens = [len(p) for p in batch.prompt_ids]
        shared = shares_prompts(learner.model)
        self.groups = [r // batch.group_size for r in range(len(self.cutoffs))] if shared else None

    def backward(self, mini: list[int], tally: Tally) -> tuple[float, list[int]]:
        """Backpropagate this rank's share of the mini-batch `mini`, in micro-batches; (this rank's loss,
        the rows of its micro-batches whose loss was not finite)."""
        learner, batch = self.learner, self.rollouts.batch
        count = batch_denominator(learner.config.algo.aggregation, batch.mask[torch.tensor(mini)])
        active = [r for r in mini if self.cutoffs[r] > 0]
        plans = learner.micro_batch_plans(active, self.prompt_tokens, self.cutoffs, self.groups)
        losses: list[tuple[list[int], torch.Tensor]] = []
        learner.run_micro_batches(plans, lambda micro: losses.append((micro, self._micro_batch(micro, count, tally))),
                                  backward=True)
        values = torch.stack([loss for _, loss in losses]).tolist() if losses else []  # one host sync
        nonfinite = [r for (micro, _), value in zip(losses, values) if not math.isfinite(value) for r in micro]
        return sum(values, 0.0), nonfinite

    def _micro_batch(self, micro: list[int], count: torch.Tensor, tally: Tally) -> torch.Tensor:
        """Forward and backward of the rows `micro`, each up to its cutoff; the loss, detached."""
        learner, batch, cutoffs = self.learner, self.rollouts.batch, self.cutoffs
        rows, width = torch.tensor(micro), max(cutoffs[r] for r in micro)
        kept = torch.arange(width)[None, :] < self.plan.cutoffs[rows][:, None]  # [b, width]
        graded = token_logprobs(learner.scorer, [batch.prompt_ids[r] for r in micro], batch.completion_ids[rows, :width],
                                kept, self.view, learner.config.model.chunk_tokens).logp.cpu()
        prompts_fed = {self.groups[r] if self.groups else r: self.prompt_tokens[r] for r in micro}
        work = tally.work
        work["graded"] += int(kept.sum())
        work["fed"] += sum(prompts_fed.values()) + sum(cutoffs[r] for r in micro)
        work["calls"] += 1
        if self.old is None:
            self.logp_old[rows, :width] = torch.where(kept, graded.detach(), 0.0)
        logp_old = self.logp_old[rows]
        logp = logp_old.clone()
        logp[:, :width] = torch.where(kept, graded, logp[:, :width])
        advantages, weights = learner.correction.token_terms(
            self.advantages[rows], logp_old, batch.logp_inf[rows], batch.mask[rows] & self.known[rows])
        out = learner.loss(logp, logp_old, advantages, batch.mask[rows], weights * self.plan.weights[rows],
                           denominator=count,
                           logp_ref=None if self.old is None or self.old.logp_ref is None else self.old.logp_ref[rows])
        out.loss.backward()
        for name, value in out.metrics.items():
            tally.diagnostics[name].append(value.detach())  # read on the host once, in result()
        return out.loss.detach()

    def result(self, tally: Tally) -> UpdateResult:
        """The UpdateResult of the update (sums over the ranks); logp_old as the loss used it."""
        learner, epochs = self.learner, self.learner.config.algo.ppo_epochs
        graded, fed, calls = all_reduce_sum([tally.work[k] for k in ("graded", "fed", "calls")], learner.world)
        logp_old = self.logp_old
        if self.old is None:  # each row's values were computed on one rank, zeros on the others
            logp_old = all_reduce_tensor(logp_old, learner.world)
        diagnostics = {name: torch.stack(values).tolist() for name, values in tally.diagnostics.items()}
        return UpdateResult(
            loss=_mean(tally.losses), grad_norm=_mean(tally.grad_norms),
            clip_fraction=_mean(diagnostics.get("clip_fraction", [])),
            approx_kl_old=_mean(diagnostics.get("approx_kl_old", [])),
            ratio_mean=_mean(diagnostics.get("ratio_mean", [])),
            kl_ref=_mean(diagnostics.get("kl_ref", [])) if learner.config.algo.kl_coef > 0 else None,
            tokens_graded=graded / epochs, graded_pass_tokens=fed / epochs, micro_batches=calls / epochs,
            applied=len(tally.grad_norms), optimizer_s=tally.optimizer_s, logp_old=logp_old, skipped=tally.skipped,
        )
