"""Write a trainer's weights (HF names) into a GGUF file that llama.cpp loads.

The GGUF file the model came from is the template: its metadata (tokenizer, chat template,
general.*) and tensor list are kept, hyper-parameters are refreshed from the HF config (so a
template can carry a new model of another size with the same tokenizer), and every tensor is
re-encoded from the trainer's weights with `gguf`'s own quantisers:

* 2-D weights take the requested type (f32, f16, bf16, q8_0, q4_0, q4_1);
* the token embedding keeps the template's type when the request is a quantised type (as
  llama.cpp's quantiser treats it), and takes the requested float type otherwise;
* 1-D tensors (norms) stay f32.

Llama's q/k projections are stored in GGUF with the rotary halves interleaved; transformers
undoes that on load, so it is redone here (the permutation of llama.cpp's convert_hf_to_gguf).

`write_gguf_adapter` writes LoRA adapters in llama.cpp's adapter format, for a base GGUF
written (or shipped) once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from deployrl.models.lora import Adapter
from deployrl.models.matching import ADAPTER, EMBEDDING
from deployrl.registry import unknown_name_error

FILE_TYPES = {  # name -> (tensor type, general.file_type)
    "f32": ("F32", "ALL_F32"),
    "f16": ("F16", "MOSTLY_F16"),
    "bf16": ("BF16", "MOSTLY_BF16"),
    "q8_0": ("Q8_0", "MOSTLY_Q8_0"),
    "q4_0": ("Q4_0", "MOSTLY_Q4_0"),
    "q4_1": ("Q4_1", "MOSTLY_Q4_1"),
}
FLOAT_TYPES = {"f32", "f16", "bf16"}
PERMUTED_ARCHS = {"llama"}


def interleave_rotary(weight: np.ndarray, n_head: int) -> np.ndarray:
    """HF q/k weight [n_head * head_dim, D] -> GGUF order (rotary halves interleaved)."""
    return weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _rope_theta(config) -> float | None:
    params = getattr(config, "rope_parameters", None) or {}
    return params.get("rope_theta", getattr(config, "rope_theta", None))


def hyperparameters(config, arch: str) -> dict[str, float | int]:
    """GGUF hyper-parameter keys of `arch`, from an HF config."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    values = {
        "block_count": config.num_hidden_layers,
        "context_length": config.max_position_embeddings,
        "embedding_length": config.hidden_size,
        "feed_forward_length": config.intermediate_size,
        "attention.head_count": config.num_attention_heads,
        "attention.head_count_kv": config.num_key_value_heads,
        "attention.layer_norm_rms_epsilon": config.rms_norm_eps,
        "rope.dimension_count": head_dim,
        "rope.freq_base": _rope_theta(config),
        "vocab_size": config.vocab_size,
    }
    return {f"{arch}.{k}": v for k, v in values.items() if v is not None}


@dataclass(frozen=True)
class GGUFTemplate:
    """What write_gguf takes from a template GGUF: its metadata (key, value, type, array item type)
    and its tensors (name, type). Parsing a tokenizer's 49k strings takes seconds, so an engine
    that writes a GGUF at every weight sync reads its template once."""

    path: Path
    arch: str
    fields: tuple[tuple[str, object, object, object], ...]
    tensors: tuple[tuple[str, object], ...]

    @classmethod
    def read(cls, path: Path) -> "GGUFTemplate":
        import gguf

        reader = gguf.GGUFReader(path)
        fields = tuple(
            (key, field.contents(), field.types[0],
             field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
            for key, field in reader.fields.items()
            if not key.startswith("GGUF.") and key != "general.architecture"
        )
        tensors = tuple((t.name, t.tensor_type) for t in reader.tensors)
        return cls(Path(path), reader.fields["general.architecture"].contents(), fields, tensors)


def _tensor_names(arch: str, layers: int, where: Path | str):
    """gguf's map from HF tensor names to GGUF ones for `arch`."""
    import gguf

    arch_enum = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}.get(arch)
    if arch_enum is None:
        raise ValueError(f"{where}: architecture {arch!r} is unknown to the gguf package")
    return gguf.get_tensor_name_map(arch_enum, layers)


def _gguf_rows(name: str, rows: np.ndarray, config, arch: str) -> np.ndarray:
    """`rows` [out, ...] of GGUF tensor `name` in GGUF's order (Llama's q/k heads interleaved)."""
    if arch in PERMUTED_ARCHS and name.endswith("attn_q.weight"):
        return interleave_rotary(rows, config.num_attention_heads)
    if arch in PERMUTED_ARCHS and name.endswith("attn_k.weight"):
        return interleave_rotary(rows, config.num_key_value_heads)
    return rows


def _finish(writer, tmp: Path, out: Path) -> Path:
    """Write out what `writer` (open on `tmp`) holds, then move it to `out` in one step."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, out)
    return out


def stored_type(name: str, ndim: int, file_type: str, template_type):
    """The GGML type a GGUF of `file_type` stores tensor `name` (GGUF name, `ndim` dimensions) in:
    1-D tensors f32; the token embedding its template's type when the request is quantised (as
    llama.cpp's quantiser treats it); everything else the requested type."""
    import gguf

    if ndim == 1:
        return gguf.GGMLQuantizationType.F32
    if name == "token_embd.weight" and file_type not in FLOAT_TYPES:
        return template_type
    return gguf.GGMLQuantizationType[FILE_TYPES[file_type][0]]


