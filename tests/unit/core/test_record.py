"""The record codec: spooled collections, self-contained, bit exact, strictly checked."""

from __future__ import annotations

import json
import math
import struct
import zlib

import pytest

from gpurelay.model import Family, Sample, Snapshot
from gpurelay.record import MAGIC, RecordDecoder, RecordEncoder, decode_record
from gpurelay.wire import Limits, WireError
from harness.pipeline import simulated_snapshots

FAM = (Family(name="temp", type="gauge", help="t"),)


def snap(*samples: Sample, ts: float = 1_790_000_000.123) -> Snapshot:
    return Snapshot(node="edge-a", timestamp=ts, families=FAM, samples=samples)


def record(ts_ms: int, series: object, values: list[float]) -> bytes:
    head = json.dumps(series).encode()
    body = struct.pack(">qI", ts_ms, len(head)) + head + struct.pack(f">{len(values)}d", *values)
    return MAGIC + zlib.compress(body)


def test_round_trip_is_bit_exact() -> None:
    values = [0.0, -0.0, math.nan, math.inf, -math.inf, 1e-300, 123456789.125]
    samples = [
        Sample("temp", (("gpu", str(i)), ("Hostname", "edge-a")), v) for i, v in enumerate(values)
    ]
    rec = decode_record(RecordEncoder().encode(snap(*samples)))
    assert rec.timestamp_ms == 1_790_000_000_123
    assert rec.series == tuple((s.name, s.labels) for s in samples)
    assert [struct.pack(">d", v) for v in rec.values] == [struct.pack(">d", v) for v in values]


def test_a_real_collection_and_the_series_cache() -> None:
    snaps = simulated_snapshots(gpus=2, processes_per_gpu=2, count=3)
    encoder, decoder = RecordEncoder(), RecordDecoder()
    records = [decoder.decode(encoder.encode(s)) for s in snaps]
    for s, r in zip(snaps, records, strict=True):
        want = {(x.name, x.labels): x.value for x in s.samples}
        got = dict(zip(r.series, r.values, strict=True))
        assert got.keys() == want.keys()
        assert all(got[k] == want[k] or (math.isnan(got[k]) and math.isnan(want[k])) for k in got)
    # the same series list: the decoder hands out the very same tuple (the gateway relies on it)
    if records[1].series == records[2].series:
        assert records[1].series is records[2].series


def test_a_record_is_one_zlib_stream_of_the_documented_body_as_the_series_come_and_go() -> None:
    """The encoder deflates the series list once per list and splices the parts; the
    result must stay one plain zlib stream (checksum included) of the same body."""
    encoder = RecordEncoder()
    bad = Sample("bad name", (), 9.0)
    steps = [
        [Sample("temp", (("gpu", "0"),), 1.0)],
        [Sample("temp", (("gpu", "0"),), 2.5)],  # same series, new value
        [Sample("temp", (("gpu", "0"),), 3.0), bad, Sample("temp", (("gpu", "1"),), -0.0)],
        [],
        [Sample("temp", (("gpu", "1"),), math.inf), Sample("temp", (("gpu", "1"),), 7.0)],
    ]
    for i, samples in enumerate(steps):
        data = encoder.encode(snap(*samples, ts=1_790_000_000 + i))
        body = zlib.decompress(data[len(MAGIC) :])  # verifies the adler32 too
        keys = list(dict.fromkeys((s.name, s.labels) for s in samples if s is not bad))
        values = [next(s.value for s in samples if (s.name, s.labels) == k) for k in keys]
        head = json.dumps(
            [[n, [p for pair in labels for p in pair]] for n, labels in keys],
            separators=(",", ":"),
        ).encode()
        packed = struct.pack(f">{len(values)}d", *values)
        assert body == struct.pack(">qI", (1_790_000_000 + i) * 1000, len(head)) + head + packed


def test_series_the_gateway_would_refuse_are_left_out_and_repeats_once() -> None:
    good = Sample("temp", (("gpu", "0"),), 1.0)
    rec = decode_record(
        RecordEncoder().encode(
            snap(good, Sample("bad name", (), 2.0), Sample("temp", (("__x", "1"),), 3.0), good)
        )
    )
    assert rec.series == (("temp", (("gpu", "0"),)),)


def test_too_many_series_are_cut_at_the_limit() -> None:
    samples = [Sample("temp", (("gpu", str(i)),), float(i)) for i in range(5)]
    limits = Limits(max_series=3)
    data = RecordEncoder(limits=limits).encode(snap(*samples))
    assert len(decode_record(data, limits=limits).values) == 3


@pytest.mark.parametrize(
    ("data", "code", "text"),
    [
        (b"XX1" + zlib.compress(b""), "malformed", "magic"),
        (MAGIC + b"not zlib", "malformed", "zlib"),
        (MAGIC + zlib.compress(b"\0" * 5), "malformed", "shorter"),
        (MAGIC + zlib.compress(b"x")[:-3], "malformed", "truncated"),
        (record(1, [["temp", ["gpu", "0"]]], []), "malformed", "value bytes"),
        (record(1, [["temp", ["gpu"]]], [1.0]), "malformed", "label list"),
        (record(1, [["temp", ["gpu", 0]]], [1.0]), "malformed", "not text"),
        (record(1, [["9temp", []]], [1.0]), "bad_name", ""),
        (record(1, [["temp", []], ["temp", []]], [1.0, 2.0]), "malformed", "twice"),
        (record(1, {"not": "a list"}, []), "malformed", "not a list"),
        (record(2**62, [], []), "malformed", "timestamp"),
        (MAGIC + zlib.compress(struct.pack(">qI", 1, 99) + b"[]"), "malformed", "longer"),
    ],
)
def test_malformed_records_raise_wire_errors(data: bytes, code: str, text: str) -> None:
    with pytest.raises(WireError) as info:
        RecordDecoder().decode(data)
    assert info.value.code == code
    assert text in str(info.value)


def test_a_record_that_inflates_too_far_is_refused() -> None:
    bomb = MAGIC + zlib.compress(b"\0" * (65 * 1024 * 1024), 9)
    with pytest.raises(WireError) as info:
        decode_record(bomb)
    assert info.value.code == "oversize"


def test_too_many_series_in_a_record_are_refused() -> None:
    data = record(1, [["temp", ["gpu", str(i)]] for i in range(4)], [0.0] * 4)
    with pytest.raises(WireError) as info:
        decode_record(data, limits=Limits(max_series=3))
    assert info.value.code == "too_many_series"
