"""Rollout traces: one group as it happened, token by token. Each token decoded by the platform, the version that
produced it, the worker's behaviour logprob beside the learner's own (learner/traces.py); the worker and its trust
state now, the learner's audit, the rewards, and what the group cost its job (its share of the ledger entry that
paid its worker, nothing once that payment was clawed back)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from echo2.protocol import (
    RolloutTrace,
    SampleSubmit,
    TraceAudit,
    TraceSample,
    TraceToken,
    TraceWorker,
)
from sqlalchemy import select
from sqlalchemy.orm import Session

from ..models import Audit, LedgerEntry, Prompt, Rollout, Worker
from ..storage import BlobStore
from . import archive, modelinfo, tenancy

Decode = Callable[[list[int]], str]
Pieces = Callable[[list[int]], list[str]]


def traces(db: Session, blobs: BlobStore, data_dir: Path, job_id: str, rows: Sequence[Rollout], *,
           own: set[str] | None) -> list[RolloutTrace]:
    """The traces of these rollouts of one job, with what they refer to loaded in one query each (their tokens
    from the table or the job's archive). With `own` (the reader's jobs; None for an admin) each worker's
    evidence reads as GET /v1/workers/{id} shows it to that user: other tenants' job and rollout ids replaced."""
    if not rows:
        return []
    ids = [r.id for r in rows]
    prompts = dict(db.execute(select(Prompt.id, Prompt.text).where(Prompt.id.in_({r.prompt_id for r in rows}))).all())
    workers = {w.id: w for w in db.scalars(select(Worker).where(Worker.id.in_({r.worker_id for r in rows})))}
    audits: dict[str, Audit] = {}
    for a in db.scalars(select(Audit).where(Audit.job_id == job_id, Audit.rollout_id.in_(ids)).order_by(Audit.id)):
        audits[a.rollout_id] = a  # the latest one
    entries = {e.id: e for e in db.scalars(select(LedgerEntry).where(
        LedgerEntry.id.in_({r.paid_entry_id for r in rows if r.paid_entry_id is not None})))}
    decode, pieces = modelinfo.decoder(blobs, job_id), modelinfo.token_pieces(blobs, job_id)
    tokens = archive.payloads(data_dir, rows)
    return [_trace(r, tokens[r.id], prompts.get(r.prompt_id, ""), _worker(r.worker_id, workers.get(r.worker_id), own),
                   audits.get(r.id), entries.get(r.paid_entry_id) if r.paid_entry_id is not None else None,
                   decode, pieces)
            for r in rows]


def _trace(r: Rollout, tokens: archive.Payload, prompt_text: str, worker: TraceWorker, audit: Audit | None,
           entry: LedgerEntry | None, decode: Decode, pieces: Pieces) -> RolloutTrace:
    learner = tokens.learner_logprobs or [None] * len(tokens.samples)
    rewards = r.rewards or [None] * len(tokens.samples)
    samples = [_sample(i, SampleSubmit.model_validate(s), r.version, lp, reward, decode, pieces)
               for i, (s, lp, reward) in enumerate(zip(tokens.samples, learner, rewards, strict=True))]
    scored = [x for x in rewards if x is not None]
    return RolloutTrace(
        id=r.id, job_id=r.job_id, prompt_id=r.prompt_id, prompt_text=prompt_text,
        prompt_tokens=len(tokens.prompt_token_ids), version=r.version, status=r.status, reason=r.reason,
        reject_kind=r.reject_kind, fault=r.reject_kind.fault() if r.reject_kind else None, claim_step=r.claim_step,
        trained_step=r.trained_step, worker=worker, audit=_audit(audit), samples=samples,
        reward_mean=sum(scored) / len(scored) if scored else None, gen_seconds=r.gen_seconds,
        cost_usd=_cost(entry), created_at=r.created_at)


def _cost(entry: LedgerEntry | None) -> float | None:
    """The group's share of the entry that paid its worker. A clawed-back payment costs the job nothing: its
    `clawback` entry nets the worker to $0.00 in the job's ledger and cost (api/services/clawback.py)."""
    if entry is None or not entry.groups:
        return None
    return 0.0 if entry.clawed_back_by is not None else entry.amount_usd / entry.groups


def _sample(index: int, s: SampleSubmit, version: int, learner: list[float] | None, reward: float | None,
            decode: Decode, pieces: Pieces) -> TraceSample:
    versions, model = s.token_versions(version), s.model_token_mask()
    texts = pieces(list(s.token_ids))
    tokens = [TraceToken(id=t, text=texts[k], version=versions[k], model=model[k],
                         behaviour_logprob=s.logprobs[k] if model[k] else None,
                         learner_logprob=learner[k] if learner is not None and model[k] else None)
              for k, t in enumerate(s.token_ids)]
    gaps = [abs(t.behaviour_logprob - t.learner_logprob) for t in tokens
            if t.behaviour_logprob is not None and t.learner_logprob is not None]
    return TraceSample(index=index, text=decode(list(s.token_ids)), finish_reason=s.finish_reason.value,
                       reward=reward, tokens=tokens, max_abs_mismatch=max(gaps) if gaps else None)


def _worker(worker_id: str, w: Worker | None, own: set[str] | None) -> TraceWorker:
    if w is None:
        return TraceWorker(id=worker_id, name=None, provider_id=None, trust=None, trust_reason=None)
    # A worker serves many tenants: its latest evidence may be about another's job (a possession check's strike).
    reason = w.trust_reason if own is None else tenancy.redact(w.trust_reason, own, rollouts=True)
    return TraceWorker(id=w.id, name=w.name, provider_id=w.provider_id, trust=w.trust, trust_reason=reason)


def _audit(a: Audit | None) -> TraceAudit | None:
    if a is None:
        return None
    stats: dict[str, Any] = a.stats or {}
    return TraceAudit(passed=a.passed, reason=a.reason, step=a.step,
                      stats={k: float(v) for k, v in stats.items() if isinstance(v, int | float)})
