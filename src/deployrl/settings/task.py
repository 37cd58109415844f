"""The settings of a run's task section: one frozen dataclass per task source, picked by `type`.

These are the schema that `deployrl.settings.config` builds from YAML and overrides; `deployrl.tasks`
reads the examples they describe. Validation here needs no data: a bad key, an unknown
benchmark or reasoning-gym dataset, or an unknown reward fails when the config is built.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Optional, Union

from deployrl.registry import unknown_name_error
from deployrl.rewards.grading import get_reward

BAD_EXAMPLE_ACTIONS = ("stop", "skip")

DEFAULT_INSTRUCTIONS = {
    "math": "Please reason step by step, and put your final answer within \\boxed{}.",
    "format": "Please reason step by step, and put your final answer within \\boxed{}.",
    "reasoning_gym": (
        "Please reason step by step, then give only the final answer between <answer> and </answer>"
        " tags, e.g. <answer>42</answer>."
    ),
}

# the math benchmarks shipped in data/benchmarks (deployrl.tasks.benchmarks parses each one)
BENCHMARK_NAMES = ("math500", "aime24", "aime25", "amc23", "minerva_math", "olympiadbench", "gsm8k")


def reasoning_gym_names() -> list[str]:
    """The dataset names reasoning-gym provides."""
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def reasoning_gym_settings(name: str) -> list[str]:
    """The settings (``rg_config`` keys) of reasoning-gym dataset `name`, without size and seed."""
    from reasoning_gym.factory import DATASETS

    return [f.name for f in dataclasses.fields(DATASETS[name][1]) if f.name not in ("size", "seed")]


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
    name: str  # one of BENCHMARK_NAMES
    # an optional override of the shipped file: its JSONL file or a directory holding <name>/test.jsonl
    path: Optional[str] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.name not in BENCHMARK_NAMES:
            raise ValueError(f"name: {unknown_name_error('benchmark', self.name, list(BENCHMARK_NAMES))}")
        if self.path is not None:
            _check_not_blank(self, "path")


# A task section: the source named by its `type` (settings.parsing builds the class whose type it names).
TaskConfig = Union[JsonlTask, ParquetTask, HFTask, ReasoningGymTask, BenchmarkTask]


def _check_not_blank(config: TaskSource, *names: str) -> None:
    for name in names:
        if not getattr(config, name).strip():
            raise ValueError(f"{name} must not be empty")
