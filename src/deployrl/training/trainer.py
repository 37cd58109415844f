"""The training loop: GRPO-family RL against the deployment engine, with DC-GRPO and PS-PPO.

One step (`Trainer.step`; docs/architecture.md follows it through the code):

    prompts -> rollout engine (K per prompt, logp_inf) -> rewards        rollout.RolloutWorker.collect
    -> cutoff plan (xi, H) and trainer no-grad pass, in the PS order     ps_orders (via Learner.learn)
    -> delta, mean D; the tolerance c from the first batch               Correction.measure
    -> graded pass on the kept prefixes, loss, backward, optimizer step  Learner.update
       (advantages and weights per token from the correction)           Correction.token_terms
    -> dual update of lambda (dc)                                        Correction.after_update
    -> weight sync to the engine -> metrics, checkpoint

The tolerance c defaults to `dc.relative_tolerance` x the mean discrepancy of the first batch,
measured before any update (the scale of delta depends on model and engine). Groups whose
rewards are all equal are dropped (or refilled) when the KL term is off: their advantages are 0.

Faults (docs/runs.md, "What survives what"): an optimizer update whose loss or gradient is not
finite is skipped and logged, and `optim.max_skipped_steps` such steps in a row stop the run
(NonFiniteError); engine and reward faults are handled in rollout.py; SIGINT/SIGTERM finish the
step, save a checkpoint and raise TrainingInterrupted.

Under torchrun the model is sharded with FSDP2 and each rank samples and computes its share of
the step; the batch's per-token tensors are gathered so that the rest is the code below on the
same data on every rank (distributed.py). Rank 0 alone logs, evaluates and writes checkpoints.
"""

from __future__ import annotations

