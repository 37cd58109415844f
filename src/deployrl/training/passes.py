"""The trainer model's passes over a step's rollouts, which the PS-PPO order and the update compose.

    old_pass    no-grad pass: logp_old, logp_ref and the cutoff law's proxies over the full
                completions, or logp_old and logp_ref over each row's prefix up to its cutoff
    plan        the PS-PPO cutoff plan: which prefix of each completion is backpropagated
    run_micro_batches   the one micro-batch runner of both passes (the graded one is the learner's)

Rows go through the model in micro-batches of `algo.micro_batch_tokens` (`micro_batches`). Under
torchrun the model is sharded with FSDP2; each rank computes a share of the rows and every rank
makes the same number of model calls (`rank_schedule`), since each call is a collective.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, TypeVar

import torch
from torch import nn

from deployrl.algo.logprobs import SamplingView
from deployrl.algo.prefix import (
    PrefixPlan,
    cutoff_law,
    engine_proxies,
    grad_norm_proxy,
    group_stats,
    law_weights,
    sample_plan,
)
from deployrl.engines import held_weights
from deployrl.models.loading import (
    DTYPES,
    Scorer,
    decoder_blocks,
    has_dropout,
    resolve_model,
    shares_prompts,
    token_logprobs,
)
from deployrl.models.matching import HeldWeights
from deployrl.settings.config import TrainConfig
from deployrl.settings.model import Autocast
from deployrl.training.distributed import World, balanced_shares, gather_in_order, shard
from deployrl.training.rollout import Rollouts

T = TypeVar("T")


@dataclass
class OldPass:
    """The trainer's no-grad pass over the full completions; the proxies it was asked for."""

    logp: torch.Tensor  # [B, T] logp_old
    logp_ref: Optional[torch.Tensor]  # [B, T] reference policy, when the KL term is on
    entropy: Optional[torch.Tensor] = None  # [B, T]
    grad_norm: Optional[torch.Tensor] = None  # [B, T] gamma
    uncertainty: Optional[torch.Tensor] = None  # [G, T] reward uncertainty u

    def proxies(self) -> dict[str, torch.Tensor]:
        """The cutoff-law proxies by name (algo.prefix.CutoffStrategy.proxies), those computed."""
        named = {"entropy": self.entropy, "grad_norm": self.grad_norm, "uncertainty": self.uncertainty}
        return {name: value for name, value in named.items() if value is not None}


def micro_batches(
    rows: list[int], prompt_tokens: list[int], completion_tokens: list[int], token_budget: int,
    groups: Optional[list[int]] = None,
) -> list[list[int]]:
    """`rows` packed greedily into micro-batches of at most `token_budget` tokens (a row alone may exceed it).

    A micro-batch costs its rows' completion tokens plus, once per group it holds, the group's
    prompt tokens: the rows of a group share their prompt (models.completion_hidden). With
    `groups=None` every row is its own group. Groups go in order of their longest row and rows by
    length within a group, so that a micro-batch holds whole groups of similar lengths.
    """
    group = groups if groups is not None else list(range(len(completion_tokens)))
    longest: dict[int, int] = {}
    for row in rows:
        longest[group[row]] = max(longest.get(group[row], 0), completion_tokens[row])
    batches, current, held, used = [], [], set(), 0
    for row in sorted(rows, key=lambda r: (longest[group[r]], group[r], completion_tokens[r])):
        cost = completion_tokens[row] + (0 if group[row] in held else prompt_tokens[row])
        if current and used + cost > token_budget:
            batches.append(current)
            current, held, used = [], set(), 0
            cost = completion_tokens[row] + prompt_tokens[row]
        current.append(row)
        held.add(group[row])
        used += cost
    if current:
        batches.append(current)
    return batches


def rank_schedule(plans: list[list[T]], rank: int) -> Iterator[Optional[T]]:
    """Rank `rank`'s micro-batches `plans[rank]`, then None until the rank with the most is done:
    at a None the rank makes a filler call, so that every rank makes as many (FSDP collectives)."""
    mine = plans[rank]
    for call in range(max(len(plan) for plan in plans)):
        yield mine[call] if call < len(mine) else None


