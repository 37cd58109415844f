"""Prefix sampling for PS-PPO: cutoff laws, cutoff draws, 1/xi weights, and their proxies.

Source: seed 004 (PS-PPO). For one prompt group of K completions, T positions, n_t the number
of completions still alive at position t (1-based in the math, 0-based in the code), a cutoff
law xi_t = Pr(H >= t) is non-increasing in t. Completion k draws U ~ Uniform(0, 1) and keeps
positions t <= H_k = max{t <= T_k : xi_t >= U}; each kept token's loss is multiplied by 1/xi_t,
so E[1{H >= t} / xi_t] = 1 and the expected loss equals the full-trajectory loss, provided its
normaliser does not depend on H (see `deployrl.algo.losses`).

The ``optimized`` law minimises the variance surrogate sum_t W_t / xi_t subject to
sum_t n_t xi_t <= K*B, xi non-increasing, xi_min <= xi_t <= 1, with W_t = sum_{k alive} w[k,t].
Its solution is xi_t = clip(sqrt(v_hat_t) / mu, xi_min, 1), v_hat the non-increasing isotonic
regression of v_t = W_t / n_t with weights n_t (scipy's PAV), and mu found by bisection so the
budget binds. Every other budgeted law is a fixed non-increasing shape f_t scaled the same way,
xi_t = clip(s * f_t, xi_min, 1), so one budget fit serves them all:

* ``full``      xi = 1 (no budget);
* ``uniform``   f_t = (T - t + 1) / T  (at s = 1 the cutoff is uniform on 1..T);
* ``temporal``  f_t = 1 / t            (priority to early tokens);
* ``heuristic`` the optimized solver fed a heuristic w (next-token entropy, by convention);
* ``optimized`` the solver fed w = gamma * u (gradient-norm proxy x reward uncertainty);
* ``sgrpo``     the S-GRPO baseline: every token kept independently with one probability q
                (constant f), weight 1/q. It samples tokens, not prefixes.

The proxies come from the trainer (a no-grad pass over every token: `group_stats`) or from the
rollout engine, which holds each sampled token's next-token distribution anyway
(`engine_proxies`: its entropy, sum p^2 and m most likely tokens). Any law keeps the gradient
unbiased; the proxies only set its variance.

Deviation from the seed: the seed writes the surrogate as sum_t w_t (1/xi_t - 1); the constant
term does not change the minimiser, so it is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional

import numpy as np
import torch
from scipy.optimize import isotonic_regression

from deployrl.algo._checks import check_ndim, check_positive, check_same_shape
from deployrl.algo.logprobs import RAW, SamplingView, processed_logits, vocab_stats
from deployrl.registry import Registry, unknown_name_error

ShapeFn = Callable[[np.ndarray, Optional[np.ndarray]], np.ndarray]
UNCERTAINTY_METRICS = ("tv", "l2")


def uniform_shape(n_alive: np.ndarray, weights: Optional[np.ndarray]) -> np.ndarray:
    t = len(n_alive)
    return (t - np.arange(t)) / t


def temporal_shape(n_alive: np.ndarray, weights: Optional[np.ndarray]) -> np.ndarray:
    return 1.0 / np.arange(1, len(n_alive) + 1)


def constant_shape(n_alive: np.ndarray, weights: Optional[np.ndarray]) -> np.ndarray:
    return np.ones(len(n_alive))


def optimal_shape(n_alive: np.ndarray, weights: Optional[np.ndarray]) -> np.ndarray:
    """sqrt of the non-increasing isotonic regression of W_t / n_t (weights n_t)."""
    v = weights / n_alive
    v_hat = isotonic_regression(v, weights=n_alive, increasing=False).x
    return np.sqrt(np.clip(v_hat, 0.0, None))


def entropy_weights(proxies: Mapping[str, torch.Tensor], group_size: int) -> torch.Tensor:
    """w [B, T] = the next-token entropy (the heuristic law)."""
    return proxies["entropy"]


def gradient_uncertainty_weights(proxies: Mapping[str, torch.Tensor], group_size: int) -> torch.Tensor:
    """w [B, T] = gamma [B, T] x u [G, T] of the completion's group (the optimized law)."""
    return proxies["grad_norm"] * proxies["uncertainty"].repeat_interleave(group_size, dim=0)


