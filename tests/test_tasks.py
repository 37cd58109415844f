import dataclasses
import json

import pytest

from deployrl.rewards.grading import format_reward, math_reward, reasoning_gym_reward
from deployrl.rewards.sandbox import score_completions
from deployrl.settings.config import EvalSettings
from deployrl.settings.parsing import ConfigError, build
from deployrl.settings.task import (
    BENCHMARK_NAMES,
    DEFAULT_INSTRUCTIONS,
    BenchmarkTask,
    HFTask,
    JsonlTask,
    ParquetTask,
    ReasoningGymTask,
)
from deployrl.tasks import BENCHMARKS, Example, Task, TaskDataError, benchmark_file, load_task, make_prompt

MATH_INSTRUCTION = DEFAULT_INSTRUCTIONS["math"]


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


# --------------------------------------------------------------------------- files

def test_jsonl_with_field_mapping_and_prompts(tmp_path):
    path = write_jsonl(
        tmp_path / "data.jsonl",
        [
            {"question": "What is 1 + 1?", "solution": "2", "extra": 0},
            {"question": "Half of 1?", "solution": r"\frac{1}{2}"},
            {"question": "Numeric?", "solution": 3},
        ],
    )
    task = load_task(JsonlTask(path=str(path), prompt_field="question", answer_field="solution"))
    assert isinstance(task, Task) and len(task) == 3
    assert task.name == str(path) and task.reward is math_reward and task.reward_name == "math"
    assert task[0] == Example(f"What is 1 + 1?\n\n{MATH_INSTRUCTION}", "2", f"{path}:1")
    assert task.references == ["2", r"\frac{1}{2}", 3]
    assert task[1].source == f"{path}:2"

    custom = load_task(
        JsonlTask(
            path=str(path), prompt_field="question", answer_field="solution",
            instruction="Answer briefly.", system_prompt="You are careful.", max_examples=2, reward="format",
        )
    )
    assert len(custom) == 2 and custom.reward is format_reward
    assert custom[0].prompt == [
        {"role": "system", "content": "You are careful."},
        {"role": "user", "content": "What is 1 + 1?\n\nAnswer briefly."},
    ]
    bare = load_task(JsonlTask(path=str(path), prompt_field="question", answer_field="solution", instruction=""))
    assert bare.prompts[0] == "What is 1 + 1?"


def test_jsonl_chat_prompts(tmp_path):
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q?"}]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": messages, "answer": "1"}])
    task = load_task(JsonlTask(path=str(path), instruction="Box it.", system_prompt="ignored: has one"))
    assert task[0].prompt == [{"role": "system", "content": "S"}, {"role": "user", "content": "Q?\n\nBox it."}]


def test_make_prompt():
    assert make_prompt("  Q  ", None, None) == "Q"
    assert make_prompt([{"role": "user", "content": "Q"}], None, "S")[0] == {"role": "system", "content": "S"}


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"prompt": "a", "answer": "1"}', '{"prompt": "b", "answer": '], r":2: not valid JSON"),
        (['{"prompt": "a", "answer": "1"}', "", '{"prompt": "b"}'], r":3: field 'answer' is missing \(fields present: prompt\)"),
        (['{"answer": "1"}'], r":1: field 'prompt' is missing"),
        (['{"prompt": "a", "answer": "  "}'], r":1: field 'answer' is an empty string"),
        (['{"prompt": "a", "answer": null}'], r":1: field 'answer' is empty"),
        (['{"prompt": "", "answer": "1"}'], r":1: field 'prompt' must be a non-empty string"),
        (['{"prompt": [{"role": "user"}], "answer": "1"}'], r":1: field 'prompt' must be a non-empty string or a list"),
        (['["prompt", "answer"]'], r":1: expected a JSON object, got list"),
    ],
)
def test_bad_jsonl_names_file_line_and_field(tmp_path, lines, message):
    path = write_jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(ValueError, match=str(path).replace(".", r"\.") + message):
        load_task(JsonlTask(path=str(path)))


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(ValueError, match=r"nope\.jsonl: file not found"):
        load_task(JsonlTask(path=str(tmp_path / "nope.jsonl")))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(TaskDataError, match="no examples"):
        load_task(JsonlTask(path=str(tmp_path / "empty.jsonl")))


def test_parquet_with_field_mapping_and_errors(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"q": ["What is 2 + 3?", "And 2 * 3?"], "a": ["5", "6"], "other": [1, 2]}), path)
    task = load_task(ParquetTask(path=str(path), prompt_field="q", answer_field="a"))
    assert task.references == ["5", "6"] and task[1].source == f"{path}:row 2"
    assert task[0].prompt.startswith("What is 2 + 3?\n\n")

    with pytest.raises(ValueError, match=r"field 'answer' is missing \(columns: q, a, other\)"):
        load_task(ParquetTask(path=str(path), prompt_field="q"))
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"prompt": ["x", "y"], "answer": ["1", None]}), bad)
    with pytest.raises(ValueError, match=r"bad\.parquet:row 2: field 'answer' is empty"):
        load_task(ParquetTask(path=str(bad)))
    junk = tmp_path / "junk.parquet"
    junk.write_text("not parquet")
    with pytest.raises(ValueError, match=r"junk\.parquet: cannot read as Parquet"):
        load_task(ParquetTask(path=str(junk)))


