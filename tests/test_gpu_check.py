"""The prepared GPU check (scripts/gpu_check.py) goes through every stage on the CPU (its dry run)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_gpu_checks_dry_run_goes_through_every_stage(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import gpu_check

    gpu_check.prepare(tmp_path / "prepared", wheels=False)  # math-verify is installed here
    out = tmp_path / "check.json"
    command = [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--device", "cpu", "--shape", "tiny",
               "--prepared", str(tmp_path / "prepared"), "--steps", "1", "--max-new-tokens", "8",
               "--t-max", "32", "64", "--skip", "tests", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, env=gpu_check.source_env())
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert [run["engine"] for run in report["train"]] == ["hf:bf16", "hf:fp8"]
    assert all(run["state_on_device"] and run["device"] == "cpu" and run["steps"] == 1 for run in report["train"])
    assert report["bench_update"]["returncode"] == 0 and set(report["bench_update"]["t_max"]) == {"32", "64"}
    assert report["installed_wheels"] == [] and report["seconds"]["total"] > 0


def test_asking_for_cuda_without_it_says_so(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    (tmp_path / "tokenizer").mkdir()
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--prepared", str(tmp_path)],
                          capture_output=True, text=True)
    assert done.returncode != 0 and "no CUDA device" in done.stderr
