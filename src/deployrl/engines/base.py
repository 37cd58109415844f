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
import time
from dataclasses import dataclass, field, replace
from typing import Optional

import torch
from torch import nn

from deployrl.algo.logprobs import RAW, SamplingView
from deployrl.registry import Choice, unknown_name_error

SEMANTICS = ("processed", "raw")
FINISH_REASONS = ("stop", "length")
LOGP_SLACK = 1e-3  # log-probabilities above this are not rounding error but a broken engine


class LoraServing(Choice):
    """How an engine holds a model's LoRA adapters (`rollout.lora_serving`)."""

    ADAPTER = "adapter", "served beside the frozen base, as deployed adapters run (vLLM: LoRA requests)"
    MERGED = "merged", "folded into the base at every sync, then quantised with it"


@dataclass(frozen=True)
class Timing:
    """The wall time of an engine's generation and the tokens it sampled; timings add up."""

    generate_s: float = 0.0
    tokens: float = 0.0

    @classmethod
    def since(cls, start: float, tokens: int) -> "Timing":
        """The timing of a generation that began at `time.perf_counter()` value `start`."""
        return cls(time.perf_counter() - start, float(tokens))

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.generate_s, 1e-9)

    def __add__(self, other: "Timing") -> "Timing":
        return Timing(self.generate_s + other.generate_s, self.tokens + other.tokens)


