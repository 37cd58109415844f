"""Policy losses: PPO clipped surrogate, aggregations, KL estimators.

* Clipped surrogate — Schulman et al. 2017, with DAPO's clip-higher (Yu et al. 2025):
  separate eps_low / eps_high, and the optional dual clip of Ye et al. 2020 that bounds the
  loss of negative-advantage tokens at -c*A (c > 1).
* Aggregation is its own setting (verl's `agg_loss`): ``token_mean`` (DAPO),
  ``seq_mean_token_mean`` (GRPO), ``seq_mean_token_sum_norm`` (Dr. GRPO: a constant
  denominator, the maximum completion length).
* KL to a reference policy (Schulman's estimators): ``k1`` = log r, ``k2`` = (log r)^2 / 2,
  ``k3`` = exp(-log r) + log r - 1 with log r = logp - logp_ref.

Per-token weights (truncated IS, prefix-sampling 1/xi with zeros on dropped tokens, token
subsets) multiply each token's loss, the KL term included. The aggregation's denominator is
computed from `mask`, the real completion tokens, never from the weights: dividing by the
number of kept tokens would make the prefix-sampled loss a biased estimate of the full one.

Padding cannot matter, whatever it holds (NaN, inf, garbage): every masked reduction selects
real tokens with `torch.where` rather than multiplying by the mask (NaN * 0 is NaN), and
`policy_loss` replaces its inputs at padding before any arithmetic, so the loss and the
gradient are those of the real tokens alone. Conventions and how they differ from verl and
TRL: docs/algorithms.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from deployrl.algo._checks import check_non_negative, check_same_shape
from deployrl.algo._tokens import masked_mean, real_tokens_only
from deployrl.registry import Registry

KL_ESTIMATORS: Registry[Callable[[torch.Tensor], torch.Tensor]] = Registry("KL estimator")
# |log rho| is bounded before the exponential (verl's value): exp(20) ~ 4.9e8 is finite in
# float32 (the log-probs' dtype), so a clipped token's zero gradient never becomes 0 * inf = NaN.
MAX_LOG_RATIO = 20.0


@dataclass(frozen=True)
class Aggregation:
    """A loss reduction and its denominator.

    `reduce(values, real, max_length, count)` sums `values` [B, T] (0 at padding) and divides by
    `count`; `count(real)` is the denominator of a whole batch, real [B, T] bool. A batch split
    into micro-batches passes the whole batch's count to each, so their losses add up.
    """

    reduce: Callable[[torch.Tensor, torch.Tensor, Optional[float], torch.Tensor], torch.Tensor]
    count: Callable[[torch.Tensor], torch.Tensor]


AGGREGATIONS: Registry[Aggregation] = Registry("loss aggregation")


def _real_count(real: torch.Tensor) -> torch.Tensor:
    return real.sum()


def _row_count(real: torch.Tensor) -> torch.Tensor:
    return torch.tensor(real.shape[0])


def _token_mean(values, real, max_length, count):
    """sum over tokens / number of real tokens (DAPO)."""
    return values.sum() / count


def _seq_mean_token_mean(values, real, max_length, count):
    """Mean over sequences of each sequence's token mean (GRPO).

    A row without real tokens counts as a sequence with mean 0 (verl leaves it out): the
    denominator is the number of rows, fixed by the batch, like every other denominator here.
    """
    return (values.sum(dim=1) / real.sum(dim=1).clamp(min=1)).sum() / count


def _seq_mean_token_sum_norm(values, real, max_length, count):
    """sum over tokens / (sequences * max_length): Dr. GRPO's constant denominator (as TRL's
    `dr_grpo`; verl divides by max_length alone, so its loss grows with the batch)."""
    if max_length is None:
        raise ValueError("seq_mean_token_sum_norm needs max_length (the maximum completion length)")
    return values.sum() / (count * max_length)


AGGREGATIONS.register("token_mean")(Aggregation(_token_mean, _real_count))
AGGREGATIONS.register("seq_mean_token_mean")(Aggregation(_seq_mean_token_mean, _row_count))
AGGREGATIONS.register("seq_mean_token_sum_norm")(Aggregation(_seq_mean_token_sum_norm, _row_count))


def batch_denominator(mode: str, mask: torch.Tensor) -> torch.Tensor:
    """The count [] the aggregation `mode` divides the batch with real tokens `mask` [B, T] by:
    real tokens (token_mean) or rows (the others)."""
    return AGGREGATIONS.get(mode).count(mask.bool())


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    max_length: Optional[float] = None,
    denominator: Optional[float] = None,
) -> torch.Tensor:
    """Reduce per-token values [B, T] to a scalar by the aggregation `mode`.

    `mask` [B, T] marks real completion tokens; `values` at padding are ignored, whatever
    they hold. `denominator` replaces the batch's own count (`batch_denominator`): pass
    the whole batch's count when a batch is split into micro-batches, so that their losses add
    up to the batch loss.
    """
    aggregation = AGGREGATIONS.get(mode)
    check_same_shape(values=values, mask=mask)
    real = mask.bool()
    count = aggregation.count(real) if denominator is None else denominator
    return aggregation.reduce(real_tokens_only(values, real), real, max_length, count)


@KL_ESTIMATORS.register("k1")
def kl_k1(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio


@KL_ESTIMATORS.register("k2")
def kl_k2(log_ratio: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_ratio.square()


@KL_ESTIMATORS.register("k3")
def kl_k3(log_ratio: torch.Tensor) -> torch.Tensor:
    # not clamped (verl clamps k3 to [-10, 10]): that would zero the KL gradient of exactly
    # the tokens that drifted furthest, from log r < -2.6 on
    return torch.expm1(-log_ratio) + log_ratio


def kl_penalty(logp: torch.Tensor, logp_ref: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate [B, T] of KL(pi || pi_ref) from samples of pi."""
    return KL_ESTIMATORS.get(estimator)(logp - logp_ref)


