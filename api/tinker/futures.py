"""`retrieve_future`: the SDK polls each future until it is done. The answer waits (a long poll) until the
request finishes or LONG_POLL_S pass, since the SDK asks again at once after a `try_again`. A result
stays retrievable until ECHO2_ARCHIVE_AFTER_H after its session ends, so a client that reconnects gets it
(durable futures); after that the retention sweep deletes it, and asking answers 410.

A request that ends in this API process wakes its waiters at once (the announcer). One that ends through
another process is seen by the `Watcher`: one query every RECHECK_S for all the futures this process is
holding, not one per future (an async RL loop keeps hundreds open, and on SQLite their polls alone
saturated the API's database connection)."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any

import anyio
from echo2.protocol.tinker import CheckpointKind, ModelStatus, RequestKind, RequestStatus
from fastapi import Request, Response
from fastapi.responses import JSONResponse
from sqlalchemy import select

from ..db import Database
from ..errors import ApiError
from ..routing import make_router
from ..services.notices import RECHECK_S, Announcer
from . import service, wire
from .deps import ApiKey, user_of
from .models import TinkerModel, TinkerRequest
from .schemas import RetrieveFutureRequest

router = make_router(prefix="/api/v1", tags=["tinker"], include_in_schema=False)
log = logging.getLogger(__name__)

LONG_POLL_S = 25.0  # the SDK's retrieve_future timeout is 45 s
PROTOBUF = "application/x-protobuf"
WATCH_BATCH = 500  # ids per status query


class Watcher:
    """One per API process (app.state.tinker_watcher): wakes the long polls of futures that ended elsewhere."""

    def __init__(self, database: Database, announcer: Announcer) -> None:
        self._database, self._announcer = database, announcer
        self._waiting: Counter[str] = Counter()
        self._task: asyncio.Task[None] | None = None

    async def wait(self, request_id: str, timeout: float) -> None:
        """Until `request_id` ends (here or in another process) or `timeout` seconds pass."""
        self._waiting[request_id] += 1
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._watch())
        try:
            await self._announcer.wait(service.request_key(request_id), timeout)
        finally:
            self._waiting[request_id] -= 1
            if self._waiting[request_id] <= 0:
                del self._waiting[request_id]

    async def _watch(self) -> None:
        while self._waiting:
            await asyncio.sleep(RECHECK_S)
            try:
                ended = await anyio.to_thread.run_sync(_ended, self._database, list(self._waiting))
            except Exception:  # the database is away: the polls still end at their deadline; look again later
                log.exception("could not look up the futures being polled")
                continue
            for request_id in ended:
                self._announcer.announce(service.request_key(request_id))


def _ended(database: Database, ids: list[str]) -> list[str]:
    terminal = [s for s in RequestStatus if s.is_terminal()]
    ended: list[str] = []
    with database.session() as db:
        for start in range(0, len(ids), WATCH_BATCH):
            batch = ids[start:start + WATCH_BATCH]
            ended += db.scalars(select(TinkerRequest.id).where(TinkerRequest.id.in_(batch),
                                                               TinkerRequest.status.in_(terminal)))
    return ended


@router.post("/retrieve_future")
async def retrieve_future(body: RetrieveFutureRequest, api_key: ApiKey, request: Request) -> Response:
    state = request.app.state
    row, model = await anyio.to_thread.run_sync(_load, state.db, api_key, body.request_id)
    if not RequestStatus(row.status).is_terminal():
        await state.tinker_watcher.wait(row.id, LONG_POLL_S)
        row, model = await anyio.to_thread.run_sync(_load, state.db, api_key, body.request_id)
    return answer(row, model)


def _load(database: Database, api_key: str, request_id: str) -> tuple[TinkerRequest, TinkerModel]:
    with database.session() as db:
        user = user_of(db, api_key)
        row = db.get(TinkerRequest, request_id)
        if row is None or row.owner_id != user.id:
            raise ApiError(404, f"future {request_id} not found", field="request_id")
        model = db.get(TinkerModel, row.model_id)
        assert model is not None
        return row, model


def answer(row: TinkerRequest, model: TinkerModel) -> Response:
    if row.status == RequestStatus.failed:
        return JSONResponse({"error": row.error or "failed", "category": row.category or "server"})
    if row.status != RequestStatus.done:
        return JSONResponse(_try_again(row, model))
    if row.result is None:  # api/tinker/service.py drop_results
        raise ApiError(410, f"the result of future {row.id} is no longer kept: results stay retrievable for "
                       "ECHO2_ARCHIVE_AFTER_H hours after their session ends", field="request_id")
    result = row.result
    kind = RequestKind(row.kind)
    if kind in (RequestKind.forward, RequestKind.forward_backward):
        out = result["forward_backward"]
        return Response(wire.write_forward_backward_output(out["outputs"], out["metrics"]), media_type=PROTOBUF)
    if kind is RequestKind.sample:
        sample = result["sample"]
        alt = (sample["alt_tokens"], sample["alt_logprobs"]) if sample.get("alt_tokens") is not None else None
        return Response(wire.write_sample_response(sample["sequences"], sample.get("prompt_logprobs"),
                                                   sample.get("topk_prompt"), alt), media_type=PROTOBUF)
    return JSONResponse(_json_result(kind, row, result))


def _json_result(kind: RequestKind, row: TinkerRequest, result: dict[str, Any]) -> dict[str, Any]:
    if kind is RequestKind.create_model and row.payload.get("load"):  # create_training_client_from_state
        return {"type": "load_weights", "model_id": row.model_id, "path": _state_path(row.payload["load"])}
    if kind is RequestKind.create_model:
        return {"type": "create_model", "model_id": row.model_id}
    if kind is RequestKind.load_weights:
        return {"type": "load_weights", "model_id": row.model_id, "path": _state_path(row.payload)}
    if kind is RequestKind.optim_step:
        return {"metrics": result.get("metrics") or {}}
    if kind is RequestKind.save_weights_for_sampler and row.payload.get("sampler_id"):
        return {"type": "save_weights_for_sampler", "sampling_session_id": row.payload["sampler_id"]}
    what = CheckpointKind.sampler if kind is RequestKind.save_weights_for_sampler else CheckpointKind.training
    return {"type": kind.value, "path": service.checkpoint_path(row.model_id, what, row.payload["name"])}


def _state_path(load: dict[str, Any]) -> str:
    return service.checkpoint_path(load["model_id"], CheckpointKind.training, load["name"])


def _try_again(row: TinkerRequest, model: TinkerModel) -> dict[str, Any]:
    if row.status == RequestStatus.fleet:
        return {"type": "try_again", "request_id": row.id, "queue_state": "active",
                "queue_state_reason": "a rollout worker is drawing these samples"}
    if model.host is None and model.status == ModelStatus.pending:
        return {"type": "try_again", "request_id": row.id, "queue_state": "paused_capacity",
                "queue_state_reason": "waiting for a Tinker learner host to load this model"}
    if model.status == ModelStatus.parked:
        return {"type": "try_again", "request_id": row.id, "queue_state": "paused_capacity",
                "queue_state_reason": f"waiting for a slot on learner host {model.host} (this model was parked "
                                      "there, or loads a state saved there)"}
    return {"type": "try_again", "request_id": row.id, "queue_state": "active"}
