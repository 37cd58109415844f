"""Sampling a step's groups: prompts in, K scored completions per prompt out.

`RolloutWorker` is one rank's side of it: its engine (when it holds one), generation with
retries and a time limit, rewards, and the step's batch gathered from every rank. `PromptStream`
is the shuffled, resumable order in which the task's examples are used. `Rollouts` is the record
the learner takes.

Faults (docs/runs.md, "What survives what"): a generation that raises, hangs past
`rollout.timeout_s` or returns a malformed batch is retried on a fresh engine
(`rollout.max_retries`), then EngineError; a reward that fails on every completion raises
RewardFailure. Every engine passes the kernel self-check (engines/check.py) when it is built and
after each weight sync.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch

from deployrl.algo.advantages import zero_variance_groups
from deployrl.engines import held_weights, make_engine
from deployrl.engines.base import (
    SEED_STRIDE,
    SEMANTICS,
    RolloutBatch,
    RolloutEngine,
    SamplingParams,
    Timing,
    check_rollouts,
    no_token_stats,
    pad_rollouts,
)
from deployrl.engines.check import check_engine, check_ids, reference_logprobs, reference_on
from deployrl.errors import EngineError, EngineTimeout, RewardFailure
from deployrl.models.loading import ModelSource, Scorer, end_token_ids, load_model, output_head
from deployrl.rewards.grading import overlong_penalty
from deployrl.rewards.sandbox import score_completions
from deployrl.settings.config import TrainConfig
from deployrl.tasks import Example, Task
from deployrl.tasks.prompts import encode_prompts
from deployrl.timeout import call_with_timeout
from deployrl.training.distributed import (
    World,
    all_gather_rows,
    all_reduce_sum,
    any_rank,
    contiguous_shares,
    gather_in_order,
)
from deployrl.training.ps_orders import PS_ORDERS
from deployrl.training.runlog import EVENTS

log = logging.getLogger(__name__)


@dataclass
class Rollouts:
    """Sampled groups with their rewards, rows group-major (row g*K + k)."""

    batch: RolloutBatch
    examples: list[Example]  # [G] one per group
    rewards: torch.Tensor  # [G, K]
    texts: list[str]  # [B] decoded completions
    sampled_rewards: torch.Tensor  # [G_sampled, K] every group sampled this step, dropped ones too
    reward_failures: int = 0
    reward_timeouts: int = 0

    def successes(self) -> torch.Tensor:
        """[G, K] bool: the completions rewarded above their group's mean (the two classes of the
        reward uncertainty u of PS-PPO's optimized law)."""
        return self.rewards > self.rewards.mean(dim=1, keepdim=True)

    def select(self, keep: torch.Tensor) -> "Rollouts":
        """The groups where `keep` [G] (bool) is True; what was sampled stays counted."""
        rows = keep.repeat_interleave(self.batch.group_size)
        return replace(
            self, batch=self.batch.select(rows), rewards=self.rewards[keep],
            examples=[e for e, g in zip(self.examples, keep.tolist()) if g],
            texts=[t for t, r in zip(self.texts, rows.tolist()) if r],
        )

    @staticmethod
    def cat(parts: list["Rollouts"]) -> "Rollouts":
        """The groups of `parts`, one after the other (a part may hold no group)."""
        batches = [p.batch for p in parts if p.examples] or [parts[0].batch]
        return Rollouts(
            batch=RolloutBatch.cat(batches),
            examples=[e for p in parts for e in p.examples],
            rewards=torch.cat([p.rewards for p in parts]),
            texts=[t for p in parts for t in p.texts],
            sampled_rewards=torch.cat([p.sampled_rewards for p in parts]),
            reward_failures=sum(p.reward_failures for p in parts),
            reward_timeouts=sum(p.reward_timeouts for p in parts),
        )

    def metrics(self) -> dict[str, float]:
        metrics = {
            "reward/mean": float(self.sampled_rewards.mean()),
            "reward/groups_dropped": float(len(self.sampled_rewards) - len(self.rewards)),
            "reward/failures": float(self.reward_failures),
            "reward/timeouts": float(self.reward_timeouts),
            "engine/tokens_per_s": self.batch.timing.tokens_per_s,
        }
        if self.examples:
            metrics["completion/mean_length"] = float(self.batch.lengths.float().mean())
        return metrics

    def samples(self, count: int) -> list[dict]:
        """The first `count` completions with their prompts and rewards, for samples.jsonl."""
        k = self.batch.group_size
        return [
            {"prompt": str(self.examples[row // k].prompt), "completion": text, "reward": float(reward)}
            for row, (text, reward) in enumerate(zip(self.texts, self.rewards.reshape(-1).tolist()))
        ][:count]


def trainer_reserve(model: torch.nn.Module, config: TrainConfig) -> int:
    """Bytes the trainer allocates after its engine starts and holds for the run: AdamW's two moments
    of every trainable weight, and the KL term's reference copy of the model."""
    def nbytes(trainable_only: bool) -> int:
        return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad or not trainable_only)

    return 2 * nbytes(True) + (nbytes(False) if config.algo.kl_coef > 0 else 0)


def data_order(size: int, seed: int) -> list[int]:
    """The order in which a run uses its task's `size` examples: a permutation seeded by `seed`."""
    order = list(range(size))
    random.Random(seed).shuffle(order)
    return order


class PromptStream:
    """The task's examples in `data_order`, taken `count` at a time and wrapping around;
    `position` (examples taken so far) is what a checkpoint saves."""

    def __init__(self, examples: list[Example], seed: int, position: int = 0) -> None:
        self.examples = examples
        self.order = data_order(len(examples), seed)
        self.position = position

    def take(self, count: int) -> list[Example]:
        n = len(self.order)
        picked = [self.examples[self.order[(self.position + i) % n]] for i in range(count)]
        self.position += count
        return picked


class RolloutWorker:
    """One rank's sampling for a run of `config`.

    The engine is built from `model` (its own copy of the weights) on the ranks that sample
    (rank 0, or all with `rollout.engine_ranks=all`). `gather_weights` returns the trainer's whole
    current weights (a collective when sharded): a fresh engine of a distributed run is built from
    them. `logger` receives the events (engine and reward failures).
    """

    def __init__(
        self, config: TrainConfig, task: Task, tokenizer, model, source: ModelSource, world: World, logger,
        gather_weights: Callable[[], dict[str, torch.Tensor]],
    ) -> None:
        self.config, self.task, self.tokenizer, self.source, self.world = config, task, tokenizer, source, world
        self.logger, self.gather_weights = logger, gather_weights
        self.model = model
        self.vocab_size = output_head(model).shape[0]
        self.end_tokens = end_token_ids(tokenizer, model)
        self.samples = world.is_main or config.rollout.every_rank_samples
        ps = config.algo.ps  # the engine reports the distribution statistics the cutoff law is solved from
        self.top_m = ps.top_m if PS_ORDERS.get(ps.proxies).engine_proxies(ps.strategy) else 0
        # the kernel self-check's sequence, scored by the model now (before sharding: every rank alone)
        self.check_ids = check_ids(tokenizer, self.vocab_size)
        self.matched = config.model.match_engine  # the trainer computes on the engine's weights (its own reference)
        scorer = Scorer(model, None, held_weights(config.rollout.engine, model, source,
                                                  lora_serving=config.rollout.lora_serving)) if self.matched else model
        self.reference = reference_logprobs(scorer, self.check_ids)
        self.engine: Optional[RolloutEngine] = self.build_engine() if self.samples else None

    def build_engine(self, weights: Optional[dict[str, torch.Tensor]] = None) -> RolloutEngine:
        """A new engine holding the model's current weights, checked.

        A sharded model cannot be copied: the engine is then built from a fresh load of the
        model's source and given `weights`, the gathered current weights.
        """
        rollout, cfg = self.config.rollout, self.config.model
        model = self.model if weights is None else load_model(self.source, cfg.dtype, False, cfg.trust_remote_code)
        engine = make_engine(rollout.engine, model, self.source, self.end_tokens, **rollout.engine_settings(),
                             reserved_bytes=trainer_reserve(self.model, self.config))
        try:
            if weights is not None:
                engine.sync(weights)
            self.check_kernels(engine)
        except BaseException:
            engine.close()  # a retry starts on the memory this one held
            raise
        return engine

    def sync(self, weights: dict[str, torch.Tensor], reference: torch.Tensor) -> None:
        """Give the engine (if this rank has one) `weights`; `reference` is the check sequence's
        log-probs under them."""
        self.reference = reference
        if self.engine is not None:
            self.engine.sync(weights)
            self.check_kernels(self.engine)

    def close(self) -> None:
        """Close this rank's engine, if it has one (a failed close is logged: it must not hide why)."""
        engine, self.engine = self.engine, None
        if engine is not None:
            try:
                engine.close()
            except Exception as err:
                log.warning("closing engine %s failed: %s: %s", engine.name, type(err).__name__, err)

    def takes_base(self) -> bool:
        """Whether the next sync must carry the base weights (some rank's engine needs them); every
        rank asks, as the gather that follows is a collective."""
        needs = self.engine.takes_base if self.engine is not None else self.samples
        return any_rank(needs, self.world)

    def check_kernels(self, engine: RolloutEngine) -> None:
        """The engine's kernel self-check against the trainer's current weights (KernelMismatch); for
        a quantised file, against the trainer's model on the weights the file holds (one process:
        a sharded model cannot take them), which a matched trainer computes on already."""
        quantised = engine.take_quantised_weights()
        reference = self.reference
        if quantised is not None and not self.world.distributed and not self.matched:
            reference = reference_on(self.model, quantised, self.check_ids)
        gap = check_engine(engine, reference, self.check_ids, self.matched)
        log.debug("kernel self-check of %s: mean |logp gap| %.4f", engine.name, gap)

    def collect(self, stream: PromptStream, step: int) -> Rollouts:
        """Sample the groups of step `step` (0-based) from the next prompts of `stream`; drop (or
        refill, `algo.dynamic_sampling`) groups whose rewards are all equal."""
        cfg = self.config
        refill_rounds = cfg.algo.refill_rounds
        wanted = cfg.rollout.prompts_per_step
        params = replace(cfg.rollout.sampling(seed=cfg.seed * SEED_STRIDE + step), top_m=self.top_m)
        rollouts = self.sample(stream.take(wanted), params, step)
        if refill_rounds is not None:
            rollouts = rollouts.select(~zero_variance_groups(rollouts.rewards))
            for round_ in range(1, refill_rounds + 1):
                if len(rollouts.examples) >= wanted:
                    break
                params = replace(params, seed=params.seed + 7919 * round_)
                extra = self.sample(stream.take(wanted - len(rollouts.examples)), params, step)
                rollouts = Rollouts.cat([rollouts, extra.select(~zero_variance_groups(extra.rewards))])
        if self.engine is not None:
            self.engine.release()  # the trainer works next; the weight sync takes the memory back
        return rollouts

    def sample(self, examples: list[Example], params: SamplingParams, step: int) -> Rollouts:
        """K completions per example, scored.

        Each rank generates and scores a consecutive share of the examples; the batch and the
        rewards are gathered. Reward failures (raised, timed out, NaN or not a number: those
        completions score 0) are logged to events.jsonl; a reward that fails on every completion
        raises RewardFailure.
        """
        world, k, cfg = self.world, params.n, self.config
        prompt_ids = encode_prompts(self.tokenizer, [e.prompt for e in examples])
        if cfg.rollout.every_rank_samples:
            shares = contiguous_shares(len(examples), world.size)
        else:  # rank 0's engine samples every prompt
            shares = [range(len(examples))] + [range(len(examples), len(examples))] * (world.size - 1)
        mine = shares[world.rank]
        local = self.generate([prompt_ids[i] for i in mine], replace(params, first_prompt=params.first_prompt + mine.start),
                              step)
        row_shares = [[row for g in share for row in range(g * k, (g + 1) * k)] for share in shares]
        batch = self.gather_batch(local, row_shares, [p for p in prompt_ids for _ in range(k)])
        texts = [self.tokenizer.decode(c, skip_special_tokens=True) for c in batch.completions()]
        rows = row_shares[world.rank]
        scores = score_completions(self.task.reward, [texts[r] for r in rows], [examples[r // k].reference for r in rows])
        failures, timeouts = (int(n) for n in all_reduce_sum([scores.failures, scores.timeouts], world))
        if scores.failures + scores.timeouts:
            self.logger.log_event(step + 1, "reward_failures", reward=self.task.reward_name, completions=len(rows),
                                  failures=scores.failures, timeouts=scores.timeouts, errors=scores.errors)
        if failures + timeouts == len(texts):
            first = scores.errors[0] if scores.errors else "(this rank scored no completion)"
            raise RewardFailure(
                f"the reward {self.task.reward_name!r} failed on all {len(texts)} completions of step {step + 1}: {first}"
                + (f" (and {len(scores.errors) - 1} other errors, in {EVENTS})" if len(scores.errors) > 1 else "")
                + "; fix the reward, then resume"
            )
        values = gather_in_order(torch.tensor(scores.values, dtype=torch.float64), row_shares, world).tolist()
        if cfg.algo.overlong_buffer:  # DAPO: soft punishment of completions near the limit
            values = [v + overlong_penalty(int(n), params.max_new_tokens, cfg.algo.overlong_buffer)
                      for v, n in zip(values, batch.lengths)]
        rewards = torch.tensor(values, dtype=torch.float32).reshape(len(examples), k)
        return Rollouts(batch, examples, rewards, texts, rewards, failures, timeouts)

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, step: int) -> RolloutBatch:
        """`engine.generate`, checked by `check_rollouts`; a call that raises, runs past
        `rollout.timeout_s` or returns a malformed batch is retried on a fresh engine, at most
        `rollout.max_retries` times, then EngineError. Sampling seeds are the same on a retry,
        so a recovered step samples what the first attempt would have. The ranks of a distributed
        run retry together (a fresh engine needs the gathered weights: a collective).
        """
        rollout = self.config.rollout
        if self.engine is not None:
            self.engine.check_prompts(prompt_ids, params)  # a prompt too long is the data's fault: no retry
        weights, failure = None, None
        for attempt in range(rollout.max_retries + 1):
            failure = None
            try:
                if self.engine is None and self.samples:
                    self.engine = self.build_engine(weights)
                if prompt_ids:
                    engine = self.engine
                    batch = call_with_timeout(
                        lambda: engine.generate(prompt_ids, params), rollout.timeout_s, EngineTimeout,
                        f"{engine.name} (rollout.timeout_s={rollout.timeout_s})",
                    )
                    check_rollouts(batch, prompt_ids, params, self.vocab_size)
                else:  # this rank's share of the step is empty
                    semantics = self.engine.semantics if self.engine is not None else "none"  # gather_batch skips it
                    stats = no_token_stats(params.top_m, self.vocab_size) if params.top_m else {}
                    batch = replace(pad_rollouts([], [], [], [], semantics, params.n), stats=stats)
            except Exception as err:
                failure = err
                if not isinstance(err, EngineTimeout):  # a hung engine's call still runs: left to itself
                    self.close()  # its memory (a GPU's) is what the retry's engine starts on
                self.engine = None  # never reused: it may be hung, or broken in a way a retry would repeat
                self.logger.log_event(step + 1, "engine_failure", engine=rollout.engine, attempt=attempt + 1,
                                      error=f"{type(err).__name__}: {err}")
                log.warning("rollout engine %s failed (attempt %d of %d): %s: %s", rollout.engine, attempt + 1,
                            rollout.max_retries + 1, type(err).__name__, err)
            if not any_rank(failure is not None, self.world):
                return batch
            if attempt < rollout.max_retries and self.world.distributed:
                weights = self.gather_weights()
        error = f"{type(failure).__name__}: {failure}" if failure is not None else "the engine of another rank failed"
        raise EngineError(
            f"the rollout engine {rollout.engine} failed {rollout.max_retries + 1} times in a row at step"
            f" {step + 1}; last error: {error}. Check the engine (for llamacpp: the llama-cpp-python install),"
            " or raise rollout.max_retries / rollout.timeout_s"
        ) from failure

    def gather_batch(self, local: RolloutBatch, row_shares: list[list[int]], prompt_ids: list[list[int]]) -> RolloutBatch:
        """The step's whole RolloutBatch from each rank's `local` one (rank r sampled rows `row_shares[r]`)."""
        world = self.world
        if not world.distributed:
            return local
        stops = torch.tensor([f == "stop" for f in local.finish_reasons], dtype=torch.bool)
        # the engine's semantics, from a rank that sampled (a rank without rows may hold no engine)
        codes = all_gather_rows(torch.tensor([SEMANTICS.index(local.semantics) if local.finish_reasons else -1]), world)
        semantics = SEMANTICS[max(int(c) for c in codes)]
        tokens, seconds = all_reduce_sum([local.timing.tokens, local.timing.generate_s], world)
        return RolloutBatch(
            prompt_ids=prompt_ids,
            completion_ids=gather_in_order(local.completion_ids, row_shares, world),
            logp_inf=gather_in_order(local.logp_inf, row_shares, world),
            mask=gather_in_order(local.mask, row_shares, world),
            finish_reasons=["stop" if s else "length" for s in gather_in_order(stops, row_shares, world).tolist()],
            semantics=semantics,
            group_size=local.group_size,
            timing=Timing(seconds / world.size, tokens),  # the ranks generate at the same time
            stats={name: gather_in_order(value, row_shares, world) for name, value in local.stats.items()},
        )
