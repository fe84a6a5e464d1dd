"""The Tinker SDK's sampling calls: sampling sessions on a saved checkpoint or a base model, and `asample`."""

from __future__ import annotations

from typing import Any

from echo2.protocol.common import reason
from echo2.protocol.tinker import (
    MAX_TOPK,
    ModelKind,
    RequestKind,
    RequestStatus,
    SampleParams,
    SamplePayload,
)
from pydantic import ValidationError
from sqlalchemy.exc import IntegrityError

from ..deps import SessionDep, SettingsDep
from ..errors import ApiError
from ..routing import make_router
from . import fleet, queueing, service
from .deps import Bell, IdempotencyKey, TinkerUser
from .models import TinkerSampler
from .schemas import CreateSamplingSessionRequest, SampleRequest, SamplingParams

router = make_router(prefix="/api/v1", tags=["tinker"], include_in_schema=False)
MAX_SAMPLE_TOKENS = 2**17  # rows x (prompt + max_tokens) of one request, and of a batch the host samples at once


@router.post("/create_sampling_session")
def create_sampling_session(body: CreateSamplingSessionRequest, user: TinkerUser, db: SessionDep,
                            bell: Bell, settings: SettingsDep) -> dict[str, Any]:
    session = service.owned_session(db, user.id, body.session_id)
    sampler_id = f"{session.id}:sample:{body.sampling_session_seq_id}"
    if db.get(TinkerSampler, sampler_id) is not None:
        raise ApiError(400, f"sampling_session_seq_id {body.sampling_session_seq_id} is taken in this session",
                       field="sampling_session_seq_id")
    if body.model_path:
        checkpoint = service.parse_checkpoint_path(db, user.id, body.model_path)
        model = service.owned_model(db, user.id, checkpoint.model_id)
        sampler = TinkerSampler(id=sampler_id, session_id=session.id, owner_id=user.id, model_id=model.id,
                                checkpoint=checkpoint.name, base_model=model.base_model, model_path=body.model_path,
                                inflight=checkpoint.inflight)
    elif body.base_model:
        model = service.new_model(db, settings, session, sampler_id, ModelKind.sample, body.base_model, None)
        queueing.enqueue(db, model, RequestKind.create_model, {}, None)
        sampler = TinkerSampler(id=sampler_id, session_id=session.id, owner_id=user.id, model_id=model.id,
                                base_model=model.base_model)
    else:
        raise ApiError(400, "give model_path (tinker://...) or base_model", field="model_path")
    try:
        with db.begin_nested():  # a concurrent twin of this call may insert it first
            db.add(sampler)
    except IntegrityError:
        raise ApiError(400, f"sampling_session_seq_id {body.sampling_session_seq_id} is taken in this session",
                       field="sampling_session_seq_id") from None
    db.commit()
    bell.announce(service.HOSTS_KEY)
    return {"type": "create_sampling_session", "sampling_session_id": sampler.id}


@router.get("/samplers/{sampler_id}")
def get_sampler(sampler_id: str, user: TinkerUser, db: SessionDep) -> dict[str, Any]:
    sampler = service.owned_sampler(db, user.id, sampler_id)
    return {"sampler_id": sampler.id, "base_model": sampler.base_model, "model_path": sampler.model_path}


@router.post("/asample")
def asample(body: SampleRequest, user: TinkerUser, db: SessionDep, key: IdempotencyKey, bell: Bell,
            settings: SettingsDep) -> dict[str, Any]:
    if body.sampling_session_id is None:
        raise ApiError(400, "Echo2 samples through a sampling session: create_sampling_client first",
                       field="sampling_session_id")
    _refuse_unsupported(body)
    sampler = service.owned_sampler(db, user.id, body.sampling_session_id)
    model = service.sampled_model(db, user.id, sampler)
    payload = _payload(body, sampler.checkpoint, sampler.inflight)
    _check_fits(payload, model.info.get("vocab_size"), model.info.get("max_context_length"))
    row = queueing.enqueue(db, model, RequestKind.sample, payload.model_dump(mode="json"), key)
    if row.status == RequestStatus.pending and (target := fleet.fleet_job_for(db, sampler, payload, settings)):
        fleet.add_prompt(db, *target, row, payload)
    db.commit()
    bell.announce(service.HOSTS_KEY)
    ids = [f"{row.id}:{k}" for k in range(body.num_samples)]
    return {"request_id": row.id, "model_id": model.id, "sample_sequence_ids": ids}


