"""Fault injection: the trainer on the tiny model is killed, interrupted, fed NaN, broken engines,
failing rewards, corrupt checkpoints and a full disk; each test asserts the behaviour of
docs/runs.md ("What survives what"). At the end of the module a line reports the faults
injected, the faults survived and the steps of data lost (must be 0).

Subprocess runs go through `deployrl train` with the toy reward `tiny:starts_with_digit`
(PYTHONPATH holds tests/), slowed down by a small wrapper (CHILD) so that kills land inside
steps and inside checkpoint writes.
"""

import copy
import errno
import math
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import pytest
import torch

from deployrl.engines.base import MalformedRollouts, RolloutBatch, SamplingParams, check_rollouts, pad_rollouts
from deployrl.errors import EngineError, NonFiniteError, RewardFailure, TrainingInterrupted
from deployrl.rewards.sandbox import score_completions
from deployrl.settings.config import load_config
from deployrl.training import rollout as rollout_module, runlog, trainer as trainer_module
from deployrl.training.checkpoint import (
    CheckpointError,
    checkpoint_step,
    latest_checkpoint,
    load_checkpoint,
    verify_checkpoint,
)
from deployrl.training.runlog import RunDirectoryError, read_jsonl
from deployrl.training.trainer import Trainer

TESTS = Path(__file__).resolve().parent
STEPS = 8

# The child process: `deployrl train` with a pause after every step and inside every checkpoint
# write (all files but the manifest written), announced on stdout, and an optional file size limit.
CHILD = r"""
import os, resource, signal, sys, time
from deployrl.training import checkpoint
from deployrl.training import trainer

limit = int(os.environ.get("FAULT_FILE_SIZE_LIMIT", "0"))
if limit:  # writes past `limit` bytes fail with EFBIG, like a full disk
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
step_pause, save_pause = float(os.environ["FAULT_STEP_PAUSE_S"]), float(os.environ["FAULT_SAVE_PAUSE_S"])
write_manifest, train_step = checkpoint._write_manifest, trainer.Trainer.step

def slow_manifest(directory, step):
    print(f"SAVING {step}", flush=True)
    time.sleep(save_pause)
    write_manifest(directory, step)

def slow_step(self):
    metrics = train_step(self)
    print(f"STEP {self.state.step}", flush=True)
    time.sleep(step_pause)
    return metrics

checkpoint._write_manifest, trainer.Trainer.step = slow_manifest, slow_step
from deployrl.cli import main
sys.exit(main(["train", *sys.argv[1:]]))
"""


def overrides(task_dir: Path, tiny_dir: Path, run: Path, *extra: str) -> list[str]:
    from tiny import toy_task_file

    return [
        f"model.name={tiny_dir}", "model.lora.rank=0", "task.type=jsonl", f"task.path={toy_task_file(task_dir)}",
        "task.reward=tiny:starts_with_digit", "task.instruction=",
        "rollout.engine=hf:bf16", "rollout.prompts_per_step=4", "rollout.group_size=6", "rollout.max_new_tokens=6",
        "rollout.context_length=256", "algo.ps.budget=3", "algo.ps.xi_min=0.05", "algo.dynamic_sampling=off",
        "optim.lr=0.01", "optim.warmup_steps=0", f"steps={STEPS}", "save_every=2", "eval.num_prompts=0",
        "tensorboard=false", "log_samples=1", f"output_dir={run}", *extra,
    ]


def losses(run: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in read_jsonl(run / "metrics.jsonl") if "loss" in row}


def events(run: Path, kind: str) -> list[dict]:
    return [e for e in read_jsonl(run / "events.jsonl") if e["event"] == kind]


def lost_steps(got: dict[int, float], expected: dict[int, float]) -> list[int]:
    """Steps of `expected` that `got` lacks or logs with another loss."""
    return [s for s, v in expected.items() if s not in got or not math.isclose(got[s], v, rel_tol=1e-5, abs_tol=1e-7)]


