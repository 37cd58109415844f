"""The reward sandbox: reward calls under a time limit, isolated from the trainer.

Grading can hang (sympy on a pathological expression) and must not stop a training run, so
``score_completions`` runs each call in a small pool of worker *processes* that is reused
across calls: a call past its time limit is stopped by killing its worker (a fresh one replaces
it), which works from any thread (no ``signal.alarm``). A reward that raises or times out
scores 0 and is counted in ``RewardScores``. A function that cannot be sent to a worker (a
lambda, a closure, a function of ``__main__``) runs in-process in a thread instead; its time
limit is then only a deadline (a hung call is abandoned, not stopped).

Functions travel to the workers by reference (module and name) over a pipe only the trainer
and its own workers hold. A worker runs a function's ``_deployrl_prepare`` attribute, if any
(its slow imports), before the call's clock starts. The pool starts on first use and stops at
exit.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable, Optional

from deployrl.rewards.grading import RewardFn
from deployrl.timeout import call_with_timeout

logger = logging.getLogger(__name__)


class RewardTimeout(TimeoutError):
    """A reward call ran past its time limit (its worker process was killed, or the in-process call abandoned)."""


class RewardError(RuntimeError):
    """A reward call raised (in a worker process: the message carries the original error)."""


# --------------------------------------------------------------------------- worker processes

_STARTUP_TIMEOUT_S = 120.0  # worker start + unpickling + the reward's imports (not timed per call)


def _as_number(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise RewardError(f"reward returned {value!r:.80}, not a number") from None


def _worker_main(task_fd: int, result_fd: int) -> None:
    """Loop of a reward worker process: receive sys.path, then (fn, args); reply.

    The two come as separate messages so that the function is looked up (by module and
    name) only after the parent's import path is in place."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business; EOF ends us
    tasks = Connection(task_fd, writable=False)
    results = Connection(result_fd, readable=False)
    while True:
        try:
            paths = tasks.recv()
        except (EOFError, OSError):
            return  # the parent went away
        if list(paths) != sys.path:
            sys.path[:] = paths
        try:
            fn, args = tasks.recv()
            prepare = getattr(fn, "_deployrl_prepare", None)
            if prepare is not None:
                prepare()
        except BaseException as err:  # noqa: BLE001 - reported to the parent
            results.send(("load-error", f"{type(err).__name__}: {err}"))
            continue
        results.send(("started", None))
        try:
            value = _as_number(fn(*args))
        except BaseException as err:  # noqa: BLE001
            results.send(("error", f"{type(err).__name__}: {err}"))
        else:
            results.send(("ok", value))


class _LoadError(Exception):
    """The function could not be loaded in a worker (not importable there)."""


class _DeadWorker(Exception):
    """An idle worker had exited before it was given a call."""


class _Worker:
    def __init__(self) -> None:
        task_r, task_w = os.pipe()
        result_r, result_w = os.pipe()
        src_dir = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([src_dir] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        code = f"from deployrl.rewards.sandbox import _worker_main; _worker_main({task_r}, {result_w})"
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", code], pass_fds=(task_r, result_w), env=env, stdin=subprocess.DEVNULL
            )
        except (OSError, ValueError) as err:  # e.g. no pass_fds on Windows
            os.close(task_w)
            os.close(result_r)
            raise _LoadError(f"cannot start a reward worker process ({type(err).__name__}: {err})") from err
        finally:
            os.close(task_r)
            os.close(result_w)
        self.tasks = Connection(task_w, readable=False)
        self.results = Connection(result_r, writable=False)

    def call(self, fn: Callable, args: tuple, timeout: Optional[float]):
        try:
            self.tasks.send(_sys_path())
            self.tasks.send((fn, args))
        except OSError as err:  # it died while idle (killed from outside, out of memory)
            raise _DeadWorker(str(err)) from err
        if not self.results.poll(_STARTUP_TIMEOUT_S):
            raise RewardTimeout(f"reward worker did not start within {_STARTUP_TIMEOUT_S:.0f} s")
        kind, info = self.results.recv()
        if kind == "load-error":
            raise _LoadError(info)
        if not self.results.poll(timeout):
            raise RewardTimeout(f"reward call exceeded {timeout} s")
        kind, info = self.results.recv()
        if kind == "error":
            raise RewardError(info)
        return info

    def kill(self) -> None:
        for conn in (self.tasks, self.results):
            try:
                conn.close()
            except OSError:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass


