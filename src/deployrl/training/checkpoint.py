"""Checkpoints that resume a run exactly (the export for deployment is `deployrl.training.export`).

A checkpoint is a directory ``run_dir/checkpoints/step_{step:08d}/``::

    model/                   save_pretrained (safetensors) + tokenizer: from_pretrained loads it;
                             a LoRA run's adapter alone, in peft's layout (deployrl.models.lora)
    optimizer.safetensors    tensors of the optimizer state, keyed "state.{parameter name}.{name}"
    optimizer.json           the rest of it (param_groups, python-number state), tensors by key
    shards/                  instead of optimizer.*, when saved by several ranks (below)
    scheduler.json           scheduler.state_dict() without its functions
    rng.safetensors          torch CPU (and CUDA) RNG states, the caller's torch.Generator states
    rng.json                 python `random` and numpy's legacy global state
    trainer_state.json       the caller's dict (step, data position, dual state, ...)
    manifest.json            written last: every other file with its size and sha256

Nothing is pickled: tensors go to safetensors, everything else to JSON with a few tags that keep
tuples, non-string dict keys, non-finite floats and numpy arrays exact, so a round trip gives
back an identical ``state_dict()``.

A checkpoint is built in a temporary directory next to the final one (``.tmp-step_...``), every
file is fsync'ed, then the directory is renamed into place. ``manifest.json`` is the completeness
marker: a directory without it (a crash during the save) is ignored by `latest_checkpoint` and
refused by `load_checkpoint`, and a file whose size or sha256 differs from the manifest is
refused with an error naming it. A save that fails (disk full, directory not writable) removes
its temporary directory and raises a CheckpointError; the checkpoints before it are untouched,
since old ones are pruned only after a new one is in place. One process writes a run directory
at a time.

Weights and optimizer state are keyed by parameter name (`torch.distributed.checkpoint.state_dict`).
A single process writes them whole. Ranks of an FSDP-sharded run each write their own shards of
both with `torch.distributed.checkpoint` into ``shards/`` (safetensors files, one per rank, whose
headers say which slice each holds; the optimizer's hyper-parameters go to ``optimizer.json``),
and rank 0 writes the rest: `model/`, the consolidated safetensors export, and the manifest over
every file. Loading reads whichever layout it finds and hands each rank its slice, so a
checkpoint resumes on any number of ranks.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Mapping, Optional

import numpy as np
import torch
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    _init_optim_state,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from deployrl.models.lora import ADAPTER_WEIGHTS, adapter_state, has_adapters, load_adapter, save_adapter
from deployrl.training.distributed import World, barrier

GATHERED = StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole tensors, on rank 0's CPU
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)  # this rank's shards, optimizer keyed "state.{name}.{key}"
SHARDS_DIR = "shards"


def _shard_tensors(model, optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's shards of the model's and the optimizer's tensors, keyed "model.{name}" and
    "optimizer.{key}", and the optimizer's other values (its hyper-parameters), by key."""
    weights, state = get_state_dict(model, optimizer, options=FLAT)
    # a tied weight (lm_head = embed_tokens) is stored once, under the name named_parameters gives it
    own = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
    tensors = {f"model.{k}": v for k, v in weights.items() if k in own}
    tensors.update({f"optimizer.{k}": v for k, v in state.items() if isinstance(v, torch.Tensor)})
    return tensors, {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}


CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"
MODEL_DIR = "model"
FORMAT = "deployrl-checkpoint"
VERSION = 1
STEP_DIR = re.compile(r"^step_(\d+)$")
PICKLE_SUFFIXES = {".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt"}


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt, cannot be written, or does not fit the objects
    it is loaded into."""


# ----------------------------------------------------------------------------- JSON + tensors


def _to_cpu_tensor(value: torch.Tensor, seen_storages: set[int]) -> torch.Tensor:
    """A contiguous CPU tensor that owns its storage (safetensors refuses shared memory)."""
    t = value.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    storage = t.untyped_storage()
    if (
        not t.is_contiguous()
        or storage.nbytes() != t.numel() * t.element_size()
        or storage.data_ptr() in seen_storages
    ):
        t = t.clone(memory_format=torch.contiguous_format)
    if t.numel():
        seen_storages.add(t.untyped_storage().data_ptr())
    return t


class _Encoder:
    """Turns a state object into JSON data, moving its tensors to a flat {key: tensor} dict."""

    def __init__(self, what: str, drop_callables: bool = False) -> None:
        self.what = what
        self.drop_callables = drop_callables
        self.tensors: dict[str, torch.Tensor] = {}
        self._by_id: dict[int, str] = {}
        self._storages: set[int] = set()

    def encode(self, obj: Any, path: tuple[str, ...] = ()) -> Any:
        if isinstance(obj, torch.Tensor):
            return {"__tensor__": self._tensor_key(obj, path)}
        if obj is None or isinstance(obj, (bool, str)):
            return obj
        if isinstance(obj, np.generic):
            return self.encode(obj.item(), path)
        if isinstance(obj, int):
            return int(obj)
        if isinstance(obj, float):
            return float(obj) if math.isfinite(obj) else {"__float__": repr(float(obj))}
        if isinstance(obj, tuple):
            return {"__tuple__": [self.encode(v, path + (str(i),)) for i, v in enumerate(obj)]}
        if isinstance(obj, list):
            return [self.encode(v, path + (str(i),)) for i, v in enumerate(obj)]
        if isinstance(obj, np.ndarray):
            if obj.dtype == object:
                raise TypeError(f"{self._where(path)}: numpy object arrays cannot be stored in a checkpoint")
            return {"__ndarray__": self.encode(obj.tolist(), path), "dtype": obj.dtype.str}
        if isinstance(obj, Mapping):
            items = [(k, v) for k, v in obj.items() if not (self.drop_callables and callable(v))]
            if all(isinstance(k, str) and not k.startswith("__") for k, _ in items):
                return {k: self.encode(v, path + (k,)) for k, v in items}
            return {"__dict__": [[self.encode(k, path), self.encode(v, path + (str(k),))] for k, v in items]}
        if self.drop_callables and callable(obj):
            return None
        raise TypeError(
            f"{self._where(path)}: a {type(obj).__name__} cannot be stored in a checkpoint"
            " (only tensors, numbers, strings, None, lists, tuples, dicts and numpy arrays)"
        )

    def _where(self, path: tuple[str, ...]) -> str:
        return self.what + "".join(f"[{p!r}]" for p in path)

    def _tensor_key(self, tensor: torch.Tensor, path: tuple[str, ...]) -> str:
        if id(tensor) in self._by_id:  # the same tensor twice: stored once
            return self._by_id[id(tensor)]
        base = ".".join(path) or "tensor"
        key, n = base, 1
        while key in self.tensors:
            key, n = f"{base}#{n}", n + 1
        self.tensors[key] = _to_cpu_tensor(tensor, self._storages)
        self._by_id[id(tensor)] = key
        return key


def _decode(data: Any, tensors: Mapping[str, torch.Tensor], file: Path) -> Any:
    if isinstance(data, list):
        return [_decode(v, tensors, file) for v in data]
    if not isinstance(data, dict):
        return data
    if "__tensor__" in data:
        key = data["__tensor__"]
        if key not in tensors:
            raise CheckpointError(f"{file} refers to tensor {key!r}, which its .safetensors file does not hold")
        return tensors[key]
    if "__tuple__" in data:
        return tuple(_decode(v, tensors, file) for v in data["__tuple__"])
    if "__float__" in data:
        return float(data["__float__"])
    if "__ndarray__" in data:
        return np.array(_decode(data["__ndarray__"], tensors, file), dtype=np.dtype(data["dtype"]))
    if "__dict__" in data:
        return {_decode(k, tensors, file): _decode(v, tensors, file) for k, v in data["__dict__"]}
    return {k: _decode(v, tensors, file) for k, v in data.items()}


# ----------------------------------------------------------------------------- files


def fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # platforms without directory file descriptors
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_json(path: Path, data: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, allow_nan=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _read_json(path: Path) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"checkpoint file {path} is corrupt (not valid JSON: {err})") from None


def _save_state(directory: Path, name: str, obj: Any, drop_callables: bool = False) -> None:
    """`obj` as name.json, plus name.safetensors when it holds tensors."""
    from safetensors.torch import save_file

    encoder = _Encoder(name, drop_callables)
    data = encoder.encode(obj)
    tensor_file = None
    if encoder.tensors:
        tensor_file = f"{name}.safetensors"
        save_file(encoder.tensors, directory / tensor_file, metadata={"format": "pt"})
        fsync_file(directory / tensor_file)
    _write_json(directory / f"{name}.json", {"version": VERSION, "tensor_file": tensor_file, "data": data})


def _load_state(directory: Path, name: str) -> Any:
    from safetensors.torch import load_file

    path = directory / f"{name}.json"
    meta = _read_json(path)
    if not isinstance(meta, dict) or "data" not in meta:
        raise CheckpointError(f"checkpoint file {path} is corrupt (no 'data' entry)")
    tensors: dict[str, torch.Tensor] = {}
    if meta.get("tensor_file"):
        tensor_path = directory / meta["tensor_file"]
        if not tensor_path.is_file():
            raise CheckpointError(f"checkpoint file {tensor_path} is missing")
        try:
            tensors = load_file(tensor_path, device="cpu")
        except Exception as err:  # safetensors raises its own error types
            raise CheckpointError(f"checkpoint file {tensor_path} is corrupt: {err}") from None
    return _decode(meta["data"], tensors, path)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file())


def _write_manifest(directory: Path, step: int) -> None:
    files = {}
    for path in _files(directory):
        rel = path.relative_to(directory).as_posix()
        if rel != MANIFEST:
            files[rel] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "files": files,
    }
    _write_json(directory / MANIFEST, manifest)


def verify_checkpoint(path: Path, deep: bool = True) -> dict:
    """The manifest of the complete checkpoint at `path`; raises CheckpointError otherwise.

    Every file listed must exist with its recorded size and (when `deep`) its sha256.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint directory at {path}")
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        hint = ""
        if (path / CHECKPOINTS).is_dir():
            hint = "; this looks like a run directory: latest_checkpoint(run_dir) finds its newest checkpoint"
        raise CheckpointError(
            f"checkpoint {path} is incomplete: {manifest_path} is missing (the save was interrupted?){hint}"
        )
    manifest = _read_json(manifest_path)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"checkpoint file {manifest_path} is corrupt (not a {FORMAT} manifest)")
    if manifest.get("version", 0) > VERSION:
        raise CheckpointError(
            f"{manifest_path}: checkpoint format version {manifest['version']} is newer than this deployrl"
            f" reads ({VERSION}); upgrade deployrl"
        )
    for rel, info in manifest["files"].items():
        parts = Path(rel).parts
        if Path(rel).is_absolute() or ".." in parts or not isinstance(info, dict) or not {"size", "sha256"} <= set(info):
            raise CheckpointError(f"checkpoint file {manifest_path} is corrupt (bad entry {rel!r})")
        file = path / rel
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: file {file} is missing")
        size = file.stat().st_size
        if size != info["size"]:
            raise CheckpointError(
                f"checkpoint {path} is corrupt: file {file} has {size} bytes, the manifest says {info['size']}"
                " (truncated or modified)"
            )
        if deep and _sha256(file) != info["sha256"]:
            raise CheckpointError(f"checkpoint {path} is corrupt: file {file} does not match its sha256 in the manifest")
    return manifest


