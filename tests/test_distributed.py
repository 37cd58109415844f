"""Multi-process training: 2 ranks on CPU (gloo, FSDP2), launched by torchrun, against 1 process.

Sampling is seeded per prompt and every decision is taken on the gathered batch, so a 2-rank run
must reproduce the 1-process run (weights up to what Adam makes of fp32 summation-order noise:
`assert_trained_alike`), whatever the algorithm, and a checkpoint must resume on either number of
ranks.
"""

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from deployrl.settings.parsing import load_yaml
from deployrl.training.checkpoint import latest_checkpoint

TESTS = Path(__file__).resolve().parent
# the variants cover GRPO, DC-GRPO with PS-PPO's optimized law, and several PPO epochs and
# mini-batches in micro-batches of 16 tokens (ranks with fewer micro-batches run fillers), and the
# default prefix-only update (the law from the engine's statistics, logp_old from the graded pass;
# grpo runs it too, with every token kept). A group's
# prompt, computed once per rank that holds rows of it, sums its gradient in another order on 2 ranks.
# Losses and gradient norms agree to within 1e-3 relative; gradient norms are compared because Adam
# would hide a gradient scaled by the number of ranks.
VARIANTS = ["grpo", "dc_optimized", "dc_heuristic_epochs", "prefix_optimized_dc"]
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


def adam_step_bound(beta1: float, beta2: float, t: int) -> float:
    """The largest |m̂/√v̂| of Adam's t-th update over every sequence of gradients (Cauchy-Schwarz on
    the two bias-corrected averages): one update moves a weight by at most lr times this (1 at t = 1,
    where the update is lr * sign(g); 1.05 at t = 12 for betas (0.9, 0.99))."""
    m = [(1 - beta1) * beta1 ** (t - i) / (1 - beta1 ** t) for i in range(1, t + 1)]
    v = [(1 - beta2) * beta2 ** (t - i) / (1 - beta2 ** t) for i in range(1, t + 1)]
    return math.sqrt(sum(a * a / b for a, b in zip(m, v)))


def load_weights(a: Path, b: Path) -> tuple[dict, dict]:
    left, right = load_file(a / "weights.safetensors"), load_file(b / "weights.safetensors")
    assert set(left) == set(right)
    return left, right


def assert_trained_alike(a: Path, b: Path) -> None:
    """The weights of two runs of `a`'s configuration that differ only in the order of fp32 sums.

    No per-element tolerance can be taken from a measurement: Adam's update lr * m̂/(√v̂ + eps)
    normalises each element's gradient, so where the gradient is near zero, summation-order noise
    decides its sign (at the first update, lr * sign(g)) and the weight can move by up to 2 lr more
    in one run than in the other, on any CPU, for whichever elements land near zero there. What
    holds everywhere follows from the run's own optimizer settings: (1) every element within
    2 * lr * sum of adam_step_bound over the run's updates, the most two Adam runs can part (a
    sanity check only: NaN, a wrong lr or extra updates); (2) the bulk agreeing tightly: at most 1%
    of the elements differ by more than lr * updates / 100. Checked against rounding itself: these
    variants trained in fp32 (in any micro-batch order) ended with the median element 1e-4 of that
    threshold from the same training in float64 (the exact trajectory, which every summation order
    rounds) and none past it, while dropping one row's gradient or half the rows' (a missing
    reduction) put over 80% of the elements past it.
    """
    config = load_yaml(a / "run" / "config.yaml")
    optim, algo = config["optim"], config["algo"]
    assert optim["weight_decay"] == 0  # (1) counts Adam's steps only
    lr = optim["lr"]  # the schedule's peak: warmup and cosine only scale it down
    updates = config["steps"] * algo["ppo_epochs"] * algo["mini_batches"]
    reach = 2 * lr * sum(adam_step_bound(optim["beta1"], optim["beta2"], t) for t in range(1, updates + 1))
    left, right = load_weights(a, b)
    diffs = {key: (left[key] - right[key]).abs() for key in left}
    for key, diff in diffs.items():
        assert bool((diff <= reach).all()), f"{key}: max difference {diff.max():.3g} > {reach:.3g} (NaN?)"
    tight = lr * updates / 100
    every = torch.cat([diff.flatten() for diff in diffs.values()])
    apart = float((every > tight).double().mean())
    assert apart <= 0.01, f"{apart:.1%} of the weights differ by more than {tight:.3g} (median {every.median():.3g})"


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
    assert_trained_alike(one, two)


