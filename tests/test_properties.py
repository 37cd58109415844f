"""Property-based tests (hypothesis) of the config loader and the dataset reader, and a fuzz run of
answer extraction and grading on random and adversarial strings.

* Config: any mapping of known keys to values of any type loads into a valid TrainConfig or
  raises ConfigError (never a bare KeyError, TypeError, ...); a valid config survives
  to_dict -> build unchanged.
* Dataset: JSONL files of valid, blank and malformed lines load exactly the valid lines, or
  stop at the first malformed one with an error naming its file and line (with
  on_bad_example: skip, leave out and count each malformed line).
* Grading: every reward returns a finite score in [0, 1] for any completion, never raises,
  and returns within its time limit. A line at the end reports the strings graded.
"""

import dataclasses
import json
import math
import time
import typing

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from deployrl.rewards.grading import (
    extract_final_answer,
    format_reward,
    last_answer_tag,
    last_boxed,
    last_number,
    math_reward,
    reasoning_gym_reward,
)
from deployrl.rewards.sandbox import score_completions
from deployrl.settings.config import TrainConfig, load_config
from deployrl.settings.parsing import ConfigError, build, to_dict
from deployrl.settings.task import JsonlTask
from deployrl.tasks import TaskDataError, load_task

FAST = settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

# --------------------------------------------------------------------------- config loader


def config_keys(cls: type = TrainConfig, prefix: str = "") -> list[str]:
    """Every dotted key of `cls`, sections included: 'algo', 'algo.dc', 'algo.dc.lr', ..."""
    keys = []
    for f in dataclasses.fields(cls):
        keys.append(prefix + f.name)
        hint = typing.get_type_hints(cls)[f.name]
        nested = [h for h in (hint, *typing.get_args(hint)) if dataclasses.is_dataclass(h)]
        if nested:
            keys += config_keys(nested[0], f"{prefix}{f.name}.")
    return keys


KEYS = config_keys()
# Names that some field accepts, so that random configs also reach the checks behind the choices.
NAMES = [
    "fp32", "bf16", "hf:bf16", "hf:fp8", "llamacpp:q4_1", "llamacpp", "grpo", "rloo", "token_mean", "dc", "none", "tis",
    "mask", "full", "uniform", "optimized", "sgrpo", "hinge", "diff", "log", "tv", "cosine", "drop", "refill", "off",
    "jsonl", "parquet", "hf", "reasoning_gym", "benchmark", "math500", "gsm8k", "basic_arithmetic", "chain_sum",
    "skip", "stop", "smollm2-135m", "model.gguf", "data.jsonl", "data.parquet", "org/model", "",
]
# Rewards are imported by name: only these, never random module names.
REWARDS = ["auto", "math", "format", "reasoning_gym", "maths", "tiny:starts_with_digit", "no_such_module_xyz:f",
           "/tmp/reward.py:f", "deployrl.rewards.grading:math_reward.__globals__", ":", 3]
ANY_VALUE = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 300), st.integers(), st.floats(), st.text(max_size=10),
    st.sampled_from(NAMES), st.lists(st.integers(-2, 5), max_size=3),
    st.dictionaries(st.sampled_from(["min_terms", "max_terms", "size", "x", "type", "name"]), st.integers(-1, 5), max_size=2),
)


def nest(pairs: list[tuple[str, object]]) -> dict:
    """{'a.b': 1} -> {'a': {'b': 1}}; a key under one already set to a non-mapping is dropped."""
    data: dict = {}
    for key, value in pairs:
        node, parts = data, key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                break
        else:
            if not isinstance(node.get(parts[-1]), dict):
                node[parts[-1]] = value
    return data


@st.composite
def random_config_data(draw) -> dict:
    keys = draw(st.lists(st.sampled_from(KEYS), max_size=6, unique=True))
    pairs = [(k, draw(st.sampled_from(REWARDS) if k.endswith("reward") else ANY_VALUE)) for k in keys]
    return nest(pairs)


