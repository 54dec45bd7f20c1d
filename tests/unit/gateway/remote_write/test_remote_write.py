"""Remote write 1.0 client: one attempt per request and what the answer means (accepted,
unavailable, rejected), splitting, auth, back-pressure; and the forwarder's backoff, the
one retry loop on the path. The encoding itself: test_prompb.py."""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cramjam
import httpx
import pytest

from cloud_gateway import __version__
from cloud_gateway.remote_write.client import (
    RemoteWriter,
    RemoteWriteRejected,
    RemoteWriteUnavailable,
    classify,
)
from cloud_gateway.remote_write.config import RemoteWriteConfig
from cloud_gateway.remote_write.forwarder import Forwarder, ForwardStats, QueuedCollection
from cloud_gateway.remote_write.prompb import Series
from tests.unit.gateway.remote_write.test_prompb import decode_write_request

URL = "http://receiver.test/api/v1/write"

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
    cfg = RemoteWriteConfig(**{"url": URL, **kwargs})
    with pytest.raises(ValueError, match=match):
        cfg.validate()
    with pytest.raises(ValueError, match=match):
        RemoteWriter(cfg)


def test_a_writer_needs_a_url() -> None:
    RemoteWriteConfig().validate()  # url "" is remote write off: valid
    with pytest.raises(ValueError, match="url is empty"):
        RemoteWriter(RemoteWriteConfig())


def test_max_retries_is_accepted_deprecated_and_ignored() -> None:
    assert RemoteWriteConfig(url=URL).deprecated() == []
    (line,) = RemoteWriteConfig(url=URL, max_retries=10).deprecated()
    assert line.startswith("remote_write.max_retries is deprecated and ignored")


# ---------------------------------------------------------------- the writer


