import math

import pytest
import torch

from deployrl.algo.losses import aggregate, kl_penalty, policy_loss


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