@FAST
@given(random_config_data())
def test_random_configs_load_or_raise_config_error(data):
    try:
        config = build(TrainConfig, data, "random.yaml")
    except ConfigError as err:
        assert str(err).startswith("random.yaml"), err
    else:
        assert isinstance(config, TrainConfig)


@FAST
@given(st.lists(st.tuples(st.sampled_from(KEYS), st.text(max_size=12)), max_size=4))
def test_random_command_line_overrides_load_or_raise_config_error(pairs):
    overrides = [f"{key}={'math' if key.endswith('reward') else text}" for key, text in pairs]
    try:
        assert isinstance(load_config(None, overrides), TrainConfig)
    except ConfigError:
        pass


@st.composite
def valid_configs(draw) -> TrainConfig:
    max_new_tokens = draw(st.integers(1, 512))
    budget = draw(st.floats(0.5, max_new_tokens))
    engine = draw(st.sampled_from(["hf:fp32", "hf:bf16", "hf:fp8", "llamacpp:q4_1", "llamacpp:f16"]))
    data = nest([
        ("model.name", "smollm2-135m" if engine.startswith("llamacpp") else draw(st.text(min_size=1, max_size=12))),
        ("model.dtype", draw(st.sampled_from(["fp32", "bf16", "fp16"]))),
        ("rollout.engine", engine),
        ("rollout.group_size", draw(st.integers(2, 16))),
        ("rollout.max_new_tokens", max_new_tokens),
        ("rollout.context_length", max_new_tokens + draw(st.integers(1, 4096))),
        ("rollout.temperature", draw(st.floats(0.01, 2))),
        ("algo.advantage", draw(st.sampled_from(["grpo", "dr_grpo", "rloo"]))),
        ("algo.correction", draw(st.sampled_from(["none", "tis", "mask", "dc"]))),
        ("algo.eps_low", draw(st.floats(0, 0.99))),
        ("algo.dc.tolerance", draw(st.none() | st.floats(0, 1))),
        ("algo.ps.strategy", draw(st.sampled_from(["full", "uniform", "temporal", "heuristic", "optimized", "sgrpo"]))),
        ("algo.ps.budget", budget),
        ("algo.ps.xi_min", draw(st.floats(1e-4, 0.999)) * min(1.0, budget / max_new_tokens)),
        ("optim.lr", draw(st.floats(1e-8, 1e-2))),
        ("task.max_examples", draw(st.none() | st.integers(1, 100))),
        ("task.on_bad_example", draw(st.sampled_from(["stop", "skip"]))),
        ("eval.task", draw(st.none() | st.just({"type": "benchmark", "name": "gsm8k"}))),
        ("seed", draw(st.integers(0, 2**32 - 1))),
        ("output_dir", draw(st.text(min_size=1, max_size=12))),
    ])
    return build(TrainConfig, data, "valid.yaml")


@FAST
@given(valid_configs())
def test_a_config_survives_to_dict_and_back(config):
    assert build(TrainConfig, to_dict(config), "round trip") == config


# --------------------------------------------------------------------------- dataset reader

TEXT = st.text(st.characters(exclude_categories=["Cs"]), min_size=1, max_size=20).filter(str.strip)
MALFORMED = {  # kind -> one line of that kind (bytes)
    "bad JSON": TEXT.map(lambda t: json.dumps({"prompt": t, "answer": "1"})[:-1].encode()),
    "missing field": TEXT.map(lambda t: json.dumps({"prompt": t}).encode()),
    "empty prompt": st.sampled_from(["", " ", "\t\n"]).map(lambda t: json.dumps({"prompt": t, "answer": "1"}).encode()),
    "non-text prompt": st.sampled_from([7, None, True, [], {"a": 1}]).map(
        lambda v: json.dumps({"prompt": v, "answer": "1"}).encode()),
    "not an object": st.sampled_from([b"[1, 2]", b"3", b'"text"', b"null"]),
    "not UTF-8": TEXT.map(lambda t: json.dumps({"prompt": t, "answer": "1"}).encode()[:-2] + b'\xff"}'),
    "NaN answer": st.just(b'{"prompt": "q", "answer": NaN}'),
    "lone surrogate": st.just(b'{"prompt": "q\\udc00", "answer": "1"}'),
}
VALID = st.tuples(TEXT, TEXT | st.integers(), st.booleans()).map(
    lambda v: json.dumps({"prompt": v[0], "answer": v[1]}, ensure_ascii=v[2]).encode())
