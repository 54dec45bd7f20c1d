"""The gateway's own metrics (``gpurelay_gateway_*``), as families for the exposition.

Every label value comes from a fixed set, never from what a client or node sent
(DESIGN.md, "Trust boundaries"): route templates, reason and error codes, HTTP statuses.
A value outside its set is counted as ``other``; the free text stays in logs and in the
node's recent errors.

The ``gpurelay_gateway_remote_write_*`` families are there only while remote write is
configured (``[remote_write] url``); without it the gateway writes nothing remotely.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from http import HTTPStatus

from cloud_gateway import __version__
from cloud_gateway.cluster.membership import Cluster
from cloud_gateway.exposition.body import FamilySamples
from cloud_gateway.http.api import ENDPOINTS
from cloud_gateway.http.auth import AUTH_FAILURE_REASONS
from cloud_gateway.ingest.session import IngestStats
from cloud_gateway.listener import CLOSE_REASONS, ConnectionStats
from cloud_gateway.registry.series_policy import REFUSAL_CODES
from cloud_gateway.registry.store import NodeState
from cloud_gateway.remote_write.client import RemoteWriteStats
from cloud_gateway.remote_write.forwarder import ForwardStats
from cloud_gateway.ssh.balancer_header import REFUSALS
from cloud_gateway.ssh.enrollment import REFUSALS as ENROLL_REFUSALS
from cloud_gateway.trust.auth_policy import REASONS
from gpurelay.model import Family, MetricType, Sample
from gpurelay.wire.frames import WIRE_ERROR_CODES


def _family(name: str, kind: MetricType, help_text: str) -> Family:
    return Family(name=name, type=kind, help=help_text)


INFO = _family("gpurelay_gateway_info", "gauge", "Gateway build.")
NODES = _family("gpurelay_gateway_nodes", "gauge", "Nodes known to the gateway, by state.")
AUTH = _family("gpurelay_gateway_auth_failures_total", "counter", "Refused SSH logins, by reason.")
ISSUED = _family(
    "gpurelay_gateway_certificates_issued_total",
    "counter",
    "Node certificates issued through this gateway over SSH ([enroll] on), by reason: "
    "enroll, renew.",
)
PROTOCOL = _family(
    "gpurelay_gateway_protocol_errors_total",
    "counter",
    "Connections closed for breaking the wire contract, by error code.",
)
PROXY_REFUSED = _family(
    "gpurelay_gateway_proxy_header_refused_total",
    "counter",
    "SSH connections closed before SSH for their PROXY protocol header, by reason "
    "(only while ssh.proxy_protocol is on).",
)
BATCHES = _family("gpurelay_gateway_batches_total", "counter", "Value batches received.")
REPLAYED = _family(
    "gpurelay_gateway_replayed_batches_total",
    "counter",
    "Spooled collections replayed by agents (REPLAY frames, duplicates included).",
)
DUPLICATES = _family(
    "gpurelay_gateway_duplicate_batches_total",
    "counter",
    "Batches and replays received again (already delivered; acknowledged, not re-applied).",
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
HELP_CONFLICTS = _family(
    "gpurelay_gateway_help_conflicts_total",
    "counter",
    "Families a node declared with another HELP than the fleet's (the first one is kept).",
)
CONFLICTS = _family(
    "gpurelay_gateway_connection_conflicts_total",
    "counter",
    "Two connections fighting over one node certificate (a copied or stolen certificate).",
)
SILENT = _family(
    "gpurelay_gateway_silent_connections_closed_total",
    "counter",
    "Connections closed because nothing arrived on them for the node's silent threshold.",
)
HEARTBEATS = _family(
    "gpurelay_gateway_heartbeats_sent_total",
    "counter",
    "HEARTBEAT frames sent to agents that had been sent nothing for their heartbeat period.",
)
ACK_FRAMES = _family(
    "gpurelay_gateway_ack_frames_total",
    "counter",
    "ACK and ACK_RANGES frames sent (an agent that asks for range ACKs gets one per few "
    "batches; compare with gpurelay_gateway_batches_total).",
)
CHANNELS = _family("gpurelay_gateway_channels", "gauge", "Open telemetry channels.")
BODIES = _family(
    "gpurelay_gateway_metrics_bodies_built_total",
    "counter",
    "Rebuilds of /metrics' fleet part and gzip passes over its changed pieces; "
    "scrapes of unchanged device data share them.",
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
HTTP = _family(
    "gpurelay_gateway_http_requests_total",
    "counter",
    "HTTP requests, by route template (other: matched no route; proxy: forward-proxy form).",
)
HTTP_AUTH = _family(
    "gpurelay_gateway_http_auth_failures_total",
    "counter",
    "HTTP requests refused for their credentials: missing, bad_token, bad_password (basic "
    "auth: wrong password or unknown user), malformed.",
)
HTTP_TLS = _family(
    "gpurelay_gateway_http_tls_handshake_failures_total",
    "counter",
    "TLS handshakes on the HTTP listener that failed (plain HTTP, untrusted certificates).",
)
HTTP_OPEN = _family(
    "gpurelay_gateway_http_connections", "gauge", "Open HTTP connections (http.max_connections)."
)
HTTP_CLOSED = _family(
    "gpurelay_gateway_http_connections_closed_total",
    "counter",
    "HTTP connections the gateway closed or refused: header_timeout (no whole request in "
    "time), evicted (oldest idle one, at the cap), refused (at the cap, none idle), "
    "bad_request (a request that could not be parsed, answered 400).",
)

_RW = "gpurelay_gateway_remote_write_"
_ONLY = " (only while remote write is configured)"
RW_QUEUED = _family(
    _RW + "queued_batches",
    "gauge",
    "Collections waiting for remote write, all nodes; not yet acknowledged" + _ONLY + ".",
)
RW_PENDING = _family(
    _RW + "pending_samples", "gauge", "Samples in remote write requests in progress" + _ONLY + "."
)
RW_SENT_SAMPLES = _family(
    _RW + "sent_samples_total", "counter", "Samples the receiver accepted (2xx)" + _ONLY + "."
)
RW_FAILED_SAMPLES = _family(
    _RW + "failed_samples_total",
    "counter",
    "Samples of sends that failed: refused, or not taken (then sent again)" + _ONLY + ".",
)
RW_SENT_REQUESTS = _family(
    _RW + "sent_requests_total", "counter", "Requests the receiver accepted (2xx)" + _ONLY + "."
)
RW_RETRIED = _family(
    _RW + "retried_requests_total",
    "counter",
    "Requests not taken (a 5xx, a 429 or a transport error), sent again after a backoff"
    + _ONLY
    + ".",
)
RW_REJECTED = _family(
    _RW + "rejected_requests_total",
    "counter",
    "Requests refused for good, e.g. a 4xx (their samples are dropped)" + _ONLY + ".",
)
RW_DROPPED = _family(
    _RW + "dropped_batches_total",
    "counter",
    "Collections refused by the receiver (4xx), acknowledged anyway and lost" + _ONLY + ".",
)
RW_LATENCY = _family(
    _RW + "request_duration_seconds_total",
    "counter",
    "Time spent in request attempts that got a response; divide by "
    + _RW
    + "responses_total for the mean"
    + _ONLY
    + ".",
)
RW_RESPONSES = _family(
    _RW + "responses_total", "counter", "Request attempts that got a response" + _ONLY + "."
)
RW_LAST_LATENCY = _family(
    _RW + "last_request_duration_seconds",
    "gauge",
    "Duration of the last request attempt that got a response" + _ONLY + ".",
)

_CL = "gpurelay_gateway_cluster_"
_IN = " (only with [cluster] database)"
CL_MEMBERS = _family(
    _CL + "members", "gauge", "Live gateways of the cluster, this one included" + _IN + "."
)
CL_OWNED = _family(
    _CL + "owned_nodes", "gauge", "Nodes this gateway owns in the directory" + _IN + "."
)
CL_CLAIMS = _family(_CL + "claims_total", "counter", "Nodes this gateway claimed" + _IN + ".")
CL_LOST = _family(
    _CL + "lost_claims_total", "counter", "Nodes another gateway claimed from this one" + _IN + "."
)
CL_FENCING = _family(
    _CL + "fencing_events_total",
    "counter",
    "Times this gateway let all its nodes go, cut off from the directory" + _IN + ".",
)
CL_ERRORS = _family(
    _CL + "directory_errors_total",
    "counter",
    "Failed directory operations, by operation" + _IN + ".",
)
CL_LEADER = _family(
    _CL + "leader",
    "gauge",
    "1 while this gateway leads (answers for the nodes of dead gateways)" + _IN + ".",
)
CL_FENCED = _family(_CL + "fenced", "gauge", "1 while this gateway is fenced" + _IN + ".")
CL_DUPLICATE = _family(
    _CL + "duplicate_id_total",
    "counter",
    "Times another running gateway took this gateway's id and this one fenced itself" + _IN + ".",
)
CL_THROTTLED = _family(
    _CL + "claims_throttled_total",
    "counter",
    "Connections refused without a claim: the node connected too often to this gateway "
    "(a reconnect loop)" + _IN + ".",
)
CL_PEER_OPEN = _family(
    _CL + "peer_connections", "gauge", "Open connections to the peer listener" + _IN + "."
)
CL_PEER_CLOSED = _family(
    _CL + "peer_connections_closed_total",
    "counter",
    "Peer-listener connections the gateway closed or refused, by reason as for "
    "gpurelay_gateway_http_connections_closed_total" + _IN + ".",
)
DIRECTORY_OPERATIONS = ("claim", "release", "heartbeat", "listen", "entries", "leader")

OTHER = "other"
AUTH_REASONS = (*REASONS, "bad_certificate", "not_a_certificate", *ENROLL_REFUSALS)
HTTP_STATUSES = tuple(str(int(s)) for s in HTTPStatus)


def _one(fam: Family, value: float, labels: tuple[tuple[str, str], ...] = ()) -> FamilySamples:
    return fam, [Sample(fam.name, labels, float(value))]


def _by(fam: Family, label: str, counts: Mapping[str, int]) -> FamilySamples:
    return fam, [Sample(fam.name, ((label, k),), float(v)) for k, v in sorted(counts.items())]


def _fixed(
    fam: Family,
    label: str,
    counts: Mapping[str, int],
    values: Collection[str],
    *,
    zeros: bool = False,
) -> FamilySamples:
    """Like :func:`_by`, with every key outside ``values`` counted as ``other``;
    ``zeros``: every value of the set is there from the start."""
    folded: dict[str, int] = dict.fromkeys(values, 0) if zeros else {}
    for key, count in counts.items():
        value = key if key in values else OTHER
        folded[value] = folded.get(value, 0) + count
    return _by(fam, label, folded)


def gateway_families(
    *,
    states: Mapping[str, NodeState],
    auth_failures: Mapping[str, int],
    protocol_errors: Mapping[str, int],
    ingest: IngestStats,
    channels: int,
    bodies_built: int,
    http_requests: Mapping[str, int],
    http_connections: ConnectionStats | None = None,
    http_auth_failures: Mapping[str, int] | None = None,
    proxy_requests: Mapping[int, int] | None = None,
    published: int = 0,
    publish_refused: int = 0,
    remote_write: RemoteWriteStats | None = None,
    forwarding: ForwardStats | None = None,
    cluster: Cluster | None = None,
    certificates: FamilySamples | None = None,
    proxy_refused: Mapping[str, int] | None = None,
    issued: Mapping[str, int] | None = None,
    peer_connections: ConnectionStats | None = None,
) -> list[FamilySamples]:
    """``certificates``: the nodes' certificate expiry (:mod:`cloud_gateway.trust.cert_expiry`)."""
    by_state = {s: 0 for s in ("online", "stale", "offline")}
    for state in states.values():
        by_state[state] += 1
    connections = http_connections or ConnectionStats()
    families = [
        _one(INFO, 1, (("version", __version__),)),
        _by(NODES, "state", by_state),
        _fixed(AUTH, "reason", auth_failures, AUTH_REASONS, zeros=True),
        _fixed(PROTOCOL, "code", protocol_errors, WIRE_ERROR_CODES),
        _one(BATCHES, ingest.batches),
        _one(REPLAYED, ingest.replays),
        _one(DUPLICATES, ingest.duplicates),
        _one(BYTES, ingest.bytes),
        _fixed(REJECTED, "reason", ingest.rejected_series, REFUSAL_CODES),
        _one(REPLACED, ingest.replaced_connections),
        _one(CONFLICTS, ingest.connection_conflicts),
        _one(HELP_CONFLICTS, ingest.help_conflicts),
        _one(SILENT, ingest.silent_closed),
        _one(HEARTBEATS, ingest.heartbeats),
        _one(ACK_FRAMES, ingest.ack_frames),
        _one(CHANNELS, channels),
        _one(BODIES, bodies_built),
        _fixed(HTTP, "endpoint", http_requests, ENDPOINTS),
        _one(HTTP_OPEN, connections.open),
        _fixed(HTTP_CLOSED, "reason", connections.closed, CLOSE_REASONS, zeros=True),
        _fixed(HTTP_AUTH, "reason", http_auth_failures or {}, AUTH_FAILURE_REASONS, zeros=True),
        _one(HTTP_TLS, connections.tls_handshake_failures),
        _fixed(
            PROXY,
            "code",
            {str(k): v for k, v in (proxy_requests or {}).items()},
            HTTP_STATUSES,
        ),
        _one(PUBLISHED, published),
        _one(PUBLISH_REFUSED, publish_refused),
    ]
    if proxy_refused is not None:  # ssh.proxy_protocol on
        families.append(_fixed(PROXY_REFUSED, "reason", proxy_refused, REFUSALS, zeros=True))
    if issued is not None:  # [enroll] on
        families.append(_fixed(ISSUED, "reason", issued, ("enroll", "renew"), zeros=True))
    if remote_write is not None:
        families += _remote_write(remote_write, forwarding or ForwardStats())
    if cluster is not None:
        families += cluster_families(cluster, peer_connections)
    if certificates is not None:
        families.append(certificates)
    return families


