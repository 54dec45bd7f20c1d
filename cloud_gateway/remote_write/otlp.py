"""OTLP/HTTP metrics: every sample the gateway forwards, also (or instead) sent as
OpenTelemetry metrics, protobuf over HTTP, for pipelines built on the OpenTelemetry
Collector.

What is sent: an ``ExportMetricsServiceRequest`` (opentelemetry-proto,
``opentelemetry/proto/collector/metrics/v1``) POSTed to the ``[otlp] url`` (the
receiver's ``/v1/metrics``) with ``Content-Type: application/x-protobuf``. One
``ResourceMetrics`` per node, its resource carrying ``host.name`` (the node, as the
registry's node label names it on the series) and ``service.name`` =
``edge-gpu-relay``; one scope ``edge-gpu-relay``; one ``Metric`` per metric name, under the
name it has in Prometheus (the DCGM names as they are), as a ``Sum`` (cumulative,
monotonic) where the fleet's family catalogue types it ``counter`` and a ``Gauge``
otherwise; one ``NumberDataPoint`` per sample (``as_double``, ``time_unix_nano`` the
sample's original timestamp) whose attributes are the series' labels, the node label
left to the resource. Written by hand like :mod:`~cloud_gateway.remote_write.prompb` (the
gateway does not import protobuf); the tests decode every request with the official
``opentelemetry-proto`` package.

The answer, as the OTLP/HTTP specification says: a 2xx is accepted (a ``partial_success``
in it is final, not retried); 429, 502, 503 and 504 are worth sending again, not before a
``Retry-After``; every other status is final. Transport errors are sent again. The same
no-loss rules as remote write follow (``forwarder``): a batch is acknowledged to its agent
only once every configured receiver accepted it.

Beside the DCGM names, the OpenTelemetry hardware semantic conventions for GPUs
(``hw.gpu.utilization``, ``hw.gpu.memory.usage``, ``hw.errors``, ``hw.status``, with
``hw.id``): :mod:`~cloud_gateway.remote_write.otlp_hw`, ``[otlp] semantic_conventions``.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator, Mapping, Sequence

from cloud_gateway import __version__
from cloud_gateway.remote_write.client import (
    RemoteWriteError,
    RemoteWriter,
    RemoteWriteRejected,
    RemoteWriteUnavailable,
    retry_after_seconds,
)
from cloud_gateway.remote_write.config import USER_AGENT, RemoteWriteConfig
from cloud_gateway.remote_write.otlp_hw import SHAPES, hardware_series
from cloud_gateway.remote_write.prompb import Series, _varint, split_series

SCOPE = "edge-gpu-relay"
OTLP_HEADERS: dict[str, str] = {
    "Content-Type": "application/x-protobuf",
    "User-Agent": USER_AGENT,
}
RETRYABLE = frozenset({429, 502, 503, 504})  # OTLP/HTTP: retry these, and no other status


def classify_otlp(
    status: int, body: str, retry_after: str | None, url: str, *, now: float
) -> RemoteWriteError | None:
    """What an OTLP/HTTP answer means: None for a 2xx, else the error to raise."""
    if 200 <= status < 300:
        return None
    if status in RETRYABLE:
        delay = retry_after_seconds(retry_after, now)
        return RemoteWriteUnavailable(status, body, url, retry_after=delay, protocol="OTLP")
    return RemoteWriteRejected(status, body, url, protocol="OTLP")


class OtlpWriter(RemoteWriter):
    """:class:`RemoteWriter`'s sending, back-pressure, auth and stats, with OTLP bodies,
    headers and answers. ``node_label``: the label that names the node (the resource);
    ``kind``: a metric name's type in the family catalogue (``counter`` becomes a Sum)."""

    protocol = "OTLP"

    def __init__(
        self,
        cfg: RemoteWriteConfig,
        *,
        node_label: str,
        kind: Callable[[str], str | None],
        hardware: bool = True,
        **kwargs: object,
    ) -> None:
        super().__init__(cfg, **kwargs)  # type: ignore[arg-type]
        self._node_label = node_label
        self._kind = kind
        self._hardware = hardware

    def _protocol_headers(self) -> Mapping[str, str]:
        return OTLP_HEADERS

    def _requests(self, series: Sequence[Series]) -> Iterator[tuple[bytes, int]]:
        return encode_otlp_requests(
            series,
            self.cfg.max_samples_per_send,
            node_label=self._node_label,
            kind=self._kind,
            hardware=self._hardware,
        )

    def _classify(
        self, status: int, body: str, retry_after: str | None, *, now: float
    ) -> RemoteWriteError | None:
        return classify_otlp(status, body, retry_after, self.cfg.url, now=now)