def same_state(a, b) -> bool:
    """Nested state dicts equal bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    return a == b


def snapshot(trainer: Trainer) -> dict:
    return copy.deepcopy({
        "weights": trainer.model.state_dict(), "optimizer": trainer.learner.optimizer.state_dict(),
        "scheduler": trainer.learner.scheduler.state_dict(),
        # lambda, what an update moves (c is measured from the first batch, before its update)
        "lambda": trainer.learner.correction.state_dict().get("lam"),
    })


@pytest.fixture(scope="module")
def tally(report_to_terminal):
    """Counts of the module: faults injected, faults survived, steps of data lost."""
    counts = {"injected": 0, "survived": 0, "data_lost": 0}
    yield counts
    line = (f"fault injection: {counts['injected']} faults injected, {counts['survived']} survived,"
            f" {counts['data_lost']} steps of data lost")
    report_to_terminal(line)
    assert counts["data_lost"] == 0, line


@contextmanager
def fault(tally):
    """One injected fault; it counts as survived when the block's assertions pass."""
    tally["injected"] += 1
    yield
    tally["survived"] += 1


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, tiny_dir):
    """The uninterrupted run: its losses per step and final weights."""
    folder = tmp_path_factory.mktemp("baseline")
    trainer = Trainer(load_config(None, overrides(folder, tiny_dir, folder / "run")))
    trainer.run()
    return {"losses": losses(folder / "run"), "weights": trainer.model.state_dict(), "run": folder / "run"}


def toy_trainer(tmp_path, tiny_dir, *extra, resume=False) -> Trainer:
    return Trainer(load_config(None, overrides(tmp_path, tiny_dir, tmp_path / "run", *extra)), resume=resume)


# --------------------------------------------------------------------------- subprocess runs


