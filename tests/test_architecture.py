"""The layout rules of docs/architecture.md, checked on the source: short functions in the
training loop and the engines, and registered names compared only where they are registered."""

import ast
from pathlib import Path

import pytest

from deployrl.algo.corrections import CORRECTIONS
from deployrl.algo.discrepancy import PENALTIES
from deployrl.algo.prefix import STRATEGIES
from deployrl.config import DynamicSampling, EngineRanks, Schedule
from deployrl.engines import ENGINES, LoraServing
from deployrl.ps_orders import PS_ORDERS

SRC = Path(__file__).resolve().parents[1] / "src" / "deployrl"
LOOP = ["trainer.py", "learner.py", "rollout.py", "ps_orders.py",
        *(str(p.relative_to(SRC)) for p in sorted((SRC / "engines").glob("*.py")))]
# each vocabulary, and the modules that own it (where its names may be compared)
VOCABULARIES = {
    "mismatch correction": (set(CORRECTIONS.names()), {"algo/corrections.py"}),
    "discrepancy penalty": (set(PENALTIES), {"algo/discrepancy.py"}),
    "cutoff strategy": (set(STRATEGIES.names()), {"algo/prefix.py"}),
    "proxy source": (set(PS_ORDERS.names()), {"ps_orders.py"}),
    "engine kind": (set(ENGINES.names()), {"engines/__init__.py"}),
    "closed vocabulary": ({c.value for e in (Schedule, DynamicSampling, EngineRanks, LoraServing) for c in e},
                          {"config.py", "engines/base.py"}),
}


def functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node, node.end_lineno - node.lineno + 1


@pytest.mark.parametrize("module", LOOP)
def test_no_function_over_60_lines(module):
    long = [(node.name, n) for node, n in functions(SRC / module) if n > 60]
    assert not long, f"{module}: {long}"


def test_the_update_reads_on_one_screen():
    lengths = {node.name: n for node, n in functions(SRC / "learner.py")}
    assert lengths["update"] <= 50


def compared_strings(tree: ast.AST):
    """(line, string) of each string constant compared with == / != / in / not in."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn))
                                                 for op in node.ops):
            for side in [node.left, *node.comparators]:
                values = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                for value in values:
                    if isinstance(value, ast.Constant) and isinstance(value.value, str):
                        yield node.lineno, value.value


def test_registered_names_are_compared_only_where_they_are_registered():
    leaks = []
    for path in sorted(SRC.rglob("*.py")):
        module = str(path.relative_to(SRC))
        for line, text in compared_strings(ast.parse(path.read_text())):
            owned = {name for names, owners in VOCABULARIES.values() if module in owners for name in names}
            for kind, (names, owners) in VOCABULARIES.items():
                if text in names and text not in owned:  # a word of its own vocabulary ("full" penalty)
                    leaks.append(f"{module}:{line} compares the {kind} {text!r}")
    assert not leaks, "\n".join(leaks)
