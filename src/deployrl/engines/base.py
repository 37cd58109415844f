"""The black-box boundary: what a rollout engine takes and what it returns.

An engine samples K completions per prompt and reports, for every sampled token, the
log-probability it used (`logp_inf`). It declares which distribution that is:

* ``processed`` — the distribution it sampled from: logits / temperature, renormalised over
  the top-k / top-p support (the default of deployrl's engines);
* ``raw`` — the model's own softmax, whatever the sampling settings.

`trainer_view` tells the trainer which distribution to recompute so that both sides compare
the same thing; comparing a processed log-prob with a raw one is a fake discrepancy.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

import torch

from deployrl.algo.logprobs import RAW, SamplingView
from deployrl.registry import unknown_name_error

SEMANTICS = ("processed", "raw")
FINISH_REASONS = ("stop", "length")


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings shared by every engine."""

    n: int = 1  # completions per prompt (K)
    temperature: float = 1.0
    top_p: float = 1.0  # 1 = off (the training default)
    top_k: int = 0  # 0 = off (the training default)
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()  # besides the model's end-of-sequence tokens
    seed: int = 0

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n (completions per prompt) must be >= 1, got {self.n}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        SamplingView(self.temperature, self.top_k, self.top_p)  # validates the three

    @property
    def view(self) -> SamplingView:
        return SamplingView(self.temperature, self.top_k, self.top_p)


def trainer_view(semantics: str, params: SamplingParams) -> SamplingView:
    """The distribution the trainer must recompute to match an engine's `logp_inf`."""
    if semantics not in SEMANTICS:
        raise unknown_name_error("log-probability semantics", semantics, list(SEMANTICS))
    return params.view if semantics == "processed" else RAW


@dataclass
class RolloutBatch:
    """K completions for each of P prompts, rows group-major (row p*K + k)."""

    prompt_ids: list[list[int]]  # [B] token ids of each row's prompt
    completion_ids: torch.Tensor  # [B, T] long, 0 on padding
    logp_inf: torch.Tensor  # [B, T] float32, 0 on padding
    mask: torch.Tensor  # [B, T] bool, real completion tokens
    finish_reasons: list[str]  # [B] "stop" or "length"
    semantics: str  # "processed" or "raw"
    group_size: int  # K
    timing: dict[str, float] = field(default_factory=dict)  # seconds, tokens per second

    @property
    def lengths(self) -> torch.Tensor:
        return self.mask.sum(dim=1)

    def completions(self) -> list[list[int]]:
        return [row[: int(n)].tolist() for row, n in zip(self.completion_ids, self.lengths)]


def pad_rollouts(
    prompt_ids: list[list[int]],
    completions: list[list[int]],
    logps: list[list[float]],
    finish_reasons: list[str],
    semantics: str,
    group_size: int,
    timing: dict[str, float],
) -> RolloutBatch:
    """Build a RolloutBatch from ragged per-row lists."""
    width = max((len(c) for c in completions), default=0)
    ids = torch.zeros(len(completions), width, dtype=torch.long)
    logp = torch.zeros(len(completions), width, dtype=torch.float32)
    for row, (tokens, values) in enumerate(zip(completions, logps)):
        ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        logp[row, : len(values)] = torch.tensor(values, dtype=torch.float32)
    mask = torch.arange(width)[None, :] < torch.tensor([len(c) for c in completions])[:, None]
    return RolloutBatch(prompt_ids, ids, logp, mask, finish_reasons, semantics, group_size, timing)


class RolloutEngine(abc.ABC):
    """A sampler with its own copy of the weights, in its own precision or runtime."""

    name: str
    semantics: str = "processed"

    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutBatch:
        """Sample params.n completions for each prompt (token ids)."""

    @abc.abstractmethod
    def sync(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load the trainer's weights (HF names), converted to this engine's format."""

    @property
    @abc.abstractmethod
    def context_length(self) -> int:
        """Longest prompt + completion the engine accepts."""

    def check_prompts(self, prompts: list[list[int]], params: SamplingParams) -> None:
        """Refuse, before any generation, prompts that cannot be completed."""
        if not prompts:
            raise ValueError("no prompts to generate from")
        for index, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"prompt {index} is empty")
            if len(prompt) + params.max_new_tokens > self.context_length:
                raise ValueError(
                    f"prompt {index} has {len(prompt)} tokens; with max_new_tokens="
                    f"{params.max_new_tokens} it exceeds the engine's context of {self.context_length}"
                )
