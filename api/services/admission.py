"""Rollout admission. A group made with version x is trainable at learner step t only if t - x <= S;
this is checked when a worker submits and again when the learner claims. With partial rollouts a group's
tokens may come from several versions (SampleSubmit.versions); x is its oldest token's (the group's
`version`, which is also what the claim orders and rejects by). Rejected groups keep their
row (with the reason and whose fault it was) and their prompt goes back to the pool: nothing is lost.

Everything a worker sends is hostile until checked. At the door each sample must fit the job: at most
`max_new_tokens` tokens, every token id (prompt and completion) inside the version's vocabulary,
`finish_reason` consistent with the tokens, and every logprob at or above `logprob_floor(V)`: the
total probability of all tokens less likely than e^floor is at most V * e^floor = 1e-9, so an honest
sampler draws such a token less than once in a billion tokens, whatever the temperature. A group
that fails is the worker's fault: it counts against its trust (services/trust.py). The rest is
checked by the learner, which re-scores a share of the groups (learner/audit.py)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from echo2.protocol import (
    ClaimedGroup,
    EpisodeLimits,
    Fault,
    GroupResult,
    GroupSubmit,
    JobSpec,
    LeaseStatus,
    Precision,
    PromptSampling,
    PromptState,
    RejectKind,
    RolloutStatus,
    SampleSubmit,
)
from echo2.seeds import prompt_seed
from sqlalchemy import func, insert, select, update
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value

from ..models import Job, Lease, Prompt, Rollout, WeightVersion, Worker, new_id, utcnow
from ..settings import Settings
from . import archive, episodes, trust
from .jobs import spec_of
from .pool import return_prompts, set_aside_failing

# A chat template's own tokens around a prompt, at most: ~50 in common ones, some thousands with a long default
# system prompt (a style guide, tool descriptions); a 1,024 bound refused every honest group of such a model.
TEMPLATE_TOKENS = 8192
HONEST_MISS = 1e-9  # chance an honest sampler draws a token below the logprob floor, per token


def submit_groups(db: Session, job: Job, lease: Lease, worker: Worker, groups: list[GroupSubmit],
                  settings: Settings) -> list[GroupResult]:
    spec = spec_of(job)
    existing = {  # idempotent per (lease, prompt): a group sent again gets the first answer, not what became of it
        r.prompt_id: GroupResult(prompt_id=r.prompt_id, rollout_id=r.id, reason=r.reason,  # (trained: not audited)
                                 status=RolloutStatus.rejected if r.status == RolloutStatus.rejected else
                                 RolloutStatus.accepted)
        for r in db.execute(select(Rollout.prompt_id, Rollout.id, Rollout.status, Rollout.reason)
                            .where(Rollout.lease_id == lease.id, Rollout.prompt_id.in_([g.prompt_id for g in groups])))
    }
    in_lease = set(lease.prompt_ids)
    prompts = {p.id: p for p in db.scalars(select(Prompt).where(Prompt.id.in_(in_lease & {g.prompt_id
                                                                                         for g in groups})))}
    results: list[GroupResult] = []
    rows: list[dict[str, Any]] = []
    bounds = episodes.limits(job)
    for group in groups:
        if group.prompt_id in existing:
            results.append(existing[group.prompt_id])  # the same answer: refused with it below, if it is
            continue
        if group.prompt_id not in in_lease:
            trust.strike(db, worker, f"submitted prompt {group.prompt_id}, which is not part of lease {lease.id}",
                         settings)
            results.append(GroupResult(prompt_id=group.prompt_id, rollout_id=None, status=RolloutStatus.rejected,
                                       reason="prompt is not part of this lease"))
            continue
        prompt = prompts.get(group.prompt_id)
        reason, kind = _rejection(job, spec, lease, group, prompt, multi_turn=bounds is not None)
        if reason is None and (reason := _unpublished(db, job, spec, lease, group)):
            kind = RejectKind.invalid
        rewards = None
        if reason is None and bounds is not None:
            reason, kind, rewards = _episodes_rejection(db, job, lease, group, bounds)
        row = _row(job, lease, worker, group, reason, kind)
        row["seed"] = prompt_seed(spec.seed, job.id, prompt.index, prompt.epoch) if prompt is not None else None
        row["rewards"] = rewards
        if kind is not None and kind.fault() is Fault.worker:
            trust.strike(db, worker, f"rollout {row['id']} refused at the door: {reason}", settings)
        rows.append(row)
        results.append(GroupResult(prompt_id=group.prompt_id, rollout_id=row["id"], status=row["status"],
                                   reason=reason))
        existing[group.prompt_id] = results[-1]
    if not worker.trust.can_work():  # shut out by a strike above: nothing of it is taken
        _refuse_all(rows, results, f"sender {worker.trust}")
    _store(db, lease, worker, rows, answered=in_lease <= existing.keys())
    return results


def _refuse_all(rows: list[dict[str, Any]], results: list[GroupResult], reason: str) -> None:
    by_id = {r.rollout_id: r for r in results}
    for row in rows:
        if row["status"] == RolloutStatus.accepted:
            row.update(status=RolloutStatus.rejected, reason=reason, reject_kind=RejectKind.sender_shut_out)
            by_id[row["id"]].status, by_id[row["id"]].reason = RolloutStatus.rejected, reason


def _rejection(job: Job, spec: JobSpec, lease: Lease, group: GroupSubmit, prompt: Prompt | None, *,
               multi_turn: bool) -> tuple[str | None, RejectKind | None]:
    # Checked first, whether or not the group comes late: a late group is no one's fault, a forged one is its
    # sender's (else junk sent on a lease the worker released itself would be a blameless "late").
    problem = _invalid(job, spec, lease, group, prompt, multi_turn)
    if problem:
        return problem, RejectKind.invalid
    if lease.status != LeaseStatus.active:
        return f"lease is {lease.status}", RejectKind.lease_ended
    if _of_lease(spec, lease, group) and group.version <= job.step and not spec.admissible(job.step, group.version):
        return f"stale: step {job.step} - version {group.version} > S={spec.staleness}", RejectKind.stale_at_submit
    if prompt is not None and prompt.request_id is not None and (prompt.state, prompt.lease_id) != ("leased", lease.id):
        return "too late: its Tinker request went to the learner host", RejectKind.lease_ended
    return None, None


def _episodes_rejection(db: Session, job: Job, lease: Lease, group: GroupSubmit, bounds: EpisodeLimits
                        ) -> tuple[str | None, RejectKind | None, list[float | None] | None]:
    """A multi-turn group must be exactly its episodes as played; their rewards become the group's."""
    too_long = [k for k, s in enumerate(group.samples) if len(s.token_ids) > bounds.max_tokens]
    if too_long:
        return f"sample {too_long[0]}: more than the episode's {bounds.max_tokens} tokens", RejectKind.invalid, None
    reason, rewards = episodes.check_group(db, lease, group)
    if reason is None:
        reason = next((f"sample {k}: {why}" for k, s in enumerate(group.samples)
                       if (why := _cut_short(job, bounds, group, s))), None)
    if reason is None:
        return None, None, rewards
    if reason.startswith("environment:"):
        return reason.removeprefix("environment: "), RejectKind.environment_failed, None
    return reason, RejectKind.invalid, None


