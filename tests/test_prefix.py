import numpy as np
import pytest
import torch
from scipy.optimize import minimize

from deployrl.algo.losses import policy_loss
from deployrl.algo.prefix import (
    STRATEGIES,
    alive_counts,
    cutoff_law,
    engine_proxies,
    grad_norm_proxy,
    group_stats,
    group_weight_sums,
    sample_plan,
    sparse_uncertainty,
    variance_surrogate,
)

PREFIX_STRATEGIES = [s for s in STRATEGIES.names() if s != "sgrpo"]


def random_group(gen, k, t, min_len=1):
    lengths = torch.randint(min_len, t + 1, (k,), generator=gen)
    lengths[0] = t
    mask = torch.arange(t)[None] < lengths[:, None]
    return mask


def general_solver(n, w, total, xi_min):
    """min sum W/xi  s.t. xi non-increasing, xi_min <= xi <= 1, sum n*xi <= total, by SLSQP."""
    t = len(n)
    start = np.full(t, max(xi_min, min(1.0, total / n.sum())))
    constraints = [
        {"type": "ineq", "fun": lambda x: total - n @ x, "jac": lambda x: -n},
        {"type": "ineq", "fun": lambda x: x[:-1] - x[1:], "jac": lambda x: np.eye(t)[:-1] - np.eye(t)[1:]},
    ]
    res = minimize(
        lambda x: (w / x).sum(), start, jac=lambda x: -w / x**2, method="SLSQP",
        bounds=[(xi_min, 1.0)] * t, constraints=constraints, options={"ftol": 1e-15, "maxiter": 2000},
    )
    return res.fun


@pytest.mark.parametrize("seed", range(12))
def test_optimized_law_is_optimal_against_general_solver(seed):
    gen = torch.Generator().manual_seed(seed)
    k = int(torch.randint(2, 9, (1,), generator=gen))
    t = int(torch.randint(3, 13, (1,), generator=gen))
    mask = random_group(gen, k, t)
    w = torch.rand(k, t, generator=gen) ** 3 * mask  # skewed, non-monotone importances
    n = alive_counts(mask, k)[0].numpy()
    budget = float(torch.empty(1).uniform_(0.15, 0.9, generator=gen)) * n.sum() / k
    xi_min = [0.01, 0.05, 0.1][seed % 3]
    xi = cutoff_law("optimized", mask, k, budget, xi_min, w)[0]
    big_w = group_weight_sums(w, mask, k)[0]

    # Constraints: monotone, bounds, budget binding (it binds: budget < sum n).
    assert torch.all(xi[:-1] >= xi[1:] - 1e-12)
    assert torch.all(xi >= xi_min - 1e-12) and torch.all(xi <= 1 + 1e-12)
    assert float((alive_counts(mask, k)[0] * xi).sum()) == pytest.approx(k * budget, rel=1e-9)

    ours = float(variance_surrogate(xi, big_w))
    reference = general_solver(n, big_w.numpy(), k * budget, xi_min)
    assert ours <= reference * (1 + 1e-6)
    assert ours == pytest.approx(reference, rel=1e-6)

    # Never worse than any other law at the same budget.
    for other in ["uniform", "temporal", "sgrpo"]:
        xi_other = cutoff_law(other, mask, k, budget, xi_min)[0]
        assert float((alive_counts(mask, k)[0] * xi_other).sum()) <= k * budget * (1 + 1e-9)
        assert ours <= float(variance_surrogate(xi_other, big_w)) * (1 + 1e-9)


def test_budget_that_does_not_bind_keeps_everything(gen):
    mask = random_group(gen, 4, 10)
    for strategy in STRATEGIES.names():
        xi = cutoff_law(strategy, mask, 4, budget=10, token_weights=torch.rand(4, 10, generator=gen))
        assert torch.all(xi[0] == 1.0)


@pytest.mark.parametrize("strategy", ["uniform", "temporal", "sgrpo", "heuristic"])
def test_every_budgeted_law_spends_the_budget(strategy, gen):
    mask = random_group(gen, 8, 50)
    w = torch.rand(8, 50, generator=gen)
    xi = cutoff_law(strategy, mask, 8, budget=12, xi_min=0.02, token_weights=w)
    n = alive_counts(mask, 8)
    assert float((n * xi).sum()) == pytest.approx(8 * 12, rel=1e-9)
    assert torch.all(xi[0, :-1] >= xi[0, 1:])