# ----------------------------------------------------------------------------- RNG and models


def _rng_state(generators: Optional[Mapping[str, torch.Generator]]) -> dict:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(legacy=True),
        "generators": {name: g.get_state() for name, g in (generators or {}).items()},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _restore_generators(state: dict, generators: Optional[Mapping[str, torch.Generator]], file: Path) -> None:
    saved = state.get("generators", {})
    for name, generator in (generators or {}).items():
        generator.set_state(saved[name])


def _restore_global_rng(state: dict, file: Path) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available():
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        else:
            warnings.warn(
                f"{file}: saved with {len(cuda)} CUDA devices, {torch.cuda.device_count()} visible now;"
                " CUDA RNG states not restored",
                RuntimeWarning,
                stacklevel=3,
            )


def unwrap(model):
    """The module itself under DistributedDataParallel / DataParallel / torch.compile wrappers."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, torch.nn.Module) and hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
            model = model.module
        else:
            return model


def _key_mismatch(model, weights: Mapping[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """Model keys missing from `weights` (tied aliases of loaded keys excepted), and extra keys."""
    own = model.state_dict()
    # Tied weights (lm_head = embed_tokens) are saved once: a missing key may alias a loaded one.
    names_of: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    aliases = {name: names for names in names_of.values() for name in names}
    missing = [k for k in own if k not in weights and not any(a in weights for a in aliases.get(k, ()))]
    return missing, sorted(k for k in weights if k not in own)


def _fill_weights(model, weights: Mapping[str, torch.Tensor], source: Path) -> None:
    """Copy the full `weights` into `model` in place (parameters stay the same objects; an
    FSDP-sharded model takes each rank's shard)."""
    missing, unexpected = _key_mismatch(model, weights)
    if missing or unexpected:
        raise CheckpointError(
            f"the weights in {source} do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    own = model.state_dict()
    for key, value in weights.items():
        if own[key].shape != value.shape:
            raise CheckpointError(
                f"the weights in {source} do not fit the model: {key} has shape {tuple(value.shape)},"
                f" the model's is {tuple(own[key].shape)}"
            )
    set_model_state_dict(model, dict(weights), options=StateDictOptions(full_state_dict=True, strict=False))


def _load_weights(model, model_dir: Path) -> None:
    from safetensors.torch import load_file

    target = unwrap(model)
    if (model_dir / ADAPTER_WEIGHTS).is_file():  # a LoRA run: the base comes from the model spec
        try:
            load_adapter(target, model_dir)
        except (ValueError, RuntimeError) as err:
            raise CheckpointError(str(err)) from None
        return
    if has_adapters(target):
        raise CheckpointError(f"{model_dir} holds a full model, not a LoRA adapter: it was saved by a run"
                              " without model.lora (set model.lora.rank=0 to resume it)")
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"checkpoint model directory {model_dir} holds no .safetensors file")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            weights.update(load_file(file, device="cpu"))
        except Exception as err:
            raise CheckpointError(f"checkpoint file {file} is corrupt: {err}") from None
    if any(_key_mismatch(target, weights)) and hasattr(type(target), "from_pretrained"):
        # transformers stores some architectures under other names than their modules use
        # (its weight conversions); its own loader maps them back.
        dtype = next(target.parameters()).dtype
        weights = type(target).from_pretrained(model_dir, dtype=dtype).state_dict()
    _fill_weights(target, weights, model_dir)


def save_model(model, tokenizer, directory: Path, weights: Optional[Mapping[str, torch.Tensor]] = None,
                adapter: Optional[dict[str, torch.Tensor]] = None) -> None:
    """save_pretrained of `model` with `weights` (default: its own state_dict) into `directory`;
    with `adapter` (its `adapter_state`), that LoRA adapter alone, in peft's layout."""
    target = unwrap(model)
    if not hasattr(target, "save_pretrained"):
        raise TypeError(f"{type(target).__name__} has no save_pretrained: checkpoints hold transformers models")
    if adapter is not None:
        save_adapter(target, directory, adapter)
    else:
        # a copy: save_pretrained drops tied aliases from the dict it is given
        target.save_pretrained(directory, state_dict=None if weights is None else dict(weights))
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    pickled = [p.name for p in directory.rglob("*") if p.suffix in PICKLE_SUFFIXES]
    if pickled:
        raise RuntimeError(f"save_pretrained wrote pickle files {pickled}; deployrl checkpoints hold none")


def sync_tree(directory: Path) -> None:
    for path in _files(directory):
        fsync_file(path)
    for sub in sorted({p.parent for p in _files(directory)} | {directory}, key=lambda p: -len(p.parts)):
        fsync_dir(sub)


def move_into_place(tmp: Path, final: Path) -> None:
    """Rename `tmp` to `final` (replacing an existing `final`) and make the rename durable."""
    trash = None
    if final.exists():
        trash = final.with_name(f".trash-{final.name}-{os.getpid()}-{time.monotonic_ns()}")
        os.replace(final, trash)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


# ----------------------------------------------------------------------------- public API


def checkpoint_path(run_dir: Path, step: int) -> Path:
    """Where the checkpoint of `step` lives (whether or not it exists)."""
    return Path(run_dir) / CHECKPOINTS / f"step_{int(step):08d}"


def checkpoint_step(path: Path) -> Optional[int]:
    """The step of a `step_XXXXXXXX` directory name, None for any other name."""
    match = STEP_DIR.match(Path(path).name)
    return int(match.group(1)) if match else None


def list_checkpoints(run_dir: Path, deep: bool = False) -> list[Path]:
    """Complete checkpoints of `run_dir`, oldest step first; incomplete ones are left out."""
    directory = Path(run_dir) / CHECKPOINTS
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        step = checkpoint_step(path)
        if step is None or not path.is_dir():
            continue  # .tmp-* (an interrupted save), .trash-* and anything else
        try:
            verify_checkpoint(path, deep=deep)
        except CheckpointError as err:
            warnings.warn(f"skipping checkpoint: {err}", RuntimeWarning, stacklevel=2)
            continue
        found.append((step, path))
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: Path, deep: bool = False) -> Optional[Path]:
    """The newest complete checkpoint of `run_dir`, or None.

    Sizes are checked; with `deep` also every sha256, newest first, so that a corrupt newest
    checkpoint is skipped (with a warning) for the one before it.
    """
    for path in reversed(list_checkpoints(run_dir)):
        if deep:
            try:
                verify_checkpoint(path, deep=True)
            except CheckpointError as err:
                warnings.warn(f"skipping checkpoint: {err}", RuntimeWarning, stacklevel=2)
                continue
        return path
    return None


