"""Security rules (docs/runs.md, "Bad input and security"): no pickle loads (safetensors and JSON
only), YAML loaded safely, trust_remote_code only when the user asks, a user reward imported
only from the module the user named, and math grading of model output under a time limit that
holds from any thread, so an adversarial completion cannot hang a run.
"""

import ast
import inspect
import sys
import threading
import time
from pathlib import Path

import pytest

import deployrl
from deployrl.models.loading import UnsupportedModelError, load_model, load_tokenizer, resolve_model
from deployrl.rewards.grading import get_reward, math_reward
from deployrl.rewards.sandbox import score_completions
from deployrl.settings.config import ModelConfig, load_config
from deployrl.settings.parsing import ConfigError
from deployrl.settings.task import JsonlTask

SOURCE = Path(deployrl.__file__).parent

# --------------------------------------------------------------------------- the source tree

UNPICKLING_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "joblib", "marshal", "shelve"}
UNSAFE_CALLS = {
    "eval", "exec", "compile", "__import__",  # builtins that run code from a string
    "yaml.load", "yaml.load_all", "yaml.full_load", "yaml.full_load_all", "yaml.unsafe_load", "yaml.unsafe_load_all",
}
UNSAFE_YAML_LOADERS = {"yaml.Loader", "yaml.FullLoader", "yaml.UnsafeLoader", "yaml.CLoader", "yaml.CFullLoader",
                       "yaml.CUnsafeLoader"}
# Where a call of a kind that can run or unpickle foreign code is allowed, and why.
ALLOWED = {
    # the pipe between the trainer and its own reward workers (multiprocessing pickles what goes
    # through it): the worker receives the function by reference and the (completion, reference)
    # pair, the trainer receives a float or an error string that the worker itself built; no
    # other process can write to the pipe and nothing read from a file or the model is unpickled
    ".recv": {("rewards/sandbox.py", "_worker_main"), ("rewards/sandbox.py", "call")},
    # the user's reward, by the module name the user gave; the bench commands and the settings
    # classes of the commands (for their help), from fixed tables
    "importlib.import_module": {("rewards/grading.py", "get_reward"), ("commands/bench/__init__.py", "main"),
                                ("settings/docs.py", "command_config"), ("cli.py", "main")},
}


