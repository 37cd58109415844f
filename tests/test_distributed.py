"""Multi-process training: 2 ranks on CPU (gloo, FSDP2), launched by torchrun, against 1 process.

Sampling is seeded per prompt and every decision is taken on the gathered batch, so a 2-rank run
must reproduce the 1-process run (weights within fp32 summation-order noise), whatever the
algorithm, and a checkpoint must resume on either number of ranks.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from deployrl.checkpoint import latest_checkpoint

TESTS = Path(__file__).resolve().parent
# the variants cover GRPO, DC-GRPO with PS-PPO's optimized law, and several PPO epochs and
# mini-batches in micro-batches of 16 tokens (ranks with fewer micro-batches run fillers). Losses
# and gradient norms agree to within 1e-3 relative (checked), but Adam turns summation-order noise
# in gradients near zero into weight differences of up to lr * noise / eps: measured 1e-5 after 3
# steps of one update each and 1.3e-3 with four updates per step (lr = 0.01; a group's prompt,
# computed once per rank that holds rows of it, sums its gradient in another order on 2 ranks).
# That is still far below one update in the wrong direction (2 lr). Gradient norms are compared
# too: Adam would hide a gradient scaled by the number of ranks.
VARIANTS = {"grpo": 5e-5, "dc_optimized": 5e-5, "dc_heuristic_epochs": 4e-3}  # variant: weight tolerance
COMMON = ["rollout.engine=hf:fp32"]  # fp32 sampling: a batch's shape cannot flip a draw


def launch(ranks: int, root: Path, tiny_dir: Path, variants: list[str], *overrides: str, resume: bool = False,
           fail_rank=None, timeout: float = 600) -> subprocess.CompletedProcess:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
        str(TESTS / "distributed_worker.py"),
        *(["--resume"] if resume else []), *([f"--fail-rank={fail_rank}"] if fail_rank is not None else []),
        str(tiny_dir), str(root), ",".join(variants), "--", *COMMON, *overrides,
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)


def finished(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result


def ranks_log(root: Path, rank: int) -> dict:
    return json.loads((root / f"rank{rank}.json").read_text())


def assert_same_weights(a: Path, b: Path, atol: float = 1e-5) -> None:
    left, right = load_file(a / "weights.safetensors"), load_file(b / "weights.safetensors")
    assert set(left) == set(right)
    for key in left:
        torch.testing.assert_close(left[key], right[key], atol=atol, rtol=0, msg=key)


@pytest.fixture(scope="module")
def one_and_two(tmp_path_factory, tiny_dir):
    """Three steps of each variant, on 1 rank and on 2."""
    roots = {n: tmp_path_factory.mktemp(f"ranks{n}") for n in (1, 2)}
    for n, root in roots.items():
        finished(launch(n, root, tiny_dir, list(VARIANTS), "steps=3"))
    return roots


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_two_ranks_train_as_one_process(one_and_two, variant):
    one, two = one_and_two[1] / variant, one_and_two[2] / variant
    single, double = ranks_log(one, 0), ranks_log(two, 0)
    assert double["reward"] == single["reward"]  # the same completions were sampled
    # abs: a loss summed from terms of both signs can be near 0 (the epochs variant's ~7e-3 differed by 1.2e-5)
    assert double["loss"][0] == pytest.approx(single["loss"][0], rel=1e-3, abs=5e-5)
    assert double["grad_norm"][0] == pytest.approx(single["grad_norm"][0], rel=1e-3)
    assert double["loss"] == pytest.approx(single["loss"], rel=1e-2, abs=1e-4)
    assert_same_weights(one, two, atol=VARIANTS[variant])


@pytest.mark.slow
def test_one_engine_on_rank_0_trains_as_one_process(one_and_two, tmp_path, tiny_dir):
    finished(launch(2, tmp_path, tiny_dir, ["grpo"], "steps=3", "rollout.engine_ranks=main"))
    assert ranks_log(tmp_path / "grpo", 0)["reward"] == ranks_log(one_and_two[1] / "grpo", 0)["reward"]
    assert_same_weights(one_and_two[1] / "grpo", tmp_path / "grpo")


@pytest.mark.slow
def test_lambda_is_the_same_on_every_rank(tmp_path, tiny_dir):
    # a bf16 engine and c below its discrepancy, so that λ moves
    finished(launch(2, tmp_path, tiny_dir, ["dc_optimized"], "steps=4", "rollout.engine=hf:bf16",
                    "algo.dc.relative_tolerance=0.5"))
    lam = [ranks_log(tmp_path / "dc_optimized", r)["lambda"] for r in (0, 1)]
    assert lam[0] == lam[1] and lam[0][-1] > 0  # the dual step ran, identically


@pytest.mark.slow
@pytest.mark.parametrize("first,second", [(2, 1), (1, 2)])
def test_checkpoint_resumes_on_another_number_of_ranks(one_and_two, tmp_path, tiny_dir, first, second):
    variant = "dc_optimized"
    finished(launch(first, tmp_path, tiny_dir, [variant], "steps=2", "save_every=2"))
    saved = latest_checkpoint(tmp_path / variant / "run")
    assert saved.name == "step_00000002"
    # several ranks write one shard file each (resharded on load); one process writes whole tensors
    assert len(list((saved / "shards").glob("*.safetensors"))) == (2 if first == 2 else 0)
    finished(launch(second, tmp_path, tiny_dir, [variant], "steps=3", "save_every=2", resume=True))
    straight = one_and_two[1] / variant  # the uninterrupted 3-step run
    assert ranks_log(tmp_path / variant, 0)["loss"] == pytest.approx(ranks_log(straight, 0)["loss"][2:], rel=1e-4)
    assert_same_weights(straight, tmp_path / variant)


@pytest.mark.slow
def test_a_failing_rank_stops_the_job_with_its_error(tmp_path, tiny_dir):
    start = time.monotonic()
    result = launch(2, tmp_path, tiny_dir, ["grpo"], "steps=3", fail_rank=1, timeout=300)
    assert result.returncode != 0
    assert "injected failure on rank 1" in result.stdout + result.stderr
    assert time.monotonic() - start < 300  # stopped, not hung until the collective's timeout
