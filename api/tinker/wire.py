"""The protobuf messages of the Tinker SDK (`tinker_public` in tinker 0.38), read and written by hand.

The SDK sends `forward_backward` as a protobuf `ForwardBackwardRequest` and insists on protobuf for two
results: `ForwardBackwardOutput` and `SampleResponse`. Those three messages are all the control plane
needs, so it speaks the wire format itself (varints, length-delimited fields, little-endian numbers)
rather than carrying the SDK's generated module. Field numbers are the SDK's, listed beside each reader.

Untrusted input has bounds: a malformed message, an unsupported chunk (images, audio) or a tensor
whose bytes do not match its shape raise `WireError`, which the route answers as a 400.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field

import numpy as np

MAX_DATUMS = 4096
MAX_TOKENS = 32_768  # per datum

DTYPES = {1: np.dtype("<f4"), 2: np.dtype("<i8"), 3: np.dtype("<i4")}  # DType enum; bf16 (4) is never sent
FLOAT32, INT64 = 1, 2
STOP_REASONS = {"stop": 0, "length": 1}


class WireError(ValueError):
    """The body is not a message the SDK could have sent."""


# ---- reading ----------------------------------------------------------------------------------------


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise WireError("truncated or overlong varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def fields(buf: bytes) -> list[tuple[int, int | bytes]]:
    """(field number, value) pairs: an int for varints, bytes for the rest (fixed-width ones raw)."""
    out: list[tuple[int, int | bytes]] = []
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, kind = key >> 3, key & 7
        if kind == 0:
            value, pos = _varint(buf, pos)
            out.append((number, value))
            continue
        size = {1: 8, 5: 4}.get(kind)
        if kind == 2:
            size, pos = _varint(buf, pos)
        if size is None or pos + size > len(buf):
            raise WireError(f"field {number}: wire type {kind} is unsupported or runs past the end")
        out.append((number, buf[pos:pos + size]))
        pos += size
    return out


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _packed_ints(values: list[int | bytes]) -> list[int]:
    out: list[int] = []
    for value in values:
        if isinstance(value, int):
            out.append(_signed(value))
            continue
        pos = 0
        while pos < len(value):
            item, pos = _varint(value, pos)
            out.append(_signed(item))
    return out


def _bytes(value: int | bytes, what: str) -> bytes:
    if not isinstance(value, bytes):
        raise WireError(f"{what} must be length-delimited")
    return value


def _text(value: int | bytes, what: str) -> str:
    try:
        return _bytes(value, what).decode()
    except UnicodeDecodeError as exc:
        raise WireError(f"{what} is not UTF-8") from exc


def _map_entry(raw: int | bytes, what: str) -> tuple[str, int | bytes | None]:
    key, value = "", None
    for number, item in fields(_bytes(raw, what)):
        if number == 1:
            key = _text(item, f"{what} key")
        elif number == 2:
            value = item
    return key, value


def _array(raw: bytes, dtype_code: int, what: str) -> np.ndarray:
    dtype = DTYPES.get(dtype_code)
    if dtype is None:
        raise WireError(f"{what}: dtype {dtype_code} is not float32, int64 or int32")
    if len(raw) % dtype.itemsize:
        raise WireError(f"{what}: {len(raw)} bytes is not a whole number of {dtype} values")
    return np.frombuffer(raw, dtype=dtype)


def read_tensor(raw: bytes, what: str) -> np.ndarray:
    """A `Tensor` (1 dense | 2 sparse_csr {1 values, 2 crow_indices, 3 col_indices}; 3 dtype; 4 shape)."""
    dense = csr = None
    dtype, shape_parts = 0, []
    for number, value in fields(raw):
        if number == 1:
            dense = _bytes(value, what)
        elif number == 2:
            csr = _bytes(value, what)
        elif number == 3 and isinstance(value, int):
            dtype = value
        elif number == 4:
            shape_parts.append(value)
    shape = _packed_ints(shape_parts)
    # math.prod, not np.prod: Python ints do not wrap round (np.prod of [2**32, 2**32] is 0).
    if len(shape) > 8 or any(n < 0 for n in shape) or math.prod(shape or [0]) > MAX_TOKENS * 64:
        raise WireError(f"{what}: shape {shape} is out of bounds")
    if csr is not None:
        return _densify(csr, dtype, shape, what)
    values = _array(dense or b"", dtype, what)
    if shape and math.prod(shape) != values.size:
        raise WireError(f"{what}: {values.size} values do not fill shape {shape}")
    return values.reshape(shape) if shape else values


def _densify(raw: bytes, dtype: int, shape: list[int], what: str) -> np.ndarray:
    parts = dict(fields(raw))
    values = _array(_bytes(parts.get(1, b""), what), dtype, what)
    crow = _array(_bytes(parts.get(2, b""), what), INT64, what)
    col = _array(_bytes(parts.get(3, b""), what), INT64, what)
    if (len(shape) != 2 or len(crow) != shape[0] + 1 or len(col) != len(values)
            or (len(crow) and (crow[0] != 0 or crow[-1] != len(col)))):
        raise WireError(f"{what}: sparse CSR indices do not match shape {shape}")
    if len(col) and (col.min() < 0 or col.max() >= shape[1]) or np.any(np.diff(crow) < 0):
        raise WireError(f"{what}: sparse CSR indices out of range")
    out = np.zeros(shape, dtype=values.dtype)
    rows = np.repeat(np.arange(shape[0]), np.diff(crow))
    out[rows, col] = values
    return out


@dataclass(frozen=True)
class Span:
    """A provenance span (tinker.types.PromptProvenanceSpan / SampledProvenanceSpan): `length` positions of the
    field it annotates are positions [offset, offset + length) of the named sequence's prompt or sampled tokens."""

    sampled: bool
    sequence_id: str
    offset: int
    length: int


