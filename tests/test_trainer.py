"""End-to-end training on a tiny random model with a character tokenizer."""

import math
from dataclasses import replace

import pytest
import torch

from deployrl.algo.prefix import cutoff_law, sample_plan
from deployrl.engines.base import SamplingParams, trainer_view
from deployrl.settings.config import load_config
from deployrl.settings.parsing import ConfigError
from deployrl.training.passes import micro_batches
from deployrl.training.trainer import Trainer


def toy_config(tmp_path, tiny_dir, *overrides):
    from tiny import toy_task_file

    task_file = toy_task_file(tmp_path)
    return load_config(None, [
        f"model.name={tiny_dir}", "model.lora.rank=0",  # full fine-tuning; tests/test_lora.py sets a rank
        "task.type=jsonl", f"task.path={task_file}", "task.reward=tiny:starts_with_digit", "task.instruction=",
        "rollout.engine=hf:bf16", "rollout.prompts_per_step=4", "rollout.group_size=6", "rollout.max_new_tokens=6",
        "rollout.context_length=256",
        "algo.ps.budget=3", "algo.ps.xi_min=0.05", "algo.dynamic_sampling=off",
        "optim.lr=0.01", "optim.warmup_steps=0",
        "steps=3", "save_every=100", "eval.num_prompts=0", "tensorboard=false",
        f"output_dir={tmp_path / 'run'}",
        *overrides,
    ])