def cluster_families(cluster: Cluster, peers: ConnectionStats | None = None) -> list[FamilySamples]:
    """``peers``: the peer listener's connections (none before it listens)."""
    stats = cluster.stats
    members = sum(1 for m in cluster.members if m.alive(cluster.ttl_seconds))
    peers = peers or ConnectionStats()
    return [
        _one(CL_MEMBERS, members),
        _one(CL_OWNED, len(cluster.owned)),
        _one(CL_CLAIMS, stats.claims),
        _one(CL_THROTTLED, stats.claims_throttled),
        _one(CL_PEER_OPEN, peers.open),
        _fixed(CL_PEER_CLOSED, "reason", peers.closed, CLOSE_REASONS, zeros=True),
        _one(CL_LOST, stats.lost_claims),
        _one(CL_FENCING, stats.fencing_events),
        _one(CL_DUPLICATE, stats.duplicate_ids),
        _fixed(CL_ERRORS, "operation", stats.directory_errors, DIRECTORY_OPERATIONS, zeros=True),
        _one(CL_LEADER, int(cluster.leader)),
        _one(CL_FENCED, int(cluster.fenced)),
    ]


def _remote_write(rw: RemoteWriteStats, fwd: ForwardStats) -> list[FamilySamples]:
    return [
        _one(RW_QUEUED, fwd.queued),
        _one(RW_PENDING, rw.pending_samples),
        _one(RW_SENT_SAMPLES, rw.sent_samples),
        _one(RW_FAILED_SAMPLES, rw.failed_samples),
        _one(RW_SENT_REQUESTS, rw.sent_requests),
        _one(RW_RETRIED, rw.retried_requests),
        _one(RW_REJECTED, rw.rejected_requests),
        _one(RW_DROPPED, fwd.dropped),
        _one(RW_LATENCY, rw.latency_seconds_sum),
        _one(RW_RESPONSES, rw.latency_seconds_count),
        _one(RW_LAST_LATENCY, rw.last_latency_seconds),
    ]
