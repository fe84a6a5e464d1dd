"""What the Tinker routes do to the database: sessions, models, samplers and their requests (futures).

A request is queued on a model; the learner host holding the model claims the model's requests one at a
time in `seq` order, so a model trains exactly in the order the SDK sent its calls. A host that falls
silent fails every unfinished request of its models (the SDK then raises instead of waiting), and so
does a session that stops heartbeating: nothing waits forever.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import PurePosixPath

from echo2.models import BUILTINS, model_error, private_dir_of, private_model_error
from echo2.protocol.tinker import (
    CheckpointKind,
    ErrorCategory,
    HostResult,
    ModelKind,
    ModelStatus,
    RequestKind,
    RequestStatus,
    SamplePayload,
    SavePayload,
    SessionStatus,
)
from sqlalchemy import delete, func, null, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from ..db import WRITER_LOCK
from ..errors import ApiError
from ..models import utcnow
from ..settings import Settings
from . import fleet, records, states, usage
from .models import TinkerCheckpoint, TinkerHost, TinkerModel, TinkerRequest, TinkerSampler, TinkerSession
from .queueing import UNFINISHED, seq_taken

HOST_DEAD_AFTER_S = 60.0
SESSION_EXPIRES_AFTER_S = 300.0  # the SDK heartbeats every 10 s
BULKY = (RequestKind.forward, RequestKind.forward_backward, RequestKind.sample,
         RequestKind.audit)
# The platform's own requests, not a user's: run past a user's quota, and never billed to the user.
PLATFORMS = (RequestKind.audit, RequestKind.drop_checkpoint)
HOSTS_KEY = "tinker/hosts"  # announced when work is queued: hosts waiting in a claim look at once


def request_key(request_id: str) -> str:
    """Announced when a request finishes: its retrieve_future answers at once."""
    return f"tinker/{request_id}"


def check_base_model(name: str, settings: Settings) -> str:
    """A model Echo2 can load without the network: a built-in, or a model folder by absolute path (where the control
    plane sees the learner hosts' disks, `model_check` "host", checked as a GRPO job's base model is: at once,
    not by a host failing to load it), outside Echo2's own data."""
    if not (name in BUILTINS or PurePosixPath(name).is_absolute()):
        raise ApiError(400, f"unknown base model {name!r}: Echo2 trains and samples {', '.join(BUILTINS)} or a model "
                            "folder given by its absolute path on the learner host (nothing is downloaded)",
                       field="base_model")
    private = private_dir_of(name, (settings.data_dir,))
    problem = private_model_error(name, private) if private is not None else \
        model_error(name, settings.hf_hub_cache, look=settings.model_check == "host")
    if problem is not None:
        raise ApiError(400, problem, field="base_model")
    return name


def owned_session(db: Session, owner_id: str, session_id: str) -> TinkerSession:
    row = db.get(TinkerSession, session_id)
    if row is None or row.owner_id != owner_id:
        raise ApiError(404, f"session {session_id} not found", field="session_id")
    if row.status != SessionStatus.active:
        raise ApiError(400, f"session {session_id} is finished ({row.finish_reason}); create a new ServiceClient",
                       field="session_id")
    return row


def owned_model(db: Session, owner_id: str, model_id: str) -> TinkerModel:
    row = db.get(TinkerModel, model_id)
    if row is None or row.owner_id != owner_id:
        raise ApiError(404, f"model {model_id} not found", field="model_id")
    if row.status == ModelStatus.failed:
        raise ApiError(400, f"model {model_id} failed: {row.error}", field="model_id")
    owned_session(db, owner_id, row.session_id)
    return row


def trained_model(db: Session, owner_id: str, model_id: str) -> TinkerModel:
    """A model a training call runs on: a copy run holds copied states and no host ever loads it, so a call
    queued on it would wait for good (and hold a place in the user's backlog)."""
    row = owned_model(db, owner_id, model_id)
    if row.kind is ModelKind.copy:
        raise ApiError(400, f"training run {model_id} is a copy made by copy_weights: it holds states and runs "
                            "nothing; load one into a training client (create_training_client_from_state)",
                       field="model_id")
    return row


