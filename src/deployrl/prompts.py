"""Prompt sources for commands that only sample: a prompt file or a built-in generator.

A prompt file is ``.jsonl`` (one object per line with a ``prompt`` string or a ``messages``
chat list) or ``.txt`` (one prompt per non-empty line). Errors name the file, line and field.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Union

Prompt = Union[str, list[dict[str, str]]]  # plain text or chat messages


def arithmetic_prompts(count: int, seed: int = 0) -> list[str]:
    """`count` two-operand integer questions (+, -, *), reproducible from `seed`."""
    rng = random.Random(seed)
    questions = []
    for _ in range(count):
        a, b, op = rng.randint(2, 99), rng.randint(2, 99), rng.choice("+-*")
        questions.append(f"What is {a} {op} {b}? Answer with a number.")
    return questions


def load_prompts(path: Path) -> list[Prompt]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: {path}")
    if path.suffix not in (".jsonl", ".txt"):
        raise ValueError(f"{path}: prompt files are .jsonl or .txt, got {path.suffix or 'no suffix'}")
    prompts: list[Prompt] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        if path.suffix == ".txt":
            prompts.append(line.strip())
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not valid JSON ({err.msg})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
        if isinstance(record.get("prompt"), str) and record["prompt"].strip():
            prompts.append(record["prompt"])
        elif isinstance(record.get("messages"), list) and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in record["messages"]
        ) and record["messages"]:
            prompts.append(record["messages"])
        else:
            raise ValueError(
                f"{path}:{number}: field 'prompt' (a non-empty string) or 'messages' (a list of"
                " {role, content}) is required"
            )
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def encode_prompts(tokenizer, prompts: list[Prompt], system_prompt: str | None = None) -> list[list[int]]:
    """Token ids of each prompt through the tokenizer's chat template (when it has one)."""
    encoded = []
    for prompt in prompts:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if system_prompt and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": system_prompt}] + messages
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        else:
            ids = tokenizer("\n".join(m["content"] for m in messages))["input_ids"]
        encoded.append(list(ids))
    return encoded
