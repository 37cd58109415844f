"""The llama.cpp engine on a tiny random Llama that carries SmolLM2's tokenizer and metadata."""

import copy

import pytest
import torch

from deployrl.algo.discrepancy import token_discrepancy
from deployrl.engines import make_engine
from deployrl.engines.base import SamplingParams, trainer_view
from deployrl.engines.gguf_io import write_gguf
from deployrl.engines.llamacpp import LlamaCppEngine
from deployrl.models import load_model, resolve_model, token_logprobs

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
    assert first.lengths.max() <= 9 and first.timing["tokens_per_s"] > 0
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
