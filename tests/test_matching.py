"""model.match_engine: the trainer's forward on the weights as its engine holds them."""

import copy

import gguf
import pytest
import torch

from deployrl.engines import held_weights
from deployrl.models.formats import fp8_per_channel, held
from deployrl.models.loading import ModelSource, Scorer, resolve_model, token_logprobs
from deployrl.models.matching import EMBEDDING, LINEAR, HeldWeights, merged_adapters, parameter_roles

GGUF_FORMATS = ["q8_0", "q4_0", "q4_1", "f16", "bf16"]


@pytest.mark.parametrize("scale", [1.0, 0.02, 1e-5])
@pytest.mark.parametrize("name", GGUF_FORMATS)
def test_gguf_formats_are_what_gguf_writes_bit_for_bit(name, scale):
    """The reference is gguf's own quantiser (which writes the files llama.cpp loads), then its
    dequantiser: the rounded weights must be equal, not close."""
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(0)) * scale
    w[1, :32] = 0  # an all-zero block
    w[2, 32:64] = scale  # a constant block
    w[3, 64:96] = -w[3, 64:96].abs()  # a block of one sign
    qtype = gguf.GGMLQuantizationType[name.upper()]
    reference = gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), qtype), qtype).reshape(w.shape)
    assert torch.equal(held(w, [name]), torch.from_numpy(reference).float())


def test_fp8_per_channel_is_the_nearest_e4m3_value_times_the_row_scale():
    """Against the whole e4m3 grid, searched value by value (random values never tie); the row scale
    is the absolute max / 448, floored at 1 / (448 * 512) as vLLM floors it (the small rows here)."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite()].unique()
    w = torch.randn(8, 40, generator=torch.Generator().manual_seed(1)) * torch.logspace(-4, 1, 8)[:, None]
    scale = (w.abs().amax(dim=1, keepdim=True) / torch.tensor(448.0)).clamp_min(1 / torch.tensor(448.0 * 512))
    assert bool((scale == 1 / torch.tensor(448.0 * 512)).any())
    nearest = grid[((w / scale)[..., None] - grid).abs().argmin(dim=-1)]
    assert torch.equal(fp8_per_channel(w), nearest * scale)


def prompts_and_completions(vocab: int, gen: torch.Generator):
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 5, 3)]
    completion = torch.randint(3, vocab, (3, 7), generator=gen)
    mask = torch.ones_like(completion, dtype=torch.bool)
    mask[2, 4:] = False
    return prompts, completion, mask


def test_the_matched_forward_is_the_model_on_held_weights_with_straight_through_gradients(gen):
    """The scorer with HeldWeights computes what the model computes with its weights rounded
    (a copy holding them, the slow reference), and its gradient with respect to each weight is the
    copy's gradient with respect to the rounded weight (straight-through)."""
    from tiny import tiny_model

    model = tiny_model("llama", hidden_size=64, init_std=0.05).train()
    roles = parameter_roles(model)
    formats = {name: ("q4_1",) if role == LINEAR else ("q8_0",) for name, role in roles.items()
               if role in (LINEAR, EMBEDDING)}
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for name, weight in rounded.named_parameters():
            if name in formats:
                weight.copy_(held(weight, formats[name]))
    prompts, completion, mask = prompts_and_completions(model.config.vocab_size, gen)
    matched = token_logprobs(Scorer(model, None, HeldWeights(formats)), prompts, completion, mask).logp
    reference = token_logprobs(rounded, prompts, completion, mask).logp
    unmatched = token_logprobs(model, prompts, completion, mask).logp
    assert torch.equal(matched, reference)
    assert (matched - unmatched)[mask].abs().max() > 1e-3  # the rounding matters: the test could fail
    matched[mask].sum().backward()
    reference[mask].sum().backward()
    for (name, weight), (_, copy_weight) in zip(model.named_parameters(), rounded.named_parameters()):
        assert weight.grad is not None and weight.grad.abs().sum() > 0, name
        assert torch.equal(weight.grad, copy_weight.grad), name