def _cut_short(job: Job, bounds: EpisodeLimits, group: GroupSubmit, sample: SampleSubmit) -> str | None:
    """An episode's last model turn that ends short of its limit without a stop token (episodes.cut_short) is honest
    only where prompt and turns fill the model's context."""
    assert sample.turns is not None
    last, before = sample.token_ids[-sample.turns[-1]:], len(sample.token_ids) - sample.turns[-1]
    room = episodes.cut_short(job, spec_of(job).grpo.max_new_tokens, bounds, before, last)
    if room is None or len(group.prompt_token_ids) + len(sample.token_ids) == job.context_length:
        return None
    return (f"its last turn ended after {len(last)} tokens without a stop token, short of its {room} and of the "
            f"model's context ({job.context_length} tokens)")


def _invalid(job: Job, spec: JobSpec, lease: Lease, group: GroupSubmit, prompt: Prompt | None,
             multi_turn: bool) -> str | None:
    """Why the group cannot be a real sample of the leased version under the job's settings (or its prompt's
    own, for a Tinker request: api/tinker/fleet.py), or None."""
    # Segments not the model's are neither bounded by max_new_tokens nor audited: only an episode has them.
    turns = [k for k, s in enumerate(group.samples) if s.turns is not None]
    if turns and not multi_turn:
        return (f"sample {turns[0]}: turns sent, but the job's task is single-turn: a sample is the model's "
                "completion alone, without turns")
    if not _of_lease(spec, lease, group):
        newer = " or, with partial rollouts, a later one" if spec.partial_rollouts else ""
        return f"version {group.version} differs from the leased version {lease.version}{newer}"
    if job.version is None or group.version > job.version:
        return f"version {group.version} was never published"
    problem = _invalid_versions(job, spec, group)
    if problem:
        return problem
    own = PromptSampling.model_validate(prompt.sampling) if prompt is not None and prompt.sampling else None
    if own is not None and (problem := _unlike_request(prompt, own, group, spec.partial_rollouts)):
        return problem
    size, max_new = (own.n, own.max_tokens) if own else (spec.grpo.group_size, spec.grpo.max_new_tokens)
    if len(group.samples) != size:
        return f"group has {len(group.samples)} samples, but {size} were asked for (the group size)"
    bound = _prompt_bound(prompt) if prompt is not None and prompt.token_ids is None else None
    if bound is not None and len(group.prompt_token_ids) > bound:
        return (f"{len(group.prompt_token_ids)} prompt tokens, more than its text and context could encode to "
                f"({bound}: a token per byte, and {TEMPLATE_TOKENS} for the chat template)")
    vocab = job.vocab_size
    if vocab is not None and max(group.prompt_token_ids) >= vocab:
        return f"prompt token id {max(group.prompt_token_ids)} is outside the vocabulary (size {vocab})"
    stops = set(own.stop_token_ids) if own and own.stop_token_ids is not None else set(job.eos_token_ids or ())
    for k, sample in enumerate(group.samples):
        problem = _invalid_sample(sample, max_new, vocab, stops, _room(job, group))
        if problem:
            return f"sample {k}: {problem}"
    return None


