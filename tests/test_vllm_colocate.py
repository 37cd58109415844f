"""The vllm engine's life beside the trainer on a GPU (sleep, wake, sync, teardown), against a
recording stand-in for vLLM's `LLM`: it runs anywhere, vLLM or not. The stand-in's methods have
the signatures of vLLM's own (tests/test_vllm.py checks them against the installed vLLM)."""

import gc
import importlib.machinery
import sys
import types
import weakref
from types import SimpleNamespace

import pytest
import torch

from deployrl.engines import make_engine
from deployrl.engines.base import SamplingParams
from deployrl.engines.vllm_engine import MEMORY_MARGIN, memory_share, model_folder
from deployrl.models.loading import ModelSource

EOS = 2
GIB = 2**30


class RecordingLLM:
    """vLLM's `LLM` as the engine uses it, recording each call; it holds the weights it was sent."""

    calls: list = []
    created: list = []

    def __init__(self, model: str, **kwargs) -> None:
        from safetensors.torch import load_file

        self.options = kwargs
        self.weights = load_file(f"{model}/model.safetensors")
        core = SimpleNamespace(shutdown=lambda: self.calls.append(("shutdown",)))
        self.llm_engine = SimpleNamespace(engine_core=core,
                                          add_lora=lambda request: self.calls.append(("add_lora",)))
        RecordingLLM.created.append(weakref.ref(self))

    def generate(self, prompts, sampling_params=None, *, use_tqdm=True, lora_request=None, priority=None,
                 tokenization_kwargs=None, mm_processor_kwargs=None):
        self.calls.append(("generate", len(prompts)))
        requests = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        step = {5: SimpleNamespace(logprob=-1.0, rank=1)}
        return [SimpleNamespace(outputs=[SimpleNamespace(index=k, token_ids=[5], logprobs=[step])
                                         for k in range(request.kwargs.get("n", 1))],
                                prompt_logprobs=[None] + [{t: SimpleNamespace(logprob=-1.0)}
                                                          for t in p["prompt_token_ids"][1:]])
                for p, request in zip(prompts, requests)]

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(("collective_rpc", method))
        if method == "reload_weights":
            self.weights.update({name: value.clone() for name, value in kwargs["weights_iterator"]})

    def apply_model(self, func):
        model = SimpleNamespace(model=SimpleNamespace(embed_tokens=SimpleNamespace(
            weight=self.weights["model.embed_tokens.weight"])), lm_head=SimpleNamespace(
            weight=self.weights.get("lm_head.weight", self.weights["model.embed_tokens.weight"])))
        return [func(model)]

    def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        self.calls.append(("reset_prefix_cache",))

    def sleep(self, level=1, mode="abort"):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags or ())))


