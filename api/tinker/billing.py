"""The SDK's usage and billing calls (AdminClient), answered from Echo2's Tinker ledger (api/tinker/usage.py).

Echo2 bills a learner host's compute time at its price, not tokens, so each hourly bucket of
`get_billing_usage` sums the ledger's entries of that hour, by session, base model and kind:
- `training`: the tokens of forward and forward_backward; its cost is the compute of every request that is
  neither sampling nor a save (forward, forward_backward, optim_step, loading a model or a state);
- `sampling_prefill` (never `cached`: Echo2 prefills every prompt) and `sampling_sample`: a sample
  request's prompt tokens and sampled tokens, its cost split between the two by token count;
- `checkpoint`: the saves (save_state, save_weights_for_sampler), their compute as their cost.
Samples drawn by rollout workers are not in this ledger: the fleet job's ledger pays their workers
(`GET /v1/jobs/{id}/ledger`). `get_current_checkpoint_storage_usage` sums the states the control plane stores.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

from echo2.protocol.tinker import RequestKind
from fastapi import Query
from sqlalchemy import func, select

from ..deps import SessionDep
from ..errors import ApiError
from ..routing import make_router
from .deps import TinkerUser
from .models import TinkerCheckpoint, TinkerModel, TinkerSession
from .models import TinkerUsage as UsageRow

router = make_router(prefix="/api/v1/billing/usage", tags=["tinker"], include_in_schema=False)
MAX_WINDOW = timedelta(days=14)
TRAINING_KINDS = (RequestKind.forward, RequestKind.forward_backward, RequestKind.optim_step, RequestKind.create_model,
                  RequestKind.load_weights)
SAVES = (RequestKind.save_weights, RequestKind.save_weights_for_sampler)


@router.get("/events")
def usage_events(user: TinkerUser, db: SessionDep, starting_on: Annotated[datetime, Query()],
                 ending_before: Annotated[datetime, Query()]) -> dict[str, Any]:
    start, end = _bound(starting_on, "starting_on"), _bound(ending_before, "ending_before")
    if start.minute or start.second or start.microsecond or end.minute or end.second or end.microsecond:
        raise ApiError(400, "starting_on and ending_before must be on UTC hour boundaries", field="starting_on")
    if not (start < end and end - start <= MAX_WINDOW):  # no sum: start + 14 days may be past year 9999
        raise ApiError(400, "ending_before must be after starting_on, and at most 14 days after it",
                       field="ending_before")
    rows = db.execute(select(UsageRow, TinkerModel.base_model)
                      .outerjoin(TinkerModel, TinkerModel.id == UsageRow.model_id)
                      .where(UsageRow.owner_id == user.id, UsageRow.created_at >= start, UsageRow.created_at < end)
                      .order_by(UsageRow.created_at)).all()
    buckets: dict[tuple, dict[str, float]] = defaultdict(lambda: {"tokens": 0.0, "usd": 0.0, "count": 0.0})
    for row, base_model in rows:
        hour = _utc(row.created_at).replace(minute=0, second=0, microsecond=0)
        for kind, tokens, usd in _events(row):
            bucket = buckets[(hour, row.session_id, base_model, kind)]
            bucket["tokens"] += tokens
            bucket["usd"] += usd
            bucket["count"] += 1
    data = [_event(key, value) for key, value in sorted(buckets.items(), key=lambda kv: (kv[0][0], -kv[1]["tokens"]))]
    return {"data": data, "sessions": {e["session_id"]: {"user_metadata": None} for e in data},
            "cost_data_through": None}


def _events(row: UsageRow) -> list[tuple[str, int, float]]:
    if row.kind is RequestKind.sample:
        sampled = max(row.tokens - row.prompt_tokens, 0)
        share = row.amount_usd / row.tokens if row.tokens else 0.0
        return [("sampling_prefill", row.prompt_tokens, share * row.prompt_tokens),
                ("sampling_sample", sampled, row.amount_usd - share * row.prompt_tokens)]
    if row.kind in SAVES:
        return [("checkpoint", 0, row.amount_usd)]
    if row.kind in TRAINING_KINDS:
        return [("training", row.tokens, row.amount_usd)]
    return []


def _event(key: tuple, value: dict[str, float]) -> dict[str, Any]:
    hour, session_id, base_model, kind = key
    tokens, usd = int(value["tokens"]), value["usd"]
    if kind == "checkpoint":
        info: dict[str, Any] = {"type": "checkpoint", "count": int(value["count"])}
    elif kind == "sampling_prefill":
        info = {"type": "sampling_prefill", "cached": False, "token_count": tokens}
    else:
        info = {"type": kind, "token_count": tokens}
    rate = usd / tokens * 1e6 if tokens and kind != "checkpoint" else None
    return {"bucket_start": hour.isoformat(), "bucket_end": (hour + timedelta(hours=1)).isoformat(),
            "base_model": base_model, "session_id": session_id, "estimated_cost_usd": usd,
            "effective_rate_usd_per_million_tokens": rate, "event_info": info}


@router.get("/checkpoints/current")
def storage_now(user: TinkerUser, db: SessionDep) -> dict[str, Any]:
    """The states the control plane stores for this user (a file shared by copies is counted once)."""
    digests = db.execute(select(TinkerCheckpoint.sha256, func.max(TinkerCheckpoint.size_bytes))
                         .join(TinkerModel, TinkerModel.id == TinkerCheckpoint.model_id)
                         .join(TinkerSession, TinkerSession.id == TinkerModel.session_id)
                         .where(TinkerModel.owner_id == user.id, TinkerCheckpoint.sha256.is_not(None))
                         .group_by(TinkerCheckpoint.sha256)).all()
    count = db.scalar(select(func.count()).select_from(TinkerCheckpoint)
                      .join(TinkerModel, TinkerModel.id == TinkerCheckpoint.model_id)
                      .where(TinkerModel.owner_id == user.id)) or 0
    size = sum(int(n or 0) for _, n in digests)
    return {"effective_rate_usd_per_gigabyte_month": None,
            "data": [{"project_id": None, "org_user_urn": user.id, "user_email": None, "user_name": user.name,
                      "checkpoint_count": count, "size_bytes": size, "size_gigabytes": size / 1e9,
                      "estimated_monthly_cost_usd": None}]}


def _utc(moment: datetime) -> datetime:
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def _bound(moment: datetime, field: str) -> datetime:
    try:
        return _utc(moment)
    except OverflowError:  # e.g. 0001-01-01T00:00+01:00, before the first representable instant
        raise ApiError(400, f"{field} is out of range", field=field) from None