def _prompt_bound(prompt: Prompt) -> int:
    """The most tokens a text prompt can encode to: tokenizers spend at least a byte of text a token (byte-level BPE,
    or SentencePiece's byte fallback), and a chat template adds its own (roles, a default system prompt)."""
    context = json.dumps(prompt.context).encode() if prompt.context else b""
    return len(prompt.text.encode()) + len(context) + TEMPLATE_TOKENS


def _unlike_request(prompt: Prompt, own: PromptSampling, group: GroupSubmit, inflight: bool) -> str | None:
    """A prompt with its own sampling (a Tinker request) must be drawn from exactly its tokens (one turn: _invalid),
    with its version (where it stops: _invalid_sample); an in-flight request (its fleet job has partial
    rollouts), with its version or newer ones, per-token versions telling which."""
    if group.version != prompt.version and not (inflight and group.version > prompt.version):
        return f"drawn with version {group.version}, but the request is for version {prompt.version}"
    if group.prompt_token_ids != prompt.token_ids:
        return "prompt_token_ids differ from the leased prompt's token_ids"
    for k, sample in enumerate(group.samples):
        if sample.versions is not None and not inflight:
            return f"sample {k}: a Tinker sample is of one version"
        if sample.finish_reason == "stop" and own.stop_token_ids == []:
            return f"sample {k}: finish_reason is stop, but the request has no stop tokens"
    return None