def _sys_path() -> list[str]:
    cwd = os.getcwd()
    return [p if p else cwd for p in sys.path]


class _WorkerPool:
    """Worker processes, started on demand (at most `size`) and reused; thread-safe."""

    def __init__(self, size: int) -> None:
        self.size = max(1, size)
        self._idle: list[_Worker] = []
        self._count = 0
        self._cond = threading.Condition()
        self._closed = False

    def _acquire(self) -> _Worker:
        with self._cond:
            while True:
                while self._idle:
                    worker = self._idle.pop()
                    if worker.proc.poll() is None:
                        return worker
                    worker.kill()  # exited while idle (killed from outside): replace it
                    self._count -= 1
                if self._count < self.size:
                    self._count += 1
                    break
                self._cond.wait()
        try:
            return _Worker()
        except BaseException:
            self._discard(None)
            raise

    def _release(self, worker: _Worker) -> None:
        with self._cond:
            if self._closed:
                worker.kill()
                self._count -= 1
            else:
                self._idle.append(worker)
            self._cond.notify()

    def _discard(self, worker: Optional[_Worker]) -> None:
        if worker is not None:
            worker.kill()
        with self._cond:
            self._count -= 1
            self._cond.notify()

    def call(self, fn: Callable, args: tuple, timeout: Optional[float]) -> float:
        for attempt in range(2):
            worker = self._acquire()
            try:
                value = worker.call(fn, args, timeout)
            except _DeadWorker as err:
                self._discard(worker)  # died just now, while idle: retry once on a fresh one
                if attempt:
                    raise RewardError(f"reward worker died before the call ({err})") from err
                continue
            except (RewardError, _LoadError):
                self._release(worker)  # the worker is fine, the function failed
                raise
            except BaseException as err:
                self._discard(worker)  # timed out, died or broken pipe: replace it
                if isinstance(err, (EOFError, OSError)) and not isinstance(err, RewardTimeout):
                    raise RewardError(f"reward worker died ({type(err).__name__}: {err})") from err
                raise
            self._release(worker)
            return value
        raise AssertionError("unreachable")  # pragma: no cover

    def close(self) -> None:
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._count -= len(idle)
        for worker in idle:
            worker.kill()


_POOL: Optional[_WorkerPool] = None
_POOL_LOCK = threading.Lock()


def _default_workers() -> int:
    env = os.environ.get("DEPLOYRL_REWARD_WORKERS")
    if env:
        return max(1, int(env))
    return max(1, min(4, os.cpu_count() or 1))


def _pool() -> _WorkerPool:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = _WorkerPool(_default_workers())
        return _POOL


def shutdown_workers() -> None:
    """Stop the reward worker processes (they restart on the next call)."""
    global _POOL
    with _POOL_LOCK:
        pool, _POOL = _POOL, None
    if pool is not None:
        pool.close()


atexit.register(shutdown_workers)


# --------------------------------------------------------------------------- batch scoring

@dataclass
class RewardScores:
    values: list[float]  # one per completion; 0 where the reward raised or timed out
    failures: int = 0  # calls that raised (or returned something that is not a finite number)
    timeouts: int = 0  # calls stopped at the time limit
    errors: list[str] = field(default_factory=list)  # the first few distinct failure messages


_MAX_ERRORS = 5
_WARNED_IN_PROCESS: set[str] = set()


