"""Rewards: pure functions ``(completion_text, reference) -> float``, a registry by name.

Built-ins (``REWARDS``):

* ``math`` — math-verify grading of the last ``\\boxed{...}`` of the completion (or, without
  one, the last answer math-verify finds) against a LaTeX or plain reference: 1.0 or 0.0.
* ``reasoning_gym`` — the answer between the last ``<answer>...</answer>`` tags (else the last
  ``\\boxed{...}``) scored by reasoning-gym's own ``score_answer`` for the entry's dataset.
* ``format`` — 1.0 when the completion contains a non-empty ``\\boxed{...}`` (its final answer).

``get_reward(name)`` returns a built-in or imports a user function given as
``"package.module:function"``.

Grading can hang (sympy on a pathological expression) and must not stop a training run, so
``score_completions`` runs each call in a small pool of worker *processes* that is reused
across calls: a call past its time limit is stopped by killing its worker (a fresh one replaces
it), which works from any thread (no ``signal.alarm``). math-verify's own signal-based timeouts
are switched off. Answer extraction is linear in the completion's length, so model output
full of unclosed braces or tags is scanned in milliseconds. A reward that raises or times out
scores 0 and is counted in ``RewardScores``. A function that cannot be sent to a worker (a
lambda, a closure, a function of ``__main__``) runs in-process in a thread instead; its time
limit is then only a deadline (a hung call is abandoned, not stopped).

``get_reward`` imports a user function only from the module named, found on ``sys.path``: a
file path or a dunder attribute is refused. Functions travel to the workers by reference
(module and name) over a pipe only the trainer and its own workers hold.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import logging
import math
import os
import re
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable, Optional

from deployrl.registry import Registry, unknown_name_error

logger = logging.getLogger(__name__)

RewardFn = Callable[[str, Any], float]
REWARDS: Registry[RewardFn] = Registry("reward")

MATH_TIMEOUT_S = 5.0  # time limit of one direct ``math`` call (score_completions sets its own)


class RewardTimeout(TimeoutError):
    """A reward call ran past its time limit (its worker process was killed)."""


class RewardError(RuntimeError):
    """A reward call raised (in a worker process: the message carries the original error)."""


# --------------------------------------------------------------------------- answer extraction

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BRACE_RE = re.compile(r"[{}]")


def _closing_braces(text: str) -> dict[int, int]:
    """The position of every ``{`` of `text` that is closed -> the position of its ``}``; one
    pass, so that model output full of unbalanced braces costs linear time.

    >>> _closing_braces("{a{b}}}{")
    {2: 4, 0: 5}
    """
    closing: dict[int, int] = {}
    opened: list[int] = []
    for match in _BRACE_RE.finditer(text):
        if match.group() == "{":
            opened.append(match.start())
        elif opened:
            closing[opened.pop()] = match.start()
    return closing


def last_boxed(text: str) -> Optional[str]:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in `text`, braces balanced;
    a box that is never closed is passed over for the one before it.

    >>> last_boxed(r"first \\boxed{1}, then \\boxed{\\frac{1}{2}}.")
    '\\\\frac{1}{2}'
    >>> last_boxed(r"\\boxed{1} \\boxed{2")
    '1'
    >>> last_boxed("no box") is None
    True
    """
    boxes = list(_BOX_RE.finditer(text))
    if not boxes:
        return None
    closing = _closing_braces(text)
    for match in reversed(boxes):
        end = closing.get(match.end() - 1)
        if end is not None:
            return text[match.end() : end]
    return None


def last_answer_tag(text: str) -> Optional[str]:
    """The content of the last ``<answer>...</answer>`` pair of `text` (pairs read left to right,
    each opening tag closed by the next closing tag), or None; linear time.

    >>> last_answer_tag("<answer>1</answer> then <answer> 2 </answer>")
    ' 2 '
    >>> last_answer_tag("<answer>a <answer>b</answer>")
    'a <answer>b'
    >>> last_answer_tag("<answer>unclosed") is None
    True
    """
    content, start = None, text.find("<answer>")
    while start >= 0:
        end = text.find("</answer>", start + len("<answer>"))
        if end < 0:
            break
        content = text[start + len("<answer>") : end]
        start = text.find("<answer>", end + len("</answer>"))
    return content