def stored_formats(roles: dict[str, str], shapes: dict[str, int], template: Path, file_type: str) -> dict[str, str]:
    """The format (models.formats) each parameter takes in a GGUF of `file_type` written from the
    model, by role (models.matching.parameter_roles) and number of dimensions; adapters are
    written in f32 (`write_gguf_adapter`)."""
    import gguf

    embedding = next(t.tensor_type for t in gguf.GGUFReader(template).tensors if t.name == "token_embd.weight")
    formats = {}
    for name, role in roles.items():
        gguf_name = "token_embd.weight" if role == EMBEDDING else name
        qtype = stored_type(gguf_name, shapes[name], file_type, embedding)
        formats[name] = "f32" if role == ADAPTER else qtype.name.lower()
    return formats


def write_gguf(
    state_dict: dict[str, torch.Tensor], config, template: Path | GGUFTemplate, out: Path, file_type: str,
    held: Optional[dict[str, torch.Tensor]] = None,
) -> Path:
    """Write `state_dict` (HF names) as a GGUF of `file_type` shaped like `template`; atomic.

    `held`, when given, receives every tensor as the file holds it (HF names and layout, float32):
    the trainer's weights rounded to the file's types."""
    import gguf

    if file_type not in FILE_TYPES:
        raise unknown_name_error("GGUF file type", file_type, list(FILE_TYPES))
    if not isinstance(template, GGUFTemplate):
        template = GGUFTemplate.read(template)
    arch = template.arch
    names = _tensor_names(arch, config.num_hidden_layers, template.path)
    by_gguf_name = {}
    for hf_name, value in state_dict.items():
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is not None:
            by_gguf_name[gguf_name] = (hf_name, value)

    tmp = out.with_name(out.name + ".tmp")
    writer = gguf.GGUFWriter(tmp, arch)
    overrides = hyperparameters(config, arch)
    overrides["general.file_type"] = int(gguf.LlamaFileType[FILE_TYPES[file_type][1]])
    for key, value, value_type, sub_type in template.fields:
        if key in overrides:
            value = type(value)(overrides[key])
        writer.add_key_value(key, value, value_type, sub_type=sub_type)

    template_blocks = sum(1 for name, _ in template.tensors if name.endswith("attn_q.weight"))
    if config.num_hidden_layers > template_blocks:
        raise ValueError(
            f"{template.path} has {template_blocks} blocks, fewer than the model's {config.num_hidden_layers}"
        )
    for name, template_type in template.tensors:
        parts = name.split(".")
        if parts[0] == "blk" and int(parts[1]) >= config.num_hidden_layers:
            continue  # the template is deeper than the model
        if name not in by_gguf_name:
            raise ValueError(f"{template.path}: tensor {name} has no counterpart in the model's weights")
        hf_name, value = by_gguf_name[name]
        data = value.detach().to(torch.float32).cpu().numpy()
        qtype = stored_type(name, data.ndim, file_type, template_type)
        encoded = gguf.quants.quantize(data, qtype)  # blocks run along rows: permuting rows commutes
        if held is not None:
            held[hf_name] = torch.from_numpy(gguf.quants.dequantize(encoded, qtype).reshape(data.shape))
        writer.add_tensor(name, _gguf_rows(name, encoded, config, arch), raw_dtype=qtype)
    return _finish(writer, tmp, out)


def write_gguf_adapter(adapters: dict[str, Adapter], config, arch: str, out: Path) -> Path:
    """Write LoRA `adapters` ({HF module name: Adapter}) as a llama.cpp GGUF LoRA adapter; atomic.

    Tensors `<gguf weight name>.lora_a` [r, in] and `.lora_b` [out, r] in float32 (llama.cpp's
    layout, the same as peft's); each B is multiplied by its scale alpha / r and
    `adapter.lora.alpha` is set to r, so llama.cpp (which scales by alpha / r) applies exactly
    the trainer's scale, and `llama-cli -m base.gguf --lora adapter.gguf` needs no --lora-scaled.
    Llama's q/k rows are interleaved as in the base GGUF.
    """
    import gguf

    names = _tensor_names(arch, config.num_hidden_layers, out)
    ranks = {adapter.a.shape[0] for adapter in adapters.values()}
    if len(ranks) != 1:
        raise ValueError(f"a GGUF adapter holds one rank (adapter.lora.alpha is per file), got ranks {sorted(ranks)}")
    tmp = out.with_name(out.name + ".tmp")
    writer = gguf.GGUFWriter(tmp, arch)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(ranks.pop()))
    for module, adapter in adapters.items():
        name = names.get_name(module + ".weight", try_suffixes=(".weight",))
        if name is None:
            raise ValueError(f"adapted layer {module} has no GGUF counterpart for architecture {arch}")
        b = _gguf_rows(name, (adapter.b.detach().float() * adapter.scale).cpu().numpy(), config, arch)
        writer.add_tensor(name + ".lora_a", np.ascontiguousarray(adapter.a.detach().float().cpu().numpy()))
        writer.add_tensor(name + ".lora_b", np.ascontiguousarray(b))
    return _finish(writer, tmp, out)
