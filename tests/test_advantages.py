import math

import pytest
import torch

from deployrl.algo.advantages import (
    ADVANTAGES,
    broadcast_to_tokens,
    compute_advantages,
    zero_variance_groups,
)


def loop_reference(name, rewards, eps):
    out = []
    for group in rewards.tolist():
        k = len(group)
        mean = sum(group) / k
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / k)
        row = []
        for i, r in enumerate(group):
            if name == "grpo":
                row.append((r - mean) / (std + eps))
            elif name == "dr_grpo":
                row.append(r - mean)
            else:
                others = [x for j, x in enumerate(group) if j != i]
                row.append(r - sum(others) / len(others))
        out.append(row)
    return torch.tensor(out)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
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
    with pytest.raises(ValueError, match="unknown advantage estimator 'grpoo'.*Did you mean 'grpo'.*dr_grpo, grpo, rloo"):
        compute_advantages("grpoo", torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"\[G, K\]"):
        compute_advantages("grpo", torch.zeros(4))
    with pytest.raises(ValueError, match="at least 2"):
        compute_advantages("rloo", torch.zeros(3, 1))
    with pytest.raises(ValueError, match="6 completions but mask has 4 rows"):
        broadcast_to_tokens(torch.zeros(3, 2), torch.ones(4, 5))
    with pytest.raises(ValueError, match="already registered"):
        ADVANTAGES.register("grpo")(lambda r, e: r)
