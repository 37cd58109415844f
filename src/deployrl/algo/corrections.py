"""Mismatch corrections: how a training step uses the engine's log-probs, registered as peers.

Every correction answers the same four calls, in the order of a step:

    measure(measured)          this batch's discrepancy (delta, mean D) as the prefix order measured it;
                               the tolerance c is set once, from the first batch with a token seen
    token_terms(A, ...)        (advantages [b, T], weights [b, T]) of a micro-batch's rows
    after_update(measured)     after an applied optimizer update: DC's dual step on lambda
    state_dict / load_state_dict   what a checkpoint keeps (c, and lambda for dc)

and describes itself: `whole_sequence` (its terms need logp_old on every real token of a row, not
only on the prefix the graded pass sees), `ready()` (it can weigh a batch before measuring it) and
the bound on its cap C. c is kept by every correction: DC constrains mean D <= c; the others log the
fraction of tokens over it.

| name       | level    | advantages               | weight per token                                  |
| none       | -        | A                        | 1                                                 |
| dc         | token    | A - lambda * delta (DC)  | 1                                                 |
| tis        | token    | A                        | min(r_t, C), r_t = exp(logp_old - logp_inf)       |
| mask       | token    | A                        | 1{r_t in [1/C, C]}                                |
| seq_tis    | sequence | A                        | min(prod_t r_t, C)                                |
| seq_mask   | sequence | A                        | 1{prod_t r_t in [1/C, C]}                         |
| geo_mask   | sequence | A                        | 1{(prod_t r_t)^(1/T_k) in [1/C, C]}               |

Each is built from the run's cap C (`algo.correction_cap`) and DC settings (`algo.dc`: signal,
tolerance, relative_tolerance, and for dc penalty, lr, lam_init, lam_max).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from deployrl.algo._tokens import real_tokens_only
from deployrl.algo.discrepancy import (
    dual_step,
    geo_mask_weights,
    mask_weights,
    seq_mask_weights,
    seq_tis_weights,
    shape_advantages,
    tis_weights,
    token_discrepancy,
)
from deployrl.registry import Registry

if TYPE_CHECKING:
    from deployrl.settings.config import DCConfig


@dataclass
class Measured:
    """A batch's train/inference discrepancy, as the prefix order measured it."""

    delta: torch.Tensor  # [B, T] delta on the tokens seen, 0 elsewhere
    seen: torch.Tensor  # [B, T] bool, the tokens whose logp_old the trainer computed
    mean: float  # mean D: exact when every token is seen, else the unbiased estimate from the kept ones


