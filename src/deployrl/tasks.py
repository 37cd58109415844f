"""Tasks: the prompts to train or evaluate on, each with the reference its reward compares with.

A task comes from a JSONL or Parquet file, a Hugging Face dataset, a reasoning-gym procedural
generator, or one of the math benchmarks shipped in ``data/benchmarks``. ``load_task`` reads
and validates every example before it returns (the trainer calls it before loading a model):
a bad file fails at once with the file, the line and the field. With
``on_bad_example: skip`` a malformed example (bad JSON, bytes that are not UTF-8, a missing,
empty or non-text field) is left out instead, counted in ``Task.skipped`` and logged; a file
that is missing or unreadable, or holds no valid example, still stops.

Prompts: the user text is the question, then ``"\\n\\n"`` and the instruction (by default the
reward's: ``\\boxed{}`` for math, ``<answer>`` tags for reasoning-gym); with a system prompt the
prompt is a chat list ``[{"role": "system", ...}, {"role": "user", ...}]``.
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import logging
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator, Optional, Union

from deployrl.prompts import Prompt
from deployrl.registry import unknown_name_error
from deployrl.rewards import RewardFn, get_reward, last_boxed

logger = logging.getLogger(__name__)

BAD_EXAMPLE_ACTIONS = ("stop", "skip")

DEFAULT_INSTRUCTIONS = {
    "math": "Please reason step by step, and put your final answer within \\boxed{}.",
    "format": "Please reason step by step, and put your final answer within \\boxed{}.",
    "reasoning_gym": (
        "Please reason step by step, then give only the final answer between <answer> and </answer>"
        " tags, e.g. <answer>42</answer>."
    ),
}

BENCHMARK_DIR_ENV = "DEPLOYRL_BENCHMARK_DIR"


class TaskDataError(ValueError):
    """A task's data is missing or malformed (the message names the file, line and field)."""


@dataclass(frozen=True)
class Example:
    prompt: Prompt  # user text, or chat messages [{"role", "content"}, ...]
    reference: Any  # what the reward compares with (an answer string, a reasoning-gym entry, ...)
    source: str  # where it came from: "data.jsonl:12", "reasoning_gym:basic_arithmetic#5", "benchmark:math500#17"