@dataclass
class Datum:
    tokens: list[int]
    inputs: dict[str, np.ndarray] = field(default_factory=dict)
    input_spans: list[Span] | None = None  # model_input_spans
    target_spans: list[Span] | None = None  # loss_fn_input_spans


@dataclass
class ForwardBackwardRequest:
    model_id: str = ""
    seq_id: int = 0
    loss_fn: str = ""
    loss_fn_config: dict[str, float | str] = field(default_factory=dict)
    forward_only: bool = False
    data: list[Datum] = field(default_factory=list)


def _read_tokens(raw: bytes, what: str) -> list[int]:
    tokens: list[int] = []
    for number, value in fields(raw):
        if number != 1:
            kind = {2: "image", 3: "audio (dmel)"}.get(number, f"field {number}")
            raise WireError(f"{what}: {kind} chunks are not supported by Echo2; send encoded text (token ids)")
        for inner, data in fields(_bytes(value, what)):
            if inner == 1:
                tokens.extend(_array(_bytes(data, what), 3, what).tolist())
    return tokens


def read_span(raw: bytes, what: str) -> Span:
    """`ProvenanceSpan`: 1 prompt_tokens | 2 sampled_tokens, each {1 sequence_id, 2 offset, 3 length}."""
    parts = fields(raw)
    if len(parts) != 1 or parts[0][0] not in (1, 2):
        raise WireError(f"{what}: a provenance span is one prompt or one sampled span")
    number, body = parts[0]
    sequence_id, offset, length = "", 0, 0
    for inner, value in fields(_bytes(body, what)):
        if inner == 1:
            sequence_id = _text(value, what)[:128]
        elif inner == 2 and isinstance(value, int):
            offset = _signed(value)
        elif inner == 3 and isinstance(value, int):
            length = _signed(value)
    if not sequence_id or not 0 <= offset <= MAX_TOKENS or not 0 <= length <= MAX_TOKENS:
        raise WireError(f"{what}: a span needs a sequence_id, and an offset and length within 0..{MAX_TOKENS}")
    return Span(sampled=number == 2, sequence_id=sequence_id, offset=offset, length=length)