@pytest.mark.slow
def test_one_engine_on_rank_0_trains_as_one_process(one_and_two, tmp_path, tiny_dir):
    finished(launch(2, tmp_path, tiny_dir, ["grpo"], "steps=3", "rollout.engine_ranks=main"))
    main, everywhere, single = tmp_path / "grpo", one_and_two[2] / "grpo", one_and_two[1] / "grpo"
    assert ranks_log(main, 0)["reward"] == ranks_log(single, 0)["reward"]  # the same completions were sampled
    # Which rank samples changes nothing the trainer sees (GRPO reads no engine log-prob), and both
    # runs train on 2 ranks, summing in the same order: bit for bit the run with an engine on every
    # rank, which test_two_ranks_train_as_one_process compares with one process.
    log, other = ranks_log(main, 0), ranks_log(everywhere, 0)
    assert (log["loss"], log["grad_norm"]) == (other["loss"], other["grad_norm"])
    left, right = load_weights(main, everywhere)
    for key in left:
        assert torch.equal(left[key], right[key]), key
    assert_trained_alike(single, main)


@pytest.mark.slow
def test_one_engine_reports_its_statistics_to_every_rank(one_and_two, tmp_path, tiny_dir):
    """The cutoff law from the engine's statistics with the engine on rank 0 alone: the other ranks,
    which sample nothing, join the gathers of the statistics and train as one process does."""
    finished(launch(2, tmp_path, tiny_dir, ["prefix_optimized_dc"], "steps=2", "rollout.engine_ranks=main"))
    log, single = ranks_log(tmp_path / "prefix_optimized_dc", 0), ranks_log(one_and_two[1] / "prefix_optimized_dc", 0)
    assert log["reward"] == single["reward"][:2]  # the same completions were sampled
    assert log["loss"][0] == pytest.approx(single["loss"][0], rel=1e-3, abs=5e-5)


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
    assert_trained_alike(straight, tmp_path / variant)


@pytest.mark.slow
def test_a_failing_rank_stops_the_job_with_its_error(tmp_path, tiny_dir):
    start = time.monotonic()
    result = launch(2, tmp_path, tiny_dir, ["grpo"], "steps=3", fail_rank=1, timeout=300)
    assert result.returncode != 0
    assert "injected failure on rank 1" in result.stdout + result.stderr
    assert time.monotonic() - start < 300  # stopped, not hung until the collective's timeout


@pytest.mark.slow
def test_a_matched_trainer_on_two_ranks_trains_as_one_process(tmp_path, tiny_dir):
    """model.match_engine under FSDP2: each rank rounds the weights FSDP gathers for a layer's
    forward, so 2 ranks compute what 1 process computes on the engine's weights, and δ is the
    matched trainer's, far below the unmatched one's (the rounding did happen under FSDP). The
    engine on rank 0 alone samples the same completions in both runs."""
    fp8 = ["steps=2", "rollout.engine=hf:fp8", "rollout.engine_ranks=main"]
    runs = {"ranks1": (1, True), "ranks2": (2, True), "unmatched": (2, False)}
    for name, (ranks, matched) in runs.items():
        finished(launch(ranks, tmp_path / name, tiny_dir, ["dc_optimized"], *fp8,
                        f"model.match_engine={str(matched).lower()}"))
    single, double, unmatched = (tmp_path / name / "dc_optimized" for name in runs)
    one, two, other = (ranks_log(run, 0) for run in (single, double, unmatched))
    assert two["reward"] == one["reward"] and other["reward"][0] == one["reward"][0]  # step 1: the same completions
    assert two["delta"] == pytest.approx(one["delta"], rel=1e-3)
    assert two["delta"][0] < 0.75 * other["delta"][0]  # measured: 0.49 × (0.0074 against 0.0151)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-3)
    assert_trained_alike(single, double)


