"""The Tinker SDK's training calls: each one queues a request on its model and answers its future at once."""

from __future__ import annotations

from typing import Any

import anyio
from echo2.protocol.common import reason
from echo2.protocol.tinker import (
    MAX_REQUEST_TOKENS,
    RECORDED_LOGPROBS,
    TEN_YEARS_S,
    AdamStep,
    CheckpointKind,
    ForwardBackwardPayload,
    LoadPayload,
    LossFn,
    ModelKind,
    ModelStatus,
    RequestKind,
    SavePayload,
    TinkerDatum,
)
from fastapi import Request
from pydantic import ValidationError
from sqlalchemy.orm import Session

from ..db import Database
from ..deps import SessionDep, SettingsDep
from ..errors import ApiError
from ..routing import make_router
from ..services.notices import Announcer
from . import queueing, records, service, wire
from .deps import Bell, IdempotencyKey, TinkerUser
from .models import TinkerCheckpoint, TinkerModel, TinkerRequest, TinkerSampler
from .schemas import CreateModelRequest, LoadWeightsRequest, ModelRef, OptimStepRequest, SaveWeightsRequest

router = make_router(prefix="/api/v1", tags=["tinker"], include_in_schema=False)

PROTOBUF = "application/x-protobuf"
# The inputs each loss needs besides target_tokens (tinker-docs "Losses"), and those it reads when given
# (weights default to ones); learner/tinker/losses.py states each loss.
LOSS_INPUTS = {LossFn.cross_entropy: (), LossFn.importance_sampling: ("logprobs", "advantages"),
               LossFn.ppo: ("logprobs", "advantages"), LossFn.cispo: ("logprobs", "advantages"),
               LossFn.dro: ("logprobs", "advantages"), LossFn.gspo: ("logprobs", "advantages"),
               LossFn.stable_reinforce: ("advantages",)}
OPTIONAL_INPUTS = {LossFn.gspo: ("weights", "sequence_ratio_mask"), LossFn.stable_reinforce: ("weights", "logprobs")}


def queued(row: TinkerRequest, bell: Announcer) -> dict[str, Any]:
    """The SDK's future of a committed request; hosts waiting for work hear of it at once."""
    bell.announce(service.HOSTS_KEY)
    return {"request_id": row.id, "model_id": row.model_id}


@router.post("/create_model")
def create_model(body: CreateModelRequest, user: TinkerUser, db: SessionDep, key: IdempotencyKey,
                 bell: Bell, settings: SettingsDep) -> dict[str, Any]:
    if body.lora_config is None:
        raise ApiError(400, "Echo2 trains LoRA adapters only: create_lora_training_client", field="lora_config")
    if body.optimizer_config.get("type", "adamw") != "adamw":
        raise ApiError(400, f"optimizer {body.optimizer_config.get('type')!r} is not supported: Echo2 steps with AdamW",
                       field="optimizer_config")
    session = service.owned_session(db, user.id, body.session_id)
    model = service.new_model(db, settings, session, f"{session.id}:train:{body.model_seq_id}", ModelKind.train,
                              body.base_model, body.lora_config.model_dump(), key)
    row = queueing.enqueue(db, model, RequestKind.create_model, {}, key)
    db.commit()
    return queued(row, bell)


@router.post("/get_info")
def get_info(body: ModelRef, user: TinkerUser, db: SessionDep) -> dict[str, Any]:
    model = service.owned_model(db, user.id, body.model_id)
    if model.status not in (ModelStatus.ready, ModelStatus.parked):
        raise ApiError(400, f"model {model.id} is not loaded yet: wait for create_model's future", field="model_id")
    lora = model.lora or {}
    return {"type": "get_info", "model_id": model.id, "is_lora": model.lora is not None,
            "lora_rank": lora.get("rank"), "model_name": model.base_model,
            "model_data": {"model_name": model.base_model, "arch": model.info.get("arch"),
                           "tokenizer_id": model.info.get("tokenizer_id")}}