@pytest.fixture
def fake_vllm(monkeypatch, tmp_path):
    """vLLM's modules replaced by the stand-in, on a machine that looks like it has a GPU with 60 of 80 GiB free."""
    module = types.ModuleType("vllm")
    module.__spec__ = importlib.machinery.ModuleSpec("vllm", None)  # what find_spec finds in sys.modules
    module.LLM = RecordingLLM
    module.SamplingParams = lambda **kwargs: SimpleNamespace(kwargs=kwargs)
    parallel_state = types.ModuleType("vllm.distributed.parallel_state")
    for name in ("destroy_model_parallel", "destroy_distributed_environment"):
        setattr(parallel_state, name, lambda name=name: RecordingLLM.calls.append((name,)))
    lora_request = types.ModuleType("vllm.lora.request")
    lora_request.LoRARequest = lambda *args, **kwargs: SimpleNamespace(args=args, kwargs=kwargs)
    modules = {"vllm": module, "vllm.distributed": types.ModuleType("vllm.distributed"),
               "vllm.distributed.parallel_state": parallel_state, "vllm.lora": types.ModuleType("vllm.lora"),
               "vllm.lora.request": lora_request}
    for name, value in modules.items():
        monkeypatch.setitem(sys.modules, name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (60 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr("deployrl.engines.vllm_engine._live_engines", weakref.WeakSet())  # real engines elsewhere
    RecordingLLM.calls, RecordingLLM.created = [], []
    return RecordingLLM


@pytest.fixture
def model():
    from tiny import tiny_model

    return tiny_model()


def engine(model, **settings):
    return make_engine("vllm:bf16", model, ModelSource("tiny", None), [EOS], context_length=64, parallel=4, **settings)


PARAMS = SamplingParams(n=2, max_new_tokens=4, seed=0)


def test_vllm_takes_the_free_memory_less_a_margin_and_sleeps(fake_vllm, model):
    vllm_engine = engine(model)
    options = fake_vllm.created[0]().options
    assert options["gpu_memory_utilization"] == pytest.approx(60 / 80 - MEMORY_MARGIN)
    assert options["enable_sleep_mode"] is True and options["enforce_eager"] is False
    vllm_engine.close()
    fixed = engine(model, gpu_memory_utilization=0.3, enforce_eager=True, sleep=False)
    options = fake_vllm.created[1]().options
    assert options["gpu_memory_utilization"] == 0.3 and options["enforce_eager"] and not options["enable_sleep_mode"]
    fixed.release()
    assert ("sleep", 2) not in fake_vllm.calls  # sleep=False: the engine keeps the card
    fixed.close()


def test_too_little_free_memory_is_a_clear_error():
    assert memory_share(60 * GIB, 80 * GIB) == pytest.approx(0.65)
    assert memory_share(60 * GIB, 80 * GIB, reserved=8 * GIB) == pytest.approx(0.55)
    with pytest.raises(RuntimeError, match="too little for vLLM beside the trainer"):
        memory_share(4 * GIB, 80 * GIB)


def test_sleep_wake_sync_generate_in_trls_order(fake_vllm, model):
    """Level 2 (every weight synced): sample, sleep; wake the weights, reload, wake the KV cache; a
    generation after a sleep with no sync in between reloads the last weights sent first."""
    vllm_engine = engine(model)
    calls = fake_vllm.calls
    vllm_engine.generate([[1, 5]], PARAMS)
    vllm_engine.release()
    assert calls[-2:] == [("generate", 1), ("sleep", 2)]
    del calls[:]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    vllm_engine.sync(model.state_dict())
    assert calls == [("wake_up", ("weights",)), ("collective_rpc", "reload_weights"), ("reset_prefix_cache",),
                     ("wake_up", ("kv_cache",)), ("reset_prefix_cache",)]
    held = fake_vllm.created[0]().weights["model.embed_tokens.weight"]
    assert torch.equal(held, model.model.embed_tokens.weight.detach().to(torch.bfloat16))
    vllm_engine.release()
    del calls[:]
    vllm_engine.generate([[1, 5]], PARAMS)  # a skipped update: no sync since the sleep
    assert calls == [("wake_up", ("weights",)), ("collective_rpc", "reload_weights"), ("reset_prefix_cache",),
                     ("wake_up", ("kv_cache",)), ("reset_prefix_cache",), ("generate", 1)]
    vllm_engine.close()


def test_served_adapters_sleep_at_level_one_and_keep_the_base(fake_vllm, model, monkeypatch):
    from deployrl.models.lora import add_lora

    monkeypatch.setattr("deployrl.engines.vllm_engine.VLLMEngine._check_adapters", lambda self, adapters: None)
    adapted = add_lora(model, 4, 8.0, 0.0, ("q_proj", "v_proj"))
    vllm_engine = engine(adapted)
    calls = fake_vllm.calls
    vllm_engine.generate([[1, 5]], PARAMS)
    vllm_engine.release()
    assert calls[-1] == ("sleep", 1)
    del calls[:]
    vllm_engine.sync(adapted.state_dict())
    assert ("collective_rpc", "reload_weights") not in calls  # the base stays: only the adapter is sent
    assert calls[:2] == [("wake_up", ("weights",)), ("wake_up", ("kv_cache",))] and ("add_lora",) in calls
    vllm_engine.close()


def test_close_frees_the_engine_so_that_a_retry_starts(fake_vllm, model):
    vllm_engine = engine(model)
    llm = fake_vllm.created[0]
    vllm_engine.close()
    gc.collect()
    assert llm() is None  # nothing holds vLLM's LLM any more
    assert fake_vllm.calls[-3:] == [("shutdown",), ("destroy_model_parallel",), ("destroy_distributed_environment",)]


def test_one_model_folder_per_architecture_config_and_dtype(fake_vllm, model):
    from tiny import tiny_model

    folder = model_folder(model.config, "LlamaForCausalLM", torch.bfloat16)
    assert folder == model_folder(model.config, "LlamaForCausalLM", torch.bfloat16)  # stable: compile caches hit
    assert folder != model_folder(model.config, "LlamaForCausalLM", torch.float32)
    assert folder != model_folder(tiny_model(hidden_size=64).config, "LlamaForCausalLM", torch.bfloat16)
    engine(model).close()
    assert (folder / "config.json").is_file() and not (folder / "model.safetensors").exists()  # weights: sent, not kept


def test_the_trainer_reserves_its_optimizer_state_and_kl_reference(model):
    """What the trainer allocates after vLLM starts: AdamW's two moments per trainable weight (the
    adapters alone with LoRA), and a whole copy of the model for the KL term."""
    from deployrl.models.lora import add_lora
    from deployrl.settings.config import load_config
    from deployrl.training.rollout import trainer_reserve

    add_lora(model, 4, 8.0, 0.0, ("q_proj", "v_proj"))
    adapters = sum(p.numel() * 4 for n, p in model.named_parameters() if ".lora_" in n)
    everything = sum(p.numel() * 4 for p in model.parameters())
    assert trainer_reserve(model, load_config(None, [])) == 2 * adapters
    assert trainer_reserve(model, load_config(None, ["algo.kl_coef=0.1"])) == 2 * adapters + everything


def test_under_torchrun_each_rank_joins_the_ranks_group_and_leaves_it_standing(fake_vllm, model, monkeypatch):
    """TRL's colocate mode: executor external_launcher (vLLM inside the ranks' process group, on this
    rank's device), no tensor parallelism; closing the engine must not destroy the trainer's group."""
    alone_folder = model_folder(model.config, "LlamaForCausalLM", torch.bfloat16)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    # the ranks start together (a collective): none may wait for another's folder lock
    assert model_folder(model.config, "LlamaForCausalLM", torch.bfloat16) == alone_folder.with_name(
        alone_folder.name + "-rank1")
    vllm_engine = engine(model)
    options = fake_vllm.created[0]().options
    assert options["distributed_executor_backend"] == "external_launcher" and options["tensor_parallel_size"] == 1
    vllm_engine.close()
    assert ("destroy_model_parallel",) in fake_vllm.calls
    assert ("destroy_distributed_environment",) not in fake_vllm.calls
    monkeypatch.setenv("WORLD_SIZE", "1")
    alone = engine(model)
    assert fake_vllm.created[1]().options["distributed_executor_backend"] == "uni"
    alone.close()


def test_vllm_needs_an_engine_on_every_rank(model):
    from deployrl.settings.config import load_config

    with pytest.raises(ValueError, match="needs rollout.engine_ranks=all: under torchrun vLLM joins"):
        load_config(None, ["rollout.engine=vllm:bf16", "rollout.engine_ranks=main"])
    load_config(None, ["rollout.engine=vllm:bf16"])
    load_config(None, ["rollout.engine=hf:fp32", "rollout.engine_ranks=main"])
