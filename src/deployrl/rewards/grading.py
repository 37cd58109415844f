"""Rewards: pure functions ``(completion_text, reference) -> float``, a registry by name.

Built-ins (``REWARDS``):

* ``math`` — math-verify grading of the last ``\\boxed{...}`` of the completion (or, without
  one, the last answer math-verify finds) against a LaTeX or plain reference: 1.0 or 0.0.
* ``reasoning_gym`` — the answer between the last ``<answer>...</answer>`` tags (else the last
  ``\\boxed{...}``) scored by reasoning-gym's own ``score_answer`` for the entry's dataset.
* ``format`` — 1.0 when the completion contains a non-empty ``\\boxed{...}`` (its final answer).

``get_reward(name)`` returns a built-in or imports a user function given as
``"package.module:function"``.

Every reward here is a pure function of its arguments: no processes, threads or time limits
(module state is limited to caches). Grading can take unbounded time (sympy on a pathological
expression): ``deployrl.rewards.sandbox.score_completions`` runs rewards under a time limit. A
reward's ``_deployrl_prepare`` attribute, if any, does its slow imports; the sandbox runs it
before the clock starts. Answer extraction is linear in the completion's length, so model
output full of unclosed braces or tags is scanned in milliseconds.

``get_reward`` imports a user function only from the module named, found on ``sys.path``: a
file path or a dunder attribute is refused.
"""

from __future__ import annotations

import functools
import importlib
import logging
import re
from typing import Any, Callable, Optional

from deployrl.registry import Registry, unknown_name_error

RewardFn = Callable[[str, Any], float]
REWARDS: Registry[RewardFn] = Registry("reward")

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


@functools.cache
def _math_verify():
    """The math_verify module, imported on first use (it pulls sympy) and set up once."""
    import math_verify
    import math_verify.grader
    import math_verify.parser

    # Its own timeouts are off in every call (parsing_timeout=None, timeout_seconds=None): they
    # use signal.alarm, which fails outside the main thread, and the reward sandbox enforces the
    # time limit instead. Silence its one-time warning about that.
    math_verify.parser.TIMEOUT_WARNING_SHOWN = True
    math_verify.grader.TIMEOUT_WARNING_SHOWN = True
    for name in ("math_verify", "latex2sympy2_extended"):
        logging.getLogger(name).setLevel(logging.ERROR)
    return math_verify


@functools.lru_cache(maxsize=8192)
def _parse_boxed(content: str) -> tuple:
    mv = _math_verify()
    config = [mv.LatexExtractionConfig(boxed_match_priority=0), mv.ExprExtractionConfig()]
    return tuple(mv.parse("\\boxed{" + _normalize_answer(content) + "}", config, parsing_timeout=None))


@REWARDS.register("math")
def math_reward(completion: str, reference: Any) -> float:
    """1.0 if the completion's final answer equals `reference` mathematically, else 0.0.

    The answer is the last ``\\boxed{...}``; without one, the last answer math-verify finds
    (after "final answer is", or the last expression). `reference` is a LaTeX or plain string,
    a number, or a list of acceptable answers; a percentage ``x\\%`` also accepts ``x``.
    Safe from any thread; no time limit of its own (``reward_sandbox.score_completions`` sets one).

    >>> math_reward(r"Half of it: \\boxed{\\frac{1}{2}}", "0.5")
    1.0
    >>> math_reward(r"\\boxed{1/2}", r"\\frac{1}{2}")
    1.0
    >>> math_reward(r"\\boxed{0.6}", "0.5")
    0.0
    >>> math_reward("I do not know.", "0.5")
    0.0
    """
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


# math-verify (and sympy) are imported before a worker's clock starts
math_reward._deployrl_prepare = _math_verify


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
    >>> get_reward("deployrl.rewards.grading:format_reward") is format_reward
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
