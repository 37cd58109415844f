"""The llama.cpp engine on a tiny random Llama that carries SmolLM2's tokenizer and metadata."""

import copy

import pytest
import torch

from deployrl.algo.discrepancy import token_discrepancy
from deployrl.engines import make_engine
from deployrl.engines.base import SamplingParams, trainer_view
from deployrl.engines.check import GAP_BOUNDS, KernelMismatch, check_engine, reference_logprobs
from deployrl.engines.gguf_io import write_gguf
from deployrl.engines.llama_runtime import LlamaRuntime, extra_buffers_allowed
from deployrl.engines.llamacpp import LlamaCppEngine
from deployrl.models.loading import load_model, resolve_model, token_logprobs

PROMPTS = [[1, 9690, 198, 2683, 359], [1, 4093, 314]]
EOS = [2]


@pytest.fixture(scope="module")
def template():
    return resolve_model("smollm2-135m").gguf_path


@pytest.fixture(scope="module")
def model():
    from tiny import tiny_model

    return tiny_model("llama", vocab_size=49152, hidden_size=64, init_std=0.05)


def mean_delta(model, batch, params, signal="diff"):
    with torch.no_grad():
        logp_old = token_logprobs(model, batch.prompt_ids, batch.completion_ids, batch.mask,
                                  trainer_view(batch.semantics, params)).logp
    return token_discrepancy(logp_old, batch.logp_inf, batch.mask, signal)[batch.mask].mean().item()


def test_f32_gguf_round_trips_through_transformers(model, template, tmp_path):
    path = write_gguf(model.state_dict(), model.config, template, tmp_path / "tiny.gguf", "f32")
    loaded = load_model(resolve_model(str(path)))
    assert loaded.config.num_hidden_layers == 2 and loaded.config.hidden_size == 64
    for name, value in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], value, atol=0, rtol=0, msg=name)
    # The GGUF quantizer marker is cleared: the loaded model trains and saves.
    loaded.model.embed_tokens.weight.sum().backward()
    assert loaded.model.embed_tokens.weight.grad is not None
    loaded.save_pretrained(tmp_path / "saved")
    assert (tmp_path / "saved" / "model.safetensors").is_file()


def test_file_types_give_ordered_discrepancy(model, template):
    params = SamplingParams(n=3, max_new_tokens=24, seed=5)
    deltas = {}
    for file_type in ("f32", "f16", "q8_0", "q4_1"):
        engine = LlamaCppEngine(model.state_dict(), model.config, template, file_type, EOS, n_ctx=256)
        # |log p_old - log p_inf|: the tiny model's probabilities are ~1/49152, so |dp| says little
        deltas[file_type] = mean_delta(model, engine.generate(PROMPTS, params), params, "log")
    assert deltas["f32"] < 5e-4
    assert deltas["f32"] < deltas["f16"] < deltas["q8_0"] < deltas["q4_1"], deltas


def test_sync_seeds_and_lengths(model, template):
    trainer = copy.deepcopy(model)
    engine = LlamaCppEngine(trainer.state_dict(), trainer.config, template, "f16", EOS, n_ctx=256)
    params = SamplingParams(n=2, max_new_tokens=9, seed=3)
    first, again = engine.generate(PROMPTS, params), engine.generate(PROMPTS, params)
    assert torch.equal(first.completion_ids, again.completion_ids)
    assert first.lengths.max() <= 9 and first.timing.tokens_per_s > 0
    assert all(r == "length" for r in first.finish_reasons if r != "stop")

    torch.manual_seed(0)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine.sync(trainer.state_dict())
    batch = engine.generate(PROMPTS, SamplingParams(n=3, max_new_tokens=16, seed=4))
    assert mean_delta(trainer, batch, params) < mean_delta(model, batch, params) / 10


