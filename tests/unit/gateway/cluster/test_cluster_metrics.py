"""The cluster's own families: throttled claims and the peer listener's connections."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from cloud_gateway.cluster.membership import ClusterStats, cluster_families
from cloud_gateway.listener import ConnectionStats


def values(families: list[Any]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, s.labels): s.value for _, samples in families for s in samples}


def test_throttled_claims_and_peer_connections_are_exported() -> None:
    stats = ClusterStats(claims=12, claims_throttled=30)
    cluster = SimpleNamespace(
        stats=stats, members=[], ttl_seconds=10.0, owned={"edge-1": 1}, leader=False, fenced=False
    )
    peers = ConnectionStats(open=3)
    peers.closed["evicted"] += 50
    got = values(cluster_families(cluster, peers))  # type: ignore[arg-type]
    assert got[("gpurelay_gateway_cluster_claims_throttled_total", ())] == 30
    assert got[("gpurelay_gateway_cluster_peer_connections", ())] == 3
    closed = "gpurelay_gateway_cluster_peer_connections_closed_total"
    assert got[(closed, (("reason", "evicted"),))] == 50
    assert got[(closed, (("reason", "refused"),))] == 0  # every reason from the start
    # before the peer listener is up: zeros, not missing series
    got = values(cluster_families(cluster))  # type: ignore[arg-type]
    assert got[("gpurelay_gateway_cluster_peer_connections", ())] == 0
