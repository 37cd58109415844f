"""LoRA adapters through peft on the trainer's model: the base stays frozen at the deployed weights.

`add_lora` injects peft's LoRA layers into the model in place (`peft.inject_adapter_in_model`),
so every other part of deployrl keeps using the same `transformers` model; only the adapter
parameters require gradients. peft names the frozen base weight of an adapted layer
``<module>.base_layer.weight`` and the adapter ``<module>.lora_A.default.weight`` ([r, in]) and
``<module>.lora_B.default.weight`` ([out, r]); the layer computes W x + (alpha / r) B A x.
`split_adapter` turns such a state dict back into the base's own names and the adapters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

ADAPTER = "default"  # peft's adapter name
BASE_MARK = ".base_layer."


@dataclass(frozen=True)
class Adapter:
    """One adapted linear layer: W + scale * B @ A."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scale: float  # alpha / r


def add_lora(model: nn.Module, rank: int, alpha: float, dropout: float, target_modules: tuple[str, ...]) -> nn.Module:
    """Inject LoRA layers (B = 0: the model is unchanged) into `model`, in place; freeze the rest."""
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules))
    inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(is_adapter_name(name))
    return model


def is_adapter_name(name: str) -> bool:
    """Whether a parameter or module name lies inside a LoRA adapter (lora_A / lora_B)."""
    return ".lora_A" in name or ".lora_B" in name


def adapter_scales(model: nn.Module) -> dict[str, float]:
    """alpha / r of every adapted module of `model`, by module name."""
    # peft's LoRA layers keep {adapter: alpha / r} in `scaling` (attention modules have a float there)
    return {name: float(module.scaling[ADAPTER]) for name, module in model.named_modules()
            if isinstance(getattr(module, "scaling", None), dict) and ADAPTER in module.scaling}


def split_adapter(
    state_dict: dict[str, torch.Tensor], scales: dict[str, float]
) -> tuple[dict[str, torch.Tensor], dict[str, Adapter]]:
    """(base weights under the base model's own names, {module name: Adapter}) of a state dict;
    a model without adapters gives (state_dict, {})."""
    base, adapters = {}, {}
    for name, value in state_dict.items():
        if ".lora_A." in name:
            module = name.split(".lora_A.")[0]
            adapters[module] = Adapter(value, state_dict[f"{module}.lora_B.{ADAPTER}.weight"], scales[module])
        elif not is_adapter_name(name):
            base[name.replace(BASE_MARK, ".")] = value
    return base, adapters