def test_the_rounding_follows_every_update_of_the_weights(gen):
    from tiny import tiny_model

    model = tiny_model("llama", hidden_size=64, init_std=0.05)
    formats = {name: ("q8_0",) for name, role in parameter_roles(model).items() if role == LINEAR}
    weights = HeldWeights(formats)
    name = next(iter(formats))
    weight = dict(model.named_parameters())[name]
    before = weights.matched(model)[name].detach().clone()
    with torch.no_grad():
        weight.mul_(1.5)  # as an optimizer step updates in place
    after = weights.matched(model)[name].detach()
    assert torch.equal(after, held(weight, ["q8_0"])) and not torch.equal(after, before)


def test_lora_roles_and_what_each_engine_holds(tiny_dir):
    """Every parameter has its role; llama.cpp holds adapters in f32 (nothing to round), vLLM in its dtype."""
    from deployrl.models.lora import add_lora

    source = resolve_model("smollm2-135m")
    from tiny import tiny_model

    model = add_lora(tiny_model("llama", vocab_size=49152, hidden_size=64, init_std=0.05), 4, 8, 0.0, ["q_proj"],
                     "tiny", 0)
    roles = parameter_roles(model)
    assert {role for name, role in roles.items() if "lora_" in name} == {"adapter"}
    assert sum(role == EMBEDDING for role in roles.values()) == 1  # the tied head is the embedding
    llamacpp = held_weights("llamacpp:q4_1", model, source).formats
    assert all("lora_" not in name for name in llamacpp)
    assert {llamacpp[name] for name, role in roles.items() if role == LINEAR} == {("q4_1",)}
    assert {llamacpp[name] for name, role in roles.items() if role == EMBEDDING} == {("q8_0",)}  # SmolLM2's file
    vllm = held_weights("vllm:fp8_per_channel", model, source).formats
    assert {vllm[name] for name, role in roles.items() if role == LINEAR} == {("bf16", "fp8_per_channel")}
    assert {vllm[name] for name, role in roles.items() if role != LINEAR} == {("bf16",)}
    merged = held_weights("vllm:fp8_per_channel", model, source, lora_serving="merged")
    assert set(merged.merged) == {name for name in roles if name.endswith("q_proj.base_layer.weight")}
    assert all("lora_" not in name for name in merged.formats)  # rounded with their base, not alone
    assert not held_weights("hf:fp32", model, source)
    for option in ("fp8", "fp8_per_tensor", "fp8_per_block"):  # rounded over merged q/k/v and gate/up
        with pytest.raises(ValueError, match=f"not vllm:{option}, which rounds the merged"):
            held_weights(f"vllm:{option}", model, source)


@pytest.mark.parametrize("file_type", ["q4_1", "q8_0"])
def test_the_matched_trainer_holds_the_files_weights_and_computes_the_engines_log_probs(file_type):
    """A trainer moved off the quantisation grid (as full fine-tuning moves it): the matched forward
    computes with exactly the weights the written file holds, and its gap to llama.cpp's
    log-probabilities is the kernels' own (activation rounding), not the weights' rounding."""
    from tiny import tiny_model

    from deployrl.engines.check import MATCHED_GAP_BOUNDS, check_ids, reference_logprobs
    from deployrl.engines.llamacpp import LlamaCppEngine
    from deployrl.models.loading import load_tokenizer

    template = resolve_model("smollm2-135m").gguf_path
    model = tiny_model("llama", vocab_size=49152, hidden_size=64, init_std=0.05)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.01)
    engine = LlamaCppEngine(model.state_dict(), model.config, template, file_type, [2], n_ctx=256)
    in_file = engine.take_quantised_weights()
    weights = held_weights(f"llamacpp:{file_type}", model, ModelSource(str(template.parent), template.name))
    matched = weights.matched(model)
    for name, value in in_file.items():
        assert torch.equal(matched[name] if name in matched else dict(model.named_parameters())[name], value), name
    ids = check_ids(load_tokenizer(resolve_model("smollm2-135m")), 49152)
    scored = engine.score(ids)
    naive = float((scored - reference_logprobs(model, ids)).abs().mean())
    gap = float((scored - reference_logprobs(Scorer(model, None, weights), ids)).abs().mean())
    assert gap < MATCHED_GAP_BOUNDS[engine.name] / 10, (gap, naive)
    # q4_1's coarse grid is most of the unmatched gap; q8_0's fine one a smaller share beside the kernels'
    assert gap < naive / (2 if file_type == "q4_1" else 1), (gap, naive)
    engine.close()


