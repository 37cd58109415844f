"""Tasks: the prompts to train or evaluate on, each with the reference its reward compares with.

A task comes from a JSONL or Parquet file, a Hugging Face dataset (`records`), a reasoning-gym
procedural generator (`reasoning_gym`), or one of the math benchmarks shipped in
``data/benchmarks`` (`benchmarks`); its settings are the classes of `deployrl.settings.task`.
``load_task`` reads and validates every example before it returns (the trainer calls it before
loading a model): a bad file fails at once with the file, the line and the field. With
``on_bad_example: skip`` a malformed example (bad JSON, bytes that are not UTF-8, a missing,
empty or non-text field) is left out instead, counted in ``Task.skipped`` and logged; a file
that is missing or unreadable, or holds no valid example, still stops.

Prompts: the user text is the question, then ``"\\n\\n"`` and the instruction (by default the
reward's: ``\\boxed{}`` for math, ``<answer>`` tags for reasoning-gym); with a system prompt the
prompt is a chat list ``[{"role": "system", ...}, {"role": "user", ...}]``.
"""

from __future__ import annotations

import logging

from deployrl.rewards.grading import get_reward
from deployrl.settings.task import (  # the settings, for `load_task(JsonlTask(path=...))`
    BenchmarkTask,
    FileSource,
    HFTask,
    JsonlTask,
    ParquetTask,
    ReasoningGymTask,
    TaskConfig,
    TaskSource,
)
from deployrl.tasks import reasoning_gym  # noqa: F401  (each source module registers its loader)
from deployrl.tasks.base import LOADERS, BadExamples, Example, Task, TaskDataError, make_prompt
from deployrl.tasks.benchmarks import BENCHMARKS, benchmark_file
from deployrl.tasks.records import load_prompt_file

__all__ = [
    "BENCHMARKS", "BenchmarkTask", "Example", "HFTask", "JsonlTask", "ParquetTask", "ReasoningGymTask", "Task",
    "TaskConfig", "TaskDataError", "benchmark_file", "load_prompt_file", "load_task", "make_prompt",
]

logger = logging.getLogger(__name__)


def load_task(config: TaskConfig) -> Task:
    """Load and validate every example of the task; errors name the file, line and field."""
    if not isinstance(config, TaskSource):
        raise TypeError(f"load_task expects a task config (JsonlTask, ReasoningGymTask, ...), got {type(config).__name__}")
    reward = get_reward(config.reward_name)
    bad = BadExamples(config.on_bad_example)
    examples = LOADERS.get(config.type)(config, config.resolved_instruction, bad)
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