def _of_lease(spec: JobSpec, lease: Lease, group: GroupSubmit) -> bool:
    """The group's (oldest token's) version is one its lease allows: the leased version, or with partial
    rollouts a later one (the worker swapped weights after it leased, before the group's first token)."""
    return group.version == lease.version or (spec.partial_rollouts and group.version > lease.version)


def _invalid_versions(job: Job, spec: JobSpec, group: GroupSubmit) -> str | None:
    """Per-token versions (the protocol checked their shape): only with partial rollouts on, and none
    newer than the latest published version."""
    tagged = [(k, s.versions) for k, s in enumerate(group.samples) if s.versions is not None]
    if tagged and not spec.partial_rollouts:
        return f"sample {tagged[0][0]}: per-token versions sent, but the job does not have partial_rollouts on"
    for k, runs in tagged:
        if job.version is None or runs[-1][0] > job.version:
            return f"sample {k}: tokens of version {runs[-1][0]}, which was never published (latest {job.version})"
    return None


def _unpublished(db: Session, job: Job, spec: JobSpec, lease: Lease, group: GroupSubmit) -> str | None:
    """Partial rollouts name versions after the leased one: each must be one the learner published (with κ > 1
    not every number is), or its auditor has no weights to replay those tokens with (it crashed on one)."""
    named = {group.version} | {v for s in group.samples if s.versions for v, _ in s.versions}
    named.discard(lease.version)  # published: the lease was granted at it
    if not named:
        return None
    known = set(db.scalars(select(WeightVersion.version).where(WeightVersion.job_id == job.id,
                                                                WeightVersion.version.in_(named))))
    missing = sorted(named - known)
    return (f"tokens of version {missing[0]}, which was never published (this job publishes every "
            f"{spec.publish_period} steps)") if missing else None


def _room(job: Job, group: GroupSubmit) -> int | None:
    """Completion tokens the model's context leaves after the group's prompt, where that is known."""
    return None if job.context_length is None else job.context_length - len(group.prompt_token_ids)


def _invalid_sample(sample: SampleSubmit, max_new: int, vocab: int | None, eos: set[int],
                    room: int | None = None) -> str | None:
    """`room`: what the model's context leaves after the prompt, where every worker stops a sample (finish "length"
    before max_new_tokens)."""
    n = len(sample.token_ids) if sample.turns is None else sample.turns[-1]  # an episode: its last model turn
    if n > max_new:
        return f"{n} tokens, but the job's max_new_tokens is {max_new}"
    # Past the context's end, where it leaves room (a prompt that alone fills it is refused by vLLM, and generated
    # past it by the transformers backend); an episode's turns are bounded as it is played.
    if room is not None and 0 < room < n and sample.turns is None:
        return f"{n} tokens, but the model's context leaves {room} after the prompt"
    if vocab is not None and max(sample.token_ids) >= vocab:
        return f"token id {max(sample.token_ids)} is outside the vocabulary (size {vocab})"
    if vocab is not None and sample.logprobs and min(sample.logprobs) < logprob_floor(vocab):
        return (f"logprob {min(sample.logprobs):.1f} is below {logprob_floor(vocab):.1f}: no sampler draws a token "
                f"that unlikely (all such tokens together have probability < {HONEST_MISS:g})")
    # An episode's last turn may end on its own room.
    if sample.finish_reason == "length" and n not in (max_new, room) and sample.turns is None:
        return (f"finish_reason is length after {n} tokens, but max_new_tokens is {max_new}"
                + ("" if room is None else f" and the model's context leaves {room} after the prompt"))
    # Every sampler stops at the first stop token (an episode's environment turns may hold one).
    early = next((i for i, t in enumerate(sample.token_ids[:-1]) if t in eos), None) if sample.turns is None else None
    if early is not None:
        return f"it goes on past the stop token at position {early}"
    if sample.finish_reason == "stop" and eos and sample.token_ids[-1] not in eos:
        return (f"finish_reason is stop, but the last token {sample.token_ids[-1]} is not a stop token (an "
                "end-of-sequence token, or one the request names)")
    return None