def read_datum(raw: bytes, index: int) -> Datum:
    """`Datum`: 1 model_input (repeated Chunk), 2 loss_fn_inputs (map<string, Tensor>), 3 model_input_spans and
    4 loss_fn_input_spans (repeated ProvenanceSpan, both or neither)."""
    what = f"data[{index}]"
    tokens: list[int] = []
    inputs: dict[str, np.ndarray] = {}
    spans: dict[int, list[Span]] = {}
    for number, value in fields(raw):
        if number == 1:
            tokens.extend(_read_tokens(_bytes(value, what), f"{what}.model_input"))
        elif number == 2:
            key, tensor = _map_entry(value, f"{what}.loss_fn_inputs")
            inputs[key] = read_tensor(_bytes(tensor or b"", what), f"{what}.loss_fn_inputs.{key}")
        elif number in (3, 4):
            found = spans.setdefault(number, [])
            if len(found) >= MAX_TOKENS:
                raise WireError(f"{what}: more provenance spans than tokens")
            found.append(read_span(_bytes(value, what), f"{what}.spans"))
    if not tokens or len(tokens) > MAX_TOKENS:
        raise WireError(f"{what}: model_input must hold 1 to {MAX_TOKENS} tokens, not {len(tokens)}")
    return Datum(tokens=tokens, inputs=inputs, input_spans=spans.get(3), target_spans=spans.get(4))


def _double(raw: int | bytes, what: str) -> float:
    value = _bytes(raw, what)
    if len(value) != 8:
        raise WireError(f"{what}: a number must be a double (8 bytes), not {len(value)} bytes")
    return struct.unpack("<d", value)[0]


def _config_value(raw: int | bytes) -> float | str:
    for number, value in fields(_bytes(raw, "loss_fn_config_v2")):
        if number == 1:
            return _double(value, "loss_fn_config_v2")
        if number == 2:
            return _text(value, "loss_fn_config_v2")
    raise WireError("loss_fn_config_v2: a value is neither a number nor a text")


def read_forward_backward(raw: bytes) -> ForwardBackwardRequest:
    """`ForwardBackwardRequest`: 1 model_id, 2 seq_id, 3 data, 4 loss_fn, 5 loss_fn_config (map<string,
    double>), 6 forward_only, 7 loss_fn_config_v2 (map<string, {1 number | 2 text}>, preferred when set)."""
    req = ForwardBackwardRequest()
    legacy: dict[str, float | str] = {}
    for number, value in fields(raw):
        if number == 1:
            req.model_id = _text(value, "model_id")[:256]
        elif number == 2 and isinstance(value, int):
            req.seq_id = _signed(value)
        elif number == 3:
            if len(req.data) >= MAX_DATUMS:
                raise WireError(f"at most {MAX_DATUMS} datums per request")
            req.data.append(read_datum(_bytes(value, "data"), len(req.data)))
        elif number == 4:
            req.loss_fn = _text(value, "loss_fn")[:64]
        elif number == 5:
            key, item = _map_entry(value, "loss_fn_config")
            legacy[key] = _double(item or bytes(8), "loss_fn_config")
        elif number == 6 and isinstance(value, int):
            req.forward_only = bool(value)
        elif number == 7:
            key, item = _map_entry(value, "loss_fn_config_v2")
            req.loss_fn_config[key] = _config_value(item or b"")
    req.loss_fn_config = req.loss_fn_config or legacy
    return req


# ---- writing ----------------------------------------------------------------------------------------


def _encode_varint(value: int) -> bytes:
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _key(number: int, kind: int) -> bytes:
    return _encode_varint(number << 3 | kind)


def _len_field(number: int, payload: bytes) -> bytes:
    return _key(number, 2) + _encode_varint(len(payload)) + payload


def _int_field(number: int, value: int) -> bytes:
    return _key(number, 0) + _encode_varint(value) if value else b""


def _double_entry(key: str, value: float) -> bytes:
    return _len_field(1, key.encode()) + _key(2, 1) + struct.pack("<d", value)


