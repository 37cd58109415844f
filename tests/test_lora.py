"""LoRA through peft: a frozen base, adapters only, engines that follow the adapter."""

from pathlib import Path

import pytest
import torch
from test_trainer import VARIANTS, toy_config

from deployrl.engines.check import reference_logprobs
from deployrl.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_scales, add_lora, split_adapter
from deployrl.training.distributed import World, full_state_dict
from deployrl.training.trainer import Trainer

EOS = [2]

LORA = ["model.lora.rank=4", "model.lora.alpha=8", "optim.lr=0.05"]


def randomise_adapters(model, seed: int, scale: float = 0.2) -> None:
    """B != 0 (peft starts at B = 0, the base itself), so that the adapter changes the model."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".lora_B." in name:
                parameter.copy_(torch.randn(parameter.shape, generator=gen) * scale)


@pytest.mark.parametrize("engine,variant", [("hf:bf16", "dc_optimized"), ("hf:fp8", "dr_grpo_tis"),
                                            ("hf:bf16", "rloo_mask_kl"), ("hf:fp8", "dc_heuristic_epochs")])
def test_lora_training_changes_only_the_adapters(engine, variant, device, tmp_path, tiny_dir):
    """With DC, TIS, the mask (and a KL to the reference), PS-PPO's laws and several epochs."""
    trainer = Trainer(toy_config(tmp_path, tiny_dir, "steps=2", f"rollout.engine={engine}", f"model.device={device}",
                                 *LORA, *VARIANTS[variant]))
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


def test_lora_checkpoint_holds_the_adapter_alone_in_peft_layout(tmp_path, tiny_dir):
    """The checkpoint's model/ is a peft adapter folder: PeftModel.from_pretrained on the base gives
    the trainer's model; it names its base; no base weight is stored."""
    from peft import PeftModel

    from deployrl.models.loading import load_model, resolve_model
    from deployrl.training.checkpoint import latest_checkpoint

    trainer = Trainer(toy_config(tmp_path, tiny_dir, "steps=2", "save_every=2", *LORA))
    trainer.run()
    model_dir = latest_checkpoint(trainer.run_dir) / "model"
    assert sorted(p.name for p in model_dir.glob("*.safetensors")) == [ADAPTER_WEIGHTS]
    assert (model_dir / ADAPTER_CONFIG).is_file()
    peft_model = PeftModel.from_pretrained(load_model(resolve_model(str(tiny_dir))), model_dir).eval()
    assert peft_model.peft_config["default"].base_model_name_or_path == str(tiny_dir)
    ids = list(range(3, 30))
    # get_base_model(): the transformers model under peft's wrapper, its LoRA layers in place
    torch.testing.assert_close(reference_logprobs(peft_model.get_base_model(), ids), reference_logprobs(trainer.model, ids),
                               rtol=0, atol=0)


def test_full_checkpoint_refused_by_a_lora_run_and_the_reverse(tmp_path, tiny_dir):
    from deployrl.training.checkpoint import CheckpointError

    Trainer(toy_config(tmp_path / "full", tiny_dir, "steps=1", "save_every=1")).run()
    with pytest.raises(CheckpointError, match="holds a full model, not a LoRA adapter"):
        Trainer(toy_config(tmp_path / "full", tiny_dir, "steps=2", *LORA), resume=True)
    Trainer(toy_config(tmp_path / "lora", tiny_dir, "steps=1", "save_every=1", *LORA)).run()
    with pytest.raises(CheckpointError, match="does not fit the model's LoRA layers"):
        Trainer(toy_config(tmp_path / "lora", tiny_dir, "steps=2", *LORA, "model.lora.rank=2"), resume=True)


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