@dataclass(frozen=True, kw_only=True)
class TaskSource:
    """What every task source shares: how its prompts are written and scored, which examples
    are kept. A task section picks its source with `type`; each source adds its own keys."""

    type: str = field(default="", init=False)  # fixed by each source class
    # a system message put before every prompt (None: none)
    system_prompt: Optional[str] = None
    # appended to each question after a blank line; None: the reward's default
    # (DEFAULT_INSTRUCTIONS), "": no instruction
    instruction: Optional[str] = None
    # a built-in reward (math, reasoning_gym, format), "package.module:function", or auto:
    # the source's default_reward
    reward: str = "auto"
    # keep only the first N examples (None: all)
    max_examples: Optional[int] = None
    # a malformed example (bad JSON line, missing, empty or non-text field): stop, with its file,
    # line and field; or skip it (counted in Task.skipped, logged) and load the rest
    on_bad_example: str = "stop"
    # reasoning_gym: the generator's seed (same seed, same examples). Every source has it because
    # the trainer's held-out evaluation set is the training task with seed + 1; the others ignore it.
    seed: int = 0

    default_reward: ClassVar[str] = "math"

    def __post_init__(self) -> None:
        if self.on_bad_example not in BAD_EXAMPLE_ACTIONS:
            raise ValueError(
                f"on_bad_example: {unknown_name_error('action', self.on_bad_example, list(BAD_EXAMPLE_ACTIONS))}"
            )
        if self.max_examples is not None and self.max_examples < 1:
            raise ValueError(f"max_examples must be a positive integer or None, got {self.max_examples}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.reward != "auto":
            try:
                get_reward(self.reward)
            except ValueError as err:
                raise ValueError(f"reward: {err}") from None

    @property
    def reward_name(self) -> str:
        """The reward this task uses, with ``auto`` resolved."""
        return self.default_reward if self.reward == "auto" else self.reward

    @property
    def resolved_instruction(self) -> Optional[str]:
        """The instruction appended to each question (None: none)."""
        if self.instruction is not None:
            return self.instruction or None
        return DEFAULT_INSTRUCTIONS.get(self.reward_name)


@dataclass(frozen=True, kw_only=True)
class RecordSource(TaskSource):
    """Records with a question field and a reference field."""

    # the field holding the question (a string, or a chat message list)
    prompt_field: str = "prompt"
    # the field holding the reference answer
    answer_field: str = "answer"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_not_blank(self, "prompt_field", "answer_field")


@dataclass(frozen=True, kw_only=True)
class FileSource(RecordSource):
    """Records in one file whose suffix is the source's type."""

    path: str  # the .jsonl / .parquet file

    def __post_init__(self) -> None:
        super().__post_init__()
        if Path(self.path).suffix != f".{self.type}":
            raise ValueError(f"path must be a .{self.type} file for a {self.type} task, got {self.path!r}")


@dataclass(frozen=True, kw_only=True)
class JsonlTask(FileSource):
    """A JSON Lines file, one record per line."""

    type: str = field(default="jsonl", init=False)


@dataclass(frozen=True, kw_only=True)
class ParquetTask(FileSource):
    """A Parquet file, one record per row."""

    type: str = field(default="parquet", init=False)


@dataclass(frozen=True, kw_only=True)
class HFTask(RecordSource):
    """A Hugging Face dataset, from the hub or a local directory."""

    type: str = field(default="hf", init=False)
    name: str  # a hub dataset id or a local directory written by `save_to_disk`
    split: str = "train"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_not_blank(self, "name", "split")


@dataclass(frozen=True, kw_only=True)
class ReasoningGymTask(TaskSource):
    """Problems generated by a reasoning-gym dataset, scored by the dataset itself."""

    type: str = field(default="reasoning_gym", init=False)
    name: str = "basic_arithmetic"  # the reasoning-gym dataset
    size: int = 1000  # the number of generated examples
    rg_config: dict = field(default_factory=dict)  # the dataset's own settings, e.g. {"min_terms": 2, "max_terms": 4}

    default_reward: ClassVar[str] = "reasoning_gym"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.name not in reasoning_gym_names():
            raise ValueError(f"name: {unknown_name_error('reasoning-gym dataset', self.name, reasoning_gym_names())}")
        if self.size < 1:
            raise ValueError(f"size must be >= 1, got {self.size}")
        for key in ("size", "seed"):
            if key in self.rg_config:
                raise ValueError(f"rg_config: set {key!r} with the task's own {key}, not in rg_config")
        valid = reasoning_gym_settings(self.name)
        unknown = sorted(set(self.rg_config) - set(valid))
        if unknown:
            raise ValueError(
                f"rg_config: {self.name!r} has no setting {', '.join(map(repr, unknown))}; valid: {', '.join(valid)}"
            )


@dataclass(frozen=True, kw_only=True)
class BenchmarkTask(TaskSource):
    """One of the math benchmarks shipped in data/benchmarks."""

    type: str = field(default="benchmark", init=False)
    name: str  # one of BENCHMARKS
    # an optional override of the shipped file: its JSONL file or a directory holding <name>/test.jsonl
    path: Optional[str] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.name not in BENCHMARKS:
            raise ValueError(f"name: {unknown_name_error('benchmark', self.name, list(BENCHMARKS))}")
        if self.path is not None:
            _check_not_blank(self, "path")


# A task section: the source named by its `type` (configio builds the class whose type it names).
TaskConfig = Union[JsonlTask, ParquetTask, HFTask, ReasoningGymTask, BenchmarkTask]


def _check_not_blank(config: TaskSource, *names: str) -> None:
    for name in names:
        if not getattr(config, name).strip():
            raise ValueError(f"{name} must not be empty")


@dataclass
class Task:
    name: str  # e.g. "reasoning_gym:basic_arithmetic", "benchmark:math500", "data.jsonl"
    examples: list[Example]
    reward: RewardFn  # (completion_text, reference) -> float
    reward_name: str = "math"  # the name or import path `reward` came from
    config: Optional[TaskConfig] = None
    skipped: list[str] = field(default_factory=list)  # why each malformed example was left out (on_bad_example: skip)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> Example:
        return self.examples[index]

    def __iter__(self) -> Iterator[Example]:
        return iter(self.examples)

    @property
    def prompts(self) -> list[Prompt]:
        return [example.prompt for example in self.examples]

    @property
    def references(self) -> list[Any]:
        return [example.reference for example in self.examples]


# --------------------------------------------------------------------------- prompts

def make_prompt(question: Prompt, instruction: Optional[str] = None, system_prompt: Optional[str] = None) -> Prompt:
    """The prompt of one example: question + "\\n\\n" + instruction; a chat list with a system prompt.

    A chat-list question gets the instruction appended to its last user message.

    >>> make_prompt("What is 2 + 2?", "Answer with a number.")
    'What is 2 + 2?\\n\\nAnswer with a number.'
    >>> make_prompt("Hi", None, "Be brief.")
    [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Hi'}]
    """
    if isinstance(question, str):
        text = question.strip()
        if instruction:
            text = f"{text}\n\n{instruction}"
        if system_prompt:
            return [{"role": "system", "content": system_prompt}, {"role": "user", "content": text}]
        return text
    messages = [dict(m) for m in question]
    if instruction:
        for message in reversed(messages):
            if message["role"] == "user":
                message["content"] = f"{message['content'].rstrip()}\n\n{instruction}"
                break
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def _check_encodable(text: str, where: str, field_name: str) -> None:
    """Refuse text that UTF-8 cannot encode: a lone surrogate (the JSON escape "\\ud800"), which
    no tokenizer accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise TaskDataError(
            f"{where}: field {field_name!r} holds a lone UTF-16 surrogate ({text[err.start]!r} at character"
            f" {err.start}), which is not text a tokenizer accepts; fix the escape in the file"
        ) from None


def _is_messages(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
        )
        and any(m["role"] == "user" for m in value)
    )


def _check_prompt(value: Any, where: str, field_name: str) -> Prompt:
    if isinstance(value, str) and value.strip():
        _check_encodable(value, where, field_name)
        return value
    if _is_messages(value):
        for message in value:
            _check_encodable(message["content"], where, field_name)
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise TaskDataError(
        f"{where}: field {field_name!r} must be a non-empty string or a list of chat messages"
        f" ({{role, content}} with a user message), got {_short(value)}"
    )


def _check_answer(value: Any, where: str, field_name: str) -> Any:
    if value is None or isinstance(value, bool):
        raise TaskDataError(f"{where}: field {field_name!r} is empty (null)")
    if isinstance(value, str):
        if not value.strip():
            raise TaskDataError(f"{where}: field {field_name!r} is an empty string")
        return value
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            raise TaskDataError(f"{where}: field {field_name!r} is {value} (not a finite number)")
        return value
    if isinstance(value, (list, tuple)):
        if not value:
            raise TaskDataError(f"{where}: field {field_name!r} is an empty list")
        return [_check_answer(v, where, field_name) for v in value]
    if isinstance(value, dict) and value:
        return value
    raise TaskDataError(f"{where}: field {field_name!r} must be a string, a number or a list, got {_short(value)}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _record_example(record: Any, where: str, config: RecordSource, instruction: Optional[str]) -> Example:
    if not isinstance(record, dict):
        raise TaskDataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    for name in (config.prompt_field, config.answer_field):
        if name not in record:
            present = ", ".join(sorted(map(str, record))) or "none"
            raise TaskDataError(f"{where}: field {name!r} is missing (fields present: {present})")
    prompt = _check_prompt(record[config.prompt_field], where, config.prompt_field)
    answer = _check_answer(record[config.answer_field], where, config.answer_field)
    return Example(prompt=make_prompt(prompt, instruction, config.system_prompt), reference=answer, source=where)


# --------------------------------------------------------------------------- files

@dataclass
class BadExamples:
    """What to do with an example that fails validation: ``stop`` raises its TaskDataError,
    ``skip`` keeps the message (``messages``) and lets the loader go on."""

    action: str = "stop"
    messages: list[str] = field(default_factory=list)

    def handle(self, err: TaskDataError) -> None:
        if self.action == "stop":
            raise err
        self.messages.append(str(err))


def _json_line(raw: bytes, where: str) -> Optional[dict]:
    """The JSON object on one line of a JSONL file (None for a blank line); errors name `where`."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise TaskDataError(
            f"{where}: not UTF-8 text (byte {raw[err.start]:#04x} at column {err.start + 1}); save the file as UTF-8"
        ) from None
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise TaskDataError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
    except (ValueError, RecursionError) as err:  # an integer too long to convert, arrays nested too deep
        raise TaskDataError(f"{where}: JSON that cannot be read ({type(err).__name__}: {err})") from None
    if not isinstance(record, dict):
        raise TaskDataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    return record


