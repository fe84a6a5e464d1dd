"""Seeds as pure functions of (job, epoch, prompt, sample), so runs replay and workers cannot pick samples."""

from __future__ import annotations

import hashlib

_MASK = 2**31 - 1


def _mix(*parts: object) -> int:
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") & _MASK


def prompt_seed(job_seed: int, job_id: str, prompt_index: int, epoch: int) -> int:
    """Base seed the server hands out with a leased prompt."""
    return _mix("prompt", job_seed, job_id, prompt_index, epoch)


def sample_seed(base_seed: int, sample_index: int) -> int:
    """Seed of sample k of a group generated for a prompt with the given base seed."""
    return _mix("sample", base_seed, sample_index)


def order_key(job_seed: int, job_id: str, prompt_index: int, epoch: int) -> int:
    """Position of a prompt in the job's lease order: a seeded permutation, one per epoch."""
    return _mix("order", job_seed, job_id, prompt_index, epoch)