def test_hf_local_dataset(tmp_path):
    datasets = pytest.importorskip("datasets")
    data = datasets.Dataset.from_dict({"problem": ["1 + 1?", "2 + 2?"], "solution": ["2", "4"]})
    datasets.DatasetDict({"test": data}).save_to_disk(str(tmp_path / "dd"))
    task = load_task(HFTask(name=str(tmp_path / "dd"), split="test", prompt_field="problem", answer_field="solution"))
    assert task.references == ["2", "4"] and task[1].source == f"hf:{tmp_path / 'dd'}[test]#1"
    with pytest.raises(ValueError, match="no split 'train'"):
        load_task(HFTask(name=str(tmp_path / "dd"), prompt_field="problem", answer_field="solution"))
    with pytest.raises(ValueError, match="field 'prompt' is missing"):
        load_task(HFTask(name=str(tmp_path / "dd"), split="test", answer_field="solution"))


# --------------------------------------------------------------------------- config validation

@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"type": "jsnol"}, r"task\.type: unknown task type 'jsnol'\. Did you mean 'jsonl'\? Valid names: benchmark, hf, jsonl"),
        ({"name": "basic_arithmetc"}, r"task: name: .*Did you mean 'basic_arithmetic'"),
        ({"type": "benchmark", "name": "math50"}, r"task: name: unknown benchmark 'math50'\. Did you mean 'math500'\? Valid names: aime24"),
        ({"reward": "maths"}, r"task: reward: unknown reward 'maths'\. Did you mean 'math'"),
        ({"reward": "no_such_mod:f"}, r"task: reward: .*cannot import module 'no_such_mod'"),
        ({"type": "jsonl"}, r"task\.path is required"),
        ({"type": "jsonl", "path": "x.parquet"}, r"task: path must be a \.jsonl file"),
        ({"size": 0}, r"task: size must be >= 1"),
        ({"seed": "1"}, r"task\.seed must be an integer"),
        ({"max_examples": 0}, r"task: max_examples must be a positive integer"),
        ({"rg_config": {"seed": 3}}, r"task: rg_config: set 'seed' with the task's own seed"),
        ({"rg_config": {"max_term": 3}}, r"task: rg_config: 'basic_arithmetic' has no setting 'max_term'; valid: min_terms, max_terms"),
        ({"rg_config": [1]}, r"task\.rg_config must be a mapping"),
        ({"type": "jsonl", "path": "x.jsonl", "prompt_field": ""}, r"task: prompt_field must not be empty"),
        # a key of another source: the valid keys of this one are listed
        ({"type": "jsonl", "path": "x.jsonl", "split": "test"},
         r"unknown key 'task\.split'\. Valid keys of a jsonl task: type, .*prompt_field, answer_field, path$"),
        ({"type": "hf", "name": "d", "splt": "test"}, r"unknown key 'task\.splt'; did you mean 'task\.split'\?"),
        ({"type": "benchmark", "name": "gsm8k", "size": 5}, r"unknown key 'task\.size'\. Valid keys of a benchmark task"),
    ],
)
def test_config_errors(kwargs, message):
    """A task section, as YAML or overrides give it: `type` picks the source (default reasoning_gym)."""
    with pytest.raises(ConfigError, match=message):
        build(EvalSettings, {"task": {"type": "reasoning_gym", **kwargs}})


def test_config_defaults():
    config = ReasoningGymTask()
    assert (config.type, config.name, config.reward_name) == ("reasoning_gym", "basic_arithmetic", "reasoning_gym")
    assert "<answer>" in config.resolved_instruction
    assert BenchmarkTask(name="gsm8k").reward_name == "math"
    assert BenchmarkTask(name="gsm8k", instruction="").resolved_instruction is None
    assert dataclasses.replace(config, seed=1).seed == 1  # the trainer derives eval tasks this way
    assert dataclasses.replace(JsonlTask(path="x.jsonl"), seed=1).seed == 1  # for every source


# --------------------------------------------------------------------------- reasoning-gym

