import pytest
import torch

from deployrl.algo.logprobs import SamplingView, chunked_token_stats, processed_logits


def naive(hidden, head, targets, view):
    logits = processed_logits(hidden @ head.T, view)  # [B, T, V], fine at test size
    logp_all = logits.log_softmax(-1)
    probs = logp_all.exp()
    return (
        logp_all.gather(-1, targets[..., None])[..., 0],
        -(probs * logp_all.nan_to_num(neginf=0)).sum(-1),
        probs.square().sum(-1),
    )


@pytest.mark.parametrize("view", [SamplingView(), SamplingView(0.7, 0, 1.0), SamplingView(1.3, 5, 0.9)])
def test_chunked_equals_naive_and_grads_match(view, gen):
    hidden = torch.randn(3, 11, 8, generator=gen, requires_grad=True)
    head = torch.randn(40, 8, generator=gen, requires_grad=True)
    mask = torch.arange(11)[None] < torch.tensor([11, 4, 7])[:, None]
    # targets from the processed support so that no log-prob is -inf
    with torch.no_grad():
        probs = processed_logits(hidden @ head.T, view).softmax(-1)
    targets = torch.multinomial(probs.reshape(-1, 40), 1, generator=gen).reshape(3, 11)
    ref_logp, ref_entropy, ref_p2 = naive(hidden, head, targets, view)
    for chunk in (1, 5, 64):
        stats = chunked_token_stats(hidden, head, targets, mask, view, chunk_tokens=chunk, with_stats=True)
        torch.testing.assert_close(stats.logp, ref_logp * mask)
        torch.testing.assert_close(stats.entropy, ref_entropy * mask)
        torch.testing.assert_close(stats.sum_p2, ref_p2 * mask)
        torch.testing.assert_close(stats.hidden_norm, hidden.detach().norm(dim=-1) * mask)
        grads = torch.autograd.grad(stats.logp.sum(), (hidden, head))
        ref_grads = torch.autograd.grad((ref_logp * mask).sum(), (hidden, head), retain_graph=True)
        for got, ref in zip(grads, ref_grads):
            torch.testing.assert_close(got, ref)


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = processed_logits(logits, SamplingView(top_p=0.8)).isfinite()
    assert kept.tolist() == [[True, True, False, False]]
    kept = processed_logits(logits, SamplingView(top_p=0.81)).isfinite()
    assert kept.tolist() == [[True, True, True, False]]
    kept = processed_logits(logits, SamplingView(top_k=1)).isfinite()
    assert kept.tolist() == [[True, False, False, False]]


def test_bad_views():
    with pytest.raises(ValueError, match="temperature must be > 0"):
        SamplingView(temperature=0)
    with pytest.raises(ValueError, match="top_p must lie in"):
        SamplingView(top_p=1.5)
    with pytest.raises(ValueError, match="top_k must be >= 0"):
        SamplingView(top_k=-1)