@dataclass
class LossOutputs:
    """The scalar loss and per-token terms of one policy-loss evaluation."""

    loss: torch.Tensor  # []
    token_loss: torch.Tensor  # [B, T], before weights and aggregation; 0 at padding
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)  # scalars, no grad


def clipped_surrogate(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's per-token loss -min(rho*A, clip(rho, 1-eps_low, 1+eps_high)*A), all [B, T].

    rho = exp(clamp(logp - logp_old, -20, 20)), as in verl: beyond |log rho| = 20 the loss
    no longer depends on logp, and a token whose clipped branch is taken gets an exact zero
    gradient, finite even where exp(logp - logp_old) would overflow.
    Returns (loss, clipped) where `clipped` marks tokens whose clipped branch was taken.
    """
    ratio = torch.exp((logp - logp_old).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    unclipped = -advantages * ratio
    clipped_loss = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped_loss)
    clipped = clipped_loss > unclipped
    if dual_clip is not None:
        bounded = torch.minimum(loss, -advantages * dual_clip)
        loss = torch.where(advantages < 0, bounded, loss)
    return loss, clipped


def check_loss_settings(eps_low: float, eps_high: float, dual_clip: Optional[float], kl_coef: float) -> None:
    """The bounds of `policy_loss`'s settings (AlgoConfig checks its fields with this too)."""
    if not 0 <= eps_low < 1:
        raise ValueError(f"eps_low must lie in [0, 1) (the ratio is clipped below at 1 - eps_low), got {eps_low}")
    check_non_negative("eps_high", eps_high)
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    check_non_negative("kl_coef", kl_coef)


def policy_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: Optional[torch.Tensor] = None,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: Optional[float] = None,
    aggregation: str = "token_mean",
    max_length: Optional[float] = None,
    denominator: Optional[float] = None,
    logp_ref: Optional[torch.Tensor] = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
) -> LossOutputs:
    """The GRPO-family loss: clipped surrogate (+ beta*KL), weighted per token, aggregated.

    logp [B, T] (with grad), logp_old [B, T], advantages [B, T] (already shaped, e.g. by
    the discrepancy penalty), mask [B, T] real completion tokens, weights [B, T] per-token
    multipliers (None = 1), applied to the KL term too. The denominator of the aggregation
    depends on `mask` only; the loss, its gradient and the metrics do not depend on any input
    at padding. `token_loss` is 0 at padding.
    """
    check_same_shape(logp=logp, logp_old=logp_old, advantages=advantages, mask=mask)
    if weights is not None:
        check_same_shape(logp=logp, weights=weights)
    check_loss_settings(eps_low, eps_high, dual_clip, kl_coef)
    if kl_coef > 0 and logp_ref is None:
        raise ValueError("kl_coef > 0 needs logp_ref, the reference policy's log-probs")
    AGGREGATIONS.get(aggregation)

    real = mask.bool()
    # Selected away before any arithmetic, so that no NaN/inf at padding reaches a product
    # whose backward would multiply it by a zero gradient.
    logp, logp_old, advantages = (real_tokens_only(t, real) for t in (logp, logp_old, advantages))
    surrogate, clipped = clipped_surrogate(logp, logp_old, advantages, eps_low, eps_high, dual_clip)
    token_loss = surrogate
    metrics: dict[str, torch.Tensor] = {}
    if kl_coef > 0:
        kl = kl_penalty(logp, real_tokens_only(logp_ref, real), kl_estimator)
        token_loss = token_loss + kl_coef * kl
        metrics["kl_ref"] = masked_mean(kl.detach(), real)
    weighted = token_loss if weights is None else token_loss * real_tokens_only(weights, real)
    loss = aggregate(weighted, real, aggregation, max_length, denominator)

    with torch.no_grad():
        log_ratio = (logp - logp_old).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)  # the ratio the loss used
        metrics["clip_fraction"] = masked_mean(clipped.to(logp.dtype), real)
        metrics["approx_kl_old"] = masked_mean(kl_k3(log_ratio), real)
        metrics["ratio_mean"] = masked_mean(log_ratio.exp(), real)
    return LossOutputs(loss=loss, token_loss=token_loss, metrics=metrics)