@router.post("/forward_backward")
async def forward_backward(request: Request, user: TinkerUser, key: IdempotencyKey, bell: Bell) -> dict[str, Any]:
    """Protobuf in (tinker_public.ForwardBackwardRequest); `forward_only` makes it the SDK's `forward`.
    Async, to read the raw body, once the caller is authenticated (a dependency); parsing a body of up to
    16 MiB and the database work run in worker threads, not on the event loop."""
    if PROTOBUF not in request.headers.get("content-type", ""):
        raise ApiError(415, f"forward_backward takes {PROTOBUF} (tinker_public.ForwardBackwardRequest)")
    if request.headers.get("content-encoding", "identity") != "identity":
        raise ApiError(415, "compressed forward_backward bodies are not accepted (client config says so)")
    parsed, kind, payload = await anyio.to_thread.run_sync(_parse, await request.body())
    row = await anyio.to_thread.run_sync(_queue_forward, request.app.state.db, user.id, parsed, kind, payload, key)
    return queued(row, bell)


def _parse(body: bytes) -> tuple[wire.ForwardBackwardRequest, RequestKind, ForwardBackwardPayload]:
    try:
        parsed = wire.read_forward_backward(body)
    except ValueError as exc:  # WireError, or what numpy says of a tensor the reader let through
        raise ApiError(400, f"forward_backward body: {exc}") from exc
    kind = RequestKind.forward if parsed.forward_only else RequestKind.forward_backward
    return parsed, kind, _payload(parsed)


def _queue_forward(database: Database, user_id: str, parsed: wire.ForwardBackwardRequest, kind: RequestKind,
                   payload: ForwardBackwardPayload, key: str | None) -> TinkerRequest:
    with database.session() as db:
        model = service.trained_model(db, user_id, parsed.model_id)
        _check_fits(model, payload)
        if payload.loss_fn is LossFn.stable_reinforce:
            _recorded(db, user_id, parsed, payload)
        row = queueing.enqueue(db, model, kind, payload.model_dump(mode="json"), key)
        db.commit()
        return row


def _recorded(db: Session, user_id: str, parsed: wire.ForwardBackwardRequest, payload: ForwardBackwardPayload) -> None:
    """stable_reinforce's behaviour policy: the logprob the sampler recorded for each target token, found through
    the datum's provenance spans (api/tinker/records.py)."""
    seen: dict = {}
    for i, (datum, raw) in enumerate(zip(payload.data, parsed.data, strict=True)):
        datum.inputs[RECORDED_LOGPROBS] = records.behaviour(db, user_id, raw, datum.target_tokens,
                                                            datum.inputs["advantages"], i, seen)


def _payload(parsed: wire.ForwardBackwardRequest) -> ForwardBackwardPayload:
    try:
        loss = LossFn(parsed.loss_fn)
    except ValueError:
        raise ApiError(400, f"loss_fn {parsed.loss_fn!r} is not supported by Echo2; it computes "
                            f"{', '.join(LossFn)}", field="loss_fn") from None
    config = {k: v for k, v in parsed.loss_fn_config.items() if isinstance(v, float)}
    if len(config) != len(parsed.loss_fn_config):
        raise ApiError(400, "loss_fn_config: Echo2 takes numbers only", field="loss_fn_config")
    unknown = sorted(set(config) - set(loss.config_keys))
    if unknown:
        known = ", ".join(loss.config_keys) or "none"
        raise ApiError(400, f"loss_fn_config: {loss.value} reads {known}, not {', '.join(unknown)}",
                       field="loss_fn_config")
    data = [_datum(d, i, loss) for i, d in enumerate(parsed.data)]
    try:
        return ForwardBackwardPayload(loss_fn=loss, loss_fn_config=config, forward_only=parsed.forward_only,
                                      data=data)
    except ValidationError as exc:
        raise ApiError(400, f"forward_backward: {reason(exc.errors()[0])}") from exc


