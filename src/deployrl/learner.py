"""The learner: everything the trainer's model computes from a step's rollouts.

    old_pass    no-grad pass: logp_old, logp_ref and the cutoff law's proxies over the full
                completions, or logp_old and logp_ref over each row's prefix up to its cutoff
    plan        the PS-PPO cutoff plan: which prefix of each completion is backpropagated
    update      PPO epochs over mini-batches; the graded pass sees each row's kept prefix only;
                each micro-batch's advantages carry the mismatch correction (DC shaping or weights)

Two orders (`algo.ps.proxies`): ``trainer`` runs the no-grad pass over every token first and
solves the cutoff law from its proxies; ``engine`` solves the law from what the rollout engine
reported while sampling, so no trainer pass ever covers a token past a row's cutoff: the no-grad
pass runs on the prefixes only, and with one PPO epoch, one mini-batch and no KL term not at all
(`fuses_old_pass`: logp_old is then the graded pass's own log-probs, detached).

Choices: the cutoff plan is drawn once per step and reused by every PPO epoch and mini-batch;
the graded pass feeds each row only up to its cutoff, and the positions past it keep
logp = logp_old (ratio 1) with weight 0, so every loss keeps full-length [B, T] tensors and its
denominator counts all real tokens (the unbiasedness condition of PS-PPO).

Rows go through the model in micro-batches of `algo.micro_batch_tokens` (`micro_batches`). Under
torchrun the model is sharded with FSDP2; each rank computes a share of the rows and every rank
makes the same number of model calls (`rank_schedule`), since each call is a collective.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional, TypeVar

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from deployrl.algo.advantages import broadcast_to_tokens, compute_advantages
from deployrl.algo.discrepancy import CORRECTIONS, apply_correction, token_discrepancy
from deployrl.algo.losses import batch_denominator, policy_loss
from deployrl.algo.prefix import (
    PrefixPlan, cutoff_law, engine_proxies, grad_norm_proxy, group_stats, law_weights, sample_plan,
)
from deployrl.algo.logprobs import SamplingView
from deployrl.config import OptimConfig, TrainConfig
from deployrl.distributed import World, all_reduce_sum, all_reduce_tensor, balanced_shares, gather_in_order, shard
from deployrl.models import DTYPES, Scorer, decoder_blocks, has_dropout, shares_prompts, token_logprobs
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
        if cfg.schedule == "constant":
            return 1.0
        progress_ = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress_, 1.0)))

    return factor


def _mean(values: list[float]) -> float:
    return float(np.mean(values)) if values else 0.0


class Learner:
    """The trainer's model with its reference copy (KL term), optimizer, scheduler and the
    generator of the cutoff draws; sharded over the ranks of `world` when distributed."""

    def __init__(self, config: TrainConfig, model: nn.Module, world: World) -> None:
        self.config, self.model, self.world = config, model, world
        ref_model = copy.deepcopy(model).eval().requires_grad_(False) if config.algo.kl_coef > 0 else None
        # every use of the weights goes through these calls (what FSDP needs)
        self.scorer = Scorer(model)
        self.ref_scorer = Scorer(ref_model) if ref_model is not None else None
        if world.distributed:
            for scorer in filter(None, (self.scorer, self.ref_scorer)):
                shard(scorer, decoder_blocks(scorer.model), world, DTYPES[config.model.dtype])
        optim = config.optim
        trainable = [p for p in model.parameters() if p.requires_grad]  # with LoRA, the adapters only
        # fused: one kernel per step and no temporaries (on CPU, the 4-layer SmolLM2 shape's step took
        # 0.03 s against the per-tensor loop's 0.13 s: docs/results.md §1)
        self.optimizer = torch.optim.AdamW(
            trainable, lr=optim.lr, betas=(optim.beta1, optim.beta2), weight_decay=optim.weight_decay, fused=True
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(optim, config.steps))
        self.generator = torch.Generator().manual_seed(config.seed)
        self.dropout = has_dropout(model)

    @torch.no_grad()
    def old_pass(
        self, rollouts: Rollouts, view: SamplingView, proxies: Optional[tuple[str, ...]] = None,
        cutoffs: Optional[torch.Tensor] = None,
    ) -> OldPass:
        """logp_old (and logp_ref, `proxies`) over the full completions, in micro-batches; with
        `cutoffs` [B], over each row's first cutoffs[row] tokens only (the rest stays 0).

        `proxies` (default: those of the configured cutoff strategy when the trainer supplies
        them, else none) are among entropy, grad_norm and uncertainty. For grad_norm and
        uncertainty the micro-batches hold whole groups and the output head runs per group, so that
        u and the token statistics share its probabilities. Each rank computes a share of the rows
        (of the groups) balanced by tokens; the results are gathered.
        """
        cfg, k, width = self.config, rollouts.batch.group_size, rollouts.batch.mask.shape[1]
        batch = rollouts.batch if cutoffs is None else rollouts.batch.prefixes(cutoffs)
        if not batch.mask.any():  # every row cut at 0: nothing to compute (the same on every rank)
            zeros = torch.zeros(rollouts.batch.mask.shape)
            return OldPass(logp=zeros, logp_ref=zeros.clone() if self.ref_scorer is not None else None)
        proxies = cfg.algo.ps.proxies_from("trainer") if proxies is None else proxies
        by_group, with_entropy = {"grad_norm", "uncertainty"} & set(proxies), "entropy" in proxies
        lengths = [len(p) + int(n) for p, n in zip(batch.prompt_ids, batch.mask.sum(dim=1).tolist())]
        unit_rows = [list(range(g * k, (g + 1) * k)) for g in range(len(rollouts.examples))] if by_group else [
            [row] for row in range(len(lengths))
        ]
        costs = [sum(lengths[r] for r in rows) for rows in unit_rows]
        prompt_tokens = [len(batch.prompt_ids[rows[0]]) for rows in unit_rows]
        groups = [rows[0] // k for rows in unit_rows] if shares_prompts(self.model) else None
        plans = [micro_batches(share, prompt_tokens, [c - p for c, p in zip(costs, prompt_tokens)],
                               cfg.algo.micro_batch_tokens, groups)
                 for share in balanced_shares(costs, self.world.size)]
        success = rollouts.successes()  # [G, K]
        chunk = max(1, cfg.model.chunk_tokens // k)

        def group_reduce(units: list[int], completions: torch.Tensor, mask: torch.Tensor):
            def reduce(hidden: torch.Tensor, head: torch.Tensor) -> list:
                on = hidden.device
                return [
                    group_stats(hidden[i * k:(i + 1) * k], head, completions[i * k:(i + 1) * k].to(on),
                                mask[i * k:(i + 1) * k].to(on), success[g].to(on), cfg.algo.ps.uncertainty, view, chunk,
                                with_entropy=with_entropy)
                    for i, g in enumerate(units)
                ]
            return reduce

        parts: dict[str, list[torch.Tensor]] = {n: [] for n in ("logp", "entropy", "sum_p2", "hidden_norm", "logp_ref")}
        uncertainty = []
        for units in rank_schedule(plans, self.world.rank):
            if units is None:
                for scorer in filter(None, (self.scorer, self.ref_scorer)):
                    self._filler_call(scorer)
                continue
            rows = [r for unit in units for r in unit_rows[unit]]
            index = torch.tensor(rows)
            prompts, completions, mask = [batch.prompt_ids[r] for r in rows], batch.completion_ids[index], batch.mask[index]
            if by_group:
                stats = self.scorer(prompts, completions, mask, group_reduce(units, completions, mask))
                for name in ("logp", "entropy", "sum_p2", "hidden_norm"):
                    parts[name] += [getattr(group, name) for group in stats]
                uncertainty += [group.uncertainty[None] for group in stats]
            else:
                stats = token_logprobs(self.scorer, prompts, completions, mask, view, cfg.model.chunk_tokens, with_entropy)
                parts["logp"].append(stats.logp)
                parts["entropy"].append(stats.entropy)
            if self.ref_scorer is not None:
                parts["logp_ref"].append(
                    token_logprobs(self.ref_scorer, prompts, completions, mask, view, cfg.model.chunk_tokens).logp
                )
        row_orders = [[r for micro in plan for unit in micro for r in unit_rows[unit]] for plan in plans]

        def gathered(pieces: list, orders: list[list[int]] = row_orders) -> Optional[torch.Tensor]:
            """The global [rows, T] tensor of this rank's `pieces` (None when the pass did not compute it)."""
            if not pieces or pieces[0] is None:
                return None
            local = torch.cat([nn.functional.pad(t.cpu(), (0, width - t.shape[1])) for t in pieces])
            return gather_in_order(local, orders, self.world)[:, :width]

        logp = gathered(parts["logp"])
        old = OldPass(logp=logp, logp_ref=gathered(parts["logp_ref"]),
                      entropy=gathered(parts["entropy"]) if with_entropy else None)
        if by_group:
            old.grad_norm = grad_norm_proxy(logp, gathered(parts["sum_p2"]), gathered(parts["hidden_norm"]))
            old.uncertainty = gathered(uncertainty, [[unit for micro in plan for unit in micro] for plan in plans])
        return old

    def _filler_call(self, scorer: Scorer, backward: bool = False) -> None:
        """A one-token call of `scorer` whose result is zero, for a rank with fewer micro-batches than
        another: FSDP's collectives must pair up across ranks. With `backward` it is backpropagated."""
        token = torch.zeros(1, 1, dtype=torch.long)
        out = scorer([[0]], token, torch.ones(1, 1, dtype=torch.bool), lambda hidden, head: (hidden.sum() + head.sum()) * 0)
        if backward:
            out.backward()

    def token_terms(
        self, rollouts: Rollouts, rows: torch.Tensor, logp_old: torch.Tensor, known: torch.Tensor, lam: float,
        tolerance: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(advantages [b, T], weights [b, T]) of the batch's `rows` [b] under the configured
        mismatch correction: group advantages per token, shaped by lam * delta (DC) or weighted
        (TIS, mask). logp_old [b, T] is known where `known` [b, T]; elsewhere both are 0 (such
        tokens must carry no loss weight). Row by row, so a micro-batch computes its own."""
        algo, batch = self.config.algo, rollouts.batch
        real = batch.mask[rows] & known
        delta = token_discrepancy(logp_old, batch.logp_inf[rows], real, algo.dc.signal)
        group = compute_advantages(algo.advantage, rollouts.rewards).reshape(-1)[rows]  # [b]
        return apply_correction(
            algo.correction, broadcast_to_tokens(group, real), delta, logp_old, batch.logp_inf[rows], real,
            lam=lam, penalty=algo.dc.penalty, tolerance=tolerance, cap=algo.correction_cap,
        )

    def fuses_old_pass(self, tolerance_known: bool) -> bool:
        """True when the update needs no no-grad pass before it (`algo.ps.proxies=engine`, one PPO
        epoch, one mini-batch, no KL term, no dropout): its one graded pass gives logp_old, detached.
        Dropout would make that logp_old, and delta, noisier than the policy's; DC's hinge penalty
        needs the tolerance c before the update, so not before c is known."""
        algo = self.config.algo
        return (algo.ps.proxies == "engine" and algo.ppo_epochs == 1 and algo.mini_batches == 1 and algo.kl_coef == 0
                and not self.dropout and (tolerance_known or not CORRECTIONS.get(algo.correction).constrained))

    def prepare(
        self, rollouts: Rollouts, view: SamplingView, tolerance_known: bool
    ) -> tuple[PrefixPlan, Optional[OldPass], dict[str, float]]:
        """The step's cutoff plan and no-grad pass, in the order `algo.ps.proxies` sets, with the
        seconds of each ("old_pass", "plan"). The pass is None when the update fuses it
        (`fuses_old_pass`; `tolerance_known`: DC's c is set)."""
        start = time.perf_counter()
        if self.config.algo.ps.proxies == "trainer":  # a no-grad pass over every token, then the law from its proxies
            old = self.old_pass(rollouts, view)
            middle = time.perf_counter()
            plan = self.plan(rollouts, old.proxies())
            return plan, old, {"old_pass": middle - start, "plan": time.perf_counter() - middle}
        plan = self.plan(rollouts, self.engine_proxies(rollouts))  # the trainer sees each row up to its cutoff only
        middle = time.perf_counter()
        old = None if self.fuses_old_pass(tolerance_known) else self.old_pass(rollouts, view, cutoffs=plan.cutoffs)
        return plan, old, {"plan": middle - start, "old_pass": time.perf_counter() - middle}

    def engine_proxies(self, rollouts: Rollouts) -> dict[str, torch.Tensor]:
        """The cutoff law's proxies from the engine's per-token statistics ({} if the law needs none)."""
        ps, batch = self.config.algo.ps, rollouts.batch
        if not ps.proxies_from("engine"):
            return {}
        return engine_proxies(batch.logp_inf, batch.stats, batch.mask, rollouts.successes(), ps.uncertainty)

    def plan(self, rollouts: Rollouts, proxies: dict[str, torch.Tensor]) -> PrefixPlan:
        """The PS-PPO plan: the configured law, solved from `proxies` (trainer's or engine's), and one draw."""
        ps, mask, k = self.config.algo.ps, rollouts.batch.mask, rollouts.batch.group_size
        xi = cutoff_law(ps.strategy, mask, k, ps.budget, ps.xi_min, law_weights(ps.strategy, proxies, k))
        return sample_plan(ps.strategy, xi, mask, self.generator)

    def update(
        self, rollouts: Rollouts, plan: PrefixPlan, view: SamplingView, lam: float, tolerance: float,
        old: Optional[OldPass] = None,
    ) -> UpdateResult:
        """PPO epochs over mini-batches; the graded pass sees each row's kept prefix only.

        `old` holds logp_old (and logp_ref) at least up to each row's cutoff; None (a fused update,
        `fuses_old_pass`) takes logp_old from the graded pass itself, detached: the ratio is 1 and the
        gradient that of the clipped surrogate at pi_old = pi, as with one epoch and one mini-batch.
        `lam` and `tolerance` are DC's, for the advantages (`token_terms`).

        An optimizer update whose loss or gradient norm is not finite is skipped (weights and
        optimizer state untouched) and reported in `UpdateResult.skipped`; the scheduler steps
        only when at least one update was applied, so a step without any leaves the whole
        optimizer state as it was. Each rank backpropagates a share of every mini-batch's rows,
        balanced by kept tokens; losses are normalised by the whole mini-batch, and FSDP sums the
        ranks' gradients.
        """
        if old is None and (self.config.algo.ppo_epochs, self.config.algo.mini_batches) != (1, 1):
            raise ValueError("an update without logp_old needs one PPO epoch and one mini-batch")
        cfg, batch = self.config, rollouts.batch
        algo = cfg.algo
        cutoffs = plan.cutoffs.tolist()
        fed = torch.arange(batch.mask.shape[1])[None, :] < plan.cutoffs[:, None]  # [B, T] positions the graded pass sees
        logp_old = old.logp if old is not None else torch.zeros(batch.mask.shape)
        prompt_tokens = [len(p) for p in batch.prompt_ids]
        groups = [r // batch.group_size for r in range(len(cutoffs))] if shares_prompts(self.model) else None
        losses, grad_norms, skipped = [], [], []
        diagnostics: dict[str, list[float]] = {"clip_fraction": [], "approx_kl_old": [], "ratio_mean": [], "kl_ref": []}
        graded_tokens, fed_tokens, calls, optimizer_s = 0, 0, 0, 0.0
        self.model.train()
        for _ in range(algo.ppo_epochs):
            order = torch.randperm(len(cutoffs), generator=self.generator).tolist()
            for part in range(algo.mini_batches):
                mini = sorted(order[part::algo.mini_batches])
                if not mini:
                    continue
                count = batch_denominator(algo.aggregation, batch.mask[torch.tensor(mini)])
                self.optimizer.zero_grad(set_to_none=True)
                step_loss, nonfinite_rows = 0.0, []
                active = [r for r in mini if cutoffs[r] > 0]
                shares = [[active[i] for i in share] for share in
                          balanced_shares([prompt_tokens[r] + cutoffs[r] for r in active], self.world.size)]
                plans = [micro_batches(share, prompt_tokens, cutoffs, algo.micro_batch_tokens, groups) for share in shares]
                for micro in rank_schedule(plans, self.world.rank):
                    if micro is None:
                        self._filler_call(self.scorer, backward=True)
                        continue
                    rows = torch.tensor(micro)
                    width = max(cutoffs[r] for r in micro)
                    kept = torch.arange(width)[None, :] < plan.cutoffs[rows][:, None]  # [b, width]
                    graded = token_logprobs(
                        self.scorer, [batch.prompt_ids[r] for r in micro], batch.completion_ids[rows, :width],
                        kept, view, cfg.model.chunk_tokens,
                    ).logp.cpu()
                    graded_tokens += int(kept.sum())
                    prompts_fed = {groups[r] if groups else r: prompt_tokens[r] for r in micro}
                    fed_tokens += sum(prompts_fed.values()) + sum(cutoffs[r] for r in micro)
                    calls += 1
                    if old is None:
                        logp_old[rows, :width] = torch.where(kept, graded.detach(), 0.0)
                    logp = logp_old[rows].clone()
                    logp[:, :width] = torch.where(kept, graded, logp[:, :width])
                    advantages, weights = self.token_terms(rollouts, rows, logp_old[rows], fed[rows], lam, tolerance)
                    out = policy_loss(
                        logp, logp_old[rows], advantages, batch.mask[rows], weights * plan.weights[rows],
                        eps_low=algo.eps_low, eps_high=algo.eps_high, dual_clip=algo.dual_clip,
                        aggregation=algo.aggregation, max_length=cfg.rollout.max_new_tokens, denominator=count,
                        logp_ref=None if old is None or old.logp_ref is None else old.logp_ref[rows],
                        kl_coef=algo.kl_coef, kl_estimator=algo.kl_estimator,
                    )
                    out.loss.backward()
                    micro_loss = float(out.loss.detach())
                    if not math.isfinite(micro_loss):
                        nonfinite_rows += micro
                    step_loss += micro_loss
                    for name, value in out.metrics.items():
                        diagnostics[name].append(float(value))
                step_loss = all_reduce_sum([step_loss], self.world)[0]  # NaN anywhere: NaN everywhere
                losses.append(step_loss)
                # clip_grad_norm_ in two halves, so that the norm is checked before anything changes
                grads = [p.grad for p in self.model.parameters() if p.grad is not None]
                total_norm = torch.nn.utils.get_total_norm(grads)
                norm = float(total_norm.full_tensor() if isinstance(total_norm, DTensor) else total_norm)
                if not (math.isfinite(step_loss) and math.isfinite(norm)):
                    self.optimizer.zero_grad(set_to_none=True)
                    skipped.append(SkippedUpdate(sorted(nonfinite_rows or mini), step_loss, norm))
                    continue
                started = time.perf_counter()
                if cfg.optim.grad_clip > 0:
                    torch.nn.utils.clip_grads_with_norm_(self.model.parameters(), cfg.optim.grad_clip, total_norm)
                grad_norms.append(norm)
                self.optimizer.step()
                optimizer_s += time.perf_counter() - started
        applied = len(grad_norms)
        if applied:
            self.scheduler.step()
        self.model.eval()
        tokens_graded, tokens_fed, micro_calls = all_reduce_sum([graded_tokens, fed_tokens, calls], self.world)
        if old is None:  # each row's values were computed on one rank, zeros on the others
            logp_old = all_reduce_tensor(logp_old, self.world)
        return UpdateResult(
            loss=_mean(losses), grad_norm=_mean(grad_norms), clip_fraction=_mean(diagnostics["clip_fraction"]),
            approx_kl_old=_mean(diagnostics["approx_kl_old"]), ratio_mean=_mean(diagnostics["ratio_mean"]),
            kl_ref=_mean(diagnostics["kl_ref"]) if algo.kl_coef > 0 else None,
            tokens_graded=tokens_graded / algo.ppo_epochs, graded_pass_tokens=tokens_fed / algo.ppo_epochs,
            micro_batches=micro_calls / algo.ppo_epochs, applied=applied, optimizer_s=optimizer_s, logp_old=logp_old,
            skipped=skipped,
        )
