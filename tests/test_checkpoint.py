"""Checkpoints: exact round trip, atomicity, pruning, refusal of damaged ones, and export."""

import json
import math
import random

import numpy as np
import pytest
import torch
from tiny import char_tokenizer, tiny_model

from deployrl.training.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from deployrl.training.export import export_model


def lr_lambda(step: int, warmup: int = 2, total: int = 10) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * min(step - warmup, total) / total))


def components(seed: int = 0):
    model = tiny_model("llama", seed=seed).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    return model, optimizer, scheduler


def train_steps(model, optimizer, scheduler, n: int) -> None:
    ids = torch.randint(0, model.config.vocab_size, (2, 6))
    for _ in range(n):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def draws(generator: torch.Generator) -> tuple:
    return (torch.rand(3).tolist(), random.random(), np.random.rand(), torch.rand(2, generator=generator).tolist())


def assert_same_state(a, b) -> None:
    """Equal nested optimizer/scheduler states: tensors exactly, the rest with ==, types too (but
    torch's name-keyed optimizer state turns tuples such as AdamW's betas into lists)."""
    assert type(a) is type(b) or {type(a), type(b)} == {list, tuple}, (a, b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert_same_state(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same_state(x, y)
    else:
        assert a == b


@pytest.fixture(scope="module")
def trained():
    torch.manual_seed(0)
    model, optimizer, scheduler = components()
    train_steps(model, optimizer, scheduler, 3)
    return model, optimizer, scheduler


def test_round_trip_restores_everything(trained, tmp_path):
    model, optimizer, scheduler = trained
    generator = torch.Generator().manual_seed(7)
    torch.rand(5, generator=generator)
    state = {"step": 3, "data_position": 12, "tolerance": None, "dual": {"lam": 0.25},
             "history": [1.5, float("nan")], "by_step": {3: (1, 2)}}
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    path = save_checkpoint(tmp_path, 3, model, optimizer, scheduler, state, tokenizer=char_tokenizer(),
                           generators={"plan": generator})
    assert path == tmp_path / "checkpoints" / "step_00000003"
    expected = draws(generator)  # the uninterrupted sequence

    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    fresh_model, fresh_opt, fresh_sched = components(seed=1)
    fresh_gen = torch.Generator().manual_seed(123)
    params_before = [id(p) for p in fresh_model.parameters()]
    restored = load_checkpoint(path, fresh_model, fresh_opt, fresh_sched, {"plan": fresh_gen})

    assert restored["step"] == 3 and restored["dual"] == {"lam": 0.25} and restored["tolerance"] is None
    assert restored["history"][0] == 1.5 and math.isnan(restored["history"][1])
    assert restored["by_step"] == {3: (1, 2)}
    assert [id(p) for p in fresh_model.parameters()] == params_before  # copied in place
    for (name, a), b in zip(model.state_dict().items(), fresh_model.state_dict().values()):
        assert torch.equal(a, b), name
    assert fresh_model.lm_head.weight is fresh_model.model.embed_tokens.weight  # ties survive
    assert_same_state(optimizer.state_dict(), fresh_opt.state_dict())
    assert_same_state(scheduler.state_dict(), fresh_sched.state_dict())
    assert fresh_opt.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    assert draws(fresh_gen) == expected
    # training continues identically
    train_steps(fresh_model, fresh_opt, fresh_sched, 1)
    assert fresh_sched.get_last_lr() != scheduler.get_last_lr()


def test_checkpoint_layout_holds_no_pickle_and_loads_with_transformers(trained, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, optimizer, scheduler = trained
    path = save_checkpoint(tmp_path, 5, model, optimizer, scheduler, {"step": 5}, tokenizer=char_tokenizer())
    names = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()}
    assert {"manifest.json", "optimizer.json", "optimizer.safetensors", "scheduler.json", "rng.json",
            "rng.safetensors", "trainer_state.json", "model/config.json", "model/model.safetensors"} <= names
    assert not [n for n in names if n.endswith((".bin", ".pt", ".pth", ".pkl"))]
    from safetensors.torch import load_file

    keys = set(load_file(path / "optimizer.safetensors"))
    name = "model.embed_tokens.weight"  # keyed by parameter name: any number of ranks can load it
    assert {f"state.{name}.exp_avg", f"state.{name}.exp_avg_sq", f"state.{name}.step"} <= keys
    manifest = json.loads((path / "manifest.json").read_text())
    assert set(manifest["files"]) == names - {"manifest.json"}
    loaded = AutoModelForCausalLM.from_pretrained(path / "model")
    torch.testing.assert_close(loaded.state_dict(), model.state_dict(), rtol=0, atol=0)
    assert AutoTokenizer.from_pretrained(path / "model")("1+2")["input_ids"] == char_tokenizer()("1+2")["input_ids"]


def test_keep_last_prunes_oldest_and_leftovers(trained, tmp_path):
    model, optimizer, scheduler = trained
    leftover = tmp_path / "checkpoints" / ".tmp-step_00000009-crashed"
    leftover.mkdir(parents=True)
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, model, optimizer, scheduler, {"step": step}, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000003", "step_00000004"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000003", "step_00000004"]
    # saving a step again replaces it
    save_checkpoint(tmp_path, 4, model, optimizer, scheduler, {"step": 4, "again": True}, keep_last=2)
    assert load_checkpoint(latest_checkpoint(tmp_path), model, restore_rng=False)["again"] is True


def test_interrupted_save_is_ignored(trained, tmp_path):
    model, optimizer, scheduler = trained
    assert latest_checkpoint(tmp_path) is None
    good = save_checkpoint(tmp_path, 2, model, optimizer, scheduler, {"step": 2})
    # a crash during the save of step 4 leaves its temporary directory, full but without manifest
    import shutil

    shutil.copytree(good, tmp_path / "checkpoints" / ".tmp-step_00000004-x1y2")
    (tmp_path / "checkpoints" / ".tmp-step_00000004-x1y2" / "manifest.json").unlink()
    # and a step directory without manifest (copied by hand, half-written) is skipped too
    shutil.copytree(good, tmp_path / "checkpoints" / "step_00000006")
    (tmp_path / "checkpoints" / "step_00000006" / "manifest.json").unlink()
    with pytest.warns(RuntimeWarning, match="manifest.json is missing"):
        assert latest_checkpoint(tmp_path) == good
    with pytest.raises(CheckpointError, match=r"step_00000006.*manifest\.json is missing"):
        load_checkpoint(tmp_path / "checkpoints" / "step_00000006", model)


def test_a_failing_save_leaves_nothing(trained, tmp_path):
    model, optimizer, scheduler = trained
    with pytest.raises(TypeError, match=r"trainer_state\['bad'\].*object"):
        save_checkpoint(tmp_path, 1, model, optimizer, scheduler, {"bad": object()})
    assert list((tmp_path / "checkpoints").iterdir()) == []


@pytest.mark.parametrize("damage", ["missing", "truncated", "flipped"])
def test_damaged_checkpoint_is_refused_naming_the_file(trained, tmp_path, damage):
    model, optimizer, scheduler = trained
    path = save_checkpoint(tmp_path, 1, model, optimizer, scheduler, {"step": 1})
    target = path / "optimizer.safetensors"
    data = target.read_bytes()
    if damage == "missing":
        target.unlink()
        message = r"optimizer\.safetensors is missing"
    elif damage == "truncated":
        target.write_bytes(data[: len(data) // 2])
        message = r"optimizer\.safetensors has \d+ bytes, the manifest says"
    else:
        target.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
        message = r"optimizer\.safetensors does not match its sha256"
    fresh, fresh_opt, _ = components(seed=1)
    before = [p.clone() for p in fresh.parameters()]
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(path, fresh, fresh_opt)
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.parameters()))  # untouched
    if damage != "flipped":  # sizes are checked without hashing
        with pytest.warns(RuntimeWarning, match="optimizer.safetensors"):
            assert latest_checkpoint(tmp_path) is None


def test_load_errors(trained, tmp_path):
    model, optimizer, scheduler = trained
    with pytest.raises(CheckpointError, match="no checkpoint directory"):
        load_checkpoint(tmp_path / "nowhere", model)
    path = save_checkpoint(tmp_path, 1, model, None, None, {"step": 1}, generators={"a": torch.Generator()})
    with pytest.raises(CheckpointError, match="incomplete.*latest_checkpoint"):
        load_checkpoint(tmp_path, model)  # a run directory, not a checkpoint
    with pytest.raises(CheckpointError, match="no optimizer state"):
        load_checkpoint(path, model, optimizer)
    with pytest.raises(CheckpointError, match="generator.*'b'"):
        load_checkpoint(path, model, generators={"b": torch.Generator()})
    with pytest.raises(CheckpointError, match="do not fit the model"):
        load_checkpoint(path, tiny_model("llama", hidden_size=64))
    with pytest.raises(ValueError, match="keep_last"):
        save_checkpoint(tmp_path, 2, model, None, None, {}, keep_last=0)


def test_export_writes_an_hf_folder(trained, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = trained[0]
    written = export_model(model, char_tokenizer(), tmp_path / "out")
    assert written == {"hf": tmp_path / "out" / "hf"}
    loaded = AutoModelForCausalLM.from_pretrained(written["hf"])
    torch.testing.assert_close(loaded.state_dict(), model.state_dict(), rtol=0, atol=0)
    assert AutoTokenizer.from_pretrained(written["hf"]).eos_token == "</s>"
    assert not [p for p in written["hf"].iterdir() if p.suffix in {".bin", ".pt", ".pkl"}]
    # exporting again replaces the folder as a whole, leaving no temporary directory
    export_model(model, None, tmp_path / "out")
    assert not (written["hf"] / "tokenizer.json").exists()
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["hf"]
    with pytest.raises(ValueError, match="GGUF file type"):
        export_model(model, None, tmp_path / "bad", gguf_template=tmp_path / "t.gguf", gguf_type="q5_k")
    with pytest.raises(FileNotFoundError, match="GGUF template"):
        export_model(model, None, tmp_path / "bad", gguf_template=tmp_path / "t.gguf")


def test_export_writes_a_gguf_for_llama_cpp(tmp_path):
    """A tiny Llama in SmolLM2's GGUF (its tokenizer and metadata), Q4_1 like the shipped file."""
    from deployrl.models.loading import resolve_model

    model = tiny_model("llama", vocab_size=49152, hidden_size=64, init_std=0.05)
    written = export_model(model, None, tmp_path, gguf_template=resolve_model("smollm2-135m").gguf_path)
    assert written == {"hf": tmp_path / "hf", "gguf": tmp_path / "model-q4_1.gguf"}
    try:
        import llama_cpp
    except ImportError:  # without the llamacpp extra: read the file back with gguf instead (slower)
        import gguf

        tensors = {t.name: t for t in gguf.GGUFReader(written["gguf"]).tensors}
        assert "blk.1.attn_q.weight" in tensors and "blk.2.attn_q.weight" not in tensors
        assert tensors["blk.0.ffn_down.weight"].tensor_type == gguf.GGMLQuantizationType.Q4_1
        assert list(tensors["token_embd.weight"].shape) == [64, 49152]
    else:
        from deployrl.engines.llama_runtime import LlamaRuntime

        runtime = LlamaRuntime(written["gguf"], n_ctx=64)
        assert runtime.n_vocab == 49152 and llama_cpp.llama_model_n_embd(runtime.model) == 64
        ids = (llama_cpp.llama_token * 8)()
        vocab = llama_cpp.llama_model_get_vocab(runtime.model)
        count = llama_cpp.llama_tokenize(vocab, b"1+2", 3, ids, 8, False, False)
        assert list(ids[:count]) == [33, 27, 34]  # SmolLM2 ids of "1", "+", "2": the tokenizer came along
        logp = runtime.score([1, 33, 27, 34])
        assert logp.shape == (3,) and bool(torch.isfinite(logp).all()) and bool((logp <= 0).all())
        runtime.close()