def dotted(node: ast.AST) -> str:
    """`torch.load` for the expression torch.load, `.recv` for any_object.recv; '' otherwise."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted(node.value)
        return f"{base}.{node.attr}" if isinstance(node.value, (ast.Name, ast.Attribute)) and base else f".{node.attr}"
    return ""


def keyword_is(call: ast.Call, name: str, value) -> bool:
    return any(k.arg == name and isinstance(k.value, ast.Constant) and k.value.value is value for k in call.keywords)


def source_violations(path: Path) -> list[str]:
    """Every forbidden import, call or keyword in the Python file `path`, as "file:line: what"."""
    relative = path.relative_to(SOURCE).as_posix()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []

    def visit(node: ast.AST, function: str) -> None:
        where = f"{relative}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        if isinstance(node, ast.Import):
            found.extend(f"{where}: import {a.name}" for a in node.names if a.name.split(".")[0] in UNPICKLING_MODULES)
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UNPICKLING_MODULES:
            found.append(f"{where}: from {node.module} import")
        if isinstance(node, ast.Attribute) and dotted(node) in UNSAFE_YAML_LOADERS:
            found.append(f"{where}: {dotted(node)}")
        if isinstance(node, ast.keyword) and node.arg == "trust_remote_code" and ast.unparse(node.value) == "True":
            found.append(f"{where}: trust_remote_code=True")
        if isinstance(node, ast.Call):
            name = dotted(node.func)
            if name in UNSAFE_CALLS:
                found.append(f"{where}: {name}()")
            if name.endswith("torch.load") and not keyword_is(node, "weights_only", True):
                found.append(f"{where}: torch.load without weights_only=True")
            if name.endswith(("np.load", "numpy.load")) and keyword_is(node, "allow_pickle", True):
                found.append(f"{where}: {name}(allow_pickle=True)")
            if name.startswith("subprocess.") and keyword_is(node, "shell", True):
                found.append(f"{where}: {name}(shell=True)")
            for kind, places in ALLOWED.items():
                if (name == kind or name.endswith(kind)) and (relative, function) not in places:
                    found.append(f"{where}: {name}() in {function} (allowed only in {sorted(places)})")
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(tree, "<module>")
    return found


def test_the_scanner_sees_forbidden_code(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "SOURCE", tmp_path)
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import pickle\nimport yaml, torch\n"
        "def f(path, conn):\n"
        "    yaml.load(open(path), Loader=yaml.Loader)\n    torch.load(path)\n    eval('1')\n"
        "    conn.recv()\n    load(path, trust_remote_code=True)\n    torch.load(path, weights_only=True)\n"
    )
    found = source_violations(bad)
    assert [v.split(": ", 1)[1] for v in found] == [
        "import pickle", "yaml.load()", "yaml.Loader", "torch.load without weights_only=True", "eval()",
        "conn.recv() in f (allowed only in [('rewards/sandbox.py', '_worker_main'), ('rewards/sandbox.py', 'call')])",
        "trust_remote_code=True",
    ]


def test_no_pickle_eval_unsafe_yaml_or_remote_code_in_the_source_tree():
    files = sorted(SOURCE.rglob("*.py"))
    assert len(files) > 20
    violations = [v for path in files for v in source_violations(path)]
    assert not violations, "\n".join(violations)


# --------------------------------------------------------------------------- YAML


def test_a_yaml_tag_that_builds_python_objects_is_refused(tmp_path):
    marker = tmp_path / "ran"
    config = tmp_path / "evil.yaml"
    config.write_text(f"steps: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(ConfigError, match=r"evil\.yaml:1: invalid YAML \(could not determine a constructor for the tag"):
        load_config(config)
    with pytest.raises(ConfigError, match=r"override 'output_dir=!!python/name:os\.system': the value is not valid YAML"):
        load_config(None, ["output_dir=!!python/name:os.system"])
    assert not marker.exists()


# --------------------------------------------------------------------------- trust_remote_code


class Loading(Exception):
    """Raised by a stand-in for transformers' loaders once it has recorded its arguments."""


def test_trust_remote_code_is_off_unless_the_user_asks(tiny_dir, tmp_path, monkeypatch):
    from tiny import toy_task_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from deployrl.training import trainer

    assert ModelConfig().trust_remote_code is False
    for function in (load_tokenizer, load_model):
        assert inspect.signature(function).parameters["trust_remote_code"].default is False
    seen = []

    def record(*args, trust_remote_code, **kwargs):
        seen.append(trust_remote_code)
        raise Loading

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", record)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", record)
    source = resolve_model(str(tiny_dir))
    for function in (load_tokenizer, load_model):
        with pytest.raises(Loading):
            function(source)
        with pytest.raises(Loading):
            function(source, trust_remote_code=True)
    assert seen == [False, True, False, True]

    # the trainer passes model.trust_remote_code through
    monkeypatch.setattr(trainer, "load_tokenizer", lambda source, trust: record(trust_remote_code=trust))
    base = [f"model.name={tiny_dir}", "task.type=jsonl", f"task.path={toy_task_file(tmp_path)}",
            "task.reward=tiny:starts_with_digit", "rollout.engine=hf:fp32", "rollout.max_new_tokens=6",
            "algo.ps.budget=3", f"output_dir={tmp_path / 'run'}"]
    for flag in ("false", "true"):
        with pytest.raises(Loading):
            trainer.Trainer(load_config(None, [*base, f"model.trust_remote_code={flag}"]))
    assert seen[-2:] == [False, True]


def test_a_model_that_ships_code_is_not_run_without_trust(tmp_path, tiny_dir):
    import json

    directory = tmp_path / "model"
    directory.mkdir()
    marker = tmp_path / "ran"
    config = {"model_type": "mine", "auto_map": {"AutoConfig": "mine.MineConfig", "AutoModelForCausalLM": "mine.Mine"}}
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "mine.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (directory / name).write_bytes((tiny_dir / name).read_bytes())
    source = resolve_model(str(directory))
    for load in (load_tokenizer, load_model):
        with pytest.raises(UnsupportedModelError, match=r"ships its own Python code .*model\.trust_remote_code=true"):
            load(source)
    assert not marker.exists()


# --------------------------------------------------------------------------- user rewards


