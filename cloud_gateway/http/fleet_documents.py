"""The API's view of nodes this gateway does not hold: owned by another gateway of the
cluster, or known from the inventory of an earlier run (offline until they reconnect);
and of the gateways themselves (``/api/v1/gateways``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from cloud_gateway.cluster.directory import NodeEntry
from cloud_gateway.http.models import Gateway, NodeSummary, TargetGroup

if TYPE_CHECKING:
    from cloud_gateway.cluster.store_pg import Member


def entry_document(
    entry: NodeEntry, owner: Member | None, now: float, *, clustered: bool = True
) -> NodeSummary:
    """The same keys as a held node's document (cloud_gateway.http.api.node_document);
    what only the owner knows (series, counters) is null. ``state``: online when its
    owner is a live gateway that holds its connection, else offline; ``published``: the
    endpoints its owner wrote to the directory, while it is online (as /api/v1/sd);
    ``gateway`` and ``gateway_alive`` only ``clustered`` (one gateway's inventory names
    no owner)."""
    facts = entry.facts
    online = owner is not None and entry.connected
    doc: NodeSummary = {
        "published": list(entry.published) if online else [],
        "name": entry.node,
        "state": "online" if online else "offline",
        "gateway": entry.gateway,
        "gateway_alive": owner is not None,
        "domain": facts.domain or entry.node,
        "gpu_count": len(facts.gpus),
        "gpu_models": sorted({g.name for g in facts.gpus}),
        "agent_version": facts.agent_version,
        "backend": facts.backend,
        "remote": facts.remote,
        "connected_since": None,
        "last_seen": entry.last_seen,
        "last_seen_seconds_ago": round(now - entry.last_seen, 3),
        "last_batch_time": None,
        "interval_seconds": facts.interval_seconds,
        "series": None,
        "batches_received": None,
        "bytes_received": None,
        "duplicate_batches": None,
        "replayed_batches": None,
        "connection_conflicts": None,
        "first_seen": entry.first_seen,
        "certificate_serial": facts.cert_serial,
        "certificate_expires": facts.cert_valid_before,
        "last_disconnect_reason": entry.last_disconnect_reason,
    }
    if not clustered:
        del doc["gateway"], doc["gateway_alive"]
    return doc


def gateway_document(member: Member, ttl: float, me: str) -> Gateway:
    alive = member.alive(ttl)
    return {
        "id": member.id,
        "advertise": member.advertise,
        "alive": alive,
        "this": member.id == me,
        "heartbeat_age_seconds": round(member.heartbeat_age, 3),
        "up_seconds": round(member.up_seconds, 3),
        "nodes": member.nodes if alive else 0,  # a dead gateway's nodes are offline
    }


def metrics_targets(
    gateways: list[tuple[str, str]], shards: int, *, scheme: str = "http"
) -> list[TargetGroup]:
    """Prometheus http_sd for the gateways' own ``/metrics``: per gateway (id, host:port),
    one target group per shard, its ``shard``/``shards`` as URL parameters
    (``__param_*``) and a ``shard`` label (else the N targets' ``up`` and scrape series
    would be one series); with one shard, the whole body (no parameters: its fast path)."""
    groups: list[TargetGroup] = []
    for gateway, address in gateways:
        for k in range(shards):
            labels = {"__metrics_path__": "/metrics", "__scheme__": scheme, "gateway": gateway}
            if shards > 1:  # shard: the N targets of one gateway differ in their labels
                labels |= {"__param_shard": str(k), "__param_shards": str(shards), "shard": str(k)}
            groups.append({"targets": [address], "labels": labels})
    return groups


def sd_groups_elsewhere(
    elsewhere: Iterable[tuple[NodeEntry, Member | None]],
) -> list[TargetGroup]:
    """http_sd target groups of the endpoints that nodes on other live gateways publish,
    as their owners wrote them to the directory (the same labels as a held node's)."""
    groups: list[TargetGroup] = []
    for entry, owner in elsewhere:
        if owner is None or not entry.connected:
            continue  # offline, or its gateway is gone: not a target anywhere
        facts = entry.facts
        for target in entry.published:
            name = target.rpartition(":")[0]
            labels = {
                "node": name,
                "via": entry.node,
                "domain": facts.domain or entry.node,
                "agent_version": facts.agent_version,
                "gpu_count": str(len(facts.gpus)) if name == entry.node else "0",
            }
            groups.append({"targets": [target], "labels": labels})
    return groups