def json_lines(path: Path, bad: Optional[BadExamples] = None) -> Iterator[tuple[str, dict]]:
    """("file:line", object) for each non-empty line of a JSONL file; errors name file and line.

    A malformed line goes to `bad` (default: stop at it); a missing file always stops."""
    bad = bad or BadExamples()
    if path.is_dir():
        raise TaskDataError(f"{path}: a directory, not a JSONL file")
    if not path.is_file():
        raise TaskDataError(f"{path}: file not found")
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            where = f"{path}:{number}"
            if number == 1:
                raw = raw.removeprefix(codecs.BOM_UTF8)  # editors on Windows start UTF-8 files with one
            try:
                record = _json_line(raw, where)
            except TaskDataError as err:
                bad.handle(err)
                continue
            if record is not None:
                yield where, record


def _load_jsonl(config: JsonlTask, instruction: Optional[str], bad: BadExamples) -> list[Example]:
    return _valid_examples(json_lines(Path(config.path), bad), config, instruction, bad)


def _valid_examples(
    records: Iterator[tuple[str, dict]], config: RecordSource, instruction: Optional[str], bad: BadExamples
) -> list[Example]:
    """The examples of (where, record) pairs, the first `config.max_examples`; a malformed record goes to `bad`."""
    examples = []
    for where, record in records:
        try:
            examples.append(_record_example(record, where, config, instruction))
        except TaskDataError as err:
            bad.handle(err)
        if config.max_examples is not None and len(examples) >= config.max_examples:
            break
    return examples


