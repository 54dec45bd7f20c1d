"""A gateway restarted with the same gateway_id (harness/cluster.py: gateway processes on
one PostgreSQL behind haproxy): the nodes its earlier run held stay in the union of the
gateways' /metrics, answered for by the leader, while their agents are away. Before, the
directory still named the restarted gateway as their owner, which no longer held them,
and the leader does not answer for a live gateway's nodes: they were in nobody's
/metrics until their agents returned."""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from harness.cluster import ClusterSpec, running_cluster
from harness.waiting import wait_until

UP = re.compile(r'^gpurelay_node_up\{[^}]*="(edge-sim-\d+)"', re.MULTILINE)


def _up(url: str) -> list[str]:
    """The nodes with a gpurelay_node_up series in a gateway's /metrics."""
    r = httpx.get(f"{url}/metrics", timeout=10)
    r.raise_for_status()
    return UP.findall(r.text)


def test_a_restarted_gateways_nodes_stay_in_the_fleets_metrics(
    tmp_path: Path, postgres_bin: None, haproxy_bin: Path
) -> None:
    spec = ClusterSpec(gateways=2, simulated=6, real=0)
    with running_cluster(tmp_path, spec, haproxy_bin=haproxy_bin) as c:
        c.wait_settled(90)
        owners = c.owners("gw-b")
        mine = sorted(n for n, g in owners.items() if g == "gw-a")
        assert mine, f"gw-a holds none of {owners}"
        assert c.fleet is not None
        c.fleet.stop()  # the agents go away, and stay away
        c.kill9("gw-a")
        gw_a = c.gateways["gw-a"]
        gw_a.start()  # the same gateway_id, a new run
        wait_until(gw_a.ready, 60, "gw-a ready again", alive=[gw_a])

        def union() -> list[str]:
            return sorted(_up(gw_a.url) + _up(c.gateways["gw-b"].url))

        # every node once in the union of the bodies (the leader answers for gw-a's)
        wait_until(
            lambda: union() == sorted(owners),
            60,
            "every node once in the gateways' /metrics",
            poll=0.5,
        )
        # gw-b, the leader, may answer for them while the restarted gw-a waits out its old
        # row; the directory names no owner once gw-a has released them (a NOTIFY, read on
        # gw-b's next tick)
        wait_until(
            lambda: all(c.view("gw-b")[n] == ("", "offline") for n in mine),
            30,
            "gw-a's old nodes owned by nobody, as gw-b lists them",
            poll=0.5,
        )
        reasons = {c.nodes("gw-b")[n]["last_disconnect_reason"] for n in mine}
        assert reasons <= {"gateway gw-a restarted", "agent disconnected"}, reasons