def all_cutoff_draws(strategy, xi, mask, gen, draws):
    """Weights [N, B, T] of `draws` independent plans, sampled in one call."""
    b, t = mask.shape
    plan = sample_plan(strategy, xi.repeat(draws, 1), mask.repeat(draws, 1), gen)
    return plan.weights.reshape(draws, b, t), plan


class TinyPolicy(torch.nn.Module):
    """log p(o_t | o_{t-1}) from an embedding and a head: a small, fixed, real model."""

    def __init__(self, vocab=6, dim=3):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, prev, tokens):
        logits = self.head(self.embed(prev))
        return logits.log_softmax(-1).gather(-1, tokens[..., None])[..., 0]


def per_token_gradients(gen, k=6, t=9):
    """The model, a batch, and the gradient of each token's term in the aggregated loss."""
    torch.manual_seed(0)
    model = TinyPolicy()
    mask = random_group(gen, k, t, min_len=2)
    tokens = torch.randint(0, 6, (k, t + 1), generator=gen)
    with torch.no_grad():
        logp_old = model(tokens[:, :-1], tokens[:, 1:]) + 0.1 * torch.randn(k, t, generator=gen)
    adv = torch.randn(k, 1, generator=gen).expand(k, t)

    def loss_grad(weights):
        model.zero_grad()
        logp = model(tokens[:, :-1], tokens[:, 1:])
        policy_loss(logp, logp_old, adv, mask, weights, aggregation="seq_mean_token_mean").loss.backward()
        return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()

    grads = torch.zeros(k, t, sum(p.numel() for p in model.parameters()), dtype=torch.float64)
    for i in range(k):
        for j in range(t):
            one_hot = torch.zeros(k, t)
            one_hot[i, j] = 1.0
            grads[i, j] = loss_grad(one_hot)
    return mask, grads, loss_grad


@pytest.mark.parametrize("strategy", STRATEGIES.names())
def test_prefix_sampled_gradient_is_unbiased(strategy, gen):
    mask, grads, loss_grad = per_token_gradients(gen)
    k = mask.shape[0]
    full = loss_grad(torch.ones_like(mask, dtype=torch.float32))
    torch.testing.assert_close(grads.sum(dim=(0, 1)), full)  # the loss is linear in the weights

    w = torch.rand(mask.shape, generator=gen)
    xi = cutoff_law(strategy, mask, k, budget=2.5, xi_min=0.05, token_weights=w)
    weights, plan = all_cutoff_draws(strategy, xi, mask, gen, draws=40000)
    # The real loss and backward on one plan equal the weighted sum of per-token gradients.
    torch.testing.assert_close(loss_grad(weights[0]), torch.einsum("bt,btp->p", weights[0].double(), grads))

    estimates = torch.einsum("nbt,btp->np", weights.double(), grads)  # [N, P]
    mean = estimates.mean(0)
    stderr = estimates.std(0) / estimates.shape[0] ** 0.5
    # 5 standard errors per coordinate, plus float32 round-off (the exact `full` law has none).
    error = (mean - full).abs()
    assert torch.all(error <= 5.0 * stderr + 1e-6 * full.abs().max()), f"{strategy}: max |z| = {(error / stderr).max():.2f}"
    if strategy != "full":
        assert plan.keep.sum() < 0.8 * mask.repeat(40000, 1).sum()


def test_normalising_by_kept_tokens_is_biased(gen):
    mask, grads, _ = per_token_gradients(gen)
    k = mask.shape[0]
    xi = cutoff_law("uniform", mask, k, budget=2.5, xi_min=0.05)
    weights, plan = all_cutoff_draws("uniform", xi, mask, gen, draws=40000)
    keep = plan.keep.reshape(weights.shape)
    # grads already carry each row's 1/real-length; swap it for 1/kept-length.
    real_len = mask.sum(1).double()[None, :, None]
    kept_len = keep.sum(2).double().clamp(min=1)[..., None]
    biased = torch.einsum("nbt,btp->np", weights.double() * real_len / kept_len, grads)
    full = grads.sum(dim=(0, 1))
    z = (biased.mean(0) - full).abs() / (biased.std(0) / biased.shape[0] ** 0.5)
    assert z.max() > 10.0


