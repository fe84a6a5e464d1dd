"""The JSON bodies the Tinker SDK (0.38) sends and expects, as it declares them in `tinker.types`.

Incoming models ignore fields they do not know (a newer SDK adds some; the SDK is the contract here,
not us), but bound every one they read.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from echo2.protocol.common import Finite, NoNul
from echo2.protocol.tinker import TinkerLora
from pydantic import BaseModel, ConfigDict, Field, StringConstraints

Str = Annotated[str, StringConstraints(max_length=512), NoNul]
IdStr = Annotated[str, StringConstraints(min_length=1, max_length=128), NoNul]
SeqId = Annotated[int, Field(ge=0, lt=2**62)]
Float = Annotated[float, Finite]


class SdkBody(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, protected_namespaces=())


class ClientConfigRequest(SdkBody):
    sdk_version: Str = ""


class CreateSessionRequest(SdkBody):
    tags: list[Annotated[str, StringConstraints(max_length=128), NoNul]] = Field(default_factory=list, max_length=64)
    sdk_version: Str = ""
    project_id: Str | None = None
    display_name: Str | None = None


class SessionRef(SdkBody):
    session_id: IdStr


class FinishSession(SdkBody):
    reason: dict[str, Str] = Field(default_factory=dict, max_length=4)
    detail: Str | None = None


class CreateModelRequest(SdkBody):
    session_id: IdStr
    model_seq_id: SeqId
    base_model: Str
    lora_config: TinkerLora | None = None
    optimizer_config: dict[str, Any] = Field(default_factory=lambda: {"type": "adamw"}, max_length=8)


class ModelRef(SdkBody):
    model_id: IdStr


class AdamParams(SdkBody):
    learning_rate: Float = 1e-4
    beta1: Float = 0.9
    beta2: Float = 0.95
    eps: Float = 1e-12
    weight_decay: Float = 0.0
    grad_clip_norm: Float = 0.0


class OptimStepRequest(SdkBody):
    model_id: IdStr
    seq_id: SeqId | None = None
    adam_params: AdamParams | None = None
    optimizer_params: dict[str, Any] | None = Field(None, max_length=16)


class SaveWeightsRequest(SdkBody):
    model_id: IdStr
    path: Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.\-]+$")] | None = None
    seq_id: SeqId | None = None
    sampling_session_seq_id: SeqId | None = None
    kind: Literal["snapshot", "inflight"] = "snapshot"
    ttl_seconds: int | None = None


class LoadWeightsRequest(SdkBody):
    """create_training_client_from_state[_with_optimizer] gives session_id and model_seq_id (a new model);
    the older load_state gives model_id (an existing one)."""

    path: Str
    optimizer: bool = False
    model_id: IdStr | None = None
    seq_id: SeqId | None = None
    session_id: IdStr | None = None
    model_seq_id: SeqId | None = None
    base_model: Str | None = None
    optimizer_config: dict[str, Any] | None = Field(None, max_length=8)


class CreateSamplingSessionRequest(SdkBody):
    session_id: IdStr
    sampling_session_seq_id: SeqId
    base_model: Str | None = None
    model_path: Str | None = None


class EncodedText(SdkBody):
    type: Literal["encoded_text"] = "encoded_text"
    tokens: list[Annotated[int, Field(ge=0, lt=2**31)]] = Field(max_length=32_768)


class ModelInput(SdkBody):
    chunks: list[dict[str, Any]] = Field(min_length=1, max_length=256)

    def tokens(self) -> list[int]:
        """The prompt's token ids; chunks other than encoded text are refused (images, audio)."""
        out: list[int] = []
        for chunk in self.chunks:
            if chunk.get("type", "encoded_text") != "encoded_text":
                raise ValueError(f"{chunk.get('type')} chunks are not supported by Echo2; send token ids")
            out.extend(EncodedText.model_validate(chunk).tokens)
        return out


class SamplingParams(SdkBody):
    max_tokens: Annotated[int, Field(ge=1, le=32_768)] | None = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    stop: str | list[Annotated[str, StringConstraints(max_length=256)]] | list[int] | None = None
    temperature: Annotated[float, Field(ge=0, le=100)] = 1.0
    top_k: Annotated[int, Field(ge=-1, le=1_000_000)] = -1
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0


class SampleRequest(SdkBody):
    num_samples: Annotated[int, Field(ge=1, le=128)] = 1
    prompt: ModelInput
    sampling_params: SamplingParams
    sampling_session_id: IdStr | None = None
    base_model: Str | None = None
    model_path: Str | None = None
    seq_id: SeqId | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: Annotated[int, Field(ge=0, le=1024)] = 0
    topk_sample_logprobs: Annotated[int, Field(ge=0, le=1024)] = 0
    prompt_alt_tokens_k: Annotated[int, Field(ge=0, le=1024)] = 0
    target_prompt_logprobs: dict[str, Any] | None = None
    prompt_logprobs_last_n: Annotated[int, Field(ge=1, le=2**31)] | None = None
    record_stability_info: bool | None = None


class CopyWeightsRequest(SdkBody):
    source_path: Str
    session_id: IdStr | None = None
    model_seq_id: SeqId | None = None
    destination_project_id: Str | None = None
    ttl_seconds: int | None = None


class WeightsInfoRequest(SdkBody):
    tinker_path: Str


class TtlRequest(SdkBody):
    ttl_seconds: int | None = None


class RetrieveFutureRequest(SdkBody):
    request_id: IdStr
    allow_metadata_only: bool = False
