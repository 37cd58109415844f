"""Train/inference discrepancy and its control (DC-GRPO), plus the baselines it is compared with.

The rollout engine reports `logp_inf` for every token it sampled; the trainer recomputes
`logp_old` in training precision. Their gap is measured per token (delta), averaged per
trajectory (D_k), and constrained as mean_k D_k <= c through a Lagrange multiplier lambda:

    shaped advantage   A_hat[k,t] = A_k - lambda * delta[k,t]      (`full` penalty)
                                  = A_k - lambda * max(0, delta - c) (`hinge` penalty)
    dual update        lambda <- clip(lambda + eta * (mean D - c), 0, lambda_max)

(seed 000: discrepancy-constrained GRPO, black-box constraint, Lagrangian relaxation with one
dual-ascent step per training step). delta and lambda carry no gradient.

Baselines, per-token weights [B, T] (the corrections that use them: algo/corrections.py):
truncated importance sampling (`tis_weights`, min(exp(logp_old - logp_inf), C)), `mask_weights`
(0 for tokens whose ratio lies outside [1/C, C]), and their sequence-level forms, whose weight is
one per row: `seq_tis_weights` (the row's ratio prod_t exp(logp_old - logp_inf), truncated at C),
`seq_mask_weights` (the row is dropped when that ratio leaves [1/C, C]) and `geo_mask_weights`
(dropped when the per-token geometric mean ratio leaves [1/C, C]).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from deployrl.algo._checks import check_non_negative, check_positive, check_same_shape
from deployrl.algo._tokens import real_tokens_only
from deployrl.registry import Registry, unknown_name_error

SIGNALS: Registry[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = Registry(
    "discrepancy signal"
)
PENALTIES = ("full", "hinge")


@SIGNALS.register("diff")
def delta_diff(logp_old: torch.Tensor, logp_inf: torch.Tensor) -> torch.Tensor:
    """|p_old - p_inf|, bounded in [0, 1]."""
    return (logp_old.exp() - logp_inf.exp()).abs()


@SIGNALS.register("ratio")
def delta_ratio(logp_old: torch.Tensor, logp_inf: torch.Tensor) -> torch.Tensor:
    """|p_old / p_inf - 1|."""
    return torch.expm1(logp_old - logp_inf).abs()


@SIGNALS.register("log")
def delta_log(logp_old: torch.Tensor, logp_inf: torch.Tensor) -> torch.Tensor:
    """|logp_old - logp_inf|."""
    return (logp_old - logp_inf).abs()


def token_discrepancy(
    logp_old: torch.Tensor, logp_inf: torch.Tensor, mask: torch.Tensor, signal: str = "diff"
) -> torch.Tensor:
    """delta [B, T] between trainer and engine log-probs [B, T]; zero on padding."""
    fn = SIGNALS.get(signal)
    check_same_shape(logp_old=logp_old, logp_inf=logp_inf, mask=mask)
    return real_tokens_only(fn(logp_old.detach(), logp_inf.detach()), mask)


def trajectory_discrepancy(delta: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """D [B]: the mean of delta [B, T] over each completion's real tokens (0 if none); delta
    at padding is ignored, whatever it holds (selected away, not multiplied by 0)."""
    check_same_shape(delta=delta, mask=mask)
    return real_tokens_only(delta, mask).sum(dim=1) / mask.bool().sum(dim=1).clamp(min=1)


def discrepancy_estimate(delta: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """D_hat [B]: sum_t weights[t] * delta[t] over each completion's real tokens / its real-token count.

    delta, weights, mask [B, T]. With PS-PPO's weights keep / xi (0 where a token was not kept,
    so delta is needed on kept tokens only), E[keep_t / xi_t] = 1 makes D_hat unbiased for the
    trajectory discrepancy D: E[D_hat] = sum_t delta_t / T_k. The denominator is the real-token
    count, fixed by the rollout; dividing by the kept count instead would bias it.
    """
    check_same_shape(delta=delta, weights=weights, mask=mask)
    return trajectory_discrepancy(delta * weights, mask)  # padding is selected away, whatever it holds


def shape_advantages(
    advantages: torch.Tensor,
    delta: torch.Tensor,
    mask: torch.Tensor,
    lam: float,
    penalty: str = "full",
    tolerance: float = 0.0,
) -> torch.Tensor:
    """A_hat [B, T] = advantages - lam * penalty(delta); zero on padding.

    `full` penalises delta itself, `hinge` only its excess max(0, delta - tolerance).
    """
    check_same_shape(advantages=advantages, delta=delta, mask=mask)
    if penalty not in PENALTIES:
        raise unknown_name_error("discrepancy penalty", penalty, list(PENALTIES))
    check_non_negative("lam", lam)
    excess = delta if penalty == "full" else (delta - tolerance).clamp(min=0)
    return real_tokens_only(advantages - lam * excess.detach(), mask)


def dual_step(
    lam: float, mean_discrepancy: float, tolerance: float, lr: float, lam_max: float
) -> float:
    """One projected dual-ascent step: clip(lam + lr * (mean D - tolerance), 0, lam_max)."""
    return min(max(lam + lr * (mean_discrepancy - tolerance), 0.0), lam_max)


def check_dual_settings(tolerance: float, lr: float, lam_max: float, lam: float, lam_name: str = "lam") -> None:
    """The bounds of the dual ascent's settings; `lam_name` is what the caller calls the initial
    multiplier (DCConfig checks its fields with this: its lam_init)."""
    check_non_negative("tolerance", tolerance)
    check_positive("lr", lr)
    check_positive("lam_max", lam_max)
    if not 0 <= lam <= lam_max:
        raise ValueError(f"{lam_name} must lie in [0, lam_max={lam_max}], got {lam}")


def tis_weights(logp_old: torch.Tensor, logp_inf: torch.Tensor, mask: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance weights min(exp(logp_old - logp_inf), cap), [B, T].

    No log-ratio bound is needed: an overflow to inf is clamped to `cap`, and the weights carry
    no gradient, so no 0 * inf can arise in a backward.
    """
    return torch.exp(logp_old - logp_inf).clamp(max=cap).detach()