# seed * SEED_STRIDE + offset: the seed of one step (offset: the step) or one prompt (offset: its
# index) derived from a seed; a prime, so (seed, offset) pairs with offsets below it never collide
SEED_STRIDE = 1_000_003


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
    first_prompt: int = 0  # the index of this call's first prompt in the step (see prompt_generators)
    top_m: int = 0  # > 0: report each sampled token's distribution statistics too (RolloutBatch.stats)

    def __post_init__(self) -> None:
        if self.top_m < 0:
            raise ValueError(f"top_m must be >= 0, got {self.top_m}")
        if self.n < 1:
            raise ValueError(f"n (completions per prompt) must be >= 1, got {self.n}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        SamplingView(self.temperature, self.top_k, self.top_p)  # validates the three

    @property
    def view(self) -> SamplingView:
        return SamplingView(self.temperature, self.top_k, self.top_p)

    def prompt_generators(self, count: int, device: torch.device | str = "cpu") -> list[torch.Generator]:
        """One generator per prompt of a call, seeded by (seed, first_prompt + its index): a prompt's
        completions do not depend on the other prompts of the call, so the ranks of a distributed
        run, each sampling its share of the step's prompts, draw what one process would."""
        return [torch.Generator(device=device).manual_seed(seed) for seed in self.prompt_seeds(count)]

    def prompt_seeds(self, count: int) -> list[int]:
        """The seed of each of `count` prompts of a call: (seed, first_prompt + its index)."""
        return [self.seed * SEED_STRIDE + self.first_prompt + i for i in range(count)]

    def completion_generators(self, count: int) -> list[torch.Generator]:
        """One generator per completion (row p*n + k) of `count` prompts, seeded by (seed, first_prompt
        + p, k): a completion's tokens depend neither on the other completions nor on the order in
        which an engine decodes them, so batched and one-at-a-time decoding draw the same tokens."""
        return [
            torch.Generator().manual_seed(((self.seed * SEED_STRIDE + self.first_prompt + p) * 1_000_033 + k) % 2**63)
            for p in range(count)
            for k in range(self.n)
        ]


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
    timing: Timing = field(default_factory=Timing)
    # with SamplingParams.top_m = m > 0, statistics of each sampled token's distribution (the one of
    # `semantics`), 0 on padding: entropy [B, T], sum_p2 [B, T], top_ids [B, T, m] long, top_logp [B, T, m]
    # (-inf for tokens outside a top-k / top-p support)
    stats: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def lengths(self) -> torch.Tensor:
        return self.mask.sum(dim=1)

    def completions(self) -> list[list[int]]:
        return [row[: int(n)].tolist() for row, n in zip(self.completion_ids, self.lengths)]

    def select(self, rows: torch.Tensor) -> "RolloutBatch":
        """The rows where `rows` [B] (bool) is True, whole groups for a group-major batch."""
        picked = rows.tolist()
        return replace(
            self,
            prompt_ids=[p for p, keep in zip(self.prompt_ids, picked) if keep],
            completion_ids=self.completion_ids[rows], logp_inf=self.logp_inf[rows], mask=self.mask[rows],
            finish_reasons=[f for f, keep in zip(self.finish_reasons, picked) if keep],
            stats={name: value[rows] for name, value in self.stats.items()},
        )

    def prefixes(self, lengths: torch.Tensor) -> "RolloutBatch":
        """Each row cut to its first lengths[row] [B] tokens, the batch to the longest of them."""
        width = int(lengths.max()) if lengths.numel() else 0
        mask = self.mask[:, :width] & (torch.arange(width)[None, :] < lengths[:, None])
        return replace(
            self, completion_ids=self.completion_ids[:, :width], logp_inf=self.logp_inf[:, :width], mask=mask,
            stats={name: value[:, :width] for name, value in self.stats.items()},
        )

    @staticmethod
    def cat(parts: list["RolloutBatch"]) -> "RolloutBatch":
        """The rows of `parts` (same semantics and group size) one after the other, padded to the
        widest; timings add up."""
        width = max(p.completion_ids.shape[1] for p in parts)

        def padded(value: torch.Tensor) -> torch.Tensor:
            return nn.functional.pad(value, (0, 0) * (value.dim() - 2) + (0, width - value.shape[1]))

        def stacked(name: str) -> torch.Tensor:
            return torch.cat([padded(getattr(p, name)) for p in parts])

        return RolloutBatch(
            prompt_ids=[p for b in parts for p in b.prompt_ids],
            completion_ids=stacked("completion_ids"), logp_inf=stacked("logp_inf"), mask=stacked("mask"),
            finish_reasons=[r for b in parts for r in b.finish_reasons],
            semantics=parts[0].semantics,
            group_size=parts[0].group_size,
            timing=sum((b.timing for b in parts), Timing()),
            stats={name: torch.cat([padded(p.stats[name]) for p in parts]) for name in parts[0].stats},
        )


class MalformedRollouts(ValueError):
    """An engine returned a batch that breaks the RolloutBatch contract."""


def check_rollouts(batch: RolloutBatch, prompts: list[list[int]], params: SamplingParams, vocab_size: int) -> None:
    """Refuse a batch that is not `params.n` completions of each prompt with sane tokens and log-probs.

    Checks the shapes and dtypes, the group-major prompt rows, the finish reasons, that the mask
    is a prefix of at most `max_new_tokens` real tokens per row, that real token ids lie in
    [0, vocab_size) and that their `logp_inf` are finite and <= 0. Raises MalformedRollouts.
    """

    def refuse(what: str) -> None:
        raise MalformedRollouts(f"malformed rollout batch: {what}")

    if not isinstance(batch, RolloutBatch):
        refuse(f"the engine returned a {type(batch).__name__}, not a RolloutBatch")
    rows = len(prompts) * params.n
    tensors = {"completion_ids": batch.completion_ids, "logp_inf": batch.logp_inf, "mask": batch.mask}
    for name, value in tensors.items():
        if not isinstance(value, torch.Tensor) or value.dim() != 2 or value.shape[0] != rows:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            refuse(f"{name} must be a [{rows}, T] tensor ({len(prompts)} prompts x {params.n}), got {shape}")
    ids, logp, mask = batch.completion_ids, batch.logp_inf, batch.mask
    if not ids.shape == logp.shape == mask.shape:
        shapes = ", ".join(str(tuple(t.shape)) for t in tensors.values())
        refuse(f"completion_ids, logp_inf and mask differ in shape: {shapes}")
    integer_ids = not ids.dtype.is_floating_point and ids.dtype != torch.bool
    if not integer_ids or mask.dtype != torch.bool or not logp.dtype.is_floating_point:
        refuse(f"dtypes must be integer ids, float logp_inf, bool mask; got {ids.dtype}, {logp.dtype}, {mask.dtype}")
    if batch.group_size != params.n:
        refuse(f"group_size is {batch.group_size}, {params.n} completions per prompt were asked for")
    if batch.semantics not in SEMANTICS:
        refuse(f"log-probability semantics {batch.semantics!r} is not one of {SEMANTICS}")
    if len(batch.prompt_ids) != rows or any(
        list(batch.prompt_ids[row]) != list(prompts[row // params.n]) for row in range(rows)
    ):
        refuse(f"prompt_ids do not repeat each of the {len(prompts)} prompts {params.n} times, group-major")
    if len(batch.finish_reasons) != rows or any(r not in FINISH_REASONS for r in batch.finish_reasons):
        refuse(f"finish_reasons must be {rows} of {FINISH_REASONS}, got {batch.finish_reasons[:8]}")
    lengths = mask.sum(dim=1)
    if lengths.numel() and int(lengths.max()) > params.max_new_tokens:
        refuse(f"a completion has {int(lengths.max())} tokens, more than max_new_tokens={params.max_new_tokens}")
    if not torch.equal(mask, torch.arange(mask.shape[1], device=mask.device)[None, :] < lengths[:, None]):
        refuse("the mask is not a prefix in every row (real tokens first, then padding)")
    real = ids[mask]
    outside = real[(real < 0) | (real >= vocab_size)]
    if outside.numel():
        refuse(f"token ids outside the vocabulary [0, {vocab_size}): {sorted(set(outside.tolist()))[:5]}")
    values = logp[mask]
    if not torch.isfinite(values).all():
        refuse(f"{int((~torch.isfinite(values)).sum())} real tokens have a non-finite logp_inf")
    if values.numel() and float(values.max()) > LOGP_SLACK:
        refuse(f"logp_inf must be <= 0 (a log-probability), got {float(values.max()):.4g}")
    if params.top_m:
        _check_token_stats(batch.stats, mask, params.top_m, refuse)


def _check_token_stats(stats: dict[str, torch.Tensor], mask: torch.Tensor, top_m: int, refuse) -> None:
    """`check_rollouts` of the statistics asked for with `top_m` > 0 (mask [B, T])."""
    missing = [name for name in TOKEN_STATS if name not in stats]
    if missing:
        refuse(f"the engine reported no {', '.join(missing)} (asked for with top_m={top_m}: PS-PPO's engine"
               " proxies, algo.ps.proxies=engine); use algo.ps.proxies=trainer with this engine")
    for name in TOKEN_STATS:
        value = stats[name]
        if tuple(value.shape[:2]) != tuple(mask.shape) or (value.dim() == 3) != name.startswith("top_"):
            refuse(f"stats[{name!r}] has shape {tuple(value.shape)}, not [B, T{', m' if name.startswith('top_') else ''}]"
                   f" with [B, T] = {tuple(mask.shape)}")
        # top_logp is -inf for tokens outside a top-k / top-p support
        bad = value[mask].isnan() if name == "top_logp" else ~torch.isfinite(value[mask])
        if value.dtype.is_floating_point and bad.any():
            refuse(f"stats[{name!r}] is {'NaN' if name == 'top_logp' else 'not finite'} on some real token")


TOKEN_STATS = ("entropy", "sum_p2", "top_ids", "top_logp")


def no_token_stats(top_m: int, vocab_size: int) -> dict[str, torch.Tensor]:
    """`RolloutBatch.stats` of a batch without rows, as engines asked for `top_m` report them: a rank
    whose share of a step is empty still joins the gathers of every statistic, with these."""
    m = min(top_m, vocab_size)
    return {"entropy": torch.zeros(0, 0), "sum_p2": torch.zeros(0, 0),
            "top_ids": torch.zeros(0, 0, m, dtype=torch.long), "top_logp": torch.zeros(0, 0, m)}


def pad_rollouts(
    prompt_ids: list[list[int]],
    completions: list[list[int]],
    logps: list[list[float]],
    finish_reasons: list[str],
    semantics: str,
    group_size: int,
    timing: Timing = Timing(),
    stats: Optional[list[dict[str, torch.Tensor]]] = None,
) -> RolloutBatch:
    """Build a RolloutBatch from ragged per-row lists; `stats` per row: name -> [length, ...]."""
    width = max((len(c) for c in completions), default=0)
    ids = torch.zeros(len(completions), width, dtype=torch.long)
    logp = torch.zeros(len(completions), width, dtype=torch.float32)
    for row, (tokens, values) in enumerate(zip(completions, logps)):
        ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        logp[row, : len(values)] = torch.tensor(values, dtype=torch.float32)
    mask = torch.arange(width)[None, :] < torch.tensor([len(c) for c in completions])[:, None]
    padded = {}
    for name in stats[0] if stats else ():
        first = stats[0][name]
        padded[name] = first.new_zeros(len(completions), width, *first.shape[1:])
        for row, row_stats in enumerate(stats):
            padded[name][row, : len(row_stats[name])] = row_stats[name]
    return RolloutBatch(prompt_ids, ids, logp, mask, finish_reasons, semantics, group_size, timing, padded)


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

    @abc.abstractmethod
    def score(self, token_ids: list[int]) -> torch.Tensor:
        """log p(token_ids[t] | token_ids[:t]) for t >= 1, [len - 1] float32, under the engine's raw
        softmax: what the kernel self-check (engines/check.py) compares with the trainer."""

    def take_quantised_weights(self) -> Optional[dict[str, torch.Tensor]]:
        """The weights (HF names) the last sync left the engine computing with, where its format
        rounds them far beyond its kernels' own error (a quantised GGUF), once; None otherwise.
        The kernel self-check compares the engine with the trainer's model on these weights, so
        that a trainer drifting off the quantisation grid is not mistaken for broken kernels."""
        return None

    def close(self) -> None:
        """Free what the engine holds (its runtime, the device's memory); it is not used again."""

    @property
    def takes_base(self) -> bool:
        """Whether a sync needs the base weights: False once the engine holds the frozen base of the
        LoRA adapters it serves, when a sync sends the adapters alone."""
        return True

    def release(self) -> None:
        """Give the device's memory back while the trainer works (after a step's sampling); the next
        sync or generation takes it again. Nothing to give back for most engines."""

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