VARIANTS = {
    "grpo": ["algo.correction=none", "algo.ps.strategy=full"],
    "dr_grpo_tis": ["algo.advantage=dr_grpo", "algo.aggregation=seq_mean_token_sum_norm", "algo.correction=tis",
                    "algo.ps.strategy=uniform"],
    # algo.ps.proxies=trainer: a no-grad pass over every token, the law from the trainer's proxies
    "rloo_mask_kl": ["algo.advantage=rloo", "algo.aggregation=seq_mean_token_mean", "algo.correction=mask",
                     "algo.kl_coef=0.1", "algo.ps.strategy=temporal", "algo.ps.proxies=trainer"],
    "dc_optimized": ["algo.correction=dc", "algo.ps.strategy=optimized", "algo.dc.penalty=hinge",
                     "algo.ps.proxies=trainer"],
    "dc_heuristic_epochs": ["algo.ps.strategy=heuristic", "algo.ppo_epochs=2", "algo.mini_batches=2",
                            "algo.dual_clip=3", "algo.micro_batch_tokens=16", "algo.ps.proxies=trainer"],
    "sgrpo": ["algo.ps.strategy=sgrpo"],
    "refill": ["algo.dynamic_sampling=refill", "algo.max_refill_rounds=3"],
    # engine proxies (the default): no trainer pass past a cutoff; one epoch fuses the no-grad pass into the graded one
    "prefix_temporal_tis": ["algo.ps.proxies=engine", "algo.ps.strategy=temporal", "algo.correction=tis"],
    "prefix_optimized_dc": ["algo.ps.proxies=engine", "algo.ps.strategy=optimized", "algo.dc.penalty=hinge"],
    "prefix_heuristic_mask_kl_epochs": ["algo.ps.proxies=engine", "algo.ps.strategy=heuristic", "algo.correction=mask",
                                       "algo.kl_coef=0.1", "algo.ppo_epochs=2", "algo.mini_batches=2"],
    # sequence-level corrections need logp_old on whole rows: with engine proxies a no-grad pass over every token
    "prefix_seq_tis": ["algo.ps.proxies=engine", "algo.ps.strategy=optimized", "algo.correction=seq_tis"],
    "seq_mask_trainer": ["algo.ps.proxies=trainer", "algo.correction=seq_mask", "algo.correction_cap=3"],
    "prefix_geo_mask_epochs": ["algo.ps.proxies=engine", "algo.correction=geo_mask", "algo.correction_cap=1.5",
                               "algo.ppo_epochs=2"],
    # the trainer computes on the engine's (bf16) weights, straight-through: prefix passes, DC, the KL reference
    "matched_prefix_dc_kl": ["model.match_engine=true", "algo.ps.proxies=engine", "algo.ps.strategy=optimized",
                             "algo.correction=dc", "algo.kl_coef=0.1"],
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_updates_every_parameter(variant, device, tmp_path, tiny_dir):
    trainer = Trainer(toy_config(tmp_path, tiny_dir, "steps=2", f"model.device={device}", *VARIANTS[variant]))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    history = trainer.run()
    assert len(history) == 2 and all(math.isfinite(m["loss"]) for m in history)
    unchanged = [n for n, p in trainer.model.named_parameters() if torch.equal(p, before[n])]
    assert not unchanged, f"{variant}: parameters that did not change: {unchanged}"


@pytest.mark.parametrize("variant", ["grpo", "dc_optimized", "prefix_optimized_dc"])
def test_reward_rises_on_a_trivially_learnable_task(variant, tmp_path, tiny_dir):
    trainer = Trainer(toy_config(tmp_path, tiny_dir, "steps=30", *VARIANTS[variant]))
    rewards = [m["reward/mean"] for m in trainer.run()]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.3 and last > 0.6, rewards


def test_dynamic_sampling_drops_and_refills_zero_variance_groups(tmp_path, tiny_dir):
    for mode in ("drop", "refill"):
        trainer = Trainer(toy_config(tmp_path / mode, tiny_dir, f"algo.dynamic_sampling={mode}"))
        rollouts, _ = collect(trainer)
        assert not bool((rollouts.rewards == rollouts.rewards[:, :1]).all(dim=1).any())
        sampled = len(rollouts.sampled_rewards)
        assert sampled == 4 if mode == "drop" else sampled >= 4
        assert rollouts.batch.completion_ids.shape[0] == 6 * len(rollouts.examples)


def test_overlong_shaping_lowers_the_reward_of_long_completions(tmp_path, tiny_dir):
    plain = Trainer(toy_config(tmp_path / "a", tiny_dir, "algo.dynamic_sampling=off"))
    shaped = Trainer(toy_config(tmp_path / "b", tiny_dir, "algo.dynamic_sampling=off", "algo.overlong_buffer=4"))
    (a, _), (b, _) = collect(plain), collect(shaped)  # same seeds: the same completions
    assert torch.equal(a.batch.completion_ids, b.batch.completion_ids)
    lengths = a.batch.lengths.reshape(a.rewards.shape).float()
    expected = a.rewards - ((lengths - 2) / 4).clamp(0, 1)  # max_new_tokens 6, buffer 4
    torch.testing.assert_close(b.rewards, expected)


def test_graded_pass_sees_only_the_sampled_prefixes(tmp_path, tiny_dir):
    trainer = Trainer(toy_config(tmp_path, tiny_dir, "algo.ps.strategy=uniform", "algo.ps.budget=2"))
    rollouts, view = collect(trainer)
    learner = trainer.learner
    old = learner.passes.old_pass(rollouts, view)
    plan = learner.passes.plan(rollouts, old.proxies())
    update = learner.update(rollouts, plan, view, old)
    assert update.tokens_graded == float(plan.cutoffs.sum())
    assert update.tokens_graded < 0.8 * float(rollouts.batch.mask.sum())


def collect(trainer):
    """The first step's rollouts of `trainer`, and the distribution its trainer recomputes."""
    rollouts = trainer.rollout.collect(trainer.stream, trainer.state.step)
    return rollouts, trainer_view(rollouts.batch.semantics, trainer.config.rollout.sampling(seed=0))


@pytest.mark.parametrize("variant", ["dc_optimized", "rloo_mask_kl", "matched_prefix_dc_kl"])
def test_update_gradient_does_not_depend_on_micro_batch_packing(variant, device, tmp_path, tiny_dir):
    """The gradient of one optimizer update is the same whether its rows go through the model in
    one call or packed into micro-batches of a few tokens (each group's prompt fed once per call)."""
    trainer = Trainer(toy_config(tmp_path, tiny_dir, *VARIANTS[variant], "algo.ps.strategy=uniform",
                                 f"model.device={device}"))
    learner = trainer.learner
    # float64: the packings sum in different orders, and in fp32 that rounding depends on the CPU's kernels
    trainer.model.double()
    rollouts, view = collect(trainer)
    old = learner.passes.old_pass(rollouts, view)
    plan = learner.passes.plan(rollouts, old.proxies())
    assert 0 < int(plan.cutoffs.sum()) < rollouts.batch.mask.sum()  # a real prefix sample
    gradients = []

    def record() -> None:  # in place of the optimizer step: the weights stay as they are
        gradients.append({n: p.grad.clone() for n, p in trainer.model.named_parameters()})

    learner.optimizer.step = record
    learner.scheduler.step = lambda: None
    learner.correction.tolerance = 0.0  # as if measured: DC's hinge needs c
    calls = []
    for budget in (100_000, 24, 8):
        learner.passes.config = replace(trainer.config, algo=replace(trainer.config.algo, micro_batch_tokens=budget))
        calls.append(learner.update(rollouts, plan, view, old).micro_batches)
    assert calls[0] == 1 < calls[1] < calls[2] and len(gradients) == 3
    for other in gradients[1:]:
        for name, grad in gradients[0].items():
            # each token's loss term is computed in float32 (the log-softmax), a few ulps (1.2e-7) off
            # whichever the packing, and summed in float64: a wrong prompt or denominator is O(1) off
            atol = 1e-5 * float(grad.abs().max())
            torch.testing.assert_close(other[name], grad, rtol=0, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


def test_resume_reproduces_the_uninterrupted_run(device, tmp_path, tiny_dir):
    settings = ("save_every=2", f"model.device={device}", *VARIANTS["dc_optimized"])
    straight = Trainer(toy_config(tmp_path / "a", tiny_dir, "steps=4", *settings))
    losses = [m["loss"] for m in straight.run()]

    config = toy_config(tmp_path / "b", tiny_dir, "steps=2", *settings)
    first = [m["loss"] for m in Trainer(config).run()]
    resumed = Trainer(toy_config(tmp_path / "b", tiny_dir, "steps=4", *settings), resume=True)
    assert resumed.state.step == 2
    second = [m["loss"] for m in resumed.run()]
    assert first + second == pytest.approx(losses, rel=1e-5, abs=1e-7)
    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(a, b, msg=name)


def test_run_directory_and_checkpoint(device, tmp_path, tiny_dir):
    trainer = Trainer(toy_config(tmp_path, tiny_dir, "steps=2", "save_every=1", "keep_last=1", "tensorboard=true",
                                 f"model.device={device}"))
    trainer.run()
    run = tmp_path / "run"
    assert (run / "config.yaml").is_file() and (run / "metrics.jsonl").is_file() and (run / "samples.jsonl").is_file()
    assert len(list((run / "checkpoints").iterdir())) == 1
    assert any((run / "plots").glob("*.png"))
    from deployrl.cpu import this_cpu
    from deployrl.training.runlog import read_jsonl

    started = [e for e in read_jsonl(run / "events.jsonl") if e["event"] == "started"]
    assert started == [{"step": 0, "event": "started", "cpu": this_cpu().describe(), "cpu_class": this_cpu().cls.value,
                        "device": str(trainer.world.device), "engine": trainer.config.rollout.engine}]
    written = trainer.export(tmp_path / "export")
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(written["hf"]).config.num_hidden_layers == 2


def test_config_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key 'algo\.dc\.tolerence'; did you mean 'algo\.dc\.tolerance'"):
        load_config(None, ["algo.dc.tolerence=0.01"])
    with pytest.raises(ConfigError, match=r"algo\.ps\.budget must be a number"):
        load_config(None, ["algo.ps.budget=lots"])
    with pytest.raises(ConfigError, match=r"unknown cutoff strategy 'optimised'.*'optimized'"):
        load_config(None, ["algo.ps.strategy=optimised"])
    with pytest.raises(ConfigError, match=r"unknown engine 'llama'"):
        load_config(None, ["rollout.engine=llama:q4_1"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("algo:\n  eps_low: 0.2\n  eps_hihg: 0.3\n")
    with pytest.raises(ConfigError, match=r"bad.yaml.*unknown key 'algo\.eps_hihg'; did you mean 'algo\.eps_high'"):
        load_config(bad)
    bad.write_text("algo: [1, 2\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:\d+: invalid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="exceeds algo.ps.budget"):
        load_config(None, ["algo.ps.xi_min=0.5", "algo.ps.budget=8"])


def test_micro_batches_pack_by_length_and_count_a_shared_prompt_once():
    assert micro_batches([0, 1, 2, 3], [0] * 4, [5, 1, 4, 2], token_budget=6) == [[1, 3], [2], [0]]
    # one prompt of 10 tokens per row: 11 + 12 > 20, every row in its own micro-batch
    assert micro_batches([0, 1, 2, 3], [10] * 4, [1, 2, 3, 4], token_budget=20) == [[0], [1], [2], [3]]
    # rows 0-1 and 2-3 share a prompt: 10 + 1 + 2 and 10 + 3 + 4 fit in 20, each group whole
    assert micro_batches([0, 1, 2, 3], [10] * 4, [1, 2, 3, 4], token_budget=20, groups=[0, 0, 1, 1]) == [[0, 1], [2, 3]]
    # groups go in order of their longest row, rows by length within a group
    assert micro_batches([0, 1, 2, 3], [1] * 4, [9, 1, 2, 3], token_budget=100, groups=[0, 0, 1, 1]) == [[2, 3, 1, 0]]


@pytest.mark.slow
def test_embedded_default_runs_two_steps(tmp_path):
    config = load_config(None, ["steps=2", "rollout.max_new_tokens=24", "eval.num_prompts=2", f"output_dir={tmp_path / 'run'}",
                                "tensorboard=false"])
    history = Trainer(config).run()
    assert len(history) == 4 and "eval/pass@1" in history[0] and "eval/pass@1" in history[-1]  # before and after
    assert history[1]["dc/mean_D"] > 0 and history[2]["dc/lambda"] >= 0


def test_example_configs_are_valid(tmp_path):
    from pathlib import Path

    examples = Path(__file__).parents[1] / "examples"
    arith = load_config(examples / "arith.yaml")
    assert arith.algo.ps.strategy == "optimized" and arith.task.rg_config["max_digits"] == 1
    data = tmp_path / "train.jsonl"
    data.write_text('{"question": "1+1?", "answer": "2"}\n')
    gsm = load_config(examples / "grpo_gsm8k.yaml", [f"task.path={data}"])
    assert gsm.algo.correction == "none" and gsm.eval.task.name == "gsm8k"


def test_eval_command_scores_a_task(tiny_dir, tmp_path, capsys):
    import json

    from deployrl.cli import main as cli

    out = tmp_path / "scores.json"
    assert cli(["eval", "--model", str(tiny_dir), "--engine", "hf:fp32", "--task", "basic_arithmetic",
                "--num-prompts", "3", "--samples", "2", "--max-new-tokens", "4", "--json", str(out)]) == 0
    assert "basic_arithmetic" in capsys.readouterr().out
    scores = json.loads(out.read_text())
    assert scores["problems"] == 3 and 0 <= scores["pass@1"] <= scores["pass@2"] <= 1


def test_eval_command_defaults_to_the_default_runs_held_out_problems():
    """`deployrl eval` without a task scores what a default run's own evaluation scores (the training
    task, seed 1); `--task` names a dataset with that dataset's own settings."""
    from deployrl.commands.evaluate import COMMAND_LINE
    from deployrl.settings.config import held_out_task, load_config

    default, _ = COMMAND_LINE.parse([])
    assert default.task == held_out_task(load_config(None, []))
    chain, _ = COMMAND_LINE.parse(["--task", "chain_sum"])
    assert (chain.task.name, chain.task.rg_config, chain.task.instruction) == ("chain_sum", {}, None)


def test_eval_stops_at_either_end_token_of_the_generation_config(tiny_dir, tmp_path):
    """A model whose generation_config lists two end tokens: `deployrl eval` stops at whichever comes first."""
    import json
    import shutil

    from deployrl.cli import main as cli
    from deployrl.engines.hf import HFEngine
    from deployrl.models.loading import load_model, load_tokenizer, resolve_model
    from deployrl.settings.task import ReasoningGymTask
    from deployrl.tasks import load_task
    from deployrl.tasks.prompts import encode_prompts

    task = ReasoningGymTask(name="basic_arithmetic", seed=1)
    source = resolve_model(str(tiny_dir))
    tokenizer = load_tokenizer(source)
    prompt = encode_prompts(tokenizer, [load_task(task).examples[0].prompt])
    greedy = HFEngine(load_model(source, "fp32", False, False), "fp32", [tokenizer.eos_token_id]).generate(
        prompt, SamplingParams(top_k=1, max_new_tokens=12)).completions()[0]
    firsts = [t for i, t in enumerate(greedy) if t not in greedy[:i]]  # each token where it first appears
    assert len(firsts) >= 3, greedy
    early, late = firsts[1], firsts[2]  # tokens that greedy decoding reaches at positions i < j
    never = next(t for t in range(3, 100) if t not in greedy)

    def eval_length(end_tokens: list[int]) -> float:
        model_dir = tmp_path / f"model-{'-'.join(map(str, end_tokens))}"
        shutil.copytree(tiny_dir, model_dir)
        config = json.loads((model_dir / "generation_config.json").read_text())
        (model_dir / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": end_tokens}))
        out = model_dir / "scores.json"
        assert cli(["eval", "--model", str(model_dir), "--engine", "hf:fp32", "--task", "basic_arithmetic",
                    "--num-prompts", "1", "--greedy", "--max-new-tokens", "12", "--json", str(out)]) == 0
        return json.loads(out.read_text())["mean_length"]

    assert eval_length([late, early]) == greedy.index(early) + 1  # the first of the two reached
    assert eval_length([never, late]) == greedy.index(late) + 1  # the other one stops it too


def test_old_pass_in_micro_batches_equals_one_pass(tmp_path, tiny_dir):
    trainer = Trainer(toy_config(tmp_path, tiny_dir, "algo.kl_coef=0.1", "algo.micro_batch_tokens=100000"))
    learner = trainer.learner
    rollouts, view = collect(trainer)
    for proxies in (("entropy",), ("entropy", "grad_norm", "uncertainty")):  # micro-batches of rows, of groups
        learner.passes.config = replace(trainer.config, algo=replace(trainer.config.algo, micro_batch_tokens=100000))
        whole = learner.passes.old_pass(rollouts, view, proxies)
        learner.passes.config = replace(trainer.config, algo=replace(trainer.config.algo, micro_batch_tokens=8))
        split = learner.passes.old_pass(rollouts, view, proxies)
        for name in ("logp", "logp_ref", "entropy", "grad_norm", "uncertainty"):
            if getattr(whole, name) is not None:
                torch.testing.assert_close(getattr(split, name), getattr(whole, name), atol=1e-5, rtol=1e-5, msg=name)
        assert (whole.grad_norm is None) == ("grad_norm" not in proxies)


def test_kernel_self_check_stops_a_garbage_engine_before_training(tmp_path, tiny_dir, monkeypatch):
    from deployrl.engines.check import KernelMismatch
    from deployrl.engines.hf import HFEngine

    healthy = Trainer(toy_config(tmp_path / "a", tiny_dir, "steps=1"))
    healthy.sync_engine()  # the check after a sync passes too
    score = HFEngine.score

    def garbage(self, token_ids):  # what a broken kernel returns: log-probabilities of noise
        logp = score(self, token_ids)
        return (torch.randn(len(token_ids) - 1, 100, generator=torch.Generator().manual_seed(0)) * 3).log_softmax(-1)[:, 0] + 0 * logp

    monkeypatch.setattr(HFEngine, "score", garbage)
    with pytest.raises(KernelMismatch, match=r"engine hf:bf16 fails its kernel self-check: .* differ from the trainer's by \d"):
        Trainer(toy_config(tmp_path / "b", tiny_dir, "steps=1"))


def recorded_gradients(learner):
    """Replace the learner's optimizer step by recording the flat gradient: the weights never move."""
    gradients = []
    learner.optimizer.step = lambda: gradients.append(
        torch.cat([p.grad.reshape(-1) for p in learner.model.parameters() if p.grad is not None]).clone()
    )
    learner.scheduler.step = lambda: None
    return gradients


@pytest.mark.parametrize("matched", [False, True])
@pytest.mark.parametrize("correction", ["dc", "tis", "mask"])
def test_prefix_only_update_equals_the_full_pass_update(correction, matched, device, tmp_path, tiny_dir):
    """For the same cutoffs, the update with logp_old from a no-grad pass over every token, from one
    over the prefixes only, and fused into the graded pass (no no-grad pass) has one gradient; also
    with the trainer on the engine's weights (model.match_engine)."""
    trainer = Trainer(toy_config(tmp_path, tiny_dir, "algo.ps.proxies=engine", "algo.ps.strategy=temporal",
                                 f"model.device={device}", f"model.match_engine={str(matched).lower()}",
                                 f"algo.correction={correction}", "algo.dc.penalty=hinge", "algo.correction_cap=1.05"))
    trainer.model.double()  # as in the packing test: float32 log-softmax per token, summed in float64
    learner = trainer.learner
    rollouts, view = collect(trainer)
    mask = rollouts.batch.mask
    plan = learner.passes.plan(rollouts, {})  # the temporal law needs no proxies
    assert 0 < int(plan.cutoffs.sum()) < int(mask.sum())  # a real prefix sample
    gradients = recorded_gradients(learner)
    full = learner.passes.old_pass(rollouts, view)
    prefix = learner.passes.old_pass(rollouts, view, cutoffs=plan.cutoffs)
    fed = torch.arange(mask.shape[1])[None, :] < plan.cutoffs[:, None]
    assert (prefix.logp[~fed] == 0).all() and not (full.logp[mask & ~fed] == 0).any()
    learner.correction.tolerance = 0.01
    if correction == "dc":
        learner.correction.lam = 0.5
    results = [learner.update(rollouts, plan, view, old) for old in (full, prefix, None)]
    torch.testing.assert_close(results[2].logp_old[fed], full.logp[fed], rtol=0, atol=1e-6)
    for other in gradients[1:]:
        torch.testing.assert_close(other, gradients[0], rtol=0, atol=1e-5 * float(gradients[0].abs().max()))
    assert results[0].loss == pytest.approx(results[2].loss, rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("matched", [False, True])
def test_prefix_only_update_gradient_is_unbiased(matched, tmp_path, tiny_dir):
    """Monte Carlo through the real loss and backward: the mean over cutoff draws of the fused
    prefix-only update's gradient is the full-trajectory gradient, and normalising by the kept
    tokens instead of the real ones (the biased variant) is caught. Checked on projections of the
    gradient (onto itself and random directions), each a mean of many independent draws; also with
    the trainer on the engine's weights (model.match_engine: straight-through, the same estimator)."""
    trainer = Trainer(toy_config(tmp_path, tiny_dir, f"model.match_engine={str(matched).lower()}",
                                 "algo.ps.proxies=engine", "algo.ps.strategy=uniform",
                                 "algo.correction=none", "algo.ps.budget=2", "optim.grad_clip=0"))  # clipping is not linear
    trainer.model.double()
    learner = trainer.learner
    rollouts, view = collect(trainer)
    mask, k = rollouts.batch.mask, rollouts.batch.group_size
    gradients = recorded_gradients(learner)
    everything = sample_plan("full", cutoff_law("full", mask, k, 1.0), mask, learner.passes.generator)
    learner.update(rollouts, everything, view)
    full = gradients.pop()
    draws, kept = 600, []
    for _ in range(draws):
        plan = learner.passes.plan(rollouts, {})
        kept.append(float(plan.keep.sum()))
        learner.update(rollouts, plan, view)
    assert sum(kept) < 0.6 * draws * float(mask.sum())  # a real subsample
    directions = torch.cat([full[None] / full.norm(), torch.randn(8, full.numel(), generator=torch.Generator().manual_seed(0),
                                                                  dtype=full.dtype)])
    estimates = torch.stack(gradients) @ directions.T  # [draws, 9]
    target = directions @ full

    def z(samples: torch.Tensor) -> torch.Tensor:
        return (samples.mean(0) - target).abs() / (samples.std(0) / draws ** 0.5)

    assert z(estimates).max() < 5, z(estimates)
    # token_mean divides by the real tokens; by the kept ones instead, each draw's gradient scales by real / kept
    biased = estimates * (float(mask.sum()) / torch.tensor(kept, dtype=full.dtype).clamp(min=1))[:, None]
    assert z(biased)[0] > 10, z(biased)


def test_the_tolerance_waits_for_a_batch_with_a_kept_token(tmp_path, tiny_dir):
    """With engine proxies DC's c comes from D_hat of the kept tokens: a first batch that kept none
    (D_hat = 0) must not set c = 0, which would push lambda up at every step after."""
    trainer = Trainer(toy_config(tmp_path, tiny_dir, "algo.ps.proxies=engine", "algo.correction=dc", "steps=2"))
    plan, calls = trainer.learner.passes.plan, []

    def first_keeps_nothing(rollouts, proxies):
        drawn = plan(rollouts, proxies)
        calls.append(drawn)
        if len(calls) > 1:
            return drawn
        return replace(drawn, keep=torch.zeros_like(drawn.keep), weights=torch.zeros_like(drawn.weights),
                       cutoffs=torch.zeros_like(drawn.cutoffs))

    trainer.learner.passes.plan = first_keeps_nothing
    first = trainer.step()
    correction = trainer.learner.correction
    assert correction.tolerance is None and first["ps/tokens_kept"] == 0 and first["dc/mean_D"] == 0
    trainer.step()
    assert correction.tolerance is not None and correction.tolerance > 0


def test_dropout_keeps_the_no_grad_pass(tmp_path, tiny_dir):
    """The fused update takes logp_old from the graded pass, which runs in training mode: with dropout
    it would be a noisy logp_old (and delta), so the prefix no-grad pass stays."""
    plain = Trainer(toy_config(tmp_path / "a", tiny_dir, "algo.ps.proxies=engine", "model.lora.rank=4"))
    assert plain.learner.passes.fusable()
    noisy = Trainer(toy_config(tmp_path / "b", tiny_dir, "algo.ps.proxies=engine", "model.lora.rank=4",
                               "model.lora.dropout=0.1", "algo.dc.tolerance=0.01"))  # DC ready: c is known
    learner = noisy.learner
    assert not learner.passes.fusable() and learner.correction.ready()
    rollouts, view = collect(noisy)
    prepared = learner.order.prepare(learner.passes, rollouts, view, learner.correction)
    assert prepared.old is not None and (prepared.old.logp[prepared.plan.keep] != 0).all()
