"""The hand-written remote write encoding (cloud_gateway.remote_write.prompb): byte-exact,
byte-identical to what the ``protobuf`` package serialises, snappy block, splitting.

The reference messages are built the way generated ``remote_pb2`` code builds them at
import: a ``FileDescriptorProto`` (field numbers and types as prometheus/prompb
``types.proto`` and ``remote.proto``) added to a pool, classes from
``message_factory.GetMessageClass``. There is no protoc here, and none is needed.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import cramjam
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from hypothesis import given, settings
from hypothesis import strategies as st

from cloud_gateway.remote_write.prompb import (
    Series,
    encode_requests,
    encode_write_request,
    snappy_compress,
    split_series,
)
from gpurelay.model import Labels

# ---------------------------------------------------------------- protobuf's own classes

_F = descriptor_pb2.FieldDescriptorProto
_ONE, _MANY = _F.LABEL_OPTIONAL, _F.LABEL_REPEATED


def _prompb_file() -> descriptor_pb2.FileDescriptorProto:
    """prometheus/prompb types.proto and remote.proto, the parts remote write 1.0 uses
    (``Histogram``, TimeSeries field 4, is left out: the gateway sends none)."""
    file = descriptor_pb2.FileDescriptorProto(
        name="prometheus/remote.proto", package="prometheus", syntax="proto3"
    )

    def message(name: str, *fields: tuple[str, int, int, Any, str]) -> None:
        msg = file.message_type.add(name=name)
        for field_name, number, label, kind, type_name in fields:
            field = msg.field.add(name=field_name, number=number, label=label, type=kind)
            if type_name:
                field.type_name = type_name

    message("Label", ("name", 1, _ONE, _F.TYPE_STRING, ""), ("value", 2, _ONE, _F.TYPE_STRING, ""))
    message(
        "Sample", ("value", 1, _ONE, _F.TYPE_DOUBLE, ""), ("timestamp", 2, _ONE, _F.TYPE_INT64, "")
    )
    message(
        "Exemplar",
        ("labels", 1, _MANY, _F.TYPE_MESSAGE, ".prometheus.Label"),
        ("value", 2, _ONE, _F.TYPE_DOUBLE, ""),
        ("timestamp", 3, _ONE, _F.TYPE_INT64, ""),
    )
    message(
        "TimeSeries",
        ("labels", 1, _MANY, _F.TYPE_MESSAGE, ".prometheus.Label"),
        ("samples", 2, _MANY, _F.TYPE_MESSAGE, ".prometheus.Sample"),
        ("exemplars", 3, _MANY, _F.TYPE_MESSAGE, ".prometheus.Exemplar"),
    )
    message(
        "MetricMetadata",
        ("type", 1, _ONE, _F.TYPE_INT32, ""),  # an enum in types.proto: same wire type
        ("metric_family_name", 2, _ONE, _F.TYPE_STRING, ""),
        ("help", 4, _ONE, _F.TYPE_STRING, ""),
        ("unit", 5, _ONE, _F.TYPE_STRING, ""),
    )
    message(
        "WriteRequest",
        ("timeseries", 1, _MANY, _F.TYPE_MESSAGE, ".prometheus.TimeSeries"),
        ("metadata", 3, _MANY, _F.TYPE_MESSAGE, ".prometheus.MetricMetadata"),
    )
    return file


_pool = descriptor_pool.DescriptorPool()
_pool.Add(_prompb_file())
WriteRequest: Any = message_factory.GetMessageClass(
    _pool.FindMessageTypeByName("prometheus.WriteRequest")
)


def reference(series: list[Series]) -> Any:
    """The WriteRequest remote write 1.0 wants for ``series``, built with protobuf: labels
    sorted by name without empty values, samples in timestamp order."""
    request = WriteRequest()
    for labels, samples in series:
        ts = request.timeseries.add()
        for name, label_value in sorted((kv for kv in labels if kv[1]), key=lambda kv: kv[0]):
            ts.labels.add(name=name, value=label_value)
        for timestamp, value in sorted(samples, key=lambda s: s[0]):
            ts.samples.add(value=value, timestamp=timestamp)
    return request


def parsed(body: bytes) -> list[Series]:
    """``body`` parsed by protobuf, as series."""
    request = WriteRequest.FromString(body)
    return [
        (
            tuple((label.name, label.value) for label in ts.labels),
            [(s.timestamp, s.value) for s in ts.samples],
        )
        for ts in request.timeseries
    ]


def bits(series: list[Series]) -> list[tuple[Labels, list[tuple[int, int]]]]:
    """Values as their IEEE bits, so NaN compares equal and -0.0 differs from 0.0."""
    return [
        (labels, [(t, struct.unpack("<q", struct.pack("<d", v))[0]) for t, v in samples])
        for labels, samples in series
    ]


# ---------------------------------------------------------------- against protobuf

AWKWARD: list[Series] = [
    (
        (("node", "edge-ü 北京"), ("__name__", "DCGM_FI_DEV_GPU_UTIL"), ("gpu", "0")),
        [
            (1_700_000_003_000, 3.0),
            (-1, float("nan")),
            (-(2**63), float("inf")),
            (2**63 - 1, float("-inf")),
            (0, -0.0),
            (5, 0.0),
            (1_700_000_001_000, 5e-324),
        ],
    ),
    ((("__name__", "gpurelay_up"), ("empty", ""), ("emoji", "🔥")), [(0, 0.0)]),
    ((("__name__", "no_samples"),), []),
    ((("__name__", "long"), ("k" * 130, "v" * 200), ("pod", "p" * 120)), [(1, 1.0)]),
]


def test_protobuf_parses_our_bytes_and_round_trips_every_value() -> None:
    got = parsed(encode_write_request(AWKWARD))
    assert bits(got) == bits(
        [
            (
                (("__name__", "DCGM_FI_DEV_GPU_UTIL"), ("gpu", "0"), ("node", "edge-ü 北京")),
                [
                    (-(2**63), float("inf")),
                    (-1, float("nan")),
                    (0, -0.0),
                    (5, 0.0),
                    (1_700_000_001_000, 5e-324),
                    (1_700_000_003_000, 3.0),
                    (2**63 - 1, float("-inf")),
                ],
            ),
            ((("__name__", "gpurelay_up"), ("emoji", "🔥")), [(0, 0.0)]),  # "" dropped
            ((("__name__", "no_samples"),), []),
            ((("__name__", "long"), ("k" * 130, "v" * 200), ("pod", "p" * 120)), [(1, 1.0)]),
        ]
    )
    assert math.copysign(1.0, got[0][1][2][1]) == -1.0  # -0.0 kept its sign


def test_byte_identical_to_protobuf_serialisation() -> None:
    assert encode_write_request(AWKWARD) == reference(AWKWARD).SerializeToString(deterministic=True)
    assert encode_write_request([]) == WriteRequest().SerializeToString() == b""


_text = st.text(min_size=1, max_size=12)
_series = st.tuples(
    st.dictionaries(
        _text, st.text(max_size=12) | st.text(min_size=120, max_size=150), max_size=6
    ).map(lambda d: tuple(d.items())),
    st.lists(
        st.tuples(st.integers(-(2**63), 2**63 - 1), st.floats(allow_nan=True, width=64)),
        max_size=8,
    ),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_series, max_size=6))
def test_any_series_byte_identical_to_protobuf(series: list[Series]) -> None:
    ours = encode_write_request(series)
    assert ours == reference(series).SerializeToString(deterministic=True)
    assert bits(parsed(ours)) == bits(parsed(reference(series).SerializeToString()))


def test_every_request_body_is_a_snappy_write_request_protobuf_parses() -> None:
    series: list[Series] = [
        ((("__name__", "a"), ("gpu", str(g))), [(t, float(t * g)) for t in range(7)])
        for g in range(3)
    ]
    bodies = list(encode_requests(series, 4))
    assert [n for _, n in bodies] == [4, 4, 4, 4, 4, 1]
    got = [s for body, _ in bodies for s in parsed(bytes(cramjam.snappy.decompress_raw(body)))]
    assert [(labels, t) for labels, samples in got for t, _ in samples] == [
        (labels, t) for labels, samples in series for t, _ in samples
    ]


# ---------------------------------------------------------------- by hand, byte by byte


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return result, i


def _fields(buf: bytes) -> list[tuple[int, int, Any]]:
    """(field number, wire type, raw value) of every field in ``buf``."""
    out: list[tuple[int, int, Any]] = []
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        field, wire = key >> 3, key & 7
        value: Any
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 1:
            value, i = buf[i : i + 8], i + 8
        elif wire == 2:
            n, i = _varint(buf, i)
            value, i = buf[i : i + n], i + n
        else:
            raise AssertionError(f"unexpected wire type {wire}")
        out.append((field, wire, value))
    assert i == len(buf)
    return out


def decode_write_request(buf: bytes) -> list[Series]:
    """A WriteRequest decoded by a few lines of hand-written protobuf (for fake receivers
    in tests that should not depend on the ``protobuf`` package)."""
    series: list[Series] = []
    for field, wire, ts in _fields(buf):
        assert (field, wire) == (1, 2)
        labels: list[tuple[str, str]] = []
        samples: list[tuple[int, float]] = []
        for f, w, v in _fields(ts):
            assert w == 2
            if f == 1:
                kv = {lf: lv.decode() for lf, lw, lv in _fields(v)}
                labels.append((kv.get(1, ""), kv.get(2, "")))
            elif f == 2:
                value, timestamp = 0.0, 0
                for sf, sw, sv in _fields(v):
                    if sf == 1:
                        assert sw == 1
                        value = struct.unpack("<d", sv)[0]
                    elif sf == 2:
                        assert sw == 0
                        timestamp = sv - (1 << 64) if sv >= 1 << 63 else sv
                samples.append((timestamp, value))
            else:
                raise AssertionError(f"unexpected TimeSeries field {f}")
        series.append((tuple(labels), samples))
    return series


def test_encoding_byte_exact_against_hand_decoded_reference() -> None:
    series: list[Series] = [((("job", "a"), ("__name__", "up")), [(2000, 0.5), (1000, 1.0)])]
    label_name = b"\x0a\x08__name__\x12\x02up"  # Label{name=1 "__name__", value=2 "up"}
    label_job = b"\x0a\x03job\x12\x01a"
    sample_1 = b"\x09" + bytes.fromhex("000000000000f03f") + b"\x10\xe8\x07"  # 1.0 @ 1000
    sample_2 = b"\x09" + bytes.fromhex("000000000000e03f") + b"\x10\xd0\x0f"  # 0.5 @ 2000
    timeseries = (
        b"\x0a\x0e" + label_name + b"\x0a\x08" + label_job  # labels sorted by name
        + b"\x12\x0c" + sample_1 + b"\x12\x0c" + sample_2  # samples in timestamp order
    )  # fmt: skip
    assert len(timeseries) == 0x36
    assert encode_write_request(series) == b"\x0a\x36" + timeseries


def test_encoding_defaults_negative_timestamp_and_empty_request() -> None:
    # proto3: value 0.0 is omitted; int64 -1 is a 10-byte varint; -0.0 is not the default.
    assert encode_write_request([((("__name__", "x"),), [(-1, 0.0)])]) == (
        b"\x0a\x1c" + b"\x0a\x0d\x0a\x08__name__\x12\x01x" + b"\x12\x0b\x10" + b"\xff" * 9 + b"\x01"
    )
    assert encode_write_request([((("__name__", "x"),), [(0, -0.0)])]).endswith(
        b"\x12\x09\x09" + struct.pack("<d", -0.0)
    )
    assert encode_write_request([]) == b""


def test_round_trip_through_decoder() -> None:
    series: list[Series] = [
        (
            (("gpu", "0"), ("__name__", "DCGM_FI_DEV_GPU_UTIL"), ("node", "edge-ü")),
            [(1_700_000_003_000, 3.0), (1_700_000_001_000, 1.25), (1_700_000_002_000, -7e300)],
        ),
        ((("__name__", "gpurelay_up"), ("empty", "")), [(5, float("inf")), (4, 0.0)]),
    ]
    decoded = decode_write_request(encode_write_request(series))
    assert decoded == [
        (
            (("__name__", "DCGM_FI_DEV_GPU_UTIL"), ("gpu", "0"), ("node", "edge-ü")),
            [(1_700_000_001_000, 1.25), (1_700_000_002_000, -7e300), (1_700_000_003_000, 3.0)],
        ),
        ((("__name__", "gpurelay_up"),), [(4, 0.0), (5, float("inf"))]),  # empty label dropped
    ]
    nan = decode_write_request(encode_write_request([((("__name__", "n"),), [(1, float("nan"))])]))
    assert nan[0][1][0][1] != nan[0][1][0][1]


def test_duplicate_label_names_refused() -> None:
    with pytest.raises(ValueError, match="duplicate"):
        encode_write_request([((("__name__", "a"), ("__name__", "b")), [(1, 1.0)])])


def test_snappy_block_round_trip() -> None:
    body = encode_write_request([((("__name__", "m"),), [(i, float(i)) for i in range(500)])])
    compressed = snappy_compress(body)
    assert len(compressed) < len(body)
    assert not compressed.startswith(b"\xff\x06\x00\x00sNaPpY")  # block, not framed
    assert bytes(cramjam.snappy.decompress_raw(compressed)) == body


def test_split_series_bounds_requests_and_keeps_order() -> None:
    a: Series = ((("__name__", "a"),), [(t, 1.0) for t in (5, 1, 4, 2, 3)])
    b: Series = ((("__name__", "b"),), [(1, 2.0), (2, 2.0)])
    empty: Series = ((("__name__", "c"),), [])
    batches = list(split_series([a, empty, b], 2))
    assert [sum(len(s) for _, s in batch) for batch in batches] == [2, 2, 2, 1]
    flat = [(labels[0][1], t) for batch in batches for labels, samples in batch for t, _ in samples]
    assert flat == [("a", 1), ("a", 2), ("a", 3), ("a", 4), ("a", 5), ("b", 1), ("b", 2)]