def test_reasoning_gym_task_is_deterministic_and_scored_by_its_dataset():
    config = ReasoningGymTask(name="basic_arithmetic", size=12, seed=7)
    task = load_task(config)
    assert len(task) == 12 and task.reward is reasoning_gym_reward
    assert task[3].source == "reasoning_gym:basic_arithmetic#3"
    assert task[0].prompt.startswith(task[0].reference["question"])
    assert task.examples == load_task(config).examples  # same seed, same examples
    assert task.prompts != load_task(dataclasses.replace(config, seed=8)).prompts

    # in the reward worker processes, as the trainer scores
    refs = task.references[:4]
    completions = [f"<answer>{r['answer']}</answer>" for r in refs[:2]] + ["<answer>no</answer>", ""]
    assert score_completions(task.reward, completions, refs).values == [1.0, 1.0, 0.0, 0.0]
    for example in task:
        answer = example.reference["answer"]
        assert task.reward(f"Let me compute. <answer>{answer}</answer>", example.reference) == 1.0
        assert task.reward(f"<answer>{answer}1</answer>", example.reference) < 1.0
        assert task.reward("I am not sure.", example.reference) == 0.0


def test_reasoning_gym_settings_reach_generator_and_scorer():
    task = load_task(
        ReasoningGymTask(name="chain_sum", size=5, seed=1, rg_config={"min_terms": 2, "max_terms": 2, "max_digits": 1},
                   max_examples=3)
    )
    assert len(task) == 3
    for example in task:
        assert example.reference["metadata"]["num_terms"] == 2
        assert example.reference["dataset_config"] == {"min_terms": 2, "max_terms": 2, "max_digits": 1}
        assert task.reward(f"<answer>{example.reference['answer']}</answer>", example.reference) == 1.0
    with pytest.raises(ValueError, match=r"task\.rg_config: reasoning-gym rejected the settings for 'chain_sum'"):
        load_task(ReasoningGymTask(name="chain_sum", rg_config={"min_terms": 5, "max_terms": 2}))


# --------------------------------------------------------------------------- benchmarks

def test_benchmarks_load_with_their_references(tmp_path, monkeypatch):
    assert tuple(BENCHMARKS) == BENCHMARK_NAMES  # every name task.name accepts has its parsers
    for name, spec in BENCHMARKS.items():
        task = load_task(BenchmarkTask(name=name, max_examples=3))
        assert len(task) == 3 and task[0].source == f"benchmark:{name}#0"
        assert all(isinstance(r, str) and r.strip() for r in task.references)
        assert task.prompts[0].endswith(MATH_INSTRUCTION)
    assert len(load_task(BenchmarkTask(name="aime24"))) == BENCHMARKS["aime24"].size == 30

    gsm8k = load_task(BenchmarkTask(name="gsm8k", max_examples=3))
    assert gsm8k.references == ["18", "3", "70000"]
    amc = load_task(BenchmarkTask(name="amc23", max_examples=1))
    assert amc.references == ["27"]
    minerva = load_task(BenchmarkTask(name="minerva_math", max_examples=1))
    assert minerva.references == ["1.6"]

    # override: a directory holding <name>/test.jsonl, or the file itself
    (tmp_path / "aime25").mkdir()
    write_jsonl(tmp_path / "aime25" / "test.jsonl", [{"problem": "P?", "answer": "7"}])
    assert load_task(BenchmarkTask(name="aime25", path=str(tmp_path))).references == ["7"]
    path = write_jsonl(tmp_path / "mine.jsonl", [{"problem": "P?", "answer": "8"}, {"problem": "Q?"}])
    with pytest.raises(ValueError, match=r"mine\.jsonl:2: no reference answer in field 'answer'"):
        load_task(BenchmarkTask(name="aime25", path=str(path)))
    monkeypatch.setenv("DEPLOYRL_BENCHMARK_DIR", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="benchmark file not found"):
        benchmark_file("math500")


def test_olympiadbench_reference_mapping(tmp_path):
    records = [
        {"question": "Q1", "context": None, "final_answer": ["$69$,$84$"], "unit": None, "answer_type": "Numerical"},
        {"question": "Q2", "context": "Ctx", "final_answer": ["$t(0,4]$"], "unit": None, "answer_type": "Interval"},
        {"question": "Q3", "context": None, "final_answer": ["4.2"], "unit": "%", "answer_type": "Numerical"},
        {"question": "Q4", "context": None, "final_answer": ["$\\frac{41}{12}$"], "unit": "km", "answer_type": "Numerical"},
    ]
    path = write_jsonl(tmp_path / "ob.jsonl", records)
    task = load_task(BenchmarkTask(name="olympiadbench", path=str(path), instruction=""))
    assert task.references == ["69, 84", "(0,4]", "4.2\\%", "\\frac{41}{12}"]
    assert task[1].prompt == "Ctx\n\nQ2"
    assert math_reward(r"\boxed{84, 69}", task[0].reference) == 1.0
    assert math_reward(r"\boxed{4.2}", task[2].reference) == 1.0
    assert math_reward(r"\boxed{\frac{41}{12} \text{ km}}", task[3].reference) == 1.0
