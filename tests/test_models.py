import json
import subprocess
import sys
import textwrap

import pytest
import torch

from deployrl.algo.logprobs import SamplingView, processed_logits
from deployrl.models.loading import (
    gguf_read_once,
    load_model,
    load_tokenizer,
    resolve_model,
    shares_prompts,
    token_logprobs,
)


def naive_logprobs(model, prompts, completions, mask, view):
    """Full-logits reference: one sequence at a time, [T, V] logits held whole."""
    device = next(model.parameters()).device
    out = torch.zeros(mask.shape, device=device)
    for b, prompt in enumerate(prompts):
        n = int(mask[b].sum())
        ids = torch.tensor([prompt + completions[b, :n].tolist()], device=device)
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + n]
        logp = processed_logits(logits, view).log_softmax(-1)
        out[b, :n] = logp.gather(-1, completions[b, :n, None].to(device))[:, 0]
    return out


def test_local_directory_and_errors(tiny_dir, tmp_path):
    source = resolve_model(str(tiny_dir))
    assert source.gguf_file is None and load_model(source).config.num_hidden_layers == 2
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        resolve_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match="without config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no such directory"):
        resolve_model("./no/such/model")
    with pytest.raises(ValueError, match="unknown training dtype 'fp64'"):
        load_model(source, dtype="fp64")


def test_a_gguf_is_parsed_once_per_load_with_the_same_model(tiny_gguf, tmp_path, monkeypatch):
    import os
    import shutil

    import gguf

    parses = []

    class CountedReader(gguf.GGUFReader):
        def __init__(self, path, mode="r"):
            parses.append(str(path))
            super().__init__(path, mode)

    monkeypatch.setattr(gguf, "GGUFReader", CountedReader)
    name_map = gguf.get_tensor_name_map

    def load():
        source = resolve_model(str(tiny_gguf))
        return load_tokenizer(source), load_model(source)

    tokenizer, model = load()
    assert len(parses) >= 3  # the check, the tokenizer, the config, the weights: each parses the file
    parses.clear()
    with gguf_read_once():
        tokenizer_once, model_once = load()
        assert parses == [str(tiny_gguf)]
        copy = tmp_path / "copy.gguf"  # a file replaced on disk is parsed again
        shutil.copy(tiny_gguf, copy)
        first = gguf.GGUFReader(copy)
        assert gguf.GGUFReader(copy) is first
        shutil.copy(tiny_gguf, tmp_path / "new.gguf")
        os.replace(tmp_path / "new.gguf", copy)
        assert gguf.GGUFReader(copy) is not first
    assert gguf.GGUFReader is CountedReader and gguf.get_tensor_name_map is name_map
    assert tokenizer_once.get_vocab() == tokenizer.get_vocab()
    state, state_once = model.state_dict(), model_once.state_dict()
    assert state.keys() == state_once.keys() and all(torch.equal(state[k], state_once[k]) for k in state)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("view", [SamplingView(), SamplingView(0.7, 8, 0.9)])
