"""Prompts: plain text or chat messages, and their token ids through the chat template."""

from __future__ import annotations

from typing import Union

Prompt = Union[str, list[dict[str, str]]]  # plain text or chat messages


def encode_prompts(tokenizer, prompts: list[Prompt]) -> list[list[int]]:
    """Token ids of each prompt through the tokenizer's chat template (when it has one); a task's
    system prompt is already in its messages (tasks.make_prompt)."""
    encoded = []
    for prompt in prompts:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        else:
            ids = tokenizer("\n".join(m["content"] for m in messages))["input_ids"]
        encoded.append(list(ids))
    return encoded