class Passes:
    """The trainer's model and its reference copy (KL term) as scorers, sharded over the ranks of
    `world` when distributed, with the generator of the cutoff draws and the mini-batch order."""

    def __init__(self, config: TrainConfig, model: nn.Module, world: World) -> None:
        self.config, self.model, self.world = config, model, world
        ref_model = copy.deepcopy(model).eval().requires_grad_(False) if config.algo.kl_coef > 0 else None
        # every use of the weights goes through these calls (what FSDP needs)
        autocast = Autocast(config.model.autocast).dtype(world.device, DTYPES[config.model.dtype])
        self.scorer = Scorer(model, autocast, self._held_weights(model))
        self.ref_scorer = Scorer(ref_model, autocast, self._held_weights(ref_model)) if ref_model is not None else None
        if world.distributed:
            for scorer in filter(None, (self.scorer, self.ref_scorer)):
                shard(scorer, decoder_blocks(scorer.model), world, DTYPES[config.model.dtype])
        self.generator = torch.Generator().manual_seed(config.seed)
        self.dropout = has_dropout(model)

    def _held_weights(self, model: nn.Module) -> Optional[HeldWeights]:
        """With model.match_engine, what the rollout engine holds of `model`'s weights; under FSDP2
        rounded at each forward, not cached (a cached rounding would hold every weight whole)."""
        config = self.config
        if not config.model.match_engine:
            return None
        return held_weights(config.rollout.engine, model, resolve_model(config.model.name),
                            cache=not self.world.distributed, lora_serving=config.rollout.lora_serving)

    def weights_changed(self) -> None:
        """The optimizer updated the weights: the engine's rounding of them is computed anew (a fused
        AdamW step updates in place without bumping the tensors' version counters)."""
        if self.scorer.held_weights:
            self.scorer.held_weights.forget()

    def micro_batch_plans(
        self, units: list[int], prompt_tokens: list[int], completion_tokens: list[int], groups: Optional[list[int]],
    ) -> list[list[list[int]]]:
        """Every rank's micro-batches of `units` (rows or groups, indexing the token lists): shares
        balanced by tokens, each packed by `micro_batches`."""
        costs = [prompt_tokens[u] + completion_tokens[u] for u in units]
        return [micro_batches([units[i] for i in share], prompt_tokens, completion_tokens,
                              self.config.algo.micro_batch_tokens, groups)
                for share in balanced_shares(costs, self.world.size)]

    def run_micro_batches(self, plans: list[list[list[int]]], call: Callable[[list[int]], None],
                          backward: bool = False) -> None:
        """`call` on each of this rank's micro-batches; a filler call of each scorer in use where
        another rank has more (FSDP's collectives pair up across ranks)."""
        scorers = [self.scorer] if backward else list(filter(None, (self.scorer, self.ref_scorer)))
        for micro in rank_schedule(plans, self.world.rank):
            if micro is not None:
                call(micro)
                continue
            for scorer in scorers:
                self._filler_call(scorer, backward)

    @torch.no_grad()
    def old_pass(
        self, rollouts: Rollouts, view: SamplingView, proxies: tuple[str, ...] = (),
        cutoffs: Optional[torch.Tensor] = None,
    ) -> OldPass:
        """logp_old (and logp_ref, `proxies`) over the full completions, in micro-batches; with
        `cutoffs` [B], over each row's first cutoffs[row] tokens only (the rest stays 0).

        `proxies` (those the PS-PPO order has the trainer compute) are among entropy, grad_norm and
        uncertainty. For grad_norm and uncertainty the micro-batches hold whole groups
        and the output head runs per group, so that u and the token statistics share its
        probabilities. Each rank computes a share of the rows (of the groups) balanced by tokens;
        the results are gathered.
        """
        k = rollouts.batch.group_size
        batch = rollouts.batch if cutoffs is None else rollouts.batch.prefixes(cutoffs)
        if not batch.mask.any():  # every row cut at 0: nothing to compute (the same on every rank)
            zeros = torch.zeros(rollouts.batch.mask.shape)
            return OldPass(logp=zeros, logp_ref=zeros.clone() if self.ref_scorer is not None else None)
        by_group = bool({"grad_norm", "uncertainty"} & set(proxies))
        lengths = [len(p) + int(n) for p, n in zip(batch.prompt_ids, batch.mask.sum(dim=1).tolist())]
        unit_rows = [list(range(g * k, (g + 1) * k)) for g in range(len(rollouts.examples))] if by_group else [
            [row] for row in range(len(lengths))
        ]
        prompt_tokens = [len(batch.prompt_ids[rows[0]]) for rows in unit_rows]
        completion_tokens = [sum(lengths[r] for r in rows) - p for rows, p in zip(unit_rows, prompt_tokens)]
        groups = [rows[0] // k for rows in unit_rows] if shares_prompts(self.model) else None
        plans = self.micro_batch_plans(list(range(len(unit_rows))), prompt_tokens, completion_tokens, groups)
        parts: dict[str, list[torch.Tensor]] = defaultdict(list)
        self.run_micro_batches(plans, lambda units: self._old_micro_batch(
            rollouts, batch, view, [r for unit in units for r in unit_rows[unit]], units, proxies, parts))
        row_orders = [[r for micro in plan for unit in micro for r in unit_rows[unit]] for plan in plans]
        return self._gather_old(parts, row_orders, [[u for micro in plan for u in micro] for plan in plans],
                                batch.mask.shape[1] if cutoffs is None else rollouts.batch.mask.shape[1], by_group,
                                "entropy" in proxies)

    def _old_micro_batch(self, rollouts: Rollouts, batch, view: SamplingView, rows: list[int], units: list[int],
                         proxies: tuple[str, ...], parts: dict[str, list[torch.Tensor]]) -> None:
        """The no-grad pass over `rows` (whole groups `units` when the law's group proxies are asked for)."""
        cfg, k = self.config, batch.group_size
        with_entropy, success = "entropy" in proxies, rollouts.successes()  # [G, K]
        index = torch.tensor(rows)
        prompts, completions, mask = [batch.prompt_ids[r] for r in rows], batch.completion_ids[index], batch.mask[index]
        if {"grad_norm", "uncertainty"} & set(proxies):
            chunk = max(1, cfg.model.chunk_tokens // k)

            def reduce(hidden: torch.Tensor, head: torch.Tensor) -> list:
                on = hidden.device
                return [group_stats(hidden[i * k:(i + 1) * k], head, completions[i * k:(i + 1) * k].to(on),
                                    mask[i * k:(i + 1) * k].to(on), success[g].to(on), cfg.algo.ps.uncertainty, view,
                                    chunk, with_entropy=with_entropy)
                        for i, g in enumerate(units)]

            stats = self.scorer(prompts, completions, mask, reduce)
            for name in ("logp", "entropy", "sum_p2", "hidden_norm"):
                parts[name] += [getattr(group, name) for group in stats]
            parts["uncertainty"] += [group.uncertainty[None] for group in stats]
        else:
            stats = token_logprobs(self.scorer, prompts, completions, mask, view, cfg.model.chunk_tokens, with_entropy)
            parts["logp"].append(stats.logp)
            parts["entropy"].append(stats.entropy)
        if self.ref_scorer is not None:
            parts["logp_ref"].append(
                token_logprobs(self.ref_scorer, prompts, completions, mask, view, cfg.model.chunk_tokens).logp
            )

    def _gather_old(self, parts: dict[str, list[torch.Tensor]], row_orders: list[list[int]],
                    unit_orders: list[list[int]], width: int, by_group: bool, with_entropy: bool) -> OldPass:
        """The OldPass of every rank's `parts`, rows (units) in global order, [B, width]."""

        def gathered(name: str, orders: list[list[int]] = row_orders) -> Optional[torch.Tensor]:
            """The global [rows, width] tensor of this rank's pieces (None when the pass did not compute it)."""
            pieces = parts.get(name)
            if not pieces or pieces[0] is None:
                return None
            local = torch.cat([nn.functional.pad(t, (0, width - t.shape[1])) for t in pieces]).cpu()
            return gather_in_order(local, orders, self.world)[:, :width]

        logp = gathered("logp")
        old = OldPass(logp=logp, logp_ref=gathered("logp_ref"), entropy=gathered("entropy") if with_entropy else None)
        if by_group:
            old.grad_norm = grad_norm_proxy(logp, gathered("sum_p2"), gathered("hidden_norm"))
            old.uncertainty = gathered("uncertainty", unit_orders)
        return old

    def _filler_call(self, scorer: Scorer, backward: bool = False) -> None:
        """A one-token call of `scorer` whose result is zero, for a rank with fewer micro-batches than
        another: FSDP's collectives must pair up across ranks. With `backward` it is backpropagated."""
        token = torch.zeros(1, 1, dtype=torch.long)
        out = scorer([[0]], token, torch.ones(1, 1, dtype=torch.bool), lambda hidden, head: (hidden.sum() + head.sum()) * 0)
        if backward:
            out.backward()

    def fusable(self) -> bool:
        """Whether an update could take logp_old from its own graded pass (detached) instead of a no-grad
        pass before it: one PPO epoch, one mini-batch, no KL term, no dropout (dropout would make that
        logp_old, and delta, noisier than the policy's). The order decides whether it does."""
        algo = self.config.algo
        return algo.ppo_epochs == 1 and algo.mini_batches == 1 and algo.kl_coef == 0 and not self.dropout

    def engine_proxies(self, rollouts: Rollouts) -> dict[str, torch.Tensor]:
        """The cutoff law's proxies from the engine's per-token statistics."""
        ps, batch = self.config.algo.ps, rollouts.batch
        return engine_proxies(batch.logp_inf, batch.stats, batch.mask, rollouts.successes(), ps.uncertainty)

    def plan(self, rollouts: Rollouts, proxies: dict[str, torch.Tensor]) -> PrefixPlan:
        """The PS-PPO plan: the configured law, solved from `proxies` (trainer's or engine's), and one draw."""
        ps, mask, k = self.config.algo.ps, rollouts.batch.mask, rollouts.batch.group_size
        xi = cutoff_law(ps.strategy, mask, k, ps.budget, ps.xi_min, law_weights(ps.strategy, proxies, k))
        return sample_plan(ps.strategy, xi, mask, self.generator)