def _check_fits(payload: SamplePayload, vocab: int | None, context: int | None) -> None:
    """Token ids inside the vocabulary: a worker drawing the request would copy an id it cannot run into its
    group and be refused (and struck) at the door. And a bound on what one request may make the host hold:
    its KV cache grows with every sample's prompt and completion, and a host that runs out of memory fails
    every model it holds, not just this one."""
    stops = payload.params.stop_tokens or []
    if vocab is not None and max([*payload.prompt, *stops]) >= vocab:
        raise ApiError(400, f"prompt and stop token ids must be below the vocabulary size {vocab}", field="prompt")
    length = len(payload.prompt) + payload.params.max_tokens
    if context is not None and length > context:
        raise ApiError(400, f"prompt ({len(payload.prompt)} tokens) + max_tokens ({payload.params.max_tokens}) is "
                            f"{length}, beyond the model's context of {context} tokens", field="sampling_params")
    if payload.num_samples * length > MAX_SAMPLE_TOKENS:
        raise ApiError(400, f"num_samples x (prompt tokens + max_tokens) is {payload.num_samples * length}, over "
                            f"{MAX_SAMPLE_TOKENS} per request: send fewer samples per request, or shorter ones",
                       field="num_samples")


def _refuse_unsupported(body: SampleRequest) -> None:
    if body.target_prompt_logprobs is not None:
        raise ApiError(400, "target_prompt_logprobs is not supported by Echo2: ask for prompt_logprobs, "
                            f"topk_prompt_logprobs (up to {MAX_TOPK}) or prompt_alt_tokens_k",
                       field="target_prompt_logprobs")
    for name in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
        if getattr(body, name) > MAX_TOPK:
            raise ApiError(400, f"{name} is at most {MAX_TOPK} on Echo2", field=name)
    if body.prompt_logprobs_last_n is not None and not (body.prompt_logprobs or body.topk_prompt_logprobs):
        raise ApiError(400, "prompt_logprobs_last_n needs prompt_logprobs (or topk_prompt_logprobs)",
                       field="prompt_logprobs_last_n")


def _payload(body: SampleRequest, checkpoint: str | None, inflight: bool) -> SamplePayload:
    try:
        prompt = body.prompt.tokens()
        last_n = body.prompt_logprobs_last_n
        if last_n is not None and not 1 <= last_n <= len(prompt) - 1:
            raise ValueError(f"prompt_logprobs_last_n must be between 1 and len(prompt) - 1 = {len(prompt) - 1}")
        return SamplePayload(checkpoint=checkpoint, prompt=prompt, num_samples=body.num_samples,
                             params=_params(body.sampling_params), prompt_logprobs=bool(body.prompt_logprobs),
                             inflight=inflight, record=bool(body.record_stability_info),
                             topk_prompt=body.topk_prompt_logprobs, topk_sample=body.topk_sample_logprobs,
                             prompt_last_n=last_n, alt_k=body.prompt_alt_tokens_k)
    except (ValueError, ValidationError) as exc:
        why = reason(exc.errors()[0]) if isinstance(exc, ValidationError) else str(exc)
        raise ApiError(400, f"asample: {why}", field="prompt") from exc


def _params(params: SamplingParams) -> SampleParams:
    """Stop as the SDK means it: None stops at EOS, strings stop there or at EOS, token ids stop at exactly
    those, and [] never stops before max_tokens."""
    stop = [params.stop] if isinstance(params.stop, str) else params.stop
    tokens = [s for s in stop or [] if isinstance(s, int)]
    strings = [s for s in stop or [] if isinstance(s, str)]
    return SampleParams(max_tokens=params.max_tokens or 128, seed=params.seed, temperature=params.temperature,
                        top_k=params.top_k, top_p=params.top_p, stop_tokens=tokens if tokens or stop == [] else None,
                        stop_strings=strings or None)
