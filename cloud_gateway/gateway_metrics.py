"""The gateway's own metrics (``gpurelay_gateway_*``), as families for the exposition."""

from __future__ import annotations

from collections.abc import Mapping

from cloud_gateway.auth_policy import REASONS
from cloud_gateway.exposition import FamilySamples
from cloud_gateway.ingest import IngestStats
from cloud_gateway.registry import NodeState
from edge_agent import __version__
from edge_agent.model import Family, MetricType, Sample


def _family(name: str, kind: MetricType, help_text: str) -> Family:
    return Family(name=name, type=kind, help=help_text)


INFO = _family("gpurelay_gateway_info", "gauge", "Gateway build.")
NODES = _family("gpurelay_gateway_nodes", "gauge", "Nodes known to the gateway, by state.")
AUTH = _family("gpurelay_gateway_auth_failures_total", "counter", "Refused SSH logins, by reason.")
PROTOCOL = _family(
    "gpurelay_gateway_protocol_errors_total",
    "counter",
    "Connections closed for breaking the wire contract, by error code.",
)
BATCHES = _family("gpurelay_gateway_batches_total", "counter", "Value batches received.")
DUPLICATES = _family(
    "gpurelay_gateway_duplicate_batches_total",
    "counter",
    "Batches received again (already applied; acknowledged, not re-applied).",
)
BYTES = _family(
    "gpurelay_gateway_received_bytes_total", "counter", "Telemetry channel bytes received."
)
REJECTED = _family(
    "gpurelay_gateway_rejected_series_total", "counter", "Declared series refused, by reason."
)
REPLACED = _family(
    "gpurelay_gateway_replaced_connections_total",
    "counter",
    "Connections closed because the same node connected again.",
)
CHANNELS = _family("gpurelay_gateway_channels", "gauge", "Open telemetry channels.")
BODIES = _family(
    "gpurelay_gateway_metrics_bodies_built_total",
    "counter",
    "/metrics bodies (and their gzip) built; scrapes of an unchanged body share one.",
)
PROXY = _family(
    "gpurelay_gateway_proxy_requests_total",
    "counter",
    "Scrapes relayed through a tunnel by node name, by HTTP status returned.",
)
PUBLISHED = _family(
    "gpurelay_gateway_published_endpoints", "gauge", "NODE:PORT endpoints reachable now."
)
PUBLISH_REFUSED = _family(
    "gpurelay_gateway_publish_refused_total",
    "counter",
    "Endpoints an agent offered that the gateway refused (name taken, invalid).",
)
HTTP = _family("gpurelay_gateway_http_requests_total", "counter", "HTTP requests, by endpoint.")


def _one(fam: Family, value: float, labels: tuple[tuple[str, str], ...] = ()) -> FamilySamples:
    return fam, [Sample(fam.name, labels, float(value))]


def _by(fam: Family, label: str, counts: Mapping[str, int]) -> FamilySamples:
    return fam, [Sample(fam.name, ((label, k),), float(v)) for k, v in sorted(counts.items())]


def gateway_families(
    *,
    states: Mapping[str, NodeState],
    auth_failures: Mapping[str, int],
    protocol_errors: Mapping[str, int],
    ingest: IngestStats,
    channels: int,
    bodies_built: int,
    http_requests: Mapping[str, int],
    proxy_requests: Mapping[int, int] | None = None,
    published: int = 0,
    publish_refused: int = 0,
) -> list[FamilySamples]:
    by_state = {s: 0 for s in ("online", "stale", "offline")}
    for state in states.values():
        by_state[state] += 1
    auth = dict.fromkeys(REASONS, 0) | {"not_a_certificate": 0} | dict(auth_failures)
    return [
        _one(INFO, 1, (("version", __version__),)),
        _by(NODES, "state", by_state),
        _by(AUTH, "reason", auth),
        _by(PROTOCOL, "code", protocol_errors),
        _one(BATCHES, ingest.batches),
        _one(DUPLICATES, ingest.duplicates),
        _one(BYTES, ingest.bytes),
        _by(REJECTED, "reason", ingest.rejected_series),
        _one(REPLACED, ingest.replaced_connections),
        _one(CHANNELS, channels),
        _one(BODIES, bodies_built),
        _by(HTTP, "endpoint", http_requests),
        _by(PROXY, "code", {str(k): v for k, v in (proxy_requests or {}).items()}),
        _one(PUBLISHED, published),
        _one(PUBLISH_REFUSED, publish_refused),
    ]
