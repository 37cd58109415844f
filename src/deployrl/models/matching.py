"""The trainer's forward on the weights its engine holds (`model.match_engine`).

`HeldWeights` knows, per parameter of the trainer's model, the formats the engine rounds it
through (`deployrl.models.formats`; the engine registry says which: `engines.held_weights`).
`HeldWeights.call(model, fn)` runs `fn(model)` with every such parameter replaced by its
rounded value, straight-through: the forward computes with the engine's weights and the gradient
reaches the trainer's own (`torch.func.functional_call`, so names, state dicts and the optimizer
see the model unchanged). A rounding is computed once per version of a parameter (after each
optimizer step: the learner calls `forget`), not once per micro-batch.
"""

from __future__ import annotations

from typing import Callable, Optional, TypeVar

import torch
from torch import nn

from deployrl.models.formats import held, straight_through
from deployrl.models.lora import ADAPTER as ADAPTER_NAME, adapter_scales, is_adapter_name

T = TypeVar("T")


class _Calls(nn.Module):
    """`fn(model)` as a module call, so that functional_call can swap the model's parameters."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, fn: Callable[[nn.Module], T]) -> T:
        return fn(self.model)


class HeldWeights:
    """{parameter name: formats} of one model and engine; the rounded values, cached per version.

    `merged` ({base weight name: (lora_A name, lora_B name, scale)}): the engine folds these adapters
    into their base weight before rounding (`rollout.lora_serving=merged`). The trainer's base
    weight W then computes as R(W + s B A) - s B A, so that with the adapter's own branch the
    layer applies R(W + s B A), and the gradient reaches A and B straight-through.
    """

    def __init__(self, formats: dict[str, tuple[str, ...]],
                 merged: Optional[dict[str, tuple[str, str, float]]] = None) -> None:
        # f32 holds fp32 (and narrower) weights exactly: nothing to round
        self.formats = {name: tuple(f) for name, f in formats.items() if tuple(f) not in ((), ("f32",))}
        self.merged = {name: m for name, m in (merged or {}).items() if name in self.formats}
        self._rounded: dict[str, tuple[tuple[int, ...], torch.Tensor]] = {}

    def __bool__(self) -> bool:
        return bool(self.formats)

    def forget(self) -> None:
        """Drop the cached roundings: the weights changed in a way their version counters do not show
        (a fused optimizer step)."""
        self._rounded.clear()

    def rounded(self, name: str, weight: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
        """held(weight) in the weight's dtype, no gradient (for a merged base, R(W + s B A) - s B A);
        recomputed when a tensor it reads changed (a new version or storage) or after `forget`."""
        tensors = [weight] + [params[n] for n in self.merged.get(name, ())[:2]]
        key = tuple(v for t in tensors for v in (t._version, t.data_ptr()))
        cached = self._rounded.get(name)
        if cached is None or cached[0] != key:
            with torch.no_grad():
                if name in self.merged:
                    a, b, scale = params[self.merged[name][0]], params[self.merged[name][1]], self.merged[name][2]
                    delta = scale * (b.float() @ a.float())
                    value = held(weight.float() + delta, self.formats[name]) - delta
                else:
                    value = held(weight, self.formats[name])
            cached = (key, value.to(weight.dtype))
            self._rounded[name] = cached
        return cached[1]

    def matched(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Every rounded parameter of `model` as the engine holds it, with the gradient of its own."""
        params = dict(model.named_parameters())
        return {name: straight_through(weight, self.rounded(name, weight, params)) if weight.requires_grad
                else self.rounded(name, weight, params)
                for name, weight in params.items() if name in self.formats}

    def call(self, model: nn.Module, fn: Callable[[nn.Module], T]) -> T:
        """fn(model), computed on the weights as the engine holds them."""
        weights = {f"model.{name}": value for name, value in self.matched(model).items()}
        return torch.func.functional_call(_Calls(model), weights, (fn,), strict=False, tie_weights=True)


EMBEDDING, HEAD, LINEAR, ADAPTER, OTHER = "embedding", "head", "linear", "adapter", "other"


def parameter_roles(model: nn.Module) -> dict[str, str]:
    """What each parameter of `model` (peft names included) is to an engine: the input `embedding`
    (with a tied head), an untied output `head`, a `linear` weight of the decoder, a LoRA `adapter`
    tensor, or `other` (norms, biases)."""
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    linear_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    roles = {}
    for name, weight in model.named_parameters():
        if is_adapter_name(name):
            roles[name] = ADAPTER
        elif weight is embedding:
            roles[name] = EMBEDDING
        elif weight is head:
            roles[name] = HEAD
        elif id(weight) in linear_weights and weight.dim() == 2:
            roles[name] = LINEAR
        else:
            roles[name] = OTHER
    return roles


def merged_adapters(model: nn.Module) -> dict[str, tuple[str, str, float]]:
    """{base weight name: (lora_A weight name, lora_B weight name, alpha / r)} of `model`'s adapters."""
    names = {name for name, _ in model.named_parameters()}
    merged = {}
    for module, scale in adapter_scales(model).items():
        base, a, b = (f"{module}.base_layer.weight", f"{module}.lora_A.{ADAPTER_NAME}.weight",
                      f"{module}.lora_B.{ADAPTER_NAME}.weight")
        if {base, a, b} <= names:
            merged[base] = (a, b, scale)
    return merged
