"""The math benchmarks shipped in ``data/benchmarks``, and how the reference answer is parsed
out of each one's records (a ``####`` line, a ``\\boxed{}`` solution, a list of final answers)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from deployrl.registry import unknown_name_error
from deployrl.rewards.grading import last_boxed
from deployrl.settings.task import BenchmarkTask
from deployrl.tasks.base import LOADERS, BadExamples, Example, TaskDataError, make_prompt
from deployrl.tasks.records import json_lines

BENCHMARK_DIR_ENV = "DEPLOYRL_BENCHMARK_DIR"


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
    ``data/benchmarks`` (the repository root holds ``src/deployrl/tasks``)."""
    env = os.environ.get(BENCHMARK_DIR_ENV)
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[3] / "data" / "benchmarks"


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


@LOADERS.register(BenchmarkTask.type)
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
