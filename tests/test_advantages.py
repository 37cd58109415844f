import math

import pytest
import torch

from deployrl.algo.advantages import (
    ADVANTAGES,
    broadcast_to_tokens,
    compute_advantages,
    zero_variance_groups,
)
from deployrl.settings.config import AlgoConfig


def loop_reference(name, rewards, eps):
    out = []
    for group in rewards.tolist():
        k = len(group)
        mean = sum(group) / k
        squares = sum((r - mean) ** 2 for r in group)
        row = []
        for i, r in enumerate(group):
            if name == "grpo":
                row.append((r - mean) / (math.sqrt(squares / k) + eps))
            elif name == "grpo_unbiased_std":
                row.append((r - mean) / (math.sqrt(squares / (k - 1)) + eps))
            elif name == "dr_grpo":
                row.append(r - mean)
            else:
                others = [x for j, x in enumerate(group) if j != i]
                row.append(r - sum(others) / len(others))
        out.append(row)
    return torch.tensor(out)


@pytest.mark.parametrize("name", ADVANTAGES.names())
def test_matches_loop_reference(name, gen):
    rewards = torch.randint(0, 3, (5, 6), generator=gen).float()
    rewards[0] = 1.0  # a zero-variance group
    got = compute_advantages(name, rewards, eps=1e-6)
    torch.testing.assert_close(got, loop_reference(name, rewards, 1e-6))
    assert torch.equal(got[0], torch.zeros(6))


def test_hand_values():
    rewards = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    torch.testing.assert_close(compute_advantages("grpo", rewards, eps=0.0), torch.tensor([[-1.0, 1, 1, -1]]))
    torch.testing.assert_close(compute_advantages("rloo", rewards), torch.tensor([[-2 / 3, 2 / 3, 2 / 3, -2 / 3]]))


def test_default_grpo_divides_by_the_population_std():
    # K = 2, rewards {0, 1}: population std 1/2, sample std 1/sqrt(2); the factor sqrt(K/(K-1)) is 1.41
    pair = torch.tensor([[0.0, 1.0]])
    torch.testing.assert_close(compute_advantages("grpo", pair, eps=0.0), torch.tensor([[-1.0, 1.0]]))
    half_sqrt2 = math.sqrt(0.5)
    torch.testing.assert_close(
        compute_advantages("grpo_unbiased_std", pair, eps=0.0), torch.tensor([[-half_sqrt2, half_sqrt2]])
    )
    # K = 8: the two differ by sqrt(8/7) = 1.07
    rewards = torch.tensor([[0.0, 1, 1, 0, 1, 0, 0, 1]])
    ratio = compute_advantages("grpo", rewards, eps=0.0) / compute_advantages("grpo_unbiased_std", rewards, eps=0.0)
    torch.testing.assert_close(ratio, torch.full((1, 8), math.sqrt(8 / 7)))
    assert AlgoConfig().advantage == "grpo"


@pytest.mark.parametrize("name", ADVANTAGES.names())
def test_all_equal_rewards_give_exactly_zero(name):
    # Equal rewards that float32 cannot represent exactly: the group mean is ~1e-8 off, which
    # GRPO would divide by std + eps ~ 1e-6. Flagged groups get exactly 0, the others are kept.
    rewards = torch.tensor([[0.1] * 7, [0.7] * 7, [1 / 3] * 7, [0.3] * 7, [0.9] * 7, [0.1] * 6 + [0.2]])
    flagged = zero_variance_groups(rewards)
    assert flagged.tolist() == [True] * 5 + [False]
    advantages = compute_advantages(name, rewards)
    assert torch.equal(advantages[flagged], torch.zeros(5, 7))
    assert torch.all(advantages[~flagged] != 0)


@pytest.mark.parametrize("name", ADVANTAGES.names())
def test_a_group_of_one_completion_is_an_error(name):
    with pytest.raises(ValueError, match="at least 2 completions per group, got K=1"):
        compute_advantages(name, torch.tensor([[0.3], [1.0]]))


def test_zero_variance_flags_and_broadcast():
    rewards = torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.5, 0.5]])
    assert zero_variance_groups(rewards).tolist() == [True, False, True]
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0], [1, 1, 1], [1, 1, 0]])
    adv = torch.arange(6.0).reshape(3, 2)
    tokens = broadcast_to_tokens(adv, mask)
    assert tokens.shape == (6, 3)
    assert tokens[2].tolist() == [2.0, 2.0, 2.0] and tokens[0].tolist() == [0.0, 0.0, 0.0]
    assert tokens[1].tolist() == [1.0, 0.0, 0.0]


def test_bad_arguments():
    valid = "dr_grpo, grpo, grpo_unbiased_std, rloo"
    with pytest.raises(ValueError, match=f"unknown advantage estimator 'grpoo'.*Did you mean 'grpo'.*{valid}"):
        compute_advantages("grpoo", torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"\[G, K\]"):
        compute_advantages("grpo", torch.zeros(4))
    with pytest.raises(ValueError, match="6 completions but mask has 4 rows"):
        broadcast_to_tokens(torch.zeros(3, 2), torch.ones(4, 5))
    with pytest.raises(ValueError, match="already registered"):
        ADVANTAGES.register("grpo")(lambda r, e: r)
