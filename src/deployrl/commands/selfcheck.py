"""Self-check: what prefix sampling buys on one random instance.

For one prompt group of K completions with random lengths, every token gets a fixed
gradient vector a[k,t] = s[k,t] * z[k,t] (z standard normal in D dimensions, scaled by 1/sqrt(D)),
with magnitudes s that decay with depth and vary by completion, as the signal of a reasoning
trace does. Each cutoff strategy, at the same token budget B per completion, draws many
cutoff plans; the table reports the estimator's relative variance E||G_hat - G||^2 / ||G||^2
(G the full-trajectory gradient, estimated by Monte Carlo), the bias ||mean G_hat - G|| / ||G||,
and the tokens kept per completion, expected and observed.

The optimized law is fed the exact importances w = s^2 (for independent directions the
surrogate sum W/xi is then the variance up to a constant); the heuristic law is fed s times
log-normal noise, a stand-in for an imperfect proxy such as next-token entropy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deployrl.algo._checks import check_positive
from deployrl.algo.prefix import STRATEGIES, cutoff_law, sample_plan
from deployrl.settings.command_line import CommandLine, Flag
from deployrl.settings.config import PSConfig
from deployrl.settings.docs import setting


@dataclass(frozen=True)
class Instance:
    mask: torch.Tensor  # [K, T]
    grads: torch.Tensor  # [K, T, D], zero on padding, already divided by the token count
    exact_weights: torch.Tensor  # [K, T]
    heuristic_weights: torch.Tensor  # [K, T]


def random_instance(
    group_size: int, max_len: int, dim: int, generator: torch.Generator
) -> Instance:
    lengths = torch.randint(max_len // 4, max_len + 1, (group_size,), generator=generator)
    positions = torch.arange(max_len)
    mask = positions[None, :] < lengths[:, None]  # [K, T]
    depth_decay = torch.exp(-positions / (max_len / 6))[None, :]
    scale = (depth_decay + 0.05) * torch.rand(group_size, 1, generator=generator).add(0.5)  # [K, T]
    scale = scale * torch.rand(group_size, max_len, generator=generator).add(0.5) * mask
    z = torch.randn(group_size, max_len, dim, generator=generator) / dim**0.5
    grads = scale[..., None] * z / mask.sum()  # token_mean aggregation
    noise = torch.exp(torch.randn(group_size, max_len, generator=generator))
    return Instance(mask, grads, scale.square(), scale * noise * mask)


def estimator_stats(
    strategy: str, inst: Instance, budget: float, xi_min: float, draws: int, generator: torch.Generator
) -> dict[str, float]:
    """Monte Carlo relative variance and bias of the prefix-sampled gradient."""
    group_size = inst.mask.shape[0]
    # the law fed gamma * u gets the instance's exact per-token variance weights, the others a noisy proxy
    weights = inst.exact_weights if STRATEGIES.get(strategy).uses_uncertainty else inst.heuristic_weights
    xi = cutoff_law(strategy, inst.mask, group_size, budget, xi_min, weights)
    full = inst.grads.sum(dim=(0, 1))  # [D]
    flat_grads = inst.grads.reshape(-1, inst.grads.shape[-1])  # [K*T, D]
    plans = [sample_plan(strategy, xi, inst.mask, generator) for _ in range(draws)]
    token_weights = torch.stack([p.weights.reshape(-1) for p in plans])  # [N, K*T]
    estimates = token_weights.double() @ flat_grads.double()  # [N, D]
    sq_err = (estimates - full.double()).square().sum(dim=1)  # [N]
    norm2 = full.double().square().sum()
    kept = torch.stack([p.keep.sum() for p in plans]).double()
    return {
        "rel_variance": float(sq_err.mean() / norm2),
        "rel_variance_se": float(sq_err.std() / draws**0.5 / norm2),
        "rel_bias": float((estimates.mean(0) - full).norm() / full.norm()),
        "expected_tokens": float(plans[0].expected_tokens) / group_size,
        "observed_tokens": float(kept.mean()) / group_size,
    }


@dataclass(frozen=True)
class SelfCheckConfig:
    """`deployrl selfcheck`: the random instance and the Monte Carlo draws."""

    group_size: int = setting(8, "completions per prompt (K)")
    max_len: int = setting(512, "longest completion (T), 4 or more")
    budget: float = setting(128.0, "expected tokens per completion (B)")
    xi_min: float = setting(0.01, "smallest inclusion probability")
    dim: int = setting(32, "dimension of the gradient vectors")
    draws: int = setting(2000, "Monte Carlo draws per strategy")
    seed: int = setting(0, "seed of the instance and the draws")

    def __post_init__(self) -> None:
        PSConfig(budget=self.budget, xi_min=self.xi_min)  # a training run's bounds on both
        if self.max_len < 4:
            raise ValueError(f"max_len must be >= 4 (completions are drawn from max_len/4 tokens up), got {self.max_len}")
        for name in ("group_size", "dim", "draws"):
            check_positive(name, getattr(self, name))


FLAGS = (
    Flag("--group-size", "group_size"),
    Flag("--max-len", "max_len"),
    Flag("--budget", "budget"),
    Flag("--xi-min", "xi_min"),
    Flag("--dim", "dim"),
    Flag("--draws", "draws"),
    Flag("--seed", "seed"),
)


def main(argv: list[str] | None = None) -> int:
    config, _ = CommandLine(
        "deployrl selfcheck", SelfCheckConfig,
        "Variance of the prefix-sampled gradient per cutoff strategy, at equal budget.", FLAGS,
    ).parse(argv)

    generator = torch.Generator().manual_seed(config.seed)
    inst = random_instance(config.group_size, config.max_len, config.dim, generator)
    mean_len = float(inst.mask.sum()) / config.group_size
    print(
        f"one group: K={config.group_size}, mean length {mean_len:.0f} tokens (max {config.max_len}), "
        f"budget B={config.budget:g} tokens per completion, xi_min={config.xi_min:g}, "
        f"{config.draws} draws per strategy"
    )
    header = f"{'strategy':<10} {'rel. variance':>20} {'rel. bias':>10} {'tokens/completion':>18} {'observed':>9}"
    print(header)
    print("-" * len(header))
    for strategy in STRATEGIES.names():
        stats = estimator_stats(strategy, inst, config.budget, config.xi_min, config.draws, generator)
        variance = f"{stats['rel_variance']:.4f} ± {stats['rel_variance_se']:.4f}"
        print(
            f"{strategy:<10} {variance:>20} {stats['rel_bias']:>10.4f} "
            f"{stats['expected_tokens']:>18.1f} {stats['observed_tokens']:>9.1f}"
        )
    print("rel. variance: E||G_hat - G||^2 / ||G||^2; rel. bias: ||mean G_hat - G|| / ||G|| (Monte Carlo noise).")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
