"""Dataset files as the control plane takes them: JSONL, one item per line. A Hugging Face dataset (a Parquet
file or a folder of them, an Arrow file, a folder written by `datasets.save_to_disk`) is converted row by row,
with pyarrow and, for a saved folder, `datasets` (`pip install 'echo2[datasets]'`: the SDK itself needs
neither). A row the control plane cannot take as JSON is named with its number."""

from __future__ import annotations

import hashlib
import json
import math
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .errors import ConfigurationError

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
FORMATS = ("auto", "jsonl", "json", "parquet", "arrow", "hf")  # json: one JSON array of items
SPLITS = ("train", "test", "validation", "valid", "dev")  # split names known without a shard number
# A Hub folder's file: its split (any name: train_sft, test_gen), shard and shard count, maybe a hash after them.
SHARD = re.compile(r"(?P<split>.+?)-\d{5}-of-\d{5}(-.*)?")


class DatasetFileError(ValueError):
    """A dataset file that cannot be read or converted; the message says which row and why."""


def detect(path: Path) -> str:
    if path.is_dir():
        if (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists() or \
                (path / "state.json").exists():
            return "hf"
        if any(path.glob("*.parquet")):
            return "parquet"
        raise DatasetFileError(f"{path} is a folder, but neither a saved Hugging Face dataset (no dataset_info.json "
                               "or dataset_dict.json) nor a folder of .parquet files")
    suffix = path.suffix.lower()
    if suffix == ".json" and _starts_with(path, b"["):  # json.dump(items, f, indent=2): an array, not JSON Lines
        return "json"
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    if suffix == ".parquet":
        return "parquet"
    if suffix == ".arrow":
        return "arrow"
    raise DatasetFileError(f"cannot tell the format of {path.name}: name it .jsonl, .parquet or .arrow, or pass "
                           f"--format ({', '.join(FORMATS[1:])})")


def as_jsonl(path: Path, fmt: str = "auto", split: str | None = None) -> tuple[Path, bool]:
    """(a JSONL file of `path`'s rows, whether it is a temporary file the caller deletes)."""
    if not path.exists():
        raise DatasetFileError(f"{path} does not exist")
    fmt = detect(path) if fmt == "auto" else fmt
    if split is not None and fmt != "hf" and not path.is_dir():
        raise DatasetFileError(f"{path.name} is one file with no splits: leave out --split (it chooses a split of a "
                               "saved Hugging Face dataset or of a folder of split files)")
    if fmt == "jsonl":
        return path, False
    rows = {"json": _json_rows, "parquet": _parquet_rows, "arrow": _arrow_rows, "hf": _hf_rows}[fmt](path, split)
    out = Path(tempfile.mkstemp(prefix="echo2-dataset-", suffix=".jsonl")[1])
    try:
        with out.open("w", encoding="utf-8") as f:
            for n, row in enumerate(rows, start=1):
                f.write(_line(n, row) + "\n")
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    return out, True


def _line(n: int, row: dict[str, Any]) -> str:
    for key, value in row.items():
        problem = _not_json(value)
        if problem:
            raise DatasetFileError(f"row {n}: column {key!r} holds {problem}, which a dataset item cannot")
    return json.dumps(row, ensure_ascii=False)


def _not_json(value: Any) -> str | None:
    if isinstance(value, bytes | bytearray):
        return "bytes"
    if isinstance(value, float) and not math.isfinite(value):
        return "a NaN or infinite number"
    if isinstance(value, list):
        return next((p for p in map(_not_json, value) if p), None)
    if isinstance(value, dict):
        return next((p for p in map(_not_json, value.values()) if p), None)
    if value is None or isinstance(value, str | int | float | bool):
        return None
    return f"a {type(value).__name__}"


def _pyarrow() -> Any:
    try:
        import pyarrow
    except ImportError:
        raise ConfigurationError("reading Parquet and Arrow files needs pyarrow: pip install 'echo2[datasets]'") \
            from None
    return pyarrow


def _table_rows(table: Any) -> Iterator[dict[str, Any]]:
    for batch in table.to_batches(max_chunksize=1024):
        yield from batch.to_pylist()


def _starts_with(path: Path, prefix: bytes) -> bool:
    with path.open("rb") as f:
        return f.read(4096).lstrip()[:len(prefix)] == prefix


def _json_rows(path: Path, split: str | None) -> Iterator[dict[str, Any]]:
    try:
        items = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise DatasetFileError(f"{path.name} is not valid JSON: {exc}") from None
    if not isinstance(items, list):
        raise DatasetFileError(f"{path.name} is not one JSON array of items, nor JSON Lines (one item per line)")
    for n, item in enumerate(items, start=1):
        if not isinstance(item, dict):
            raise DatasetFileError(f"item {n} of {path.name} is not an object ({{\"question\": ..., ...}})")
        yield item


def _split_files(path: Path, split: str | None) -> list[Path]:
    """A folder's Parquet files, only the chosen split's where their names say which split they are (a Hub
    folder's train-00000-of-00001.parquet beside test-...): merged, the test split was trained on. With no split
    chosen and no train split, the user chooses: a folder of train_sft-... and test_sft-... has no default."""
    files = sorted(path.glob("*.parquet"))
    by_split: dict[str, list[Path]] = {}
    for file in files:
        name = _split_of(file)
        if name is not None:
            by_split.setdefault(name, []).append(file)
    if not by_split:
        if split is not None:
            raise DatasetFileError(f"{path} holds no split files (named like train-00000-of-00001.parquet): "
                                   "leave out --split")
        return files
    chosen = split or ("train" if "train" in by_split else None)
    if chosen is None or chosen not in by_split:
        raise DatasetFileError(f"{path} holds the splits {', '.join(by_split)}: choose one with --split")
    return by_split[chosen]


def _split_of(file: Path) -> str | None:
    """The split a file's name says it is: whatever comes before a Hub shard's -00000-of-00003, a known split name
    before the first '-' (train.parquet, test-part2.parquet), or a name with a known split name as one of its words
    (train_sft.parquet beside test_sft.parquet, as `dataset[split].to_parquet(f"{split}.parquet")` writes them);
    None for a file of no split (data.parquet, data_0.parquet)."""
    shard = SHARD.fullmatch(file.stem)
    if shard:
        return shard["split"].lower()
    stem = file.stem.lower()
    head = stem.split("-", 1)[0]
    if head in SPLITS:
        return head
    return stem if set(re.split(r"[_\-.]", stem)) & set(SPLITS) else None


def _parquet_rows(path: Path, split: str | None) -> Iterator[dict[str, Any]]:
    _pyarrow()
    import pyarrow.parquet as pq

    files = _split_files(path, split) if path.is_dir() else [path]
    for file in files:
        try:
            parquet = pq.ParquetFile(file)
        except Exception as exc:
            raise DatasetFileError(f"{file.name} is not a Parquet file: {exc}") from None
        for batch in parquet.iter_batches(batch_size=1024):
            yield from batch.to_pylist()


def _arrow_rows(path: Path, split: str | None) -> Iterator[dict[str, Any]]:
    pa = _pyarrow()
    import pyarrow.ipc as ipc

    for opener in (ipc.open_stream, ipc.open_file):  # datasets writes streams; others files
        try:
            with pa.memory_map(str(path)) as source:
                yield from _table_rows(opener(source).read_all())
            return
        except pa.ArrowInvalid:
            continue
    raise DatasetFileError(f"{path.name} is not an Arrow stream or file")


def _hf_rows(path: Path, split: str | None) -> Iterator[dict[str, Any]]:
    try:
        from datasets import DatasetDict, load_from_disk
    except ImportError:
        raise ConfigurationError("reading a saved Hugging Face dataset needs datasets: pip install "
                                 "'echo2[datasets]'") from None
    loaded = load_from_disk(str(path))
    if isinstance(loaded, DatasetDict):
        names = sorted(loaded)
        chosen = split or ("train" if "train" in loaded else None)
        if chosen is None or chosen not in loaded:
            raise DatasetFileError(f"{path} holds the splits {', '.join(names)}: choose one with --split")
        loaded = loaded[chosen]
    elif split is not None:
        raise DatasetFileError(f"{path} is a single dataset with no splits: leave out --split")
    for batch in loaded.iter(batch_size=1024):
        keys = list(batch)
        for i in range(len(batch[keys[0]]) if keys else 0):
            yield {k: batch[k][i] for k in keys}


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