def save_checkpoint(
    run_dir: Path,
    step: int,
    model,
    optimizer: Optional[torch.optim.Optimizer],
    scheduler,
    trainer_state: dict,
    keep_last: Optional[int] = 3,
    tokenizer=None,
    generators: Optional[Mapping[str, torch.Generator]] = None,
    world: World = World(),
) -> Path:
    """Write `run_dir/checkpoints/step_{step:08d}` atomically and return its path.

    `trainer_state` holds JSON values (and tensors, stored in safetensors). The RNG states
    of torch (CPU, and CUDA when initialised), python `random`, numpy's global generator and
    every generator in `generators` are saved. Afterwards only the new checkpoint and the
    newest `keep_last - 1` others are kept (None keeps all), and leftovers of interrupted
    saves are removed. With a sharded model every rank of `world` calls this (the weights are
    gathered) and rank 0 writes.
    """
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be at least 1 (or None to keep all), got {keep_last}")
    if not isinstance(trainer_state, Mapping):
        raise TypeError(f"trainer_state must be a dict, got {type(trainer_state).__name__}")
    final = checkpoint_path(run_dir, step)
    root = final.parent
    target = unwrap(model)
    # a LoRA run keeps only its adapter, gathered whole (it is small): the frozen base is the model
    # spec's own file
    adapter = adapter_state(target) if has_adapters(target) else None
    weights = None if adapter is not None else get_model_state_dict(target, options=GATHERED)
    sharded = world.distributed and optimizer is not None and adapter is None
    optimizer_state = None
    if optimizer is not None and not sharded:
        optimizer_state = get_optimizer_state_dict(target, optimizer, options=GATHERED)
    tmp = None
    try:
        if sharded:  # every rank writes its shards into the same temporary directory
            tmp = root / f".tmp-{final.name}-ranks"
            if world.is_main:
                shutil.rmtree(tmp, ignore_errors=True)  # a crashed earlier attempt
                tmp.mkdir(parents=True)
            barrier(world)
            tensors, optimizer_state = _shard_tensors(target, optimizer)
            dcp.save(tensors, storage_writer=HuggingFaceStorageWriter(str(tmp / SHARDS_DIR), save_distributed=True))
            if not world.is_main:
                return final
        else:
            if not world.is_main:
                return final
            root.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=root))
        _save_state(tmp, "rng", _rng_state(generators))
        _save_state(tmp, "trainer_state", dict(trainer_state))  # first: a bad value fails fast
        if optimizer_state is not None:
            _save_state(tmp, "optimizer", optimizer_state)
        if scheduler is not None:
            _save_state(tmp, "scheduler", scheduler.state_dict(), drop_callables=True)
        save_model(target, tokenizer, tmp / MODEL_DIR, weights, adapter)
        sync_tree(tmp)
        _write_manifest(tmp, int(step))
        fsync_dir(tmp)
        move_into_place(tmp, final)
    except BaseException as err:
        from safetensors import SafetensorError  # how safetensors reports a failed write
        from torch.distributed.checkpoint.api import CheckpointException  # a rank's failed write

        if tmp is not None and world.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, (OSError, SafetensorError, CheckpointException)):  # disk full, read-only or vanished directory
            previous = latest_checkpoint(run_dir)
            raise CheckpointError(
                f"could not write checkpoint {final}: {err}. Nothing of it was kept; the previous checkpoint"
                f" ({previous or 'none'}) is untouched. Free space in {root} or make it writable, then resume"
            ) from err
        raise
    _prune(root, final, keep_last)
    return final


