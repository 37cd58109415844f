"""Group-relative advantage estimators (critic-free).

* ``grpo``    — Shao et al. 2024 (DeepSeekMath): A_k = (r_k - mean r) / (std r + eps) with the
  population std (divide by K), so a group of two rewards {0, 1} gives A = ±1/(0.5 + eps).
  The default, kept so that recorded runs stay comparable.
* ``grpo_unbiased_std`` — the same with the sample std (divide by K - 1), verl's and TRL's
  choice: A is the ``grpo`` one divided by sqrt(K / (K - 1)) (1.41 at K = 2, 1.07 at K = 8).
* ``dr_grpo`` — Liu et al. 2025 (Dr. GRPO): A_k = r_k - mean r.
* ``rloo``    — Ahmadian et al. 2024: A_k = r_k - mean_{j != k} r_j.

Every estimator needs K >= 2: one completion has no other to be compared with (verl would
return r/(1 + eps) for GRPO), so `compute_advantages` raises instead of returning something.
A group whose rewards are all equal has A = 0 exactly, for every estimator: `compute_advantages`
sets it on the groups `zero_variance_groups` flags, the flag that also drops them before the
update (DAPO dynamic sampling). Left to the arithmetic, 0.1 x 7 in float32 has a mean ~1e-8
off, and GRPO divides that residual by std + eps ~ 1e-6 into advantages up to ~0.06.
"""

from __future__ import annotations

from typing import Callable

import torch

from deployrl.algo._checks import check_ndim, check_non_negative
from deployrl.algo._tokens import real_tokens_only
from deployrl.registry import Registry

AdvantageFn = Callable[[torch.Tensor, float], torch.Tensor]
ADVANTAGES: Registry[AdvantageFn] = Registry("advantage estimator")


def _std_normalised(rewards: torch.Tensor, eps: float, correction: int) -> torch.Tensor:
    """(r - mean r) / (std r + eps) per group, std with `correction` degrees of freedom removed."""
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    return centred / (rewards.std(dim=1, correction=correction, keepdim=True) + eps)


@ADVANTAGES.register("grpo")
def grpo_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """rewards [G, K] -> advantages [G, K], normalised by the group's population std (/K)."""
    return _std_normalised(rewards, eps, correction=0)


@ADVANTAGES.register("grpo_unbiased_std")
def grpo_unbiased_std_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """rewards [G, K] -> advantages [G, K], normalised by the group's sample std (/(K - 1))."""
    return _std_normalised(rewards, eps, correction=1)


@ADVANTAGES.register("dr_grpo")
def dr_grpo_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """rewards [G, K] -> advantages [G, K], centred but not scaled (`eps` unused)."""
    return rewards - rewards.mean(dim=1, keepdim=True)


@ADVANTAGES.register("rloo")
def rloo_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """rewards [G, K] -> advantages [G, K] against the leave-one-out mean (`eps` unused)."""
    k = rewards.shape[1]
    others_mean = (rewards.sum(dim=1, keepdim=True) - rewards) / (k - 1)
    return rewards - others_mean


def compute_advantages(name: str, rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Advantages [G, K] (float32) of rewards [G, K], K >= 2, by the registered estimator
    `name`; exactly 0 on the groups that `zero_variance_groups` flags."""
    estimator = ADVANTAGES.get(name)
    check_ndim("rewards", rewards, 2, "[G, K] (prompt groups x completions)")
    check_non_negative("eps", eps)
    if rewards.shape[1] < 2:
        raise ValueError(
            f"group advantages need at least 2 completions per group, got K={rewards.shape[1]}:"
            " one completion has no other to be compared with (rollout.group_size must be >= 2)"
        )
    rewards = rewards.to(torch.float32)
    return estimator(rewards, eps).masked_fill(zero_variance_groups(rewards)[:, None], 0.0)


def zero_variance_groups(rewards: torch.Tensor) -> torch.Tensor:
    """rewards [G, K] -> [G] bool, True where every reward in the group is equal.

    Compared in float32, the precision of `compute_advantages`, so that the groups flagged here
    are exactly those given A = 0 there, whatever the rewards' dtype.
    """
    check_ndim("rewards", rewards, 2, "[G, K] (prompt groups x completions)")
    rewards = rewards.to(torch.float32)
    return (rewards == rewards[:, :1]).all(dim=1)


def broadcast_to_tokens(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-completion advantages [G, K] (or [B]) -> per-token [B, T], zero on padding.

    Rows of `mask` [B, T] are the completions in group-major order (row g*K + k).
    """
    flat = advantages.reshape(-1)  # [B]
    if flat.shape[0] != mask.shape[0]:
        raise ValueError(
            f"advantages hold {flat.shape[0]} completions but mask has {mask.shape[0]} rows"
        )
    return real_tokens_only(flat[:, None], mask)  # [B, T]
