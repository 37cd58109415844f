import math

import pytest
import torch

from deployrl.algo.losses import AGGREGATIONS, aggregate, kl_penalty, policy_loss
from deployrl.settings.config import AlgoConfig


def token_loss_reference(lp, lp_old, a, eps_low, eps_high, dual_clip):
    ratio = math.exp(lp - lp_old)
    clipped_ratio = min(max(ratio, 1 - eps_low), 1 + eps_high)
    loss = max(-a * ratio, -a * clipped_ratio)
    if dual_clip is not None and a < 0:
        loss = min(loss, -a * dual_clip)
    return loss


def aggregate_reference(values, mask, mode, max_length):
    rows = [[v for v, m in zip(vr, mr) if m] for vr, mr in zip(values, mask)]
    if mode == "token_mean":
        return sum(sum(r) for r in rows) / sum(len(r) for r in rows)
    if mode == "seq_mean_token_mean":
        return sum(sum(r) / len(r) for r in rows) / len(rows)
    return sum(sum(r) for r in rows) / (len(rows) * max_length)


def random_batch(gen, b=4, t=7):
    logp_old = -torch.rand(b, t, generator=gen) * 3
    logp = logp_old + 0.5 * torch.randn(b, t, generator=gen)
    adv = torch.randn(b, 1, generator=gen).expand(b, t).clone()
    lengths = torch.tensor([7, 3, 5, 1])[:b]
    mask = torch.arange(t)[None] < lengths[:, None]
    weights = torch.rand(b, t, generator=gen) * 3
    return logp, logp_old, adv, mask, weights


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_policy_loss_matches_loop_reference(mode, dual_clip, gen):
    logp, logp_old, adv, mask, weights = random_batch(gen)
    out = policy_loss(
        logp, logp_old, adv, mask, weights, eps_low=0.2, eps_high=0.28,
        dual_clip=dual_clip, aggregation=mode, max_length=10,
    )
    per_token = [
        [
            token_loss_reference(logp[i, j].item(), logp_old[i, j].item(), adv[i, j].item(), 0.2, 0.28, dual_clip)
            * weights[i, j].item()
            for j in range(logp.shape[1])
        ]
        for i in range(logp.shape[0])
    ]
    expected = aggregate_reference(per_token, mask.tolist(), mode, 10)
    assert out.loss.item() == pytest.approx(expected, rel=1e-5)


def test_hand_computed_loss():
    # Two tokens, A = 1: ratio 1.5 is clipped at 1.2, ratio 0.5 is not (min takes it).
    logp_old = torch.zeros(1, 2)
    logp = torch.log(torch.tensor([[1.5, 0.5]]))
    out = policy_loss(logp, logp_old, torch.ones(1, 2), torch.ones(1, 2), eps_low=0.2, eps_high=0.2)
    assert out.loss.item() == pytest.approx((-1.2 - 0.5) / 2)
    assert out.metrics["clip_fraction"].item() == pytest.approx(0.5)
    # A = -2 with ratio 5: PPO's loss is 10, the dual clip at c = 3 bounds it to 6.
    logp = torch.log(torch.tensor([[5.0]]))
    out = policy_loss(logp, torch.zeros(1, 1), -2 * torch.ones(1, 1), torch.ones(1, 1), dual_clip=3.0)
    assert out.loss.item() == pytest.approx(6.0)


def test_denominator_ignores_weights_and_microbatches_add_up(gen):
    logp, logp_old, adv, mask, weights = random_batch(gen)
    kept = weights * (torch.rand(weights.shape, generator=gen) < 0.5)
    full = policy_loss(logp, logp_old, adv, mask, kept, aggregation="token_mean")
    # Denominator is the real-token count (16), whatever was kept.
    by_hand = (full.token_loss * kept * mask).sum() / mask.sum()
    torch.testing.assert_close(full.loss, by_hand)
    for mode in ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]:
        whole = policy_loss(logp, logp_old, adv, mask, kept, aggregation=mode, max_length=9).loss
        count = mask.sum() if mode == "token_mean" else mask.shape[0]
        parts = sum(
            policy_loss(
                logp[s], logp_old[s], adv[s], mask[s], kept[s],
                aggregation=mode, max_length=9, denominator=count,
            ).loss
            for s in (slice(0, 1), slice(1, 4))
        )
        torch.testing.assert_close(parts, whole)