def _prune(root: Path, keep: Path, keep_last: Optional[int]) -> None:
    if keep_last is not None:
        others = [p for p in list_checkpoints(root.parent) if p != keep]
        for old in others[: max(len(others) - (keep_last - 1), 0)]:
            # Renamed first, so a crash mid-delete leaves no step_* directory that looks valid.
            trash = old.with_name(f".trash-{old.name}-{os.getpid()}-{time.monotonic_ns()}")
            os.replace(old, trash)
            shutil.rmtree(trash, ignore_errors=True)
    for leftover in root.iterdir():
        if leftover.is_dir() and leftover.name.startswith((".tmp-", ".trash-")):
            shutil.rmtree(leftover, ignore_errors=True)
    fsync_dir(root)


def load_checkpoint(
    path: Path,
    model,
    optimizer: Optional[torch.optim.Optimizer] = None,
    scheduler=None,
    generators: Optional[Mapping[str, torch.Generator]] = None,
    restore_rng: bool = True,
    verify: bool = True,
) -> dict:
    """Restore a checkpoint into the given objects and return its trainer_state.

    Weights are copied in place into `model` (its parameters stay the same objects, so an
    optimizer built on them stays valid); the optimizer, scheduler, generators and (with
    `restore_rng`) the global RNG states are restored when given. `verify` checks every
    file's sha256 against the manifest first (sizes are always checked).
    """
    path = Path(path)
    verify_checkpoint(path, deep=verify)
    # Read and decode everything before touching any object.
    optimizer_state = scheduler_state = None
    sharded = (path / SHARDS_DIR).is_dir()
    if optimizer is not None:
        if not (path / "optimizer.json").is_file():
            raise CheckpointError(f"checkpoint {path} holds no optimizer state ({path / 'optimizer.json'})")
        optimizer_state = _load_state(path, "optimizer")
    if scheduler is not None:
        if not (path / "scheduler.json").is_file():
            raise CheckpointError(f"checkpoint {path} holds no scheduler state ({path / 'scheduler.json'})")
        scheduler_state = _load_state(path, "scheduler")
    rng = _load_state(path, "rng")
    missing = [name for name in (generators or {}) if name not in rng.get("generators", {})]
    if missing:
        raise CheckpointError(
            f"{path / 'rng.json'} holds no state for generator(s) {missing}"
            f" (it has: {sorted(rng.get('generators', {})) or 'none'})"
        )
    trainer_state = _load_state(path, "trainer_state")

    if sharded:
        _load_shards(unwrap(model), optimizer, optimizer_state, path)
    else:
        _load_weights(model, path / MODEL_DIR)
    if optimizer_state is not None and not sharded:
        try:
            set_optimizer_state_dict(
                unwrap(model), optimizer, optimizer_state, options=StateDictOptions(full_state_dict=True)
            )
        except (ValueError, KeyError, RuntimeError, AssertionError) as err:
            raise CheckpointError(f"{path / 'optimizer.json'} does not fit the optimizer: {err}") from None
    if scheduler_state is not None:
        scheduler.load_state_dict(scheduler_state)
    _restore_generators(rng, generators, path / "rng.json")
    if restore_rng:
        _restore_global_rng(rng, path / "rng.json")
    return trainer_state


