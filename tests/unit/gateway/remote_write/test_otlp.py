"""OTLP/HTTP metrics (cloud_gateway.remote_write.otlp): every request decoded with the
official opentelemetry-proto package, the OTLP retry rules, a receiver written here on
real HTTP on loopback, and the no-loss rule with remote write beside it (a batch is
acknowledged once every receiver took it).

No real OTLP receiver could be installed here: Debian's Prometheus (2.42) and
VictoriaMetrics (1.79) predate their OTLP receivers (Prometheus 2.47, VictoriaMetrics
1.92), and the OpenTelemetry Collector is in neither Debian nor PyPI."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.metrics.v1.metrics_pb2 import AggregationTemporality

from cloud_gateway.config import load as load_gateway_config
from cloud_gateway.errors import GatewayConfigError
from cloud_gateway.remote_write.client import (
    Fanout,
    RemoteWriter,
    RemoteWriteRejected,
    RemoteWriteUnavailable,
)
from cloud_gateway.remote_write.config import OtlpConfig, RemoteWriteConfig, check_otlp
from cloud_gateway.remote_write.forwarder import Forwarder, ForwardStats, QueuedCollection
from cloud_gateway.remote_write.otlp import OtlpWriter, classify_otlp, encode_otlp_requests
from cloud_gateway.remote_write.prompb import Series
from edge_agent.health import WATCHES
from gpurelay.families import known

T0 = 1_790_000_000_000  # ms


def kind(name: str) -> str | None:
    family = known(name)
    return family.type if family is not None else None


def decode(body: bytes) -> ExportMetricsServiceRequest:
    request = ExportMetricsServiceRequest()
    request.ParseFromString(body)
    return request


def flat(
    request: ExportMetricsServiceRequest,
) -> list[tuple[str, str, str, dict[str, str], int, float]]:
    """(node, metric, kind, attributes, time in ns, value) of every data point."""
    out = []
    for rm in request.resource_metrics:
        resource = {a.key: a.value.string_value for a in rm.resource.attributes}
        assert resource["service.name"] == "edge-gpu-relay"
        for sm in rm.scope_metrics:
            assert sm.scope.name == "edge-gpu-relay"
            for metric in sm.metrics:
                which = metric.WhichOneof("data")
                data = getattr(metric, which)
                if which == "sum":
                    assert data.is_monotonic
                    assert data.aggregation_temporality == AggregationTemporality.Value(
                        "AGGREGATION_TEMPORALITY_CUMULATIVE"
                    )
                for p in data.data_points:
                    attrs = {a.key: a.value.string_value for a in p.attributes}
                    out.append(
                        (
                            resource.get("host.name", ""),
                            metric.name,
                            which,
                            attrs,
                            p.time_unix_nano,
                            p.as_double,
                        )
                    )
    return out


SERIES: list[Series] = [
    (
        (
            ("__name__", "DCGM_FI_DEV_GPU_TEMP"),
            ("gpu", "0"),
            ("UUID", "GPU-a"),
            ("Hostname", "edge-1"),
        ),
        [(T0, 61.0), (T0 + 10_000, 62.5)],
    ),
    (
        (
            ("__name__", "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"),
            ("gpu", "0"),
            ("Hostname", "edge-1"),
        ),
        [(T0, 123456789.0)],
    ),
    (
        (("__name__", "DCGM_FI_DEV_GPU_TEMP"), ("gpu", "0"), ("Hostname", "edge-2")),
        [(T0, -0.0)],
    ),
    ((("__name__", "gpurelay_node_up"), ("Hostname", "edge-2")), [(T0, math.nan)]),
]


def test_every_sample_reaches_the_request_as_it_was() -> None:
    ((body, n),) = encode_otlp_requests(
        SERIES, 100, node_label="Hostname", kind=kind, hardware=False
    )
    points = flat(decode(body))
    assert n == len(points) == 5
    temp = [p for p in points if p[:2] == ("edge-1", "DCGM_FI_DEV_GPU_TEMP")]
    assert [(p[2], p[3], p[4], p[5]) for p in temp] == [
        ("gauge", {"gpu": "0", "UUID": "GPU-a"}, T0 * 1_000_000, 61.0),
        ("gauge", {"gpu": "0", "UUID": "GPU-a"}, (T0 + 10_000) * 1_000_000, 62.5),
    ]
    (energy,) = [p for p in points if p[1] == "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"]
    assert energy[2] == "sum" and energy[5] == 123456789.0  # a counter in the catalogue
    (negative_zero,) = [p for p in points if p[0] == "edge-2" and p[1] == "DCGM_FI_DEV_GPU_TEMP"]
    assert math.copysign(1.0, negative_zero[5]) == -1.0  # bit exact
    (up,) = [p for p in points if p[1] == "gpurelay_node_up"]
    assert math.isnan(up[5]) and up[3] == {}  # the node label went to the resource


def test_requests_hold_at_most_max_samples() -> None:
    requests = list(
        encode_otlp_requests(SERIES, 2, node_label="Hostname", kind=kind, hardware=False)
    )
    assert [n for _, n in requests] == [2, 2, 1]
    assert sum(len(flat(decode(body))) for body, _ in requests) == 5


GPU = (
    ("gpu", "0"),
    ("UUID", "GPU-a"),
    ("modelName", "NVIDIA H100 80GB HBM3"),
    ("Hostname", "edge-1"),
    ("DCGM_FI_DRIVER_VERSION", "550.54.15"),
)


def health(ts: int, warn: str = "", fail: str = "") -> list[Series]:
    out: list[Series] = []
    for watch in WATCHES:
        value = 20.0 if watch == fail else 10.0 if watch == warn else 0.0
        labels = (("__name__", "DCGM_EXP_GPU_HEALTH_STATUS"), *GPU, ("health_watch", watch))
        out.append(
            ((*labels, ("health_error_code", "X" if value else "DCGM_FR_OK")), [(ts, value)])
        )
    return out


def hw_points(requests: list[tuple[bytes, int]]) -> dict[tuple[Any, ...], tuple[str, str, float]]:
    """(metric, time, its own attributes) -> (kind, unit, value) of the hw.* points."""
    out = {}
    for body, _ in requests:
        request = decode(body)
        for rm in request.resource_metrics:
            host = {a.key: a.value.string_value for a in rm.resource.attributes}["host.name"]
            for metric in rm.scope_metrics[0].metrics:
                if not metric.name.startswith("hw."):
                    continue
                which = metric.WhichOneof("data")
                data = getattr(metric, which)
                kind_ = which if which == "gauge" else "counter" if data.is_monotonic else "updown"
                for p in data.data_points:
                    attrs = {a.key: a.value.string_value for a in p.attributes}
                    assert attrs.pop("hw.id") == "GPU-a" and host == "edge-1"
                    assert attrs.pop("hw.model") == "NVIDIA H100 80GB HBM3"
                    assert attrs.pop("hw.driver_version") == "550.54.15"
                    assert attrs.pop("hw.vendor") == "NVIDIA"
                    key = (metric.name, p.time_unix_nano // 1_000_000, tuple(sorted(attrs.items())))
                    assert key not in out
                    out[key] = (kind_, metric.unit, p.as_double)
    return out


def test_the_hardware_conventions_beside_the_dcgm_names() -> None:
    series: list[Series] = [
        ((("__name__", "DCGM_FI_DEV_GPU_UTIL"), *GPU), [(T0, 42.0), (T0 + 1000, 7.0)]),
        ((("__name__", "DCGM_FI_DEV_ENC_UTIL"), *GPU), [(T0, 5.0)]),
        ((("__name__", "DCGM_FI_DEV_DEC_UTIL"), *GPU), [(T0, 0.0)]),
        ((("__name__", "DCGM_FI_DEV_FB_USED"), *GPU), [(T0, 1000.0)]),
        ((("__name__", "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL"), *GPU), [(T0, 3.0)]),
        ((("__name__", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"), *GPU), [(T0, 0.0)]),
        # a MIG instance: no hw.* of its own (its GPU would count twice)
        ((("__name__", "DCGM_FI_DEV_FB_USED"), *GPU, ("GPU_I_ID", "1")), [(T0, 500.0)]),
        *health(T0, warn="THERMAL"),
        *health(T0 + 1000, warn="POWER", fail="MEM"),
    ]
    # 3 data points per request: the hw.status of one instant still comes from all 11 watches
    got = hw_points(list(encode_otlp_requests(series, 3, node_label="Hostname", kind=kind)))
    general, encoder, decoder = (
        (("hw.gpu.task", task),) for task in ("general", "encoder", "decoder")
    )
    assert got[("hw.gpu.utilization", T0, general)] == ("gauge", "1", 0.42)
    assert got[("hw.gpu.utilization", T0 + 1000, general)] == ("gauge", "1", 0.07)
    assert got[("hw.gpu.utilization", T0, encoder)] == ("gauge", "1", 0.05)
    assert got[("hw.gpu.utilization", T0, decoder)] == ("gauge", "1", 0.0)
    assert got[("hw.gpu.memory.usage", T0, ())] == ("updown", "By", 1000 * 2**20)
    corrected = (("error.type", "corrected"), ("hw.type", "gpu"))
    uncorrected = (("error.type", "uncorrected"), ("hw.type", "gpu"))
    assert got[("hw.errors", T0, corrected)] == ("counter", "{error}", 3.0)
    assert got[("hw.errors", T0, uncorrected)] == ("counter", "{error}", 0.0)
    for ts, state in ((T0, "degraded"), (T0 + 1000, "failed")):
        for s in ("ok", "degraded", "failed", "predicted_failure"):
            key = ("hw.status", ts, (("hw.state", s), ("hw.type", "gpu")))
            assert got[key] == ("updown", "1", 1.0 if s == state else 0.0), (ts, s)
    assert len(got) == 7 + 8  # nothing from the MIG instance


def test_the_hardware_conventions_from_dcgm_exporter_49_names() -> None:
    """Under 4.9's names the utilisations are ratios already and memory is bytes, so the
    capacity gives hw.gpu.memory.limit exactly; the driver label is 4.9's."""
    gpu = tuple(
        ("DCGM_FI_SYSTEM_DRIVER_VERSION", v) if k == "DCGM_FI_DRIVER_VERSION" else (k, v)
        for k, v in GPU
    )
    series: list[Series] = [
        ((("__name__", "DCGM_FI_DEV_GPU_UTIL_RATIO"), *gpu), [(T0, 0.42)]),
        ((("__name__", "DCGM_FI_DEV_ENC_UTIL_RATIO"), *gpu), [(T0, 0.05)]),
        ((("__name__", "DCGM_FI_DEV_DEC_UTIL_RATIO"), *gpu), [(T0, 0.0)]),
        ((("__name__", "DCGM_FI_DEV_FB_USED_BYTES"), *gpu), [(T0, 1_048_588_395.0)]),
        ((("__name__", "DCGM_FI_DEV_FB_CAPACITY_BYTES"), *gpu), [(T0, 85_520_809_984.0)]),
        ((("__name__", "DCGM_FI_DEV_FB_USED_BYTES"), *gpu, ("GPU_I_ID", "1")), [(T0, 5.0)]),
    ]
    got = hw_points(list(encode_otlp_requests(series, 3, node_label="Hostname", kind=kind)))
    general, encoder, decoder = (
        (("hw.gpu.task", task),) for task in ("general", "encoder", "decoder")
    )
    assert got[("hw.gpu.utilization", T0, general)] == ("gauge", "1", 0.42)
    assert got[("hw.gpu.utilization", T0, encoder)] == ("gauge", "1", 0.05)
    assert got[("hw.gpu.utilization", T0, decoder)] == ("gauge", "1", 0.0)
    assert got[("hw.gpu.memory.usage", T0, ())] == ("updown", "By", 1_048_588_395.0)
    assert got[("hw.gpu.memory.limit", T0, ())] == ("updown", "By", 85_520_809_984.0)
    assert len(got) == 5


