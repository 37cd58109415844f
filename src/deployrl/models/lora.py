"""LoRA adapters through peft on the trainer's model: the base stays frozen at the deployed weights.

`add_lora` injects peft's LoRA layers into the model in place (`peft.inject_adapter_in_model`),
so every other part of deployrl keeps using the same `transformers` model; only the adapter
parameters require gradients. peft names the frozen base weight of an adapted layer
``<module>.base_layer.weight`` and the adapter ``<module>.lora_A.default.weight`` ([r, in]) and
``<module>.lora_B.default.weight`` ([out, r]); the layer computes W x + (alpha / r) B A x.
`split_adapter` turns such a state dict back into the base's own names and the adapters, and
`merge_adapters` folds the adapters into the base weights.

`save_adapter` / `load_adapter` use peft's folder layout (`adapter_config.json` +
`adapter_model.safetensors`, keys `base_model.model.<module>.lora_A.weight`), so a saved adapter
also loads with `peft.PeftModel.from_pretrained(base_model, folder)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import nn

ADAPTER = "default"  # peft's adapter name
BASE_MARK = ".base_layer."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # what PeftModel.save_pretrained puts before the module names


@dataclass(frozen=True)
class Adapter:
    """One adapted linear layer: W + scale * B @ A."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scale: float  # alpha / r


def add_lora(
    model: nn.Module, rank: int, alpha: float, dropout: float, target_modules: tuple[str, ...],
    base: Optional[str] = None, seed: int = 0,
) -> nn.Module:
    """Inject LoRA layers (B = 0: the model is unchanged) into `model`, in place; freeze the rest.
    A's random initialisation is drawn from `seed` alone, so that every process (and every rank of
    a sharded run) starts from the same adapter. `base` (the base model's spec) is recorded in the
    adapter's saved config."""
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=sorted(target_modules),
                        base_model_name_or_path=base, task_type="CAUSAL_LM")
    devices = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):  # the caller's random streams are left as they were
        torch.manual_seed(seed)
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


def merge_adapters(base: dict[str, torch.Tensor], adapters: dict[str, Adapter]) -> dict[str, torch.Tensor]:
    """The base weights (`split_adapter`'s) with every adapter folded in: W + scale * B @ A (in
    float32, stored in W's dtype)."""
    merged = dict(base)
    for module, adapter in adapters.items():
        weight = base[module + ".weight"]
        delta = adapter.scale * (adapter.b.float() @ adapter.a.float())
        merged[module + ".weight"] = (weight.float() + delta).to(weight.dtype)
    return merged


def has_adapters(model: nn.Module) -> bool:
    return ADAPTER in getattr(model, "peft_config", {})