def _datum(datum: wire.Datum, index: int, loss: LossFn) -> TinkerDatum:
    what = f"data[{index}].loss_fn_inputs"
    needed = ("target_tokens", *LOSS_INPUTS[loss])
    missing = [name for name in needed if name not in datum.inputs]
    if missing:
        raise ApiError(400, f"{what}: {loss.value} needs {', '.join(missing)}", field=what)
    for name, array in datum.inputs.items():
        if array.ndim != 1 or len(array) != len(datum.tokens):
            raise ApiError(400, f"{what}.{name}: Echo2 takes one value per input token ({len(datum.tokens)}), "
                                f"not shape {list(array.shape)}", field=f"{what}.{name}")
    optional = OPTIONAL_INPUTS.get(loss, ("weights",))
    inputs = {name: datum.inputs[name].astype(float).tolist() for name in (*optional, *LOSS_INPUTS[loss])
              if name in datum.inputs}
    records.check_tiling(datum, len(datum.inputs["target_tokens"]), index)
    try:
        return TinkerDatum(tokens=datum.tokens, target_tokens=datum.inputs["target_tokens"].tolist(), inputs=inputs)
    except ValidationError as exc:
        raise ApiError(400, f"data[{index}]: {reason(exc.errors()[0])}", field=f"data[{index}]") from exc


def _check_fits(model: TinkerModel, payload: ForwardBackwardPayload) -> None:
    """Token ids inside the vocabulary, no datum longer than the model's context (a longer one would make the host
    build attention over it anyway, and the memory that takes can fail every model the host holds), and at most
    MAX_REQUEST_TOKENS in all: what one request may cost its owner and hold the host for."""
    vocab, context = model.info.get("vocab_size"), model.info.get("max_context_length")
    total = sum(len(datum.tokens) for datum in payload.data)
    if total > MAX_REQUEST_TOKENS:
        raise ApiError(400, f"data: {total:,} tokens in one request, more than Echo2 runs at once "
                            f"({MAX_REQUEST_TOKENS:,}): split the batch into several forward_backward calls (their "
                            "gradients add up until optim_step)", field="data")
    for i, datum in enumerate(payload.data):
        if vocab is not None and (max(datum.tokens) >= vocab or max(datum.target_tokens, default=0) >= vocab):
            raise ApiError(400, f"data[{i}]: token ids must be below the vocabulary size {vocab}", field=f"data[{i}]")
        if context is not None and len(datum.tokens) > context:
            raise ApiError(400, f"data[{i}]: {len(datum.tokens)} tokens, beyond the model's context of {context}",
                           field=f"data[{i}]")


@router.post("/optim_step")
def optim_step(body: OptimStepRequest, user: TinkerUser, db: SessionDep, key: IdempotencyKey,
               bell: Bell) -> dict[str, Any]:
    if body.adam_params is None:
        raise ApiError(400, "Echo2 steps with Adam only: pass AdamParams", field="optim_params")
    try:
        step = AdamStep(**body.adam_params.model_dump())
    except ValidationError as exc:  # named as its field, as every other refusal is
        first = exc.errors()[0]
        raise ApiError(400, f"adam_params: {first['loc'][0]}: {first['msg']}",
                       field=f"adam_params.{first['loc'][0]}") from exc
    model = service.trained_model(db, user.id, body.model_id)
    row = queueing.enqueue(db, model, RequestKind.optim_step, step.model_dump(mode="json"), key)
    db.commit()
    return queued(row, bell)


@router.post("/save_weights_for_sampler")
def save_for_sampler(body: SaveWeightsRequest, user: TinkerUser, db: SessionDep, key: IdempotencyKey,
                     bell: Bell) -> dict[str, Any]:
    """A sampler checkpoint. kind="inflight": the model's in-flight samplers (every one, old and new) move to it,
    and the samples they are drawing continue on it from their next segment (learner/sampling.py; on the
    fleet, workers/echo2_worker/partial.py)."""
    model = service.trained_model(db, user.id, body.model_id)
    ttl = _ttl(body.ttl_seconds)
    if body.kind == "inflight" and ttl is not None:
        raise ApiError(400, "an inflight save takes no ttl_seconds (the SDK omits it): in-flight checkpoints live "
                            "as long as their model", field="ttl_seconds")
    sampler_id = None
    if body.path is None:
        if body.sampling_session_seq_id is None:
            raise ApiError(422, "give path (a name) or sampling_session_seq_id", field="path")
        sampler_id = f"{model.session_id}:sample:{body.sampling_session_seq_id}"
    name = body.path or f"sampler-{body.sampling_session_seq_id}"
    payload = SavePayload(name=name, kind=CheckpointKind.sampler, sampler_id=sampler_id,
                          inflight=body.kind == "inflight", ttl_seconds=ttl)
    row = queueing.enqueue(db, model, RequestKind.save_weights_for_sampler, payload.model_dump(), key)
    if sampler_id is not None and db.get(TinkerSampler, sampler_id) is None:
        db.add(TinkerSampler(id=sampler_id, session_id=model.session_id, owner_id=user.id, model_id=model.id,
                             checkpoint=name, base_model=model.base_model, inflight=payload.inflight,
                             model_path=service.checkpoint_path(model.id, CheckpointKind.sampler, name)))
    db.commit()
    return queued(row, bell)


