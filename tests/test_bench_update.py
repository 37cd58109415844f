"""`deployrl bench update` end to end on the tiny random model: the table, the JSON, the batch.

No timing assertions: only the structure of the output and the token counts, which are exact.
About 15 s on 2 busy cores (one fresh process).
"""

import json

import pytest
import torch

from deployrl.commands.bench import update
from deployrl.commands.bench.measure import in_fresh_process
from deployrl.commands.bench.update import Settings
from deployrl.settings.config import TrainConfig
from deployrl.settings.parsing import build


def table_rows(text: str) -> dict[tuple[int, str], dict[str, str]]:
    """The markdown table of the output as {(T_max, method): {header: cell}}."""
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    headers = [h.strip() for h in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[1:]:
        cells = dict(zip(headers, (c.strip() for c in line.strip("|").split("|"))))
        rows[(int(cells["T_max"]), cells["method"])] = cells
    return rows


def test_update_benchmark_prints_a_row_per_length_and_method(tiny_dir, tmp_path, capsys):
    out_json = tmp_path / "update.json"
    methods = ["grpo", "dapo", "ps:temporal", "ps:temporal:engine"]
    code = update.main([
        "--model", str(tiny_dir), "--layers", "0", "--t-max", "32", "64", "--budget", "8", "--prompt-tokens", "4",
        "--repeats", "1", "--threads", "1", "--same-process", "--methods", *methods, "--json", str(out_json),
    ])
    assert code == 0
    rows = table_rows(capsys.readouterr().out)
    assert set(rows) == {(t, m) for t in (32, 64) for m in methods}
    for t_max in (32, 64):
        grpo = rows[(t_max, "grpo")]
        assert grpo["speed-up vs grpo"] == "1" and grpo["memory vs grpo"] == "1"
        assert int(grpo["tokens backprop"]) == int(grpo["tokens total"])  # full trajectories
        assert grpo["expected backprop"] == grpo["tokens total"]
        ps = rows[(t_max, "ps:temporal")]
        assert int(ps["tokens backprop"]) < int(grpo["tokens backprop"])
        assert int(ps["expected backprop"]) <= 4 * 8  # K x B
        assert {rows[(t_max, m)]["tokens total"] for m in methods} == {grpo["tokens total"]}  # one batch
        prefix_only = rows[(t_max, "ps:temporal:engine")]
        assert prefix_only["tokens backprop"] == ps["tokens backprop"]  # the same law and draw
        assert float(prefix_only["ideal"]) > float(ps["ideal"]) > 1  # and no no-grad pass over every token
    saved = json.loads(out_json.read_text())
    assert saved["settings"]["budget"] == 8 and saved["methods"] == methods
    assert len(saved["measurements"]) == 8
    for m in saved["measurements"]:
        stages = ("old_pass_s", "plan_s", "measure_s", "graded_s", "optimizer_s")
        # the stages cover the phase; between their clocks only a few Python statements run
        assert m["seconds"] == pytest.approx(sum(m[k] for k in stages), abs=1e-3)
        assert m["threads"] == 1
        fused = m["method"] == "ps:temporal:engine"  # one epoch: no no-grad pass at all
        assert (m["old_pass_tokens"] == 0) == fused and (m["old_pass_tokens"] > m["tokens_total"]) != fused


def test_measure_one_runs_in_a_fresh_process(tiny_dir):
    settings = Settings(budget=8, prompt_tokens=4, threads=1)
    result = in_fresh_process("deployrl.commands.bench.update:measure_one", {
        "model_dir": str(tiny_dir), "method": "ps:optimized", "t_max": 48, "settings": vars(settings),
        "repeat": 1,
    })
    assert (result["method"], result["repeat"], result["threads"]) == ("ps:optimized", 1, 1)
    assert result["tokens_graded"] <= result["tokens_total"]  # a draw may keep no token at all
    assert result["tokens_expected"] == pytest.approx(4 * 8)  # K x B, the budget binds
    assert result["peak_bytes"] >= 0 and result["micro_batches"] <= 1


def test_synthetic_batch_is_seeded_and_every_group_has_both_rewards():
    settings = Settings(groups=3, group_size=4, prompt_tokens=5)
    a = update.synthetic_rollouts(["e0", "e1", "e2", "e3"], 100, 40, settings)
    b = update.synthetic_rollouts(["e0", "e1", "e2", "e3"], 100, 40, settings)
    assert torch.equal(a.batch.completion_ids, b.batch.completion_ids) and torch.equal(a.rewards, b.rewards)
    lengths = a.batch.lengths
    assert lengths.min() >= 20 and lengths.max() <= 40
    assert a.rewards.shape == (3, 4) and (a.rewards.sum(dim=1) == 2).all()
    assert a.batch.prompt_ids[0] == a.batch.prompt_ids[3] != a.batch.prompt_ids[4]  # group-major rows
    assert a.examples == ["e0", "e1", "e2"]
    assert ((a.batch.logp_inf <= 0) & (a.batch.logp_inf >= -3)).all()
    assert (a.batch.logp_inf[~a.batch.mask] == 0).all() and (a.batch.completion_ids[~a.batch.mask] == 0).all()


@pytest.mark.parametrize("t_max", update.T_MAX)
def test_every_method_validates_at_the_default_lengths(t_max):
    settings = Settings()
    for method in update.METHODS:
        config = build(TrainConfig, update.nest(update.config_overrides("model-dir", method, t_max, settings, "out")))
        assert config.algo.correction == "none" and config.rollout.max_new_tokens == t_max
        assert config.algo.ps.xi_min * t_max <= settings.budget / 2


def test_prepare_model_keeps_the_first_layers(tiny_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    info = update.prepare_model(str(tiny_dir), 1, str(tmp_path / "model"))
    assert (info["layers"], info["of_layers"]) == (1, 2)
    original = AutoModelForCausalLM.from_pretrained(tiny_dir)
    truncated = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert len(truncated.model.layers) == 1
    assert torch.equal(truncated.model.layers[0].mlp.up_proj.weight, original.model.layers[0].mlp.up_proj.weight)
    with pytest.raises(ValueError, match="only 2 decoder layers"):
        update.prepare_model(str(tiny_dir), 3, str(tmp_path / "too-many"))


def test_draws_far_from_the_expected_tokens_are_noted():
    def result(method, kept, expected):
        return {"t_max": 512, "method": method, "tokens_graded": kept, "tokens_expected": expected}

    results = [result("ps:optimized", 0.0, 512.0), result("ps:uniform", 600.0, 512.0), result("grpo", 1600.0, 1600.0)]
    notes = update.draw_notes(results, ["grpo", "ps:uniform", "ps:optimized"], [512])
    assert len(notes) == 1 and "ps:optimized at T_max 512 backpropagated 0 tokens" in notes[0]