@pytest.mark.parametrize("poison", [math.nan, -math.inf, math.inf, 1e30])
@pytest.mark.parametrize("mode", AGGREGATIONS.names())
def test_padding_cannot_change_loss_gradient_or_metrics(poison, mode, gen):
    logp, logp_old, adv, mask, weights = random_batch(gen)
    logp_ref = logp_old - 0.3 * torch.rand(logp.shape, generator=gen)

    def evaluate(fill: bool):
        inputs = [t.clone() for t in (logp, logp_old, adv, weights, logp_ref)]
        if fill:  # opposite signs on logp and logp_old: a huge log-ratio, not their difference 0
            for t, sign in zip(inputs, (1, -1, 1, 1, -1)):
                t[~mask] = sign * poison
        lp = inputs[0].requires_grad_()
        out = policy_loss(
            lp, *inputs[1:3], mask, inputs[3], dual_clip=3.0, aggregation=mode, max_length=10,
            logp_ref=inputs[4], kl_coef=0.1,
        )
        out.loss.backward()
        return out, lp.grad

    clean, clean_grad = evaluate(fill=False)
    poisoned, poisoned_grad = evaluate(fill=True)
    assert torch.isfinite(poisoned.loss) and torch.isfinite(poisoned_grad).all()
    # padding is selected away before any arithmetic: the same numbers, summed in the same order
    assert torch.equal(poisoned.loss, clean.loss)
    assert torch.equal(poisoned_grad, clean_grad) and torch.all(clean_grad[~mask] == 0)
    assert poisoned.metrics.keys() == clean.metrics.keys()
    for name, value in clean.metrics.items():
        assert torch.equal(poisoned.metrics[name], value), name


@pytest.mark.parametrize(
    "log_ratio, advantage, dual_clip, expected",
    [
        (100.0, 1.0, None, -1.28),  # clipped above at 1 + eps_high: loss -A * 1.28
        (-100.0, -1.0, None, 0.8),  # clipped below at 1 - eps_low: loss -A * 0.8
        (100.0, -1.0, 3.0, 3.0),  # the dual clip bounds the loss at -c * A
        (30.0, -1.0, None, math.exp(20.0)),  # unclipped branch, saturated at |log rho| = 20
    ],
)
def test_huge_log_ratio_gives_a_finite_zero_gradient(log_ratio, advantage, dual_clip, expected):
    # float32, where exp(100) overflows: without the bound, 0 * inf = NaN in the backward
    logp = torch.tensor([[-10.0 if log_ratio > 0 else -110.0]], requires_grad=True)
    logp_old = logp.detach() - log_ratio
    out = policy_loss(
        logp, logp_old, torch.full((1, 1), advantage), torch.ones(1, 1), eps_low=0.2, eps_high=0.28,
        dual_clip=dual_clip,
    )
    out.loss.backward()
    torch.testing.assert_close(out.loss, torch.tensor(expected))
    assert torch.equal(logp.grad, torch.zeros(1, 1))
    assert all(torch.isfinite(value) for value in out.metrics.values())


def test_log_ratio_bound_leaves_moderate_ratios_alone():
    # |log rho| = 19.5 < 20, negative advantage, no dual clip: PPO's loss exp(19.5) and gradient
    logp = torch.tensor([[-0.5]], dtype=torch.float64, requires_grad=True)
    logp_old = torch.tensor([[-20.0]], dtype=torch.float64)
    out = policy_loss(logp, logp_old, -torch.ones(1, 1, dtype=torch.float64), torch.ones(1, 1))
    out.loss.backward()
    assert out.loss.item() == pytest.approx(math.exp(19.5), rel=1e-12)
    assert logp.grad.item() == pytest.approx(math.exp(19.5), rel=1e-12)


def test_seq_mean_token_mean_counts_an_empty_row():
    values = torch.tensor([[1.0, 2.0], [5.0, 7.0]])
    mask = torch.tensor([[1, 1], [0, 0]])
    # (mean(1, 2) + 0) / 2 rows; verl leaves the empty row out and gets 1.5
    assert aggregate(values, mask, "seq_mean_token_mean").item() == 0.75


