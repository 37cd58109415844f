"""experiments/run.py on a tiny experiment: every arm trains, the report compares them."""

import importlib.util
from pathlib import Path

import yaml

RUNNER = Path(__file__).resolve().parents[1] / "experiments" / "run.py"


def load_runner():
    spec = importlib.util.spec_from_file_location("experiment_runner", RUNNER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shipped_experiments_are_valid_configs():
    from deployrl.settings.config import load_config

    runner = load_runner()
    for name in ("mismatch", "ps_accuracy"):
        spec = runner.load_experiment(name)
        for arm in spec["arms"].values():
            load_config(spec["base"], arm["overrides"])


def test_runner_trains_each_arm_once_and_reports(tmp_path, tiny_dir, capsys, monkeypatch):
    from tiny import toy_task_file

    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))  # arms import the toy reward from tests/

    folder = tmp_path / "toy"
    folder.mkdir()
    base = {
        "model": {"name": str(tiny_dir)},
        "task": {"type": "jsonl", "path": str(toy_task_file(tmp_path)), "reward": "tiny:starts_with_digit",
                 "instruction": ""},
        "rollout": {"engine": "hf:fp32", "prompts_per_step": 2, "group_size": 4, "max_new_tokens": 6,
                    "context_length": 64},
        "algo": {"dynamic_sampling": "off", "ps": {"budget": 3, "xi_min": 0.05}},
        "eval": {"every": 1, "before_training": True, "num_prompts": 2},
        "tensorboard": False,
    }
    (folder / "base.yaml").write_text(yaml.safe_dump(base))
    (folder / "arms.yaml").write_text(yaml.safe_dump({
        "steps": 2,
        "arms": {"full": {"about": "everything", "overrides": ["algo.ps.strategy=full", "algo.correction=none"]},
                 "ps": {"about": "prefixes", "overrides": ["algo.ps.strategy=uniform"]}},
        "plots": {"toy": ["full", "ps"]},
    }))
    runner = load_runner()
    out = tmp_path / "runs"
    assert runner.main([str(folder), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| full | everything |" in printed and "| ps | prefixes |" in printed
    assert (out / "report.md").exists() and (out / "plots" / "toy.png").exists()
    assert runner.finished(out / "full", 2) and runner.finished(out / "ps", 2)
    runner.main([str(folder), "--out", str(out)])
    assert capsys.readouterr().out.count("already finished, skipped") == 2
    stopped = out / "full" / "seed1"  # a run stopped before its first checkpoint: logs, no checkpoint
    stopped.mkdir(parents=True)
    (stopped / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
    assert runner.main([str(folder), "--out", str(out), "--seeds", "0", "1", "--baseline", "full"]) == 0
    printed = capsys.readouterr().out
    assert (out / "full" / "seed1" / "metrics.jsonl").exists() and (out / "plots" / "seeds.png").exists()
    assert (out / "plots" / "toy_seeds.png").exists()  # D per step by seed beside the end scores
    ps_row = next(line for line in printed.splitlines() if line.startswith("| ps |"))
    cells = [cell.strip() for cell in ps_row.strip("|").split("|")]
    assert cells[2] == "0, 1" and " ± " in cells[4]  # the mean and 95% interval over the two seeds
    ends = {arm: [dict(zip(*runner.series(runner.read_metrics(out / arm / f"seed{seed}"), "eval/pass@1")))[2]
                  for seed in (0, 1)] for arm in ("full", "ps")}
    paired = [a - b for a, b in zip(ends["ps"], ends["full"])]
    assert cells[5].startswith(f"{sum(paired) / 2:.3f} ± ")  # the paired difference, seed by seed

    def at_equal_time(arm: str, seed: int) -> float:  # by hand: the last eval within the fastest arm's total time
        def rows(name):
            return runner.read_metrics(out / name / f"seed{seed}")

        def total(name):
            return sum(r["time/step"] for r in rows(name) if "time/step" in r)

        limit = min(total("full"), total("ps"))
        made = [r for r in rows(arm) if "eval/pass@1" in r
                and sum(q["time/step"] for q in rows(arm) if "time/step" in q and q["step"] <= r["step"]) <= limit]
        return made[-1]["eval/pass@1"]

    timed = [at_equal_time("ps", seed) for seed in (0, 1)]
    paired = [a - at_equal_time("full", seed) for seed, a in zip((0, 1), timed)]
    assert cells[6].startswith(f"{sum(timed) / 2:.3f} ± ") and cells[7].startswith(f"{sum(paired) / 2:.3f} ± ")