BLANK = st.sampled_from([b"", b"   ", b"\t"])
LINES = st.lists(
    st.one_of(VALID.map(lambda b: ("valid", b)), BLANK.map(lambda b: ("blank", b)),
              *[s.map(lambda b, k=kind: (k, b)) for kind, s in MALFORMED.items()]),
    max_size=8,
)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("properties")


def write(directory, lines) -> str:
    path = directory / "data.jsonl"
    path.write_bytes(b"".join(line + b"\n" for _, line in lines))
    return str(path)


@FAST
@given(lines=LINES, skip=st.booleans())
def test_jsonl_lines_load_or_name_the_first_bad_line(data_dir, lines, skip):
    path = write(data_dir, lines)
    valid = [n for n, (kind, _) in enumerate(lines, start=1) if kind == "valid"]
    bad = [n for n, (kind, _) in enumerate(lines, start=1) if kind not in ("valid", "blank")]
    config = JsonlTask(path=path, on_bad_example="skip" if skip else "stop")
    if (bad and not skip) or not valid:
        with pytest.raises(TaskDataError) as info:
            load_task(config)
        expected = f"{path}:{bad[0]}: " if bad and not skip else f"task {path}: no examples"
        assert str(info.value).startswith(expected), (str(info.value), lines)
        return
    task = load_task(config)
    assert [e.source for e in task] == [f"{path}:{n}" for n in valid]
    assert [m.split(": ", 1)[0] for m in task.skipped] == [f"{path}:{n}" for n in bad]


@FAST
@given(st.lists(st.binary(max_size=30).filter(lambda b: b"\n" not in b), max_size=6))
def test_random_bytes_load_or_raise_task_data_error(data_dir, raw_lines):
    path = write(data_dir, [(None, line) for line in raw_lines])
    try:
        task = load_task(JsonlTask(path=path))
    except TaskDataError as err:
        assert str(err).startswith((f"{path}:", f"task {path}: no examples")), err
    else:
        assert 1 <= len(task) <= len(raw_lines)


# --------------------------------------------------------------------------- grading fuzz

LATEX = ["\\boxed{", "\\fbox{", "{", "}", "\\frac", "\\sqrt", "\\left(", "\\right)", "\\", "$", "<answer>", "</answer>",
         "1", "2", "42", "-", ".", "x", "=", "+", "\\pi", "\\infty", "\\text{", "%", ",", " ", "\n", "\x00", "e5", "\u00bd"]
# Exponents and factorials are left to the hand list: random towers of them make sympy run to the
# time limit too often for a fast test.
COMPLETIONS = st.one_of(st.text(max_size=60), st.lists(st.sampled_from(LATEX) | st.text(max_size=3), max_size=24).map("".join))
ADVERSARIAL = [
    r"\boxed{9^{9^{9^{9}}}}", r"\boxed{9**9**9**9}", r"\boxed{10^{10^{10}}}", r"\boxed{100000!}", r"\boxed{2^{-9999999}}",
    "\\boxed{" + "{" * 3000 + "}" * 3000 + "}", "\\boxed{" * 300 + "1" + "}" * 300, "\\boxed{" * 20_000, "}" * 20_000,
    "\\boxed{" + "\\frac{1}{" * 100 + "2" + "}" * 100 + "}", "<answer>" * 50_000, "</answer><answer>" * 20_000,
    "\\boxed{" + "9" * 100_000 + "}", "1" * 200_000, "\\boxed{1\x00}", "\x00" * 1000, "\\boxed{\ud800}",
    "\\boxed{\u00bd\u221a\U0001f600\u202e}", "\\boxed{\\left(\\right.}", "\\boxed{\\sqrt{\\sqrt{\\sqrt{-1}}}}",
    "\\boxed{" + "\\\\" * 5000 + "}", "$" * 10_000, "\\begin{matrix}" * 1000, "\\boxed{1/0}", "\\boxed{0^0}",
    "\\boxed{\\infty - \\infty}", "\\boxed{nan}", "<answer>\\boxed{</answer>}", "\\boxed{\\text{" + "}" * 50,
]
ENTRY = {"question": "2 + 3 =", "answer": "5", "metadata": {"source_dataset": "chain_sum"}}
GRADERS = {"math": (math_reward, "5"), "format": (format_reward, None), "reasoning_gym": (reasoning_gym_reward, ENTRY)}
LIMIT_S = 2.0
RESPAWN_S = 30.0  # a timed-out call's worker is replaced: seconds of imports on two busy cores