import logging
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from deployrl.algo.discrepancy import discrepancy_summary
from deployrl.cpu import this_cpu
from deployrl.engines.base import trainer_view
from deployrl.engines.check import reference_logprobs
from deployrl.errors import NonFiniteError, StopSignals, TrainingInterrupted
from deployrl.models.loading import gguf_read_once, load_model, load_tokenizer, resolve_model
from deployrl.models.lora import add_lora
from deployrl.settings.config import TrainConfig, held_out_task
from deployrl.settings.parsing import to_dict
from deployrl.tasks import Task, load_task
from deployrl.training.checkpoint import (
    checkpoint_path,
    checkpoint_step,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from deployrl.training.distributed import World, all_reduce_sum, full_state_dict, init_world
from deployrl.training.export import export_model
from deployrl.training.learner import Learned, Learner, UpdateResult
from deployrl.training.rollout import PromptStream, Rollouts, RolloutWorker
from deployrl.training.runlog import EVENTS, RunLogger, SilentLogger, check_writable, format_postfix, progress

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    """What a checkpoint needs besides weights, optimizer and scheduler."""

    step: int = 0
    data_position: int = 0
    correction: dict[str, Optional[float]] = field(default_factory=dict)  # Correction.state_dict()
    skipped_in_a_row: int = 0  # consecutive steps with a skipped (non-finite) update

    @classmethod
    def from_saved(cls, saved: dict) -> "TrainState":
        """The state of a checkpoint; one written before corrections owned their state keeps c and
        lambda as `tolerance` and `dual`."""
        if "dual" in saved:
            saved = dict(saved)
            saved["correction"] = {"tolerance": saved.pop("tolerance"), **saved.pop("dual")}
        return cls(**saved)


class Trainer:
    """Holds the components of a run; `run()` trains, `step()` does one step."""

    def __init__(self, config: TrainConfig, resume: bool = False, world: Optional[World] = None) -> None:
        self.config, self.world = config, world or init_world(config.model.device)
        self.task: Task = load_task(config.task)  # data is validated before any model loads
        # held-out problems (default: fresh ones of the training task, another seed), checked now too
        self.eval_task: Optional[Task] = load_task(held_out_task(config)) if config.eval.num_prompts else None
        if len(self.task.examples) < config.rollout.prompts_per_step:
            raise ValueError(f"task {self.task.name} has {len(self.task.examples)} examples, fewer than"
                             f" rollout.prompts_per_step={config.rollout.prompts_per_step}")
        self.run_dir = Path(config.output_dir)
        if self.world.is_main:
            check_writable(self.run_dir)  # before the model loads: an unwritable directory fails in seconds
        with gguf_read_once():  # the checks, tokenizer, model and engine share one parse of a GGUF
            self.source = resolve_model(config.model.name)
            self.tokenizer = load_tokenizer(self.source, config.model.trust_remote_code)
            self.model = load_model(
                self.source, config.model.dtype, config.model.activation_checkpointing, config.model.trust_remote_code
            ).to(self.world.device)
            lora = config.model.lora
            if lora.rank:  # the base stays frozen at the weights the engine deploys; only adapters train
                add_lora(self.model, lora.rank, lora.alpha, lora.dropout, lora.target_modules, config.model.name,
                         config.seed)
            # the engine copies the whole model, before the learner shards it
            self.rollout = RolloutWorker(config, self.task, self.tokenizer, self.model, self.source, self.world,
                                         SilentLogger(), self.engine_weights)
        self.learner = Learner(config, self.model, self.world)
        # the command that continues this run, for stop messages (the CLI sets the real one)
        self.resume_command = "deployrl train <your config and overrides> --resume"
        self.state = TrainState()
        self.resumed_from = self._resume_checkpoint() if resume else None
        if self.resumed_from is not None:
            learner = self.learner
            saved = load_checkpoint(self.resumed_from, self.model, learner.optimizer, learner.scheduler,
                                    {"plan": learner.passes.generator}, verify=False)
            self.state = TrainState.from_saved(saved)
            self.learner.correction.load_state_dict(self.state.correction)
            self.sync_engine()
        else:
            if resume:
                log.warning("no complete checkpoint in %s: the run starts from step 0", self.run_dir / "checkpoints")
            random.seed(config.seed)
            np.random.seed(config.seed)
            torch.manual_seed(config.seed)
        self.stream = PromptStream(self.task.examples, config.seed, self.state.data_position)
        self.logger = RunLogger(
            self.run_dir, to_dict(config), tensorboard=config.tensorboard, wandb=config.wandb, resume=resume,
        ) if self.world.is_main else SilentLogger()
        self.rollout.logger = self.logger
        if resume:  # drop what the lost steps logged (all of it when there was no checkpoint)
            self.logger.truncate_after(self.state.step if self.resumed_from is not None else -1)
            self.logger.log_event(self.state.step, "resumed", checkpoint=self.resumed_from)
        cpu = this_cpu()  # an engine's speed depends on the CPU's class (docs/engines.md): said with every run
        engine = self.rollout.engine.name if self.rollout.engine else config.rollout.engine  # concrete once built
        log.info("machine: %s; trainer on %s; engine %s", cpu.describe(), self.world.device, engine)
        self.logger.log_event(self.state.step, "started", cpu=cpu.describe(), cpu_class=cpu.cls.value,
                              device=str(self.world.device), engine=engine)

    def _resume_checkpoint(self) -> Optional[Path]:
        """The newest checkpoint whose sha256s all match (a corrupt newest one is skipped for the
        one before it). Rank 0 reads the files and tells the other ranks which step it chose."""
        found = latest_checkpoint(self.run_dir, deep=True) if self.world.is_main else None
        if not self.world.distributed:
            return found
        mine = (checkpoint_step(found) if found is not None else -1) if self.world.is_main else 0
        step = int(all_reduce_sum([mine], self.world)[0])  # rank 0's value: the others add 0
        return None if step < 0 else checkpoint_path(self.run_dir, step)

    def engine_weights(self, base: bool = True) -> dict[str, torch.Tensor]:
        """The model's weights for the engines (`base=False`: the LoRA adapters only): on every rank,
        or on rank 0 alone when only it samples (`rollout.engine_ranks=main`; the others get {}). A
        collective when sharded."""
        return full_state_dict(self.model, self.world, to_main_only=not self.config.rollout.every_rank_samples,
                               base=base)

    def sync_engine(self) -> None:
        """Give this rank's engine (if it has one) the model's current weights, the adapters alone when
        every engine serves them on a base it holds; every rank calls it."""
        weights = self.engine_weights(base=self.rollout.takes_base())
        reference = reference_logprobs(self.learner.passes.scorer, self.rollout.check_ids)  # a collective when sharded
        self.rollout.sync(weights, reference)

    # --- the loop ----------------------------------------------------------------------

    def step(self) -> dict[str, float]:
        """One training step; returns its metrics."""
        start = time.perf_counter()
        rollouts = self.rollout.collect(self.stream, self.state.step)
        metrics = self.learn(rollouts, {"time/rollout": time.perf_counter() - start})
        metrics["time/step"] = time.perf_counter() - start
        return metrics

    def learn(self, rollouts: Rollouts, times: Optional[dict[str, float]] = None) -> dict[str, float]:
        """Everything of a step after sampling; the step counter advances. Returns the step's
        metrics, with the seconds of each stage (time/old_pass, time/plan, time/update, time/sync)."""
        metrics, correction = {**rollouts.metrics(), **(times or {})}, self.learner.correction
        if rollouts.examples:
            view = trainer_view(rollouts.batch.semantics, self.config.rollout.sampling(seed=0))
            learned = self.learner.learn(rollouts, view)
            self._count_skips(learned.update, rollouts)
            start = time.perf_counter()
            if learned.update.applied:  # weights changed: lambda and the engine follow
                metrics |= correction.after_update(learned.measured)
                self.sync_engine()
            seconds = learned.seconds | {"sync": time.perf_counter() - start}
            metrics |= {f"time/{name}": value for name, value in seconds.items()}
            metrics |= self._step_metrics(rollouts, learned)
            self.logger.log_samples(self.state.step + 1, rollouts.samples(self.config.log_samples))
        metrics |= correction.metrics()
        self.state.step += 1
        return metrics

    def _step_metrics(self, rollouts: Rollouts, learned: Learned) -> dict[str, float]:
        """The discrepancy summary, the update's metrics and the plan's token counts of a step."""
        measured, plan, update = learned.measured, learned.prepared.plan, learned.update
        tolerance = self.learner.correction.metrics()["dc/tolerance"]
        summary = discrepancy_summary(measured.delta, measured.seen, update.logp_old, tolerance)
        metrics = {f"dc/{k}": float(v) for k, v in summary.items()} | {"dc/mean_D": measured.mean}
        return metrics | update.metrics() | {
            "ps/tokens_kept": float(plan.keep.sum()), "ps/tokens_total": float(rollouts.batch.mask.sum()),
            "ps/expected_kept": float(plan.expected_tokens), "lr": self.learner.scheduler.get_last_lr()[0],
        }

    def _count_skips(self, update: UpdateResult, rollouts: Rollouts) -> None:
        """Log the skipped updates; NonFiniteError at `optim.max_skipped_steps` steps in a row with one."""
        k, step = rollouts.batch.group_size, self.state.step + 1
        for skip in update.skipped:
            ids = list(dict.fromkeys(rollouts.examples[r // k].source for r in skip.rows))
            self.logger.log_event(step, "nonfinite_update", loss=skip.loss, grad_norm=skip.grad_norm,
                                  examples=ids, rows=skip.rows)
            log.warning("step %d: non-finite loss (%s) or gradient norm (%s): update skipped, weights untouched;"
                        " examples %s", step, skip.loss, skip.grad_norm, ids)
        self.state.skipped_in_a_row = self.state.skipped_in_a_row + 1 if update.skipped else 0
        limit = self.config.optim.max_skipped_steps
        if self.state.skipped_in_a_row >= limit:
            raise NonFiniteError(
                f"stopped at step {step}: the loss or gradient was not finite in {limit} steps in a row"
                f" (optim.max_skipped_steps={limit}); the weights are those of the last finite update. The"
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
                    history.append(self._log_eval())
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
                    history.append(self._log_eval())
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

    def _log_eval(self) -> dict[str, float]:
        scores = {f"eval/{k}": v for k, v in self.evaluate().items()}
        self.logger.log(self.state.step, scores)
        return scores

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

    def close(self) -> None:
        """Free the engine (before the process group goes: under torchrun vLLM's groups live in it)."""
        self.rollout.close()

    def save(self) -> Path:
        self.state.correction, self.state.data_position = self.learner.correction.state_dict(), self.stream.position
        learner = self.learner
        return save_checkpoint(
            self.run_dir, self.state.step, self.model, learner.optimizer, learner.scheduler,
            self.state.__dict__.copy(), keep_last=self.config.keep_last, tokenizer=self.tokenizer,
            generators={"plan": learner.passes.generator}, world=self.world,
        )

    def export(self, out_dir: Path, gguf_type: str = "q4_1") -> dict[str, Path]:
        """The final model as an HF folder (and a GGUF); written by rank 0, {} on the other ranks."""
        weights = full_state_dict(self.model, self.world, to_main_only=True)
        if not self.world.is_main:
            return {}
        return export_model(self.model, self.tokenizer, out_dir, self.source.gguf_path, gguf_type, weights)

    def evaluate(self) -> dict[str, float]:
        """Pass@k of the deployment engine on held-out problems; rank 0 evaluates, the others return {}."""
        from deployrl.training.evaluation import evaluate

        cfg = self.config
        if not self.world.is_main:
            return {}
        return evaluate(self.rollout.engine, self.tokenizer, self.eval_task, cfg.eval,
                        cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens, cfg.seed)


def train(config: TrainConfig, resume: bool = False) -> list[dict[str, float]]:
    """Train with `config`; with `resume`, continue from the run directory's latest checkpoint."""
    return Trainer(config, resume=resume).run()