def load_prompt_file(path: Path) -> list[Prompt]:
    """Prompts without references (for sampling only): ``.jsonl`` with a ``prompt`` string or a
    ``messages`` chat list per line, or ``.txt`` with one prompt per non-empty line."""
    path = Path(path)
    if path.suffix == ".txt":
        if not path.is_file():
            raise TaskDataError(f"{path}: file not found")
        prompts: list[Prompt] = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    elif path.suffix == ".jsonl":
        prompts = []
        for where, record in json_lines(path):
            key = "prompt" if "prompt" in record else "messages"
            if key not in record:
                raise TaskDataError(f"{where}: field 'prompt' (a string) or 'messages' (a chat list) is required")
            prompts.append(_check_prompt(record[key], where, key))
    else:
        raise TaskDataError(f"{path}: prompt files are .jsonl or .txt, got {path.suffix or 'no suffix'}")
    if not prompts:
        raise TaskDataError(f"{path}: no prompts")
    return prompts


def _load_parquet(config: ParquetTask, instruction: Optional[str], bad: BadExamples) -> list[Example]:
    import pyarrow.parquet as pq

    path = Path(config.path)
    if not path.is_file():
        raise TaskDataError(f"{path}: file not found (task.path)")
    try:
        table = pq.read_table(path)
    except Exception as err:  # pyarrow raises its own error types
        raise TaskDataError(f"{path}: cannot read as Parquet ({type(err).__name__}: {err})") from None
    for name in (config.prompt_field, config.answer_field):
        if name not in table.column_names:
            raise TaskDataError(
                f"{path}: field {name!r} is missing (columns: {', '.join(table.column_names) or 'none'})"
            )
    if config.max_examples is not None:
        table = table.slice(0, config.max_examples)
    records = table.select([config.prompt_field, config.answer_field]).to_pylist()
    return _valid_examples(
        ((f"{path}:row {number}", record) for number, record in enumerate(records, start=1)), config, instruction, bad
    )


def _load_hf(config: HFTask, instruction: Optional[str], bad: BadExamples) -> list[Example]:
    try:
        import datasets
    except ImportError as err:  # pragma: no cover - datasets is a dependency
        raise TaskDataError("hf tasks need the 'datasets' package (pip install datasets)") from err
    local = Path(config.name)
    try:
        if local.is_dir() and (
            (local / "dataset_info.json").is_file()
            or (local / "state.json").is_file()
            or (local / "dataset_dict.json").is_file()
        ):
            data = datasets.load_from_disk(str(local))
            if isinstance(data, datasets.DatasetDict):
                if config.split not in data:
                    raise TaskDataError(
                        f"{local}: no split {config.split!r} (task.split); splits: {', '.join(data)}"
                    )
                data = data[config.split]
        else:
            data = datasets.load_dataset(config.name, split=config.split)
    except TaskDataError:
        raise
    except Exception as err:
        raise TaskDataError(
            f"hf dataset {config.name!r} (split {config.split!r}): cannot load ({type(err).__name__}: {err})"
        ) from None
    for name in (config.prompt_field, config.answer_field):
        if name not in data.column_names:
            raise TaskDataError(
                f"hf dataset {config.name!r}: field {name!r} is missing (columns: {', '.join(data.column_names)})"
            )
    if config.max_examples is not None:
        data = data.select(range(min(config.max_examples, len(data))))
    data = data.select_columns([config.prompt_field, config.answer_field])
    return _valid_examples(
        ((f"hf:{config.name}[{config.split}]#{index}", record) for index, record in enumerate(data)),
        config, instruction, bad,
    )


