"""The math reward grades every benchmark problem's own reference answer correct.

For each benchmark in data/benchmarks: the completion "... \\boxed{<reference>}" must score 1.0
for at least 99% of the problems (measured: 100% everywhere), references must parse into a
mathematical object (not only a string; the documented exceptions are listed in
docs/tasks.md), and another problem's different answer must score 0. Run with -s to see the
rates. About 30 s on 2 cores.
"""

import json
import random

import pytest

from deployrl.rewards.grading import last_boxed, math_reward
from deployrl.rewards.sandbox import score_completions
from deployrl.settings.task import BenchmarkTask
from deployrl.tasks import BENCHMARKS, load_task

# References math-verify can only compare as strings (see docs/tasks.md): a derivative
# equation and a list of subscripted energy symbols.
STRING_ONLY = {("minerva_math", 27), ("minerva_math", 269)}
SAMPLE = 100  # wrong-answer pairs per benchmark (sympy takes up to a second on some pairs)


def parses_symbolically(completion: str, reference) -> float:
    """1.0 if the reference parses to a sympy object (runs in the reward workers)."""
    import sympy

    from deployrl.rewards.grading import _parse_boxed

    return float(any(isinstance(x, (sympy.Basic, sympy.MatrixBase)) for x in _parse_boxed(str(reference))))


@pytest.fixture(scope="module")
def references():
    return {name: load_task(BenchmarkTask(name=name)).references for name in BENCHMARKS}


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_math_reward_grades_own_reference_correct(name, references):
    refs = references[name]
    assert len(refs) == BENCHMARKS[name].size
    completions = [f"Let me check the work once more. So the final answer is $\\boxed{{{r}}}$." for r in refs]
    scores = score_completions(math_reward, completions, refs, timeout_s=30.0)
    rate = sum(scores.values) / len(refs)
    wrong = [(i, refs[i]) for i, v in enumerate(scores.values) if v != 1.0]
    print(f"\n{name}: {rate:.2%} of {len(refs)} references graded correct; failures {wrong[:10]}")
    assert scores.timeouts == 0 and scores.failures == 0, scores.errors
    assert rate >= 0.99, wrong


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_references_parse_symbolically(name, references):
    refs = references[name]
    scores = score_completions(parses_symbolically, [""] * len(refs), refs, timeout_s=30.0)
    string_only = {(name, i) for i, v in enumerate(scores.values) if v != 1.0}
    print(f"\n{name}: {len(string_only)} references compared as strings only: {sorted(string_only)}")
    assert scores.failures == scores.timeouts == 0, scores.errors
    assert string_only <= STRING_ONLY, [(i, refs[i]) for _, i in sorted(string_only - STRING_ONLY)]


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_other_problems_answers_are_wrong(name, references):
    refs = references[name]
    order = list(range(len(refs)))
    random.Random(0).shuffle(order)
    pairs = [(i, j) for i, j in enumerate(order) if refs[i].strip() != refs[j].strip()][:SAMPLE]
    completions = [f"\\boxed{{{refs[j]}}}" for _, j in pairs]
    scores = score_completions(math_reward, completions, [refs[i] for i, _ in pairs], timeout_s=30.0)
    accepted = [(refs[i], refs[j]) for (i, j), v in zip(pairs, scores.values) if v != 0.0]
    print(f"\n{name}: {len(accepted)} of {len(pairs)} different answers accepted: {accepted[:10]}")
    assert len(accepted) <= max(1, 0.01 * len(pairs)), accepted  # e.g. "2" and "+2" are equal


def test_math500_worked_solutions_match_their_answers():
    """The last \\boxed{} of each MATH-500 worked solution grades correct against `answer`."""
    rows = [json.loads(line) for line in open(_benchmark_path("math500"), encoding="utf-8")]
    boxed = [last_boxed(row["solution"]) for row in rows]
    scores = score_completions(math_reward, [f"\\boxed{{{b}}}" for b in boxed], [row["answer"] for row in rows])
    wrong = [(boxed[i], rows[i]["answer"]) for i, v in enumerate(scores.values) if v != 1.0]
    print(f"\nmath500 solutions vs answers: {1 - len(wrong) / len(rows):.2%}; {wrong[:10]}")
    assert len(wrong) <= 5, wrong


def _benchmark_path(name):
    from deployrl.tasks import benchmark_file

    return benchmark_file(name)
