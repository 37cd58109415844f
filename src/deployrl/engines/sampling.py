"""The sampler both engines share: one draw from the processed next-token distribution.

Engines differ in how they compute logits (kernels, precision, quantisation), which is the
discrepancy deployrl measures; they share this sampler, so the sampling rule and the
reported log-probability are exactly the ones the trainer recomputes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from deployrl.algo.logprobs import SamplingView, processed_logits


@dataclass
class Draw:
    tokens: torch.Tensor  # [N] long
    logp: torch.Tensor  # [N] under the distribution of `semantics` (engines/base.py)


def sample_next(
    logits: torch.Tensor, view: SamplingView, generators: Sequence[torch.Generator], semantics: str = "processed"
) -> Draw:
    """Draw one token per row of logits [N, V] (any float dtype; computed in float32), and its
    log-probability under the distribution sampled from (`processed`) or the model's softmax (`raw`).

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
    return Draw(tokens=tokens[:, 0], logp=reported.gather(-1, tokens)[:, 0])
