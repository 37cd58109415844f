"""Weights as an engine holds them: the rounding of each storage format, as pure functions on tensors.

An engine that stores a weight in a narrower format computes with the rounded weight. These
functions give that rounded weight in float32, bit for bit what the engine holds (tests check
each GGUF format against `gguf`'s own quantisers, which write the files llama.cpp loads):

* ``f32``, ``f16``, ``bf16``: a cast (round to nearest even);
* ``q8_0``, ``q4_0``, ``q4_1``: GGUF's blocks of 32 along each row, scales (and q4_1's minimum)
  stored in f16, with ggml's reference rounding;
* ``fp8_per_channel``: float8 e4m3 with a float32 scale per output row (absolute max / 448), as
  vLLM's online quantisation and the ``hf:fp8`` engine define it.

`held` chains them (vLLM's FP8 options quantise the bf16 weights it was given: ``bf16`` then
``fp8_per_channel``). `straight_through` makes a rounded weight differentiable as the identity,
which is how a trainer computes the engine's forward and still gets the gradient of its own
weights (quantisation-aware training). The weights are rounded; activations are not: an engine's
activation rounding cannot be reproduced outside its kernels (docs/engines.md, "Where the
discrepancy comes from").
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

GGUF_BLOCK = 32  # values per block of q8_0 / q4_0 / q4_1, along a row
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448


def _f16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).float()


def _blocks(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] float32 as blocks [N, K / 32, 32] of consecutive values of a row."""
    if w.dim() != 2 or w.shape[1] % GGUF_BLOCK:
        raise ValueError(f"GGUF block formats need [rows, columns] with columns a multiple of {GGUF_BLOCK},"
                         f" got {tuple(w.shape)}")
    return w.float().reshape(w.shape[0], -1, GGUF_BLOCK)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / d)


def q8_0(w: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N, K]: d = absmax / 127 per block, values round(w / d) (half away from zero) * f16(d)."""
    blocks = _blocks(w)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    scaled = blocks * _inverse(d)
    rounded = torch.sign(scaled) * (scaled.abs() + 0.5).floor()  # ggml's roundf, as gguf's np_roundf
    return (rounded * _f16(d)).reshape(w.shape)


def q4_0(w: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N, K]: d = (the value of largest magnitude) / -8 per block, 16 levels (q - 8) * f16(d)."""
    blocks = _blocks(w)
    largest = blocks.gather(-1, blocks.abs().argmax(dim=-1, keepdim=True))
    d = largest / -8
    q = (blocks * _inverse(d) + 8.5).trunc().clamp(0, 15)
    return ((q - 8) * _f16(d)).reshape(w.shape)


def q4_1(w: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N, K]: 16 levels from the block's minimum, f16(d) * q + f16(min), d = (max - min) / 15."""
    blocks = _blocks(w)
    low, high = blocks.amin(dim=-1, keepdim=True), blocks.amax(dim=-1, keepdim=True)
    d = (high - low) / 15
    q = ((blocks - low) * _inverse(d) + 0.5).trunc().clamp(0, 15)
    return (_f16(d) * q + _f16(low)).reshape(w.shape)


def quantize_fp8(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of values [N, K] -> (float8_e4m3fn [N, K], round to nearest even; float32 scales [N, 1],
    absolute max / 448, at least 1 / (448 * 512)): one scale per row, as the ``hf:fp8`` engine
    stores weights and quantises activations and as vLLM's online ``fp8_per_channel`` computes it.

    Both divisions are true divisions by tensors, as vLLM's are: a Python-float divisor is lowered
    to a multiplication by its reciprocal on GPUs, which rounds some scales the other way."""
    amax = values.detach().abs().amax(dim=-1, keepdim=True).float()
    fp8_max = amax.new_full((), FP8_MAX)  # filled on the device: no host copy per call (activations)
    scale = (amax / fp8_max).clamp_min(1.0 / (fp8_max * 512))
    return (values.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_per_channel(w: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N, K]: float8 e4m3 with one float32 scale per row (`quantize_fp8`), dequantised."""
    quantised, scale = quantize_fp8(w)
    return quantised.float() * scale


FORMATS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "f32": lambda w: w.float(),
    "f16": _f16,
    "bf16": lambda w: w.to(torch.bfloat16).float(),
    "q8_0": q8_0,
    "q4_0": q4_0,
    "q4_1": q4_1,
    "fp8_per_channel": fp8_per_channel,
}


def held(w: torch.Tensor, formats: Sequence[str]) -> torch.Tensor:
    """`w` rounded through `formats` in order (float32, same shape), what an engine computes with."""
    out = w.detach().float()
    for name in formats:
        out = FORMATS[name](out)
    return out


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
        return rounded.view_as(rounded)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def straight_through(w: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    """`rounded` (bit for bit, `w`'s shape and dtype) with the gradient of `w`: d out / d w = identity."""
    return _StraightThrough.apply(w, rounded.detach())