def owned_sampler(db: Session, owner_id: str, sampler_id: str) -> TinkerSampler:
    row = db.get(TinkerSampler, sampler_id)
    if row is None or row.owner_id != owner_id:
        raise ApiError(404, f"sampling session {sampler_id} not found", field="sampling_session_id")
    return row


def sampled_model(db: Session, owner_id: str, sampler: TinkerSampler) -> TinkerModel:
    """The model a sampling session draws from. A sampler opened in another session on a checkpoint whose own
    session has ended since is told that its checkpoint ended: creating a new ServiceClient would not bring it back."""
    model = db.get(TinkerModel, sampler.model_id)
    if model is not None and model.session_id != sampler.session_id and sampler.model_path \
            and session_ended(db, model):
        raise sampler_ended(db, sampler.model_path, model)
    return owned_model(db, owner_id, sampler.model_id)


def new_model(db: Session, settings: Settings, session: TinkerSession, model_id: str, kind: ModelKind,
              base_model: str, lora: dict | None, idempotency_key: str | None = None) -> TinkerModel:
    """A model for a create call; for a repeat of the call that made it (a retried POST, even when its first
    attempt committed while this one ran, or the SDK's outer retry, which sends a new key), that model: the same
    owner, kind, base model and adapter (queueing.enqueue then answers the first create's future). Another create
    under a taken model_seq_id is a 400."""
    base_model = check_base_model(base_model, settings)
    existing = db.get(TinkerModel, model_id)
    if existing is None:
        model = TinkerModel(id=model_id, session_id=session.id, owner_id=session.owner_id, kind=kind,
                            base_model=base_model, lora=lora)
        try:
            with db.begin_nested():  # a concurrent twin of this call may insert it first
                db.add(model)
            return model
        except IntegrityError:
            existing = db.get(TinkerModel, model_id, populate_existing=True)
    if existing is not None and existing.owner_id == session.owner_id and \
            (existing.kind, existing.base_model, existing.lora) == (kind, base_model, lora):
        return existing
    raise seq_taken(model_id)


def checkpoint_path(model_id: str, kind: CheckpointKind, name: str) -> str:
    return f"tinker://{model_id}/{kind.segment}/{name}"


def parse_checkpoint_path(db: Session, owner_id: str, path: str) -> TinkerCheckpoint:
    """The sampler checkpoint a sampling client opens. A state's path (`weights/NAME`) is refused, not read as
    the sampler checkpoint of that name: the two are different weights (the cookbook saves both under one name)."""
    parts = path.removeprefix("tinker://").split("/")
    if path.startswith("tinker://") and len(parts) == 3 and parts[1] == "weights":
        raise ApiError(400, f"model_path {path!r} is a state (save_state): sampling takes a sampler checkpoint, "
                            "tinker://MODEL/sampler_weights/NAME (save_weights_for_sampler); to sample a state, "
                            "load it (create_training_client_from_state) and save_weights_and_get_sampling_client",
                       field="model_path")
    if not path.startswith("tinker://") or len(parts) != 3 or parts[1] != "sampler_weights":
        raise ApiError(400, f"model_path {path!r} is not tinker://MODEL/sampler_weights/NAME", field="model_path")
    model = db.get(TinkerModel, parts[0])
    row = db.get(TinkerCheckpoint, (parts[0], parts[2], CheckpointKind.sampler))
    if model is not None and model.owner_id == owner_id and session_ended(db, model):
        raise sampler_ended(db, path, model)
    if model is None or model.owner_id != owner_id or row is None or expired(row):
        raise ApiError(404, f"checkpoint {path} not found", field="model_path")
    if model.status == ModelStatus.failed:
        raise ApiError(400, f"checkpoint {path}: its model failed: {model.error}", field="model_path")
    owned_session(db, owner_id, model.session_id)
    return row


def sampler_ended(db: Session, path: str, model: TinkerModel) -> ApiError:
    """The answer for a sampler checkpoint whose session ended: its weights went with its model (the host dropped
    them), and weights outlive a session only as a state saved with save_state, so that is what to tell."""
    session = db.get(TinkerSession, model.session_id)
    why = session.finish_reason if session is not None else "deleted"
    return ApiError(404, f"sampler checkpoint {path} ended with the session that saved it ({model.session_id}, "
                         f"{why}): sampler weights last as long as their session. To sample trained weights in a "
                         "later session, save_state them before it ends, then load the state there "
                         "(create_training_client_from_state) and save_weights_and_get_sampling_client",
                    field="model_path")