def test_cutoffs_are_prefixes_with_the_law_as_tail_probability(gen):
    mask = random_group(gen, 4, 20)
    xi = cutoff_law("temporal", mask, 4, budget=6, xi_min=0.05)
    _, plan = all_cutoff_draws("temporal", xi, mask, gen, draws=20000)
    keep = plan.keep.reshape(20000, 4, 20)
    lengths = keep.sum(2)
    assert torch.equal(keep, torch.arange(20)[None, None] < lengths[..., None])
    assert torch.equal(plan.cutoffs.reshape(20000, 4), lengths)
    freq = keep.double().mean(0)  # estimates Pr(H >= t) = xi_t on real positions
    expected = xi.double().expand(4, 20) * mask
    assert torch.all((freq - expected).abs() <= 5 * (expected * (1 - expected) / 20000).sqrt() + 1e-9)


def test_grad_norm_proxy_equals_the_head_gradient_norm(gen):
    head = torch.randn(11, 5, generator=gen, requires_grad=True)
    for _ in range(5):
        h = torch.randn(5, generator=gen)
        token = int(torch.randint(0, 11, (1,), generator=gen))
        logp = (head @ h).log_softmax(-1)
        (grad,) = torch.autograd.grad(logp[token], head)
        p = logp.exp().detach()
        proxy = grad_norm_proxy(logp[token].detach().reshape(1, 1), p.square().sum().reshape(1, 1), h.norm().reshape(1, 1))
        assert proxy.item() == pytest.approx(grad.norm().item(), rel=1e-5)


def uncertainty_reference(hidden, head, mask, success, metric):
    probs = (hidden @ head.T).softmax(-1)  # [K, T, V], fine at test size
    out, last = [], 1.0
    for t in range(hidden.shape[1]):
        good = [probs[k, t] for k in range(len(success)) if mask[k, t] and success[k]]
        bad = [probs[k, t] for k in range(len(success)) if mask[k, t] and not success[k]]
        if good and bad:
            diff = torch.stack(good).mean(0) - torch.stack(bad).mean(0)
            last = (0.5 * diff.abs().sum() if metric == "tv" else diff.norm()).item()
        out.append(last)
    return torch.tensor(out)


@pytest.mark.parametrize("metric", ["tv", "l2"])
def test_reward_uncertainty_matches_full_computation(metric, gen):
    hidden = torch.randn(6, 13, 4, generator=gen)
    head = torch.randn(17, 4, generator=gen)
    targets = torch.randint(0, 17, (6, 13), generator=gen)
    mask = torch.arange(13)[None] < torch.tensor([13, 5, 9, 2, 13, 7])[:, None]
    success = torch.tensor([False, True, True, False, False, True])  # successes die out by t=9
    expected = uncertainty_reference(hidden, head, mask, success, metric)
    for chunk in (1, 4, 13):
        got = group_stats(hidden, head, targets, mask, success, metric, chunk_size=chunk).uncertainty
        torch.testing.assert_close(got, expected)
    everyone_won = group_stats(hidden, head, targets, mask, torch.ones(6, dtype=torch.bool)).uncertainty
    assert torch.equal(everyone_won, torch.ones(13))


def test_group_stats_token_statistics_match_the_chunked_pass(gen):
    from deployrl.algo.logprobs import SamplingView, chunked_token_stats

    hidden = torch.randn(5, 11, 4, generator=gen)
    head = torch.randn(19, 4, generator=gen)
    targets = torch.randint(0, 19, (5, 11), generator=gen)
    mask = torch.arange(11)[None] < torch.tensor([11, 3, 8, 1, 6])[:, None]
    view = SamplingView(temperature=0.7, top_k=5)
    expected = chunked_token_stats(hidden, head, targets, mask, view, chunk_tokens=7, with_stats=True)
    got = group_stats(hidden, head, targets, mask, torch.tensor([True, False, True, False, False]), view=view,
                      chunk_size=3, with_entropy=True)
    for name in ("logp", "entropy", "sum_p2", "hidden_norm"):
        torch.testing.assert_close(getattr(got, name), getattr(expected, name), msg=name)


