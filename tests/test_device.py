"""Where the trainer runs (`model.device`) and in which precision it computes (`model.autocast`)."""

import pytest
import torch
from test_trainer import toy_config

from deployrl.algo.logprobs import chunked_token_stats
from deployrl.models.loading import Scorer, completion_hidden, output_head, token_logprobs
from deployrl.settings.config import load_config
from deployrl.settings.model import Autocast, Device
from deployrl.settings.parsing import ConfigError
from deployrl.training.distributed import init_world
from deployrl.training.trainer import Trainer


@pytest.fixture
def two_gpus(monkeypatch):
    """A machine that looks as if it had two CUDA devices (nothing is allocated on them)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_auto_is_the_cpu_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert Device.AUTO.resolve() == torch.device("cpu")


def test_auto_and_cuda_take_torchruns_local_rank(two_gpus, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert Device.AUTO.resolve() == Device.CUDA.resolve() == torch.device("cuda", 1)
    assert Device.AUTO.resolve(local_rank=0) == torch.device("cuda", 0)
    assert Device.CPU.resolve() == torch.device("cpu")  # cpu stays cpu where CUDA is there
    with pytest.raises(ValueError, match="LOCAL_RANK=2 but only 2 CUDA devices"):
        Device.CUDA.resolve(local_rank=2)


def test_cuda_without_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="model.device=cuda, but this torch .* sees no CUDA device"):
        init_world("cuda")  # before any model loads: the Trainer asks for its World first


def test_device_and_autocast_settings_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="model.device"):
        load_config(None, ["model.device=gpu"])
    with pytest.raises(ConfigError, match="model.autocast=bf16 casts fp32 weights"):
        load_config(None, ["model.dtype=bf16", "model.autocast=bf16"])
    assert load_config(None, []).model.device == "auto"


def test_autocast_is_bf16_on_cuda_with_fp32_weights_only():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert Autocast.AUTO.dtype(cuda, torch.float32) is torch.bfloat16
    assert Autocast.AUTO.dtype(cpu, torch.float32) is None
    assert Autocast.AUTO.dtype(cuda, torch.bfloat16) is None  # bf16 weights compute in bf16 already
    assert Autocast.OFF.dtype(cuda, torch.float32) is None
    assert Autocast.BF16.dtype(cpu, torch.float32) is torch.bfloat16


def test_autocast_runs_the_decoder_in_bf16_and_the_head_in_fp32():
    """The scorer under bf16 autocast is exactly: the decoder under torch.autocast, then the fp32 head's
    log-softmax outside it; it differs from the fp32 scorer, and gradients reach the fp32 weights in fp32."""
    from tiny import tiny_model

    model = tiny_model()
    prompts = [[1, 5, 6, 7], [1, 5, 6, 7], [1, 8]]
    completions = torch.randint(3, 40, (3, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.arange(10)[None, :] < torch.tensor([10, 7, 4])[:, None]
    mixed = token_logprobs(Scorer(model, torch.bfloat16), prompts, completions, mask).logp
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = completion_hidden(model, prompts, completions, mask)
    assert hidden.dtype == torch.float32  # the residual stream stays in the weights' dtype
    reference = chunked_token_stats(hidden, output_head(model), completions, mask).logp
    assert mixed.dtype == torch.float32
    torch.testing.assert_close(mixed, reference, rtol=0, atol=0)
    full = token_logprobs(Scorer(model), prompts, completions, mask).logp
    assert not torch.equal(mixed[mask], full[mask])  # bf16 matmuls did run
    mixed[mask].sum().backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and g.dtype == torch.float32 and g.abs().sum() > 0 for g in grads)


def test_the_trainer_trains_with_bf16_autocast_on_the_cpu(tmp_path, tiny_dir):
    trainer = Trainer(toy_config(tmp_path, tiny_dir, "steps=2", "model.autocast=bf16"))
    assert trainer.learner.passes.scorer.autocast is torch.bfloat16
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    history = trainer.run()
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in history)
    for name, p in trainer.model.named_parameters():
        assert p.dtype == torch.float32 and not torch.equal(p, before[name]), name
    states = [t for s in trainer.learner.optimizer.state.values() for t in s.values() if t.dim() > 0]
    assert states and all(t.dtype == torch.float32 for t in states)


def test_model_and_optimizer_live_on_the_configured_device(device, tmp_path, tiny_dir):
    trainer = Trainer(toy_config(tmp_path, tiny_dir, "steps=1", f"model.device={device}"))
    trainer.run()
    where = torch.device(device).type
    assert trainer.world.device.type == where
    assert all(p.device.type == where for p in trainer.model.parameters())
    states = [t for s in trainer.learner.optimizer.state.values() for t in s.values() if t.dim() > 0]
    assert states and all(t.device.type == where for t in states)


def test_a_sync_hands_the_engine_the_models_own_tensors(tmp_path, tiny_dir):
    """In one process the trainer copies nothing for a sync: the engine gets the model's tensors
    where they live, and copies to the host only what it uses (with served adapters, the adapters)."""
    trainer = Trainer(toy_config(tmp_path, tiny_dir, "model.lora.rank=4"))
    weights, own = trainer.engine_weights(), trainer.model.state_dict()
    assert weights.keys() == own.keys()
    assert all(weights[k].data_ptr() == own[k].data_ptr() and not weights[k].requires_grad for k in own)