def saved_state(db: Session, owner_id: str, path: str) -> TinkerCheckpoint:
    """A state saved with save_state (`tinker://MODEL/weights/NAME`): it outlives its session and its model."""
    parts = path.removeprefix("tinker://").split("/")
    if not path.startswith("tinker://") or len(parts) != 3 or parts[1] != "weights":
        raise ApiError(400, f"path {path!r} is not tinker://MODEL/weights/NAME (a state saved with save_state)",
                       field="path")
    model = db.get(TinkerModel, parts[0])
    row = db.get(TinkerCheckpoint, (parts[0], parts[2], CheckpointKind.training))
    if (model is None or model.owner_id != owner_id or row is None or (row.sha256 is None and row.host is None)
            or expired(row)):
        raise ApiError(404, f"no state saved with save_state at {path} (deleted, or expired)", field="path")
    return row


def expired(row: TinkerCheckpoint) -> bool:
    return row.expires_at is not None and row.expires_at <= utcnow()


def finish_session(db: Session, session: TinkerSession, reason: str) -> None:
    """End a session: its unfinished requests fail, and hosts drop its models at their next claim. Its sampler
    checkpoints go now (the API no longer lists or loads them), as deleted ones do: their weights are in those
    models' memory, which the hosts drop with the models (no drop_checkpoint is queued on a model that ends)."""
    if session.status == SessionStatus.finished:
        return
    session.status, session.finish_reason, session.finished_at = SessionStatus.finished, reason, utcnow()
    models = select(TinkerModel.id).where(TinkerModel.session_id == session.id)
    fail_requests(db, TinkerRequest.model_id.in_(models), f"the session ended ({reason})", ErrorCategory.user)
    db.execute(delete(TinkerCheckpoint).where(TinkerCheckpoint.model_id.in_(models),
                                              TinkerCheckpoint.kind == CheckpointKind.sampler))
    fleet.end_jobs(db, models, f"its Tinker session ended ({reason})")


def drop_results(db: Session, before: datetime) -> int:
    """Delete the results of the futures of sessions that ended before `before`; returns how many. Nothing
    asks for them but a client that kept a future's id, and it is told why (410, api/tinker/futures.py)."""
    ended = (select(TinkerModel.id).join(TinkerSession, TinkerSession.id == TinkerModel.session_id)
             .where(TinkerSession.finished_at <= before))
    gone = db.execute(update(TinkerRequest).where(TinkerRequest.model_id.in_(ended), TinkerRequest.result.is_not(None))
                      .values(result=null()).execution_options(synchronize_session=False)).rowcount
    db.commit()
    return gone


def fail_requests(db: Session, where, error: str, category: ErrorCategory) -> None:  # type: ignore[no-untyped-def]
    db.execute(update(TinkerRequest).where(where, TinkerRequest.status.in_(UNFINISHED))
               .values(status=RequestStatus.failed, error=error[:1024], category=category,
                       finished_at=utcnow()))


def session_ended(db: Session, model: TinkerModel) -> bool:
    session = db.get(TinkerSession, model.session_id)
    return session is None or session.status != SessionStatus.active


def fail_model(db: Session, model: TinkerModel, error: str, category: ErrorCategory) -> None:
    model.status, model.error = ModelStatus.failed, error[:1024]
    fail_requests(db, TinkerRequest.model_id == model.id, error, category)
    fleet.end_jobs(db, [model.id], f"its Tinker model failed: {error}"[:512])


def sweep(db: Session) -> None:
    """Expire silent sessions and fail the models of silent hosts (run by every host claim)."""
    now = utcnow()
    stale = db.scalars(select(TinkerSession).where(
        TinkerSession.status == SessionStatus.active,
        TinkerSession.heartbeat_at < now - timedelta(seconds=SESSION_EXPIRES_AFTER_S)))
    for session in stale:
        finish_session(db, session, "expired: no heartbeat")
    dead = select(TinkerHost.name).where(TinkerHost.seen_at < now - timedelta(seconds=HOST_DEAD_AFTER_S))
    for model in db.scalars(select(TinkerModel).where(TinkerModel.host.in_(dead),
                                                      TinkerModel.status != ModelStatus.failed)):
        fail_model(db, model, f"its learner host {model.host} stopped answering; create a new client",
                   ErrorCategory.server)
    fleet.sweep(db)
    records.sweep(db)