def extract_final_answer(text: str) -> Optional[str]:
    """The final answer of a completion: the last ``<answer>...</answer>``, else the last
    ``\\boxed{...}``; stripped. None when there is neither.

    >>> extract_final_answer("think... <answer> 42 </answer>")
    '42'
    >>> extract_final_answer(r"so \\boxed{7}")
    '7'
    >>> extract_final_answer(r"<answer>\\boxed{7}</answer>")
    '7'
    >>> extract_final_answer("7") is None
    True
    """
    tag = last_answer_tag(text)
    if tag is not None:
        inner = last_boxed(tag)  # <answer>\boxed{5}</answer> -> 5
        return (inner if inner is not None else tag).strip()
    boxed = last_boxed(text)
    return boxed.strip() if boxed is not None else None


_NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")


def last_number(text: str) -> Optional[str]:
    """The last number written in `text`, as written; None if there is none.

    >>> last_number("3 + 4 = 7.")
    '7'
    >>> last_number("it is -2.5 degrees")
    '-2.5'
    >>> last_number("none") is None
    True
    """
    numbers = _NUMBER_RE.findall(text)
    return numbers[-1] if numbers else None


# --------------------------------------------------------------------------- math (math-verify)

# 4.5e33 -> 4.5 \times 10^{33} (LaTeX parsers read "e" as Euler's number)
_SCI_RE = re.compile(r"(?<![\w\\.])(\d+(?:\.\d*)?|\.\d+)[eE]([+-]?\d+)(?![\w.])")
_PERCENT_RE = re.compile(r"^(.*?)\s*\\?%\s*$", re.DOTALL)


def _normalize_answer(text: str) -> str:
    return _SCI_RE.sub(r"\1 \\times 10^{\2}", text.strip())


def _gold_strings(reference: Any) -> list[str]:
    """Acceptable gold answers: a string, a number or a list of them; ``x\\%`` also accepts x."""
    if isinstance(reference, (list, tuple)):
        golds = [g for item in reference for g in _gold_strings(item)]
        if not golds:
            raise ValueError("math reward: empty reference list")
        return golds
    if isinstance(reference, bool) or reference is None:
        raise ValueError(f"math reward: reference must be a string or a number, got {reference!r}")
    if isinstance(reference, float) and reference.is_integer():
        reference = int(reference)
    text = str(reference).strip()
    if not text:
        raise ValueError("math reward: empty reference")
    golds = [text]
    percent = _PERCENT_RE.match(text)
    if percent and percent.group(1).strip():
        golds.append(percent.group(1).strip())
    return golds


_MV = None  # math_verify, imported lazily (it pulls sympy)


def _math_verify():
    global _MV
    if _MV is None:
        import math_verify
        import math_verify.grader
        import math_verify.parser

        # We enforce time limits ourselves (worker processes); silence the one-time warning.
        math_verify.parser.TIMEOUT_WARNING_SHOWN = True
        math_verify.grader.TIMEOUT_WARNING_SHOWN = True
        for name in ("math_verify", "latex2sympy2_extended"):
            logging.getLogger(name).setLevel(logging.ERROR)
        _MV = math_verify
    return _MV


@functools.lru_cache(maxsize=8192)
def _parse_boxed(content: str) -> tuple:
    mv = _math_verify()
    config = [mv.LatexExtractionConfig(boxed_match_priority=0), mv.ExprExtractionConfig()]
    return tuple(mv.parse("\\boxed{" + _normalize_answer(content) + "}", config, parsing_timeout=None))


def _math_grade(completion: str, reference: Any) -> float:
    mv = _math_verify()
    golds = _gold_strings(reference)
    boxed = last_boxed(completion)
    if boxed is not None:
        pred = list(_parse_boxed(boxed)) if boxed.strip() else []
    else:
        pred = mv.parse(completion, parsing_timeout=None)
    if not pred:
        return 0.0
    for gold in golds:
        parsed = list(_parse_boxed(gold))
        if parsed and mv.verify(parsed, pred, timeout_seconds=None):
            return 1.0
    return 0.0


