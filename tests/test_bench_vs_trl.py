"""`deployrl bench vs-trl`: the wall clock that keeps adapters, the statistics, and the whole
experiment end to end at a toy budget on a tiny random model (runs and scores in this process).
No timing is asserted: a run does what its wall clock lets it on whatever machine runs it."""

import importlib
import json

import pytest

from deployrl.commands.bench import step, vs_trl

SMALL = [
    "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=4", "rollout.context_length=256",
    "task.size=16", "algo.ps.budget=2",
]


def test_the_adapter_kept_at_a_mark_is_the_newest_finished_by_it(tmp_path):
    """Steps of 4, 8, 3 and 10 s end at 4, 12, 15 and 25 s on the run's clock (saving takes 1 s, not
    charged): the adapter kept at 10 s is the one after step 1, at 20 s the one after step 3, and the
    budget is spent after step 4."""
    now, adapter, kept = [0.0], {"version": 0}, {}

    def save(version, folder):
        kept[folder.name] = version
        now[0] += 1.0

    keeper = vs_trl.Keeper(tmp_path, [10.0, 20.0], lambda: adapter["version"], save, clock=lambda: now[0])
    done = []
    for version, seconds in zip((1, 2, 3, 4), (4.0, 8.0, 3.0, 10.0)):
        keeper.before_step()
        now[0] += seconds
        adapter["version"] = version  # the step trains
        done.append(keeper.after_step({"step_s": seconds}))
    assert kept == {"10s": 1, "20s": 3}
    assert done == [False, False, False, True]
    steps = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [s["elapsed_s"] for s in steps] == [4, 12, 15, 25]


def test_marks_end_at_the_budget():
    assert vs_trl.VsTrlConfig(budget_min=12, keep_every_min=3).marks == [180, 360, 540, 720]
    assert vs_trl.VsTrlConfig(budget_min=10, keep_every_min=3).marks == [180, 360, 540, 600]
    assert vs_trl.VsTrlConfig(budget_min=2, keep_every_min=5).marks == [120]


def test_the_interval_is_students_t_by_hand():
    mean, half = vs_trl.interval([0.2, 0.4, 0.6])
    # s = 0.2, t(0.975, 2 degrees of freedom) = 4.302653
    assert mean == pytest.approx(0.4) and half == pytest.approx(4.302653 * 0.2 / 3 ** 0.5, rel=1e-6)
    assert vs_trl.interval([0.5])[1] != vs_trl.interval([0.5])[1]  # nan: no interval from one seed


def test_the_first_task_alone_runs_the_engine_arm():
    config = vs_trl.VsTrlConfig(seeds=(0, 1), tasks=("arithmetic", "arithmetic3"))
    runs = config.runs()
    assert ("arithmetic", "deployrl_hf", 1) in runs and ("arithmetic3", "deployrl_hf", 0) not in runs
    assert runs[:5] == [("arithmetic", "trl", 0), ("arithmetic", "deployrl", 0), ("arithmetic", "deployrl_hf", 0),
                        ("arithmetic3", "trl", 0), ("arithmetic3", "deployrl", 0)]


@pytest.mark.parametrize("argv, message", [
    (["--arms", "trl,verl"], "verl"),
    (["--tasks", "gsm9k"], "gsm9k"),
    (["--eval-engines", "llamacpp:q4_1,nosuch:x"], "nosuch"),
    (["algo.aggregation=token_sum"], "aggregation"),
    (["--model", "missing.gguf"], "missing.gguf"),
])
def test_bad_settings_stop_before_anything_runs(argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(vs_trl, "in_fresh_process", lambda *a, **k: pytest.fail("something ran"))
    try:
        code = vs_trl.main(["--out", str(tmp_path / "out"), *argv])
    except SystemExit as stop:  # a bad flag value stops in the command line's parser
        code = stop.code
    assert code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_experiment_runs_end_to_end_resumes_and_reports(tiny_gguf, tmp_path, monkeypatch, capsys):
    pytest.importorskip("trl", reason="TRL is not installed: pip install 'deployrl[bench]'")
    calls = []

    def in_this_process(function, kwargs, timeout=None):
        module, name = function.split(":")
        calls.append(name)
        return getattr(importlib.import_module(module), name)(**kwargs)

    monkeypatch.setattr(vs_trl, "in_fresh_process", in_this_process)
    monkeypatch.setattr(step, "in_fresh_process", in_this_process)
    out = tmp_path / "out"
    argv = ["--model", str(tiny_gguf), "--cache-dir", str(tmp_path / "cache"), "--out", str(out),
            "--budget-min", "0.1", "--keep-every-min", "0.05", "--seeds", "0", "--tasks", "arithmetic",
            "--eval-problems", "2", "--eval-samples", "2", "--trl-micro-batch", "4", "rollout.threads=1", *SMALL]
    assert vs_trl.main(argv) == 0
    for arm in vs_trl.ARMS:
        run_dir = out / "arithmetic" / arm / "seed0"
        summary = json.loads((run_dir / "run.json").read_text())
        steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
        assert summary["steps"] == len(steps) >= 1 and summary["marks"] == [3, 6], arm
        assert steps[-1]["elapsed_s"] >= 6 and all(s["elapsed_s"] < 6 for s in steps[:-1]), arm
        for record in steps:
            parts = record["generation_s"] + record["update_s"] + record["sync_s"]
            assert parts == pytest.approx(record["step_s"]) and record["generation_s"] > 0, arm
        for mark in ("3s", "6s"):
            assert (run_dir / "adapters" / mark / "adapter_config.json").is_file(), (arm, mark)
            for engine in ("llamacpp_q4_1", "hf_fp32"):
                scored = json.loads((run_dir / "eval" / engine / f"{mark}.json").read_text())
                assert scored["problems"] == 2 and 0 <= scored["pass@1"] <= 1, (arm, mark, engine)
    assert (out / "arithmetic" / "base" / "seed0" / "eval" / "llamacpp_q4_1" / "0s.json").is_file()
    report = (out / "report.md").read_text()
    for label, *_ in vs_trl.ARMS.values():
        assert label in report
    assert "difference from TRL in llamacpp:q4_1" in report and (out / "plots" / "arithmetic.png").stat().st_size
    assert set(json.loads((out / "results.json").read_text())["results"]["arithmetic"]) == set(vs_trl.ARMS)

    calls.clear()  # a second call finds everything done
    assert vs_trl.main(argv) == 0
    assert calls == []
    # a run interrupted before its run.json starts over, and only its scores are redone
    (out / "arithmetic" / "deployrl" / "seed0" / "run.json").unlink()
    assert vs_trl.main(argv) == 0
    assert calls == ["train_run", "score"]  # one process scores a run's every adapter in every engine
    # a score missing in one engine is redone in that engine alone: the other's file is not rewritten
    trl_eval = out / "arithmetic" / "trl" / "seed0" / "eval"
    (trl_eval / "hf_fp32" / "6s.json").unlink()
    kept = {f: f.stat().st_mtime_ns for f in trl_eval.glob("*/*.json")}
    calls.clear()
    assert vs_trl.main(argv) == 0
    assert calls == ["score"] and (trl_eval / "hf_fp32" / "6s.json").is_file()
    assert {f: f.stat().st_mtime_ns for f in kept} == kept
