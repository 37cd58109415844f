"""The sampler both engines share: one draw from the processed next-token distribution.

Engines differ in how they compute logits (kernels, precision, quantisation), which is the
discrepancy deployrl measures; they share this sampler, so the sampling rule and the
reported log-probability are exactly the ones the trainer recomputes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from deployrl.algo.logprobs import SamplingView, processed_logits


@dataclass
class Draw:
    tokens: torch.Tensor  # [N] long
    logp: torch.Tensor  # [N] under the distribution of `semantics` (engines/base.py)
    stats: dict[str, torch.Tensor] = field(default_factory=dict)  # `token_stats` of that distribution, when asked


def token_stats(logp: torch.Tensor, top_m: int) -> dict[str, torch.Tensor]:
    """What PS-PPO's engine proxies need of each next-token distribution logp [N, V]: entropy [N],
    sum_p2 [N] (sum of p^2), top_ids [N, m] and top_logp [N, m], its m most likely tokens."""
    probs = logp.exp()
    top_logp, top_ids = logp.topk(min(top_m, logp.shape[-1]), dim=-1)
    return {
        "entropy": torch.special.entr(probs).sum(dim=-1),
        "sum_p2": torch.linalg.vector_norm(probs, dim=-1).square(),  # vecdot(p, p) is ~100x slower on CPU
        "top_ids": top_ids, "top_logp": top_logp,
    }


def sample_next(
    logits: torch.Tensor, view: SamplingView, generators: Sequence[torch.Generator], semantics: str = "processed",
    top_m: int = 0,
) -> Draw:
    """Draw one token per row of logits [N, V] (any float dtype; computed in float32), and its
    log-probability under the distribution sampled from (`processed`) or the model's softmax (`raw`);
    with `top_m` > 0, that distribution's `token_stats` too.

    The rows are len(generators) equal consecutive blocks (a prompt's K completions, or one row
    each), each drawn with its own generator: one uniform u per row, and the token whose interval
    of the cumulative distribution (float64) holds u. Only tokens of positive probability have a
    non-empty interval. (torch.multinomial draws the same law but costs ~1 ms per row of 49k.)
    """
    logits = logits.float()
    logp = processed_logits(logits, view).log_softmax(dim=-1)  # [N, V]
    cdf = logp.double().exp().cumsum(dim=-1)  # [N, V]
    block = logits.shape[0] // len(generators)
    u = torch.cat([torch.rand(block, generator=g, dtype=torch.float64) for g in generators])  # [N]
    tokens = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp(max=logits.shape[-1] - 1)  # [N, 1]
    reported = logp if semantics == "processed" or view.is_raw else logits.log_softmax(dim=-1)
    return Draw(tokens=tokens[:, 0], logp=reported.gather(-1, tokens)[:, 0],
                stats=token_stats(reported, top_m) if top_m else {})