def _picklable(fn: Callable) -> bool:
    """Whether a worker can import `fn` by module and qualified name (how functions travel)."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if module in (None, "__main__") or "<" in qualname:
        return False  # a worker's __main__ is not the user's script; lambdas and closures have no name
    target = sys.modules.get(module)
    for part in qualname.split("."):
        target = getattr(target, part, None)
    return target is fn


def _call_in_process(fn: Callable, args: tuple, timeout: Optional[float]) -> float:
    """fn(*args) in a thread of this process, abandoned (not stopped) past `timeout`."""

    def call() -> Any:
        try:
            return fn(*args)
        except KeyboardInterrupt:  # Ctrl-C (timeout None runs fn in this thread): the run's to handle
            raise
        except BaseException as err:  # noqa: BLE001 - the reward failed, as a worker reports it
            raise RewardError(f"{type(err).__name__}: {err}") from err

    def timed_out(_message: str) -> RewardTimeout:  # worded as a worker's: "reward call exceeded N s"
        return RewardTimeout(f"reward call exceeded {timeout} s (left running in a thread)")

    return _as_number(call_with_timeout(call, timeout, timed_out, "deployrl-reward"))


def _warn_in_process(fn: Callable, why: str) -> None:
    key = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
    if key not in _WARNED_IN_PROCESS:
        _WARNED_IN_PROCESS.add(key)
        logger.warning(
            "reward %s cannot run in a worker process (%s); running it in-process: its time limit"
            " is a deadline only, a hung call keeps running in a background thread",
            key,
            why,
        )


def score_completions(
    reward_fn: RewardFn, completions: list[str], references: list, timeout_s: Optional[float] = 5.0
) -> RewardScores:
    """Score each completion against its reference with `reward_fn`, never raising for one call.

    A call that raises, returns a non-finite or non-numeric value, or runs past `timeout_s`
    seconds (None: no limit) scores 0 and is counted. Calls run in parallel in the reward
    worker processes (``DEPLOYRL_REWARD_WORKERS``, default min(4, CPUs)); safe from any thread.
    """
    if len(completions) != len(references):
        raise ValueError(f"score_completions: {len(completions)} completions but {len(references)} references")
    if timeout_s is not None and timeout_s <= 0:
        raise ValueError(f"score_completions: timeout_s must be > 0 or None, got {timeout_s}")
    scores = RewardScores(values=[0.0] * len(completions))
    if not completions:
        return scores
    lock = threading.Lock()
    in_process = not _picklable(reward_fn)
    if in_process:
        _warn_in_process(reward_fn, "it cannot be pickled by reference")

    def record(kind: str, message: str) -> None:
        with lock:
            if kind == "timeout":
                scores.timeouts += 1
            else:
                scores.failures += 1
            if len(scores.errors) < _MAX_ERRORS and message not in scores.errors:
                scores.errors.append(message)

    def one(i: int) -> None:
        nonlocal in_process
        args = (completions[i], references[i])
        try:
            if not in_process:
                try:
                    value = _pool().call(reward_fn, args, timeout_s)
                except _LoadError as err:
                    _warn_in_process(reward_fn, str(err))
                    in_process = True
            if in_process:
                value = _call_in_process(reward_fn, args, timeout_s)
        except RewardTimeout as err:
            record("timeout", str(err))
            return
        except Exception as err:  # noqa: BLE001 - one bad call must not stop the run
            record("error", f"{type(err).__name__}: {err}" if not isinstance(err, RewardError) else str(err))
            return
        if not math.isfinite(value):
            record("error", f"reward returned {value}")
            return
        scores.values[i] = value

    workers = 1 if in_process else min(_pool().size, len(completions))
    if workers == 1:
        for i in range(len(completions)):
            one(i)
    else:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="deployrl-score") as executor:
            list(executor.map(one, range(len(completions))))
    return scores
