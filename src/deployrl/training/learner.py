"""The learner: a step's learn phase, from the rollouts to the updated weights.

    learn       the PS-PPO order prepares (cutoff plan and no-grad pass, with `Passes`), the
                correction measures the discrepancy, the update, the discrepancy again if the
                update computed logp_old itself
    update      PPO epochs over mini-batches; the graded pass (`GradedPass`) sees each row's kept
                prefix only; each micro-batch's advantages and weights come from the correction
    optimizer_step  NaN skip, clipping and the step

The order (`algo.ps.proxies`, ps_orders.py) decides how far the no-grad pass runs: over every
token (``trainer``), over each row's prefix, or not at all (``engine``; logp_old is then the
graded pass's own log-probs, detached). The correction (algo/corrections.py) owns the tolerance
and lambda; the learner holds both for the run, and a checkpoint keeps the correction's state.

Choices: the cutoff plan is drawn once per step and reused by every PPO epoch and mini-batch;
the graded pass feeds each row only up to its cutoff, and the positions past it keep
logp = logp_old (ratio 1) with weight 0, so every loss keeps full-length [B, T] tensors and its
denominator counts all real tokens (the unbiasedness condition of PS-PPO). Both passes run on
`Passes.run_micro_batches`; under torchrun each rank backpropagates a share of every mini-batch.
"""

from __future__ import annotations

import functools
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from deployrl.algo.advantages import broadcast_to_tokens, compute_advantages
from deployrl.algo.corrections import CORRECTIONS, Correction, Measured
from deployrl.algo.logprobs import SamplingView
from deployrl.algo.losses import LossOutputs, batch_denominator, policy_loss
from deployrl.algo.prefix import PrefixPlan
from deployrl.models.loading import shares_prompts, token_logprobs
from deployrl.settings.config import OptimConfig, TrainConfig
from deployrl.training.distributed import World, all_reduce_sum, all_reduce_tensor
from deployrl.training.passes import OldPass, Passes
from deployrl.training.ps_orders import PS_ORDERS, Prepared
from deployrl.training.rollout import Rollouts


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
    """The trainer's model with its passes (`Passes`: scorers, the micro-batch runner, the cutoff
    draws), optimizer, scheduler, the mismatch correction and the PS-PPO order."""

    def __init__(self, config: TrainConfig, model: nn.Module, world: World) -> None:
        self.config, self.model, self.world = config, model, world
        algo, optim = config.algo, config.optim
        self.passes = Passes(config, model, world)
        trainable = [p for p in model.parameters() if p.requires_grad]  # with LoRA, the adapters only
        # fused: one kernel per step and no temporaries (on CPU, the 4-layer SmolLM2 shape's step took
        # 0.03 s against the per-tensor loop's 0.13 s: docs/results.md §1)
        self.optimizer = torch.optim.AdamW(
            trainable, lr=optim.lr, betas=(optim.beta1, optim.beta2), weight_decay=optim.weight_decay, fused=True
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(optim, config.steps))
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
        prepared = self.order.prepare(self.passes, rollouts, view, self.correction)
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

    def group_advantages(self, rollouts: Rollouts) -> torch.Tensor:
        """Each row's group advantage on its real tokens, [B, T] (0 at padding)."""
        advantages = compute_advantages(self.config.algo.advantage, rollouts.rewards).reshape(-1)
        return broadcast_to_tokens(advantages, rollouts.batch.mask)

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
            order = torch.randperm(len(plan.cutoffs), generator=self.passes.generator).tolist()
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
        self.passes.weights_changed()
        tally.optimizer_s += time.perf_counter() - started