@dataclass(frozen=True)
class CutoffStrategy:
    """How a strategy shapes its law and draws the kept tokens.

    `proxies` names the trainer-side statistics its token weights w are made of: ``entropy``
    [B, T], ``grad_norm`` (gamma) [B, T], ``uncertainty`` (u) [G, T]; `token_weights(proxies,
    group_size)` makes w [B, T] from them.
    """

    shape: Optional[ShapeFn]  # None: xi = 1, no budget
    proxies: tuple[str, ...] = ()
    token_weights: Optional[Callable[[Mapping[str, torch.Tensor], int], torch.Tensor]] = None
    independent_tokens: bool = False  # True: Bernoulli per token (S-GRPO), not a prefix

    @property
    def budgeted(self) -> bool:
        """Whether the law cuts anything (its budget binds), unlike ``full``."""
        return self.shape is not None

    @property
    def uses_uncertainty(self) -> bool:
        """Whether its token weights include the reward uncertainty u (from the top tokens of each
        sampled distribution, when the engine reports them)."""
        return "uncertainty" in self.proxies


STRATEGIES: Registry[CutoffStrategy] = Registry("cutoff strategy")
STRATEGIES.register("full")(CutoffStrategy(shape=None))
STRATEGIES.register("uniform")(CutoffStrategy(shape=uniform_shape))
STRATEGIES.register("temporal")(CutoffStrategy(shape=temporal_shape))
STRATEGIES.register("heuristic")(CutoffStrategy(optimal_shape, ("entropy",), entropy_weights))
STRATEGIES.register("optimized")(
    CutoffStrategy(optimal_shape, ("grad_norm", "uncertainty"), gradient_uncertainty_weights)
)
STRATEGIES.register("sgrpo")(CutoffStrategy(shape=constant_shape, independent_tokens=True))


def law_weights(strategy: str, proxies: Mapping[str, torch.Tensor], group_size: int) -> Optional[torch.Tensor]:
    """The token weights w [B, T] the cutoff `strategy` is solved with (None: it needs none)."""
    spec = STRATEGIES.get(strategy)
    if spec.token_weights is None:
        return None
    missing = [name for name in spec.proxies if proxies.get(name) is None]
    if missing:
        raise ValueError(f"cutoff strategy {strategy!r} needs the proxies {missing}")
    return spec.token_weights(proxies, group_size)


def fit_to_budget(
    shape: np.ndarray, n_alive: np.ndarray, total_budget: float, xi_min: float, iters: int = 200
) -> np.ndarray:
    """xi = clip(s * shape, xi_min, 1) with the largest s such that sum n * xi <= total_budget.

    shape [T] >= 0, n_alive [T] > 0. If even xi = 1 (or xi = 1 wherever shape > 0) fits in the
    budget, that is returned: the budget does not bind.
    """
    if n_alive.sum() <= total_budget:
        return np.ones_like(shape)
    positive = shape > 0
    if not positive.any():
        return np.full_like(shape, xi_min)

    def spent(scale: float) -> float:
        return float((n_alive * np.clip(scale * shape, xi_min, 1.0)).sum())

    hi = 1.0 / shape[positive].min()
    if spent(hi) <= total_budget:
        return np.clip(hi * shape, xi_min, 1.0)
    lo = 0.0
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if spent(mid) <= total_budget else (lo, mid)
        if hi - lo <= 1e-15 * hi:
            break
    return np.clip(lo * shape, xi_min, 1.0)


def variance_surrogate(xi: torch.Tensor, group_weights: torch.Tensor) -> torch.Tensor:
    """sum_t W_t / xi_t over positions with W_t > 0; xi, W [..., T] -> [...]."""
    terms = torch.where(group_weights > 0, group_weights / xi, torch.zeros_like(xi))
    return terms.sum(dim=-1)