class Correction:
    """`none`: ignore the engine's log-probs (what most frameworks did until 2025). The base of the others."""

    whole_sequence = False  # token_terms needs logp_old on every real token of each row
    cap_above: Optional[float] = None  # the cap C must exceed this; None: the correction takes no cap

    def __init__(self, cap: float, dc: "DCConfig") -> None:
        self.check_cap(cap)
        self.cap, self.signal, self.relative_tolerance = cap, dc.signal, dc.relative_tolerance
        self.tolerance: Optional[float] = dc.tolerance  # c; None until measured

    @classmethod
    def check_cap(cls, cap: float) -> None:
        """The bound of the cap C (`cap_above`), for the config's check before anything loads."""
        if cls.cap_above is not None and not cap > cls.cap_above:
            raise ValueError(f"the cap of this correction must be > {cls.cap_above:g} (cap > {cls.cap_above:g}),"
                             f" got {cap}")

    def ready(self) -> bool:
        """Whether `token_terms` can weigh a batch before its discrepancy is measured."""
        return True

    def measure(self, measured: Measured) -> None:
        """c is set once, from the first batch with a token seen (`relative_tolerance` x its mean D),
        unless configured; the discrepancy of no token is 0, not D."""
        if self.tolerance is None and bool(measured.seen.any()) and math.isfinite(measured.mean):
            self.tolerance = self.relative_tolerance * measured.mean

    def token_terms(
        self, advantages: torch.Tensor, logp_old: torch.Tensor, logp_inf: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(advantages [b, T], weights [b, T]), both 0 outside `mask` [b, T] (real tokens whose logp_old
        is known). advantages [b, T] are the group advantages per token; logp_old, logp_inf [b, T]."""
        return real_tokens_only(advantages, mask), real_tokens_only(self.weights(logp_old, logp_inf, mask), mask)

    def weights(self, logp_old: torch.Tensor, logp_inf: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(logp_old)

    def after_update(self, measured: Measured) -> dict[str, float]:
        """What follows an applied optimizer update (the dual step of dc); its metrics."""
        return {}

    def metrics(self) -> dict[str, float]:
        return {"dc/tolerance": self.tolerance if self.tolerance is not None else math.nan, "dc/lambda": 0.0}

    def state_dict(self) -> dict[str, Optional[float]]:
        return {"tolerance": self.tolerance}

    def load_state_dict(self, state: dict[str, Optional[float]]) -> None:
        missing = set(self.state_dict()) - set(state)
        if missing:
            raise ValueError(f"correction state lacks {sorted(missing)}, got {sorted(state)}")
        self.tolerance = None if state["tolerance"] is None else float(state["tolerance"])


CORRECTIONS: Registry[type[Correction]] = Registry("mismatch correction")
CORRECTIONS.register("none")(Correction)


@CORRECTIONS.register("dc")
class DiscrepancyConstraint(Correction):
    """DC-GRPO: mean D <= c through lambda. A_hat = A - lambda * delta (`full`) or
    A - lambda * max(0, delta - c) (`hinge`); after each update lambda <- clip(lambda + lr (mean D - c), 0, lam_max)."""

    def __init__(self, cap: float, dc: "DCConfig") -> None:
        super().__init__(cap, dc)
        self.penalty, self.lr, self.lam_max, self.lam = dc.penalty, dc.lr, dc.lam_max, dc.lam_init

    def ready(self) -> bool:
        return self.tolerance is not None  # the hinge needs c, and lambda's target is c

    def token_terms(self, advantages, logp_old, logp_inf, mask):
        delta = token_discrepancy(logp_old, logp_inf, mask, self.signal)
        tolerance = self.tolerance if self.tolerance is not None else math.nan  # a NaN step is skipped
        shaped = shape_advantages(real_tokens_only(advantages, mask), delta, mask, self.lam, self.penalty, tolerance)
        return shaped, real_tokens_only(torch.ones_like(logp_old), mask)

    def after_update(self, measured: Measured) -> dict[str, float]:
        if not math.isfinite(measured.mean):
            raise ValueError(f"mean discrepancy must be finite, got {measured.mean}")
        used = self.lam
        self.lam = dual_step(self.lam, measured.mean, self.tolerance or 0.0, self.lr, self.lam_max)
        return {"dc/lambda_used": used}

    def metrics(self) -> dict[str, float]:
        return super().metrics() | {"dc/lambda": self.lam}

    def state_dict(self) -> dict[str, Optional[float]]:
        return super().state_dict() | {"lam": self.lam}

    def load_state_dict(self, state: dict[str, Optional[float]]) -> None:
        super().load_state_dict(state)
        lam = float(state["lam"])
        if not 0 <= lam <= self.lam_max:
            raise ValueError(f"correction state lam={lam} is outside [0, lam_max={self.lam_max}]")
        self.lam = lam


@CORRECTIONS.register("tis")
class TruncatedIS(Correction):
    """Truncated importance sampling per token: weight min(r_t, C)."""

    cap_above = 0.0

    def weights(self, logp_old, logp_inf, mask):
        return tis_weights(logp_old, logp_inf, mask, self.cap)


@CORRECTIONS.register("mask")
class TokenMask(Correction):
    """Token masking: weight 0 where r_t leaves [1/C, C]."""

    cap_above = 1.0

    def weights(self, logp_old, logp_inf, mask):
        return mask_weights(logp_old, logp_inf, mask, self.cap)


@CORRECTIONS.register("seq_tis")
class SequenceTruncatedIS(Correction):
    """Sequence-level truncated IS (TRL's sequence_truncate, verl's sequence TIS): min(prod_t r_t, C) per row."""

    cap_above, whole_sequence = 0.0, True

    def weights(self, logp_old, logp_inf, mask):
        return seq_tis_weights(logp_old, logp_inf, mask, self.cap)


@CORRECTIONS.register("seq_mask")
class SequenceMask(Correction):
    """Sequence-level masking (verl's sequence rejection): a row is dropped when prod_t r_t leaves [1/C, C]."""

    cap_above, whole_sequence = 1.0, True

    def weights(self, logp_old, logp_inf, mask):
        return seq_mask_weights(logp_old, logp_inf, mask, self.cap)


@CORRECTIONS.register("geo_mask")
class GeometricMask(Correction):
    """Geometric-mean masking (verl's geometric rejection): a row is dropped when its per-token
    geometric mean ratio leaves [1/C, C]."""

    cap_above, whole_sequence = 1.0, True

    def weights(self, logp_old, logp_inf, mask):
        return geo_mask_weights(logp_old, logp_inf, mask, self.cap)