class GradedPass:
    """The graded pass of one update: each row fed up to its cutoff, the step's tensors bound once.

    Positions past a row's cutoff keep logp = logp_old (ratio 1) with weight 0, so every loss keeps
    full-length [B, T] tensors and its denominator counts all real tokens (PS-PPO's unbiasedness).
    """

    def __init__(self, learner: Learner, rollouts: Rollouts, plan: PrefixPlan, view: SamplingView,
                 old: Optional[OldPass], known: Optional[torch.Tensor]) -> None:
        self.learner, self.rollouts, self.plan, self.view, self.old = learner, rollouts, plan, view, old
        batch, device = rollouts.batch, learner.world.device
        self.cutoffs = plan.cutoffs.tolist()
        fed = torch.arange(batch.mask.shape[1])[None, :] < plan.cutoffs[:, None]  # [B, T] positions the pass sees
        known = known if known is not None else batch.mask.bool() & fed
        # the step's [B, T] tensors on the model's device once; micro-batches index them there
        on = functools.partial(torch.Tensor.to, device=device)
        self.mask, self.logp_inf, self.known = on(batch.mask), on(batch.logp_inf), on(known)
        self.plan_weights = on(plan.weights)
        self.logp_old = on(old.logp) if old is not None else torch.zeros(batch.mask.shape, device=device)
        self.logp_ref = on(old.logp_ref) if old is not None and old.logp_ref is not None else None
        self.advantages = on(learner.group_advantages(rollouts))  # once per step
        self.prompt_tokens = [len(p) for p in batch.prompt_ids]
        shared = shares_prompts(learner.model)
        self.groups = [r // batch.group_size for r in range(len(self.cutoffs))] if shared else None

    def backward(self, mini: list[int], tally: Tally) -> tuple[float, list[int]]:
        """Backpropagate this rank's share of the mini-batch `mini`, in micro-batches; (this rank's loss,
        the rows of its micro-batches whose loss was not finite)."""
        learner, rows = self.learner, torch.tensor(mini, device=self.mask.device)
        count = batch_denominator(learner.config.algo.aggregation, self.mask[rows])
        active = [r for r in mini if self.cutoffs[r] > 0]
        plans = learner.passes.micro_batch_plans(active, self.prompt_tokens, self.cutoffs, self.groups)
        losses: list[tuple[list[int], torch.Tensor]] = []
        learner.passes.run_micro_batches(
            plans, lambda micro: losses.append((micro, self._micro_batch(micro, count, tally))), backward=True)
        values = torch.stack([loss for _, loss in losses]).tolist() if losses else []  # one host sync
        nonfinite = [r for (micro, _), value in zip(losses, values) if not math.isfinite(value) for r in micro]
        return sum(values, 0.0), nonfinite

    def _micro_batch(self, micro: list[int], count: torch.Tensor, tally: Tally) -> torch.Tensor:
        """Forward and backward of the rows `micro`, each up to its cutoff; the loss, detached."""
        learner, batch, cutoffs = self.learner, self.rollouts.batch, self.cutoffs
        width, graded_tokens = max(cutoffs[r] for r in micro), sum(cutoffs[r] for r in micro)
        rows = torch.tensor(micro, device=self.mask.device)
        # [b, width] from the host's cutoffs: the forward reads its lengths without waiting for the device
        kept = torch.arange(width)[None, :] < self.plan.cutoffs[micro][:, None]
        graded = token_logprobs(learner.passes.scorer, [batch.prompt_ids[r] for r in micro],
                                batch.completion_ids[micro, :width], kept, self.view,
                                learner.config.model.chunk_tokens).logp
        kept = kept.to(rows.device)
        prompts_fed = {self.groups[r] if self.groups else r: self.prompt_tokens[r] for r in micro}
        work = tally.work
        work["graded"] += graded_tokens
        work["fed"] += sum(prompts_fed.values()) + graded_tokens
        work["calls"] += 1
        if self.old is None:
            self.logp_old[rows, :width] = torch.where(kept, graded.detach(), 0.0)
        logp_old = self.logp_old[rows]
        logp = logp_old.clone()
        logp[:, :width] = torch.where(kept, graded, logp[:, :width])
        mask = self.mask[rows]
        advantages, weights = learner.correction.token_terms(
            self.advantages[rows], logp_old, self.logp_inf[rows], mask & self.known[rows])
        out = learner.loss(logp, logp_old, advantages, mask, weights * self.plan_weights[rows], denominator=count,
                           logp_ref=None if self.logp_ref is None else self.logp_ref[rows])
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
        logp_old = logp_old.cpu()  # beside the engine's log-probs, for the discrepancy
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
