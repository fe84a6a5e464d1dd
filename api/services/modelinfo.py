"""What the control plane knows of a job's model, read from its first published version: the
vocabulary size and eos ids the door checks samples against, and the tokenizer it decodes completions
with for display (a worker's own text is never shown)."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from echo2.modelinfo import (
    INFO_FILES,
    Reader,
    eos_token_ids,
    generation_memory_gib,
    parse_json,
    vocab_size,
    weight_bytes,
)
from echo2.protocol import JobSpec, Manifest
from echo2.snapshots import atomic_write

from ..models import Job
from ..storage import BlobStore

MAX_INFO_BYTES = 64 * 2**20  # a tokenizer.json of a very large vocabulary stays well below
TOKENIZER = "tokenizer.json"


def record(blobs: BlobStore, job: Job, manifest: Manifest) -> None:
    """On the job's first published version: its vocabulary bounds and a copy of its tokenizer."""
    if job.vocab_size is not None:
        return
    raw = {name: blobs.read_file(job.id, manifest, name, MAX_INFO_BYTES) for name in INFO_FILES}
    parsed = {name: parse_json(data) for name, data in raw.items()}
    job.vocab_size = vocab_size(parsed.__getitem__)
    job.eos_token_ids = sorted(eos_token_ids(parsed.__getitem__))
    job.memory_need_gb = memory_need(job, parsed.__getitem__, manifest)
    if raw[TOKENIZER]:
        atomic_write(blobs.job_file(job.id, TOKENIZER), raw[TOKENIZER])


def memory_need(job: Job, read: Reader, manifest: Manifest) -> float:
    """GiB a worker must offer for the job: what its spec says, or what one group of its model needs."""
    spec = JobSpec.model_validate(job.spec)
    if spec.workers.memory_gb is not None:
        return spec.workers.memory_gb
    weights = weight_bytes([(f.path, f.size) for f in manifest.files])
    return generation_memory_gib(read, weights, spec.grpo.group_size, spec.grpo.max_new_tokens)


def decoder(blobs: BlobStore, job_id: str) -> Any:
    """A function from token ids to text with the job's tokenizer (special tokens skipped)."""
    path = blobs.job_file(job_id, TOKENIZER)
    tokenizer = _load(str(path), path.stat().st_mtime) if path.exists() else None
    if tokenizer is None:
        return lambda ids: f"<{len(ids)} tokens; the job's tokenizer is not available for display>"
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


@lru_cache(maxsize=16)
def _load(path: str, mtime: float) -> Any:
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(path)
    except Exception:  # a tokenizer file the library cannot read: show token counts instead
        return None

