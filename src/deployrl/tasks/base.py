"""What every task source yields: examples, the task that holds them, and how prompts are written.

Each source module (`records`, `reasoning_gym`, `benchmarks`) registers one loader in `LOADERS`
under its settings class's `type`: ``loader(settings, instruction, bad) -> list[Example]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

from deployrl.registry import Registry
from deployrl.rewards.grading import RewardFn
from deployrl.settings.task import TaskConfig
from deployrl.tasks.prompts import Prompt


class TaskDataError(ValueError):
    """A task's data is missing or malformed (the message names the file, line and field)."""


@dataclass(frozen=True)
class Example:
    prompt: Prompt  # user text, or chat messages [{"role", "content"}, ...]
    reference: Any  # what the reward compares with (an answer string, a reasoning-gym entry, ...)
    source: str  # where it came from: "data.jsonl:12", "reasoning_gym:basic_arithmetic#5", "benchmark:math500#17"


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


# (settings, instruction or None, bad-example handler) -> the examples
Loader = Callable[[TaskConfig, Optional[str], BadExamples], list[Example]]
LOADERS: Registry[Loader] = Registry("task type")


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
