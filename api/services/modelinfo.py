"""What the control plane knows of a job's model, read from its first published version: the
vocabulary size and eos ids the door checks samples against, and the tokenizer it decodes completions
with for display (a worker's own text is never shown)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from echo2.modelinfo import (
    INFO_FILES,
    Reader,
    context_length,
    eos_token_ids,
    generation_memory_gib,
    parse_json,
    vocab_size,
    weight_bytes,
)
from echo2.protocol import JobSpec, Manifest
from echo2.snapshots import atomic_write

from ..errors import ApiError
from ..models import Job
from ..storage import BlobStore
from . import chat_frame

MAX_INFO_BYTES = 64 * 2**20  # a tokenizer.json of a very large vocabulary stays well below
TOKENIZER, TOKENIZER_CONFIG = "tokenizer.json", "tokenizer_config.json"
CHAT_FRAME = "chat_frame.json"  # what the chat template puts around an environment's reply (chat_frame.py)


def record(blobs: BlobStore, job: Job, manifest: Manifest) -> None:
    """On the job's first published version: its vocabulary bounds and a copy of its tokenizer."""
    if job.vocab_size is not None:
        return
    raw = {name: blobs.read_file(job.id, manifest, name, MAX_INFO_BYTES) for name in INFO_FILES}
    parsed = {name: parse_json(data) for name, data in raw.items()}
    job.vocab_size = vocab_size(parsed.__getitem__)
    job.context_length = context_length(parsed.__getitem__)
    job.eos_token_ids = sorted(eos_token_ids(parsed.__getitem__))
    job.memory_need_gb = memory_need(job, parsed.__getitem__, manifest)
    for name in (TOKENIZER, TOKENIZER_CONFIG):
        if raw[name]:
            atomic_write(blobs.job_file(job.id, name), raw[name])


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


def token_pieces(blobs: BlobStore, job_id: str) -> Callable[[list[int]], list[str]]:
    """A function from token ids to each token's own text (special tokens shown), for traces."""
    path = blobs.job_file(job_id, TOKENIZER)
    tokenizer = _load(str(path), path.stat().st_mtime) if path.exists() else None
    if tokenizer is None:
        return lambda ids: [f"<{i}>" for i in ids]
    return lambda ids: [tokenizer.decode([i], skip_special_tokens=False) for i in ids]


def observation_encoder(blobs: BlobStore, job_id: str) -> Callable[[str, bool], list[int]]:
    """A function (environment reply, the model's turn ended with eos) -> the tokens that follow the
    model's turn: the reply as a user turn plus the generation prompt by the model's chat template, as
    `echo2.prompting.encode_prompt` frames the first one; a model without a template gets the text as is.
    The template is rendered once per job, in a child process (chat_frame.py), and the frame kept beside
    the job's tokenizer. Call it outside any database transaction: that first rendering may take seconds."""
    path = blobs.job_file(job_id, TOKENIZER)
    tokenizer = _load(str(path), path.stat().st_mtime) if path.exists() else None
    if tokenizer is None:
        raise ApiError(409, f"job {job_id} has no readable tokenizer.json: multi-turn episodes need one")
    config_path = blobs.job_file(job_id, TOKENIZER_CONFIG)
    config = parse_json(config_path.read_bytes()) if config_path.exists() else {}
    template = config.get("chat_template")
    if not isinstance(template, str) or not template:
        return lambda text, _eos: tokenizer.encode(text, add_special_tokens=False).ids
    frame = _frame(blobs, job_id, template, config)
    return lambda text, eos: tokenizer.encode(frame.around(text, eos), add_special_tokens=False).ids


def _frame(blobs: BlobStore, job_id: str, template: str, config: dict[str, Any]) -> chat_frame.Frame:
    """The job's frame, rendered the first time and kept (a template that cannot frame a turn, too)."""

    def token(name: str) -> str:
        value = config.get(name)
        return value.get("content", "") if isinstance(value, dict) else str(value or "")

    path = blobs.job_file(job_id, CHAT_FRAME)
    if not path.exists():
        try:
            kept = dataclasses.asdict(chat_frame.render(template, {"bos_token": token("bos_token"),
                                                                   "eos_token": token("eos_token")}))
        except chat_frame.FrameError as exc:
            kept = {"error": str(exc)}
        atomic_write(path, json.dumps(kept).encode())
    kept = json.loads(path.read_bytes())
    if "error" in kept:
        raise ApiError(409, kept["error"])
    return chat_frame.Frame(**kept)


@lru_cache(maxsize=16)
def _load(path: str, mtime: float) -> Any:
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(path)
    except Exception:  # a tokenizer file the library cannot read: show token counts instead
        return None

