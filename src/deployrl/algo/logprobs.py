"""Token log-probabilities from final hidden states, in chunks: never a [B, T, V] tensor.

The output head is applied to `chunk_tokens` real tokens at a time; with gradients, each chunk
is recomputed in the backward pass (activation checkpointing), so the logits held at any
moment are [chunk_tokens, V] whether or not autograd is on.

Log-probability semantics must match the engine that sampled the tokens: ``raw`` is the model
distribution softmax(z); ``processed`` is the distribution the engine sampled from,
softmax(z / temperature) renormalised over the top-k / top-p support (top-p keeps the
smallest set of most likely tokens whose mass reaches p, as in Holtzman et al. 2020 and the
HF / llama.cpp samplers). A sampled token outside the trainer's processed support gets
log-prob -inf: the caller decides what to do with it (`outside_support` counts them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.utils.checkpoint import checkpoint

from deployrl.algo._checks import check_positive


@dataclass(frozen=True)
class SamplingView:
    """Which distribution a log-probability refers to: the model's logits processed by these."""

    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0

    def __post_init__(self) -> None:
        check_positive("temperature", self.temperature)
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")

    @property
    def is_raw(self) -> bool:
        return self.temperature == 1.0 and self.top_k == 0 and self.top_p == 1.0


RAW = SamplingView()


def processed_logits(logits: torch.Tensor, view: SamplingView) -> torch.Tensor:
    """Logits [N, V] -> logits of the processed distribution, -inf outside its support."""
    z = logits / view.temperature if view.temperature != 1.0 else logits
    if view.top_k > 0 and view.top_k < z.shape[-1]:
        kth = z.topk(view.top_k, dim=-1).values[..., -1:]  # [N, 1]
        z = z.masked_fill(z < kth, float("-inf"))
    if view.top_p < 1.0:
        sorted_z, order = z.sort(dim=-1, descending=True)
        probs = sorted_z.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
        drop_sorted = mass_before >= view.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        z = z.masked_fill(drop, float("-inf"))
    return z


@dataclass
class TokenStats:
    """Per-token results of one chunked pass, all [B, T] and zero on padding."""

    logp: torch.Tensor
    entropy: Optional[torch.Tensor] = None
    sum_p2: Optional[torch.Tensor] = None
    hidden_norm: Optional[torch.Tensor] = None


def _chunk_stats(
    hidden: torch.Tensor, head_weight: torch.Tensor, targets: torch.Tensor, view: SamplingView, with_stats: bool
) -> torch.Tensor:
    """hidden [N, D], targets [N] -> [N, 1] (logp) or [N, 3] (logp, entropy, sum p^2)."""
    logp_all = processed_logits((hidden @ head_weight.T).float(), view).log_softmax(dim=-1)  # [N, V]
    logp = logp_all.gather(-1, targets[:, None])  # [N, 1]
    if not with_stats:
        return logp
    with torch.no_grad():  # the proxies are never differentiated
        # vocab_stats works in place: never on the tensor autograd saved for the backward
        entropy, sum_p2, _ = vocab_stats(logp_all.detach().clone() if logp_all.requires_grad else logp_all)
    return torch.cat([logp, entropy, sum_p2], dim=-1)


def vocab_stats(
    logp_all: torch.Tensor, with_entropy: bool = True
) -> tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """(entropy or None, sum_v p_v^2, probs) of log-distributions logp_all [..., V]: the two
    statistics [..., 1] and the probabilities [..., V]. No grad.

    Consumes `logp_all` (overwritten in place): on CPU a fresh [N, V] tensor costs more in page
    faults than the exp that fills it. Tokens outside the support (-inf, removed by top-k /
    top-p) add 0 to the entropy.
    """
    if not with_entropy:
        probs = logp_all.exp_()
        entropy = None
    else:
        probs = logp_all.exp()
        finite = logp_all.clamp_(min=torch.finfo(logp_all.dtype).min)  # 0 * -inf would be nan
        entropy = -torch.linalg.vecdot(probs, finite).unsqueeze(-1)
    # vector_norm squared, not vecdot(probs, probs): the latter measured ~80x slower on CPU
    sum_p2 = torch.linalg.vector_norm(probs, dim=-1, keepdim=True).square()
    return entropy, sum_p2, probs


def chunked_token_stats(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    targets: torch.Tensor,
    mask: torch.Tensor,
    view: SamplingView = RAW,
    chunk_tokens: int = 1024,
    with_stats: bool = False,
) -> TokenStats:
    """log p(targets) under softmax(hidden @ head_weight^T), processed by `view`.

    hidden [B, T, D] (the hidden state that predicts each target), head_weight [V, D],
    targets [B, T] long, mask [B, T]. Only real tokens are computed, `chunk_tokens` at a time.
    `with_stats` adds the PS-PPO proxies' inputs: entropy, sum_v p_v^2 and ||h|| (no grad).
    `targets` and `mask` may live on the host while `hidden` is on a GPU: the real tokens are then
    found on the host, and the device is never waited on. Results are on hidden's device.
    """
    if hidden.shape[:2] != targets.shape or targets.shape != mask.shape:
        raise ValueError(
            f"hidden {list(hidden.shape)}, targets {list(targets.shape)} and mask {list(mask.shape)}"
            " must be [B, T, D], [B, T] and [B, T]"
        )
    check_positive("chunk_tokens", chunk_tokens)
    real = mask.bool()
    index = real.reshape(-1).nonzero().squeeze(1).to(hidden.device)  # [N] real positions, found where the mask is
    flat_hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, index)  # [N, D]
    flat_targets = targets.reshape(-1).to(hidden.device).index_select(0, index)  # [N]
    columns = 3 if with_stats else 1
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or head_weight.requires_grad)
    pieces = []
    for start in range(0, flat_hidden.shape[0], chunk_tokens):
        h, t = flat_hidden[start : start + chunk_tokens], flat_targets[start : start + chunk_tokens]
        if needs_grad:
            pieces.append(checkpoint(_chunk_stats, h, head_weight, t, view, with_stats, use_reentrant=False))
        else:
            pieces.append(_chunk_stats(h, head_weight, t, view, with_stats))
    flat = torch.cat(pieces) if pieces else hidden.new_zeros(0, columns, dtype=torch.float32)

    def scatter(column: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(mask.numel(), dtype=torch.float32, device=hidden.device)
        return out.index_copy(0, index, column.float()).reshape(mask.shape)

    stats = TokenStats(logp=scatter(flat[:, 0]))
    if with_stats:
        detached = flat.detach()
        stats.entropy = scatter(detached[:, 1])
        stats.sum_p2 = scatter(detached[:, 2])
        stats.hidden_norm = scatter(flat_hidden.detach().float().norm(dim=-1))
    return stats