def record_result(db: Session, request: TinkerRequest, result: HostResult, host: str,
                  settings: Settings) -> list[str]:
    """Store a host's outcome: the request is done (and billed) or failed, and what it made exists from now on.
    Returns the other requests it answered (an audit's fleet sample request)."""
    model = db.get(TinkerModel, request.model_id)
    assert model is not None
    if result.error is None and result.progress is not None and request.kind == RequestKind.sample:
        _resume_later(db, request, model, result)
        return []
    request.finished_at = utcnow()
    answered = []
    if request.kind == RequestKind.audit:
        answered = fleet.audited(db, request, result.audit if result.error is None else None, settings)
    if result.error is None and request.kind not in PLATFORMS:  # an audit, a dropped checkpoint: the platform's cost
        usage.bill(db, request, model, host, result)
    if result.error is None and request.kind == RequestKind.sample and result.sample is not None:
        records.record(db, request.id, request.owner_id, model.id, SamplePayload.model_validate(request.payload),
                       result.sample)
    if request.kind in BULKY:  # the tokens are not needed once run: only the result is kept
        request.payload = {}
    if result.error is not None:
        request.status, request.error, request.category = RequestStatus.failed, result.error, result.category
        if request.kind == RequestKind.create_model:
            fail_model(db, model, result.error, result.category)
        return answered
    request.status = RequestStatus.done
    request.result = result.model_dump(mode="json", exclude_none=True, exclude={"category", "seconds"})
    if request.kind == RequestKind.create_model and result.info is not None:
        model.status, model.info = ModelStatus.ready, result.info.model_dump(mode="json")
    if request.kind in (RequestKind.save_weights, RequestKind.save_weights_for_sampler):
        _saved(db, model, SavePayload.model_validate(request.payload), result, host, settings)
    return answered


def _saved(db: Session, model: TinkerModel, save: SavePayload, result: HostResult, host: str,
           settings: Settings) -> None:
    checkpoint = db.get(TinkerCheckpoint, (model.id, save.name, save.kind)) or TinkerCheckpoint(
        model_id=model.id, name=save.name, kind=save.kind)
    replaced = checkpoint.sha256
    checkpoint.step, checkpoint.inflight = result.step or 0, save.inflight
    checkpoint.host = host if save.kind is CheckpointKind.training else None
    checkpoint.version = result.published
    checkpoint.sha256 = result.state.sha256 if result.state is not None else None
    checkpoint.size_bytes = result.state.size_bytes if result.state is not None else None
    checkpoint.created_at = utcnow()
    checkpoint.expires_at = utcnow() + timedelta(seconds=save.ttl_seconds) if save.ttl_seconds else None
    db.add(checkpoint)
    db.flush()
    if replaced and replaced != checkpoint.sha256:  # saved again under its name: the old file may go
        states.collect(db, settings.data_dir / "tinker-states", {replaced})
    if result.published is not None:
        fleet.published(db, model, result.published)


def _resume_later(db: Session, request: TinkerRequest, model: TinkerModel, result: HostResult) -> None:
    """An in-flight sample between two segments: it goes back to the queue behind the model's other requests
    (a training step and an in-flight save sent after it run first, and its next segment draws with the newer
    weights), carrying what it drew so far and the compute time spent on it (billed when it finishes)."""
    assert result.progress is not None
    payload = SamplePayload.model_validate(request.payload)
    # The seconds so far are what this control plane kept, not what the host sends back (the learner host starts
    # each segment's progress at 0: every segment but the last two went unbilled).
    before = payload.progress.seconds if payload.progress is not None else 0.0
    progress = result.progress.model_copy(update={"seconds": before + (result.seconds or 0.0)})
    db.execute(select(TinkerModel.id).where(TinkerModel.id == model.id).with_for_update(**WRITER_LOCK))
    last = db.scalar(select(func.max(TinkerRequest.seq)).where(TinkerRequest.model_id == model.id)) or 0
    payload = payload.model_copy(update={"progress": progress})
    request.payload = payload.model_dump(mode="json")
    request.seq, request.status = last + 1, RequestStatus.pending