def test_chunked_logprobs_equal_full_logits(arch, view, device, gen):
    from tiny import tiny_model

    model = tiny_model(arch).to(device)
    prompts = [[1, 5, 6, 7], [1, 9], [1, 3, 3, 3, 3, 4]]
    completions = torch.randint(3, 40, (3, 9), generator=gen)
    mask = torch.arange(9)[None] < torch.tensor([9, 4, 1])[:, None]
    with torch.no_grad():
        reference = naive_logprobs(model, prompts, completions, mask, view)
        finite = torch.isfinite(reference)
        for chunk in (1, 5, 1024):
            got = token_logprobs(model, prompts, completions, mask, view, chunk_tokens=chunk).logp
            assert got.device == reference.device  # on the model's device
            assert torch.equal(torch.isfinite(got), finite)
            torch.testing.assert_close(got[finite], reference[finite], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_shared_prompt_runs_once_with_the_per_row_values_and_gradients(arch, gen):
    from tiny import tiny_model

    model = tiny_model(arch)
    assert shares_prompts(model)
    prompts = [[1, 5, 6, 7], [1, 9], [1, 5, 6, 7], [1, 9], [1, 5, 6, 7], [1, 3, 3, 3, 3, 4]]
    completions = torch.randint(3, 40, (6, 9), generator=gen)
    mask = torch.arange(9)[None] < torch.tensor([9, 4, 1, 0, 7, 5])[:, None]
    fed = []
    hook = model.get_input_embeddings().register_forward_hook(lambda module, args, out: fed.append(args[0].shape))
    got = token_logprobs(model, prompts, completions, mask, chunk_tokens=5).logp
    hook.remove()
    assert fed == [torch.Size([3, 6]), torch.Size([6, 8])]  # 3 distinct prompts, then completion[:8] per row
    got[mask].sum().backward()
    shared = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    reference = naive_logprobs(model, prompts, completions, mask, SamplingView())
    reference[mask].sum().backward()
    torch.testing.assert_close(got[mask], reference[mask], atol=1e-5, rtol=1e-5)
    for grad, parameter in zip(shared, model.parameters()):
        torch.testing.assert_close(grad, parameter.grad, atol=1e-4, rtol=1e-4)


def test_sliding_window_models_feed_every_row_whole(gen):
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, use_sliding_window=True, sliding_window=4, max_window_layers=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    assert not shares_prompts(model)
    prompts = [[1, 5, 6, 7, 8, 9], [1, 5, 6, 7, 8, 9], [1, 2]]
    completions = torch.randint(3, 40, (3, 7), generator=gen)
    mask = torch.arange(7)[None] < torch.tensor([7, 3, 6])[:, None]
    with torch.no_grad():
        got = token_logprobs(model, prompts, completions, mask).logp
        reference = naive_logprobs(model, prompts, completions, mask, SamplingView())
    torch.testing.assert_close(got[mask], reference[mask], atol=1e-5, rtol=1e-5)


def test_activation_checkpointing_gives_the_same_gradients(tiny_dir, gen):
    prompts = [[1, 5, 6], [1, 7]]
    completions = torch.randint(3, 40, (2, 6), generator=gen)
    mask = torch.ones(2, 6, dtype=torch.bool)
    grads = []
    for checkpointing in (False, True):
        model = load_model(resolve_model(str(tiny_dir)), activation_checkpointing=checkpointing).train()
        # float64: the two paths sum in different orders, and in fp32 that order's rounding
        # (~1e-5 here) depends on the CPU's kernels; in float64 it is ~1e-14 everywhere
        model.double()
        assert shares_prompts(model) is not checkpointing  # the fallback: one pass per row
        token_logprobs(model, prompts, completions, mask, chunk_tokens=4).logp.sum().backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    assert grads[0].dtype == torch.float64
    torch.testing.assert_close(grads[0], grads[1])


PEAK_SCRIPT = textwrap.dedent(
    """
    import json, resource, sys, torch
    from deployrl.algo.logprobs import chunked_token_stats
    torch.set_num_threads(1)
    b, t, d, v, grad = int(sys.argv[1]), int(sys.argv[2]), 64, int(sys.argv[3]), sys.argv[4] == "1"
    hidden = torch.randn(b, t, d, requires_grad=grad)
    head = torch.randn(v, d, requires_grad=grad)
    targets = torch.randint(0, v, (b, t))
    mask = torch.ones(b, t, dtype=torch.bool)
    chunked_token_stats(hidden[:, :4], head, targets[:, :4], mask[:, :4], chunk_tokens=4)  # warm up
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    stats = chunked_token_stats(hidden, head, targets, mask, chunk_tokens=256, with_stats=not grad)
    if grad:
        stats.logp.sum().backward()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_mb": (after - before) / 1024, "logits_mb": b * t * v * 4 / 2**20}))
    """
)


def peak_extra_memory(b, t, v, grad):
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(b), str(t), str(v), str(int(grad))],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.mark.parametrize("grad", [False, True])
def test_chunked_pass_memory_stays_bounded(grad):
    small = peak_extra_memory(2, 1024, 16384, grad)
    large = peak_extra_memory(2, 4096, 32768, grad)  # 8x vocabulary x length
    assert large["logits_mb"] == 8 * small["logits_mb"] == 1024
    # The full logits would be 1 GiB; the chunked pass holds a few [256, V] chunks at a time.
    assert large["peak_mb"] < 0.2 * large["logits_mb"], large
    assert large["peak_mb"] < 2.5 * small["peak_mb"] + 40, (small, large)


def test_end_tokens_merge_the_tokenizer_and_the_generation_config():
    from types import SimpleNamespace

    from deployrl.models.loading import end_token_ids

    tokenizer = SimpleNamespace(eos_token_id=2)
    chat_model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[7, 2]))
    assert end_token_ids(tokenizer, chat_model) == [2, 7]  # train, eval and mismatch all stop on both
    assert end_token_ids(tokenizer, SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=None))) == [2]
    assert end_token_ids(SimpleNamespace(eos_token_id=None), SimpleNamespace()) == []
