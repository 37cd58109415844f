"""Bad input, caught before the expensive work: malformed configs, datasets, model files and
engine specs each fail with one error whose message names what is wrong (file, line, field or
key) and how to fix it, and the trainer refuses them before any model weights load
(docs/runs.md, "Bad input and security"). At the end of the module a line reports the bad
inputs injected and how many were caught with a clear message.
"""

import json
import re
from functools import partial
from pathlib import Path
from typing import Optional

import pytest

from deployrl.models.loading import UnsupportedModelError, load_model, load_tokenizer, resolve_model
from deployrl.settings.config import load_config
from deployrl.settings.parsing import ConfigError
from deployrl.settings.task import JsonlTask, ParquetTask
from deployrl.tasks import TaskDataError, load_task
from deployrl.training import trainer as trainer_module


@pytest.fixture(scope="module")
def tally(report_to_terminal):
    """Counts of the module: bad inputs injected, bad inputs caught with a clear message."""
    counts = {"injected": 0, "caught": 0}
    yield counts
    line = f"bad input: {counts['injected']} bad inputs injected, {counts['caught']} caught with a clear message"
    report_to_terminal(line)


def caught(tally, error_type, message, action):
    """Inject one bad input (`action`); it is caught when `action` raises `error_type` with
    `message` (a regular expression) in a message of one line."""
    tally["injected"] += 1
    with pytest.raises(error_type, match=message) as info:
        action()
    assert "\n" not in str(info.value), f"not one line: {info.value}"
    tally["caught"] += 1
    return info.value