def logprob_floor(vocab_size: int) -> float:
    """The lowest behaviour logprob an honest sample has, but with probability < HONEST_MISS per token."""
    return -(math.log(vocab_size) - math.log(HONEST_MISS))


def _row(job: Job, lease: Lease, worker: Worker, group: GroupSubmit, reason: str | None,
         kind: RejectKind | None) -> dict[str, Any]:
    return {
        "id": new_id("rol"), "job_id": job.id, "prompt_id": group.prompt_id, "lease_id": lease.id,
        "worker_id": worker.id, "version": group.version,
        "status": RolloutStatus.rejected if reason else RolloutStatus.accepted, "reason": reason,
        "reject_kind": kind, "prompt_token_ids": group.prompt_token_ids,
        # The worker's text is not kept: the platform shows its own decoding of the tokens.
        "samples": [s.model_dump(mode="json", exclude={"text"}) for s in group.samples],
        "gen_seconds": group.gen_seconds, "seq": None, "precision": group.precision.value,
        "suspicion": duplicated(group),
    }


def duplicated(group: GroupSubmit) -> str | None:
    """Samples of one group drawn with different seeds that are token for token the same: an honest sampler
    makes them only where the model is near certain, a worker that copies one sample G times always. Such a
    group is audited whatever its sender's trust (trust.should_audit): the replay tells the two apart."""
    seen = {tuple(s.token_ids) for s in group.samples}
    return f"{len(group.samples) - len(seen)} duplicated samples" if len(seen) < len(group.samples) else None


def _store(db: Session, lease: Lease, worker: Worker, rows: list[dict[str, Any]], answered: bool) -> None:
    """`answered`: every prompt of the lease has its group now (the request held them all), so none is counted."""
    _count(db, worker, rows)
    if rows:
        db.execute(insert(Rollout), rows)
    accepted = [r["prompt_id"] for r in rows if r["status"] == RolloutStatus.accepted]
    back = [r["prompt_id"] for r in rows if r["status"] != RolloutStatus.accepted]
    if accepted:
        db.execute(update(Prompt).where(Prompt.id.in_(accepted), Prompt.lease_id == lease.id)
                   .values(state=PromptState.submitted))
    return_prompts(db, back, lease_id=lease.id)
    set_aside_failing(db, lease.job_id, [r["prompt_id"] for r in rows
                                         if r["reject_kind"] == RejectKind.environment_failed])
    if lease.status == LeaseStatus.active and (answered or _all_answered(db, lease)):
        lease.status, lease.finished_at = LeaseStatus.completed, utcnow()


def _count(db: Session, worker: Worker, rows: list[dict[str, Any]]) -> None:
    """The worker's counts of groups, and its accepted groups numbered for the audit windows (trust.should_audit),
    in one atomic statement: two submissions at once never share numbers (a worker cannot send many at once to
    have them all fall outside its audit), and neither overwrites the other's counts (the submission route
    locks the worker's row, but the learner's verdicts also count its rejections)."""
    if not rows:
        return
    accepted = [r for r in rows if r["status"] == RolloutStatus.accepted]
    counts = db.execute(
        update(Worker).where(Worker.id == worker.id)
        .values(groups_numbered=Worker.groups_numbered + len(accepted),
                accepted_rollouts=Worker.accepted_rollouts + len(accepted),
                rejected_rollouts=Worker.rejected_rollouts + len(rows) - len(accepted))
        .returning(Worker.groups_numbered, Worker.accepted_rollouts, Worker.rejected_rollouts)
        .execution_options(synchronize_session=False)).one()
    for k, row in enumerate(accepted):
        row["seq"] = counts.groups_numbered - len(accepted) + k
    for key, value in counts._mapping.items():  # what the row now holds, without writing it again
        set_committed_value(worker, key, value)


