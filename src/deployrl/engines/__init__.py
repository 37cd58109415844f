"""Rollout engines, by name: `hf:<precision>`, `llamacpp:<file type>` and `vllm:<dtype or quantisation>`.

An engine spec is ``kind:option``; both parts are checked by `parse_engine_spec` before any
model loads, and `make_engine` builds the engine from the trainer's model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from deployrl.engines.base import RolloutBatch, RolloutEngine, SamplingParams, trainer_view
from deployrl.engines.gguf_io import FILE_TYPES
from deployrl.engines.hf import PRECISIONS
from deployrl.engines.vllm_engine import OPTIONS as VLLM_OPTIONS
from deployrl.models import ModelSource, unwrapped
from deployrl.registry import Registry, unknown_name_error

__all__ = [
    "ENGINES", "LORA_SERVING", "RolloutBatch", "RolloutEngine", "SamplingParams", "make_engine", "parse_engine_spec",
    "serves_lora", "trainer_view",
]


@dataclass(frozen=True)
class EngineKind:
    options: tuple[str, ...]
    default: str
    build: Callable[..., RolloutEngine]
    lora_servings: tuple[str, ...] = ("adapter",)  # the LORA_SERVING ways it can hold a model's adapters


def _build_hf(option, model, source, eos_token_ids, context_length, threads, parallel, lora_serving):
    from deployrl.engines.hf import HFEngine

    return HFEngine(model, option, eos_token_ids, context_length)


def _build_llamacpp(option, model, source: ModelSource, eos_token_ids, context_length, threads, parallel, lora_serving):
    from deployrl.engines.llamacpp import LlamaCppEngine
    from deployrl.lora import adapter_scales

    if source.gguf_path is None:
        raise ValueError(
            "the llamacpp engine writes the trainer's weights into a GGUF shaped like the model's own"
            " GGUF file (tokenizer, metadata): load the model from a .gguf file or the smollm2-135m alias"
        )
    return LlamaCppEngine(
        model.state_dict(), model.config, source.gguf_path, option, eos_token_ids, n_ctx=context_length or 2048,
        threads=threads, parallel=parallel, adapter_scales=adapter_scales(model),
    )


def _build_vllm(option, model, source, eos_token_ids, context_length, threads, parallel, lora_serving):
    from deployrl.engines.vllm_engine import VLLMEngine
    from deployrl.lora import adapter_scales

    return VLLMEngine(
        model.state_dict(), model.config, type(unwrapped(model)).__name__, option, eos_token_ids,
        context_length=context_length or 2048,
        parallel=parallel, threads=threads, adapter_scales=adapter_scales(model), lora_serving=lora_serving,
    )


LORA_SERVING = ("adapter", "merged")  # a model's LoRA adapters: beside the base, or folded into it
ENGINES: Registry[EngineKind] = Registry("engine")
ENGINES.register("hf")(EngineKind(tuple(PRECISIONS), "bf16", _build_hf))
ENGINES.register("llamacpp")(EngineKind(tuple(FILE_TYPES), "q4_1", _build_llamacpp))
ENGINES.register("vllm")(EngineKind(tuple(VLLM_OPTIONS), "bf16", _build_vllm, lora_servings=LORA_SERVING))


def serves_lora(spec: str, serving: str) -> bool:
    """Whether engine `spec` can hold a model's LoRA adapters the `serving` way (a LORA_SERVING name)."""
    return serving in ENGINES.get(parse_engine_spec(spec)[0]).lora_servings


def parse_engine_spec(spec: str) -> tuple[str, str]:
    """'llamacpp:q4_1' -> ('llamacpp', 'q4_1'); a bare kind takes its default option."""
    kind_name, _, option = spec.partition(":")
    kind = ENGINES.get(kind_name)
    option = option or kind.default
    if option not in kind.options:
        raise unknown_name_error(f"{kind_name} engine option", option, list(kind.options))
    return kind_name, option


def make_engine(
    spec: str,
    model,
    source: ModelSource,
    eos_token_ids: list[int],
    context_length: Optional[int] = None,
    threads: Optional[int] = None,
    parallel: int = 32,
    lora_serving: str = "adapter",
) -> RolloutEngine:
    """Build the engine `spec` from the trainer's model (its own copy of the weights).

    `threads` (None: every CPU) and `parallel` (completions decoded together) apply to llamacpp
    and vllm; the hf engine decodes all completions together on torch's threads. `lora_serving`
    (`RolloutConfig`'s): a model's LoRA adapters served beside the base, or merged into it (vllm)."""
    kind_name, option = parse_engine_spec(spec)
    return ENGINES.get(kind_name).build(option, model, source, eos_token_ids, context_length, threads, parallel, lora_serving)