LORA = ["model.lora.rank=4", "model.lora.alpha=8", "optim.lr=0.05"]


@pytest.mark.slow
def test_lora_on_two_ranks_trains_as_one_process_and_resumes_on_one(tmp_path, tiny_dir):
    """FSDP2 shards the frozen base and the adapters alike; a checkpoint holds the gathered adapter."""
    for ranks in (1, 2):
        finished(launch(ranks, tmp_path / f"ranks{ranks}", tiny_dir, ["dc_optimized"], "steps=3", *LORA))
    single, double = tmp_path / "ranks1" / "dc_optimized", tmp_path / "ranks2" / "dc_optimized"
    assert ranks_log(double, 0)["reward"] == ranks_log(single, 0)["reward"]
    assert ranks_log(double, 0)["loss"] == pytest.approx(ranks_log(single, 0)["loss"], rel=1e-2, abs=1e-4)
    left, right = load_weights(single, double)
    assert all(torch.equal(left[k], right[k]) for k in left if ".lora_" not in k)  # the base stayed frozen
    assert_trained_alike(single, double)
    root = tmp_path / "resumed"
    finished(launch(2, root, tiny_dir, ["dc_optimized"], "steps=2", "save_every=2", *LORA))
    saved = latest_checkpoint(root / "dc_optimized" / "run")
    assert not (saved / "shards").exists() and (saved / "model" / "adapter_model.safetensors").is_file()
    finished(launch(1, root, tiny_dir, ["dc_optimized"], "steps=3", "save_every=2", *LORA, resume=True))
    assert ranks_log(root / "dc_optimized", 0)["loss"] == pytest.approx(ranks_log(single, 0)["loss"][2:], rel=1e-4)
    assert_trained_alike(single, root / "dc_optimized")


def test_one_process_leaves_a_process_group_it_did_not_start_alone(tmp_path):
    """In-process vLLM starts a one-rank group and destroys it at exit: deployrl closing it first
    made vLLM's teardown fail ("Invalid process group specified") after every vLLM run."""
    import torch.distributed as dist

    from deployrl.training.distributed import World, close_world

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        close_world(World())
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_the_engines_weights_are_gathered_whole_or_adapters_alone(tmp_path):
    """FSDP2 shards gathered one tensor at a time equal torch's gathered state dict; with
    `base=False` only the adapters are gathered; `to_main_only` leaves the other ranks nothing."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(TESTS / "gather_worker.py"), str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    finished(subprocess.run(command, env=env, capture_output=True, text=True, timeout=300))
    for rank in (0, 1):
        got = load_file(tmp_path / f"rank{rank}.safetensors")
        ways = {way: {k.split("/", 1)[1]: v for k, v in got.items() if k.startswith(way + "/")}
                for way in ("reference", "all", "main", "adapters", "adapters_main")}
        reference = ways["reference"]
        adapters = {k for k in reference if ".lora_" in k}
        assert adapters and len(adapters) < len(reference)
        assert set(ways["all"]) == set(reference) and set(ways["adapters"]) == adapters
        assert set(ways["main"]) == (set(reference) if rank == 0 else set())
        assert set(ways["adapters_main"]) == (adapters if rank == 0 else set())
        for way in ("all", "main", "adapters", "adapters_main"):
            assert all(torch.equal(value, reference[k]) for k, value in ways[way].items()), way
