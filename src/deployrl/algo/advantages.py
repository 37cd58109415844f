"""Group-relative advantage estimators (critic-free).

* ``grpo``    — Shao et al. 2024 (DeepSeekMath): A_k = (r_k - mean r) / (std r + eps).
  The std is the population std (divide by K), so a group of two rewards {0, 1} gives
  A = ±1/(0.5 + eps); verl and TRL use the unbiased std, which only rescales A.
* ``dr_grpo`` — Liu et al. 2025 (Dr. GRPO): A_k = r_k - mean r.
* ``rloo``    — Ahmadian et al. 2024: A_k = r_k - mean_{j != k} r_j.

A group whose rewards are all equal has A = 0 for every estimator; `zero_variance_groups`
flags those groups so callers can drop them before the update (DAPO dynamic sampling).
"""

from __future__ import annotations

from typing import Callable

import torch

from deployrl.algo._checks import check_ndim, check_non_negative
from deployrl.registry import Registry

AdvantageFn = Callable[[torch.Tensor, float], torch.Tensor]
ADVANTAGES: Registry[AdvantageFn] = Registry("advantage estimator")


@ADVANTAGES.register("grpo")
def grpo_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """rewards [G, K] -> advantages [G, K], normalised by the group's std."""
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    return centred / (rewards.std(dim=1, unbiased=False, keepdim=True) + eps)


@ADVANTAGES.register("dr_grpo")
def dr_grpo_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """rewards [G, K] -> advantages [G, K], centred but not scaled (`eps` unused)."""
    return rewards - rewards.mean(dim=1, keepdim=True)


@ADVANTAGES.register("rloo")
def rloo_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """rewards [G, K] -> advantages [G, K] against the leave-one-out mean (needs K >= 2)."""
    k = rewards.shape[1]
    if k < 2:
        raise ValueError(f"rloo needs at least 2 completions per group, got K={k}")
    others_mean = (rewards.sum(dim=1, keepdim=True) - rewards) / (k - 1)
    return rewards - others_mean


def compute_advantages(name: str, rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Advantages [G, K] of rewards [G, K] by the registered estimator `name`."""
    estimator = ADVANTAGES.get(name)
    check_ndim("rewards", rewards, 2, "[G, K] (prompt groups x completions)")
    check_non_negative("eps", eps)
    return estimator(rewards.to(torch.float32), eps)


def zero_variance_groups(rewards: torch.Tensor) -> torch.Tensor:
    """rewards [G, K] -> [G] bool, True where every reward in the group is equal."""
    check_ndim("rewards", rewards, 2, "[G, K] (prompt groups x completions)")
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
    return flat[:, None] * mask.to(flat.dtype)  # [B, T]