def test_the_hardware_conventions_can_be_left_out() -> None:
    series: list[Series] = [((("__name__", "DCGM_FI_DEV_GPU_UTIL"), *GPU), [(T0, 42.0)])]
    requests = list(
        encode_otlp_requests(series, 10, node_label="Hostname", kind=kind, hardware=False)
    )
    assert hw_points(requests) == {}
    assert check_otlp(OtlpConfig(url="http://c")) is not None
    assert OtlpConfig().semantic_conventions


def test_another_node_label_names_the_resource() -> None:
    series: list[Series] = [((("__name__", "x"), ("hostname", "edge-9")), [(T0, 1.0)])]
    ((body, _),) = encode_otlp_requests(series, 10, node_label="hostname", kind=kind)
    assert flat(decode(body))[0][:4] == ("edge-9", "x", "gauge", {})


@pytest.mark.parametrize(
    ("status", "verdict"),
    [
        (200, None),
        (202, None),
        (429, RemoteWriteUnavailable),
        (502, RemoteWriteUnavailable),
        (503, RemoteWriteUnavailable),
        (504, RemoteWriteUnavailable),
        (400, RemoteWriteRejected),
        (401, RemoteWriteRejected),
        (413, RemoteWriteRejected),
        (500, RemoteWriteRejected),  # OTLP: only 429, 502, 503, 504 are retried
        (501, RemoteWriteRejected),
    ],
)
def test_the_otlp_retry_rules(status: int, verdict: type[Exception] | None) -> None:
    error = classify_otlp(status, "why", "7", "http://r/v1/metrics", now=0.0)
    if verdict is None:
        assert error is None
        return
    assert isinstance(error, verdict)
    assert "OTLP to http://r/v1/metrics" in str(error)
    if isinstance(error, RemoteWriteUnavailable):
        assert error.retry_after == 7.0