def test_written_adapters_load_back_as_the_models_own(tmp_path):
    """`write_adapters` (what the vLLM engine hands vLLM) is peft's layout of the same adapter: rank,
    alpha, targets and tensors read back equal; mixed ranks cannot be written as one config."""
    from dataclasses import replace

    from tiny import tiny_model

    from deployrl.models.lora import read_adapter, write_adapters

    model = add_lora(tiny_model("llama"), rank=2, alpha=6.0, dropout=0.0, target_modules=("q_proj", "down_proj"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    adapters = split_adapter(model.state_dict(), adapter_scales(model))[1]
    write_adapters(tmp_path / "adapter", adapters)
    own = {name: p for name, p in model.named_parameters() if "lora_" in name}
    read = read_adapter(model, tmp_path / "adapter")  # refuses another rank, alpha or target set
    assert set(read) == set(own) and all(torch.equal(read[name], own[name]) for name in own)
    module = "model.layers.0.self_attn.q_proj"
    mixed = {**adapters, module: replace(adapters[module], scale=1.0)}
    with pytest.raises(ValueError, match="different \\(rank, scale\\) pairs"):
        write_adapters(tmp_path / "mixed", mixed)


def engine_for(spec: str, model):
    """The engine `spec` built from `model` (a tiny Llama with SmolLM2's vocabulary)."""
    from deployrl.engines.hf import HFEngine
    from deployrl.engines.llamacpp import LlamaCppEngine
    from deployrl.models.loading import resolve_model

    kind, option = spec.split(":")
    if kind == "hf":
        return HFEngine(model, option, EOS)
    template = resolve_model("smollm2-135m").gguf_path
    return LlamaCppEngine(model.state_dict(), model.config, template, option, EOS, n_ctx=256,
                          adapter_scales=adapter_scales(model))


@pytest.mark.parametrize("spec", ["llamacpp:f32", "llamacpp:f16", "hf:fp32", "hf:bf16"])
def test_engines_apply_the_adapter_as_peft_does(spec):
    """An engine given new adapters moves its log-probs as peft moves the trainer's, up to its own
    kernels' gap on the base; llama.cpp swaps the adapter file without reloading the base, and
    needs only the adapters at a sync."""
    from tiny import tiny_model

    model = tiny_model("llama", vocab_size=49152, hidden_size=64, init_std=0.05)
    ids = list(range(1, 40))
    base_trainer = reference_logprobs(model, ids)
    add_lora(model, rank=4, alpha=8.0, dropout=0.0, target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "up_proj"))
    engine = engine_for(spec, model)
    base_engine = engine.score(ids)
    runtime = getattr(engine, "runtime", None)
    base_gap = float((base_engine - base_trainer).abs().mean())
    # llama.cpp holds the frozen base: a sync sends the adapters alone (all a sharded run gathers)
    assert engine.takes_base == spec.startswith("hf")
    for seed in (0, 1):  # two syncs: the second adapter replaces the first
        randomise_adapters(model, seed)
        engine.sync(full_state_dict(model, World(), base=engine.takes_base))
        assert getattr(engine, "runtime", None) is runtime  # llama.cpp: the base stayed loaded
        trainer_move = reference_logprobs(model, ids) - base_trainer
        engine_move = engine.score(ids) - base_engine
        assert float(trainer_move.abs().mean()) > 0.05  # the adapter matters
        # measured: the adapter-only difference is about the base's own gap (f32 2e-4, f16 4e-4)
        assert float((engine_move - trainer_move).abs().mean()) <= 2 * base_gap + 1e-4, (spec, base_gap)


TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_lora_base_is_the_dequantised_gguf(tmp_path):
    """Loaded from a Q4_1 file, the frozen base of the LoRA model is what the file holds, exactly."""
    from tiny import tiny_model

    from deployrl.engines.gguf_io import write_gguf
    from deployrl.models.loading import load_model, resolve_model

    model = tiny_model("llama", vocab_size=49152, hidden_size=64, init_std=0.05)
    held: dict[str, torch.Tensor] = {}
    path = write_gguf(model.state_dict(), model.config, resolve_model("smollm2-135m").gguf_path,
                      tmp_path / "model.gguf", "q4_1", held=held)
    loaded = add_lora(load_model(resolve_model(str(path))), 4, 8.0, 0.0, TARGETS)
    base, adapters = split_adapter(loaded.state_dict(), adapter_scales(loaded))
    assert len(adapters) == 7 * 2
    assert set(held) <= set(base)
    assert max(float((base[name] - value).abs().max()) for name, value in held.items()) == 0.0
    assert any(not torch.equal(value, model.state_dict()[name]) for name, value in held.items())  # it did round


def test_export_of_a_lora_model(tmp_path):
    """peft adapter, merged HF model, merged GGUF and GGUF adapter: each is the trained model, and
    llama.cpp with base + adapter.gguf scores as the merged file does."""
    from peft import PeftModel
    from tiny import tiny_model
    from transformers import AutoModelForCausalLM

    from deployrl.engines.gguf_io import write_gguf
    from deployrl.engines.llama_runtime import LlamaRuntime
    from deployrl.models.loading import resolve_model
    from deployrl.training.export import export_model

    template = resolve_model("smollm2-135m").gguf_path
    model = tiny_model("llama", vocab_size=49152, hidden_size=64, init_std=0.05)
    base_weights = {k: v.clone() for k, v in model.state_dict().items()}
    add_lora(model, 4, 8.0, 0.0, TARGETS)
    randomise_adapters(model, 0, scale=0.05)
    written = export_model(model, None, tmp_path / "export", template, "f32")
    assert sorted(written) == ["adapter", "gguf", "gguf_adapter", "hf"]
    ids = list(range(1, 40))
    trained = reference_logprobs(model, ids)
    moved = float((trained - reference_logprobs(tiny_model("llama", vocab_size=49152, hidden_size=64, init_std=0.05),
                                               ids)).abs().mean())
    assert moved > 0.05  # the adapter matters
    fresh = tiny_model("llama", vocab_size=49152, hidden_size=64, init_std=0.05)
    torch.testing.assert_close(reference_logprobs(PeftModel.from_pretrained(fresh, written["adapter"]).get_base_model(), ids), trained,
                               rtol=0, atol=0)
    merged = AutoModelForCausalLM.from_pretrained(written["hf"])
    # W + s B A rounded once to fp32: the log-probs move by float32 rounding only
    torch.testing.assert_close(reference_logprobs(merged, ids), trained, rtol=0, atol=1e-4)
    base_file = write_gguf(base_weights, model.config, template, tmp_path / "base.gguf", "f32")
    with_adapter = LlamaRuntime(base_file, n_ctx=256, n_seq=1, threads=1)
    with_adapter.set_adapter(written["gguf_adapter"])
    merged_file = LlamaRuntime(written["gguf"], n_ctx=256, n_seq=1, threads=1)
    try:
        gap = float((merged_file.score(ids) - trained).abs().mean())  # llama.cpp's f32 kernels against torch
        assert float((with_adapter.score(ids) - merged_file.score(ids)).abs().mean()) <= 2 * gap + 1e-4
    finally:
        with_adapter.close()
        merged_file.close()


def test_eval_scores_an_adapter_folder_as_its_merged_model(tmp_path, tiny_dir):
    """`deployrl eval --model <adapter folder>` loads the base its config names, applies the adapter in
    the engine, and scores what the merged export scores, not what the base scores."""
    import json

    from tiny import toy_task_file

    from deployrl.cli import main as cli
    from deployrl.models.loading import load_model, load_tokenizer, resolve_model
    from deployrl.training.export import export_model

    source = resolve_model(str(tiny_dir))
    model = add_lora(load_model(source), 4, 8.0, 0.0, ("q_proj", "v_proj", "up_proj"), base=str(tiny_dir))
    randomise_adapters(model, 0, scale=1.0)  # far from the base
    written = export_model(model, load_tokenizer(source), tmp_path / "export")
    task = [f"task.path={toy_task_file(tmp_path)}", "task.type=jsonl", "task.reward=tiny:starts_with_digit",
            "task.instruction="]

    def scores(model: str) -> dict:
        out = tmp_path / f"{Path(model).name}.json"
        assert cli(["eval", "--model", model, "--engine", "hf:fp32", "--num-prompts", "16", "--samples", "4",
                    "--max-new-tokens", "6", "--json", str(out), *task]) == 0
        found = json.loads(out.read_text())
        return {k: found[k] for k in ("pass@1", "pass@4", "mean_reward", "mean_length")}

    adapter, merged, base = scores(str(written["adapter"])), scores(str(written["hf"])), scores(str(tiny_dir))
    assert adapter == merged
    assert adapter != base
