"""The training loop: GRPO-family RL against the deployment engine, with DC-GRPO and PS-PPO.

One step, as in DESIGN.md:

    prompts -> rollout engine (K per prompt, logp_inf) -> rewards -> group advantages
    -> trainer no-grad pass (logp_old, proxies) -> delta, lambda-shaped advantages
    -> cutoff plan (xi, H) -> graded pass on the kept prefixes, loss, backward, optimizer step
    -> dual update of lambda -> weight sync to the engine -> metrics, checkpoint

Each stage is a function below; `Trainer.step` strings them together. Deviations and choices:
* the cutoff plan is drawn once per step and reused by every PPO epoch and mini-batch;
* the graded pass feeds each row only up to its cutoff; the positions past it keep
  logp = logp_old (ratio 1) with weight 0, so every loss keeps full-length [B, T] tensors and
  its denominator counts all real tokens (the unbiasedness condition of PS-PPO);
* with `dc`, the tolerance c defaults to `relative_tolerance` x the mean discrepancy of the
  first batch, measured before any update (the scale of delta depends on model and engine);
* rows are group-major; groups whose rewards are all equal are dropped (or refilled) when
  the KL term is off, since their advantages are exactly zero.

Faults (docs/runs.md, "What survives what"): an optimizer update whose loss or gradient is not
finite is skipped and logged, and `optim.max_skipped_steps` such steps in a row stop the run; a
generation that raises, hangs past `rollout.timeout_s` or returns a malformed batch is retried
on a fresh engine (`rollout.max_retries`); a reward that fails on every completion stops the
run; SIGINT/SIGTERM finish the step, save a checkpoint and raise TrainingInterrupted.

Under torchrun the model is sharded with FSDP2 and each rank samples and computes its share of
the step; the batch's per-token tensors are gathered so that the rest is the code below on the
same data on every rank (distributed.py). Rank 0 alone logs, evaluates and writes checkpoints.
"""

from __future__ import annotations

import copy
import logging
import math
import random
import signal
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from deployrl.algo.advantages import (
    broadcast_to_tokens,
    compute_advantages,
    zero_variance_groups,
)
from deployrl.algo.discrepancy import (
    DualController,
    correction_weights,
    discrepancy_summary,
    shape_advantages,
    token_discrepancy,
    trajectory_discrepancy,
)
from deployrl.algo.losses import policy_loss
from deployrl.algo.prefix import (
    PrefixPlan,
    cutoff_law,
    grad_norm_proxy,
    group_stats,
    sample_plan,
)
from deployrl.checkpoint import (
    checkpoint_path,
    checkpoint_step,
    export_model,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from deployrl.config import PSConfig, TrainConfig
from deployrl.configio import to_dict
from deployrl.distributed import (
    World,
    all_gather_rows,
    all_reduce_sum,
    any_rank,
    balanced_shares,
    contiguous_shares,
    full_state_dict,
    gather_in_order,
    init_world,
    shard,
)
from deployrl.engines import make_engine
from deployrl.engines.check import check_engine, check_ids, reference_logprobs
from deployrl.engines.base import (
    SEMANTICS,
    RolloutBatch,
    SamplingParams,
    check_rollouts,
    pad_rollouts,
    trainer_view,
)
from deployrl.models import (
    DTYPES,
    Scorer,
    decoder_blocks,
    end_token_ids,
    load_model,
    load_tokenizer,
    output_head,
    resolve_model,
    shares_prompts,
    token_logprobs,
)
from deployrl.prompts import encode_prompts
from deployrl.rewards import overlong_penalty, score_completions
from deployrl.runlog import EVENTS, RunLogger, check_writable, format_postfix, progress
from deployrl.tasks import Example, Task, load_task

log = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    """The run stopped on a fault it could not work around; the message says what and what to do."""


class EngineError(TrainingError):
    """The rollout engine failed on every attempt (`rollout.max_retries` retries on fresh engines)."""


class EngineTimeout(TimeoutError):
    """A generation call ran past `rollout.timeout_s`."""


class RewardFailure(TrainingError):
    """The reward failed on every completion of a step."""


class NonFiniteError(TrainingError):
    """`optim.max_skipped_steps` steps in a row had a non-finite loss or gradient."""


class TrainingInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped the run; `checkpoint` is where it resumes from (None: the start).

    A KeyboardInterrupt, so that `except Exception` clauses do not swallow it.
    """

    def __init__(self, message: str, signum: int, checkpoint: Optional[Path] = None) -> None:
        super().__init__(message)
        self.signum = signum
        self.checkpoint = checkpoint


class StopSignals:
    """Within `with`: the first SIGINT or SIGTERM is recorded in `signum` (the loop stops after
    the current step); a second one raises TrainingInterrupted at once, abandoning the step.

    Handlers are installed only in the main thread (the only one Python delivers signals to)
    and the previous ones are restored on exit.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            # None: the previous handler was not installed from Python; the default is the best guess
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            raise TrainingInterrupted(f"a second {name} abandoned the step in progress", signum)
        self.signum = signum
        log.warning("%s: stopping after the current step, with a checkpoint (send it again to stop at once,"
                    " losing the steps since the last checkpoint)", name)


@dataclass
class Rollouts:
    """Sampled groups with their rewards."""

    batch: RolloutBatch
    examples: list[Example]  # one per group
    rewards: torch.Tensor  # [G, K]
    texts: list[str]  # [B] decoded completions
    sampled_rewards: torch.Tensor  # [G_sampled, K] every group sampled this step, dropped ones too
    reward_failures: int = 0
    reward_timeouts: int = 0


@dataclass
class OldPass:
    """The trainer's no-grad pass over the full completions."""

    logp: torch.Tensor  # [B, T] logp_old
    logp_ref: Optional[torch.Tensor]  # [B, T] reference policy, when the KL term is on
    entropy: Optional[torch.Tensor] = None  # [B, T]
    grad_norm: Optional[torch.Tensor] = None  # [B, T] gamma
    uncertainty: Optional[torch.Tensor] = None  # [G, T] reward uncertainty u


@dataclass
class TrainState:
    """What a checkpoint needs besides weights, optimizer and scheduler."""

    step: int = 0
    data_position: int = 0
    tolerance: Optional[float] = None
    dual: dict[str, float] = field(default_factory=dict)
    skipped_in_a_row: int = 0  # consecutive steps with a skipped (non-finite) update


class OtherRankLogger:
    """The logger of ranks other than 0, which write nothing: rank 0 writes the run directory."""

    def log(self, step: int, metrics) -> None:
        pass

    def log_samples(self, step: int, samples) -> None:
        pass

    def log_event(self, step: int, event: str, **details) -> None:
        pass

    def truncate_after(self, step: int) -> None:
        pass

    def plot(self) -> None:
        pass

    def close(self) -> None:
        pass


def cat_rollouts(parts: list[RolloutBatch]) -> RolloutBatch:
    """Concatenate rollout batches row-wise (same group size), padding to the widest."""
    if len(parts) == 1:
        return parts[0]
    width = max(p.completion_ids.shape[1] for p in parts)

    def pad(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[1]))

    return RolloutBatch(
        prompt_ids=[p for b in parts for p in b.prompt_ids],
        completion_ids=torch.cat([pad(b.completion_ids) for b in parts]),
        logp_inf=torch.cat([pad(b.logp_inf) for b in parts]),
        mask=torch.cat([pad(b.mask) for b in parts]),
        finish_reasons=[r for b in parts for r in b.finish_reasons],
        semantics=parts[0].semantics,
        group_size=parts[0].group_size,
        timing={k: sum(b.timing.get(k, 0.0) for b in parts) for k in parts[0].timing},
    )