@REWARDS.register("math")
def math_reward(completion: str, reference: Any) -> float:
    """1.0 if the completion's final answer equals `reference` mathematically, else 0.0.

    The answer is the last ``\\boxed{...}``; without one, the last answer math-verify finds
    (after "final answer is", or the last expression). `reference` is a LaTeX or plain string,
    a number, or a list of acceptable answers; a percentage ``x\\%`` also accepts ``x``.
    Runs in a worker process with a ``MATH_TIMEOUT_S`` limit (raises ``RewardTimeout``);
    safe from any thread.

    >>> math_reward(r"Half of it: \\boxed{\\frac{1}{2}}", "0.5")
    1.0
    >>> math_reward(r"\\boxed{1/2}", r"\\frac{1}{2}")
    1.0
    >>> math_reward(r"\\boxed{0.6}", "0.5")
    0.0
    >>> math_reward("I do not know.", "0.5")
    0.0
    """
    if _IN_WORKER:
        return _math_grade(completion, reference)
    try:
        return _pool().call(_math_grade, (completion, reference), MATH_TIMEOUT_S)
    except _LoadError:  # no worker processes on this platform
        return _call_in_thread(_math_grade, (completion, reference), MATH_TIMEOUT_S)


# math-verify (and sympy) are imported before a worker's clock starts
math_reward._deployrl_prepare = _math_verify
_math_grade._deployrl_prepare = _math_verify


# --------------------------------------------------------------------------- reasoning-gym

@functools.lru_cache(maxsize=256)
def _rg_scorer(name: str, config_key: str) -> Callable[[Optional[str], dict], float]:
    import json

    import reasoning_gym

    config = json.loads(config_key)
    if config:
        return reasoning_gym.create_dataset(name, **config).score_answer
    return reasoning_gym.get_score_answer_fn(name)


def _rg_prepare() -> None:
    import reasoning_gym  # noqa: F401  (about 2 s, before a worker's clock starts)


@REWARDS.register("reasoning_gym")
def reasoning_gym_reward(completion: str, reference: dict) -> float:
    """reasoning-gym's own score for the completion's final answer, in [0, 1].

    The answer is the text between the last ``<answer>`` and ``</answer>`` tags, else the
    content of the last ``\\boxed{...}`` (``extract_final_answer``), else the last number in
    the completion (small models state results in prose before they learn a format); without
    any, the dataset scores ``None`` (0 for every built-in dataset). `reference` is the entry that
    reasoning-gym generated (``question``, ``answer``, ``metadata``); the dataset is
    ``reference["dataset"]`` if present, else ``metadata["source_dataset"]``, built with the
    settings in ``reference["dataset_config"]`` (default settings if absent).

    >>> entry = {"question": "2 + 3 =", "answer": "5",
    ...          "metadata": {"source_dataset": "chain_sum"}}
    >>> reasoning_gym_reward("2 + 3 is five. <answer>5</answer>", entry)
    1.0
    >>> reasoning_gym_reward("<answer>6</answer>", entry)
    0.0
    >>> reasoning_gym_reward("2 + 3 = 5.", entry)
    1.0
    """
    import json

    if not isinstance(reference, dict) or "answer" not in reference:
        raise ValueError("reasoning_gym reward: the reference must be a reasoning-gym entry (a dict with 'answer')")
    name = reference.get("dataset") or (reference.get("metadata") or {}).get("source_dataset")
    if not name:
        raise ValueError("reasoning_gym reward: the entry names no dataset (metadata['source_dataset'])")
    config = reference.get("dataset_config") or {}
    scorer = _rg_scorer(name, json.dumps(config, sort_keys=True, default=str))
    answer = extract_final_answer(completion)
    return float(scorer(answer if answer is not None else last_number(completion), reference))


reasoning_gym_reward._deployrl_prepare = _rg_prepare


# --------------------------------------------------------------------------- format

