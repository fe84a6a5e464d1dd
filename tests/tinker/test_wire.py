"""The hand-written protobuf reader refuses what the SDK could not have sent, with the reason; the writer's
output reads back. (That the SDK itself reads it is tests/tinker/test_sdk.py's part.)"""

from __future__ import annotations

import struct

import numpy as np
import pytest

from api.tinker import wire


def field(number: int, payload: bytes) -> bytes:
    return bytes([number << 3 | 2, len(payload)]) + payload


def tensor(raw: bytes, dtype: int, shape: list[int]) -> bytes:
    return field(1, raw) + bytes([3 << 3, dtype]) + field(4, bytes(shape))


def datum(*inputs: tuple[str, bytes], chunk: bytes | None = None) -> bytes:
    chunk = chunk if chunk is not None else field(1, field(1, struct.pack("<3i", 1, 2, 3)))
    return field(1, chunk) + b"".join(field(2, field(1, k.encode()) + field(2, v)) for k, v in inputs)


# One value at column 9 of a 1 x 3 tensor.
CSR = field(1, b"\x00" * 4) + field(2, struct.pack("<2q", 0, 1)) + field(3, struct.pack("<q", 9))
SPARSE_OUT_OF_RANGE = field(2, CSR) + bytes([3 << 3, 1]) + field(4, bytes([1, 3]))


def test_a_request_reads_back():
    targets = tensor(struct.pack("<3q", 2, 3, 4), 2, [3])
    weights = tensor(struct.pack("<3f", 0, 1, 1), 1, [3])
    config = field(7, field(1, b"clip_low_threshold") + field(2, b"\x09" + struct.pack("<d", 0.7)))
    raw = field(1, b"m:train:0") + field(3, datum(("target_tokens", targets), ("weights", weights))) + \
        field(4, b"ppo") + config + bytes([6 << 3, 1])
    req = wire.read_forward_backward(raw)
    assert (req.model_id, req.loss_fn, req.forward_only, req.loss_fn_config) == \
        ("m:train:0", "ppo", True, {"clip_low_threshold": 0.7})
    assert req.data[0].tokens == [1, 2, 3] and req.data[0].inputs["weights"].tolist() == [0, 1, 1]


@pytest.mark.parametrize(("raw", "reason"), [
    (b"\x0a\x05ab", "runs past the end"),
    (b"\x08\xff\xff", "varint"),
    (field(3, datum(chunk=field(2, field(1, b"png")))), "image chunks are not supported"),
    (field(3, datum(("target_tokens", tensor(struct.pack("<2q", 1, 2), 2, [3])))), "do not fill shape"),
    (field(3, datum(("weights", tensor(b"\x00" * 6, 1, [])))), "whole number"),
    (field(3, datum(("weights", SPARSE_OUT_OF_RANGE))), "sparse CSR indices"),
    (field(3, field(1, field(1, field(1, b"")))), "1 to 32768 tokens"),
])
def test_what_the_sdk_never_sends_is_refused(raw, reason):
    with pytest.raises(wire.WireError, match=reason):
        wire.read_forward_backward(raw)


def test_outputs_read_back():
    out = dict(wire.fields(wire.write_forward_backward_output([{"logprobs": [-1.0, -2.0]}, {"logprobs": [-0.5]}],
                                                              {"loss:sum": 3.5})))
    record = dict(wire.fields(out[2]))
    entry = dict(wire.fields(record[2]))
    batched = dict(wire.fields(entry[2]))
    assert np.frombuffer(batched[1], "<f4").tolist() == [-1.0, -2.0, -0.5]
    assert np.frombuffer(batched[2], "<i8").tolist() == [0, 8, 12] and record[3] == 2
    sample = wire.fields(wire.write_sample_response([{"tokens": [4, 5], "logprobs": [-0.25, -1.0],
                                                      "stop_reason": "length"}], [None, -2.0]))
    sequence = dict(wire.fields(sample[0][1]))
    assert sequence[1] == 1 and np.frombuffer(sequence[2], "<i4").tolist() == [4, 5]
    assert np.isnan(np.frombuffer(sample[1][1], "<f4")[0])


def span(kind: int, sequence_id: bytes, offset: int, length: int) -> bytes:
    """A ProvenanceSpan: 1 prompt_tokens | 2 sampled_tokens {1 sequence_id, 2 offset, 3 length}."""
    return field(kind, field(1, sequence_id) + bytes([2 << 3, offset, 3 << 3, length]))


def test_provenance_spans_read_back():
    targets = tensor(struct.pack("<3q", 2, 3, 4), 2, [3])
    spans = (field(3, span(1, b"r:0", 0, 2)) + field(3, span(2, b"r:0", 0, 1)) + field(4, span(1, b"r:0", 1, 1))
             + field(4, span(2, b"r:0", 0, 2)))
    req = wire.read_forward_backward(field(3, datum(("target_tokens", targets)) + spans) + field(4, b"ppo"))
    [d] = req.data
    assert d.input_spans == [wire.Span(False, "r:0", 0, 2), wire.Span(True, "r:0", 0, 1)]
    assert d.target_spans == [wire.Span(False, "r:0", 1, 1), wire.Span(True, "r:0", 0, 2)]
    with pytest.raises(wire.WireError, match="needs a sequence_id"):
        wire.read_forward_backward(field(3, datum(("target_tokens", targets)) + field(3, span(2, b"", 0, 1))))


def test_topk_lists_and_alternative_prompt_tokens_read_back():
    seq = {"tokens": [4], "logprobs": [-0.5], "stop_reason": "stop", "topk": [[(4, -0.5), (7, -1.5)]]}
    raw = wire.write_sample_response([seq], [None, -2.0, -1.0], [None, [(1, -0.1)], [(2, -0.2), (3, -0.3)]],
                                     ([[5, 6], [7, 8]], [[-1.0, -2.0], [-3.0, -4.0]]))
    parts = dict(wire.fields(raw))
    topk = dict(wire.fields(dict(wire.fields(parts[1]))[4]))
    assert (topk[3], topk[4]) == (2, 1)
    assert np.frombuffer(topk[1], "<i4").tolist() == [4, 7]
    prompt = dict(wire.fields(parts[3]))
    assert (prompt[3], prompt[4]) == (2, 3)
    assert np.frombuffer(prompt[1], "<i4").tolist() == [0, 0, 1, 0, 2, 3]  # a missing entry is (0, -99999)
    assert np.frombuffer(prompt[2], "<f4").tolist()[:2] == [wire.MASK_LOGPROB] * 2
    alt = dict(wire.fields(parts[6]))
    tokens = dict(wire.fields(alt[1]))
    assert np.frombuffer(tokens[1], "<i8").reshape(2, 2).tolist() == [[5, 6], [7, 8]] and tokens[3] == wire.INT64