def select_groups(rollouts: Rollouts, keep: torch.Tensor) -> Rollouts:
    """The groups where `keep` [G] is True."""
    k = rollouts.batch.group_size
    rows = keep.repeat_interleave(k)
    b = rollouts.batch
    batch = RolloutBatch(
        prompt_ids=[p for p, r in zip(b.prompt_ids, rows.tolist()) if r],
        completion_ids=b.completion_ids[rows],
        logp_inf=b.logp_inf[rows],
        mask=b.mask[rows],
        finish_reasons=[f for f, r in zip(b.finish_reasons, rows.tolist()) if r],
        semantics=b.semantics,
        group_size=k,
        timing=b.timing,
    )
    return Rollouts(
        batch=batch,
        examples=[e for e, g in zip(rollouts.examples, keep.tolist()) if g],
        rewards=rollouts.rewards[keep],
        texts=[t for t, r in zip(rollouts.texts, rows.tolist()) if r],
        sampled_rewards=rollouts.sampled_rewards,
        reward_failures=rollouts.reward_failures,
        reward_timeouts=rollouts.reward_timeouts,
    )


def micro_batches(
    rows: list[int], prompt_tokens: list[int], completion_tokens: list[int], token_budget: int,
    groups: Optional[list[int]] = None,
) -> list[list[int]]:
    """`rows` packed greedily into micro-batches of at most `token_budget` tokens (a row alone may exceed it).

    A micro-batch costs its rows' completion tokens plus, once per group it holds, the group's
    prompt tokens: the rows of a group share their prompt (models.completion_hidden). With
    `groups=None` every row is its own group. Groups go in order of their longest row and rows by
    length within a group, so that a micro-batch holds whole groups of similar lengths.
    """
    group = groups if groups is not None else list(range(len(completion_tokens)))
    longest: dict[int, int] = {}
    for row in rows:
        longest[group[row]] = max(longest.get(group[row], 0), completion_tokens[row])
    batches, current, held, used = [], [], set(), 0
    for row in sorted(rows, key=lambda r: (longest[group[r]], group[r], completion_tokens[r])):
        cost = completion_tokens[row] + (0 if group[row] in held else prompt_tokens[row])
        if current and used + cost > token_budget:
            batches.append(current)
            current, held, used = [], set(), 0
            cost = completion_tokens[row] + prompt_tokens[row]
        current.append(row)
        held.add(group[row])
        used += cost
    if current:
        batches.append(current)
    return batches


def lr_lambda(cfg, total_steps: int):
    """Warmup then constant or cosine decay, as a LambdaLR multiplier of the step."""

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        if cfg.schedule == "constant":
            return 1.0
        progress_ = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress_, 1.0)))

    return factor