# --------------------------------------------------------------------------- encoding
#
# The messages (opentelemetry-proto v1, metrics.proto, resource.proto, common.proto):
#   ExportMetricsServiceRequest { repeated ResourceMetrics resource_metrics = 1; }
#   ResourceMetrics { Resource resource = 1; repeated ScopeMetrics scope_metrics = 2; }
#   Resource        { repeated KeyValue attributes = 1; }
#   ScopeMetrics    { InstrumentationScope scope = 1; repeated Metric metrics = 2; }
#   InstrumentationScope { string name = 1; string version = 2; }
#   Metric          { string name = 1; string description = 2; string unit = 3;
#                     Gauge gauge = 5; Sum sum = 7; }
#   Gauge           { repeated NumberDataPoint data_points = 1; }
#   Sum             { repeated NumberDataPoint data_points = 1;
#                     AggregationTemporality aggregation_temporality = 2; bool is_monotonic = 3; }
#   NumberDataPoint { fixed64 start_time_unix_nano = 2; fixed64 time_unix_nano = 3;
#                     double as_double = 4; repeated KeyValue attributes = 7; }
#   KeyValue        { string key = 1; AnyValue value = 2; }
#   AnyValue        { string string_value = 1; }

_CUMULATIVE = 2  # AGGREGATION_TEMPORALITY_CUMULATIVE
_FIXED64 = struct.Struct("<Q")
_DOUBLE = struct.Struct("<d")


def _field(number: int, payload: bytes | bytearray, out: bytearray) -> None:
    """A length-delimited field (wire type 2)."""
    _varint(number << 3 | 2, out)
    _varint(len(payload), out)
    out += payload


def _string(number: int, text: str, out: bytearray) -> None:
    _field(number, text.encode(), out)


def _key_value(key: str, value: str) -> bytes:
    any_value = bytearray()
    _string(1, value, any_value)
    out = bytearray()
    _string(1, key, out)
    _field(2, any_value, out)
    return bytes(out)


def _point(attributes: bytes, ts_ms: int, value: float) -> bytes:
    out = bytearray()
    out.append(3 << 3 | 1)  # time_unix_nano, fixed64
    out += _FIXED64.pack(ts_ms * 1_000_000)
    out.append(4 << 3 | 1)  # as_double
    out += _DOUBLE.pack(value)
    out += attributes
    return bytes(out)


def encode_otlp_request(
    series: Sequence[Series], *, node_label: str, kind: Callable[[str], str | None]
) -> bytes:
    """One ``ExportMetricsServiceRequest`` for ``series`` (grouped by node, then name)."""
    nodes: dict[str, dict[str, list[bytes]]] = {}
    for labels, samples in series:
        name, node, attributes = "", "", bytearray()
        for key, value in labels:
            if key == "__name__":
                name = value
            elif key == node_label:
                node = value
            else:
                _field(7, _key_value(key, value), attributes)
        points = nodes.setdefault(node, {}).setdefault(name, [])
        encoded = bytes(attributes)
        points.extend(_point(encoded, ts, value) for ts, value in samples)
    request = bytearray()
    for node, metrics in nodes.items():
        resource = bytearray()
        _field(1, _key_value("service.name", SCOPE), resource)
        if node:
            _field(1, _key_value("host.name", node), resource)
        scope = bytearray()
        _string(1, SCOPE, scope)
        _string(2, __version__, scope)
        scope_metrics = bytearray()
        _field(1, scope, scope_metrics)
        for name, points in metrics.items():
            data = bytearray()
            for point in points:
                _field(1, point, data)
            metric = bytearray()
            _string(1, name, metric)
            shape, unit = SHAPES.get(name) or (kind(name) or "gauge", "")
            if unit:
                _string(3, unit, metric)
            if shape in ("counter", "updown"):
                data.append(2 << 3)  # aggregation_temporality
                _varint(_CUMULATIVE, data)
                if shape == "counter":
                    data += b"\x18\x01"  # is_monotonic = true
                _field(7, data, metric)
            else:
                _field(5, data, metric)
            _field(2, metric, scope_metrics)
        resource_metrics = bytearray()
        _field(1, resource, resource_metrics)
        _field(2, scope_metrics, resource_metrics)
        _field(1, resource_metrics, request)
    return bytes(request)


def encode_otlp_requests(
    series: Sequence[Series],
    max_samples: int,
    *,
    node_label: str,
    kind: Callable[[str], str | None],
    hardware: bool = True,
) -> Iterator[tuple[bytes, int]]:
    """Request bodies of at most ``max_samples`` data points each, with their counts; with
    ``hardware``, the ``hw.*`` series of :mod:`~cloud_gateway.remote_write.otlp_hw` too
    (derived from the whole of ``series`` before it is split)."""
    if hardware:
        series = [*series, *hardware_series(series, node_label)]
    for batch in split_series(series, max_samples):
        n = sum(len(samples) for _, samples in batch)
        yield encode_otlp_request(batch, node_label=node_label, kind=kind), n