@pytest.fixture(scope="module")
def fuzz_tally(report_to_terminal):
    counts = {"strings": 0, "graded": 0, "in_range": 0, "raised": 0, "timed_out": 0}
    yield counts
    line = (f"grading fuzz: {counts['strings']} strings, {counts['graded']} gradings, {counts['in_range']} scores"
            f" in [0, 1], {counts['raised']} raised, {counts['timed_out']} stopped at the {LIMIT_S:g} s limit")
    report_to_terminal(line)


def check_extraction(text: str) -> None:
    boxed = last_boxed(text)
    assert boxed is None or (boxed in text and boxed.count("{") == boxed.count("}"))
    tag = last_answer_tag(text)
    assert tag is None or f"<answer>{tag}</answer>" in text
    final = extract_final_answer(text)
    assert final is None or final == final.strip()
    number = last_number(text)
    assert number is None or number in text


def grade(texts: list[str], tally: dict) -> None:
    """Grade `texts` with every reward: finite scores in [0, 1], no reward raising, and within the limit."""
    tally["strings"] += len(texts)
    for reward, reference in GRADERS.values():
        start = time.monotonic()
        scores = score_completions(reward, texts, [reference] * len(texts), timeout_s=LIMIT_S)
        seconds = time.monotonic() - start
        tally["graded"] += len(texts)
        tally["in_range"] += sum(math.isfinite(v) and 0 <= v <= 1 for v in scores.values)
        tally["raised"] += scores.failures
        tally["timed_out"] += scores.timeouts
        assert scores.failures == 0, (reward.__name__, scores.errors)
        assert all(math.isfinite(v) and 0 <= v <= 1 for v in scores.values), scores.values
        # a hang guard, not a speed check: every string could at worst run into the limit and a respawn
        assert seconds < 60 + len(texts) * (LIMIT_S + RESPAWN_S), (reward.__name__, seconds, scores)


@settings(max_examples=300, deadline=None, database=None)
@given(COMPLETIONS)
def test_answer_extraction_never_raises_and_stays_in_the_text(text):
    check_extraction(text)


def test_adversarial_strings_are_extracted_in_linear_time():
    # a hang bound, not a speed test: linear extraction takes ~1 s here, the quadratic one it replaced
    # took 70-80 s on 400k characters and would take ~20 min on these 4x longer strings
    longer = ["<answer>" * 200_000, "</answer><answer>" * 80_000, "\\boxed{" * 80_000]
    start = time.monotonic()
    for text in ADVERSARIAL + longer:
        check_extraction(text)
    assert time.monotonic() - start < 120


@settings(max_examples=60, deadline=None, database=None)
@given(st.lists(COMPLETIONS, min_size=1, max_size=4))
def test_random_completions_are_graded_in_range(fuzz_tally, texts):
    grade(texts, fuzz_tally)


def test_adversarial_completions_are_graded_in_range_within_the_limit(fuzz_tally):
    score_completions(math_reward, [r"\boxed{1}"], ["1"])  # workers started and warm
    grade(ADVERSARIAL, fuzz_tally)
