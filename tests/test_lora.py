"""LoRA through peft: a frozen base, adapters only, engines that follow the adapter."""

import pytest
import torch

from deployrl.engines.check import reference_logprobs
from deployrl.lora import add_lora, adapter_scales, split_adapter
from deployrl.trainer import Trainer

from test_trainer import VARIANTS, toy_config

EOS = [2]

LORA = ["model.lora.rank=4", "model.lora.alpha=8", "optim.lr=0.05"]


def randomise_adapters(model, seed: int, scale: float = 0.2) -> None:
    """B != 0 (peft starts at B = 0, the base itself), so that the adapter changes the model."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".lora_B." in name:
                parameter.copy_(torch.randn(parameter.shape, generator=gen) * scale)


@pytest.mark.parametrize("engine", ["hf:bf16", "hf:fp8"])
def test_lora_training_changes_only_the_adapters(engine, tmp_path, tiny_dir):
    trainer = Trainer(toy_config(tmp_path, tiny_dir, "steps=2", f"rollout.engine={engine}", *LORA,
                                 *VARIANTS["dc_optimized"]))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    adapters = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert adapters and all(".lora_A." in n or ".lora_B." in n for n in adapters)
    trainer.run()
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == adapters  # every adapter moved (B from 0), no base weight did
    quantised = [n for n, m in trainer.rollout.engine.model.named_modules() if type(m).__name__ == "FP8Linear"]
    assert not any(".lora_" in n for n in quantised)  # fp8: the base is quantised, the adapters are not
    assert bool(quantised) == (engine == "hf:fp8")


def test_resumed_lora_run_reproduces_the_uninterrupted_one(tmp_path, tiny_dir):
    straight = Trainer(toy_config(tmp_path / "a", tiny_dir, "steps=4", "save_every=2", *LORA))
    losses = [m["loss"] for m in straight.run()]
    first = [m["loss"] for m in Trainer(toy_config(tmp_path / "b", tiny_dir, "steps=2", "save_every=2", *LORA)).run()]
    resumed = Trainer(toy_config(tmp_path / "b", tiny_dir, "steps=4", "save_every=2", *LORA), resume=True)
    second = [m["loss"] for m in resumed.run()]
    assert first + second == pytest.approx(losses, rel=1e-5, abs=1e-7)
    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(a, b, msg=name)


def test_split_adapter_gives_the_base_names_and_the_scale():
    from tiny import tiny_model

    model = tiny_model("llama")
    plain = set(model.state_dict())
    add_lora(model, rank=2, alpha=6.0, dropout=0.0, target_modules=("q_proj", "down_proj"))
    base, adapters = split_adapter(model.state_dict(), adapter_scales(model))
    assert set(base) == plain
    assert sorted(adapters) == sorted(n[: -len(".weight")] for n in plain if n.endswith(("q_proj.weight", "down_proj.weight")))
    adapter = adapters["model.layers.0.self_attn.q_proj"]
    assert adapter.scale == 3.0 and adapter.a.shape[0] == 2 and adapter.b.shape[1] == 2


def engine_for(spec: str, model):
    """The engine `spec` built from `model` (a tiny Llama with SmolLM2's vocabulary)."""
    from deployrl.engines.hf import HFEngine
    from deployrl.engines.llamacpp import LlamaCppEngine
    from deployrl.models import resolve_model

    kind, option = spec.split(":")
    if kind == "hf":
        return HFEngine(model, option, EOS)
    template = resolve_model("smollm2-135m").gguf_path
    return LlamaCppEngine(model.state_dict(), model.config, template, option, EOS, n_ctx=256,
                          adapter_scales=adapter_scales(model))


@pytest.mark.parametrize("spec", ["llamacpp:f32", "llamacpp:f16", "hf:fp32", "hf:bf16"])
def test_engines_apply_the_adapter_as_peft_does(spec):
    """An engine given new adapters moves its log-probs as peft moves the trainer's, up to its own
    kernels' gap on the base; llama.cpp swaps the adapter file without reloading the base."""
    from tiny import tiny_model

    model = tiny_model("llama", vocab_size=49152, hidden_size=64, init_std=0.05)
    ids = list(range(1, 40))
    base_trainer = reference_logprobs(model, ids)
    add_lora(model, rank=4, alpha=8.0, dropout=0.0, target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "up_proj"))
    engine = engine_for(spec, model)
    base_engine = engine.score(ids)
    runtime = getattr(engine, "runtime", None)
    base_gap = float((base_engine - base_trainer).abs().mean())
    for seed in (0, 1):  # two syncs: the second adapter replaces the first
        randomise_adapters(model, seed)
        engine.sync(model.state_dict())
        assert getattr(engine, "runtime", None) is runtime  # llama.cpp: the base stayed loaded
        trainer_move = reference_logprobs(model, ids) - base_trainer
        engine_move = engine.score(ids) - base_engine
        assert float(trainer_move.abs().mean()) > 0.05  # the adapter matters
        # measured: the adapter-only difference is about the base's own gap (f32 2e-4, f16 4e-4)
        assert float((engine_move - trainer_move).abs().mean()) <= 2 * base_gap + 1e-4, (spec, base_gap)