def alive_counts(mask: torch.Tensor, group_size: int) -> torch.Tensor:
    """n [G, T]: completions of each group still alive at each position, from mask [B, T]."""
    return mask.reshape(-1, group_size, mask.shape[1]).to(torch.float64).sum(dim=1)


def group_weight_sums(token_weights: torch.Tensor, mask: torch.Tensor, group_size: int) -> torch.Tensor:
    """W [G, T] = sum over alive completions of w [B, T]."""
    w = (token_weights.to(torch.float64) * mask).reshape(-1, group_size, mask.shape[1])
    return w.sum(dim=1)


def check_law_settings(budget: float, xi_min: float) -> None:
    """The bounds of a cutoff law's settings: budget B > 0 and xi_min in (0, 1]."""
    check_positive("budget", budget)
    if not 0 < xi_min <= 1:
        raise ValueError(f"xi_min must lie in (0, 1], got {xi_min}")


def cutoff_law(
    strategy: str,
    mask: torch.Tensor,
    group_size: int,
    budget: float,
    xi_min: float = 0.01,
    token_weights: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The inclusion probabilities xi [G, T] of each prompt group (0 beyond its longest row).

    mask [B, T] real completion tokens, rows group-major (row g*K + k) and contiguous from
    position 0; `budget` B is the expected number of backpropagated tokens per completion;
    token_weights [B, T] is w (>= 0) for strategies that need it (heuristic, optimized).
    """
    spec = STRATEGIES.get(strategy)
    check_ndim("mask", mask, 2, "[B, T] (completions x positions)")
    if group_size < 1 or mask.shape[0] % group_size:
        raise ValueError(f"mask has {mask.shape[0]} rows, not a multiple of group_size={group_size}")
    check_law_settings(budget, xi_min)
    if spec.token_weights is not None:
        if token_weights is None:
            raise ValueError(f"cutoff strategy {strategy!r} needs token_weights [B, T]")
        check_same_shape(token_weights=token_weights, mask=mask)
        if (token_weights < 0).any() or not torch.isfinite(token_weights).all():
            raise ValueError("token_weights must be finite and >= 0")

    n_alive = alive_counts(mask, group_size).numpy()  # [G, T]
    weight_sums = (
        group_weight_sums(token_weights, mask, group_size).numpy() if spec.token_weights is not None else None
    )
    total_budget = group_size * budget
    xi = np.zeros_like(n_alive)
    for g, n_g in enumerate(n_alive):
        length = int((n_g > 0).sum())
        if length == 0:
            continue
        n = n_g[:length]
        if spec.shape is None:
            xi[g, :length] = 1.0
            continue
        if xi_min * n.sum() > total_budget:
            raise ValueError(
                f"xi_min={xi_min} keeps {xi_min * n.sum():.1f} tokens of group {g} in expectation,"
                f" above the budget K*B={total_budget:g}; lower xi_min or raise the budget"
            )
        w = weight_sums[g, :length] if weight_sums is not None else None
        xi[g, :length] = fit_to_budget(spec.shape(n, w), n, total_budget, xi_min)
    return torch.from_numpy(xi)


@dataclass
class PrefixPlan:
    """Which tokens the graded pass backpropagates, and with which weights."""

    xi: torch.Tensor  # [B, T] inclusion probability of each token, 0 on padding
    keep: torch.Tensor  # [B, T] bool, tokens that enter the loss
    weights: torch.Tensor  # [B, T] keep / xi, the unbiasing weights (0 where not kept)
    cutoffs: torch.Tensor  # [B] long, positions >= cutoff are never needed by the graded pass
    expected_tokens: torch.Tensor  # [] expected number of kept tokens, sum of xi


def sample_plan(
    strategy: str, xi_groups: torch.Tensor, mask: torch.Tensor, generator: torch.Generator
) -> PrefixPlan:
    """Draw the kept tokens from a law xi_groups [G, T] for completions mask [B, T].

    Prefix strategies draw one U per completion (H = max{t < length : xi_t >= U}); S-GRPO
    draws one U per token.
    """
    spec = STRATEGIES.get(strategy)
    group_size = mask.shape[0] // xi_groups.shape[0]
    real = mask.bool()
    xi = xi_groups.repeat_interleave(group_size, dim=0).to(torch.float32) * real  # [B, T]
    if spec.independent_tokens:
        draws = torch.rand(mask.shape, generator=generator)  # [B, T]
        keep = real & (draws < xi)
        positions = torch.arange(1, mask.shape[1] + 1).expand_as(keep)
        cutoffs = (positions * keep).amax(dim=1)
    else:
        draws = torch.rand(mask.shape[0], 1, generator=generator)  # [B, 1]
        keep = real & (xi >= draws)  # a prefix, since xi is non-increasing
        cutoffs = keep.sum(dim=1)
    weights = torch.where(keep, 1.0 / xi, torch.zeros_like(xi))
    return PrefixPlan(xi=xi, keep=keep, weights=weights, cutoffs=cutoffs, expected_tokens=xi.sum())


def grad_norm_proxy(logp_token: torch.Tensor, sum_p2: torch.Tensor, hidden_norm: torch.Tensor) -> torch.Tensor:
    """gamma [B, T]: the norm of the output head's gradient of log p(o_t).

    d log p(o_t) / d W_head = (e_{o_t} - p_t) h_t^T, whose norm is
    ||e_{o_t} - p_t|| * ||h_t|| = sqrt(1 - 2 p(o_t) + sum_v p_v^2) * ||h_t||.
    """
    check_same_shape(logp_token=logp_token, sum_p2=sum_p2, hidden_norm=hidden_norm)
    sq = 1.0 - 2.0 * logp_token.exp() + sum_p2
    return sq.clamp(min=0).sqrt() * hidden_norm


@dataclass
class GroupStats:
    """One group's no-grad output-head pass: per-token statistics [K, T] (zero on padding) and
    the reward uncertainty u [T]."""

    logp: torch.Tensor
    entropy: Optional[torch.Tensor]  # only when asked for: one more [N, V] tensor per chunk
    sum_p2: torch.Tensor
    hidden_norm: torch.Tensor
    uncertainty: torch.Tensor


def group_stats(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    targets: torch.Tensor,
    mask: torch.Tensor,
    success: torch.Tensor,
    metric: str = "tv",
    view: SamplingView = RAW,
    chunk_size: int = 64,
    with_entropy: bool = False,
) -> GroupStats:
    """log p, entropy and sum p^2 of each target, and u [T]: the distance between the mean
    next-token distributions of the successful and unsuccessful completions of one group.

    hidden [K, T, D] final hidden states, head_weight [V, D], targets [K, T] long, mask [K, T],
    success [K] bool. Distributions are softmax(h W^T) processed by `view` (the sampling
    semantics); each class's mean is over its completions alive at t. The per-token statistics
    and u come from the same probabilities of a chunk's real tokens (at most [K * chunk_size, V]),
    so the optimized cutoff law costs one output-head pass, and no [K, T, V] tensor exists.
    Where one class has no completion alive, u carries the last defined value forward
    (depth beyond the evidence: assume the uncertainty is unchanged); a group with an empty
    class has no evidence at all and gets u = 1 everywhere (no preference between positions).
    """
    if metric not in UNCERTAINTY_METRICS:
        raise unknown_name_error("uncertainty metric", metric, list(UNCERTAINTY_METRICS))
    check_ndim("hidden", hidden, 3, "[K, T, D]")
    if not (tuple(mask.shape) == tuple(targets.shape) == tuple(hidden.shape[:2])) or tuple(success.shape) != (hidden.shape[0],):
        raise ValueError(
            f"hidden {list(hidden.shape)}, targets {list(targets.shape)}, mask {list(mask.shape)} and success"
            f" {list(success.shape)} must be [K, T, D], [K, T], [K, T] and [K]"
        )
    length = hidden.shape[1]
    real = mask.bool()
    classes = torch.stack([success, ~success]).to(torch.float32)  # [2, K]
    u = torch.full((length,), float("nan"))
    stats = torch.zeros(3, *mask.shape)  # logp, entropy, sum p^2; only real tokens are written, padding stays 0
    with torch.no_grad():
        for start in range(0, length, chunk_size):
            window = real[:, start : start + chunk_size]  # [K, C]
            if not window.any():
                continue
            counts = classes @ window.to(torch.float32)  # [2, C]: completions of each class alive at t
            # u = dist(sum_k w_kt p_kt), with w = 1/n_success on successes and -1/n_failure on failures
            signed = classes[:, :, None] / counts.clamp(min=1)[:, None, :] * window  # [2, K, C]
            rows, columns = window.nonzero(as_tuple=True)  # only real tokens go through the head
            positions = start + columns
            stats[:, rows, positions], dist = _group_chunk(
                hidden[rows, positions], head_weight, targets[rows, positions],
                (signed[0] - signed[1])[rows, columns], columns, window.shape[1], metric, view, with_entropy,
            )
            u[start : start + chunk_size] = torch.where((counts > 0).all(dim=0), dist, torch.nan)
        norm = hidden.detach().float().norm(dim=-1) * real
    return GroupStats(
        logp=stats[0], entropy=stats[1] if with_entropy else None, sum_p2=stats[2], hidden_norm=norm,
        uncertainty=_carry_forward(u),
    )


def engine_proxies(
    logp: torch.Tensor, stats: Mapping[str, torch.Tensor], mask: torch.Tensor, success: torch.Tensor,
    metric: str = "tv",
) -> dict[str, torch.Tensor]:
    """The cutoff-law proxies from what a rollout engine reported while sampling.

    logp [B, T] the sampled tokens' log-probs, `stats` the engine's per-token statistics of the
    same distribution: ``entropy`` [B, T], ``sum_p2`` [B, T], ``top_ids`` and ``top_logp``
    [B, T, m] (its m most likely next tokens); mask [B, T]; success [G, K] bool. Returns
    entropy [B, T], grad_norm [B, T] = sqrt(1 - 2 p(o_t) + sum p^2) (gamma without ||h||, which
    an engine does not report: every hidden state counts as norm 1) and uncertainty [G, T] from
    the top-m distributions (`sparse_uncertainty`).
    """
    real = mask.bool()
    ones = real.to(logp.dtype)
    return {
        "entropy": stats["entropy"] * ones,
        "grad_norm": grad_norm_proxy(logp * ones, stats["sum_p2"] * ones, ones),
        "uncertainty": sparse_uncertainty(stats["top_ids"], stats["top_logp"], real, success, metric),
    }


def sparse_uncertainty(
    top_ids: torch.Tensor, top_logp: torch.Tensor, mask: torch.Tensor, success: torch.Tensor, metric: str = "tv"
) -> torch.Tensor:
    """u [G, T] of `group_stats` from each token's m most likely next tokens only.

    top_ids [B, T, m] long, top_logp [B, T, m], mask [B, T], success [G, K] bool (B = G*K, rows
    group-major). Each distribution is its top m probabilities plus one bucket for the rest (the
    tail, 1 - their sum), so the class means and their distance are those of this coarser
    distribution: equal to the full u when the top m hold all the mass (m >= the support, as with
    top-k sampling at k <= m), an approximation otherwise. l2 leaves the tail out. The same
    rules as `group_stats` where a class has no completion alive.
    """
    if metric not in UNCERTAINTY_METRICS:
        raise unknown_name_error("uncertainty metric", metric, list(UNCERTAINTY_METRICS))
    check_ndim("top_ids", top_ids, 3, "[B, T, m]")
    check_same_shape(top_ids=top_ids, top_logp=top_logp)
    groups, k = success.shape
    b, t, m = top_ids.shape
    if b != groups * k or tuple(mask.shape) != (b, t):
        raise ValueError(f"top_ids {list(top_ids.shape)}, mask {list(mask.shape)} and success {list(success.shape)}"
                         " must be [G*K, T, m], [G*K, T] and [G, K]")
    alive = mask.bool().reshape(groups, k, t).to(torch.float64)
    classes = torch.stack([success, ~success], dim=1).to(torch.float64)  # [G, 2, K]
    counts = classes @ alive  # [G, 2, T]: completions of each class alive at t
    # a token's signed weight: 1/n_success for successes, -1/n_failure for failures, 0 at padding
    per_class = classes[:, :, :, None] * alive[:, None] / counts.clamp(min=1)[:, :, None, :]  # [G, 2, K, T]
    weight = (per_class[:, 0] - per_class[:, 1])  # [G, K, T]
    probs = top_logp.to(torch.float64).exp().reshape(groups, k, t, m) * alive[..., None]  # [G, K, T, m]
    tail = (alive - probs.sum(-1)).clamp(min=0)  # [G, K, T]
    ids = top_ids.reshape(groups, k, t, m).permute(0, 2, 1, 3).reshape(groups * t, k * m)  # [G*T, K*m]
    values = (weight[..., None] * probs).permute(0, 2, 1, 3).reshape(groups * t, k * m)
    diff = _segment_sums(ids, values)  # [G*T, K*m]: class-mean difference per distinct token
    tail_diff = (weight * tail).sum(dim=1).reshape(-1)  # [G*T]
    if metric == "tv":
        dist = 0.5 * (diff.abs().sum(-1) + tail_diff.abs())
    else:
        dist = torch.linalg.vector_norm(diff, dim=-1)
    defined = (counts > 0).all(dim=1).reshape(-1)  # both classes alive at t
    u = torch.where(defined, dist, torch.nan).reshape(groups, t).to(torch.float32)
    return torch.stack([_carry_forward(row) for row in u]) if groups else u


def _segment_sums(ids: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Per row of ids [R, N], the sum of `values` [R, N] over each distinct id, at that id's last
    place in sorted order and 0 elsewhere (so |.| and squares sum over distinct ids)."""
    ids, order = ids.sort(dim=-1)
    total = values.gather(-1, order).cumsum(dim=-1)
    last = torch.ones_like(ids, dtype=torch.bool)
    last[:, :-1] = ids[:, 1:] != ids[:, :-1]  # the last place of each distinct id
    places = torch.arange(ids.shape[1]).expand_as(ids)
    before = torch.where(last, places, -1).cummax(dim=-1).values  # [R, N]: the last end at or before each place
    previous = torch.nn.functional.pad(before[:, :-1], (1, 0), value=-1)  # the end strictly before
    start_total = torch.where(previous >= 0, total.gather(-1, previous.clamp(min=0)), torch.zeros_like(total))
    return torch.where(last, total - start_total, torch.zeros_like(total))


def _group_chunk(
    hidden: torch.Tensor, head_weight: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor,
    columns: torch.Tensor, width: int, metric: str, view: SamplingView, with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of `group_stats` over its N real tokens: hidden [N, D], targets [N], class
    weights [N] and column in the chunk [N] -> (logp, entropy or 0, sum p^2) [3, N] and the
    class distance [width]. A function, so that its [N, V] temporaries are freed before the
    next chunk allocates its own."""
    logp_all = processed_logits(hidden.float() @ head_weight.float().T, view).log_softmax(dim=-1)  # [N, V]
    logp = logp_all.gather(-1, targets[:, None])[:, 0]
    entropy, sum_p2, probs = vocab_stats(logp_all, with_entropy)
    del logp_all
    diff = probs.new_zeros(width, probs.shape[1]).index_add_(0, columns, probs.mul_(weights[:, None]))  # [C, V]
    dist = 0.5 * diff.abs_().sum(-1) if metric == "tv" else torch.linalg.vector_norm(diff, dim=-1)
    entropy = entropy[:, 0] if with_entropy else torch.zeros_like(logp)
    return torch.stack([logp, entropy, sum_p2[:, 0]]), dist


def _carry_forward(values: torch.Tensor) -> torch.Tensor:
    """Replace NaNs [T] by the last finite value before them (by 1 if there is none)."""
    positions = torch.arange(len(values))
    last_finite = torch.where(torch.isnan(values), -1, positions).cummax(dim=0).values  # [T]
    return torch.where(last_finite >= 0, values[last_finite.clamp(min=0)], 1.0)
