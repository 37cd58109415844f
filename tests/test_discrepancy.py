import math

import pytest
import torch

from deployrl.algo.discrepancy import (
    discrepancy_estimate,
    discrepancy_summary,
    shape_advantages,
    token_discrepancy,
    trajectory_discrepancy,
)


def test_signals_hand_values():
    logp_old = torch.log(torch.tensor([[0.5, 0.2]]))
    logp_inf = torch.log(torch.tensor([[0.4, 0.25]]))
    mask = torch.tensor([[1, 1]])
    torch.testing.assert_close(token_discrepancy(logp_old, logp_inf, mask, "diff"), torch.tensor([[0.1, 0.05]]))
    torch.testing.assert_close(token_discrepancy(logp_old, logp_inf, mask, "ratio"), torch.tensor([[0.25, 0.2]]))
    torch.testing.assert_close(
        token_discrepancy(logp_old, logp_inf, mask, "log"),
        torch.tensor([[math.log(1.25), math.log(1.25)]]),
    )
    assert token_discrepancy(logp_old, logp_inf, torch.tensor([[1, 0]]))[0, 1] == 0


def test_trajectory_mean_and_shaping_against_loops(gen):
    delta = torch.rand(3, 5, generator=gen) * 0.1
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]])
    d = trajectory_discrepancy(delta, mask)
    for i in range(3):
        real = [delta[i, j].item() for j in range(5) if mask[i, j]]
        assert d[i].item() == pytest.approx(sum(real) / len(real) if real else 0.0)
    adv = torch.randn(3, 1, generator=gen).expand(3, 5) * mask
    full = shape_advantages(adv, delta, mask, lam=2.0, penalty="full")
    hinge = shape_advantages(adv, delta, mask, lam=2.0, penalty="hinge", tolerance=0.05)
    for i in range(3):
        for j in range(5):
            if not mask[i, j]:
                assert full[i, j] == 0 and hinge[i, j] == 0
                continue
            assert full[i, j].item() == pytest.approx(adv[i, j].item() - 2.0 * delta[i, j].item())
            excess = max(0.0, delta[i, j].item() - 0.05)
            assert hinge[i, j].item() == pytest.approx(adv[i, j].item() - 2.0 * excess)


@pytest.mark.parametrize("poison", [math.nan, math.inf, -math.inf])
def test_trajectory_discrepancy_ignores_padding(poison, gen):
    delta = torch.rand(3, 5, generator=gen)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]]).bool()
    poisoned = delta.clone()
    poisoned[~mask] = poison
    assert torch.equal(trajectory_discrepancy(poisoned, mask), trajectory_discrepancy(delta, mask))


def test_summary_buckets_by_hand():
    p_old = torch.tensor([[0.05, 0.3, 0.95, 0.6], [0.97, 0.08, 0.5, 0.5]])
    delta = torch.tensor([[0.01, 0.02, 0.03, 0.04], [0.05, 0.06, 0.5, 0.5]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    s = discrepancy_summary(delta, mask, p_old.log(), tolerance=0.035, position_edges=(0, 2, math.inf))
    assert s["mean_D"].item() == pytest.approx((0.025 + 0.055) / 2)
    assert s["max_delta"].item() == pytest.approx(0.06)
    assert s["frac_over_tolerance"].item() == pytest.approx(3 / 6)
    assert s["delta_by_prob/0-0.1"].item() == pytest.approx((0.01 + 0.06) / 2)
    assert s["delta_by_prob/0.1-0.5"].item() == pytest.approx(0.02)
    assert s["delta_by_prob/0.5-0.9"].item() == pytest.approx(0.04)
    assert s["delta_by_prob/0.9-0.99"].item() == pytest.approx((0.03 + 0.05) / 2)
    assert math.isnan(s["delta_by_prob/0.99-1"].item())
    assert s["delta_by_pos/0-2"].item() == pytest.approx((0.01 + 0.02 + 0.05 + 0.06) / 4)
    assert s["delta_by_pos/2-inf"].item() == pytest.approx(0.035)


def test_bad_arguments():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="unknown discrepancy signal 'dif'.*'diff'.*diff, log, ratio"):
        token_discrepancy(x, x, x, "dif")
    with pytest.raises(ValueError, match="shape mismatch"):
        token_discrepancy(x, torch.zeros(2, 4), x)
    with pytest.raises(ValueError, match="unknown discrepancy penalty 'hinged'"):
        shape_advantages(x, x, x, 1.0, penalty="hinged")


@pytest.mark.parametrize("strategy", ["uniform", "temporal", "optimized", "sgrpo"])
def test_discrepancy_estimate_from_kept_tokens_is_unbiased(strategy, gen):
    """D_hat = sum over kept tokens of delta / xi / real length: its mean over cutoff draws is D, and
    dividing by the kept tokens instead is biased."""
    from deployrl.algo.prefix import cutoff_law, sample_plan

    k, t, draws = 4, 12, 40000
    mask = torch.arange(t)[None] < torch.tensor([12, 3, 7, 10, 1, 12, 9, 5])[:, None]
    delta = torch.rand(8, t, generator=gen) * torch.linspace(0.1, 1.0, t)  # growing with the position
    xi = cutoff_law(strategy, mask, k, budget=3.0, xi_min=0.05, token_weights=torch.rand(8, t, generator=gen))
    plan = sample_plan(strategy, xi.repeat(draws, 1), mask.repeat(draws, 1), gen)
    seen = torch.where(plan.keep, delta.repeat(draws, 1), torch.zeros(()))  # delta is known on kept tokens only
    estimates = discrepancy_estimate(seen, plan.weights, mask.repeat(draws, 1)).reshape(draws, 8).mean(1)
    exact = float(trajectory_discrepancy(delta, mask).mean())
    stderr = float(estimates.std()) / draws ** 0.5
    assert abs(float(estimates.mean()) - exact) <= 5 * stderr
    assert plan.keep.sum() < 0.6 * mask.sum() * draws  # a real subsample
    kept_mean = trajectory_discrepancy(seen, plan.keep).reshape(draws, 8).mean(1)  # normalised by kept tokens
    assert abs(float(kept_mean.mean()) - exact) > 10 * float(kept_mean.std()) / draws ** 0.5
