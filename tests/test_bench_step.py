"""`deployrl bench step` on tiny random models: every row runs a step, the table and the JSON come out.

The rows run in this process (in_fresh_process is replaced): a fresh Python process per row costs
about ten seconds of imports on two busy cores. No timing is asserted.
"""

import importlib
import json

import pytest

from deployrl.commands.bench import step
from deployrl.settings.config import load_config

SMALL = [
    "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=4", "rollout.context_length=256",
    "task.size=16", "algo.ps.budget=2",
]


def in_this_process(function, kwargs, timeout=None):
    module, name = function.split(":")
    return getattr(importlib.import_module(module), name)(**kwargs)


@pytest.fixture
def rows_in_this_process(monkeypatch):
    monkeypatch.setattr(step, "in_fresh_process", in_this_process)


def table_rows(out: str) -> dict[str, list[str]]:
    """The markdown table's rows by their first cell."""
    lines = [line for line in out.splitlines() if line.startswith("| ")][1:]  # past the header
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    return {row[0]: row[1:] for row in cells}


def test_every_row_runs_against_trl_and_the_json_is_written(tiny_gguf, tmp_path, rows_in_this_process, capsys):
    pytest.importorskip("trl", reason="TRL is not installed: pip install 'deployrl[bench]'")
    out_json = tmp_path / "step.json"
    code = step.main([
        "--model", str(tiny_gguf), "--cache-dir", str(tmp_path / "cache"), "--vs", "trl", "--steps", "1",
        "--threads", "1", "--trl-micro-batch", "4", "--json", str(out_json), *SMALL,
    ])
    out = capsys.readouterr().out
    assert code == 0
    rows = table_rows(out)
    shipped = "deployrl as shipped (llamacpp:q4_1, correction dc, PS optimized)"
    assert list(rows) == [step.TRL_LABEL, "deployrl hf:fp32, PS off", "deployrl hf:fp32, PS on",
                          "deployrl hf:fp32, PS prefix-only", shipped], out
    assert all(len(cells) == 6 for cells in rows.values())  # five numbers and the speed ratio
    assert rows[step.TRL_LABEL][-1] == "1"
    assert "trl 1." in out and "torch threads: 1" in out
    assert list((tmp_path / "cache").iterdir()), "the GGUF was not dequantised into the cache directory"

    data = json.loads(out_json.read_text())
    assert list(data["results"]) == ["trl", "ps_off", "ps_on", "ps_prefix", "as_shipped"]
    for name, result in data["results"].items():
        (record,) = result["steps"]
        assert 0 < record["generation_s"] <= record["step_s"], name
        assert record["update_s"] == pytest.approx(record["step_s"] - record["generation_s"])
        assert result["median"]["step_s"] == record["step_s"]
        assert result["threads"] == 1 and result["peak_mb"] >= 0 and result["process_peak_mb"] > result["loaded_mb"] > 0
    # TRL and PS off backpropagate every completion (no group is dropped on these rows).
    assert data["results"]["trl"]["steps"][0]["update_s"] > 0
    assert data["results"]["ps_off"]["steps"][0]["update_s"] > 0


def test_without_trl_an_hf_folder_runs_the_hf_rows_only(tiny_dir, tmp_path, rows_in_this_process, capsys):
    code = step.main(["--model", str(tiny_dir), "--steps", "1", "--threads", "1", *SMALL])
    captured = capsys.readouterr()
    assert code == 0
    rows = table_rows(captured.out)
    assert list(rows) == ["deployrl hf:fp32, PS off", "deployrl hf:fp32, PS on", "deployrl hf:fp32, PS prefix-only"]
    assert all(len(cells) == 5 for cells in rows.values())  # no speed ratio without TRL
    versions = next(line for line in captured.out.splitlines() if line.startswith("- versions:"))
    assert "speed vs TRL" not in captured.out and "trl " not in versions
    assert "needs a GGUF model" in captured.err


def test_trl_settings_mirror_the_config():
    config = load_config(None, ["rollout.group_size=4", "rollout.prompts_per_step=3", "optim.lr=0.001"])
    settings = step.trl_settings(config, completions_per_micro_batch=6)
    assert settings["num_generations"] == 4
    assert settings["per_device_train_batch_size"] * settings["gradient_accumulation_steps"] == 12
    assert settings["loss_type"] == "dapo" and settings["scale_rewards"] == "group"
    assert settings["learning_rate"] == 0.001 and settings["beta"] == 0.0 and settings["num_iterations"] == 1
    assert (settings["epsilon"], settings["epsilon_high"]) == (0.2, 0.28)
    sequence_mean = load_config(None, ["algo.aggregation=seq_mean_token_mean", "algo.advantage=dr_grpo"])
    assert step.trl_settings(sequence_mean, 16)["loss_type"] == "grpo"
    assert step.trl_settings(sequence_mean, 16)["scale_rewards"] == "none"


@pytest.mark.parametrize("overrides, micro_batch, message", [
    (["algo.advantage=rloo"], 16, "algo.advantage=rloo"),
    (["algo.ppo_epochs=2"], 16, "ppo_epochs"),
    ([], 5, "does not divide 32"),
])
def test_trl_settings_refuse_what_trl_cannot_match(overrides, micro_batch, message):
    with pytest.raises(ValueError, match=message):
        step.trl_settings(load_config(None, overrides), micro_batch)


def test_medians_skip_the_warm_up_step():
    records = [{"step_s": 9.0, "generation_s": 5.0, "update_s": 4.0}] + [
        {"step_s": s, "generation_s": 1.0, "update_s": s - 1.0} for s in (2.0, 3.0, 7.0)
    ]
    assert step.summarise({"steps": records}) == {"step_s": 3.0, "generation_s": 1.0, "update_s": 2.0}
    assert step.summarise({"steps": records[:1]})["step_s"] == 9.0


@pytest.mark.parametrize("extra, message", [
    (["algo.aggregation=token_sum"], "aggregation"),
    (["--vs", "trl", "algo.advantage=rloo"], "no TRL equivalent for: algo.advantage=rloo"),
])
def test_bad_settings_stop_before_any_row_runs(extra, message, tiny_dir, capsys, monkeypatch):
    monkeypatch.setattr(step, "in_fresh_process", lambda *a, **k: pytest.fail("a row ran"))
    assert step.main(["--model", str(tiny_dir), *extra]) == 2
    assert message in capsys.readouterr().err
