"""Facts about a model folder read from its JSON files alone (no torch, no transformers), shared by the
workers (where to stop generating) and the control plane (what a valid sample of that model is)."""

from __future__ import annotations

import json
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
        added = read("tokenizer.json").get("added_tokens") or []
        ids.update(t["id"] for t in added if isinstance(t, dict) and t.get("content") == eos)
    return ids


def vocab_size(read: Reader) -> int | None:
    """Rows of the embedding (config.json `vocab_size`, or its text_config's): every valid token id is below."""
    config = read("config.json")
    value = config.get("vocab_size", (config.get("text_config") or {}).get("vocab_size"))
    return value if isinstance(value, int) and value > 0 else None


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