def test_configuration() -> None:
    assert check_otlp(OtlpConfig()) is None  # off
    cfg = check_otlp(OtlpConfig(url="http://c:4318/v1/metrics", headers=("X-Tenant: edge",)))
    assert cfg is not None and cfg.url == "http://c:4318/v1/metrics"
    with pytest.raises(GatewayConfigError, match=r"otlp: url must be http\(s\)://"):
        check_otlp(OtlpConfig(url="grpc://c:4317"))
    with pytest.raises(GatewayConfigError, match="otlp: header 'Content-Type'"):
        check_otlp(OtlpConfig(url="http://c", headers=("Content-Type: text/plain",)))
    env = {"CLOUD_GATEWAY_OTLP_URL": "http://collector:4318/v1/metrics"}
    assert load_gateway_config(None, env).otlp.url == "http://collector:4318/v1/metrics"


def test_the_operator_guide_example_loads(tmp_path: Any) -> None:
    guide = (Path(__file__).resolve().parents[4] / "docs" / "operator-guide.md").read_text()
    blocks = [b.split("```")[0] for b in guide.split("```toml\n")[1:]]
    (block,) = [b for b in blocks if b.startswith("[otlp]")]
    path = tmp_path / "gateway.toml"
    path.write_text(block)
    assert load_gateway_config(path, {}).otlp.url == "http://otel-collector:4318/v1/metrics"