@pytest.fixture
def no_weights(monkeypatch):
    """Fail the test if any model weights load (transformers' from_pretrained of a model)."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: pytest.fail("model weights loaded before the bad input was refused"))


def toy_overrides(tmp_path: Path, tiny_dir: Path, *extra: str) -> list[str]:
    from tiny import toy_task_file

    return [
        f"model.name={tiny_dir}", "task.type=jsonl", f"task.path={toy_task_file(tmp_path)}",
        "task.reward=tiny:starts_with_digit", "task.instruction=", "rollout.engine=hf:bf16",
        "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=6", "rollout.context_length=64",
        "algo.ps.budget=3", "eval.num_prompts=0", "tensorboard=false", f"output_dir={tmp_path / 'run'}", *extra,
    ]


# --------------------------------------------------------------------------- configs

CONFIG_CASES = {
    # unknown keys: the nearest valid key is named
    "unknown key": (["algo.dc.tolerence=0.01"], r"unknown key 'algo\.dc\.tolerence'; did you mean 'algo\.dc\.tolerance'"),
    "unknown section": (["rolout.group_size=4"], r"unknown key 'rolout'; did you mean 'rollout'"),
    # wrong types
    "string for a number": (["algo.ps.budget=lots"], r"algo\.ps\.budget must be a number, got 'lots'"),
    "float for an integer": (["steps=2.5"], r"steps must be an integer, got 2\.5"),
    "word for a boolean": (["model.trust_remote_code=yes"], r"model\.trust_remote_code must be true or false, got 'yes'"),
    "value for a section": (["rollout=3"], r"rollout must be a mapping, got int"),
    "invalid YAML value": (["steps=[1,"], r"override 'steps=\[1,': the value is not valid YAML .*quote"),
    # out of range
    "zero steps": (["steps=0"], r"steps must be > 0, got 0"),
    "NaN learning rate": (["optim.lr=.nan"], r"optim\.lr must be a finite number, got nan"),
    "infinite multiplier cap": (["algo.dc.lam_max=.inf"], r"algo\.dc\.lam_max must be a finite number, got inf"),
    "top_p above 1": (["rollout.top_p=1.5"], r"top_p must lie in \(0, 1\], got 1\.5"),
    "negative seed": (["seed=-1"], r"seed must lie in \[0, 4294967295\], got -1"),
    "eps_low of 1 or more": (["algo.eps_low=1.5"], r"eps_low must lie in \[0, 1\)"),
    "zero eval tokens": (["eval.max_new_tokens=0"], r"eval: max_new_tokens must be > 0"),
    "unknown choice": (["algo.ps.strategy=optimised"], r"unknown cutoff strategy 'optimised'\. Did you mean 'optimized'"),
    # incompatible options
    "budget above the completion length": (
        ["algo.ps.budget=64", "rollout.max_new_tokens=32"],
        r"algo\.ps\.budget=64 exceeds rollout\.max_new_tokens=32: .*set algo\.ps\.strategy=full",
    ),
    "K = 1 with group advantages": (["rollout.group_size=1"], r"group_size must be >= 2, got 1: .*rollout\.group_size=2"),
    "no room for a prompt": (["rollout.context_length=32", "rollout.max_new_tokens=32"],
                             r"context_length=32 leaves no room for a prompt next to max_new_tokens=32"),
    "merged adapters outside vLLM": (["rollout.lora_serving=merged"],
                                     r"lora_serving=merged is a vllm engine option; llamacpp:q4_1 serves adapters"),
    "unknown LoRA serving": (["rollout.lora_serving=merge"], r"lora_serving"),
    "xi_min beyond the budget": (["algo.ps.xi_min=0.5", "algo.ps.budget=8"], r"exceeds algo\.ps\.budget=8"),
    "overlong buffer beyond the completion": (["algo.overlong_buffer=64"], r"overlong_buffer=64 exceeds rollout\.max_new_tokens"),
    "llama.cpp engine on a Hugging Face model": (
        ["model.name=some/dir", "rollout.engine=llamacpp:q4_1"],
        r"rollout\.engine=llamacpp:q4_1 .* model\.name must be a \.gguf file .*rollout\.engine=hf:bf16",
    ),
}


@pytest.mark.parametrize("case", CONFIG_CASES)
def test_bad_config_values_name_the_key(case, tally):
    overrides, message = CONFIG_CASES[case]
    caught(tally, ConfigError, message, lambda: load_config(None, overrides))


YAML_CASES = {
    "syntax error": ("algo:\n  eps_low: 0.2\n  ps: [1, 2\n", r"bad\.yaml:\d+: invalid YAML"),
    "duplicate key": ("steps: 3\nseed: 1\nsteps: 4\n", r"bad\.yaml:3: invalid YAML \(key 'steps' is given twice \(first on line 1\)"),
    "unknown key in a file": ("algo:\n  eps_hihg: 0.3\n", r"bad\.yaml:2: unknown key 'algo\.eps_hihg'; did you mean 'algo\.eps_high'"),
    "wrong type in a file": ("steps: 3\nalgo:\n  ps:\n    budget: lots\n", r"bad\.yaml:4: algo\.ps\.budget must be a number, got 'lots'"),
    "key of another task type": ("task:\n  type: jsonl\n  path: a.jsonl\n  size: 5\n",
                                 r"bad\.yaml:4: unknown key 'task\.size'\. Valid keys of a jsonl task: type, .*path"),
    "top level is a list": ("- steps\n", r"bad\.yaml: the top level must be a mapping of sections, got list"),
    "not UTF-8": (b"steps: 3\n# caf\xe9\n", r"bad\.yaml: not UTF-8 text \(byte 0xe9 at offset 14\); save it as UTF-8"),
}


@pytest.mark.parametrize("case", YAML_CASES)
def test_bad_config_files_name_the_file_and_line(case, tmp_path, tally):
    text, message = YAML_CASES[case]
    path = tmp_path / "bad.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    caught(tally, ConfigError, message, lambda: load_config(path))


def test_missing_config_file(tmp_path, tally):
    caught(tally, ConfigError, r"config file not found: .*nope\.yaml", lambda: load_config(tmp_path / "nope.yaml"))
    caught(tally, ConfigError, r"is a directory; give a YAML config file", lambda: load_config(tmp_path))


def test_the_train_command_prints_one_line_and_exits_2(tally, capsys):
    from deployrl.cli import main

    tally["injected"] += 1
    with pytest.raises(SystemExit) as info:
        main(["train", "rollout.group_size=1"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("deployrl train: error: command line: rollout: group_size must be >= 2")
    tally["caught"] += 1


# --------------------------------------------------------------------------- datasets

DATA_CASES = {
    "malformed JSON": (['{"prompt": "a", "answer": "1"}', '{"prompt": "b", "answer": '], r":2: not valid JSON"),
    "missing field": (['{"prompt": "a"}'], r":1: field 'answer' is missing \(fields present: prompt\)"),
    "empty prompt": (['{"prompt": "  ", "answer": "1"}'], r":1: field 'prompt' must be a non-empty string"),
    "non-text prompt": (['{"prompt": 7, "answer": "1"}'], r":1: field 'prompt' must be a non-empty string .*got 7"),
    "chat message without content": (['{"prompt": [{"role": "user"}], "answer": "1"}'], r":1: field 'prompt' must be"),
    "empty answer": (['{"prompt": "a", "answer": null}'], r":1: field 'answer' is empty \(null\)"),
    "infinite answer": (['{"prompt": "a", "answer": Infinity}'], r":1: field 'answer' is inf \(not a finite number\)"),
    "not an object": (['["a", "1"]'], r":1: expected a JSON object, got list"),
    "not UTF-8": ([b'{"prompt": "caf\xe9", "answer": "1"}'], r":1: not UTF-8 text \(byte 0xe9 at column 16\)"),
    "lone surrogate": (['{"prompt": "x\\ud800", "answer": "1"}'], r":1: field 'prompt' holds a lone UTF-16 surrogate"),
    "nested too deeply": (['{"prompt": "a", "answer": ' + "[" * 100_000 + "]" * 100_000 + "}"],
                          r":1: JSON that cannot be read \(RecursionError"),
}


def write_lines(path: Path, lines) -> Path:
    path.write_bytes(b"".join((line if isinstance(line, bytes) else line.encode()) + b"\n" for line in lines))
    return path


@pytest.mark.parametrize("case", DATA_CASES)
def test_bad_datasets_name_the_file_line_and_field(case, tmp_path, tally):
    lines, message = DATA_CASES[case]
    path = write_lines(tmp_path / "bad.jsonl", lines)
    caught(tally, TaskDataError, re.escape(str(path)) + message,
           lambda: load_task(JsonlTask(path=str(path))))


def test_missing_dataset_files(tmp_path, tally):
    caught(tally, TaskDataError, r"nope\.jsonl: file not found",
           lambda: load_task(JsonlTask(path=str(tmp_path / "nope.jsonl"))))
    (tmp_path / "dir.jsonl").mkdir()
    caught(tally, TaskDataError, r"dir\.jsonl: a directory, not a JSONL file",
           lambda: load_task(JsonlTask(path=str(tmp_path / "dir.jsonl"))))
    write_lines(tmp_path / "blank.jsonl", ["", "  "])
    caught(tally, TaskDataError, r"task .*blank\.jsonl: no examples",
           lambda: load_task(JsonlTask(path=str(tmp_path / "blank.jsonl"))))
    caught(tally, TaskDataError, r"nope\.parquet: file not found \(task\.path\)",
           lambda: load_task(ParquetTask(path=str(tmp_path / "nope.parquet"))))
    caught(tally, ConfigError, r"task: path must be a \.jsonl file",
           lambda: load_config(None, ["task.type=jsonl", "task.path=data.json"]))
    caught(tally, ConfigError, r"task: on_bad_example: unknown action 'ignore'\. Valid names: skip, stop",
           lambda: load_config(None, ["task.on_bad_example=ignore"]))


def test_skip_leaves_out_malformed_examples_and_counts_them(tmp_path, tally, caplog):
    path = write_lines(tmp_path / "mixed.jsonl", [
        '{"prompt": "1+1?", "answer": "2"}', '{"prompt": "2+2?", "answer": ', b"\xff\xfe", "",
        '{"prompt": "", "answer": "1"}', '{"prompt": "3+3?", "answer": "6"}',
    ])
    caught(tally, TaskDataError, r"mixed\.jsonl:2: not valid JSON",  # stop is the default
           lambda: load_task(JsonlTask(path=str(path))))
    task = load_task(JsonlTask(path=str(path), on_bad_example="skip"))
    assert task.references == ["2", "6"] and [e.source for e in task] == [f"{path}:1", f"{path}:6"]
    assert [m.split(": ", 1)[0] for m in task.skipped] == [f"{path}:2", f"{path}:3", f"{path}:5"]
    assert "2 examples loaded, 3 malformed example(s) skipped (task.on_bad_example=skip)" in caplog.text
    tally["injected"] += 3
    tally["caught"] += 3
    only_bad = write_lines(tmp_path / "bad.jsonl", ['{"prompt": "x"}'])
    caught(tally, TaskDataError, r"no examples \(1 malformed example\(s\) skipped .*bad\.jsonl:1: field 'answer' is missing",
           lambda: load_task(JsonlTask(path=str(only_bad), on_bad_example="skip")))


def test_a_bad_dataset_fails_before_the_model_loads(tmp_path, tiny_dir, tally, no_weights, monkeypatch):
    monkeypatch.setattr(trainer_module, "resolve_model", lambda *a: pytest.fail("the model was resolved"))
    path = write_lines(tmp_path / "bad.jsonl", ['{"prompt": "a", "answer": "1"}', "{oops"])
    config = load_config(None, toy_overrides(tmp_path, tiny_dir, f"task.path={path}"))
    caught(tally, TaskDataError, r"bad\.jsonl:2: not valid JSON", lambda: trainer_module.Trainer(config))


# --------------------------------------------------------------------------- models


def model_dir(tmp_path: Path, config, tiny_dir: Optional[Path] = None, files=()) -> Path:
    """A model directory: `config` as config.json (a dict, or raw text), plus `files` copied from `tiny_dir`."""
    directory = tmp_path / "model"
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    for name in files:
        (directory / name).write_bytes((tiny_dir / name).read_bytes())
    return directory


def gguf_file(path: Path, metadata: dict) -> Path:
    """A GGUF file holding only `metadata` (strings and integers) and no tensors."""
    import gguf

    writer = gguf.GGUFWriter(str(path), metadata.pop("general.architecture", "llama"))
    for key, value in metadata.items():
        (writer.add_string if isinstance(value, str) else writer.add_uint32)(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_missing_model_paths(tmp_path, tally):
    caught(tally, FileNotFoundError, r"GGUF file not found", lambda: resolve_model(str(tmp_path / "m.gguf")))
    caught(tally, FileNotFoundError, r"is a directory without config\.json", lambda: resolve_model(str(tmp_path)))
    caught(tally, FileNotFoundError, r"'\./no/such/model': no such directory or GGUF file",
           lambda: resolve_model("./no/such/model"))
    (tmp_path / "model.safetensors").write_bytes(b"")
    caught(tally, UnsupportedModelError, r"is neither a directory nor a \.gguf file",
           lambda: resolve_model(str(tmp_path / "model.safetensors")))


MODEL_CONFIG_CASES = {
    "config.json not JSON": ("{not json", r"config\.json: not valid JSON"),
    "no model_type": ({"hidden_size": 8}, r"config\.json: no 'model_type'"),
    "unsupported architecture": ({"model_type": "frobnicator"},
                                 r"config\.json: unsupported architecture 'frobnicator': transformers .* does not know it"),
    "not a causal language model": ({"model_type": "vit"}, r"architecture 'vit' is not a causal language model"),
}


@pytest.mark.parametrize("case", MODEL_CONFIG_CASES)
def test_unsupported_model_directories(case, tmp_path, tally):
    config, message = MODEL_CONFIG_CASES[case]
    directory = model_dir(tmp_path, config)
    caught(tally, UnsupportedModelError, message, lambda: resolve_model(str(directory)))


def test_model_directory_without_tokenizer_or_with_untrusted_code(tmp_path, tiny_dir, tally, no_weights):
    bare = model_dir(tmp_path, json.loads((tiny_dir / "config.json").read_text()))
    caught(tally, UnsupportedModelError, r"model: no tokenizer files \(tokenizer\.json, .*tokenizer\.save_pretrained",
           lambda: load_tokenizer(resolve_model(str(bare))))
    remote = model_dir(tmp_path / "r", {"model_type": "mine", "auto_map": {"AutoModelForCausalLM": "mine.Mine"}},
                       tiny_dir, ["tokenizer.json", "tokenizer_config.json"])
    source = resolve_model(str(remote))  # the architecture is the model's own code: trust decides
    for load in (load_tokenizer, load_model):
        caught(tally, UnsupportedModelError, r"ships its own Python code .* set model\.trust_remote_code=true",
               partial(load, source))


GGUF_CASES = {
    "not a GGUF": (None, r"bad\.gguf: not a readable GGUF file"),
    "unsupported architecture": ({"general.architecture": "rwkv"},
                                 r"bad\.gguf: architecture 'rwkv' cannot be loaded from GGUF by transformers"),
    "no tokenizer": ({"llama.block_count": 2, "llama.embedding_length": 32},
                     r"bad\.gguf: the GGUF metadata lacks tokenizer\.ggml\.model, tokenizer\.ggml\.tokens"),
    "no shape": ({"tokenizer.ggml.model": "gpt2"},
                 r"lacks llama\.block_count, llama\.embedding_length, tokenizer\.ggml\.tokens"),
}


@pytest.mark.parametrize("case", GGUF_CASES)
def test_gguf_without_the_needed_metadata(case, tmp_path, tally):
    metadata, message = GGUF_CASES[case]
    path = tmp_path / "bad.gguf"
    if metadata is None:
        path.write_bytes(b"GGML" + bytes(60))
    else:
        gguf_file(path, dict(metadata))
    caught(tally, UnsupportedModelError, message, lambda: resolve_model(str(path)))


def test_a_bad_model_fails_before_its_weights_load(tmp_path, tiny_dir, tally, no_weights):
    directory = model_dir(tmp_path, {"model_type": "frobnicator"})
    config = load_config(None, toy_overrides(tmp_path, tiny_dir, f"model.name={directory}"))
    caught(tally, UnsupportedModelError, r"unsupported architecture 'frobnicator'", lambda: trainer_module.Trainer(config))


# --------------------------------------------------------------------------- engines

ENGINE_CASES = {
    "unsupported llama.cpp quantisation": ("llamacpp:q5_k", r"unknown llamacpp engine option 'q5_k'\. .*q4_0, q4_1, q8_0"),
    "unsupported hf precision": ("hf:int8", r"unknown hf engine option 'int8'\. Valid names: bf16, fp16, fp32, fp8"),
    "unknown engine": ("sglang:fp8", r"unknown engine 'sglang'\. Valid names: hf, llamacpp, vllm"),
}


@pytest.mark.parametrize("case", ENGINE_CASES)
def test_unsupported_engines_are_refused_with_the_config(case, tally):
    spec, message = ENGINE_CASES[case]
    caught(tally, ConfigError, r"rollout: " + message, lambda: load_config(None, [f"rollout.engine={spec}"]))


def test_the_eval_command_checks_the_engine_before_loading(tally, capsys, no_weights, monkeypatch):
    from deployrl.commands import evaluate

    monkeypatch.setattr("deployrl.tasks.load_task", lambda *a: pytest.fail("the task was loaded"))
    tally["injected"] += 1
    with pytest.raises(SystemExit) as info:
        evaluate.main(["--engine", "llamacpp:q5_k"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.startswith("deployrl eval: error: command line: "), err
    assert "unknown llamacpp engine option 'q5_k'" in err
    tally["caught"] += 1


# --------------------------------------------------------------------------- every command

COMMAND_CASES = {  # argv of `deployrl`, the message: every command parses its settings one way
    "train": (["train", "rollout.group_sise=4"], r"unknown key 'rollout\.group_sise'; did you mean 'rollout\.group_size'\?"),
    "eval": (["eval", "num_promts=3"], r"unknown key 'num_promts'; did you mean 'num_prompts'\?"),
    "eval task": (["eval", "task.type=benchmark", "task.name=gsm8k", "task.splt=test"],
                  r"unknown key 'task\.splt'\. Valid keys of a benchmark task: "),
    "eval flag": (["eval", "--num-prompts", "many"], r"num_prompts must be an integer, got 'many'"),
    "mismatch": (["mismatch", "threshhold=0.1"], r"unknown key 'threshhold'; did you mean 'threshold'\?"),
    "mismatch flag": (["mismatch", "-n", "0"], r"n \(completions per prompt\) must be >= 1, got 0"),
    "selfcheck": (["selfcheck", "budgte=3"], r"unknown key 'budgte'; did you mean 'budget'\?"),
    "bench update": (["bench", "update", "budgte=8"], r"unknown key 'budgte'; did you mean 'budget'\?"),
    "bench update flag": (["bench", "update", "--methods", "grpo", "ps:optimised"],
                          r"unknown method 'ps:optimised'\. Did you mean 'ps:optimized'\?"),
    "bench engines": (["bench", "engines", "parallell=4"], r"unknown key 'parallell'; did you mean 'parallel'\?"),
    "bench step": (["bench", "step", "rollout.max_new_tokenz=8"],
                   r"unknown key 'rollout\.max_new_tokenz'; did you mean 'rollout\.max_new_tokens'\?"),
    "bench step flag": (["bench", "step", "--vs", "tlr"], r"unknown framework to compare with 'tlr'\. Did you mean 'trl'\?"),
    "bench variance": (["bench", "variance", "algo.ps.budgte=8"], r"unknown key 'algo\.ps\.budgte'; did you mean 'algo\.ps\.budget'\?"),
}


@pytest.mark.parametrize("case", COMMAND_CASES)
def test_every_command_names_the_bad_key_and_the_nearest_valid_one(case, tally, capsys, no_weights):
    from deployrl.cli import main

    argv, message = COMMAND_CASES[case]
    tally["injected"] += 1
    try:
        code = main(argv)
    except SystemExit as stop:
        code = stop.code
    err = capsys.readouterr().err
    command = " ".join(["deployrl", *argv[: 2 if argv[0] == "bench" else 1]])
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"{command}: error: command line: ") and re.search(message, err), err
    tally["caught"] += 1
