"""The wire codec: round trips, chunking, every error code, exact floats, fuzzing."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import struct
import zlib
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpurelay.model import GpuInventory
from gpurelay.wire import (
    PROTOCOL_VERSION,
    Ack,
    Batch,
    Declare,
    ErrorFrame,
    Frame,
    FrameDecoder,
    FrameEncoder,
    FrameType,
    Goodbye,
    Heartbeat,
    Hello,
    Limits,
    SeriesDecl,
    WireError,
    check_series,
)
from gpurelay.wire.frames import CODEC_ERROR_CODES
from gpurelay.wire.payloads import dump_json, hello_json, parse_hello
from gpurelay.wire.rules import Passed

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
T0 = 1_790_000_000.0
DEFAULT = Limits()

GPU = GpuInventory(
    index=0,
    uuid="GPU-b570349c-7e54-75c7-2716-9c74139c7c2b",
    name="NVIDIA H100 80GB HBM3",
    pci_bus_id="00000000:1B:00.0",
    minor=0,
    memory_total_bytes=85_899_345_920,
    memory_used_bytes=1_073_741_824,
)
HELLO = Hello(
    agent_version="0.1.0",
    node="edge-node-1",
    domain="edge-node-1.example",
    backend="simulated",
    driver_version="550.54.15",
    hostname="box-1",
    interval_seconds=10.0,
    gpus=(GPU, dataclasses.replace(GPU, index=1, minor=1, mig_enabled=True, healthy=False)),
)


def decl(sid: int, name: str = "DCGM_FI_DEV_GPU_TEMP", **labels: str) -> SeriesDecl:
    return SeriesDecl(
        id=sid,
        name=name,
        type="gauge",
        help="GPU temperature (in C).",
        labels=tuple(labels.items()) or (("gpu", str(sid)), ("UUID", f"GPU-{sid}")),
    )


def roundtrip(frames: Sequence[Frame], limits: Limits = DEFAULT) -> list[Frame]:
    encoder, decoder = FrameEncoder(limits=limits), FrameDecoder(limits=limits)
    return decoder.feed(b"".join(encoder.encode(f) for f in frames))


def opening(n: int = 3) -> list[Frame]:
    return [HELLO, Declare(series=tuple(decl(i) for i in range(n)))]


class Raw:
    """Hand-made frames, for the invalid input that FrameEncoder refuses to produce."""

    def __init__(self) -> None:
        self._deflate = zlib.compressobj(6, zlib.DEFLATED, -15)

    def frame(
        self, ftype: int, body: bytes, *, version: int = PROTOCOL_VERSION, deflate: bool = True
    ) -> bytes:
        payload = body
        if deflate and ftype in (FrameType.HELLO, FrameType.DECLARE, FrameType.BATCH):
            out = self._deflate.compress(body) + self._deflate.flush(zlib.Z_SYNC_FLUSH)
            payload = out[:-4]
        return struct.pack(">IBB", len(payload) + 2, version, ftype) + payload

    def json(self, ftype: int, obj: object) -> bytes:
        return self.frame(ftype, json.dumps(obj).encode())

    def hello(self) -> bytes:
        return self.json(FrameType.HELLO, {"agent_version": "1", "node": "n"})

    def declare(self, *series: dict[str, object]) -> bytes:
        return self.json(FrameType.DECLARE, {"series": list(series)})


def series_json(sid: int = 0, **over: object) -> dict[str, object]:
    base: dict[str, object] = {
        "id": sid,
        "name": "DCGM_FI_DEV_GPU_TEMP",
        "type": "gauge",
        "help": "",
        "labels": [["gpu", "0"]],
    }
    return {**base, **over}


def expect(code: str, data: bytes, limits: Limits = DEFAULT) -> WireError:
    decoder = FrameDecoder(limits=limits)
    with pytest.raises(WireError) as info:
        decoder.feed(data)
    assert info.value.code == code, str(info.value)
    with pytest.raises(WireError):  # and it stays broken
        decoder.feed(b"")
    return info.value


# --- round trips -------------------------------------------------------------------------


def test_every_frame_type_round_trips() -> None:
    frames: list[Frame] = [
        *opening(3),
        Batch(seq=1, timestamp=T0, values=((0, 61.0), (1, 239.892), (2, 0.0)), full=True),
        Batch(seq=2, timestamp=T0 + 10, values=((1, 240.5),)),
        Batch(seq=5, timestamp=T0 + 20.125, values=(), removed=(0, 2)),
        Declare(series=(decl(7, "DCGM_FI_DEV_POWER_USAGE", gpu="0"),)),
        Batch(seq=6, timestamp=T0 + 30, values=((1, 1.0), (7, 350.25)), full=True),
        Ack(seq=6),
        ErrorFrame(code="bad_name", message="series 3: metric name 'x y' is not valid ü"),
        Goodbye(reason="gateway restarting"),
    ]
    assert roundtrip(frames) == frames


def test_hello_defaults_are_optional_on_the_wire() -> None:
    raw = Raw()
    frames = FrameDecoder().feed(raw.hello())
    assert frames == [Hello(agent_version="1", node="n")]


def test_values_come_back_sorted_by_id() -> None:
    frames = [*opening(3), Batch(seq=1, timestamp=T0, values=((2, 1.0), (0, 2.0)))]
    out = roundtrip(frames)[-1]
    assert isinstance(out, Batch)
    assert out.values == ((0, 2.0), (2, 1.0))


def test_byte_by_byte_feeding_gives_the_same_frames() -> None:
    frames: list[Frame] = [
        *opening(4),
        Batch(seq=1, timestamp=T0, values=tuple((i, 20.0 + i) for i in range(4)), full=True),
        Batch(seq=2, timestamp=T0 + 10, values=((3, 99.5),)),
        Ack(seq=2),
        Goodbye(reason="bye"),
    ]
    encoder = FrameEncoder()
    data = b"".join(encoder.encode(f) for f in frames)
    decoder = FrameDecoder()
    got: list[Frame] = []
    for i in range(len(data)):
        got += decoder.feed(data[i : i + 1])
    assert got == frames


@FUZZ
@given(cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=12))
def test_any_chunking_gives_the_same_frames(cuts: list[int]) -> None:
    frames: list[Frame] = [
        *opening(20),
        Batch(seq=1, timestamp=T0, values=tuple((i, i * 1.5) for i in range(20)), full=True),
        Batch(seq=2, timestamp=T0 + 10, values=((5, 7.0), (19, -3.25))),
    ]
    encoder = FrameEncoder()
    data = b"".join(encoder.encode(f) for f in frames)
    decoder = FrameDecoder()
    got: list[Frame] = []
    start = 0
    for cut in sorted(c % (len(data) + 1) for c in cuts):
        got += decoder.feed(data[start:cut])
        start = max(start, cut)
    got += decoder.feed(data[start:])
    assert got == frames


def test_batch_layout_is_as_documented() -> None:
    """Pins the BATCH body byte for byte (see the module docstring): other ends rely on it."""
    frames: list[Frame] = [
        HELLO,
        Declare(series=tuple(decl(i) for i in range(5))),
        Batch(
            seq=1, timestamp=T0, values=((0, 239.892), (1, 65.0), (3, 4096.0 * 1024), (4, math.nan))
        ),
        Batch(seq=2, timestamp=T0 + 10, values=((0, 240.0), (1, 66.0))),
    ]
    encoder = FrameEncoder()
    inflate = zlib.decompressobj(-15)
    bodies = []
    for frame in frames:
        data = encoder.encode(frame)
        length, version, ftype = struct.unpack(">IBB", data[:6])
        assert (length, version, ftype) == (len(data) - 4, 1, _type_of(frame))
        bodies.append(inflate.decompress(data[6:] + b"\x00\x00\xff\xff"))
    assert bodies[2].hex(" ") == (
        "00 02 80 b0 83 c5 98 68 00 04"  # flags, zz(seq 1), zz(ms), no removals, 4 values
        " 02 00 0c 06"  # heads: id 0 MILLI, id 1 INT, id 3 (gap 1) KIBI, id 4 FLOAT64
        " a8 a4 1d 82 01 80 40 7f f8 00 00 00 00 00 00"  # 239892, 65, 4096, NaN
    )
    assert bodies[3].hex(" ") == (
        "00 02 a0 9c 01 00 02"  # flags, zz(+1), zz(+10000 ms), no removals, 2 values
        " 01 01 02 02"  # INT_DELTA both: 240 = int(239.892) + 1, 66 = 65 + 1
    )


def _type_of(frame: Frame) -> FrameType:
    types: dict[type, FrameType] = {
        Hello: FrameType.HELLO,
        Declare: FrameType.DECLARE,
        Batch: FrameType.BATCH,
    }
    return types[type(frame)]


def test_acks_errors_and_goodbyes_are_not_compressed() -> None:
    encoder = FrameEncoder()
    assert encoder.encode(Ack(seq=300)) == bytes.fromhex("00000004 01 04 ac02")
    data = encoder.encode(Goodbye(reason="bye"))
    assert data[6:] == b'{"reason":"bye"}'


def test_repeated_structure_compresses_away() -> None:
    n, rng = 500, random.Random(1)
    ids = sorted(rng.sample(range(n), 200))  # the same irregular set of series every batch
    encoder = FrameEncoder()
    opening_bytes = encoder.encode(Hello(agent_version="1", node="n")) + encoder.encode(
        Declare(series=tuple(decl(i) for i in range(n)))
    )
    sizes = []
    for seq in range(1, 4):
        values = tuple((i, rng.random()) for i in ids)  # 8 incompressible bytes each
        sizes.append(len(encoder.encode(Batch(seq=seq, timestamp=T0 + 10 * seq, values=values))))
    assert len(opening_bytes) < 40 * n  # label sets compress
    assert sizes[2] < sizes[0] - 100  # the heads column matches the previous batch's


# --- exact values -------------------------------------------------------------------------

floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True),
    st.sampled_from([0.0, -0.0, math.inf, -math.inf, math.nan, 5e-324, 1.7976931348623157e308]),
    st.integers(min_value=-(2**70), max_value=2**70).map(float),
    st.integers(min_value=-(10**13), max_value=10**13).map(lambda n: n / 1000),
    st.integers(min_value=-(2**50), max_value=2**50).map(lambda n: float(n * 1024)),
    st.floats(width=32),
    st.just(float(struct.unpack(">d", bytes.fromhex("7ff0000000000001"))[0])),  # signalling NaN
)


def bits(v: float) -> bytes:
    return struct.pack(">d", v)


@FUZZ
@given(rows=st.lists(st.lists(floats, min_size=3, max_size=3), min_size=1, max_size=6))
def test_every_float_round_trips_bit_for_bit(rows: list[list[float]]) -> None:
    """Three series over several batches, so absolute and delta kinds both get used."""
    frames: list[Frame] = opening(3)
    for seq, row in enumerate(rows, start=1):
        frames.append(Batch(seq=seq, timestamp=T0 + seq, values=tuple(enumerate(row))))
    got = roundtrip(frames)[2:]
    for want, batch in zip(rows, got, strict=True):
        assert isinstance(batch, Batch)
        assert [bits(v) for _, v in batch.values] == [bits(v) for v in want]


@FUZZ
@given(
    seqs=st.lists(
        st.integers(min_value=0, max_value=2**63 - 1), min_size=1, max_size=5, unique=True
    ),
    stamps=st.lists(st.integers(min_value=-(10**15), max_value=10**15), min_size=5, max_size=5),
)
def test_seq_and_millisecond_timestamps_round_trip(seqs: list[int], stamps: list[int]) -> None:
    frames: list[Frame] = opening(1)
    for seq, ms in zip(sorted(seqs), stamps, strict=False):
        frames.append(Batch(seq=seq, timestamp=ms / 1000, values=()))
    got = roundtrip(frames)[2:]
    assert [(b.seq, b.timestamp) for b in got if isinstance(b, Batch)] == [
        (f.seq, f.timestamp) for f in frames[2:] if isinstance(f, Batch)
    ]


def test_typical_values_take_few_bytes() -> None:
    def size(*values: float) -> int:
        encoder = FrameEncoder()
        encoder.encode(HELLO)
        encoder.encode(Declare(series=(decl(0),)))
        return len(encoder.encode(Batch(seq=1, timestamp=T0, values=tuple((0, v) for v in values))))

    assert size(239.892) < size(math.pi)
    assert size(4_308_434_944.0) < size(4_308_434_945.5)  # bytes from KiB/s


# --- errors, one code at a time ----------------------------------------------------------


def test_unknown_version_names_both_versions() -> None:
    err = expect("version", Raw().frame(FrameType.ACK, b"\x01", version=9, deflate=False)[:5])
    assert "version 9" in str(err) and f"version {PROTOCOL_VERSION}" in str(err)


def test_unknown_frame_type() -> None:
    err = expect("frame_type", struct.pack(">IBB", 3, PROTOCOL_VERSION, 42))
    assert "42" in str(err) and "BATCH" in str(err)


def test_oversize_is_refused_from_the_header_alone() -> None:
    limits = Limits(max_frame_bytes=1024)
    err = expect("oversize", struct.pack(">I", 1025), limits)
    assert "1025" in str(err) and "1024" in str(err)


def test_zip_bomb_is_refused_while_inflating() -> None:
    limits = Limits(max_frame_bytes=64 * 1024)
    raw = Raw()
    bomb = raw.frame(FrameType.BATCH, b"\x00" * (1024 * 1024))
    assert len(bomb) < limits.max_frame_bytes
    err = expect("oversize", raw.hello() + bomb, limits)
    assert "inflates" in str(err)


def test_encoder_refuses_frames_over_the_limit() -> None:
    encoder = FrameEncoder(limits=Limits(max_frame_bytes=200))
    encoder.encode(Hello(agent_version="1", node="n"))
    with pytest.raises(WireError) as info:
        encoder.encode(Declare(series=tuple(decl(i) for i in range(10))))
    assert info.value.code == "oversize"
    encoder.encode(Declare(series=(decl(0),)))  # still usable: nothing was sent


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (struct.pack(">IB", 1, 1), "shorter than"),
        (Raw().frame(FrameType.HELLO, b"\xff\xfe"), "not UTF-8"),
        (Raw().frame(FrameType.HELLO, b"[1, 2"), "not valid JSON"),
        (Raw().json(FrameType.HELLO, [1]), "not a JSON object"),
        (Raw().json(FrameType.HELLO, {"node": "n"}), "lacks the field 'agent_version'"),
        (Raw().json(FrameType.HELLO, {"agent_version": 1, "node": "n"}), "must be a string"),
        (Raw().json(FrameType.HELLO, {"agent_version": "1", "node": "n", "x": 1}), "unknown"),
        (Raw().frame(FrameType.HELLO, b'{"agent_version":"1","node":"n","node":"m"}'), "repeats"),
        (
            Raw().frame(
                FrameType.HELLO, b'{"agent_version":"1","node":"n","interval_seconds":NaN}'
            ),
            "NaN",
        ),
        (Raw().json(FrameType.HELLO, {"agent_version": "1", "node": "n", "gpus": [{}]}), "gpus[0]"),
        (Raw().frame(FrameType.HELLO, b'{"agent_version":"\\ud800","node":"n"}'), "Unicode"),
        (Raw().frame(FrameType.ACK, b"\x01\x02", deflate=False), "ACK"),
        (Raw().frame(FrameType.ERROR, b'{"code":"x"}', deflate=False), "'message'"),
        (Raw().frame(FrameType.GOODBYE, b"{}", deflate=False), "'reason'"),
        (Raw().frame(FrameType.HELLO, b"not deflate", deflate=False), "deflate"),
    ],
)
def test_malformed_payloads(data: bytes, needle: str) -> None:
    err = expect("malformed", data)
    assert needle in str(err)


def test_deeply_nested_json_is_malformed_not_a_crash() -> None:
    expect("malformed", Raw().frame(FrameType.HELLO, b"[" * 100_000 + b"]" * 100_000))


BAD_DECLARATIONS = [
    (series_json(name="1abc"), "bad_name", "metric name '1abc'"),
    (series_json(name="gpu-temp"), "bad_name", "[a-zA-Z_:]"),
    (series_json(name="a" * 201), "bad_name", "limit of 200"),
    (series_json(labels=[["__name__", "x"]]), "bad_label", "__"),
    (series_json(labels=[["1gpu", "x"]]), "bad_label", "'1gpu'"),
    (series_json(labels=[["gpu", "0"], ["gpu", "1"]]), "bad_label", "twice"),
    (series_json(labels=[["gpu", "x" * 2049]]), "bad_label", "limit of 2048"),
    (series_json(labels=[[f"l{i}", ""] for i in range(33)]), "too_many_labels", "33 labels"),
    (series_json(type="histogram"), "malformed", "gauge or counter"),
    (series_json(help="h" * 1025), "malformed", "help"),
    (series_json(sid=-1), "malformed", "'id'"),
    (series_json(sid=2**32), "malformed", "id"),
    (series_json(labels=[["gpu"]]), "malformed", "pair"),
    (series_json(labels=["ab"]), "malformed", "pair"),  # two characters are not a pair
    (series_json(labels=[{"a": "b", "c": "d"}]), "malformed", "pair"),
    (series_json(labels=[["gpu", "0", "1"]]), "malformed", "pair"),
]


@pytest.mark.parametrize(("series", "code", "needle"), BAD_DECLARATIONS)
def test_bad_declarations_are_refused_by_both_ends(
    series: dict[str, object], code: str, needle: str
) -> None:
    raw = Raw()
    err = expect(code, raw.hello() + raw.declare(series))
    assert needle in str(err)
    if code != "malformed" or needle == "help":  # the rest cannot be built as SeriesDecl
        encoder = FrameEncoder()
        encoder.encode(HELLO)
        labels = tuple((k, v) for k, v in series["labels"])  # type: ignore[attr-defined]
        bad = SeriesDecl(
            id=series["id"],  # type: ignore[arg-type]
            name=series["name"],  # type: ignore[arg-type]
            type=series["type"],  # type: ignore[arg-type]
            help=series["help"],  # type: ignore[arg-type]
            labels=labels,
        )
        with pytest.raises(WireError) as info:
            encoder.encode(Declare(series=(bad,)))
        assert info.value.code == code


def test_what_passed_in_a_frame_is_remembered_but_never_what_failed() -> None:
    """Within one DECLARE the checks skip what passed before (issue 26: a node's DECLARE
    repeats the same GPU's pairs hundreds of times); a series made of remembered parts is
    still refused for what it does wrong with them, and so is one under tighter limits."""
    good = series_json(0, labels=[["gpu", "0"], ["Hostname", "n"]])
    raw = Raw()
    assert len(FrameDecoder().feed(raw.hello() + raw.declare(good, {**good, "id": 1}))) == 2
    again = [
        (series_json(1, labels=[["gpu", "0"], ["gpu", "0"]]), "bad_label", "twice"),
        (series_json(1, labels=[["Hostname", "n"], ["gpu", ["0"]]]), "bad_label", "not a string"),
        (series_json(1, labels=[["gpu", "0"], ["__x", "0"]]), "bad_label", "__"),
        (series_json(1, labels=[["gpu", "0"], {"gpu": "0"}]), "malformed", "pair"),
        (series_json(labels=[["gpu", "0"]], id="1"), "malformed", "'id'"),
    ]
    for series, code, needle in again:
        raw = Raw()
        assert needle in str(expect(code, raw.hello() + raw.declare(good, series)))
    tight = Limits(max_label_value_bytes=0)
    raw = Raw()
    assert "limit of 0" in str(expect("bad_label", raw.hello() + raw.declare(good), tight))
    raw = Raw()
    read = FrameDecoder().feed(raw.hello() + raw.declare(good))[1]
    assert isinstance(read, Declare)
    assert read.series == (SeriesDecl(id=0, name="DCGM_FI_DEV_GPU_TEMP", type="gauge", help="",
                                      labels=(("gpu", "0"), ("Hostname", "n"))),)  # fmt: skip
    passed = Passed()
    check_series(decl(0, gpu="0"), DEFAULT, passed)
    head = ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C).")
    assert passed.heads == {head}  # remembered, and still no label pair
    odd = SeriesDecl(
        id=1,
        name=head[0],
        type="gauge",
        help=head[2],
        labels=(head,),  # type: ignore[arg-type]
    )
    with pytest.raises(WireError, match="pair"):
        check_series(odd, DEFAULT, passed)


def test_redeclaring_an_id_is_refused() -> None:
    raw = Raw()
    err = expect(
        "malformed", raw.hello() + raw.declare(series_json(0)) + raw.declare(series_json(0))
    )
    assert "already declared" in str(err)
    encoder = FrameEncoder()
    for frame in opening(1):
        encoder.encode(frame)
    with pytest.raises(WireError, match="already declared"):
        encoder.encode(Declare(series=(decl(0),)))


def test_too_many_series() -> None:
    limits = Limits(max_series=2)
    raw = Raw()
    data = raw.hello() + raw.declare(series_json(0), series_json(1)) + raw.declare(series_json(2))
    err = expect("too_many_series", data, limits)
    assert "limit of 2" in str(err)


def test_values_for_unknown_or_removed_series() -> None:
    encoder = FrameEncoder()
    for frame in opening(2):
        encoder.encode(frame)
    with pytest.raises(WireError) as info:
        encoder.encode(Batch(seq=1, timestamp=T0, values=((5, 1.0),)))
    assert info.value.code == "unknown_series" and "never declared" in str(info.value)
    encoder.encode(Batch(seq=1, timestamp=T0, values=(), removed=(1,)))
    for bad in (
        Batch(seq=2, timestamp=T0, values=((1, 1.0),)),
        Batch(seq=2, timestamp=T0, values=(), removed=(1,)),
        Batch(seq=2, timestamp=T0, values=((0, 1.0),), removed=(0,)),
    ):
        with pytest.raises(WireError) as info:
            encoder.encode(bad)
        assert info.value.code == "unknown_series", bad
    # the decoder says the same about a hand-made batch (series 9, never declared)
    raw = Raw()
    body = bytes([0, 2, 0, 0, 1, 9 << 3, 0])
    err = expect("unknown_series", raw.hello() + raw.declare(series_json(0)) + raw.frame(3, body))
    assert "series 9" in str(err)
    raw = Raw()
    body = bytes([0, 2, 0, 1, 0, 1, 0, 0])  # removes series 0, then sets it
    err = expect("unknown_series", raw.hello() + raw.declare(series_json(0)) + raw.frame(3, body))
    assert "was removed" in str(err)


def test_seq_must_increase_on_a_connection() -> None:
    encoder = FrameEncoder()
    for frame in opening(1):
        encoder.encode(frame)
    encoder.encode(Batch(seq=7, timestamp=T0, values=()))
    for seq in (7, 3):
        with pytest.raises(WireError) as info:
            encoder.encode(Batch(seq=seq, timestamp=T0, values=()))
        assert info.value.code == "order" and "seq 7" in str(info.value)
    raw = Raw()
    batches = raw.frame(3, bytes([0, 14, 0, 0, 0])) + raw.frame(3, bytes([0, 1, 0, 0, 0]))
    err = expect("order", raw.hello() + raw.declare(series_json(0)) + batches)
    assert "seq 6 does not follow seq 7" in str(err)


def test_hello_comes_first_and_once() -> None:
    raw = Raw()
    assert expect("order", raw.declare(series_json(0))).code == "order"
    raw = Raw()
    assert "only once" in str(expect("order", raw.hello() + raw.hello()))
    with pytest.raises(WireError) as info:
        FrameEncoder().encode(Batch(seq=1, timestamp=T0, values=()))
    assert info.value.code == "order"


def test_a_full_batch_must_list_every_live_series() -> None:
    encoder = FrameEncoder()
    for frame in opening(3):
        encoder.encode(frame)
    with pytest.raises(WireError, match="2 of the 3"):
        encoder.encode(Batch(seq=1, timestamp=T0, values=((0, 1.0), (1, 1.0)), full=True))
    raw = Raw()
    body = bytes([1, 2, 0, 0, 1, 0, 0])
    data = raw.hello() + raw.declare(series_json(0), series_json(1)) + raw.frame(3, body)
    assert "1 of the 2" in str(expect("malformed", data))


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (bytes([4, 2, 0, 0, 0]), "flags"),
        (bytes([0, 2, 0, 0, 1, 0]), "ends in the middle"),
        (bytes([0, 2, 0, 0, 0, 0]), "left over"),
        (bytes([0, 2, 0, 0, 1, 7, 0]), "kind 7"),
        (bytes([0, 2, 0, 0, 1, 1, 2]), "no finite previous value"),
        (bytes([0, 2, 0, 0, 200, 1]), "more than fit"),
        (bytes([0, 2, 0, *[0xFF] * 11]), "longer than 10 bytes"),
        (bytes([0, 1, 0, 0, 0]), "not in 0..2**63-1"),
        (bytes([0, 2, 0, 0, 1, 6, 0, 0]), "ends in the middle"),
    ],
)
def test_malformed_batches(body: bytes, needle: str) -> None:
    raw = Raw()
    err = expect("malformed", raw.hello() + raw.declare(series_json(0)) + raw.frame(3, body))
    assert needle in str(err)


def test_encoder_refuses_nonsense_batches() -> None:
    encoder = FrameEncoder()
    for frame in opening(2):
        encoder.encode(frame)
    for bad, needle in (
        (Batch(seq=-1, timestamp=T0, values=()), "seq -1"),
        (Batch(seq=1, timestamp=math.nan, values=()), "timestamp"),
        (Batch(seq=1, timestamp=T0, values=((0, 1.0), (0, 2.0))), "twice"),
        (Batch(seq=1, timestamp=T0, values=((0, "1"),)), "not a number"),  # type: ignore[arg-type]
        (Batch(seq=1, timestamp=T0, values=(), removed=(1, 1)), "twice"),
    ):
        with pytest.raises(WireError, match=needle):
            encoder.encode(bad)
    # nothing above was sent, so the connection state is untouched
    encoder.encode(Batch(seq=1, timestamp=T0, values=((0, 1.0), (1, 2.0)), full=True))


# --- fuzzing: nothing but WireError ever escapes ------------------------------------------


def feed_all(chunks: Sequence[bytes], limits: Limits = DEFAULT) -> None:
    decoder = FrameDecoder(limits=limits)
    try:
        for chunk in chunks:
            decoder.feed(chunk)
    except WireError as exc:
        assert exc.code in CODEC_ERROR_CODES  # the codec's own; the channel adds others
        assert str(exc)


def valid_stream() -> bytes:
    frames: list[Frame] = [
        HELLO,
        Declare(series=(decl(0), decl(1, "DCGM_FI_DEV_POWER_USAGE", gpu="0"), decl(5))),
        Batch(seq=1, timestamp=T0, values=((0, 61.0), (1, 239.892), (5, 2.0**40)), full=True),
        Batch(seq=2, timestamp=T0 + 10, values=((0, 62.0), (1, math.nan), (5, 2.0**40 + 1024))),
        Batch(seq=3, timestamp=T0 + 20, values=((1, 1.5),), removed=(0,)),
        Ack(seq=3),
        ErrorFrame(code="x", message="y"),
        Goodbye(reason="z"),
    ]
    encoder = FrameEncoder()
    return b"".join(encoder.encode(f) for f in frames)


VALID = valid_stream()


@FUZZ
@given(data=st.binary(max_size=2048))
def test_arbitrary_bytes(data: bytes) -> None:
    feed_all([data], Limits(max_frame_bytes=4096))


@FUZZ
@given(
    edits=st.lists(
        st.tuples(st.integers(min_value=0, max_value=len(VALID) - 1), st.integers(0, 255)),
        min_size=1,
        max_size=6,
    ),
    cut=st.integers(min_value=1, max_value=len(VALID)),
)
def test_mutated_valid_streams(edits: list[tuple[int, int]], cut: int) -> None:
    data = bytearray(VALID[:cut])
    for pos, byte in edits:
        if pos < len(data):
            data[pos] = byte
    feed_all([bytes(data[:17]), bytes(data[17:])])


@FUZZ
@given(
    bodies=st.lists(st.tuples(st.sampled_from(list(FrameType)), st.binary(max_size=64)), max_size=4)
)
def test_well_framed_garbage_payloads(bodies: list[tuple[FrameType, bytes]]) -> None:
    """Valid headers and deflate, arbitrary bodies: reaches the payload parsers."""
    raw = Raw()
    stream = raw.hello() + raw.declare(series_json(0), series_json(3))
    stream += raw.frame(3, bytes([1, 2, 0, 0, 2, 0, 16, 0, 0]))
    feed_all([stream + b"".join(raw.frame(t, body) for t, body in bodies)])


@FUZZ
@given(
    obj=st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
        lambda inner: (
            st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
        ),
        max_leaves=12,
    )
)
def test_arbitrary_json_in_every_json_frame(obj: object) -> None:
    for ftype in (FrameType.HELLO, FrameType.DECLARE, FrameType.ERROR, FrameType.GOODBYE):
        raw = Raw()
        prefix = raw.hello() if ftype is FrameType.DECLARE else b""
        try:
            body = json.dumps(obj).encode()
        except ValueError:
            return
        feed_all([prefix + raw.frame(ftype, body)])


def test_heartbeat_round_trips_and_hello_carries_the_period_only_when_asked() -> None:
    enc, dec = FrameEncoder(), FrameDecoder()
    assert dec.feed(enc.encode(Heartbeat(received=2**63 - 1))) == [Heartbeat(received=2**63 - 1)]
    with pytest.raises(WireError, match="HEARTBEAT seq"):
        enc.encode(Heartbeat(received=-1))
    hello = Hello(agent_version="1", node="n", interval_seconds=1.0, heartbeat_seconds=1.0)
    assert dec.feed(FrameEncoder().encode(hello)) == [hello]
    # an older agent's HELLO (no heartbeat_seconds) is unchanged, byte for byte
    assert "heartbeat_seconds" not in hello_json(Hello(agent_version="1", node="n"))
    for bad in (-1.0, 3601.0):
        body = dump_json({**hello_json(hello), "heartbeat_seconds": bad})
        with pytest.raises(WireError, match="heartbeat_seconds"):
            parse_hello(body)


def test_frames_decodes_a_read_one_frame_at_a_time() -> None:
    """The gateway decodes a read as it handles it (issue 24, W17): a frame is decoded only
    when asked for, the ones before a bad frame are handed out first, and feed() is the
    same frames as a list."""
    enc = FrameEncoder()
    hello = enc.encode(Hello(agent_version="1", node="n"))
    declare = enc.encode(
        Declare(series=(SeriesDecl(id=0, name="m", type="gauge", help="h", labels=()),))
    )
    read = hello + declare + b"\x00\x00\x00\x02\x01\xee"  # then a frame of an unknown type
    dec = FrameDecoder()
    frames = dec.frames(read)
    assert isinstance(next(frames), Hello)
    assert dec.pending == len(read) - len(hello)  # the rest is not decoded yet
    assert isinstance(next(frames), Declare)
    with pytest.raises(WireError):
        next(frames)
    assert FrameDecoder().feed(hello + declare) == [
        Hello(agent_version="1", node="n"),
        Declare(series=(SeriesDecl(id=0, name="m", type="gauge", help="h", labels=()),)),
    ]