def saved_name(name: str) -> str:
    """peft's saved name of an adapter parameter: `<module>.lora_A.default.weight` -> `<module>.lora_A.weight`."""
    return name.replace(f".{ADAPTER}.", ".")


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors, whole and on the CPU, under peft's saved names (`saved_name`).
    An FSDP-sharded model's are gathered: every rank must call this."""
    from torch.distributed.tensor import DTensor

    return {saved_name(name): (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu()
            for name, p in model.named_parameters() if is_adapter_name(name)}


def save_adapter(model: nn.Module, directory: Path, weights: dict[str, torch.Tensor]) -> None:
    """Write the adapter `weights` (under `saved_name`s) and the model's LoRA config in peft's
    layout into `directory` (created if needed)."""
    _save_peft(directory, weights, model.peft_config[ADAPTER])


def write_adapters(directory: Path, adapters: dict[str, Adapter]) -> None:
    """`split_adapter`'s adapters in peft's layout, as a server (vLLM) loads them: one rank and
    scale for every module (what `add_lora` makes), alpha = scale * rank."""
    from peft import LoraConfig

    shapes = {(adapter.a.shape[0], adapter.scale) for adapter in adapters.values()}
    if len(shapes) != 1:
        raise ValueError(f"adapters with different (rank, scale) pairs {sorted(shapes)}: peft's layout takes one")
    (rank, scale), = shapes
    weights = {}
    for module, adapter in adapters.items():
        weights[f"{module}.lora_A.weight"], weights[f"{module}.lora_B.weight"] = adapter.a, adapter.b
    targets = sorted({module.rsplit(".", 1)[-1] for module in adapters})
    _save_peft(directory, weights, LoraConfig(r=rank, lora_alpha=scale * rank, target_modules=targets, task_type="CAUSAL_LM"))


def _save_peft(directory: Path, weights: dict[str, torch.Tensor], config) -> None:
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({PEFT_PREFIX + k: v.contiguous() for k, v in weights.items()}, directory / ADAPTER_WEIGHTS,
              metadata={"format": "pt"})
    config.save_pretrained(directory)


def read_adapter_config(directory: Path):
    """The peft LoraConfig of an adapter folder; a clear error for anything else."""
    from peft import LoraConfig

    file = Path(directory) / ADAPTER_CONFIG
    try:
        config = LoraConfig.from_pretrained(str(directory))
    except (ValueError, TypeError, OSError) as err:
        raise ValueError(f"{file}: not a peft LoRA adapter config ({err})") from None
    if config.peft_type != "LORA" or not isinstance(config.r, int):
        raise ValueError(f"{file}: peft_type {config.peft_type!r}; deployrl loads LoRA adapters only")
    return config


def read_adapter(model: nn.Module, directory: Path) -> dict[str, torch.Tensor]:
    """The adapter saved in `directory` (peft's layout) under `model`'s parameter names, checked
    against the model's LoRA layers: the same rank, scale, target modules and tensor shapes."""
    from safetensors.torch import load_file

    directory = Path(directory)
    saved = read_adapter_config(directory)
    own = model.peft_config[ADAPTER] if has_adapters(model) else None
    if own is None or (saved.r, saved.lora_alpha, set(saved.target_modules)) != (
            own.r, own.lora_alpha, set(own.target_modules)):
        have = "none" if own is None else f"rank {own.r}, alpha {own.lora_alpha}, targets {sorted(own.target_modules)}"
        raise ValueError(
            f"the adapter in {directory} (rank {saved.r}, alpha {saved.lora_alpha}, targets"
            f" {sorted(saved.target_modules)}) does not fit the model's LoRA layers ({have}): set model.lora to match"
        )
    file = directory / ADAPTER_WEIGHTS
    weights = {k.removeprefix(PEFT_PREFIX): v for k, v in load_file(file).items()}
    params = {saved_name(name): (name, p) for name, p in model.named_parameters() if is_adapter_name(name)}
    if set(weights) != set(params):
        raise ValueError(f"{file} does not fit the model's adapters: missing {sorted(set(params) - set(weights))[:5]},"
                         f" unexpected {sorted(set(weights) - set(params))[:5]}")
    wrong = [k for k, v in weights.items() if v.shape != params[k][1].shape]
    if wrong:
        raise ValueError(f"{file}: {wrong[0]} has shape {tuple(weights[wrong[0]].shape)}, the model's is"
                         f" {tuple(params[wrong[0]][1].shape)}")
    return {params[k][0]: v for k, v in weights.items()}


def load_adapter(model: nn.Module, directory: Path) -> None:
    """Copy the adapter saved in `directory` into `model`'s LoRA layers (an FSDP-sharded model takes
    each rank's shard); the base weights are untouched."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, read_adapter(model, directory),
                         options=StateDictOptions(full_state_dict=True, strict=False))


def attach_adapter(model: nn.Module, directory: Path) -> nn.Module:
    """Add LoRA layers shaped as the adapter saved in `directory` to `model` and load it (in place)."""
    saved = read_adapter_config(directory)
    add_lora(model, saved.r, saved.lora_alpha, 0.0, tuple(saved.target_modules), base=saved.base_model_name_or_path)
    load_adapter(model, directory)
    return model


def adapter_base(directory: Path, base: Optional[str] = None) -> str:
    """The base model spec of an adapter folder: `base` if given, else the one its config names."""
    spec = base or read_adapter_config(directory).base_model_name_or_path
    if not spec:
        raise ValueError(f"{Path(directory) / ADAPTER_CONFIG} names no base model (base_model_name_or_path):"
                         " give the base with --base")
    return spec
