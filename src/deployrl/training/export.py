"""The export of a trained model for deployment: a Hugging Face folder, and with a GGUF template a
llama.cpp file; a LoRA run's adapter besides, in peft's and llama.cpp's layouts.

Each folder is written in a temporary folder and renamed into place, as checkpoints are
(`deployrl.training.checkpoint`, whose file helpers this module shares).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Mapping, Optional

import torch

from deployrl.models.lora import has_adapters
from deployrl.training.checkpoint import fsync_dir, fsync_file, move_into_place, save_model, sync_tree, unwrap


def _write_folder(out: Path, write) -> Path:
    """Call write(folder) on a temporary folder, then move it to `out` atomically."""
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}-", dir=out.parent))
    try:
        write(tmp)
        sync_tree(tmp)
        move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def export_model(
    model,
    tokenizer,
    out_dir: Path,
    gguf_template: Optional[Path] = None,
    gguf_type: str = "q4_1",
    weights: Optional[Mapping[str, torch.Tensor]] = None,
) -> dict[str, Path]:
    """Write the model for deployment; returns {"hf": folder} plus {"gguf": file} with a template,
    and for a model with LoRA adapters also {"adapter": folder} and, with a template, {"gguf_adapter": file}.

    `weights` (default: the model's state_dict) are the ones written: a sharded model's gathered weights.

    `out_dir/hf/` is a Hugging Face folder (safetensors, config, tokenizer) that
    `from_pretrained` loads; it replaces a previous export atomically. With `gguf_template`
    (the GGUF the model came from: its tokenizer and metadata are reused), also
    `out_dir/model-{gguf_type}.gguf` for llama.cpp, of type f32, f16, bf16, q8_0, q4_0 or q4_1.
    With adapters, `hf/` and `model-{gguf_type}.gguf` hold the merged model (W + scale B A),
    `adapter/` the adapter in peft's layout (`PeftModel.from_pretrained(base, "adapter")`) and
    `adapter.gguf` llama.cpp's LoRA adapter (`llama-cli -m <template> --lora adapter.gguf`): the
    exact trained model on the template's own base, where a merged quantised file rounds the update.
    """
    from deployrl.engines.gguf_io import FILE_TYPES, GGUFTemplate, write_gguf, write_gguf_adapter
    from deployrl.models.lora import adapter_scales, is_adapter_name, merge_adapters, saved_name, split_adapter
    from deployrl.registry import unknown_name_error

    if gguf_template is not None:
        gguf_template = Path(gguf_template)
        if gguf_type not in FILE_TYPES:
            raise unknown_name_error("GGUF file type", gguf_type, list(FILE_TYPES))
        if not gguf_template.is_file():
            raise FileNotFoundError(f"GGUF template not found: {gguf_template}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = unwrap(model)
    weights = dict(weights if weights is not None else target.state_dict())
    lora = has_adapters(target)
    if lora:
        saved = {saved_name(k): v.detach().cpu() for k, v in weights.items() if is_adapter_name(k)}
        base, adapters = split_adapter(weights, adapter_scales(target))
        weights = merge_adapters(base, adapters)
    written: dict[str, Path] = {}
    written["hf"] = _write_folder(out_dir / "hf", lambda folder: save_model(target, tokenizer, folder, weights))
    if lora:
        written["adapter"] = _write_folder(out_dir / "adapter", lambda folder: save_model(
            target, tokenizer, folder, adapter=saved))
    if gguf_template is not None:
        template = GGUFTemplate.read(gguf_template)
        out = out_dir / f"model-{gguf_type}.gguf"
        write_gguf(weights, target.config, template, out, gguf_type)
        written["gguf"] = out
        if lora:
            written["gguf_adapter"] = write_gguf_adapter(adapters, target.config, template.arch, out_dir / "adapter.gguf")
        for file in written.values():
            if file.is_file():
                fsync_file(file)
        fsync_dir(out_dir)
    return written
