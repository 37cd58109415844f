"""The run directory's logs: metrics.jsonl, samples.jsonl, config, TensorBoard, plots, resume."""

import io
import json
import math

import pytest
import torch
import yaml

from deployrl.training.runlog import RunLogger, format_postfix, plot_metrics, progress, read_jsonl, run_summary

CONFIG = {"model": {"name": "tiny"}, "steps": 4, "betas": (0.9, 0.95)}


def metrics(step: int) -> dict:
    return {
        "reward/mean": 0.1 * step, "reward/failures": 0.0, "dc/mean_D": 0.02 / step, "dc/tolerance": 0.01,
        "dc/max_delta": 0.3, "dc/lambda": 0.5 * step, "ps/tokens_kept": 40.0 + step, "ps/tokens_total": 100.0,
        "time/step": 1.5, "time/rollout": 1.0,
    }


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_metrics_samples_config_and_tensorboard(tmp_path):
    with RunLogger(tmp_path / "run", CONFIG, tensorboard=True) as logger:
        logger.log(1, {"reward/mean": 0.5, "dc/mean_D": torch.tensor(0.25), "bad": float("nan"), "inf": math.inf})
        logger.log(2, {"reward/mean": 1})
        logger.log_samples(1, [{"prompt": "1+1=", "completion": "2", "reward": 1.0},
                               {"prompt": "2+2=", "completion": "5", "reward": float("nan")}])
    run = tmp_path / "run"
    assert lines(run / "metrics.jsonl") == [
        {"step": 1, "reward/mean": 0.5, "dc/mean_D": 0.25, "bad": None, "inf": None},
        {"step": 2, "reward/mean": 1.0},
    ]
    assert lines(run / "samples.jsonl") == [
        {"step": 1, "prompt": "1+1=", "completion": "2", "reward": 1.0},
        {"step": 1, "prompt": "2+2=", "completion": "5", "reward": None},
    ]
    assert yaml.safe_load((run / "config.yaml").read_text()) == {**CONFIG, "betas": [0.9, 0.95]}
    events = list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0
    with RunLogger(tmp_path / "other", CONFIG, tensorboard=False) as logger:
        with pytest.raises(TypeError, match="metric 'x' must be a number"):
            logger.log(1, {"x": "text"})
    assert (tmp_path / "other" / "metrics.jsonl").read_text() == ""


def test_refuses_to_overwrite_a_run(tmp_path):
    with RunLogger(tmp_path, CONFIG, tensorboard=False) as logger:
        logger.log(1, {"reward": 1.0})
    with pytest.raises(FileExistsError, match="already holds metrics.jsonl.*resume"):
        RunLogger(tmp_path, CONFIG, tensorboard=False)
    assert len(lines(tmp_path / "metrics.jsonl")) == 1
    (tmp_path / "metrics.jsonl").unlink()
    (tmp_path / "checkpoints" / "step_00000001").mkdir(parents=True)
    with pytest.raises(FileExistsError, match="checkpoints/"):
        RunLogger(tmp_path, CONFIG, tensorboard=False)


def test_resume_truncates_past_the_resumed_step(tmp_path):
    with RunLogger(tmp_path, CONFIG, tensorboard=True) as logger:
        for step in (1, 2, 3, 4):
            logger.log(step, {"reward": float(step)})
            logger.log_samples(step, [{"completion": str(step)}])
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "rew')  # a crash mid-line
    with pytest.warns(RuntimeWarning, match="torn last line"):
        logger = RunLogger(tmp_path, {**CONFIG, "steps": 8}, tensorboard=True, resume=True)
        logger.truncate_after(2)
    with logger:
        for step in (3, 4, 5):
            logger.log(step, {"reward": 10.0 * step})
    assert [(r["step"], r["reward"]) for r in lines(tmp_path / "metrics.jsonl")] == [
        (1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0), (5, 50.0)]
    assert [r["step"] for r in lines(tmp_path / "samples.jsonl")] == [1, 2]
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["steps"] == 8
    assert yaml.safe_load((tmp_path / "config.before-resume-1.yaml").read_text())["steps"] == 4
    # resume_step does the same at construction
    with RunLogger(tmp_path, {**CONFIG, "steps": 8}, tensorboard=False, resume=True, resume_step=1):
        pass
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1]
    assert not (tmp_path / "config.before-resume-2.yaml").exists()  # same config: nothing kept


def test_plots(tmp_path):
    with RunLogger(tmp_path, CONFIG, tensorboard=False) as logger:
        assert logger.plot() == []  # nothing logged yet
        for step in range(1, 6):
            logger.log(step, metrics(step))
        logger.log(6, {"reward/mean": float("nan")})
        written = logger.plot()
    names = sorted(p.name for p in written)
    assert names == ["discrepancy.png", "lambda.png", "reward.png", "step_time.png", "tokens.png"]
    for path in written:
        assert path.parent == tmp_path / "plots" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in plot_metrics(tmp_path, ["dc/lambda", "missing/key"])] == ["dc_lambda.png"]
    # missing groups are skipped silently
    other = tmp_path / "other"
    with RunLogger(other, CONFIG, tensorboard=False) as logger:
        logger.log(1, {"dc/lambda": 0.1})
        assert [p.name for p in logger.plot()] == ["lambda.png"]


def test_progress_and_postfix():
    assert format_postfix(metrics(2)) == {"reward": "0.2", "δ": "0.01", "λ": "1", "s/step": "1.5"}
    assert format_postfix({"reward/failures": 3.0, "dc/mean_D": None}) == {}
    out = io.StringIO()
    bar = progress(10, initial=4, file=out)
    bar.update(1)
    bar.set_postfix(format_postfix(metrics(1)))
    bar.close()
    assert bar.n == 5 and bar.total == 10
    assert "5/10" in out.getvalue() and "λ=0.5" in out.getvalue()


def test_run_summary_shows_what_the_run_bought():
    rows = [{"step": 0, "eval/pass@1": 0.2, "eval/pass@1_se": 0.03, "eval/avg@2": 0.2, "eval/problems": 64.0}]
    rows += [{"step": s, "reward/mean": 0.1 * s, "dc/mean_D": 0.01 + 0.001 * s, "dc/tolerance": 0.0125,
              "dc/lambda": 0.25 * s} for s in range(1, 9)]
    rows.append({"step": 8, "eval/pass@1": 0.4, "eval/pass@1_se": 0.04, "eval/avg@2": 0.4, "eval/problems": 64.0})
    lines = run_summary(rows, "llamacpp:q4_1")
    # rise 0.2 over sqrt(0.03^2 + 0.04^2) = 0.05: 4 standard errors
    assert lines[0] == ("eval pass@1 in llamacpp:q4_1 (64 problems × 2): 0.200 ± 0.030 at step 0"
                        " → 0.400 ± 0.040 at step 8: +0.200 (+4.0 s.e.)")
    assert lines[1] == "training reward (engine samples): 0.150 over steps 1–2 → 0.750 over steps 7–8"
    # D exceeds c = 0.0125 from step 3 (0.013): 6 of 8 steps
    assert lines[2] == ("discrepancy δ: 0.0110 at step 1 → 0.0180 at step 8; tolerance c 0.0125,"
                        " exceeded at 6 of 8 steps; λ 2.00 at the end")
    assert run_summary([], "hf:fp32") == []
