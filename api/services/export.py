"""A job's model as a plain Hugging Face folder, the way `transformers` and vLLM load one: weights in
safetensors, config.json, the tokenizer and generation_config.json, nothing of Echo2's around them.

Which files, out of a published version (learner/weights.py says what each version holds):
- a full fine-tune: the version's folder (its final one by default);
- a LoRA job, merged: its final version, which is the merged model (the `adapter/` beside it left out); an
  earlier version is the adapter alone, which cannot be merged without the model's framework: refused, saying so;
- a LoRA job's adapter (`adapter`): `adapter/` of the final version, or an adapter version as it is, with
  adapter_config.json naming the job's base model (the learner wrote its own cache path there).
A folder without generation_config.json gets one derived from its config.json, as transformers would.
"""

from __future__ import annotations

import json
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass

from echo2.protocol import JobSpec, Manifest

from ..errors import ApiError
from ..models import Job
from ..storage import BlobStore

ADAPTER_DIR = "adapter/"
ADAPTER_CONFIG = "adapter_config.json"
GENERATION_CONFIG = "generation_config.json"
MAX_JSON_BYTES = 16 * 2**20
HUB_IDS = {"echo2:smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct"}  # built-ins that are Hub models
GENERATION_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")


@dataclass(frozen=True)
class Entry:
    """One file of the export: copied from the version (`source`) or written here (`data`)."""

    name: str
    size: int
    source: str | None = None
    data: bytes | None = None


def plan(blobs: BlobStore, job: Job, spec: JobSpec, manifest: Manifest, adapter: bool) -> list[Entry]:
    """The export's files, or the 409/422 that says why this version cannot be exported so."""
    paths = [f.path for f in manifest.files]
    sizes = {f.path: f.size for f in manifest.files}
    has_adapter_dir = any(p.startswith(ADAPTER_DIR) for p in paths)
    adapter_only = ADAPTER_CONFIG in paths
    if adapter and spec.lora is None:
        raise ApiError(422, f"job {job.id} trains every weight, not a LoRA adapter: export it without adapter",
                       field="adapter")
    if adapter:
        if has_adapter_dir:
            chosen = {p: p.removeprefix(ADAPTER_DIR) for p in paths if p.startswith(ADAPTER_DIR)}
        elif adapter_only:
            chosen = {p: p for p in paths}
        else:
            raise ApiError(409, f"version {manifest.version} of job {job.id} is its base model (a LoRA job's first "
                           "version): there is no adapter in it yet", field="version")
        return [_adapter_config(blobs, job.id, manifest, spec, src) if dst == ADAPTER_CONFIG
                else Entry(dst, sizes[src], source=src) for src, dst in chosen.items()]
    if adapter_only:
        # A job that ended without its final version never merges one: waiting would be for nothing.
        later = "" if job.status.is_terminal() else ", or wait for the job to finish"
        raise ApiError(409, f"version {manifest.version} of job {job.id} is its LoRA adapter alone; the merged model "
                       "is the final version a job makes when it completes: export the adapter (adapter=true, "
                       f"--adapter){later}", field="version")
    entries = [Entry(p, sizes[p], source=p) for p in paths if not p.startswith(ADAPTER_DIR)]
    if GENERATION_CONFIG not in paths:
        entries.append(_generation_config(blobs, job.id, manifest))
    return entries


def _adapter_config(blobs: BlobStore, job_id: str, manifest: Manifest, spec: JobSpec, path: str) -> Entry:
    config = _json(blobs, job_id, manifest, path)
    config["base_model_name_or_path"] = HUB_IDS.get(spec.base_model, spec.base_model)
    data = json.dumps(config, indent=2, sort_keys=True).encode()
    return Entry(ADAPTER_CONFIG, len(data), data=data)


def _generation_config(blobs: BlobStore, job_id: str, manifest: Manifest) -> Entry:
    """What transformers' GenerationConfig.from_model_config takes from config.json."""
    config = _json(blobs, job_id, manifest, "config.json")
    derived = {k: config[k] for k in GENERATION_KEYS if config.get(k) is not None}
    derived["_from_model_config"] = True
    data = json.dumps(derived, indent=2, sort_keys=True).encode()
    return Entry(GENERATION_CONFIG, len(data), data=data)


def _json(blobs: BlobStore, job_id: str, manifest: Manifest, path: str) -> dict:  # type: ignore[type-arg]
    raw = blobs.read_file(job_id, manifest, path, MAX_JSON_BYTES)
    try:
        value = json.loads(raw) if raw is not None else None
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ApiError(409, f"version {manifest.version} of job {job_id} has no readable {path}")
    return value


def iter_tar(blobs: BlobStore, job_id: str, manifest: Manifest, entries: list[Entry]) -> Iterator[bytes]:
    """The entries as an uncompressed tar, each copied file streamed out of the version's chunks."""
    for e in entries:
        info = tarfile.TarInfo(name=e.name)
        info.size, info.mode = e.size, 0o644
        yield info.tobuf(format=tarfile.PAX_FORMAT)
        if e.data is not None:
            yield e.data
        else:
            assert e.source is not None
            yield from blobs.iter_file(job_id, manifest, e.source)
        if e.size % tarfile.BLOCKSIZE:
            yield b"\0" * (tarfile.BLOCKSIZE - e.size % tarfile.BLOCKSIZE)
    yield b"\0" * (2 * tarfile.BLOCKSIZE)
