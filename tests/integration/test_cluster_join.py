"""A fourth gateway joins three behind haproxy (harness/cluster.py): the load spreads onto
it without a reconnect storm. Nothing tells the agents; the three gateways above their new
fair share let a few go with GOODBYE (cloud_gateway/cluster/membership.py: at most 2 a second each),
and their agents reconnect through haproxy (leastconn), mostly onto the newcomer.

Sizes (2 CI cores, next to four gateways, PostgreSQL, haproxy and two Prometheus servers):
32 simulated agents (1 GPU, a batch every second) and 2 real agents (2 GPUs, a spool).
Bounds are wide (CI is slow and noisy); the measured figures are printed and carried in
the assertion messages.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from cloud_gateway.cluster.membership import SHED_PER_SECOND, SHED_SLACK
from harness.cluster import Cluster, ClusterSpec, running_cluster
from harness.prometheus import assert_nothing_lost
from harness.waiting import wait_until
from tests.integration.test_cluster_failover import DEVICE_SERIES, held_twice

SETTLE = 90.0  # start to every node listed online everywhere
FAIR_WITHIN = 30.0  # the newcomer in haproxy to every gateway within its fair share
QUIET = 6.0  # then this long without a move (no ping-pong): settled
EXTRA_MOVES = 2  # moves beyond the newcomer's nodes (a node shed onto an old gateway)
POLL = 0.2  # s between two reads of the owners
# the busiest second of moves: every old gateway sheds at most SHED_PER_SECOND; one more
# each for the edges of a 1 s window and reconnects that arrive together
BUSIEST_FROM_ONE = SHED_PER_SECOND + 1
BUSIEST_AT_MOST = 3 * BUSIEST_FROM_ONE


@pytest.fixture
def cluster(
    tmp_path: Path, postgres_bin: None, haproxy_bin: Path, prometheus_bin: Path
) -> Iterator[Cluster]:
    """Three gateways settled, a fourth ready to join; every gateway's /metrics scraped by
    a real Prometheus every second, remote write to a shared receiver."""
    spec = ClusterSpec(gateways=3, joining=1, simulated=32, real=2, remote_write=True, scrape=True)
    with running_cluster(
        tmp_path, spec, prometheus_bin=prometheus_bin, haproxy_bin=haproxy_bin
    ) as c:
        try:
            c.wait_settled(SETTLE)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{c.logs()}") from exc
        yield c


def test_a_fourth_gateway_takes_its_share_without_a_reconnect_storm(cluster: Cluster) -> None:
    """- within FAIR_WITHIN of joining haproxy, every gateway (the newcomer too) owns at
      least its share ``total // 4`` less the shedding slack, and none more than
      ``ceil(total / 4)`` plus it; then nothing moves for QUIET seconds;
    - only the nodes that moved reconnected (the others kept their connection), about as
      many as the newcomer needed, and the busiest second carried at most BUSIEST_AT_MOST
      moves, at most BUSIEST_FROM_ONE from any one gateway;
    - no node owned twice: at the end haproxy holds one connection per node, on the
      gateway that owns it, and Prometheus never saw a device series on two gateways at
      once; every gateway lists the same owners;
    - every collection of the real agents reached the receiver."""
    assert cluster.fleet is not None and cluster.lb is not None
    old = list(cluster.gateways)
    total = len(cluster.node_names)
    time.sleep(3)  # Prometheus scrapes the settled cluster a few times
    before = cluster.owners(old[0])
    connects = {n: s["connects"] for n, s in cluster.fleet.status().items()}

    joined = cluster.join()
    added = time.time()
    live = [*old, joined]
    low = total // len(live) - SHED_SLACK
    high = -(-total // len(live)) + SHED_SLACK
    moves: list[tuple[float, str, str, str]] = []  # (s after joining, node, from, to)
    seen = dict(before)
    fair_after: float | None = None
    settled = False
    counts: Counter[str] = Counter()
    last_move = added
    while time.time() < added + FAIR_WITHIN + QUIET:
        now = time.time()
        view = cluster.view(joined)
        for node, (owner, _) in view.items():
            if owner and owner != seen.get(node):
                moves.append((now - added, node, seen.get(node, ""), owner))
                seen[node] = owner
                last_move = now
        counts = Counter(o for o, s in view.values() if s == "online")
        fair = sum(counts.values()) == total and all(low <= counts[g] <= high for g in live)
        if fair_after is None and fair:
            fair_after = now - added
        if fair and now - last_move >= QUIET:
            settled = True
            break
        time.sleep(POLL)
    moved = {m[1] for m in moves}
    sideways = [m for m in moves if m[3] != joined]
    busiest = _busiest(moves)
    from_one = max((_busiest([m for m in moves if m[2] == g]) for g in old), default=0)
    reconnected = sorted(
        n for n, s in cluster.fleet.status().items() if s["connects"] > connects[n]
    )
    figures = (
        f"{joined} joined {len(old)} gateways holding {total} nodes "
        f"({dict(Counter(before.values()))}): within [{low}, {high}] each after "
        f"{'never' if fair_after is None else f'{fair_after:.1f} s'} "
        f"({dict(sorted(counts.items()))}); {len(moves)} moves of {len(moved)} nodes over "
        f"{moves[0][0] if moves else 0:.1f}..{moves[-1][0] if moves else 0:.1f} s, "
        f"busiest second {busiest} ({busiest / max(1, len(moves)):.0%}; from one gateway "
        f"{from_one}), "
        f"{len(sideways)} not onto {joined}; {'settled' if settled else 'still moving'}; "
        f"{len(reconnected)} simulated agents reconnected; real agents moved: "
        f"{sorted(n for n in cluster.agents if n in moved)}"
    )
    print(figures)
    why = f"{figures}\nmoves: {moves}\n{cluster.logs(20)}"
    assert fair_after is not None and fair_after <= FAIR_WITHIN, why
    assert settled, why
    assert busiest <= BUSIEST_AT_MOST and from_one <= BUSIEST_FROM_ONE, why
    # about as many moves as the newcomer needed, and no agent reconnected without moving
    assert len(moves) <= counts[joined] + EXTRA_MOVES, why
    assert set(reconnected) <= moved, why

    # one owner per node: the same on every gateway, and haproxy agrees
    def same() -> bool:
        views = [cluster.owners(g) for g in live]
        return all(v == views[0] for v in views) and set(views[0]) == set(cluster.node_names)

    wait_until(same, 20, "identical owners on every gateway", poll=0.5)
    owners = cluster.owners(joined)
    through = cluster.lb.sessions()
    assert through == dict(Counter(owners.values())), (through, owners)
    time.sleep(3)  # and a few scrapes after

    # Prometheus (every gateway's /metrics, the newcomer's too) never saw a device series
    # on two gateways at once
    assert cluster.prometheus is not None
    window = int(time.time() - cluster.started) + 10
    doubles, series = held_twice(cluster.prometheus.url, DEVICE_SERIES, window)
    report = f"{figures}; Prometheus: {series} device series, {len(doubles)} held twice"
    print(report)
    assert series >= total, report
    assert not doubles, report + "\n" + "\n".join(doubles[:10])

    # remote write: every collection of every real agent, moved or not
    assert cluster.receiver is not None
    for node in cluster.agents:
        assert_nothing_lost(
            cluster.receiver,
            node,
            started=cluster.started,
            what=f"{node} ({before[node]} -> {owners[node]})",
            drained=lambda node=node: cluster.agent_drained(node),  # type: ignore[misc]
            logs=cluster.logs,
        )


def _busiest(moves: list[tuple[float, str, str, str]]) -> int:
    """The most moves in a window of 1 s."""
    return max((sum(t <= u < t + 1 for u, *_ in moves) for t, *_ in moves), default=0)