# --------------------------------------------------------------------------- reasoning-gym

def reasoning_gym_names() -> list[str]:
    """The dataset names reasoning-gym provides."""
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def reasoning_gym_settings(name: str) -> list[str]:
    """The settings (``rg_config`` keys) of reasoning-gym dataset `name`, without size and seed."""
    from reasoning_gym.factory import DATASETS

    return [f.name for f in dataclasses.fields(DATASETS[name][1]) if f.name not in ("size", "seed")]


def _load_reasoning_gym(config: ReasoningGymTask, instruction: Optional[str], bad: BadExamples) -> list[Example]:
    import reasoning_gym

    try:
        dataset = reasoning_gym.create_dataset(config.name, size=config.size, seed=config.seed, **config.rg_config)
    except Exception as err:  # the dataset's own validation (assertions, type errors)
        raise ValueError(
            f"task.rg_config: reasoning-gym rejected the settings for {config.name!r}"
            f" ({type(err).__name__}: {err or 'invalid value'})"
        ) from None
    count = config.size if config.max_examples is None else min(config.size, config.max_examples)
    examples = []
    for index in range(count):
        entry = dict(dataset[index])
        where = f"reasoning_gym:{config.name}#{index}"
        question = entry.get("question")
        if not isinstance(question, str) or not question.strip():
            bad.handle(TaskDataError(f"{where}: reasoning-gym produced an entry without a question"))
            continue
        if config.rg_config:
            entry["dataset_config"] = dict(config.rg_config)
        examples.append(Example(make_prompt(question, instruction, config.system_prompt), entry, where))
    return examples


# --------------------------------------------------------------------------- benchmarks

def _benchmark_answer(record: dict) -> Any:
    return record.get("answer")


def _gsm8k_answer(record: dict) -> Any:
    solution = record.get("answer")
    if not isinstance(solution, str) or "####" not in solution:
        return None
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


def _minerva_answer(record: dict) -> Any:
    answer = last_boxed(record["solution"]) if isinstance(record.get("solution"), str) else None
    if answer is None:
        return None
    answer = re.sub(r"\bnp\.([a-z]+)", r"\\\1", answer)  # np.arcsin(10/13) -> \arcsin(10/13)
    answer = re.sub(r"(\d)\./", r"\1/", answer)  # Python's -1./3 -> -1/3
    return answer.strip()


def _olympiad_answer(record: dict) -> Any:
    finals = record.get("final_answer")
    if not isinstance(finals, list) or not finals:
        return None
    parts = []
    for final in finals:
        # "$69$,$84$" (several answers) -> "69, 84"; strip math delimiters and a final period
        for piece in re.split(r"\$\s*,\s*\$", str(final)):
            piece = piece.strip().strip("$").strip().rstrip(".").strip()
            if piece:
                parts.append(piece)
    answer = ", ".join(parts)
    if record.get("answer_type") == "Interval":
        answer = re.sub(r"^[a-zA-Z]\s*(?=[(\[])", "", answer)  # "t(0,4]" -> "(0,4]"
    answer = re.sub(r"_\{\\(max|min)\s*\}", r"_{\1}", answer)  # m_{\max } -> m_{max}
    if (record.get("unit") or "").strip() in ("%", "\\%"):
        answer += "\\%"  # the math reward accepts both 4.2\% and 4.2
    return answer or None


def _olympiad_question(record: dict) -> Any:
    question, context = record.get("question"), record.get("context")
    if isinstance(context, str) and context.strip() and isinstance(question, str):
        return f"{context.strip()}\n\n{question}"
    return question


@dataclass(frozen=True)
class Benchmark:
    question: Callable[[dict], Any]  # the question text of a record
    answer: Callable[[dict], Any]  # the reference answer of a record (None if absent)
    answer_field: str  # the field the answer comes from (for error messages)
    size: int  # the number of problems