def test_bad_arguments(gen):
    mask = random_group(gen, 4, 10)
    with pytest.raises(ValueError, match="unknown cutoff strategy 'optimised'.*'optimized'.*full, heuristic"):
        cutoff_law("optimised", mask, 4, budget=3)
    with pytest.raises(ValueError, match="budget must be > 0"):
        cutoff_law("uniform", mask, 4, budget=0)
    with pytest.raises(ValueError, match="xi_min must lie in"):
        cutoff_law("uniform", mask, 4, budget=3, xi_min=0)
    with pytest.raises(ValueError, match="above the budget"):
        cutoff_law("uniform", mask, 4, budget=3, xi_min=0.9)
    with pytest.raises(ValueError, match="needs token_weights"):
        cutoff_law("optimized", mask, 4, budget=3)
    with pytest.raises(ValueError, match="shape mismatch"):
        cutoff_law("optimized", mask, 4, budget=3, token_weights=torch.ones(4, 9))
    with pytest.raises(ValueError, match=">= 0"):
        cutoff_law("optimized", mask, 4, budget=3, token_weights=-torch.ones(4, 10))
    with pytest.raises(ValueError, match="not a multiple of group_size=3"):
        cutoff_law("uniform", mask, 3, budget=3)
    with pytest.raises(ValueError, match="unknown uncertainty metric"):
        group_stats(torch.zeros(2, 3, 4), torch.zeros(5, 4), torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3),
                    torch.ones(2).bool(), "kl")


def group_batch(gen, groups=3, k=6, t=13, vocab=17, dim=4):
    """Hidden states, head, targets, mask and success of `groups` random groups, rows group-major."""
    hidden = torch.randn(groups * k, t, dim, generator=gen)
    head = torch.randn(vocab, dim, generator=gen)
    targets = torch.randint(0, vocab, (groups * k, t), generator=gen)
    mask = torch.arange(t)[None] < torch.randint(1, t + 1, (groups * k,), generator=gen)[:, None]
    success = torch.rand(groups, k, generator=gen) < 0.5
    success[0] = torch.arange(k) % 2 == 0  # both classes in one group at least
    success[-1] = True  # and one group without failures: u = 1
    return hidden, head, targets, mask, success


@pytest.mark.parametrize("metric", ["tv", "l2"])
def test_sparse_uncertainty_with_the_whole_support_is_the_trainers(metric, gen):
    from deployrl.algo.logprobs import SamplingView, processed_logits

    hidden, head, targets, mask, success = group_batch(gen)
    k = success.shape[1]
    for view, m in ((SamplingView(), 17), (SamplingView(temperature=0.8, top_k=4), 6)):  # m >= the support
        logp = processed_logits(hidden @ head.T, view).log_softmax(-1)  # [B, T, V]
        top_logp, top_ids = logp.topk(m, dim=-1)
        got = sparse_uncertainty(top_ids, top_logp, mask, success, metric)
        for g in range(len(success)):
            rows = slice(g * k, (g + 1) * k)
            dense = group_stats(hidden[rows], head, targets[rows], mask[rows], success[g], metric, view).uncertainty
            torch.testing.assert_close(got[g], dense, atol=1e-6, rtol=1e-5)
    assert torch.equal(got[-1], torch.ones(mask.shape[1]))
    # fewer tokens than the support: a different (coarser) u, not the same number
    top_logp, top_ids = (hidden @ head.T).log_softmax(-1).topk(3, dim=-1)
    dense = group_stats(hidden[:k], head, targets[:k], mask[:k], success[0], metric).uncertainty
    assert not torch.allclose(sparse_uncertainty(top_ids, top_logp, mask, success, metric)[0], dense)


def test_engine_proxies_are_the_trainers_without_the_hidden_norm(gen):
    hidden, head, targets, mask, success = group_batch(gen)
    k = success.shape[1]
    logp_all = (hidden @ head.T).log_softmax(-1)
    probs = logp_all.exp()
    logp = logp_all.gather(-1, targets[..., None])[..., 0]
    top_logp, top_ids = logp_all.topk(17, dim=-1)
    stats = {"entropy": torch.special.entr(probs).sum(-1), "sum_p2": probs.square().sum(-1),
             "top_ids": top_ids, "top_logp": top_logp}
    proxies = engine_proxies(logp, stats, mask, success)
    for g in range(len(success)):
        rows = slice(g * k, (g + 1) * k)
        trainer = group_stats(hidden[rows], head, targets[rows], mask[rows], success[g], with_entropy=True)
        gamma = grad_norm_proxy(trainer.logp, trainer.sum_p2, trainer.hidden_norm)
        torch.testing.assert_close(proxies["grad_norm"][rows] * trainer.hidden_norm, gamma, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(proxies["entropy"][rows], trainer.entropy, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(proxies["uncertainty"][g], trainer.uncertainty, atol=1e-6, rtol=1e-5)
    assert (proxies["grad_norm"][~mask] == 0).all() and (proxies["entropy"][~mask] == 0).all()