class Recorder:
    """A receiver behind httpx.MockTransport answering ``responses`` in turn (then 204),
    and the writer and forwarder in front of it; the forwarder's sleeps are recorded."""

    def __init__(self, *responses: httpx.Response | Exception) -> None:
        self.responses = list(responses)
        self.requests: list[httpx.Request] = []
        self.sleeps: list[float] = []
        self.delivered: list[int] = []
        self.failures: list[str] = []  # the forwarder's own failures (bugs): none expected

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
        return RemoteWriter(RemoteWriteConfig(**{"url": URL, **cfg}), client=client)

    def forwarder(
        self,
        writer: RemoteWriter,
        backoff: tuple[float, float] = (0.1, 0.4),
        jitter: Callable[[], float] = lambda: 1.0,
    ) -> Forwarder:
        return Forwarder(
            writer,
            log=logging.getLogger("test.forwarding"),
            delivered=self.delivered.append,
            failed=self.failures.append,
            stats=ForwardStats(),
            backoff=backoff,
            sleep=self.sleep,
            jitter=jitter,
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


# ---------------------------------------------------------------- one attempt, classified


@pytest.mark.parametrize(
    ("status", "body", "retry_after", "outcome", "delay"),
    [
        (200, "", None, None, None),
        (204, "", "7", None, None),
        (503, "busy", None, RemoteWriteUnavailable, None),
        (500, "", "2.5", RemoteWriteUnavailable, 2.5),
        (429, "slow down", "7", RemoteWriteUnavailable, 7.0),
        (429, "", "Fri, 14 Nov 2025 12:00:10 GMT", RemoteWriteUnavailable, 10.0),
        (429, "", "soon", RemoteWriteUnavailable, None),  # unreadable: no floor
        (503, "", "86400", RemoteWriteUnavailable, 300.0),  # honoured up to 5 minutes
        (400, "out of order sample", "7", RemoteWriteRejected, None),
        (404, "", None, RemoteWriteRejected, None),
        (413, "", None, RemoteWriteRejected, None),
        (302, "", None, RemoteWriteRejected, None),
        (500, "too old sample", None, RemoteWriteRejected, None),  # Prometheus < 2.49
        (500, "Out of bounds", None, RemoteWriteRejected, None),
    ],
)
def test_classify(
    status: int, body: str, retry_after: str | None, outcome: type | None, delay: float | None
) -> None:
    now = 1_763_121_600.0  # Fri, 14 Nov 2025 12:00:00 GMT
    error = classify(status, body, retry_after, URL, now=now)
    if outcome is None:
        assert error is None
        return
    assert error is not None and type(error) is outcome
    assert (error.status, error.body, error.url) == (status, body, URL)
    assert f"HTTP {status}: {body}" in str(error) and URL in str(error)
    if isinstance(error, RemoteWriteUnavailable):
        assert error.retry_after == delay


async def test_5xx_is_one_attempt_then_unavailable() -> None:
    rec = Recorder(httpx.Response(503, text="busy"))
    w = rec.writer()
    with pytest.raises(RemoteWriteUnavailable) as info:
        await w.send(SERIES)
    assert len(rec.requests) == 1
    assert (info.value.status, info.value.body, info.value.retry_after) == (503, "busy", None)
    assert w.stats.retried_requests == 1
    assert w.stats.sent_samples == 0
    assert w.stats.failed_samples == 2
    assert w.stats.pending_samples == 0


async def test_429_carries_retry_after() -> None:
    rec = Recorder(httpx.Response(429, headers={"Retry-After": "7"}))
    w = rec.writer()
    with pytest.raises(RemoteWriteUnavailable) as info:
        await w.send(SERIES)
    assert info.value.retry_after == 7.0
    assert len(rec.requests) == 1
    assert w.stats.retried_requests == 1


async def test_400_is_rejected_with_body_and_not_retried(caplog: pytest.LogCaptureFixture) -> None:
    body = "out of order sample"
    rec = Recorder(httpx.Response(400, text=body))
    w = rec.writer()
    with pytest.raises(RemoteWriteRejected) as info:
        await w.send(SERIES)
    assert info.value.status == 400
    assert info.value.body == body
    assert len(rec.requests) == 1
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
    assert (info.value.status, len(rec.requests)) == (500, 1)


async def test_transport_error_is_unavailable() -> None:
    rec = Recorder(httpx.ConnectError("refused"))
    w = rec.writer()
    with pytest.raises(RemoteWriteUnavailable) as info:
        await w.send(SERIES)
    assert len(rec.requests) == 1
    assert info.value.status is None
    assert info.value.body == "ConnectError: refused"
    assert str(info.value) == f"remote write to {URL} unavailable: ConnectError: refused"
    assert w.stats.retried_requests == 1
    assert w.stats.latency_seconds_count == 0


async def test_unreadable_token_file_is_unavailable(tmp_path: Path) -> None:
    rec = Recorder()
    w = rec.writer(bearer_token_file=tmp_path / "rotating")
    with pytest.raises(RemoteWriteUnavailable, match="bearer_token_file"):
        await w.send(SERIES)
    assert rec.requests == []


async def test_a_send_stops_at_the_first_request_not_taken() -> None:
    """Requests before it stay accepted; sending again duplicates them (same samples)."""
    rec = Recorder(httpx.Response(204), httpx.Response(502))
    w = rec.writer(max_samples_per_send=1)
    with pytest.raises(RemoteWriteUnavailable):
        await w.send(SERIES)
    assert len(rec.requests) == 2
    assert w.stats.sent_requests == 1
    assert w.stats.sent_samples == 1
    assert w.stats.failed_samples == 1  # the failed request's sample
    assert w.stats.pending_samples == 0

    rec = Recorder(httpx.Response(502), httpx.Response(204))
    w = rec.writer(max_samples_per_send=1)
    with pytest.raises(RemoteWriteUnavailable):
        await w.send(SERIES)
    assert len(rec.requests) == 1
    assert w.stats.failed_samples == 2  # the failed request and the one never sent


# ---------------------------------------------------------------- the forwarder's backoff


async def settle(predicate: Callable[[], object], timeout: float = 5.0) -> None:
    async def wait() -> None:
        while not predicate():
            await asyncio.sleep(0.001)

    await asyncio.wait_for(wait(), timeout)


def collection(seq: int) -> QueuedCollection:
    labels = (("__name__", "m"), ("gpu", "0"))
    return QueuedCollection(
        seq=seq, timestamp_ms=seq * 1000, samples=[(labels, 1.0)], replayed=False
    )


async def test_one_retry_loop_the_forwarders() -> None:
    """A receiver answering 503 N times: one send of the writer alone POSTs once; the
    forwarder POSTs N + 1 times, waiting longer each time up to the longest delay."""
    n = 5
    alone = Recorder(*[httpx.Response(503) for _ in range(n)])
    with pytest.raises(RemoteWriteUnavailable):
        await alone.writer().send(SERIES)
    assert len(alone.requests) == 1

    rec = Recorder(*[httpx.Response(503) for _ in range(n)])
    w = rec.writer()
    fwd = rec.forwarder(w, backoff=(0.1, 1.0))
    fwd.put(collection(1))
    await settle(lambda: rec.delivered == [1])
    assert len(rec.requests) == n + 1
    assert all(r.content == rec.requests[0].content for r in rec.requests)
    assert rec.sleeps == [0.1, 0.2, 0.4, 0.8, 1.0]  # doubling, capped (jitter pinned at 100 %)
    assert w.stats.retried_requests == n
    assert w.stats.sent_samples == 1
    assert fwd.stats.unavailable == n
    assert fwd.stats.delivered == 1
    fwd.close()
    assert rec.failures == []


async def test_backoff_jitter_and_reset_after_success() -> None:
    rec = Recorder(httpx.Response(500), httpx.Response(500), httpx.Response(204))
    rec.responses += [httpx.Response(500), httpx.Response(204)]
    fwd = rec.forwarder(rec.writer(), backoff=(0.1, 0.4), jitter=lambda: 0.0)
    fwd.put(collection(1))
    await settle(lambda: rec.delivered == [1])
    fwd.put(collection(2))
    await settle(lambda: rec.delivered == [1, 2])
    assert rec.sleeps == [0.05, 0.1, 0.05]  # 50 % of each step; a success starts over
    fwd.close()
    assert rec.failures == []


async def test_retry_after_is_a_floor_for_the_backoff() -> None:
    rec = Recorder(
        httpx.Response(429, headers={"Retry-After": "7"}),
        httpx.Response(503, headers={"Retry-After": "0"}),
    )
    fwd = rec.forwarder(rec.writer(), backoff=(0.1, 0.4))
    fwd.put(collection(1))
    await settle(lambda: rec.delivered == [1])
    assert rec.sleeps == [7.0, 0.2]  # longer than the backoff: honoured; shorter: ignored
    fwd.close()
    assert rec.failures == []


async def test_transport_errors_are_retried_by_the_forwarder() -> None:
    rec = Recorder(httpx.ConnectError("refused"), httpx.ReadTimeout("slow"), httpx.Response(204))
    w = rec.writer()
    fwd = rec.forwarder(w)
    fwd.put(collection(1))
    await settle(lambda: rec.delivered == [1])
    assert len(rec.requests) == 3
    assert w.stats.retried_requests == 2
    assert w.stats.sent_samples == 1
    fwd.close()
    assert rec.failures == []


async def test_the_retry_log_line_names_url_status_answer_and_delay(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rec = Recorder(httpx.Response(503, text="ingester busy"))
    fwd = rec.forwarder(rec.writer(), backoff=(0.25, 1.0))
    with caplog.at_level(logging.WARNING):
        fwd.put(collection(1))
        await settle(lambda: rec.delivered == [1])
    (line,) = [r.getMessage() for r in caplog.records if r.name == "test.forwarding"]
    assert line == (
        f"remote write to {URL} unavailable: HTTP 503: ingester busy; "
        "keeping 1 collection(s) unacknowledged, retry in 0.25s"
    )
    fwd.close()
    assert rec.failures == []


async def test_a_refused_collection_is_dropped_without_backoff() -> None:
    rec = Recorder(httpx.Response(400, text="out of order sample"))
    fwd = rec.forwarder(rec.writer())
    fwd.put(collection(1))
    await settle(lambda: rec.delivered == [1])
    assert (len(rec.requests), rec.sleeps) == (1, [])
    assert (fwd.stats.dropped, fwd.stats.delivered) == (1, 0)
    fwd.close()
    assert rec.failures == []


# ---------------------------------------------------------------- back-pressure


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