class Trainer:
    """Holds the components of a run; `run()` trains, `step()` does one step."""

    def __init__(self, config: TrainConfig, resume: bool = False, world: Optional[World] = None) -> None:
        self.config = config
        self.world = world or init_world()
        self.task: Task = load_task(config.task)  # data is validated before any model loads
        # held-out problems (default: fresh ones of the training task, another seed), checked now too
        self.eval_task: Optional[Task] = load_task(
            config.eval.task or replace(config.task, seed=config.task.seed + 1)
        ) if config.eval.num_prompts else None
        if len(self.task.examples) < config.rollout.prompts_per_step:
            raise ValueError(
                f"task {self.task.name} has {len(self.task.examples)} examples, fewer than"
                f" rollout.prompts_per_step={config.rollout.prompts_per_step}"
            )
        self.run_dir = Path(config.output_dir)
        if self.world.is_main:
            check_writable(self.run_dir)  # before the model loads: an unwritable directory fails in seconds
        self.source = resolve_model(config.model.name)
        self.tokenizer = load_tokenizer(self.source, config.model.trust_remote_code)
        self.model = load_model(
            self.source, config.model.dtype, config.model.activation_checkpointing, config.model.trust_remote_code
        ).to(self.world.device)
        self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False) if config.algo.kl_coef > 0 else None
        self.vocab_size = output_head(self.model).shape[0]
        # which ranks hold a rollout engine (built from the whole model, before it is sharded)
        self.samples = self.world.is_main or config.rollout.engine_ranks == "all"
        # the kernel self-check's sequence, scored by the model now (before sharding: every rank alone)
        self.check_ids = check_ids(self.tokenizer, self.vocab_size)
        self.check_reference = reference_logprobs(self.model, self.check_ids)
        self.engine = self.build_engine() if self.samples else None
        # every use of the weights goes through these calls (what FSDP needs)
        self.scorer = Scorer(self.model)
        self.ref_scorer = Scorer(self.ref_model) if self.ref_model is not None else None
        if self.world.distributed:
            for scorer in filter(None, (self.scorer, self.ref_scorer)):
                shard(scorer, decoder_blocks(scorer.model), self.world, DTYPES[config.model.dtype])
        # the command that continues this run, for stop messages (the CLI sets the real one)
        self.resume_command = "deployrl train <your config and overrides> --resume"
        optim = config.optim
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=optim.lr, betas=(optim.beta1, optim.beta2), weight_decay=optim.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(optim, config.steps))
        dc = config.algo.dc
        self.dual = DualController(tolerance=dc.tolerance or 0.0, lr=dc.lr, lam_max=dc.lam_max, lam=dc.lam_init)
        self.state = TrainState(tolerance=dc.tolerance)
        self.generator = torch.Generator().manual_seed(config.seed)
        self.order = self._data_order()
        self.resumed_from: Optional[Path] = None
        checkpoint = self._resume_checkpoint() if resume else None
        if checkpoint is not None:
            saved = load_checkpoint(
                checkpoint, self.model, self.optimizer, self.scheduler, {"plan": self.generator}, verify=False
            )
            self.state = TrainState(**saved)
            self.dual.load_state_dict(self.state.dual)
            if self.state.tolerance is not None:
                self.dual.tolerance = self.state.tolerance
            self.sync_engine()
            self.resumed_from = checkpoint
        else:
            if resume:
                log.warning("no complete checkpoint in %s: the run starts from step 0", self.run_dir / "checkpoints")
            random.seed(config.seed)
            np.random.seed(config.seed)
            torch.manual_seed(config.seed)
        self.logger = RunLogger(
            self.run_dir, to_dict(config), tensorboard=config.tensorboard, wandb=config.wandb, resume=resume,
        ) if self.world.is_main else OtherRankLogger()
        if resume:  # drop what the lost steps logged (all of it when there was no checkpoint)
            self.logger.truncate_after(self.state.step if self.resumed_from is not None else -1)
            self.logger.log_event(self.state.step, "resumed", checkpoint=self.resumed_from)

    def _resume_checkpoint(self) -> Optional[Path]:
        """The newest checkpoint whose sha256s all match (a corrupt newest one is skipped for the
        one before it). Rank 0 reads the files and tells the other ranks which step it chose."""
        found = latest_checkpoint(self.run_dir, deep=True) if self.world.is_main else None
        if not self.world.distributed:
            return found
        mine = (checkpoint_step(found) if found is not None else -1) if self.world.is_main else 0
        step = int(all_reduce_sum([mine], self.world)[0])  # rank 0's value: the others add 0
        return None if step < 0 else checkpoint_path(self.run_dir, step)

    def engine_weights(self) -> dict[str, torch.Tensor]:
        """The model's whole weights for the engines: on every rank, or on rank 0 alone when only it
        samples (`rollout.engine_ranks=main`; the others get {}). A collective when sharded."""
        return full_state_dict(self.model, self.world, to_main_only=self.config.rollout.engine_ranks == "main")

    def sync_engine(self) -> None:
        """Give this rank's engine (if it has one) the model's current weights; every rank calls it."""
        weights = self.engine_weights()
        self.check_reference = reference_logprobs(self.scorer, self.check_ids)  # a collective when sharded
        if self.engine is not None:
            self.engine.sync(weights)
            self.check_kernels(self.engine)

    def check_kernels(self, engine) -> None:
        """The engine's kernel self-check against the model's current weights (KernelMismatch)."""
        gap = check_engine(engine, self.check_reference, self.check_ids)
        log.debug("kernel self-check of %s: mean |logp gap| %.4f", engine.name, gap)

    def build_engine(self, weights: Optional[dict[str, torch.Tensor]] = None):
        """A new rollout engine holding the model's current weights.

        A sharded model cannot be copied: the engine is then built from a fresh load of the
        model's source and given `weights`, the gathered current weights.
        """
        rollout, cfg = self.config.rollout, self.config.model
        model = self.model if weights is None else load_model(self.source, cfg.dtype, False, cfg.trust_remote_code)
        engine = make_engine(
            rollout.engine, model, self.source, end_token_ids(self.tokenizer, self.model), rollout.context_length,
            threads=rollout.threads, parallel=rollout.parallel,
        )
        if weights is not None:
            engine.sync(weights)
        self.check_kernels(engine)
        return engine

    def _data_order(self) -> list[int]:
        order = list(range(len(self.task.examples)))
        random.Random(self.config.seed).shuffle(order)
        return order

    # --- stages -------------------------------------------------------------------------

    def next_examples(self, count: int) -> list[Example]:
        """The next `count` examples of the shuffled stream (wrapping around)."""
        n = len(self.order)
        picked = [self.task.examples[self.order[(self.state.data_position + i) % n]] for i in range(count)]
        self.state.data_position += count
        return picked

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> RolloutBatch:
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
                    batch = self._generate_within_timeout(prompt_ids, params)
                    check_rollouts(batch, prompt_ids, params, self.vocab_size)
                else:  # this rank's share of the step is empty
                    semantics = self.engine.semantics if self.engine is not None else "none"  # gather_batch skips it
                    batch = pad_rollouts([], [], [], [], semantics, params.n, {})
            except Exception as err:
                failure = err
                self.engine = None  # never reused: it may be hung, or broken in a way a retry would repeat
                self.logger.log_event(self.state.step + 1, "engine_failure", engine=rollout.engine,
                                      attempt=attempt + 1, error=f"{type(err).__name__}: {err}")
                log.warning("rollout engine %s failed (attempt %d of %d): %s: %s", rollout.engine, attempt + 1,
                            rollout.max_retries + 1, type(err).__name__, err)
            if not any_rank(failure is not None, self.world):
                return batch
            if attempt < rollout.max_retries and self.world.distributed:
                weights = self.engine_weights()
        error = f"{type(failure).__name__}: {failure}" if failure is not None else "the engine of another rank failed"
        raise EngineError(
            f"the rollout engine {rollout.engine} failed {rollout.max_retries + 1} times in a row at step"
            f" {self.state.step + 1}; last error: {error}. Check the engine (for llamacpp: the"
            " llama-cpp-python install), or raise rollout.max_retries / rollout.timeout_s"
        ) from failure

    def _generate_within_timeout(self, prompt_ids: list[list[int]], params: SamplingParams) -> RolloutBatch:
        timeout = self.config.rollout.timeout_s
        engine = self.engine
        if timeout is None:
            return engine.generate(prompt_ids, params)
        box: dict[str, object] = {}

        def call() -> None:
            try:
                box["batch"] = engine.generate(prompt_ids, params)
            except BaseException as err:  # noqa: BLE001 - handed to the caller's thread
                box["error"] = err

        worker = threading.Thread(target=call, name="deployrl-rollout", daemon=True)
        worker.start()
        worker.join(timeout)
        if worker.is_alive():
            # Python cannot stop the call: it is abandoned together with its engine.
            raise EngineTimeout(f"{engine.name} did not return within rollout.timeout_s={timeout} s")
        if "error" in box:
            raise box["error"]
        return box["batch"]

    def sample(self, examples: list[Example], params: SamplingParams) -> Rollouts:
        """Generate K completions per example with the engine and score them.

        Each rank generates and scores a consecutive share of the examples; the batch and the
        rewards are gathered. Reward failures (raised, timed out, NaN or not a number: those
        completions score 0) are logged to events.jsonl; a reward that fails on every completion
        raises RewardFailure.
        """
        world, k = self.world, params.n
        prompt_ids = encode_prompts(self.tokenizer, [e.prompt for e in examples])
        if self.config.rollout.engine_ranks == "all":
            shares = contiguous_shares(len(examples), world.size)
        else:  # rank 0's engine samples every prompt
            shares = [range(len(examples))] + [range(len(examples), len(examples))] * (world.size - 1)
        mine = shares[world.rank]
        local = self.generate([prompt_ids[i] for i in mine], replace(params, first_prompt=params.first_prompt + mine.start))
        row_shares = [[row for g in share for row in range(g * k, (g + 1) * k)] for share in shares]
        batch = self.gather_batch(local, row_shares, [p for p in prompt_ids for _ in range(k)])
        texts = [self.tokenizer.decode(c, skip_special_tokens=True) for c in batch.completions()]
        rows = row_shares[world.rank]
        scores = score_completions(self.task.reward, [texts[r] for r in rows], [examples[r // k].reference for r in rows])
        failures, timeouts = (int(n) for n in all_reduce_sum([scores.failures, scores.timeouts], world))
        if scores.failures + scores.timeouts:
            self.logger.log_event(self.state.step + 1, "reward_failures", reward=self.task.reward_name,
                                  completions=len(rows), failures=scores.failures, timeouts=scores.timeouts,
                                  errors=scores.errors)
        if failures + timeouts == len(texts):
            first = scores.errors[0] if scores.errors else "(this rank scored no completion)"
            raise RewardFailure(
                f"the reward {self.task.reward_name!r} failed on all {len(texts)} completions of step"
                f" {self.state.step + 1}: {first}"
                + (f" (and {len(scores.errors) - 1} other errors, in {EVENTS})" if len(scores.errors) > 1 else "")
                + "; fix the reward, then resume"
            )
        values = gather_in_order(torch.tensor(scores.values, dtype=torch.float64), row_shares, world).tolist()
        if self.config.algo.overlong_buffer:  # DAPO: soft punishment of completions near the limit
            values = [
                v + overlong_penalty(int(n), params.max_new_tokens, self.config.algo.overlong_buffer)
                for v, n in zip(values, batch.lengths)
            ]
        rewards = torch.tensor(values, dtype=torch.float32).reshape(len(examples), k)
        return Rollouts(batch, examples, rewards, texts, rewards, failures, timeouts)

    def gather_batch(self, local: RolloutBatch, row_shares: list[list[int]], prompt_ids: list[list[int]]) -> RolloutBatch:
        """The step's whole RolloutBatch from each rank's `local` one (rank r sampled rows `row_shares[r]`)."""
        world = self.world
        if not world.distributed:
            return local
        stops = torch.tensor([f == "stop" for f in local.finish_reasons], dtype=torch.bool)
        # the engine's semantics, from a rank that sampled (a rank without rows may hold no engine)
        codes = all_gather_rows(torch.tensor([SEMANTICS.index(local.semantics) if local.finish_reasons else -1]), world)
        semantics = SEMANTICS[max(int(c) for c in codes)]
        tokens, seconds = all_reduce_sum([local.timing.get("tokens", 0.0), local.timing.get("generate_s", 0.0)], world)
        seconds /= world.size  # the ranks generate at the same time
        return RolloutBatch(
            prompt_ids=prompt_ids,
            completion_ids=gather_in_order(local.completion_ids, row_shares, world),
            logp_inf=gather_in_order(local.logp_inf, row_shares, world),
            mask=gather_in_order(local.mask, row_shares, world),
            finish_reasons=["stop" if s else "length" for s in gather_in_order(stops, row_shares, world).tolist()],
            semantics=semantics,
            group_size=local.group_size,
            timing={"generate_s": seconds, "tokens": tokens, "tokens_per_s": tokens / max(seconds, 1e-9)},
        )

    def collect(self) -> Rollouts:
        """Sample one step's groups; drop (or refill) groups whose rewards are all equal."""
        cfg = self.config
        mode = cfg.algo.dynamic_sampling if cfg.algo.kl_coef == 0 else "off"
        params = cfg.rollout.sampling(seed=cfg.seed * 1_000_003 + self.state.step)
        rollouts = self.sample(self.next_examples(cfg.rollout.prompts_per_step), params)
        if mode == "off":
            return rollouts
        rollouts = select_groups(rollouts, ~zero_variance_groups(rollouts.rewards))
        rounds = 0
        while mode == "refill" and rounds < cfg.algo.max_refill_rounds and len(rollouts.examples) < cfg.rollout.prompts_per_step:
            rounds += 1
            missing = cfg.rollout.prompts_per_step - len(rollouts.examples)
            params = SamplingParams(**{**params.__dict__, "seed": params.seed + 7919 * rounds})
            extra = self.sample(self.next_examples(missing), params)
            extra = select_groups(extra, ~zero_variance_groups(extra.rewards))
            rollouts = Rollouts(
                batch=cat_rollouts([rollouts.batch, extra.batch]) if extra.examples else rollouts.batch,
                examples=rollouts.examples + extra.examples,
                rewards=torch.cat([rollouts.rewards, extra.rewards]),
                texts=rollouts.texts + extra.texts,
                sampled_rewards=torch.cat([rollouts.sampled_rewards, extra.sampled_rewards]),
                reward_failures=rollouts.reward_failures + extra.reward_failures,
                reward_timeouts=rollouts.reward_timeouts + extra.reward_timeouts,
            )
        return rollouts

    @torch.no_grad()
    def old_pass(self, rollouts: Rollouts, params: SamplingParams, strategies: tuple[str, ...] = ()) -> OldPass:
        """logp_old (and logp_ref, proxies) over the full completions, in chunks.

        Rows go through the model in micro-batches of `algo.micro_batch_tokens`, like the graded
        pass, so this pass's peak memory does not grow with the batch. Keeps the proxies the
        cutoff `strategies` need (default: the configured strategy's). For `optimized` the
        micro-batches hold whole groups and the output head runs per group, so that u and the
        token statistics share its probabilities. Each rank computes a share of the rows (of
        the groups for `optimized`) balanced by tokens; the results are gathered.
        """
        batch, cfg, k = rollouts.batch, self.config, rollouts.batch.group_size
        view = trainer_view(batch.semantics, params)
        strategies = strategies or (cfg.algo.ps.strategy,)
        optimized, with_entropy = "optimized" in strategies, "heuristic" in strategies
        lengths = [len(p) + int(n) for p, n in zip(batch.prompt_ids, batch.mask.sum(dim=1).tolist())]
        unit_rows = [list(range(g * k, (g + 1) * k)) for g in range(len(rollouts.examples))] if optimized else [
            [row] for row in range(len(lengths))
        ]
        costs = [sum(lengths[r] for r in rows) for rows in unit_rows]
        prompt_tokens = [len(batch.prompt_ids[rows[0]]) for rows in unit_rows]
        groups = [rows[0] // k for rows in unit_rows] if shares_prompts(self.model) else None
        plans = [micro_batches(share, prompt_tokens, [c - p for c, p in zip(costs, prompt_tokens)],
                               cfg.algo.micro_batch_tokens, groups)
                 for share in balanced_shares(costs, self.world.size)]
        success = rollouts.rewards > rollouts.rewards.mean(dim=1, keepdim=True)  # [G, K]
        chunk = max(1, cfg.model.chunk_tokens // k)

        def group_reduce(units: list[int], completions: torch.Tensor, mask: torch.Tensor):
            def reduce(hidden: torch.Tensor, head: torch.Tensor) -> list:
                on = hidden.device
                return [
                    group_stats(hidden[i * k:(i + 1) * k], head, completions[i * k:(i + 1) * k].to(on),
                                mask[i * k:(i + 1) * k].to(on), success[g].to(on), cfg.algo.ps.uncertainty, view, chunk,
                                with_entropy=with_entropy)
                    for i, g in enumerate(units)
                ]
            return reduce

        parts: dict[str, list[torch.Tensor]] = {n: [] for n in ("logp", "entropy", "sum_p2", "hidden_norm", "logp_ref")}
        uncertainty = []
        mine = plans[self.world.rank]
        for call in range(max(len(plan) for plan in plans)):
            if call >= len(mine):  # this rank has fewer micro-batches than another
                for scorer in filter(None, (self.scorer, self.ref_scorer)):
                    self._filler_call(scorer)
                continue
            rows = [r for unit in mine[call] for r in unit_rows[unit]]
            index = torch.tensor(rows)
            prompts, completions, mask = [batch.prompt_ids[r] for r in rows], batch.completion_ids[index], batch.mask[index]
            if optimized:
                groups = self.scorer(prompts, completions, mask, group_reduce(mine[call], completions, mask))
                for name in ("logp", "entropy", "sum_p2", "hidden_norm"):
                    parts[name] += [getattr(stats, name) for stats in groups]
                uncertainty += [stats.uncertainty[None] for stats in groups]
            else:
                stats = token_logprobs(self.scorer, prompts, completions, mask, view, cfg.model.chunk_tokens, with_entropy)
                parts["logp"].append(stats.logp)
                parts["entropy"].append(stats.entropy)
            if self.ref_scorer is not None:
                parts["logp_ref"].append(
                    token_logprobs(self.ref_scorer, prompts, completions, mask, view, cfg.model.chunk_tokens).logp
                )
        row_orders = [[r for micro in plan for unit in micro for r in unit_rows[unit]] for plan in plans]
        width = batch.mask.shape[1]

        def gathered(pieces: list, orders: list[list[int]] = row_orders) -> Optional[torch.Tensor]:
            """The global [rows, T] tensor of this rank's `pieces` (None when the pass did not compute it)."""
            if not pieces or pieces[0] is None:
                return None
            local = torch.cat([nn.functional.pad(t.cpu(), (0, width - t.shape[1])) for t in pieces])
            return gather_in_order(local, orders, self.world)[:, :width]

        if not optimized:
            return OldPass(logp=gathered(parts["logp"]), logp_ref=gathered(parts["logp_ref"]),
                           entropy=gathered(parts["entropy"]))
        logp = gathered(parts["logp"])
        return OldPass(
            logp=logp, logp_ref=gathered(parts["logp_ref"]), entropy=gathered(parts["entropy"]) if with_entropy else None,
            grad_norm=grad_norm_proxy(logp, gathered(parts["sum_p2"]), gathered(parts["hidden_norm"])),
            uncertainty=gathered(uncertainty, [[unit for micro in plan for unit in micro] for plan in plans]),
        )

    def _filler_call(self, scorer: Scorer, backward: bool = False) -> None:
        """A one-token call of `scorer` whose result is zero, for a rank with fewer micro-batches than
        another: FSDP's collectives must pair up across ranks. With `backward` it is backpropagated."""
        token = torch.zeros(1, 1, dtype=torch.long)
        out = scorer([[0]], token, torch.ones(1, 1, dtype=torch.bool), lambda hidden, head: (hidden.sum() + head.sum()) * 0)
        if backward:
            out.backward()

    def shaped_advantages(self, rollouts: Rollouts, old: OldPass) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Group advantages per token, DC-shaped when `dc` is on; per-token correction weights."""
        batch, algo = rollouts.batch, self.config.algo
        mask = batch.mask
        advantages = broadcast_to_tokens(compute_advantages(algo.advantage, rollouts.rewards), mask)
        delta = token_discrepancy(old.logp, batch.logp_inf, mask, algo.dc.signal)
        mean_d = float(trajectory_discrepancy(delta, mask).mean())
        if self.state.tolerance is None and math.isfinite(mean_d):  # c relative to what this engine really does
            self.state.tolerance = algo.dc.relative_tolerance * mean_d
            self.dual.tolerance = self.state.tolerance
        # a non-finite first batch leaves c unset; this step's update is then non-finite and skipped
        tolerance = self.state.tolerance if self.state.tolerance is not None else math.nan
        metrics = {f"dc/{k}": float(v) for k, v in discrepancy_summary(delta, mask, old.logp, tolerance).items()}
        metrics["dc/tolerance"] = tolerance
        if algo.correction == "dc":
            advantages = shape_advantages(advantages, delta, mask, self.dual.lam, algo.dc.penalty, tolerance)
            weights = torch.ones_like(advantages)
        else:
            weights = correction_weights(algo.correction, old.logp, batch.logp_inf, algo.correction_cap) * mask
        return advantages, weights, metrics

    def cutoff_law(self, rollouts: Rollouts, old: OldPass, ps: Optional[PSConfig] = None) -> torch.Tensor:
        """xi [G, T], the cutoff law of each group under `ps` (default: the configured one)."""
        ps, batch = ps or self.config.algo.ps, rollouts.batch
        k, mask = batch.group_size, batch.mask
        token_weights = None
        if ps.strategy == "heuristic":
            token_weights = old.entropy
        elif ps.strategy == "optimized":
            token_weights = old.grad_norm * old.uncertainty.repeat_interleave(k, dim=0)
        return cutoff_law(ps.strategy, mask, k, ps.budget, ps.xi_min, token_weights)

    def cutoff_plan(self, rollouts: Rollouts, old: OldPass) -> PrefixPlan:
        """The PS-PPO plan: which prefix of each completion the graded pass backpropagates."""
        strategy = self.config.algo.ps.strategy
        return sample_plan(strategy, self.cutoff_law(rollouts, old), rollouts.batch.mask, self.generator)

    def update(
        self, rollouts: Rollouts, old: OldPass, advantages: torch.Tensor, weights: torch.Tensor,
        plan: PrefixPlan, params: SamplingParams,
    ) -> dict[str, float]:
        """PPO epochs over mini-batches; the graded pass sees each row's kept prefix only.

        An optimizer update whose loss or gradient norm is not finite is skipped (weights and
        optimizer state untouched) and logged to events.jsonl with its examples' ids; the
        scheduler steps only when at least one update was applied, so a step without any leaves
        the whole optimizer state as it was. Each rank backpropagates a share of every mini-batch's
        rows, balanced by kept tokens; losses are normalised by the whole mini-batch, and FSDP
        sums the ranks' gradients.
        """
        cfg, batch = self.config, rollouts.batch
        algo = cfg.algo
        view = trainer_view(batch.semantics, params)
        token_weights = weights * plan.weights
        cutoffs = plan.cutoffs.tolist()
        prompt_tokens = [len(p) for p in batch.prompt_ids]
        row_tokens = [p + c for p, c in zip(prompt_tokens, cutoffs)]
        groups = [r // batch.group_size for r in range(len(cutoffs))] if shares_prompts(self.model) else None
        rows_all = list(range(len(cutoffs)))
        losses, clip_fracs, grad_norms, graded_tokens, fed_tokens, calls = [], [], [], 0, 0, 0
        applied, skipped = 0, 0
        self.model.train()
        for _ in range(algo.ppo_epochs):
            order = torch.randperm(len(rows_all), generator=self.generator).tolist()
            for part in range(algo.mini_batches):
                mini = sorted(order[part::algo.mini_batches])
                if not mini:
                    continue
                idx = torch.tensor(mini)
                count = batch.mask[idx].sum() if algo.aggregation == "token_mean" else len(mini)
                self.optimizer.zero_grad(set_to_none=True)
                step_loss, nonfinite_rows = 0.0, []
                active = [r for r in mini if cutoffs[r] > 0]
                shares = [[active[i] for i in share]
                          for share in balanced_shares([row_tokens[r] for r in active], self.world.size)]
                plans = [micro_batches(share, prompt_tokens, cutoffs, algo.micro_batch_tokens, groups) for share in shares]
                mine = plans[self.world.rank]
                for call in range(max(len(plan) for plan in plans)):
                    if call >= len(mine):  # this rank has fewer micro-batches than another
                        self._filler_call(self.scorer, backward=True)
                        continue
                    micro = mine[call]
                    rows = torch.tensor(micro)
                    width = max(cutoffs[r] for r in micro)
                    kept = torch.arange(width)[None, :] < plan.cutoffs[rows][:, None]  # [b, width]
                    graded = token_logprobs(
                        self.scorer, [batch.prompt_ids[r] for r in micro], batch.completion_ids[rows, :width],
                        kept, view, cfg.model.chunk_tokens,
                    ).logp.cpu()
                    graded_tokens += int(kept.sum())
                    prompts_fed = {groups[r] if groups else r: prompt_tokens[r] for r in micro}
                    fed_tokens += sum(prompts_fed.values()) + sum(cutoffs[r] for r in micro)
                    calls += 1
                    logp = old.logp[rows].clone()
                    logp[:, :width] = torch.where(kept, graded, logp[:, :width])
                    out = policy_loss(
                        logp, old.logp[rows], advantages[rows], batch.mask[rows], token_weights[rows],
                        eps_low=algo.eps_low, eps_high=algo.eps_high, dual_clip=algo.dual_clip,
                        aggregation=algo.aggregation, max_length=cfg.rollout.max_new_tokens, denominator=count,
                        logp_ref=None if old.logp_ref is None else old.logp_ref[rows],
                        kl_coef=algo.kl_coef, kl_estimator=algo.kl_estimator,
                    )
                    out.loss.backward()
                    micro_loss = float(out.loss.detach())
                    if not math.isfinite(micro_loss):
                        nonfinite_rows += micro
                    step_loss += micro_loss
                    clip_fracs.append(float(out.metrics["clip_fraction"]))
                step_loss = all_reduce_sum([step_loss], self.world)[0]  # NaN anywhere: NaN everywhere
                losses.append(step_loss)
                # clip_grad_norm_ in two halves, so that the norm is checked before anything changes
                grads = [p.grad for p in self.model.parameters() if p.grad is not None]
                total_norm = torch.nn.utils.get_total_norm(grads)
                norm = float(total_norm.full_tensor() if isinstance(total_norm, DTensor) else total_norm)
                if not (math.isfinite(step_loss) and math.isfinite(norm)):
                    self.optimizer.zero_grad(set_to_none=True)
                    skipped += 1
                    self._log_skipped_update(rollouts, nonfinite_rows or mini, step_loss, norm)
                    continue
                if cfg.optim.grad_clip > 0:
                    torch.nn.utils.clip_grads_with_norm_(self.model.parameters(), cfg.optim.grad_clip, total_norm)
                grad_norms.append(norm)
                self.optimizer.step()
                applied += 1
        if applied:
            self.scheduler.step()
        self.model.eval()
        tokens_graded, tokens_fed, micro_calls = all_reduce_sum([graded_tokens, fed_tokens, calls], self.world)
        return {
            "loss": float(np.mean(losses)) if losses else 0.0,
            "clip_fraction": float(np.mean(clip_fracs)) if clip_fracs else 0.0,
            "grad_norm": float(np.mean(grad_norms)) if grad_norms else 0.0,
            "ps/tokens_graded": tokens_graded / algo.ppo_epochs,
            "ps/graded_pass_tokens": tokens_fed / algo.ppo_epochs,  # prompts (once per group and call) + kept
            "ps/micro_batches": micro_calls / algo.ppo_epochs,
            "ps/tokens_kept": float(plan.keep.sum()),
            "ps/tokens_total": float(batch.mask.sum()),
            "ps/expected_kept": float(plan.expected_tokens),
            "lr": self.scheduler.get_last_lr()[0],
            "optim/updates": float(applied),
            "optim/skipped_updates": float(skipped),
        }

    def _log_skipped_update(self, rollouts: Rollouts, rows: list[int], loss: float, grad_norm: float) -> None:
        k = rollouts.batch.group_size
        ids = list(dict.fromkeys(rollouts.examples[r // k].source for r in sorted(rows)))
        self.logger.log_event(self.state.step + 1, "nonfinite_update", loss=loss, grad_norm=grad_norm,
                              examples=ids, rows=sorted(rows))
        log.warning("step %d: non-finite loss (%s) or gradient norm (%s): update skipped, weights untouched;"
                    " examples %s", self.state.step + 1, loss, grad_norm, ids)

    # --- the loop ----------------------------------------------------------------------

    def step(self) -> dict[str, float]:
        """One training step; returns its metrics."""
        start = time.perf_counter()
        rollouts = self.collect()
        metrics = self.learn(rollouts, {"time/rollout": time.perf_counter() - start})
        metrics["time/step"] = time.perf_counter() - start
        return metrics

    def learn(self, rollouts: Rollouts, times: Optional[dict[str, float]] = None) -> dict[str, float]:
        """Everything of a step after sampling: no-grad pass, advantages, plan, update, dual step
        and weight sync (the step counter advances). Returns the step's metrics."""
        cfg = self.config
        times = dict(times or {})
        tick = time.perf_counter()

        def lap(name: str) -> None:
            nonlocal tick
            now = time.perf_counter()
            times[f"time/{name}"] = now - tick
            tick = now

        metrics: dict[str, float] = {
            "reward/mean": float(rollouts.sampled_rewards.mean()),
            "reward/groups_dropped": float(len(rollouts.sampled_rewards) - len(rollouts.rewards)),
            "reward/failures": float(rollouts.reward_failures),
            "reward/timeouts": float(rollouts.reward_timeouts),
            "engine/tokens_per_s": rollouts.batch.timing.get("tokens_per_s", 0.0),
        }
        if rollouts.examples:
            params = cfg.rollout.sampling(seed=0)
            metrics["completion/mean_length"] = float(rollouts.batch.lengths.float().mean())
            old = self.old_pass(rollouts, params)
            lap("old_pass")
            advantages, weights, dc_metrics = self.shaped_advantages(rollouts, old)
            metrics.update(dc_metrics)
            plan = self.cutoff_plan(rollouts, old)
            lap("plan")
            metrics.update(self.update(rollouts, old, advantages, weights, plan, params))
            lap("update")
            self._count_skips(metrics["optim/skipped_updates"] > 0)
            if metrics["optim/updates"]:  # weights changed: λ and the engine follow
                if cfg.algo.correction == "dc":
                    metrics["dc/lambda_used"] = self.dual.lam
                    self.dual.step(metrics["dc/mean_D"])
                self.sync_engine()
            lap("sync")
            self.logger.log_samples(self.state.step + 1, [
                {"prompt": str(e.prompt), "completion": t, "reward": float(r)}
                for e, t, r in zip(
                    [rollouts.examples[i // rollouts.batch.group_size] for i in range(len(rollouts.texts))],
                    rollouts.texts, rollouts.rewards.reshape(-1),
                )
            ][: cfg.log_samples])
        metrics["dc/lambda"] = self.dual.lam
        self.state.step += 1
        self.state.dual = self.dual.state_dict()
        metrics.update(times)
        return metrics

    def _count_skips(self, skipped: bool) -> None:
        """Count steps with a skipped update in a row; NonFiniteError at `optim.max_skipped_steps`."""
        self.state.skipped_in_a_row = self.state.skipped_in_a_row + 1 if skipped else 0
        limit = self.config.optim.max_skipped_steps
        if self.state.skipped_in_a_row >= limit:
            raise NonFiniteError(
                f"stopped at step {self.state.step + 1}: the loss or gradient was not finite in {limit} steps in a"
                f" row (optim.max_skipped_steps={limit}); the weights are those of the last finite update. The"
                f" offending examples are listed in {self.run_dir / EVENTS}. Lower optim.lr, keep optim.grad_clip"
                " on, check the reward and data, then resume from the last checkpoint"
            )

    def run(self) -> list[dict[str, float]]:
        """Train up to `steps`, saving every `save_every` steps and at the end.

        SIGINT or SIGTERM: the current step finishes, a checkpoint is saved and TrainingInterrupted
        is raised; a second signal abandons the step at once (the run resumes from the last
        checkpoint). The previous signal handlers are restored when run returns.
        """
        cfg = self.config
        history = []
        bar = progress(cfg.steps, initial=self.state.step, disable=not self.world.is_main)
        try:
            with StopSignals() as signals:
                if cfg.eval.before_training and cfg.eval.num_prompts and self.state.step == 0:
                    initial = {f"eval/{k}": v for k, v in self.evaluate().items()}
                    self.logger.log(0, initial)
                    history.append(initial)
                while self.state.step < cfg.steps:
                    metrics = self.step()
                    if cfg.eval.every and self.state.step % cfg.eval.every == 0:
                        metrics.update({f"eval/{k}": v for k, v in self.evaluate().items()})
                    self.logger.log(self.state.step, metrics)
                    history.append(metrics)
                    bar.update(1)
                    bar.set_postfix(format_postfix(metrics))
                    saved = None
                    if self.state.step % cfg.save_every == 0 or self.state.step == cfg.steps:
                        saved = self.save()
                    if signals.signum is not None:
                        name = signal.Signals(signals.signum).name
                        raise self._interrupted(signals.signum, saved or self.save(), f"{name} received")
                if cfg.eval.num_prompts and not cfg.eval.every:
                    final = {f"eval/{k}": v for k, v in self.evaluate().items()}
                    self.logger.log(self.state.step, final)
                    history.append(final)
        except TrainingInterrupted as interrupt:
            if interrupt.checkpoint is None:  # abandoned mid-step: the run goes on from the last checkpoint
                interrupt = self._interrupted(interrupt.signum, latest_checkpoint(self.run_dir), str(interrupt))
            self._finish_logs(failed=True)
            raise interrupt from None
        except BaseException as err:
            self._finish_logs(failed=True, error=err)
            raise
        finally:
            bar.close()
        self._finish_logs()
        return history

    def _interrupted(self, signum: int, checkpoint: Optional[Path], why: str) -> TrainingInterrupted:
        """The TrainingInterrupted for a stop at `checkpoint` (None: there is none), logged."""
        self.logger.log_event(self.state.step, "interrupted", signal=signal.Signals(signum).name,
                              checkpoint=checkpoint, reason=why)
        step = checkpoint_step(checkpoint) if checkpoint is not None else 0
        where = f"the checkpoint {checkpoint} holds step {step}" if checkpoint else "no checkpoint yet: it starts over"
        return TrainingInterrupted(f"stopped at step {step}; resume with: {self.resume_command}\n({why}; {where})",
                                   signum, checkpoint)

    def _finish_logs(self, failed: bool = False, error: Optional[BaseException] = None) -> None:
        """Plot and close the logs, after an events.jsonl line for `error`. When the run has `failed`,
        a failure here is only reported, so that it does not hide why the run stopped (a full disk
        would fail both)."""
        try:
            if error is not None:
                self.logger.log_event(self.state.step, "stopped", error=f"{type(error).__name__}: {error}")
            self.logger.plot()
            self.logger.close()
        except Exception as err:
            if not failed:
                raise
            log.warning("could not finish the run's logs: %s: %s", type(err).__name__, err)

    def save(self) -> Path:
        self.state.dual = self.dual.state_dict()
        return save_checkpoint(
            self.run_dir, self.state.step, self.model, self.optimizer, self.scheduler,
            self.state.__dict__.copy(), keep_last=self.config.keep_last, tokenizer=self.tokenizer,
            generators={"plan": self.generator},
        )

    def export(self, out_dir: Path, gguf_type: str = "q4_1") -> dict[str, Path]:
        """The final model as an HF folder (and a GGUF); written by rank 0, {} on the other ranks."""
        weights = full_state_dict(self.model, self.world, to_main_only=True)
        if not self.world.is_main:
            return {}
        return export_model(self.model, self.tokenizer, out_dir, self.source.gguf_path, gguf_type, weights)

    def evaluate(self) -> dict[str, float]:
        """Pass@k of the deployment engine on held-out problems; rank 0 evaluates, the others return {}."""
        from deployrl.evaluate import evaluate

        cfg = self.config
        if not self.world.is_main:
            return {}
        task = self.eval_task
        return evaluate(
            self.engine, self.tokenizer, task, cfg.eval, cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens, cfg.seed
        )


def train(config: TrainConfig, resume: bool = False) -> list[dict[str, float]]:
    """Train with `config`; with `resume`, continue from the run directory's latest checkpoint."""
    return Trainer(config, resume=resume).run()