def _field(name: str) -> Callable[[dict], Any]:
    return lambda record: record.get(name)


BENCHMARKS: dict[str, Benchmark] = {
    "math500": Benchmark(_field("problem"), _benchmark_answer, "answer", 500),
    "aime24": Benchmark(_field("problem"), _benchmark_answer, "answer", 30),
    "aime25": Benchmark(_field("problem"), _benchmark_answer, "answer", 30),
    "amc23": Benchmark(_field("question"), _benchmark_answer, "answer", 40),
    "minerva_math": Benchmark(_field("problem"), _minerva_answer, "solution", 272),
    "olympiadbench": Benchmark(_olympiad_question, _olympiad_answer, "final_answer", 675),
    "gsm8k": Benchmark(_field("question"), _gsm8k_answer, "answer", 1319),
}


def benchmark_dir() -> Path:
    """Where the benchmark files live: ``$DEPLOYRL_BENCHMARK_DIR``, else the repository's
    ``data/benchmarks`` (the repository root holds ``src/deployrl``)."""
    env = os.environ.get(BENCHMARK_DIR_ENV)
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "data" / "benchmarks"


def benchmark_file(name: str, override: Optional[str] = None) -> Path:
    """The JSONL file of benchmark `name`; `override` is that file or a directory holding
    ``<name>/test.jsonl``."""
    if name not in BENCHMARKS:
        raise unknown_name_error("benchmark", name, list(BENCHMARKS))
    if override is not None:
        base = Path(override)
        path = base if base.is_file() else base / name / "test.jsonl"
    else:
        path = benchmark_dir() / name / "test.jsonl"
    if not path.is_file():
        raise TaskDataError(
            f"{path}: benchmark file not found; the files ship in the repository's data/benchmarks:"
            f" point task.path (or ${BENCHMARK_DIR_ENV}) at that directory"
        )
    return path


def _load_benchmark(config: BenchmarkTask, instruction: Optional[str], bad: BadExamples) -> list[Example]:
    spec = BENCHMARKS[config.name]
    path = benchmark_file(config.name, config.path)
    examples = []
    for where, record in json_lines(path, bad):
        question = spec.question(record)
        if not isinstance(question, str) or not question.strip():
            bad.handle(TaskDataError(f"{where}: no question (field 'problem'/'question' missing or empty)"))
            continue
        answer = spec.answer(record)
        if answer is None or (isinstance(answer, str) and not answer.strip()):
            bad.handle(TaskDataError(f"{where}: no reference answer in field {spec.answer_field!r}"))
            continue
        if isinstance(answer, float) and answer.is_integer():
            answer = int(answer)
        answer = str(answer)
        source = f"benchmark:{config.name}#{len(examples)}"
        examples.append(Example(make_prompt(question, instruction, config.system_prompt), answer, source))
        if config.max_examples is not None and len(examples) >= config.max_examples:
            break
    return examples


# --------------------------------------------------------------------------- entry point

_LOADERS = {
    "jsonl": _load_jsonl,
    "parquet": _load_parquet,
    "hf": _load_hf,
    "reasoning_gym": _load_reasoning_gym,
    "benchmark": _load_benchmark,
}


def load_task(config: TaskConfig) -> Task:
    """Load and validate every example of the task; errors name the file, line and field."""
    if not isinstance(config, TaskSource):
        raise TypeError(f"load_task expects a task config (JsonlTask, ReasoningGymTask, ...), got {type(config).__name__}")
    reward = get_reward(config.reward_name)
    bad = BadExamples(config.on_bad_example)
    examples = _LOADERS[config.type](config, config.resolved_instruction, bad)
    name = _task_name(config)
    if not examples:
        raise TaskDataError(f"task {name}: no examples" + (f" ({_skipped_summary(bad)})" if bad.messages else ""))
    if bad.messages:
        logger.warning("task %s: %d examples loaded, %s", name, len(examples), _skipped_summary(bad))
    return Task(
        name=name, examples=examples, reward=reward, reward_name=config.reward_name, config=config, skipped=bad.messages
    )


def _skipped_summary(bad: BadExamples) -> str:
    return f"{len(bad.messages)} malformed example(s) skipped (task.on_bad_example=skip); first: {bad.messages[0]}"


def _task_name(config: TaskConfig) -> str:
    if isinstance(config, FileSource):
        return config.path
    return f"{config.type}:{config.name}"