def test_a_matched_run_measures_the_kernels_gap_not_the_rounding_of_the_weights(tiny_gguf, tmp_path):
    """Full fine-tuning of a model whose weights are off the Q4_1 grid, sampled by llama.cpp Q4_1:
    the first step samples the same completions either way (the same file), and the trainer's
    discrepancy D with matching is a fraction of D without (the weights' rounding taken out)."""
    from tiny import toy_task_file

    from deployrl.settings.config import load_config
    from deployrl.training.trainer import Trainer

    torch.set_num_threads(1)
    task_file = toy_task_file(tmp_path)
    mean_d = {}
    for match in (False, True):
        config = load_config(None, [
            f"model.name={tiny_gguf}", "model.lora.rank=0", f"model.match_engine={str(match).lower()}",
            "task.type=jsonl", f"task.path={task_file}", "task.reward=tiny:starts_with_digit", "task.instruction=",
            "rollout.engine=llamacpp:q4_1", "rollout.prompts_per_step=2", "rollout.group_size=4",
            "rollout.max_new_tokens=8", "rollout.context_length=256", "algo.correction=dc", "algo.ps.budget=4", "algo.dynamic_sampling=off", "steps=1",
            "save_every=100", "eval.num_prompts=0", "tensorboard=false", f"output_dir={tmp_path / str(match)}",
        ])
        trainer = Trainer(config)
        assert bool(trainer.learner.passes.scorer.held_weights) is match
        history = trainer.run()
        mean_d[match] = history[0]["dc/mean_D"]
    assert mean_d[True] < mean_d[False] / 2, mean_d