def write_forward_backward_output(outputs: list[dict[str, list[float]]], metrics: dict[str, float]) -> bytes:
    """`ForwardBackwardOutput`: 1 loss_fn_output_type, 2 loss_fn_outputs (one `ArrayRecord` holding every
    datum: 1 type_tag, 2 fields map<string, BatchedTensor{1 data, 2 offsets, 3 dtype, 4 trailing_shape}>,
    3 num_datums), 3 metrics (map<string, double>). Every field is float32, one value per token."""
    names = sorted({name for out in outputs for name in out})
    record = _len_field(1, b"ArrayRecord")
    for name in names:
        arrays = [np.asarray(out.get(name, []), dtype="<f4") for out in outputs]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype("<i8")
        batched = (_len_field(1, b"".join(a.tobytes() for a in arrays)) + _len_field(2, offsets.tobytes())
                   + _int_field(3, FLOAT32))
        record += _len_field(2, _len_field(1, name.encode()) + _len_field(2, batched))
    record += _int_field(3, len(outputs))
    body = _len_field(1, b"ArrayRecord") + _len_field(2, record)
    for key, value in sorted(metrics.items()):
        body += _len_field(3, _double_entry(key, float(value)))
    return body


MASK_LOGPROB = -99999.0  # tinker.types.topk_logprobs: the filler of a position with fewer than k (or no) entries


def _topk(rows: list[list[tuple[int, float]] | None]) -> bytes:
    """`TopkLogprobs`: 1 token_ids int32 [n, k], 2 logprobs float32 [n, k], 3 k, 4 length; positions with
    nothing (None) or fewer than k entries are filled with (0, MASK_LOGPROB)."""
    k = max((len(r) for r in rows if r), default=0)
    ids = np.zeros((len(rows), k), dtype="<i4")
    lps = np.full((len(rows), k), MASK_LOGPROB, dtype="<f4")
    for i, row in enumerate(rows):
        for j, (token, logprob) in enumerate(row or []):
            ids[i, j], lps[i, j] = token, logprob
    return (_len_field(1, ids.tobytes()) + _len_field(2, lps.tobytes()) + _int_field(3, k)
            + _int_field(4, len(rows)))


def _tensor(values: np.ndarray, dtype: int) -> bytes:
    """`Tensor`: 1 dense, 3 dtype, 4 shape (packed)."""
    shape = b"".join(_encode_varint(n) for n in values.shape)
    return _len_field(1, values.tobytes()) + _int_field(3, dtype) + _len_field(4, shape)


def write_sample_response(sequences: list[dict], prompt_logprobs: list[float | None] | None,
                          topk_prompt: list[list[tuple[int, float]] | None] | None = None,
                          alt: tuple[list[list[int]], list[list[float]]] | None = None) -> bytes:
    """`SampleResponse`: 1 sequences (`SampledSequence`: 1 stop_reason, 2 tokens int32, 3 logprobs float32,
    4 topk_sampled_logprobs), 2 prompt_logprobs (float32, NaN where there is none: the first position),
    3 topk_prompt_logprobs, 6 prompt_alt_tokens (`PromptAltTokens`: 1 tokens int64, 2 logprobs float32, both
    [len(prompt) - 1, k])."""
    body = b""
    for seq in sequences:
        tokens = np.asarray(seq["tokens"], dtype="<i4").tobytes()
        logprobs = np.asarray(seq["logprobs"], dtype="<f4").tobytes()
        topk = _len_field(4, _topk(seq["topk"])) if seq.get("topk") is not None else b""
        body += _len_field(1, _int_field(1, STOP_REASONS[seq["stop_reason"]]) + _len_field(2, tokens)
                           + _len_field(3, logprobs) + topk)
    if prompt_logprobs is not None:
        values = np.asarray([np.nan if v is None else v for v in prompt_logprobs], dtype="<f4")
        body += _len_field(2, values.tobytes())
    if topk_prompt is not None:
        body += _len_field(3, _topk(topk_prompt))
    if alt is not None:
        ids, lps = alt
        k = len(ids[0]) if ids else 0
        body += _len_field(6, _len_field(1, _tensor(np.asarray(ids, dtype="<i8").reshape(len(ids), k), INT64))
                           + _len_field(2, _tensor(np.asarray(lps, dtype="<f4").reshape(len(lps), k), FLOAT32)))
    return body