def test_bad_input(model, template, tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF template not found"):
        LlamaCppEngine(model.state_dict(), model.config, tmp_path / "none.gguf", "q4_1", EOS)
    with pytest.raises(ValueError, match="unknown llamacpp file type 'q4_k'"):
        LlamaCppEngine(model.state_dict(), model.config, template, "q4_k", EOS)
    engine = LlamaCppEngine(model.state_dict(), model.config, template, "f16", EOS, n_ctx=64)
    with pytest.raises(ValueError, match="exceeds the engine's context of 64"):
        engine.generate([[1] * 60], SamplingParams(max_new_tokens=8))


@pytest.mark.slow
def test_real_model_requantises_bit_for_bit(template, tmp_path):
    model = load_model(resolve_model("smollm2-135m"))
    written = write_gguf(model.state_dict(), model.config, template, tmp_path / "q4_1.gguf", "q4_1")
    assert written.read_bytes() == template.read_bytes()


@pytest.mark.slow
def test_real_model_engines_are_ordered(template):
    """F16 < Q8_0 < Q4_1 once the weights leave the Q4_1 grid they were loaded from (after training)."""
    source = resolve_model("smollm2-135m")
    model = load_model(source)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.add_(0.02 * p.std() * torch.randn_like(p))
    params = SamplingParams(n=2, max_new_tokens=32, seed=0)
    prompts = [[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 7018, 2, 198, 1, 4093, 198, 1780, 314, 216, 33, 32, 35, 216, 39, 47, 2, 198, 1, 520, 9531, 198]]
    deltas = {}
    for file_type in ("f16", "q8_0", "q4_1"):
        engine = make_engine(f"llamacpp:{file_type}", model, source, EOS)
        deltas[file_type] = mean_delta(model, engine.generate(prompts, params), params)
    assert deltas["f16"] < deltas["q8_0"] < deltas["q4_1"], deltas
    assert 1e-4 < deltas["q4_1"] < 0.05, deltas


def test_amx_flags_turn_the_extra_buffers_off(model, template, tmp_path):
    """Fed an AMX CPU's flags, the constructor loads without extra buffers (no AMX or repacked
    weights), whatever CPU the test runs on."""
    path = write_gguf(model.state_dict(), model.config, template, tmp_path / "q4_0.gguf", "q4_0")
    assert extra_buffers_allowed(["avx2", "fma", "avx512f"])
    assert not extra_buffers_allowed(["avx512f", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"])
    amx = LlamaRuntime(path, n_ctx=64, flags=["avx512f", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"])
    assert not amx.use_extra_buffers
    assert amx.buffer_types and not any("AMX" in b or "REPACK" in b for b in amx.buffer_types), amx.buffer_types
    logp = amx.score(PROMPTS[0])
    assert logp.shape == (4,) and bool(torch.isfinite(logp).all())
    assert LlamaRuntime(path, n_ctx=64, flags=["avx2", "fma"]).use_extra_buffers


@pytest.mark.parametrize("file_type", ["f32", "q4_1"])
def test_kernel_self_check_passes_healthy_and_stops_corrupted_logits(model, template, file_type, monkeypatch):
    engine = LlamaCppEngine(model.state_dict(), model.config, template, file_type, EOS, n_ctx=256)
    ids = PROMPTS[0] + PROMPTS[1] + PROMPTS[0]
    reference = reference_logprobs(model, ids)
    assert check_engine(engine, reference, ids) < GAP_BOUNDS[engine.name] / 10
    decode = LlamaRuntime.decode

    def corrupted(self, *args):  # garbage logits, as a broken kernel returns them
        logits = decode(self, *args)
        return logits + 3 * torch.randn(logits.shape, generator=torch.Generator().manual_seed(0))

    monkeypatch.setattr(LlamaRuntime, "decode", corrupted)
    with pytest.raises(KernelMismatch, match=rf"engine llamacpp:{file_type} fails its kernel self-check"):
        check_engine(engine, reference, ids)


@pytest.mark.parametrize("file_type", ["f32", "q4_1"])
def test_batched_decoding_samples_what_one_at_a_time_samples(model, template, file_type):
    """Continuous batching (several prompts and completions per llama_decode, prompts shared in
    the KV cache) against one completion at a time: the same law, per-completion seeds. The
    kernels are not batch-invariant (F16 KV cache, flash attention: docs/engines.md), so the
    log-probabilities of a token agree to the tolerance of those kernels, not bit for bit."""
    engine = LlamaCppEngine(model.state_dict(), model.config, template, file_type, EOS, n_ctx=256, parallel=1)
    params = SamplingParams(n=4, max_new_tokens=12, seed=7)
    prompts = PROMPTS + [[1, 30, 31, 32, 33, 34, 35]]
    one = engine.generate(prompts, params)
    engine.parallel = 5  # rows of different prompts share a batch; a prompt's rows start apart
    batched = engine.generate(prompts, params)
    assert batched.prompt_ids == one.prompt_ids and batched.completion_ids.shape[0] == 12
    same = one.mask & batched.mask & (one.completion_ids == batched.completion_ids)
    same &= same.long().cumprod(dim=1).bool()  # up to a row's first different token
    assert same.sum() >= 0.5 * one.mask.sum()
    # two computations of one model by kernels of the file type's precision: they differ by no more
    # than that precision lets each differ from the model (measured here: 3e-4 for f32, 6e-3 for q4_1)
    bound = GAP_BOUNDS[engine.name]
    torch.testing.assert_close(batched.logp_inf[same], one.logp_inf[same], atol=bound, rtol=0)


def test_kernel_self_check_follows_a_trainer_off_the_quantisation_grid(template):
    """Full fine-tuning moves the trainer off the Q4_1 grid, and the re-quantised file cannot
    follow (docs/training.md): the check compares the engine with the trainer's model on the
    weights the file holds, so that drift is not mistaken for broken kernels."""
    from tiny import tiny_model

    from deployrl.engines.check import check_ids, reference_on
    from deployrl.models.loading import load_tokenizer

    model = tiny_model("llama", vocab_size=49152, hidden_size=64, init_std=0.05)
    ids = check_ids(load_tokenizer(resolve_model("smollm2-135m")), 49152)
    engine = LlamaCppEngine(model.state_dict(), model.config, template, "q4_1", EOS, n_ctx=256)
    on_grid = engine.take_quantised_weights()
    assert engine.take_quantised_weights() is None  # handed over once
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a drift the grid cannot represent: half a quantisation step per weight
        for p in model.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=gen) * 0.01)
    engine.sync(model.state_dict())
    quantised = engine.take_quantised_weights()
    assert set(quantised) == set(on_grid) and any(not torch.equal(quantised[n], on_grid[n]) for n in quantised)
    trainer = reference_logprobs(model, ids)
    naive = float((engine.score(ids) - trainer).abs().mean())
    held = float((engine.score(ids) - reference_on(model, quantised, ids)).abs().mean())
    assert held < naive / 2, (held, naive)  # the kernels' own gap, without the rounding of the weights
    assert torch.equal(reference_logprobs(model, ids), trainer)  # the trainer's own weights are back


def test_engine_statistics_are_the_trainers_within_the_kernel_gap(model, template):
    """PS-PPO's engine proxies from llama.cpp's logits (f32 file): entropy, sum p^2 and p(o_t) equal the
    trainer's up to the kernels' own discrepancy. A log-prob error of at most e on every token moves
    H = -sum p log p by at most e * (H + 1) and sum p^2 by at most 2e * sum p^2 (to first order)."""
    params = SamplingParams(n=2, max_new_tokens=12, seed=6, top_m=4)
    engine = LlamaCppEngine(model.state_dict(), model.config, template, "f32", EOS, n_ctx=256)
    batch = engine.generate(PROMPTS, params)
    real = batch.mask
    with torch.no_grad():
        stats = token_logprobs(model, batch.prompt_ids, batch.completion_ids, real,
                               trainer_view(batch.semantics, params), with_stats=True)
    gap = float((batch.logp_inf - stats.logp)[real].abs().max())  # the kernels' error on the sampled tokens
    assert gap < 1e-3
    error = 10 * gap  # margin: the largest error over the vocabulary exceeds the sampled tokens' one
    assert (batch.stats["entropy"] - stats.entropy)[real].abs().max() <= error * (stats.entropy[real].max() + 1)
    assert (batch.stats["sum_p2"] - stats.sum_p2)[real].abs().max() <= 2 * error * stats.sum_p2[real].max()
    top = batch.stats["top_logp"][real]
    assert (top[:, :-1] >= top[:, 1:]).all() and (top <= 0).all()