def _all_answered(db: Session, lease: Lease) -> bool:
    answered = db.scalar(select(func.count()).where(Rollout.lease_id == lease.id))
    return answered >= len(lease.prompt_ids)


def reject_stale(db: Session, job: Job, step: int, spec: JobSpec) -> int:
    """Queued groups too old for step t are rejected and their prompts re-pooled."""
    stale = list(db.scalars(
        select(Rollout).where(Rollout.job_id == job.id, Rollout.status == RolloutStatus.accepted,
                              Rollout.version < spec.oldest_admissible(step)).with_for_update(skip_locked=True)
    ))
    for r in stale:
        r.status, r.reject_kind = RolloutStatus.rejected, RejectKind.stale_at_claim
        r.reason = f"stale at claim: step {step} - version {r.version} > S={spec.staleness}"
    return_prompts(db, [r.prompt_id for r in stale], from_state="submitted")
    return len(stale)


def claim(db: Session, job: Job, step: int, max_groups: int) -> tuple[list[Rollout], int]:
    """The queued rollouts admissible at `step` (the committed step t, or t + 1 while t trains), oldest
    version first, then in arrival order: a group waits only behind groups at least as stale, all of
    which lease_room counted, so one that was leased in room is trained before its version goes stale.
    Those too stale for t are rejected; those admissible at t but not at t + 1 stay for t."""
    spec = spec_of(job)
    rejected = reject_stale(db, job, job.step, spec)
    # The first groups of the queue are chosen and locked by id alone, then read: where PostgreSQL sorts the queue
    # to find them (its statistics not yet counting a burst of submissions), it sorts ids, not every queued
    # group's samples (thousands of those spilled to disk: 40-60 ms a claim, holding the job's lock).
    ids = list(db.scalars(
        select(Rollout.id)
        .where(Rollout.job_id == job.id, Rollout.status == RolloutStatus.accepted,
               Rollout.version >= spec.oldest_admissible(step))
        .order_by(Rollout.version, Rollout.created_at, Rollout.id)
        .limit(max_groups)
        .with_for_update(skip_locked=True)
    ))
    by_id = {r.id: r for r in db.scalars(select(Rollout).where(Rollout.id.in_(ids)))} if ids else {}
    rows = [by_id[i] for i in ids]
    for r in rows:
        r.status, r.claim_step = RolloutStatus.claimed, step
    return rows, rejected


def release_claims(db: Session, job_id: str, step: int | None = None) -> int:
    """Claimed rollouts not committed by a step go back to the queue (re-checked for staleness)."""
    query = update(Rollout).where(Rollout.job_id == job_id, Rollout.status == RolloutStatus.claimed)
    if step is not None:
        query = query.where(Rollout.claim_step == step)
    return db.execute(query.values(status=RolloutStatus.accepted, claim_step=None)).rowcount or 0


def claimed_groups(db: Session, rows: list[Rollout], audit: Callable[[Rollout], bool],
                   data_dir: Path) -> list[ClaimedGroup]:
    """Rollouts as the learner gets them: with their prompt and reference (trusted side only), and their tokens
    from the table or, for a committed step replayed long after, the job's archive."""
    prompts = {p.id: p for p in db.scalars(select(Prompt).where(Prompt.id.in_([r.prompt_id for r in rows])))}
    tokens = archive.payloads(data_dir, rows)
    return [ClaimedGroup(rollout_id=r.id, prompt_id=r.prompt_id, prompt_text=prompts[r.prompt_id].text,
                         prompt_context=prompts[r.prompt_id].context,
                         reference=prompts[r.prompt_id].reference, version=r.version, worker_id=r.worker_id,
                         prompt_token_ids=tokens[r.id].prompt_token_ids, samples=tokens[r.id].samples,
                         rewards=r.rewards,
                         audit=audit(r), seed=r.seed, precision=r.precision or Precision.float32)
            for r in rows]
