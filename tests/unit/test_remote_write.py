"""Remote write 1.0 client: protobuf encoding, snappy, retries, splitting, auth, back-pressure."""

from __future__ import annotations

import asyncio
import base64
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cramjam
import httpx
import pytest

from cloud_gateway import __version__
from cloud_gateway.remote_write import (
    RemoteWriteConfig,
    RemoteWriter,
    RemoteWriteRejected,
    RemoteWriteUnavailable,
    Series,
    encode_write_request,
    snappy_compress,
    split_series,
)

URL = "http://receiver.test/api/v1/write"

# ---------------------------------------------------------------- a tiny protobuf decoder


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


# ---------------------------------------------------------------- encoding


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


# ---------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"url": "ftp://x"}, "http"),
        ({"bearer_token": "t", "bearer_token_file": Path("/t")}, "not both"),
        ({"bearer_token": "t", "basic_user": "u"}, "not both"),
        ({"max_samples_per_send": 0}, "max_samples_per_send"),
        ({"headers": ("NoColon",)}, "Name: value"),
        ({"headers": ("Content-Encoding: gzip",)}, "set by the remote write client"),
        ({"headers": ("Authorization: x",), "bearer_token": "t"}, "set by the remote"),
        ({"min_backoff_seconds": 2.0, "max_backoff_seconds": 1.0}, "backoff"),
    ],
)
def test_config_validation(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RemoteWriteConfig(**{"url": URL, **kwargs})


# ---------------------------------------------------------------- the writer


Handler = Callable[[httpx.Request], Any]


class Recorder:
    def __init__(self, *responses: httpx.Response | Exception) -> None:
        self.responses = list(responses)
        self.requests: list[httpx.Request] = []
        self.sleeps: list[float] = []

    def handler(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if not self.responses:
            return httpx.Response(204)
        r = self.responses.pop(0)
        if isinstance(r, Exception):
            raise r
        return r

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)

    def writer(self, **cfg: Any) -> RemoteWriter:
        client = httpx.AsyncClient(transport=httpx.MockTransport(self.handler))
        return RemoteWriter(
            RemoteWriteConfig(**{"url": URL, **cfg}),
            client=client,
            sleep=self.sleep,
            jitter=lambda: 1.0,
        )

    def decoded(self, i: int) -> list[Series]:
        return decode_write_request(bytes(cramjam.snappy.decompress_raw(self.requests[i].content)))


SERIES: list[Series] = [((("__name__", "m"), ("gpu", "0")), [(1000, 1.0), (2000, 2.0)])]


async def test_success_headers_and_body() -> None:
    rec = Recorder()
    w = rec.writer(headers=("X-Scope-OrgID: edge",), bearer_token="tok")
    await w.send(SERIES)
    (req,) = rec.requests
    assert req.method == "POST"
    assert str(req.url) == URL
    assert req.headers["Content-Encoding"] == "snappy"
    assert req.headers["Content-Type"] == "application/x-protobuf"
    assert req.headers["X-Prometheus-Remote-Write-Version"] == "0.1.0"
    assert req.headers["User-Agent"] == f"edge-gpu-relay/{__version__}"
    assert req.headers["X-Scope-OrgID"] == "edge"
    assert req.headers["Authorization"] == "Bearer tok"
    assert rec.decoded(0) == SERIES
    assert (w.stats.sent_samples, w.stats.pending_samples, w.stats.sent_requests) == (2, 0, 1)
    assert w.stats.latency_seconds_count == 1
    assert w.stats.last_latency_seconds >= 0
    assert rec.sleeps == []


async def test_basic_auth() -> None:
    rec = Recorder()
    await rec.writer(basic_user="user", basic_password="pa:ss").send(SERIES)
    expected = "Basic " + base64.b64encode(b"user:pa:ss").decode()
    assert rec.requests[0].headers["Authorization"] == expected


async def test_bearer_token_file_reread_per_request(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("first\n")
    rec = Recorder()
    w = rec.writer(bearer_token_file=token)
    await w.send(SERIES)
    token.write_text("second\n")
    await w.send(SERIES)
    assert [r.headers["Authorization"] for r in rec.requests] == [
        "Bearer first",
        "Bearer second",
    ]


async def test_splits_into_requests_of_at_most_max_samples() -> None:
    rec = Recorder()
    series: list[Series] = [
        ((("__name__", "a"),), [(t, float(t)) for t in range(5)]),
        ((("__name__", "b"),), [(t, float(t)) for t in range(3)]),
    ]
    w = rec.writer(max_samples_per_send=3)
    await w.send(series)
    sizes = [sum(len(s) for _, s in rec.decoded(i)) for i in range(len(rec.requests))]
    assert sizes == [3, 3, 2]
    got = [(lb[0][1], t) for i in range(3) for lb, samples in rec.decoded(i) for t, _ in samples]
    assert got == [(n, t) for n, k in (("a", 5), ("b", 3)) for t in range(k)]
    assert w.stats.sent_samples == 8
    assert w.stats.sent_requests == 3


async def test_5xx_then_200_is_retried_with_backoff() -> None:
    rec = Recorder(httpx.Response(503, text="busy"), httpx.Response(500), httpx.Response(200))
    w = rec.writer(min_backoff_seconds=0.1, max_backoff_seconds=0.15)
    await w.send(SERIES)
    assert len(rec.requests) == 3
    assert rec.requests[0].content == rec.requests[2].content
    assert rec.sleeps == [0.1, 0.15]  # exponential, capped (jitter pinned at 100 %)
    assert w.stats.retried_requests == 2
    assert w.stats.sent_samples == 2
    assert w.stats.failed_samples == 0


async def test_429_honours_retry_after() -> None:
    rec = Recorder(httpx.Response(429, headers={"Retry-After": "7"}), httpx.Response(200))
    w = rec.writer()
    await w.send(SERIES)
    assert rec.sleeps == [7.0]
    assert w.stats.retried_requests == 1
    assert w.stats.sent_samples == 2


async def test_400_is_rejected_with_body_and_not_retried(caplog: pytest.LogCaptureFixture) -> None:
    body = "out of order sample"
    rec = Recorder(httpx.Response(400, text=body))
    w = rec.writer()
    with pytest.raises(RemoteWriteRejected) as info:
        await w.send(SERIES)
    assert info.value.status == 400
    assert info.value.body == body
    assert len(rec.requests) == 1
    assert rec.sleeps == []
    assert w.stats.rejected_requests == 1
    assert w.stats.failed_samples == 2
    assert w.stats.sent_samples == 0
    assert w.stats.pending_samples == 0
    assert body in caplog.text


async def test_old_prometheus_500_for_too_old_samples_is_final() -> None:
    """Prometheus < 2.49 answers 500 for samples beyond its out-of-order window."""
    body = "too old sample"
    rec = Recorder(httpx.Response(500, text=body))
    w = rec.writer()
    with pytest.raises(RemoteWriteRejected) as info:
        await w.send(SERIES)
    assert (info.value.status, len(rec.requests), rec.sleeps) == (500, 1, [])


async def test_transport_error_is_retried() -> None:
    rec = Recorder(httpx.ConnectError("refused"), httpx.ReadTimeout("slow"), httpx.Response(204))
    w = rec.writer()
    await w.send(SERIES)
    assert len(rec.requests) == 3
    assert w.stats.retried_requests == 2
    assert w.stats.sent_samples == 2


async def test_retries_exhausted_raise_unavailable() -> None:
    rec = Recorder(*[httpx.Response(502) for _ in range(4)])
    w = rec.writer(max_retries=2, max_samples_per_send=1)
    with pytest.raises(RemoteWriteUnavailable):
        await w.send(SERIES)
    assert len(rec.requests) == 3
    assert w.stats.failed_requests == 1
    assert w.stats.failed_samples == 2  # the failed request and the one never sent
    assert w.stats.pending_samples == 0


async def test_back_pressure_blocks_until_space_frees() -> None:
    gate = asyncio.Event()
    seen: list[int] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        seen.append(len(request.content))
        await gate.wait()
        return httpx.Response(200)

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    w = RemoteWriter(RemoteWriteConfig(url=URL, max_pending_samples=3), client=client)
    first = asyncio.create_task(w.send([((("__name__", "a"),), [(1, 1.0), (2, 1.0)])]))
    await asyncio.sleep(0.01)
    second = asyncio.create_task(w.send([((("__name__", "b"),), [(1, 1.0), (2, 1.0)])]))
    await asyncio.sleep(0.01)
    assert w.stats.pending_samples == 2  # the second send waits: 2 + 2 > 3
    assert len(seen) == 1
    assert not second.done()
    gate.set()
    await asyncio.wait_for(asyncio.gather(first, second), 5)
    assert len(seen) == 2
    assert w.stats.pending_samples == 0
    assert w.stats.sent_samples == 4
    await client.aclose()


async def test_send_larger_than_bound_goes_alone() -> None:
    rec = Recorder()
    w = rec.writer(max_pending_samples=1)
    await asyncio.wait_for(w.send(SERIES), 5)
    assert w.stats.sent_samples == 2


async def test_owned_client_is_closed() -> None:
    w = RemoteWriter(RemoteWriteConfig(url=URL))
    await w.send([])  # nothing to send: no request
    await w.close()
    assert w._client.is_closed
