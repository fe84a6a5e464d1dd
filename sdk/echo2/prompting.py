"""How a prompt's text becomes token ids. Workers and the learner must agree exactly, so the rule
lives here, once: a tokenizer with a chat template gets the prompt's context (a chat item's turns before
its last user turn: a system prompt, earlier turns), then the text as the user's turn, plus the generation
prompt; a plain tokenizer encodes the context's contents and the text joined by blank lines, as is (with
its default special tokens)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def encode_prompt(tokenizer: Any, text: str, context: Sequence[Mapping[str, str]] | None = None) -> list[int]:
    """`tokenizer` is a transformers tokenizer (duck-typed, so the SDK needs no transformers); `context` is a
    list of {role, content} turns (LeasedPrompt.context)."""
    turns = [{"role": str(t["role"]), "content": str(t["content"])} for t in context or ()]
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([*turns, {"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer("\n\n".join([*(t["content"] for t in turns), text]))["input_ids"]]
