"""Which checkpoint drew which tokens of a sampled sequence: Echo2's own route beside the Tinker API.

The SDK's `SampledSequence` has no field for it (its `SamplingClientKind` docs: "Responses do not identify
which saved weights produced each token"), so the SDK's answer carries the tokens, their logprobs and the
`sequence_id`, and this route answers for that id: the checkpoint runs (an in-flight sample may span
several), who drew it (a rollout worker of the fleet, or the learner host), and, for a sequence recorded with
record_stability_info, until when stable_reinforce can train on it.

    GET /v1/tinker/sequences/{sequence_id}      (Authorization: Bearer e2u_..., or X-API-Key: tml-e2u_...)
"""

from __future__ import annotations

from typing import Any

from echo2.protocol.tinker import CheckpointKind, RequestKind

from ..deps import SessionDep
from ..errors import ApiError
from ..routing import make_router
from . import service
from .deps import TinkerUser
from .models import TinkerRequest, TinkerSequence

router = make_router(prefix="/v1/tinker/sequences", tags=["tinker"], include_in_schema=False)


@router.get("/{sequence_id}")
def sequence(sequence_id: str, user: TinkerUser, db: SessionDep) -> dict[str, Any]:
    request_id, _, k = sequence_id.rpartition(":")
    request = db.get(TinkerRequest, request_id)
    # ASCII digits only, and few: str.isdigit() also takes '²' and 5,000 digits, which int() refuses (a 500).
    index = int(k) if k.isascii() and k.isdigit() and len(k) <= 6 else None
    if request is None or request.owner_id != user.id or index is None or request.kind is not RequestKind.sample:
        raise ApiError(404, f"sequence {sequence_id} not found", field="sequence_id")
    record = db.get(TinkerSequence, sequence_id)
    sequences = ((request.result or {}).get("sample") or {}).get("sequences") or []
    if index >= len(sequences):
        raise ApiError(404, f"sequence {sequence_id} is not drawn yet (its request is {request.status})",
                       field="sequence_id")
    seq = sequences[index]
    runs = seq.get("checkpoints") or (record.checkpoints if record is not None else None)
    return {"sequence_id": sequence_id, "model_id": request.model_id, "tokens": seq["tokens"],
            "logprobs": seq["logprobs"], "stop_reason": seq["stop_reason"],
            "checkpoints": [{"checkpoint": name, "tokens": n,
                             "tinker_path": service.checkpoint_path(request.model_id, CheckpointKind.sampler, name)}
                            for name, n in runs] if runs else None,
            "drawn_by": f"worker {request.result['worker']}" if request.result and request.result.get("worker")
            else "learner host",
            "recorded_until": record.expires_at.isoformat() if record is not None else None}
