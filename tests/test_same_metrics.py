"""Refactors keep behaviour: fixed-seed 3-step runs give the metrics recorded before them.

tests/data/learn_metrics.json holds every step's metrics of the VARIANTS below, recorded at
2ed8105 (before the learn phase was restructured, issue 28) with

    python tests/test_same_metrics.py --write

The run is the tiny random model sampled by the fp32 HF engine, so sampling is the same on any
x86 CPU (a token flips only if a uniform draw lands within float32 rounding of a CDF boundary).
An fp32 engine agrees with the fp32 trainer to rounding (delta ~ 1e-7, which differs by CPU), so
the engine's logp_inf is perturbed by fixed noise (0.1 nats per token): delta ~ 1e-2, and the
corrections, lambda and the tolerance do real work.
Counts must match exactly; float metrics to a relative 1e-4: fp32 sums over a few hundred terms
in another order (another kernel, another CPU) differ by ~1e-6 relative, and three Adam steps
with lr 0.01 on a 2-layer model do not amplify that by 100.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from deployrl.training.trainer import Trainer

GOLDEN = Path(__file__).parent / "data" / "learn_metrics.json"
COMMON = ("rollout.engine=hf:fp32", "algo.dynamic_sampling=drop")
VARIANTS = {
    # the embedded default's algorithm: DC (c from the first batch), optimized law from the engine's proxies
    "default": (),
    # a binding tolerance (lambda rises from its first step), hinge penalty, 2 epochs x 2 mini-batches
    "dc_binding_epochs": ("algo.dc.tolerance=0.005", "algo.dc.lam_init=0.5", "algo.dc.penalty=hinge",
                          "algo.ppo_epochs=2", "algo.mini_batches=2", "algo.micro_batch_tokens=16"),
    # truncated IS, 2 epochs, the trainer's proxies first (a no-grad pass over every token), KL on
    "tis_epochs_trainer": ("algo.correction=tis", "algo.ppo_epochs=2", "algo.ps.proxies=trainer",
                           "algo.kl_coef=0.05"),
}
EXACT = ("ps/tokens_kept", "ps/tokens_total", "ps/tokens_graded", "optim/updates", "optim/skipped_updates",
         "ps/micro_batches", "reward/mean")


def run_variant(tmp_path: Path, tiny_dir: Path, variant: str) -> list[dict[str, float]]:
    from test_trainer import toy_config

    trainer = Trainer(toy_config(tmp_path / variant, tiny_dir, *COMMON, *VARIANTS[variant]))
    collect = trainer.rollout.collect

    def perturbed(stream, step):
        rollouts = collect(stream, step)
        batch = rollouts.batch
        noise = torch.randn(batch.logp_inf.shape, generator=torch.Generator().manual_seed(step))
        batch.logp_inf = torch.where(batch.mask, batch.logp_inf + 0.1 * noise, batch.logp_inf)
        return rollouts

    trainer.rollout.collect = perturbed
    return [{k: v for k, v in m.items() if not is_speed(k)} for m in trainer.run()]


def is_speed(key: str) -> bool:
    """Seconds and rates: the machine's, not the algorithm's."""
    return key.startswith("time/") or key.endswith("per_s")


@pytest.mark.parametrize("variant", VARIANTS)
def test_metrics_as_recorded_before_the_refactor(variant, tmp_path, tiny_dir):
    golden = json.loads(GOLDEN.read_text())[variant]
    history = run_variant(tmp_path, tiny_dir, variant)
    assert len(history) == len(golden)
    for step, (got, want) in enumerate(zip(history, golden), start=1):
        for key, value in want.items():
            if is_speed(key):
                continue
            assert key in got, f"step {step}: metric {key} is gone"
            if value is None or (isinstance(value, float) and math.isnan(value)):
                assert math.isnan(got[key]), f"step {step} {key}: {got[key]} (recorded NaN)"
            elif key in EXACT:
                assert got[key] == value, f"step {step} {key}: {got[key]} != {value}"
            else:
                assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), f"step {step} {key}"


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    import tempfile

    from tiny import save_tiny

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        tiny = save_tiny(Path(tmp) / "tiny")
        record = {name: run_variant(Path(tmp), tiny, name) for name in VARIANTS}
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