def _load_shards(model, optimizer: Optional[torch.optim.Optimizer], hyper: Optional[dict], path: Path) -> None:
    """Restore weights (and with `optimizer`, its state; `hyper` its non-tensor values) from the
    per-rank shards of `path`, whatever the number of ranks that wrote them and that read them."""
    if optimizer is None:
        own = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
        tensors = {f"model.{k}": v for k, v in get_model_state_dict(model).items() if k in own}
    else:
        # the optimizer's state tensors must exist, shaped like their parameters, to be read into
        _init_optim_state(optimizer)
        tensors, _ = _shard_tensors(model, optimizer)
    try:
        dcp.load(tensors, storage_reader=HuggingFaceStorageReader(str(path / SHARDS_DIR)))
    except Exception as err:  # a missing key or a corrupt file, reported by torch.distributed.checkpoint
        raise CheckpointError(f"the shards in {path / SHARDS_DIR} do not fit the model and optimizer: {err}") from None
    weights = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    loading = StateDictOptions(flatten_optimizer_state_dict=True, strict=False)  # tied aliases are not stored
    if optimizer is None:
        set_model_state_dict(model, weights, options=loading)
        return
    state = {**(hyper or {}), **{k[len("optimizer."):]: v for k, v in tensors.items() if k.startswith("optimizer.")}}
    set_state_dict(model, optimizer, model_state_dict=weights, optim_state_dict=state, options=loading)