@REWARDS.register("format")
def format_reward(completion: str, reference: Any = None) -> float:
    """1.0 if the completion gives a final answer in the expected format, a non-empty
    ``\\boxed{...}``; else 0.0. The reference is ignored.

    >>> format_reward(r"... so the answer is \\boxed{12}.", None)
    1.0
    >>> format_reward("the answer is 12", None)
    0.0
    >>> format_reward(r"\\boxed{}", None)
    0.0
    """
    boxed = last_boxed(completion)
    return 1.0 if boxed is not None and boxed.strip() else 0.0


# --------------------------------------------------------------------------- lookup

def get_reward(name: str) -> RewardFn:
    """A built-in reward by name, or a user function ``"package.module:function"``.

    >>> get_reward("math") is math_reward
    True
    >>> get_reward("deployrl.rewards:format_reward") is format_reward
    True
    >>> get_reward("maths")
    Traceback (most recent call last):
    ...
    ValueError: unknown reward 'maths'. Did you mean 'math'? Valid names: format, math, reasoning_gym. A user function is given as 'package.module:function'.
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"reward name must be a non-empty string, got {name!r}")
    if ":" not in name:
        if name not in REWARDS:
            err = unknown_name_error("reward", name, REWARDS.names())
            raise ValueError(f"{err} A user function is given as 'package.module:function'.")
        return REWARDS.get(name)
    module_name, _, attr_path = name.partition(":")
    if not module_name or not attr_path:
        raise ValueError(f"reward {name!r}: expected 'package.module:function'")
    if not all(part.isidentifier() for part in module_name.split(".")):
        raise ValueError(
            f"reward {name!r}: {module_name!r} is not a module name; give the module's import name"
            " (package.module, found on sys.path: put its directory on PYTHONPATH), not a file path"
        )
    if not all(part.isidentifier() and not part.startswith("__") for part in attr_path.split(".")):
        raise ValueError(
            f"reward {name!r}: {attr_path!r} must name a function of the module (function or Class.method),"
            " without dunder attributes"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # ImportError, or an error raised while importing the module
        raise ValueError(f"reward {name!r}: cannot import module {module_name!r} ({type(err).__name__}: {err})") from err
    obj: Any = module
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"reward {name!r}: module {module_name!r} has no attribute {attr_path!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"reward {name!r}: {module_name}:{attr_path} is not callable")
    return obj


# --------------------------------------------------------------------------- DAPO overlong

def overlong_penalty(length: int, max_length: int, buffer: int) -> float:
    """DAPO's soft overlong punishment, added to the reward of a completion of `length` tokens.

    0 up to ``max_length - buffer``, then linear down to -1 at `max_length`, -1 beyond.

    >>> overlong_penalty(100, max_length=1000, buffer=200)
    0.0
    >>> overlong_penalty(800, max_length=1000, buffer=200)
    0.0
    >>> overlong_penalty(900, max_length=1000, buffer=200)
    -0.5
    >>> overlong_penalty(1000, max_length=1000, buffer=200)
    -1.0
    >>> overlong_penalty(1200, max_length=1000, buffer=200)
    -1.0
    """
    if max_length <= 0:
        raise ValueError(f"overlong_penalty: max_length must be > 0, got {max_length}")
    if not 0 <= buffer <= max_length:
        raise ValueError(f"overlong_penalty: buffer must be in [0, max_length={max_length}], got {buffer}")
    start = max_length - buffer
    if length <= start:
        return 0.0
    if length >= max_length:
        return -1.0
    return (start - length) / buffer


# --------------------------------------------------------------------------- worker processes

_IN_WORKER = False  # True inside a reward worker process
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
    global _IN_WORKER
    _IN_WORKER = True
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
        src_dir = str(Path(__file__).resolve().parents[1])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([src_dir] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        code = f"from deployrl.rewards import _worker_main; _worker_main({task_r}, {result_w})"
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


def _call_in_thread(fn: Callable, args: tuple, timeout: Optional[float]) -> float:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as err:  # noqa: BLE001
            box["error"] = err

    thread = threading.Thread(target=run, daemon=True, name="deployrl-reward")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise RewardTimeout(f"reward call exceeded {timeout} s (left running in a thread)")
    if "error" in box:
        err = box["error"]
        raise RewardError(f"{type(err).__name__}: {err}") from err
    return _as_number(box["value"])


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
                value = _call_in_thread(reward_fn, args, timeout_s)
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