def test_seq_mean_token_sum_norm_divides_by_rows_times_max_length():
    values = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    # (1 + 2 + 3) / (2 rows * 4); verl divides by max_length alone: 1.5
    assert aggregate(values, mask, "seq_mean_token_sum_norm", max_length=4).item() == 0.75


def test_weights_multiply_the_kl_term_too():
    # ratio 1 and A = 1: surrogate -1 per token; k1 = log 2 per token; weights 2 and 0.5
    logp = torch.full((1, 2), -1.0, dtype=torch.float64)
    weights = torch.tensor([[2.0, 0.5]], dtype=torch.float64)
    out = policy_loss(
        logp, logp, torch.ones(1, 2, dtype=torch.float64), torch.ones(1, 2), weights,
        logp_ref=logp - math.log(2), kl_coef=0.1, kl_estimator="k1",
    )
    expected = (2.0 + 0.5) * (-1 + 0.1 * math.log(2)) / 2  # verl: (2 + 0.5) * -1 / 2 + 0.1 log 2
    assert out.loss.item() == pytest.approx(expected, rel=1e-12)


def test_dual_clip_is_off_by_default():
    # A = -2 with ratio 5: PPO's loss 10 stands; verl's default c = 3 would give 6
    out = policy_loss(torch.log(torch.tensor([[5.0]])), torch.zeros(1, 1), -2 * torch.ones(1, 1), torch.ones(1, 1))
    assert out.loss.item() == pytest.approx(10.0)
    assert AlgoConfig().dual_clip is None


def test_k3_is_exact_and_not_clamped_at_log_ratio_3():
    log_r = torch.tensor([-3.0, 3.0], dtype=torch.float64, requires_grad=True)
    kl = kl_penalty(log_r, torch.zeros(2, dtype=torch.float64), "k3")
    kl.sum().backward()
    # e^3 - 4 = 16.09 (verl clamps it to 10, with zero gradient) and e^-3 + 2
    assert kl.tolist() == pytest.approx([math.exp(3) - 4, math.exp(-3) + 2], rel=1e-12)
    assert log_r.grad.tolist() == pytest.approx([1 - math.exp(3), 1 - math.exp(-3)], rel=1e-12)


def test_kl_estimators_hand_values():
    logp = torch.log(torch.tensor([0.5]))
    logp_ref = torch.log(torch.tensor([0.25]))
    log_r = math.log(2)
    assert kl_penalty(logp, logp_ref, "k1").item() == pytest.approx(log_r)
    assert kl_penalty(logp, logp_ref, "k2").item() == pytest.approx(0.5 * log_r**2)
    assert kl_penalty(logp, logp_ref, "k3").item() == pytest.approx(0.5 - 1 + log_r)


def test_kl_term_enters_the_loss(gen):
    logp, logp_old, adv, mask, _ = random_batch(gen)
    logp_ref = logp_old - 0.3
    base = policy_loss(logp, logp_old, adv, mask).loss
    with_kl = policy_loss(logp, logp_old, adv, mask, logp_ref=logp_ref, kl_coef=0.1, kl_estimator="k2").loss
    expected = base + 0.1 * aggregate(0.5 * (logp - logp_ref) ** 2, mask, "token_mean")
    torch.testing.assert_close(with_kl, expected)


def test_gradient_flows_only_through_logp(gen):
    logp, logp_old, adv, mask, weights = random_batch(gen)
    logp = logp.clone().requires_grad_()
    policy_loss(logp, logp_old, adv, mask, weights).loss.backward()
    assert torch.all(logp.grad[~mask] == 0)
    assert logp.grad[mask].abs().sum() > 0


def test_bad_arguments(gen):
    logp, logp_old, adv, mask, _ = random_batch(gen)
    with pytest.raises(ValueError, match="shape mismatch"):
        policy_loss(logp, logp_old[:, :3], adv, mask)
    with pytest.raises(ValueError, match="unknown loss aggregation 'token_means'.*'token_mean'"):
        policy_loss(logp, logp_old, adv, mask, aggregation="token_means")
    with pytest.raises(ValueError, match="max_length"):
        policy_loss(logp, logp_old, adv, mask, aggregation="seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        policy_loss(logp, logp_old, adv, mask, dual_clip=0.5)
    with pytest.raises(ValueError, match="needs logp_ref"):
        policy_loss(logp, logp_old, adv, mask, kl_coef=0.1)
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        kl_penalty(logp, logp_old, "k4")
