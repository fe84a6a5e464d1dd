"""Stability records: what `record_stability_info` asks of sampling, and what stable_reinforce trains on.

A sample request made with `record_stability_info=True` keeps, for each sequence it returns (its id is the
SDK's `SampledSequence.sequence_id`, `{request}:{k}`), the prompt, the sampled tokens, the logprob each was
drawn with, and which checkpoint drew which tokens (an in-flight sample may span several); for a sequence a
rollout worker drew, which worker. That holds whoever drew it: the learner host (`record_result`) or the fleet
(`fleet._deliver`).

A `forward_backward` datum names the sequences behind its tokens with provenance spans (the SDK's
`Datum.with_provenance`). The door checks each span against the record (the datum's tokens must be the
recorded ones at the positions named) and, for stable_reinforce, gives the loss the recorded logprob of every
target token (`RECORDED_LOGPROBS`): its behaviour policy is the one that really drew each token, whatever the
client sends as `logprobs`. A record is kept RECORD_TTL_S after it was drawn or last trained on (tinker-docs:
recorded sequences are trainable for a day), then swept.
"""

from __future__ import annotations

from datetime import timedelta

from echo2.protocol.tinker import SamplePayload, SampleResult
from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from ..errors import ApiError
from ..models import utcnow
from . import wire
from .models import TinkerSequence

RECORD_TTL_S = 86_400.0
MAX_RECORDS_PER_REQUEST = 4096  # distinct sequences one forward_backward may name


def record(db: Session, request_id: str, owner_id: str, model_id: str, payload: SamplePayload,
           result: SampleResult, worker_id: str | None = None) -> None:
    """Keep every sequence of a finished sample request made with record_stability_info."""
    if not payload.record:
        return
    expires = utcnow() + timedelta(seconds=RECORD_TTL_S)
    for k, seq in enumerate(result.sequences):
        runs = seq.checkpoints or [(payload.checkpoint or "base", len(seq.tokens))]
        db.merge(TinkerSequence(id=f"{request_id}:{k}", owner_id=owner_id, model_id=model_id,
                                prompt=list(payload.prompt), tokens=list(seq.tokens), logprobs=list(seq.logprobs),
                                checkpoints=[list(r) for r in runs], worker_id=worker_id, expires_at=expires))


def sweep(db: Session) -> None:
    db.execute(delete(TinkerSequence).where(TinkerSequence.expires_at < utcnow()))


def owned(db: Session, owner_id: str, sequence_id: str) -> TinkerSequence:
    row = db.get(TinkerSequence, sequence_id)
    if row is None or row.owner_id != owner_id or row.expires_at < utcnow():
        raise ApiError(400, f"sequence {sequence_id} is not recorded: sample with record_stability_info=True; "
                            f"records are kept {RECORD_TTL_S / 3600:g} h after they were drawn or last trained on",
                       field="sequence_id")
    return row


def check_tiling(datum: wire.Datum, targets: int, index: int) -> None:
    """Spans come as a pair and tile their fields (the SDK checks the same before it sends)."""
    if (datum.input_spans is None) != (datum.target_spans is None):
        raise ApiError(400, f"data[{index}]: provenance comes as a pair: model_input_spans and loss_fn_input_spans",
                       field=f"data[{index}]")
    if datum.input_spans is None or datum.target_spans is None:
        return
    for name, spans, size in (("model_input_spans", datum.input_spans, len(datum.tokens)),
                              ("loss_fn_input_spans", datum.target_spans, targets)):
        covered = sum(s.length for s in spans)
        if covered != size:
            raise ApiError(400, f"data[{index}].{name} cover {covered} positions, but the field has {size}",
                           field=f"data[{index}].{name}")


def behaviour(db: Session, owner_id: str, datum: wire.Datum, targets: list[int], advantages: list[float],
              index: int, seen: dict[str, TinkerSequence]) -> list[float]:
    """The recorded logprob of every target token of a datum (0 where a prompt span covers it), after checking
    that every span names a recorded sequence of this user and that the datum's tokens are the recorded ones.
    stable_reinforce trains sampled tokens only: advantages must be 0 on the positions of prompt spans."""
    what = f"data[{index}]"
    if datum.target_spans is None or datum.input_spans is None:
        raise ApiError(400, f"{what}: stable_reinforce needs provenance spans on every datum (Datum.with_provenance, "
                            "naming the sampled sequences behind its tokens)", field=what)
    _match(db, owner_id, datum.input_spans, datum.tokens, f"{what}.model_input_spans", seen)
    out: list[float] = []
    pos = 0
    for span in datum.target_spans:
        row = _match(db, owner_id, [span], targets[pos:pos + span.length], f"{what}.loss_fn_input_spans", seen)
        if span.sampled:
            out += [float(x) for x in row.logprobs[span.offset:span.offset + span.length]]
        else:
            nonzero = [pos + i for i in range(span.length) if advantages[pos + i] != 0]
            if nonzero:
                raise ApiError(400, f"{what}: advantages must be 0 on prompt positions (position {nonzero[0]} is "
                                    "covered by a prompt span): stable_reinforce trains sampled tokens only",
                               field=f"{what}.advantages")
            out += [0.0] * span.length
        pos += span.length
    return out


def _match(db: Session, owner_id: str, spans: list[wire.Span], tokens: list[int], what: str,
           seen: dict[str, TinkerSequence]) -> TinkerSequence:
    pos, row = 0, None
    for span in spans:
        row = seen.get(span.sequence_id)
        if row is None:
            if len(seen) >= MAX_RECORDS_PER_REQUEST:
                raise ApiError(400, f"{what}: more than {MAX_RECORDS_PER_REQUEST} sequences in one request")
            row = seen[span.sequence_id] = owned(db, owner_id, span.sequence_id)
            row.expires_at = utcnow() + timedelta(seconds=RECORD_TTL_S)  # trained on: kept a day more
        source = row.tokens if span.sampled else row.prompt
        recorded = source[span.offset:span.offset + span.length]
        if len(recorded) != span.length or recorded != tokens[pos:pos + span.length]:
            kind = "sampled tokens" if span.sampled else "prompt"
            raise ApiError(400, f"{what}: positions {pos}..{pos + span.length - 1} are not the {kind} of sequence "
                                f"{span.sequence_id} at offset {span.offset}", field=what)
        pos += span.length
    assert row is not None
    return row


def lookup(db: Session, owner_id: str, ids: list[str]) -> list[TinkerSequence]:
    rows = list(db.scalars(select(TinkerSequence).where(TinkerSequence.id.in_(ids[:1024]),
                                                        TinkerSequence.owner_id == owner_id)))
    return [r for r in rows if r.expires_at >= utcnow()]