@router.post("/save_weights")
def save_weights(body: SaveWeightsRequest, user: TinkerUser, db: SessionDep, key: IdempotencyKey,
                 bell: Bell) -> dict[str, Any]:
    """A state (adapter and AdamW state): the host uploads it to the control plane, where any host loads it."""
    model = service.trained_model(db, user.id, body.model_id)
    payload = SavePayload(name=body.path or f"state-{body.seq_id or 0}", kind=CheckpointKind.training,
                          ttl_seconds=_ttl(body.ttl_seconds))
    row = queueing.enqueue(db, model, RequestKind.save_weights, payload.model_dump(), key)
    db.commit()
    return queued(row, bell)


def _ttl(ttl_seconds: int | None) -> int | None:
    if ttl_seconds is not None and not 3600 <= ttl_seconds <= TEN_YEARS_S:
        raise ApiError(400, f"ttl_seconds must be between 3600 (an hour) and {TEN_YEARS_S} (ten years), or None "
                            "(kept until deleted)", field="ttl_seconds")
    return ttl_seconds


@router.post("/load_weights")
def load_weights(body: LoadWeightsRequest, user: TinkerUser, db: SessionDep, key: IdempotencyKey,
                 bell: Bell, settings: SettingsDep) -> dict[str, Any]:
    """A state saved with save_state, into a new model (session_id, model_seq_id: the SDK's
    create_training_client_from_state) or into an existing one (model_id: load_state). The control plane stores
    the state (api/tinker/states.py), so whichever host runs the model loads it."""
    state = service.saved_state(db, user.id, body.path)
    if (body.optimizer_config or {}).get("type", "adamw") != "adamw":
        raise ApiError(400, "Echo2 steps with AdamW only", field="optimizer_config")
    source = db.get(TinkerModel, state.model_id)
    assert source is not None
    load = LoadPayload(model_id=source.id, name=state.name, optimizer=body.optimizer,
                       sha256=state.sha256).model_dump()
    if body.model_id is not None:
        model = service.trained_model(db, user.id, body.model_id)
        _pin(model, state)
        row = queueing.enqueue(db, model, RequestKind.load_weights, load, key)
    elif body.session_id is not None and body.model_seq_id is not None:
        session = service.owned_session(db, user.id, body.session_id)
        model = service.new_model(db, settings, session, f"{session.id}:train:{body.model_seq_id}", ModelKind.train,
                                  body.base_model or source.base_model, source.lora, key)
        _pin(model, state)
        row = queueing.enqueue(db, model, RequestKind.create_model, {"load": load}, key)
    else:
        raise ApiError(422, "give model_id, or session_id and model_seq_id", field="model_id")
    db.commit()
    return queued(row, bell)


def _pin(model: TinkerModel, state: TinkerCheckpoint) -> None:
    """A state saved before states were stored by the control plane (no digest) is on the disk of the host that
    saved it: the model loading it runs there (one no host has loaded yet waits for a slot there)."""
    if state.sha256 is not None:
        return
    if model.host is None and model.status == ModelStatus.pending:
        model.host, model.status = state.host, ModelStatus.parked
    elif model.host != state.host:
        raise ApiError(400, f"that state is on learner host {state.host}, and model {model.id} runs on {model.host}: "
                            "load it into a new training client (create_training_client_from_state)", field="path")