class Child:
    """`deployrl train` in a subprocess (CHILD); stdout lines are read by a thread."""

    def __init__(self, args: list[str], folder: Path, step_pause=0.3, save_pause=0.2, size_limit=0) -> None:
        env = dict(os.environ, PYTHONPATH=str(TESTS), OMP_NUM_THREADS="1", DEPLOYRL_REWARD_WORKERS="1",
                   TQDM_DISABLE="1", FAULT_STEP_PAUSE_S=str(step_pause), FAULT_SAVE_PAUSE_S=str(save_pause),
                   FAULT_FILE_SIZE_LIMIT=str(size_limit))
        folder.mkdir(parents=True, exist_ok=True)
        self.stderr_path = folder / f"stderr-{time.monotonic_ns()}.txt"
        self._stderr = open(self.stderr_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, *args], stdout=subprocess.PIPE,
                                     stderr=self._stderr, text=True, env=env)
        self.lines: "queue.Queue[str | None]" = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.seen: list[str] = []

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put(None)

    def wait_for(self, marker: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while marker not in self.seen:
            line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            if line is None:
                raise AssertionError(f"the child exited before {marker!r}:\n{self.stderr()}")
            self.seen.append(line)

    def finish(self, timeout: float = 120) -> int:
        """Wait for the exit; every stdout line is in `seen` afterwards."""
        code = self.proc.wait(timeout)
        self._stderr.close()
        while (line := self.lines.get(timeout=timeout)) is not None:
            self.seen.append(line)
        return code

    def kill(self, signum=signal.SIGKILL) -> int:
        self.proc.send_signal(signum)
        return self.finish()

    def stderr(self) -> str:
        return self.stderr_path.read_text()


@pytest.fixture
def spawn(tmp_path):
    """Child(...) that is killed at the end of the test if it still runs (a failed test)."""
    children = []

    def start(*args, **kwargs) -> Child:
        children.append(Child(*args, **kwargs))
        return children[-1]

    yield start
    for child in children:
        if child.proc.poll() is None:
            child.kill()


def test_killed_and_interrupted_runs_resume_to_the_uninterrupted_result(baseline, tmp_path, tiny_dir, tally, spawn):
    """SIGKILL in a checkpoint write, SIGKILL at a random moment, SIGTERM: the resumed run ends
    with the uninterrupted run's losses and weights."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    run = tmp_path / "run"
    args = overrides(tmp_path, tiny_dir, run)
    checkpoints = run / "checkpoints"

    with fault(tally):  # SIGKILL while the first checkpoint is written: it must never be picked up
        child = spawn(args, tmp_path, save_pause=5)
        child.wait_for("SAVING 2")
        assert child.kill() == -signal.SIGKILL
        assert list(checkpoints.glob(".tmp-step_00000002-*")) and latest_checkpoint(run) is None

    with fault(tally):  # SIGKILL at a random moment of a later step (maybe inside a checkpoint write)
        child = spawn([*args, "--resume"], tmp_path)
        child.wait_for("STEP 1")
        assert "starts from step 0" in child.stderr()  # the half-written checkpoint was ignored
        kill_after = rng.randint(3, 6)
        child.wait_for(f"STEP {kill_after}")
        time.sleep(rng.uniform(0, 0.6))
        assert child.kill() == -signal.SIGKILL
        last = checkpoint_step(latest_checkpoint(run))
        assert 2 <= last <= kill_after, f"seed {seed}"
        verify_checkpoint(latest_checkpoint(run))

    with fault(tally):  # SIGTERM: the step finishes, a checkpoint is written, a resume hint printed
        child = spawn([*args, "--resume"], tmp_path)
        child.wait_for(f"STEP {last + 1}")
        assert f"resuming from {latest_checkpoint(run)} (step {last})" in child.stderr()
        assert child.kill(signal.SIGTERM) == 128 + signal.SIGTERM
        stopped = last + 1
        hint = next(line for line in child.stderr().splitlines() if "resume with:" in line)
        assert f"stopped at step {stopped}; resume with: deployrl train " in hint and hint.endswith(" --resume")
        assert checkpoint_step(latest_checkpoint(run)) == stopped and max(losses(run)) == stopped
        verify_checkpoint(latest_checkpoint(run))
        assert events(run, "interrupted")[-1]["signal"] == "SIGTERM"

    child = spawn([*args, "--resume"], tmp_path, step_pause=0, save_pause=0)
    assert child.finish() == 0, child.stderr()
    assert child.seen[0] == f"STEP {stopped + 1}", f"seed {seed}"  # nothing before the checkpoint is redone
    got = losses(run)
    assert sorted(got) == list(range(1, STEPS + 1))  # every step once
    lost = lost_steps(got, baseline["losses"])
    tally["data_lost"] += len(lost)
    assert not lost, f"seed {seed}: steps {lost} differ from the uninterrupted run"
    from safetensors.torch import load_file

    final = load_file(checkpoints / f"step_{STEPS:08d}" / "model" / "model.safetensors")
    for name, value in final.items():
        torch.testing.assert_close(value, baseline["weights"][name], rtol=1e-5, atol=1e-6, msg=name)
    assert not list(checkpoints.glob(".tmp-*"))  # the half-written checkpoint was cleaned up


def test_full_disk_at_checkpoint_time_keeps_the_previous_checkpoint(tmp_path, tiny_dir, tally, spawn):
    run = tmp_path / "run"
    toy_trainer(tmp_path, tiny_dir, "steps=2").run()  # step_00000002, written normally
    with fault(tally):
        # Files may grow to 16 kB: the logs fit, a checkpoint (its rng.json alone is 22 kB) does not.
        child = spawn([*overrides(tmp_path, tiny_dir, run, "steps=4"), "--resume"], tmp_path, step_pause=0,
                      save_pause=0, size_limit=16_000)
        assert child.finish() == 1
        err = child.stderr()
        assert f"could not write checkpoint {run / 'checkpoints' / 'step_00000004'}" in err
        assert "File too large" in err and "step_00000002) is untouched" in err
        assert "resume with: deployrl train" in err
        assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_00000002"]  # no partial one
        verify_checkpoint(run / "checkpoints" / "step_00000002")
        assert sorted(losses(run)) == [1, 2, 3, 4]


# --------------------------------------------------------------------------- in-process faults


def test_unwritable_or_full_run_directory_fails_before_the_model_loads(tmp_path, tiny_dir, tally, monkeypatch):
    monkeypatch.setattr(trainer_module, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with fault(tally):  # (chmod does not stop root: a file in the way does)
        config = load_config(None, overrides(tmp_path, tiny_dir, blocker / "run"))
        with pytest.raises(RunDirectoryError, match=r"cannot write to the run directory .*a-file/run \(output_dir\)"):
            Trainer(config)

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with fault(tally):
        monkeypatch.setattr(runlog, "open", full_disk, raising=False)
        with pytest.raises(RunDirectoryError, match="No space left on device.*free space") as info:
            Trainer(load_config(None, overrides(tmp_path, tiny_dir, tmp_path / "run")))
        assert info.value.errno == errno.ENOSPC


def test_corrupt_checkpoint_is_refused_and_resume_falls_back(baseline, tmp_path, tiny_dir, tally):
    run = tmp_path / "run"
    shutil.copytree(baseline["run"], run)
    weights = run / "checkpoints" / f"step_{STEPS:08d}" / "model" / "model.safetensors"
    with fault(tally):
        data = bytearray(weights.read_bytes())
        data[-100] ^= 0xFF  # one flipped bit pattern, same size: only the sha256 sees it
        weights.write_bytes(bytes(data))
        with pytest.warns(RuntimeWarning, match=r"skipping checkpoint: .*does not match its sha256"):
            trainer = toy_trainer(tmp_path, tiny_dir, resume=True)
        assert trainer.resumed_from == run / "checkpoints" / f"step_{STEPS - 2:08d}"
        with pytest.raises(CheckpointError, match=r"model\.safetensors does not match its sha256"):
            load_checkpoint(weights.parents[1], trainer.model)
        trainer.run()
        got = losses(run)
        lost = lost_steps(got, baseline["losses"])
        tally["data_lost"] += len(lost)
        assert sorted(got) == list(range(1, STEPS + 1)) and not lost
        verify_checkpoint(weights.parents[1])  # rewritten whole


def test_nonfinite_loss_skips_the_update_and_leaves_the_state_untouched(tmp_path, tiny_dir, tally, monkeypatch):
    trainer = toy_trainer(tmp_path, tiny_dir, "algo.correction=dc")
    trainer.step()
    before = snapshot(trainer)
    real_loss = trainer.learner.loss

    def nan_loss(*args, **kwargs):
        out = real_loss(*args, **kwargs)
        out.loss = out.loss * math.nan
        return out

    with fault(tally):
        monkeypatch.setattr(trainer.learner, "loss", nan_loss)
        metrics = trainer.step()
        assert metrics["optim/skipped_updates"] == 1 and metrics["optim/updates"] == 0
        assert same_state(snapshot(trainer), before)  # weights, optimizer, schedule and λ bit for bit
        skip = events(tmp_path / "run", "nonfinite_update")[-1]
        assert skip["step"] == 2 and skip["loss"] is None
        assert skip["examples"] and all("digits.jsonl:" in e for e in skip["examples"])
        assert trainer.state.skipped_in_a_row == 1
    monkeypatch.setattr(trainer.learner, "loss", real_loss)
    metrics = trainer.step()
    assert metrics["optim/updates"] == 1 and trainer.state.skipped_in_a_row == 0
    assert not same_state(snapshot(trainer)["weights"], before["weights"])
    trainer.logger.close()


def test_nan_gradients_in_a_row_stop_the_run(tmp_path, tiny_dir, tally):
    trainer = toy_trainer(tmp_path, tiny_dir, "optim.max_skipped_steps=2")
    before = snapshot(trainer)
    with fault(tally):  # a finite loss, a NaN gradient on one parameter, every step
        trainer.model.model.norm.weight.register_hook(lambda grad: torch.full_like(grad, math.nan))
        limit = r"stopped at step 2: .* 2 steps in a row \(optim\.max_skipped_steps=2\)"
        with pytest.raises(NonFiniteError, match=limit):
            trainer.run()
        assert same_state(snapshot(trainer), before)
        skips = events(tmp_path / "run", "nonfinite_update")
        assert len(skips) == 2 and all(math.isfinite(s["loss"]) and s["grad_norm"] is None for s in skips)
        assert "NonFiniteError" in events(tmp_path / "run", "stopped")[-1]["error"]


class FlakyEngine:
    """Wraps an engine; each generate call fails in the way the next item of `faults` names (None: not).
    `closed` lists the faults of the engines closed after failing."""

    closed: list = []

    def __init__(self, engine, faults, unhang: threading.Event) -> None:
        self.engine, self.faults, self.unhang, self.name = engine, faults, unhang, engine.name
        self.fault = None

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def close(self) -> None:
        FlakyEngine.closed.append(self.fault)
        self.engine.close()

    def generate(self, prompts, params) -> RolloutBatch:
        fault = self.fault = next(self.faults, None)
        if fault == "raise":
            raise RuntimeError("llama_decode returned -1")
        if fault == "hang":
            self.unhang.wait(30)
        batch = self.engine.generate(prompts, params)
        if fault == "bad_token":
            batch.completion_ids[0, 0] = 10_000
        elif fault == "nan_logp":
            batch.logp_inf[1, 0] = math.nan
        elif fault == "short":
            batch.mask = batch.mask[:-1]
        return batch


def flaky_engines(monkeypatch, trainer: Trainer, faults: list) -> threading.Event:
    """Make every engine of `trainer`, the first and the rebuilt ones, fail its calls as `faults`
    says in turn; returns the event that releases a hung call."""
    release, plan = threading.Event(), iter(faults)
    FlakyEngine.closed = []
    trainer.rollout.engine = FlakyEngine(trainer.rollout.engine, plan, release)
    build = trainer.rollout.build_engine
    monkeypatch.setattr(trainer.rollout, "build_engine", lambda weights=None: FlakyEngine(build(weights), plan, release))
    return release


def test_engine_failures_are_retried_on_a_fresh_engine(baseline, tmp_path, tiny_dir, tally, monkeypatch):
    trainer = toy_trainer(tmp_path, tiny_dir, "steps=4", "rollout.max_retries=2", "rollout.timeout_s=2")
    # one item per generate call of the 4 steps; a failed call is retried on a fresh engine
    release = flaky_engines(monkeypatch, trainer, ["raise", "bad_token", None, "hang", None, "nan_logp", None, "short"])
    tally["injected"] += 5
    try:
        trainer.run()
    finally:
        release.set()
    failures = events(tmp_path / "run", "engine_failure")
    assert [e["step"] for e in failures] == [1, 1, 2, 3, 4]
    assert "RuntimeError: llama_decode returned -1" in failures[0]["error"]
    assert "token ids outside the vocabulary" in failures[1]["error"]
    assert "EngineTimeout" in failures[2]["error"] and "rollout.timeout_s=2" in failures[2]["error"]
    assert "non-finite logp_inf" in failures[3]["error"]
    assert "must be a [24, T] tensor" in failures[4]["error"]
    # a failed engine is closed (its memory is the retry's); a hung one is left to its running call
    assert FlakyEngine.closed == ["raise", "bad_token", "nan_logp", "short"]
    got = losses(tmp_path / "run")
    lost = lost_steps(got, {s: baseline["losses"][s] for s in range(1, 5)})  # no bad batch reached the loss
    tally["data_lost"] += len(lost)
    assert not lost
    tally["survived"] += 5


def test_check_rollouts_names_what_is_malformed():
    prompts, params = [[5, 6], [7]], SamplingParams(n=2, max_new_tokens=3)
    good = pad_rollouts([[5, 6], [5, 6], [7], [7]], [[1, 2], [3], [4, 5, 2], [9]],
                        [[-0.5, -1.0], [-0.1], [-2.0, -0.3, -0.2], [0.0]], ["length", "stop", "stop", "stop"],
                        "processed", 2)
    check_rollouts(good, prompts, params, vocab_size=10)
    broken = {
        r"logp_inf must be <= 0": lambda b: b.logp_inf.__setitem__((0, 0), 0.5),
        r"1 real tokens have a non-finite logp_inf": lambda b: b.logp_inf.__setitem__((2, 1), -math.inf),
        r"outside the vocabulary \[0, 10\): \[10\]": lambda b: b.completion_ids.__setitem__((1, 0), 10),
        r"the mask is not a prefix": lambda b: b.mask.__setitem__((1, 2), True),
        r"prompt_ids do not repeat each of the 2 prompts 2 times": lambda b: b.prompt_ids.reverse(),
        r"finish_reasons must be 4 of": lambda b: b.finish_reasons.__setitem__(0, "eos"),
        r"group_size is 3": lambda b: setattr(b, "group_size", 3),
        r"logp_inf must be a \[4, T\] tensor": lambda b: setattr(b, "logp_inf", b.logp_inf[:3]),
        r"differ in shape": lambda b: setattr(b, "logp_inf", b.logp_inf[:, :2]),
        r"not a RolloutBatch": None,
    }
    for message, corrupt in broken.items():
        batch = copy.deepcopy(good)
        if corrupt is None:
            batch = {"completion_ids": batch.completion_ids}
        else:
            corrupt(batch)
        with pytest.raises(MalformedRollouts, match=message):
            check_rollouts(batch, prompts, params, vocab_size=10)
    with pytest.raises(MalformedRollouts, match=r"a completion has 3 tokens, more than max_new_tokens=2"):
        check_rollouts(good, prompts, SamplingParams(n=2, max_new_tokens=2), vocab_size=10)


def test_an_engine_that_keeps_failing_stops_the_run(tmp_path, tiny_dir, tally, monkeypatch):
    trainer = toy_trainer(tmp_path, tiny_dir, "rollout.max_retries=1")
    before = snapshot(trainer)
    flaky_engines(monkeypatch, trainer, ["raise"] * 3)
    with fault(tally):
        with pytest.raises(EngineError, match=r"engine hf:bf16 failed 2 times in a row at step 1; last error:"
                                              r" RuntimeError: llama_decode returned -1"):
            trainer.run()
        assert len(events(tmp_path / "run", "engine_failure")) == 2
        assert same_state(snapshot(trainer), before)  # nothing reached the loss


def test_reward_failures_score_zero_and_the_run_goes_on(tmp_path, tiny_dir, tally, monkeypatch):
    trainer = toy_trainer(tmp_path, tiny_dir)
    calls = iter(range(10_000))

    def flaky_reward(completion, reference):  # a closure: scored in this process, in call order
        kind = next(calls) % 5
        if kind == 0:
            raise ValueError("grader crashed")
        if kind == 1:
            return math.nan
        if kind == 2:
            return "yes"
        if kind == 3:
            time.sleep(1.0)
        return 1.0

    trainer.task.reward = flaky_reward
    monkeypatch.setattr(rollout_module, "score_completions", partial(score_completions, timeout_s=0.5))
    tally["injected"] += 4  # raises, NaN, not a number, hangs
    metrics = trainer.step()
    # 24 completions: 5 of each kind but the last one
    assert metrics["reward/failures"] == 15 and metrics["reward/timeouts"] == 5
    assert metrics["reward/mean"] == pytest.approx(4 / 24)
    logged = events(tmp_path / "run", "reward_failures")[-1]
    assert logged["failures"] == 15 and logged["timeouts"] == 5
    text = " ".join(logged["errors"])
    assert "ValueError: grader crashed" in text and "reward returned nan" in text and "not a number" in text
    assert "exceeded 0.5 s" in text
    from tiny import starts_with_digit

    trainer.task.reward = starts_with_digit
    assert trainer.step()["optim/updates"] == 1  # the run goes on
    trainer.logger.close()
    tally["survived"] += 4


def test_a_reward_failing_on_every_sample_stops_the_run(tmp_path, tiny_dir, tally):
    trainer = toy_trainer(tmp_path, tiny_dir)
    before = snapshot(trainer)

    def broken_reward(completion, reference):
        return 1 / 0

    trainer.task.reward = broken_reward
    with fault(tally):
        own_error = r"failed on all 24 completions of step 1: ZeroDivisionError: division by zero"
        with pytest.raises(RewardFailure, match=own_error):
            trainer.run()
        assert same_state(snapshot(trainer), before)


def signals_in_step(monkeypatch, trainer: Trainer, step: int, count: int) -> None:
    """`count` SIGINTs arrive at the start of training step `step` of `trainer`."""
    run_step = trainer.step

    def step_with_signals():
        if trainer.state.step + 1 == step:
            for _ in range(count):
                os.kill(os.getpid(), signal.SIGINT)
        return run_step()

    monkeypatch.setattr(trainer, "step", step_with_signals)


def test_sigint_finishes_the_step_saves_and_restores_the_handler(tmp_path, tiny_dir, tally, monkeypatch):
    previous = signal.getsignal(signal.SIGINT)
    run = tmp_path / "run"
    with fault(tally):
        trainer = toy_trainer(tmp_path, tiny_dir, "steps=5", "save_every=100")
        signals_in_step(monkeypatch, trainer, step=2, count=1)
        with pytest.raises(TrainingInterrupted, match=r"stopped at step 2; resume with: deployrl train") as info:
            trainer.run()
        assert info.value.signum == signal.SIGINT and info.value.checkpoint == latest_checkpoint(run)
        assert checkpoint_step(info.value.checkpoint) == 2 and sorted(losses(run)) == [1, 2]
        assert signal.getsignal(signal.SIGINT) is previous

    with fault(tally):  # a second SIGINT abandons the step: the run goes on from the last checkpoint
        trainer = toy_trainer(tmp_path, tiny_dir, "steps=5", "save_every=100", resume=True)
        signals_in_step(monkeypatch, trainer, step=3, count=2)
        with pytest.raises(TrainingInterrupted, match=r"(?s)stopped at step 2; .*a second SIGINT abandoned") as info:
            trainer.run()
        assert checkpoint_step(info.value.checkpoint) == 2 and sorted(losses(run)) == [1, 2]
        assert signal.getsignal(signal.SIGINT) is previous