def mask_weights(logp_old: torch.Tensor, logp_inf: torch.Tensor, mask: torch.Tensor, cap: float) -> torch.Tensor:
    """1 where exp(logp_old - logp_inf) lies in [1/cap, cap], else 0, [B, T]; compared in
    log space (no exponential), a NaN log-ratio gets 0."""
    log_ratio = (logp_old - logp_inf).detach()
    return (log_ratio.abs() <= math.log(cap)).to(logp_old.dtype)


def sequence_log_ratio(logp_old: torch.Tensor, logp_inf: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log of the sequence ratio pi_old(o) / pi_inf(o) = sum over real tokens of logp_old - logp_inf, [B]."""
    return real_tokens_only((logp_old - logp_inf).detach(), mask).sum(dim=1)


def seq_tis_weights(logp_old: torch.Tensor, logp_inf: torch.Tensor, mask: torch.Tensor, cap: float) -> torch.Tensor:
    """Sequence-level truncated IS: min(pi_old(o) / pi_inf(o), cap) on every token of the row, [B, T]."""
    return sequence_log_ratio(logp_old, logp_inf, mask).exp().clamp(max=cap)[:, None].expand_as(logp_old)


def seq_mask_weights(logp_old: torch.Tensor, logp_inf: torch.Tensor, mask: torch.Tensor, cap: float) -> torch.Tensor:
    """Sequence-level masking: 1 on every token of a row whose ratio pi_old(o) / pi_inf(o) lies in
    [1/cap, cap], 0 on the whole row otherwise (compared in log space), [B, T]."""
    inside = sequence_log_ratio(logp_old, logp_inf, mask).abs() <= math.log(cap)
    return inside.to(logp_old.dtype)[:, None].expand_as(logp_old)


def geo_mask_weights(logp_old: torch.Tensor, logp_inf: torch.Tensor, mask: torch.Tensor, cap: float) -> torch.Tensor:
    """Geometric-mean masking: 1 on every token of a row whose per-token geometric mean ratio
    exp(mean_t (logp_old - logp_inf)) lies in [1/cap, cap], else 0 on the whole row, [B, T].
    Unlike the sequence ratio, it does not grow with the length, so one cap suits every length."""
    mean = sequence_log_ratio(logp_old, logp_inf, mask) / mask.bool().sum(dim=1).clamp(min=1)
    return (mean.abs() <= math.log(cap)).to(logp_old.dtype)[:, None].expand_as(logp_old)


def _bucket_means(
    values: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, edges: Sequence[float], prefix: str
) -> dict[str, torch.Tensor]:
    """Mean of `values` over real tokens whose key falls in [edges[i], edges[i+1]); NaN if empty."""
    edge_t = torch.tensor(edges, dtype=keys.dtype)
    index = torch.bucketize(keys[mask], edge_t[1:-1], right=True)  # [N]
    sums = torch.zeros(len(edges) - 1, dtype=values.dtype).index_add_(0, index, values[mask])
    counts = torch.zeros(len(edges) - 1, dtype=values.dtype).index_add_(
        0, index, torch.ones_like(values[mask])
    )
    means = sums / counts  # NaN where a bucket is empty
    return {f"{prefix}/{edges[i]:g}-{edges[i + 1]:g}": means[i] for i in range(len(edges) - 1)}


def discrepancy_summary(
    delta: torch.Tensor,
    mask: torch.Tensor,
    logp_old: torch.Tensor,
    tolerance: float,
    prob_edges: Sequence[float] = (0.0, 0.1, 0.5, 0.9, 0.99, 1.0),
    position_edges: Sequence[float] = (0, 16, 64, 256, 1024, math.inf),
) -> dict[str, torch.Tensor]:
    """Scalars for logging: mean D, max delta, fraction of tokens over the tolerance, and the
    mean delta by the trainer's token probability and by completion position (0-based).
    All inputs [B, T]; bucket means are NaN where a bucket holds no token.
    """
    check_same_shape(delta=delta, mask=mask, logp_old=logp_old)
    real = mask.bool()
    with torch.no_grad():
        summary = {
            "mean_D": trajectory_discrepancy(delta, mask).mean(),
            "max_delta": delta[real].max() if real.any() else delta.new_zeros(()),
            "frac_over_tolerance": (delta[real] > tolerance).to(delta.dtype).mean(),
        }
        positions = torch.arange(delta.shape[1], dtype=delta.dtype).expand_as(delta)
        summary |= _bucket_means(delta, logp_old.exp(), real, prob_edges, "delta_by_prob")
        summary |= _bucket_means(delta, positions, real, position_edges, "delta_by_pos")
    return summary
