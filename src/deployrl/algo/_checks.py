"""Argument checks shared by the algorithm modules; each error says what is wrong."""

from __future__ import annotations

import torch


def check_same_shape(**tensors: torch.Tensor) -> None:
    """Raise if the named tensors do not all have one shape."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{n}{list(s)}" for n, s in shapes.items())
        raise ValueError(f"shape mismatch: {listed} must all have the same shape")


def check_ndim(name: str, tensor: torch.Tensor, ndim: int, layout: str) -> None:
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must be {layout}, got shape {list(tensor.shape)}")


def check_positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")


def check_non_negative(name: str, value: float) -> None:
    if not value >= 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
