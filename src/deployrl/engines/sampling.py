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
    logp_processed: torch.Tensor  # [N] under the distribution sampled from
    logp_raw: torch.Tensor  # [N] under the model's softmax


def sample_next(logits: torch.Tensor, view: SamplingView, generators: Sequence[torch.Generator]) -> Draw:
    """Draw one token per row of logits [N, V] (any float dtype; computed in float32).

    The rows are len(generators) equal consecutive blocks (a prompt's K completions), each drawn
    with its own generator.
    """
    logits = logits.float()
    logp = processed_logits(logits, view).log_softmax(dim=-1)  # [N, V]
    probs = logp.exp().split(logits.shape[0] // len(generators))
    tokens = torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators)])  # [N, 1]
    return Draw(
        tokens=tokens[:, 0],
        logp_processed=logp.gather(-1, tokens)[:, 0],
        logp_raw=logits.log_softmax(dim=-1).gather(-1, tokens)[:, 0],
    )