def test_a_user_reward_is_imported_only_from_the_module_named(tmp_path):
    marker = tmp_path / "imported"
    evil = tmp_path / "evil_reward.py"
    evil.write_text(f"open({str(marker)!r}, 'w').close()\ndef score(c, r):\n    return 1.0\n")
    with pytest.raises(ValueError, match=r"is not a module name; give the module's import name .*not a file path"):
        get_reward(f"{evil}:score")
    with pytest.raises(ValueError, match=r"must name a function of the module .*without dunder attributes"):
        get_reward("deployrl.rewards.grading:math_reward.__globals__")
    # a module next to the dataset is not on the import path: it is not found, not imported
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1+1?", "answer": "2"}\n')
    with pytest.raises(ValueError, match=r"reward: reward 'evil_reward:score': cannot import module 'evil_reward'"):
        JsonlTask(path=str(data), reward="evil_reward:score")
    assert not marker.exists() and "evil_reward" not in sys.modules


def test_a_user_reward_comes_from_the_path_the_user_gave(tmp_path, monkeypatch):
    (tmp_path / "named_user_reward.py").write_text("def score(completion, reference):\n    return 0.5\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = get_reward("named_user_reward:score")
    assert Path(inspect.getfile(fn)) == tmp_path / "named_user_reward.py"
    assert score_completions(fn, ["x", "y"], [None, None]).values == [0.5, 0.5]  # the workers find it too


# --------------------------------------------------------------------------- grading under a time limit

ADVERSARIAL = {
    "power tower": r"\boxed{9^{9^{9^{9}}}}",
    "python power tower": r"\boxed{9**9**9**9}",
    "huge exponent": r"\boxed{10^{10^{10}}}",
    "factorial": r"\boxed{100000!}",
    "nested braces": "\\boxed{" + "{" * 5000 + "}" * 5000 + "}",
    "nested fractions": "\\boxed{" + "\\frac{1}{" * 200 + "2" + "}" * 200 + "}",
    "nested boxes": "\\boxed{" * 300 + "1" + "}" * 300,
    "unclosed boxes": "\\boxed{" * 20_000,
    "unclosed answer tags": "<answer>" * 50_000,
    "long digit string": "\\boxed{" + "9" * 100_000 + "}",
    "null bytes": "\\boxed{1\x00}\x00\x00",
    "unicode": "\\boxed{\u00bd\u221a\u2044\U0001f600\u202e}",
}


def test_adversarial_completions_are_graded_within_the_limit_from_a_thread():
    out = {}
    timeout = 2.0

    def grade() -> None:
        start = time.monotonic()
        out["scores"] = score_completions(math_reward, list(ADVERSARIAL.values()), ["1"] * len(ADVERSARIAL), timeout)
        out["seconds"] = time.monotonic() - start

    score_completions(math_reward, [r"\boxed{1}"], ["1"])  # workers started and warm
    thread = threading.Thread(target=grade, name="not-the-main-thread")
    thread.start()
    thread.join(300)
    assert not thread.is_alive(), "grading hung"
    scores = out["scores"]
    assert all(v in (0.0, 1.0) for v in scores.values) and scores.failures == 0, scores
    # each call that timed out cost its limit plus a fresh worker (seconds of imports on 2 busy cores)
    assert out["seconds"] < 30 + scores.timeouts * (timeout + 30), (out["seconds"], scores)


def test_one_math_grading_from_a_thread_stops_at_its_limit():
    out = {}

    def grade() -> None:
        start = time.monotonic()
        out["scores"] = score_completions(math_reward, [ADVERSARIAL["power tower"]], ["1"], timeout_s=1.0)
        out["seconds"] = time.monotonic() - start

    thread = threading.Thread(target=grade)
    thread.start()
    thread.join(120)
    assert out["scores"].timeouts == 1 and out["seconds"] < 60, out


def test_math_verify_runs_without_signals_outside_the_main_thread():
    """math-verify's own timeouts use signal.alarm, which fails outside the main thread; they are
    off (the reward sandbox enforces the limit), so math_reward works from any thread."""
    out = {}
    thread = threading.Thread(target=lambda: out.update(value=math_reward(r"\boxed{\frac{1}{2}}", "0.5")))
    thread.start()
    thread.join(120)
    assert out == {"value": 1.0}
