"""Selection of real completion tokens, shared by the algorithm modules.

Padding is selected away with `torch.where`, never multiplied by the mask: NaN * 0 is NaN, and
a NaN or inf at padding must not reach a sum, or a product whose backward it would poison.
"""

from __future__ import annotations

import torch


def real_tokens_only(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """values [B, T] (or broadcastable to mask) with padding (mask == 0) replaced by 0, [B, T]."""
    return torch.where(mask.bool(), values, values.new_zeros(()))


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean [] of values [B, T] over real tokens (NaN when there is none)."""
    return real_tokens_only(values, mask).sum() / mask.sum()
