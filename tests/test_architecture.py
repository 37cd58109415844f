"""The layout rules of docs/architecture.md, checked on the source: imports go down the floors only,
short functions in the training loop and the engines, and registered names compared only where they
are registered."""

import ast
import sys
from pathlib import Path

import pytest

from deployrl.algo.corrections import CORRECTIONS
from deployrl.algo.discrepancy import PENALTIES
from deployrl.algo.prefix import STRATEGIES
from deployrl.engines import ENGINES, LoraServing
from deployrl.settings.config import DynamicSampling, EngineRanks, ProxySource, Schedule
from deployrl.training.ps_orders import PS_ORDERS

SRC = Path(__file__).resolve().parents[1] / "src" / "deployrl"
LOOP = ["training/trainer.py", "training/learner.py", "training/passes.py", "training/rollout.py",
        "training/ps_orders.py",
        *(str(p.relative_to(SRC)) for p in sorted((SRC / "engines").glob("*.py")))]
# each vocabulary, and the modules that own it (where its names may be compared)
VOCABULARIES = {
    "mismatch correction": (set(CORRECTIONS.names()), {"algo/corrections.py"}),
    "discrepancy penalty": (set(PENALTIES), {"algo/discrepancy.py"}),
    "cutoff strategy": (set(STRATEGIES.names()), {"algo/prefix.py"}),
    "proxy source": (set(ProxySource.names()), {"settings/config.py"}),
    "engine kind": (set(ENGINES.names()), {"engines/__init__.py"}),
    "closed vocabulary": ({c.value for e in (Schedule, DynamicSampling, EngineRanks, LoraServing) for c in e},
                          {"settings/config.py", "engines/base.py"}),
}


# the floors of docs/architecture.md: a module imports from its own floor or below, never above
FLOORS = {
    "registry": 0, "errors": 0, "timeout": 0, "cpu": 0,
    "algo": 1, "rewards": 1, "settings.parsing": 1, "settings.docs": 1, "settings.model": 1, "settings.task": 1,
    "settings": 1, "settings.command_line": 1,
    "models": 2, "tasks": 2,
    "engines": 3,
    "settings.config": 4,
    "training": 5,
    "commands": 6, "cli": 6, "__main__": 6,
}


def floor(module: str) -> int:
    """The floor of a dotted module path inside deployrl (its longest prefix in FLOORS)."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in FLOORS:
            return FLOORS[".".join(parts[:n])]
    raise KeyError(f"deployrl.{module} has no floor in FLOORS")


def imported_modules(tree: ast.AST):
    """(line, module inside deployrl) of each import, those only for type checkers left out."""
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
               for child in node.body for n in ast.walk(child)}
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("deployrl."):
            yield node.lineno, node.module.removeprefix("deployrl.")
        elif isinstance(node, ast.Import):
            yield from ((node.lineno, a.name.removeprefix("deployrl.")) for a in node.names
                        if a.name.startswith("deployrl."))


def test_imports_go_down_the_floors():
    climbs = []
    for path in sorted(SRC.rglob("*.py")):
        module = ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
        for line, target in imported_modules(ast.parse(path.read_text())):
            if floor(target) > floor(module):
                climbs.append(f"{module}:{line} (floor {floor(module)}) imports {target} (floor {floor(target)})")
    assert not climbs, "\n".join(climbs)


def test_every_proxy_source_has_its_order():
    assert sorted(PS_ORDERS.names()) == sorted(ProxySource.names())


def functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node, node.end_lineno - node.lineno + 1


@pytest.mark.parametrize("module", LOOP)
def test_no_function_over_60_lines(module):
    long = [(node.name, n) for node, n in functions(SRC / module) if n > 60]
    assert not long, f"{module}: {long}"


def test_the_update_reads_on_one_screen():
    lengths = {node.name: n for node, n in functions(SRC / "training/learner.py")}
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


def learn_path(trainer, rollouts) -> tuple[list[str], set[tuple[str, str]]]:
    """Follow `Trainer.learn(rollouts)` through the code. Returns the rooms (deployrl modules) control
    passes through, in order, and the climbs back up: each distinct call from one room into another
    that is already on the call stack (a room calling back into one of its callers). Frames outside
    deployrl (torch, transformers) belong to the deployrl frame below them."""
    stack: list[tuple[str, str]] = []
    rooms: list[str] = []
    climbs: set[tuple[str, str]] = set()

    def profile(frame, event, arg):
        module = frame.f_globals.get("__name__", "")
        if event not in ("call", "return") or not module.startswith("deployrl."):
            return
        if event == "call":
            here = stack[-1] if stack else None
            if here and module != here[0] and module in {room for room, _ in stack}:
                climbs.add((f"{here[0]}.{here[1]}", f"{module}.{frame.f_code.co_qualname}"))
            stack.append((module, frame.f_code.co_qualname))
        elif stack:
            stack.pop()
        room = stack[-1][0] if stack else module
        if not rooms or rooms[-1] != room:
            rooms.append(room)

    sys.setprofile(profile)
    try:
        trainer.learn(rollouts)
    finally:
        sys.setprofile(None)
    return rooms, climbs


@pytest.mark.parametrize("proxies", ["engine", "trainer"])
def test_the_learn_phase_never_calls_back_up_by_name(proxies, tmp_path, tiny_dir):
    from test_trainer import toy_config

    from deployrl.training.trainer import Trainer

    trainer = Trainer(toy_config(tmp_path, tiny_dir, "model.lora.rank=4", f"algo.ps.proxies={proxies}"))
    rollouts = trainer.rollout.collect(trainer.stream, 0)
    rooms, climbs = learn_path(trainer, rollouts)
    assert rooms[0] == "deployrl.training.trainer" and "deployrl.algo.losses" in rooms  # it followed the step
    assert len(climbs) <= 5, "\n".join(f"{a} -> {b}" for a, b in sorted(climbs))
    # the climbs left are functions handed down as arguments (a runner's call, a scorer's reduction);
    # no room calls a named function of a room above it
    named = [f"{a} -> {b}" for a, b in sorted(climbs) if "<locals>" not in b]
    assert not named, "\n".join(named)
