"""The PS-PPO order of a step (`algo.ps.proxies`): where the cutoff law's inputs come from, and so
how far the trainer's no-grad pass runs and how mean D is measured.

* ``trainer``: a no-grad pass over every token first (logp_old and the law's proxies), then the
  law. mean D is exact.
* ``engine``: the law from what the rollout engine reported while sampling, then a no-grad pass
  over each row's prefix up to its cutoff only, or none at all when the update can take logp_old
  from its own graded pass (`Passes.fusable`: one PPO epoch, one mini-batch, no KL term, no
  dropout) and the correction can weigh the batch unmeasured (`Correction.ready`). mean D is the
  unbiased estimate from the kept tokens (`discrepancy_estimate`). A correction that needs whole
  rows (`Correction.whole_sequence`) gets a no-grad pass over every token, and an exact mean D.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from deployrl.algo.corrections import Correction, Measured
from deployrl.algo.discrepancy import discrepancy_estimate, token_discrepancy, trajectory_discrepancy
from deployrl.algo.prefix import STRATEGIES, PrefixPlan
from deployrl.registry import Registry
from deployrl.settings.config import ProxySource

if TYPE_CHECKING:
    from deployrl.algo.logprobs import SamplingView
    from deployrl.training.passes import OldPass, Passes
    from deployrl.training.rollout import Rollouts


@dataclass
class Prepared:
    """A step's cutoff plan and no-grad pass, before the update."""

    plan: PrefixPlan
    old: Optional["OldPass"]  # None: the update computes logp_old itself (a fused pass)
    known: torch.Tensor  # [B, T] bool, the real tokens whose logp_old the update has (old's, or its own)
    every_token: bool  # the no-grad pass covered every real token (mean D exact), not the prefixes only
    seconds: dict[str, float]  # "old_pass", "plan"


class ProxyOrder:
    """How one step orders the no-grad pass and the cutoff law; `source` is where the law's proxies come from."""

    source = ProxySource.TRAINER

    def trainer_proxies(self, strategy: str) -> tuple[str, ...]:
        """The proxies of `strategy` the trainer's no-grad pass computes."""
        return STRATEGIES.get(strategy).proxies if self.source is ProxySource.TRAINER else ()

    def engine_proxies(self, strategy: str) -> tuple[str, ...]:
        """The proxies of `strategy` the engine reports while sampling."""
        return STRATEGIES.get(strategy).proxies if self.source is ProxySource.ENGINE else ()

    def prepare(self, passes: "Passes", rollouts: "Rollouts", view: "SamplingView", correction: Correction) -> Prepared:
        """The step's cutoff plan and no-grad pass, run with the model's `passes`."""
        start = time.perf_counter()
        old = passes.old_pass(rollouts, view, self.trainer_proxies(passes.config.algo.ps.strategy))
        middle = time.perf_counter()
        plan = passes.plan(rollouts, old.proxies())
        seconds = {"old_pass": middle - start, "plan": time.perf_counter() - middle}
        return Prepared(plan, old, rollouts.batch.mask.bool(), True, seconds)

    def measure(self, rollouts: "Rollouts", prepared: Prepared, logp_old: torch.Tensor, signal: str) -> Measured:
        """delta on the tokens with logp_old, and mean D: exact when the no-grad pass covered every token,
        else the unbiased estimate from the kept tokens and their weights 1/xi (never chosen by the draw:
        switching to the exact mean when every row happens to be kept whole would bias it)."""
        batch, plan = rollouts.batch, prepared.plan
        if prepared.every_token:
            delta = token_discrepancy(logp_old, batch.logp_inf, batch.mask, signal)
            return Measured(delta, batch.mask, float(trajectory_discrepancy(delta, batch.mask).mean()))
        delta = token_discrepancy(logp_old, batch.logp_inf, plan.keep, signal)
        return Measured(delta, plan.keep, float(discrepancy_estimate(delta, plan.weights, batch.mask).mean()))


PS_ORDERS: Registry[ProxyOrder] = Registry("proxy source")
PS_ORDERS.register(ProxySource.TRAINER)(ProxyOrder())


class EngineFirst(ProxyOrder):
    source = ProxySource.ENGINE

    def prepare(self, passes, rollouts, view, correction):
        start = time.perf_counter()
        proxies = passes.engine_proxies(rollouts) if self.engine_proxies(passes.config.algo.ps.strategy) else {}
        plan = passes.plan(rollouts, proxies)  # the trainer sees each row up to its cutoff only
        middle = time.perf_counter()
        mask = rollouts.batch.mask.bool()
        if correction.whole_sequence:
            old, known = passes.old_pass(rollouts, view), mask
        else:
            old = None if passes.fusable() and correction.ready() else passes.old_pass(rollouts, view, cutoffs=plan.cutoffs)
            known = mask & (torch.arange(mask.shape[1])[None, :] < plan.cutoffs[:, None])
        seconds = {"plan": middle - start, "old_pass": time.perf_counter() - middle}
        return Prepared(plan, old, known, correction.whole_sequence, seconds)


PS_ORDERS.register(ProxySource.ENGINE)(EngineFirst())
