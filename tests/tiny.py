"""A tiny random causal LM with a character tokenizer, saved as a local model directory."""

from __future__ import annotations

import os
from pathlib import Path

import torch

CHARS = list("0123456789+-*=? abcdefghijklmnopqrstuvwxyz.,")
SPECIAL = ["<pad>", "<s>", "</s>"]


def char_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="?"
    )


def tiny_model(
    arch: str = "llama", vocab_size: int | None = None, seed: int = 0, init_std: float = 0.3, hidden_size: int = 32
):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    config_cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[arch]
    config = config_cls(
        vocab_size=vocab_size or len(SPECIAL) + len(CHARS),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        initializer_range=init_std,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def save_tiny(directory: Path, arch: str = "llama", hidden_size: int = 32) -> Path:
    tiny_model(arch, hidden_size=hidden_size).save_pretrained(directory)
    char_tokenizer().save_pretrained(directory)
    return directory


def starts_with_digit(completion: str, reference) -> float:
    """The toy task's reward: 1 if the completion starts with a digit."""
    return float(completion[:1].isdigit())


def toy_task_file(directory: Path, count: int = 16) -> Path:
    """A JSONL task whose prompts are digits; the toy reward is `tiny:starts_with_digit`."""
    import json

    Path(directory).mkdir(parents=True, exist_ok=True)
    path = Path(directory) / "digits.jsonl"
    lines = [json.dumps({"prompt": f"{i % 10}=", "answer": str(i % 10)}) for i in range(count)]
    # every rank of a distributed test writes it: atomically, so that no rank reads a torn file
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)
    return path
