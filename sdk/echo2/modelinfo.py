"""Facts about a model folder read from its JSON files alone (no torch, no transformers), shared by the
workers (where to stop generating) and the control plane (what a valid sample of that model is)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The files these facts come from; the control plane reads them out of a published version.
INFO_FILES = ("config.json", "generation_config.json", "tokenizer_config.json", "tokenizer.json")

Reader = Callable[[str], dict[str, Any]]


def folder_reader(model_dir: Path) -> Reader:
    """Read one of INFO_FILES from a folder; a missing or malformed file reads as {}."""
    return lambda name: _parse(_read_bytes(Path(model_dir) / name))


def parse_json(data: bytes | None) -> dict[str, Any]:
    return _parse(data)


def eos_token_ids(read: Reader) -> set[int]:
    """The eos ids a model declares (generation_config.json, config.json, and tokenizer_config.json's
    eos_token resolved through tokenizer.json), so both backends stop at exactly the same ids."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        value = read(name).get("eos_token_id")
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    eos = read("tokenizer_config.json").get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if isinstance(eos, str):
        tokenizer = read("tokenizer.json")
        added = tokenizer.get("added_tokens") or []
        ids.update(t["id"] for t in added if isinstance(t, dict) and t.get("content") == eos)
        ids |= _vocab_ids(tokenizer.get("model") or {}, eos)
    return ids


def _vocab_ids(model: dict[str, Any], piece: str) -> set[int]:
    """The id of `piece` in a tokenizer.json model's own vocabulary (BPE/WordPiece: piece -> id; Unigram: [piece,
    score] by id): an eos that is a regular token, not an added one, which a tokenizer stops at all the same."""
    vocab = model.get("vocab")
    if isinstance(vocab, dict):
        found = vocab.get(piece)
        return {found} if isinstance(found, int) else set()
    if isinstance(vocab, list):
        return {i for i, entry in enumerate(vocab) if isinstance(entry, list) and entry and entry[0] == piece}
    return set()


def vocab_size(read: Reader) -> int | None:
    """Rows of the embedding (config.json `vocab_size`, or its text_config's): every valid token id is below."""
    config = read("config.json")
    value = config.get("vocab_size", (config.get("text_config") or {}).get("vocab_size"))
    return value if isinstance(value, int) and value > 0 else None


def context_length(read: Reader) -> int | None:
    """Tokens a sequence of the model may hold, prompt and completion (config.json `max_position_embeddings`, GPT-2's
    `n_positions`, or its text_config's), stretched by a RoPE scaling factor as vLLM stretches it: every worker
    stops a sample there, whatever max_new_tokens asks."""
    config = read("config.json")
    for part in (config, config.get("text_config") or {}):
        value = part.get("max_position_embeddings", part.get("n_positions"))
        if isinstance(value, int) and value > 0:
            return int(value * _rope_factor(part, config.get("model_type") or ""))
    return None


# RoPE types whose max_position_embeddings is already the scaled length (vLLM's _get_and_verify_max_len).
SCALED_ALREADY = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling", "default")


def _rope_factor(config: dict[str, Any], model_type: str) -> float:
    """A linear or dynamic RoPE scaling's factor (config rope_scaling, or rope_parameters), else 1."""
    rope = config.get("rope_scaling") or config.get("rope_parameters")
    if not isinstance(rope, dict) or "gemma3" in model_type:
        return 1.0
    kind, factor = rope.get("rope_type", rope.get("type")), rope.get("factor")
    ok = kind not in SCALED_ALREADY and isinstance(factor, int | float) and factor >= 1
    return float(factor) if ok else 1.0


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
PROMPT_TOKENS = 512  # room for the prompt beside the completion, per sequence
RUNTIME_GIB = 0.5  # the framework itself: CUDA context or torch's CPU allocator, kernels, sampler
OVERHEAD = 1.2  # activations, allocator fragmentation


def generation_memory_gib(read: Reader, weight_bytes: int, sequences: int, new_tokens: int) -> float:
    """Memory a worker needs to generate `sequences` completions at once of this model: its weights as
    published, the KV cache of every sequence at full length (prompt allowance + new tokens), with
    headroom. From config.json alone; a config without attention sizes counts the weights only."""
    config = read("config.json")
    config = config.get("text_config") or config
    layers, heads = config.get("num_hidden_layers"), config.get("num_attention_heads")
    kv_heads, hidden = config.get("num_key_value_heads") or heads, config.get("hidden_size")
    head_dim = config.get("head_dim") or (hidden // heads if isinstance(hidden, int) and heads else None)
    width = 4 if config.get("torch_dtype") == "float32" else 2
    kv = 0
    if all(isinstance(v, int) and v > 0 for v in (layers, kv_heads, head_dim)):
        kv = 2 * layers * kv_heads * head_dim * width * sequences * (PROMPT_TOKENS + new_tokens)
    return math.ceil(100 * (OVERHEAD * (weight_bytes + kv) / 2**30 + RUNTIME_GIB)) / 100  # up to 0.01 GiB


def weight_bytes(paths_and_sizes: list[tuple[str, int]]) -> int:
    return sum(size for path, size in paths_and_sizes if path.endswith(WEIGHT_SUFFIXES))


def _read_bytes(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def _parse(data: bytes | None) -> dict[str, Any]:
    if not data:
        return {}
    try:
        parsed = json.loads(data)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}
