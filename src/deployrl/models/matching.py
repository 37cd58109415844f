"""The trainer's forward on the weights its engine holds (`model.match_engine`).

`HeldWeights` knows, per parameter of the trainer's model, the formats the engine rounds it
through (`deployrl.models.formats`; the engine registry says which: `engines.held_weights`).
`HeldWeights.call(model, fn)` runs `fn(model)` with every such parameter replaced by its
rounded value, straight-through: the forward computes with the engine's weights and the gradient
reaches the trainer's own. The swap happens inside each module that owns such a parameter, for
the span of its forward (hooks registered for the call alone), because that is where the weight
is whole: under FSDP2 a decoder layer's parameters are gathered only for its forward, and the
rounding of a row-blocked format needs every column of a row. Names, state dicts and the
optimizer see the model unchanged. A rounding is computed once per version of a parameter (after
each optimizer step: the learner calls `forget`), not once per micro-batch; with `cache=False`
(FSDP2, where a cached copy would hold every rank's weights whole) once per forward.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Callable, Optional, TypeVar

import torch
from torch import nn

from deployrl.models.formats import held, straight_through
from deployrl.models.lora import ADAPTER as ADAPTER_NAME, adapter_scales, is_adapter_name

T = TypeVar("T")


class HeldWeights:
    """{parameter name: formats} of one model and engine; the rounded values, cached per version.

    `merged` ({base weight name: (lora_A name, lora_B name, scale)}): the engine folds these adapters
    into their base weight before rounding (`rollout.lora_serving=merged`). The trainer's base
    weight W then computes as R(W + s B A) - s B A, so that with the adapter's own branch the
    layer applies R(W + s B A), and the gradient reaches A and B straight-through.
    """

    def __init__(self, formats: dict[str, tuple[str, ...]],
                 merged: Optional[dict[str, tuple[str, str, float]]] = None, cache: bool = True) -> None:
        # f32 holds fp32 (and narrower) weights exactly: nothing to round
        self.formats = {name: tuple(f) for name, f in formats.items() if tuple(f) not in ((), ("f32",))}
        self.merged = {name: m for name, m in (merged or {}).items() if name in self.formats}
        self.cache = cache
        self._rounded: dict[str, tuple[tuple[int, ...], torch.Tensor]] = {}

    def __bool__(self) -> bool:
        return bool(self.formats)

    def forget(self) -> None:
        """Drop the cached roundings: the weights changed in a way their version counters do not show
        (a fused optimizer step)."""
        self._rounded.clear()

    def rounded(self, name: str, weight: torch.Tensor, params: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """held(weight) in the weight's dtype, no gradient (for a merged base, R(W + s B A) - s B A,
        A and B looked up by name in `params`); recomputed when a tensor it reads changed (a new
        version or storage), after `forget`, or always without the cache."""
        tensors = [weight] + [params(n) for n in self.merged.get(name, ())[:2]]
        key = tuple(v for t in tensors for v in (t._version, t.data_ptr()))
        cached = self._rounded.get(name)
        if cached is None or cached[0] != key:
            with torch.no_grad():
                if name in self.merged:
                    a, b, scale = tensors[1], tensors[2], self.merged[name][2]
                    delta = scale * (b.float() @ a.float())
                    value = held(weight.float() + delta, self.formats[name]) - delta
                else:
                    value = held(weight, self.formats[name])
            cached = (key, value.to(weight.dtype))
            if self.cache:
                self._rounded[name] = cached
        return cached[1]

    def value(self, name: str, weight: torch.Tensor, params: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """The rounded `weight`, with the gradient of its own if it takes one."""
        rounded = self.rounded(name, weight, params)
        return straight_through(weight, rounded) if weight.requires_grad else rounded

    def matched(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Every rounded parameter of `model` as the engine holds it, with the gradient of its own."""
        return {name: self.value(name, weight, model.get_parameter)
                for name, weight in model.named_parameters() if name in self.formats}

    def call(self, model: nn.Module, fn: Callable[[nn.Module], T]) -> T:
        """fn(model), computed on the weights as the engine holds them.

        Each module that owns a rounded parameter swaps in its value for the span of its forward
        (then the weight is the one FSDP2 gathered for that forward). The output head's weight is
        read directly, not through its module's forward (the chunked log-softmax), so it is swapped
        for the whole call (under FSDP2 the head belongs to the root, gathered for the whole call).
        Without the cache the backward recomputes a rounded weight instead of keeping it from the
        forward, as FSDP2 gathers a weight again instead of keeping it.
        """
        names = {}  # a parameter's first name: tied weights (embedding and head) have one format entry
        owners = []
        for prefix, module in model.named_modules():
            for local, weight in module._parameters.items():
                if weight is not None:
                    name = names.setdefault(id(weight), f"{prefix}.{local}" if prefix else local)
                    if name in self.formats:
                        owners.append((module, local, name))
        head, state = model.get_output_embeddings(), _Call(self, model)
        with ExitStack() as stack:
            if not self.cache and torch.is_grad_enabled():
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(state.pack, state.unpack))
            for module, local, name in owners:
                swap = _Swap(state, local, name)
                if module is head:
                    swap.enter(module)
                    stack.callback(swap.leave, module)
                else:
                    stack.callback(module.register_forward_pre_hook(swap.pre_hook).remove)
                    stack.callback(module.register_forward_hook(swap.post_hook, always_call=True).remove)
            return fn(model)


class _Call:
    """The rounded values of one `HeldWeights.call`: one per weight (a tied embedding and head get
    one, whose gradient reaches the weight summed as the model's own), and how to recompute each
    for the backward (`pack`, `unpack`: a saved tensor that views a rounded value is kept as the
    weight's name and the view's geometry)."""

    def __init__(self, weights: HeldWeights, model: nn.Module) -> None:
        self.weights, self.model = weights, model
        self.values: dict[int, torch.Tensor] = {}  # id of a weight: its value
        self.recipes: dict[int, tuple[str, torch.Tensor]] = {}  # a value's storage: (name, weight)

    def value(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        if id(weight) not in self.values:
            value = self.weights.value(name, weight, self.model.get_parameter)
            self.values[id(weight)] = value
            self.recipes[value.untyped_storage().data_ptr()] = (name, weight)
        return self.values[id(weight)]

    def pack(self, saved: torch.Tensor):
        recipe = self.recipes.get(saved.untyped_storage().data_ptr()) if saved.layout is torch.strided else None
        return saved if recipe is None else (recipe, saved.size(), saved.stride(), saved.storage_offset())

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        (name, weight), size, stride, offset = packed
        return self.weights.rounded(name, weight, self.model.get_parameter).as_strided(size, stride, offset)


class _Swap:
    """One module's rounded parameter in place of its own, between `enter` and `leave` (nests)."""

    def __init__(self, state: _Call, local: str, name: str) -> None:
        self.state, self.local, self.name = state, local, name
        self.saved: list[torch.Tensor] = []

    def enter(self, module: nn.Module) -> None:
        weight = module._parameters[self.local]
        self.saved.append(weight)
        # not setattr: a Parameter's slot takes a plain (differentiable) tensor only through the dict
        module._parameters[self.local] = self.state.value(self.name, weight)

    def leave(self, module: nn.Module) -> None:
        module._parameters[self.local] = self.saved.pop()

    def pre_hook(self, module: nn.Module, args) -> None:
        self.enter(module)

    def post_hook(self, module: nn.Module, args, output) -> None:
        self.leave(module)


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
