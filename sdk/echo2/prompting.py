"""How a prompt's text becomes token ids. Workers and the learner must agree exactly, so the rule
lives here, once: a tokenizer with a chat template gets the text as one user turn plus the generation
prompt; a plain tokenizer encodes the text as is (with its default special tokens)."""

from __future__ import annotations

from typing import Any


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """`tokenizer` is a transformers tokenizer (duck-typed, so the SDK needs no transformers)."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer(text)["input_ids"]]