# --- a receiver on loopback -------------------------------------------------------------------


class Receiver:
    """An OTLP/HTTP receiver: answers ``statuses`` in turn (then 200) and decodes what it
    takes with opentelemetry-proto."""

    def __init__(self) -> None:
        self.statuses: list[tuple[int, dict[str, str]]] = []
        self.taken: list[ExportMetricsServiceRequest] = []
        self.headers: list[dict[str, str]] = []

    async def handle(self, request: web.Request) -> web.Response:
        self.headers.append(dict(request.headers))
        body = await request.read()
        if self.statuses:
            status, headers = self.statuses.pop(0)
            return web.Response(status=status, text="busy", headers=headers)
        self.taken.append(decode(body))
        return web.Response(status=200, body=b"", content_type="application/x-protobuf")


@pytest.fixture
async def receiver() -> AsyncIterator[tuple[Receiver, str]]:
    r = Receiver()
    app = web.Application()
    app.router.add_post("/v1/metrics", r.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield r, f"http://127.0.0.1:{port}/v1/metrics"
    await runner.cleanup()


def writer(url: str, **kw: Any) -> OtlpWriter:
    cfg = check_otlp(OtlpConfig(url=url, **kw))
    assert cfg is not None
    return OtlpWriter(cfg, node_label="Hostname", kind=kind)


async def test_a_receiver_takes_the_samples_with_the_protocol_headers(
    receiver: tuple[Receiver, str],
) -> None:
    r, url = receiver
    async with writer(url, bearer_token="tok") as w:
        await w.send(SERIES)
    (request,) = r.taken
    assert len(flat(request)) == 5
    headers = {k.lower(): v for k, v in r.headers[0].items()}
    assert headers["content-type"] == "application/x-protobuf"
    assert headers["authorization"] == "Bearer tok"
    assert "content-encoding" not in headers  # plain protobuf, no snappy
    assert (w.stats.sent_samples, w.stats.sent_requests) == (5, 1)


async def test_a_busy_receiver_is_sent_again_and_a_refusal_is_final(
    receiver: tuple[Receiver, str],
) -> None:
    r, url = receiver
    r.statuses = [(503, {"Retry-After": "3"}), (400, {})]
    async with writer(url) as w:
        with pytest.raises(RemoteWriteUnavailable) as busy:
            await w.send(SERIES)
        assert busy.value.retry_after == 3.0
        with pytest.raises(RemoteWriteRejected):
            await w.send(SERIES)
        await w.send(SERIES)
    assert len(r.taken) == 1
    assert (w.stats.retried_requests, w.stats.rejected_requests, w.stats.sent_requests) == (1, 1, 1)


async def test_a_batch_is_acknowledged_once_both_receivers_took_it(
    receiver: tuple[Receiver, str],
) -> None:
    """Remote write beside OTLP: the forwarder retries until both accepted, and only then
    acknowledges the collection to its agent."""
    r, url = receiver
    r.statuses = [(503, {}), (502, {})]
    prometheus: list[int] = []

    def remote_write(request: httpx.Request) -> httpx.Response:
        prometheus.append(len(request.content))
        return httpx.Response(204)

    rw = RemoteWriter(
        RemoteWriteConfig(url="http://prometheus.test/api/v1/write"),
        client=httpx.AsyncClient(transport=httpx.MockTransport(remote_write)),
    )
    otlp = writer(url)
    delivered: list[int] = []
    sleeps: list[float] = []

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)

    failures: list[str] = []
    forwarder = Forwarder(
        Fanout([rw, otlp]),
        log=logging.getLogger("test.otlp"),
        delivered=delivered.append,
        failed=failures.append,
        stats=ForwardStats(),
        backoff=(0.01, 0.05),
        sleep=sleep,
        jitter=lambda: 1.0,
    )
    labels = (("__name__", "DCGM_FI_DEV_GPU_TEMP"), ("gpu", "0"), ("Hostname", "edge-1"))
    forwarder.put(
        QueuedCollection(seq=41, timestamp_ms=T0, samples=[(labels, 60.0)], replayed=False)
    )
    for _ in range(500):
        if delivered:
            break
        await asyncio.sleep(0.01)
    forwarder.close()
    await rw.close()
    await otlp.close()
    assert failures == []
    assert delivered == [41]
    assert len(sleeps) == 2  # two refusals of the OTLP receiver, two backoffs
    assert len(prometheus) == 3  # remote write got it each time (duplicates are harmless)
    assert len(r.taken) == 1 and flat(r.taken[0])[0][5] == 60.0
