"""PostgreSQL stopped under three running gateway processes (harness/cluster.py): the
nodes they own keep flowing, a node that was not connected is refused with a clear error,
each gateway fences itself (GOODBYE to its agents) before the others could take its nodes,
and when PostgreSQL is back the cluster heals by itself.

Heartbeat 1 s, TTL 8 s: a gateway that has not completed a heartbeat for TTL - heartbeat
(7 s, counted from when it sent its last good one) lets its agents go. 10 simulated agents
and 2 real agents; bounds are wide and the measured figures printed."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from harness.cluster import Cluster, ClusterSpec, running_cluster
from harness.waiting import wait_until

HEARTBEAT = 1.0
TTL = 8.0
HEALED_WITHIN = 60.0  # PostgreSQL started again to every node online on a gateway


@pytest.fixture
def cluster(tmp_path: Path, postgres_bin: None, haproxy_bin: Path) -> Iterator[Cluster]:
    spec = ClusterSpec(simulated=10, real=2, heartbeat_seconds=HEARTBEAT, ttl_seconds=TTL)
    with running_cluster(tmp_path, spec, haproxy_bin=haproxy_bin) as c:
        try:
            c.wait_settled(90)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{c.logs()}") from exc
        yield c


def batches(c: Cluster) -> dict[str, int]:
    """Batches each gateway took from each node it holds (its own /api/v1/nodes)."""
    out = {}
    for gid in c.live():
        for name, doc in c.nodes(gid).items():
            if doc.get("gateway") == gid and doc["batches_received"] is not None:
                out[name] = doc["batches_received"]
    return out


def first_time(c: Cluster, text: str, gateways: list[str]) -> Callable[[], bool]:
    return lambda: all(c.grep(g, text) for g in gateways)


def test_postgres_stopped_nodes_flow_new_ones_are_refused_fencing_then_healing(
    cluster: Cluster,
) -> None:
    c = cluster
    gateways = c.live()
    before = batches(c)
    assert set(before) == set(c.node_names), before
    acked = {n: a.metric("gpurelay_agent_gateway_acked_seq") for n, a in c.agents.items()}

    stopped = time.time()
    c.postgres.stop()
    newcomer = c.add_agent("edge-late")

    # owned nodes keep flowing: every node sends more batches to its gateway before the
    # fence (TTL - 2 x heartbeat = 6 s at the earliest); the gateways' own logs say that
    # none had fenced yet when the batches were counted (not a clock: this machine is busy)
    def grew() -> dict[str, int]:
        during = batches(c)
        return {n: during.get(n, 0) - before[n] for n in before}

    wait_until(
        lambda: all(g >= 1 for g in grew().values()),
        TTL,
        "every node sent batches during the outage",
        poll=0.5,
    )
    fenced = [g for g in gateways if c.grep(g, "lost the node directory")]
    assert not fenced, f"{fenced} fenced before every node's batches were counted"
    wait_until(
        lambda: all(a.metric("gpurelay_agent_gateway_acked_seq") > acked[n] for n, a in
                    c.agents.items() if n in acked),
        5,
        "the real agents acknowledged during the outage",
    )  # fmt: skip

    # a new node is refused with a clear error
    wait_until(
        lambda: "refused our data (unavailable)" in newcomer.log.read_text(errors="replace"),
        15,
        "the newcomer refused with ERROR 'unavailable'",
        alive=[newcomer],
    )

    # self-fencing after the TTL: each gateway lets its agents go (GOODBYE)
    wait_until(first_time(c, "lost the node directory", gateways), TTL + 15, "every fence")
    fenced_after = time.time() - stopped

    # each gateway logs its fence, then says GOODBYE: its agents log the reason just after
    def goodbyes() -> list[str]:
        return [
            n for n, a in c.agents.items()
            if n in acked and "lost the node directory" in a.log.read_text(errors="replace")
        ]  # fmt: skip

    wait_until(lambda: set(goodbyes()) == set(acked), 10, "every real agent told GOODBYE")
    figures = f"fenced {fenced_after:.1f} s after PostgreSQL stopped (ttl {TTL:g} s)"
    print(figures)
    assert TTL - 2 * HEARTBEAT - 0.5 <= fenced_after <= TTL + 15, figures

    # PostgreSQL back: the cluster heals by itself, the newcomer included
    time.sleep(2)
    c.postgres.start()
    restarted = time.time()
    for gid in gateways:
        wait_until(
            lambda gid=gid: c.all_owned(gid, gateways),  # type: ignore[misc]
            HEALED_WITHIN,
            f"every node online again, as {gid} lists them",
            poll=0.5,
        )
    healed_after = time.time() - restarted
    print(f"{figures}; healed {healed_after:.1f} s after PostgreSQL started again")
    assert "edge-late" in c.owners(gateways[0])