def test_merged_adapters_compute_the_rounded_merged_weight_with_the_adapters_chain_rule_gradient(gen):
    """vLLM with rollout.lora_serving=merged rounds W + s B A. Reference: a plain copy holding the
    rounded merged weights W' (no adapters); its gradient G for W' gives the adapters' gradients
    by the chain rule of W + s B A: dA = s B^T G, dB = s G A^T."""
    from tiny import tiny_model

    from deployrl.models.lora import add_lora

    base = tiny_model("llama", hidden_size=64, init_std=0.05)
    model = add_lora(copy.deepcopy(base), 4, 8, 0.0, ["q_proj", "down_proj"], "tiny", 0)
    with torch.no_grad():  # B = 0 at the start; a trained adapter moves the weights
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=gen)
    formats = ("bf16", "fp8_per_channel")
    roles = parameter_roles(model)
    weights = HeldWeights({name: formats for name, role in roles.items() if role == LINEAR}, merged_adapters(model))
    params = dict(model.named_parameters())
    reference, effective = copy.deepcopy(base), {}
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if p.dim() == 2 and name != "model.embed_tokens.weight":
                module = name.removesuffix(".weight")
                adapted = f"{module}.base_layer.weight" in weights.merged
                w = params[f"{module}.base_layer.weight" if adapted else name].float()
                if adapted:
                    a_name, b_name, scale = weights.merged[f"{module}.base_layer.weight"]
                    w = w + scale * (params[b_name].float() @ params[a_name].float())
                    effective[module] = p
                p.copy_(held(w, formats))
    prompts, completion, mask = prompts_and_completions(base.config.vocab_size, gen)
    matched = token_logprobs(Scorer(model, None, weights), prompts, completion, mask).logp
    expected = token_logprobs(reference, prompts, completion, mask).logp
    torch.testing.assert_close(matched, expected, rtol=0, atol=1e-5)
    matched[mask].sum().backward()
    expected[mask].sum().backward()
    for module, weight in effective.items():
        a_name, b_name, scale = weights.merged[f"{module}.base_layer.weight"]
        a, b, grad = params[a_name], params[b_name], weight.grad
        torch.testing.assert_close(a.grad, scale * b.detach().T @ grad, rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(b.grad, scale * grad @ a.detach().T, rtol=1e-4, atol=1e-7)


def test_a_matched_trainer_is_held_to_the_tighter_bound():
    """A gap the rounding of drifting weights explains passes the unmatched check; a trainer that
    computes on the engine's weights has no such excuse."""
    from deployrl.engines.check import GAP_BOUNDS, MATCHED_GAP_BOUNDS, KernelMismatch, check_engine

    class Engine:  # an engine whose log-probabilities sit a fixed gap from the trainer's
        name = "llamacpp:q4_1"

        def score(self, ids):
            return torch.full((len(ids) - 1,), -2.0 - gap)

    gap = (GAP_BOUNDS["llamacpp:q4_1"] + MATCHED_GAP_BOUNDS["llamacpp:q4_1"]) / 2
    reference, ids = torch.full((9,), -2.0), list(range(10))
    assert check_engine(Engine(), reference, ids) == pytest.approx(gap)
    with pytest.raises(KernelMismatch):
        check_engine(Engine(), reference, ids, matched=True)


def test_matching_refuses_activation_checkpointing():
    """The backward's recomputation of a checkpointed layer would run on the trainer's own weights
    (measured on the tiny model: gradients off by 1.9 where they reach 9.2), so the pair is refused."""
    from deployrl.settings.config import ModelConfig

    with pytest.raises(ValueError, match="activation checkpointing"):
        ModelConfig(match_engine=True, activation_checkpointing=True)


def test_without_the_cache_the_backward_recomputes_the_rounding_instead_of_keeping_it(gen, monkeypatch):
    """As FSDP2 runs it (no cache): the same forward and gradients bit for bit as with the cache,
    and no rounded weight outlives the forward (the backward rounds again), so a sharded model is
    not held whole until its backward."""
    import gc
    import weakref

    from tiny import tiny_model

    model = tiny_model("llama", hidden_size=64, init_std=0.05).train()
    formats = {name: ("q4_1",) if role == LINEAR else ("q8_0",) for name, role in parameter_roles(model).items()
               if role in (LINEAR, EMBEDDING)}
    prompts, completion, mask = prompts_and_completions(model.config.vocab_size, gen)
    results = {}
    for cache in (True, False):
        weights, rounded = HeldWeights(formats, cache=cache), []
        compute = weights.rounded
        monkeypatch.setattr(weights, "rounded", lambda *a: rounded.append(compute(*a)) or rounded[-1])
        logp = token_logprobs(Scorer(model, None, weights), prompts, completion, mask).logp
        forward_roundings = len(rounded)
        kept = [weakref.ref(r) for r in rounded]
        rounded.clear()
        gc.collect()
        alive = sum(r() is not None for r in kept)
        logp[mask].sum().backward()
        results[cache] = logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, alive, len(rounded)
        model.zero_grad()
        assert forward_roundings == len(formats)
    (logp, grads, alive, again), (logp_nc, grads_nc, alive_nc, again_nc) = results[True], results[False]
    assert torch.equal(logp, logp_nc)
    assert all(torch.equal(grads[n], grads_nc[n]) for n in grads)
    assert alive == len(formats) and again == 0  # cached: kept, nothing rounded again
    assert alive_nc == 0 and again_nc > 0  # recomputed in the backward
