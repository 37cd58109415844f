"""Mismatch corrections as registered peers: hand computations, loops, the dual step, state."""

import math
from dataclasses import replace

import pytest
import torch

from deployrl.algo.corrections import CORRECTIONS, Measured
from deployrl.settings.config import DCConfig

DC = DCConfig()


def make(name: str, cap: float = 2.0, **dc) -> object:
    return CORRECTIONS.get(name)(cap, replace(DC, **dc))


def weights(name: str, logp_old, logp_inf, mask, cap: float = 2.0) -> torch.Tensor:
    advantages = torch.ones_like(logp_old)
    return make(name, cap).token_terms(advantages, logp_old, logp_inf, mask)[1]


def test_sequence_corrections_by_hand():
    # row 0: log-ratios 0.3, 0.4 (sum 0.7, mean 0.35); row 1: -0.2 then padding (garbage there)
    logp_old = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, 5.0, 9.0]])
    logp_inf = torch.tensor([[-1.3, -2.4, -3.0], [-0.8, -50.0, 1.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    # seq_tis, cap 1.5: row 0 min(e^0.7 = 2.01, 1.5) = 1.5; row 1 e^-0.2 = 0.8187
    got = weights("seq_tis", logp_old, logp_inf, mask, cap=1.5)
    torch.testing.assert_close(got, torch.tensor([[1.5, 1.5, 0.0], [math.exp(-0.2), 0.0, 0.0]]))
    # seq_mask, cap 1.5 (band |sum| <= log 1.5 = 0.405): row 0 out (0.7), row 1 in (0.2)
    got = weights("seq_mask", logp_old, logp_inf, mask, cap=1.5)
    assert torch.equal(got, torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]))
    # geo_mask, cap 1.5: row 0's mean 0.35 <= 0.405 is in; cap 1.4 (log 0.336) puts it out
    assert torch.equal(weights("geo_mask", logp_old, logp_inf, mask, cap=1.5), mask.float())
    assert torch.equal(weights("geo_mask", logp_old, logp_inf, mask, cap=1.4), torch.tensor([[0.0, 0, 0], [1, 0, 0]]))


@pytest.mark.parametrize("name", ["tis", "mask", "seq_tis", "seq_mask", "geo_mask"])
def test_weights_against_loops(name, gen):
    logp_old = -torch.rand(4, 6, generator=gen) * 2
    logp_inf = logp_old + 0.3 * torch.randn(4, 6, generator=gen)
    lengths = [6, 4, 1, 3]
    mask = torch.arange(6)[None, :] < torch.tensor(lengths)[:, None]
    got = weights(name, logp_old, logp_inf, mask, cap=1.3)
    for i in range(4):
        ratios = [math.exp(logp_old[i, j].item() - logp_inf[i, j].item()) for j in range(lengths[i])]
        sequence, geometric = math.prod(ratios), math.prod(ratios) ** (1 / lengths[i])
        for j in range(6):
            expected = 0.0 if j >= lengths[i] else {
                "tis": min(ratios[j], 1.3), "mask": float(1 / 1.3 <= ratios[j] <= 1.3),
                "seq_tis": min(sequence, 1.3), "seq_mask": float(1 / 1.3 <= sequence <= 1.3),
                "geo_mask": float(1 / 1.3 <= geometric <= 1.3),
            }[name]
            assert got[i, j].item() == pytest.approx(expected, rel=1e-5), (name, i, j)


def test_weights_at_huge_log_ratios():
    # float32 log-ratios of +200 (exp overflows) and -200 (exp underflows to exactly 0 on any CPU)
    logp_old = torch.tensor([[-1.0, -201.0]])
    logp_inf = torch.tensor([[-201.0, -1.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    assert torch.equal(weights("tis", logp_old, logp_inf, mask), torch.tensor([[2.0, 0.0]]))
    assert torch.equal(weights("mask", logp_old, logp_inf, mask), torch.zeros(1, 2))
    rows = torch.tensor([[-1.0, -1.0]]), torch.tensor([[-201.0, -1.0]])  # one row, sequence log-ratio +200
    assert torch.equal(weights("seq_tis", *rows, mask), torch.tensor([[2.0, 2.0]]))
    assert torch.equal(weights("seq_mask", *rows, mask), torch.zeros(1, 2))


@pytest.mark.parametrize("name", CORRECTIONS.names())
@pytest.mark.parametrize("poison", [math.nan, math.inf])
def test_padding_cannot_matter(name, poison, gen):
    logp_old = -torch.rand(3, 5, generator=gen)
    logp_inf = logp_old + 0.1 * torch.randn(3, 5, generator=gen)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]]).bool()
    advantages = torch.randn(3, 5, generator=gen)
    clean = make(name, tolerance=0.01).token_terms(advantages, logp_old, logp_inf, mask)
    dirty = [t.clone() for t in (advantages, logp_old, logp_inf)]
    for t in dirty:
        t[~mask] = poison
    for a, b in zip(clean, make(name, tolerance=0.01).token_terms(*dirty, mask)):
        assert torch.equal(a, b)


def test_dc_shapes_the_advantages_and_others_do_not(gen):
    logp_old = -torch.rand(2, 4, generator=gen)
    logp_inf = logp_old + 0.2 * torch.randn(2, 4, generator=gen)
    mask = torch.ones(2, 4, dtype=torch.bool)
    advantages = torch.randn(2, 4, generator=gen)
    delta = (logp_old.exp() - logp_inf.exp()).abs()
    dc = make("dc", tolerance=0.05, lam_init=2.0, penalty="hinge")
    shaped, unit = dc.token_terms(advantages, logp_old, logp_inf, mask)
    torch.testing.assert_close(shaped, advantages - 2.0 * (delta - 0.05).clamp(min=0))
    assert torch.equal(unit, torch.ones(2, 4))
    for name in ("none", "tis", "seq_mask"):
        assert torch.equal(make(name).token_terms(advantages, logp_old, logp_inf, mask)[0], advantages)


def measured(mean: float, seen: bool = True) -> Measured:
    return Measured(torch.zeros(1, 2), torch.full((1, 2), seen), mean)


def test_dual_step_rises_falls_to_zero_and_respects_max():
    dc = make("dc", tolerance=0.01, lr=10.0, lam_max=0.5)

    def step(mean: float) -> float:
        before = dc.lam
        assert dc.after_update(measured(mean)) == {"dc/lambda_used": before}  # the lambda the update used
        return dc.lam

    assert step(0.03) == pytest.approx(0.2)  # 10 * (0.03 - 0.01)
    assert step(0.03) == pytest.approx(0.4)
    assert step(0.05) == 0.5  # clipped at lam_max
    assert step(0.02) == 0.5
    assert step(0.0) == pytest.approx(0.4)  # inside the tolerance region: decays
    lams = [step(0.005) for _ in range(20)]
    assert lams[-1] == 0.0 and all(b <= a for a, b in zip(lams, lams[1:]))
    assert all(lam == 0.0 for lam in lams[lams.index(0.0):])
    with pytest.raises(ValueError, match="finite"):
        dc.after_update(measured(math.nan))


def test_tolerance_from_the_first_batch_with_a_token_seen():
    for name in ("dc", "tis"):
        correction = make(name, relative_tolerance=2.0)
        assert not correction.ready() if name == "dc" else correction.ready()
        correction.measure(measured(0.0, seen=False))  # D_hat of no token is 0, not D
        assert correction.tolerance is None and math.isnan(correction.metrics()["dc/tolerance"])
        correction.measure(measured(0.03))
        correction.measure(measured(0.5))  # set once
        assert correction.tolerance == pytest.approx(0.06) and correction.ready()
    assert make("dc", tolerance=0.01).tolerance == 0.01  # configured: never measured


def test_state_round_trip():
    dc = make("dc", tolerance=0.01, lam_init=0.3)
    other = make("dc")
    other.load_state_dict(dc.state_dict())
    assert (other.lam, other.tolerance) == (0.3, 0.01)
    assert other.after_update(measured(0.02)) == dc.after_update(measured(0.02)) and other.lam == dc.lam
    with pytest.raises(ValueError, match="outside"):
        other.load_state_dict({"tolerance": 0.01, "lam": 500.0})
    with pytest.raises(ValueError, match="lacks"):
        other.load_state_dict({"tolerance": 0.01})
    tis = make("tis")
    tis.load_state_dict({"tolerance": 0.2, "lam": 0.0})  # a checkpoint of a dc run read by another correction
    assert tis.tolerance == 0.2


def test_bad_settings():
    with pytest.raises(ValueError, match="cap > 1"):
        make("mask", cap=0.5)
    with pytest.raises(ValueError, match="cap > 1"):
        make("geo_mask", cap=1.0)
    with pytest.raises(ValueError, match="cap > 0"):
        make("seq_tis", cap=0.0)
    with pytest.raises(ValueError, match="unknown mismatch correction 'tiss'"):
        CORRECTIONS.get("tiss")
    assert [CORRECTIONS.get(n).whole_sequence for n in ("none", "dc", "tis", "mask", "seq_tis", "seq_mask", "geo_mask")] \
        == [False] * 4 + [True] * 3
