"""Shedding when a gateway joins a small fleet: the old gateways make room down to the
fair share itself while one holds less than the share less the slack (else every old
gateway keeps its slack, and the newcomer of 3 x 11 nodes takes none)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cloud_gateway.cluster.membership import Cluster, to_shed
from cloud_gateway.cluster.store_pg import Member


@pytest.mark.parametrize(
    ("owned", "total", "lightest", "expected"),
    [
        (11, 33, None, 0),  # 4 live, share 9: within the slack, nobody far below
        (11, 33, 0, 1),  # a newcomer holds none: down to the share
        (10, 33, 6, 1),  # still below 9 - 2
        (10, 33, 7, 0),  # at the share less the slack: the slack again
        (9, 33, 0, 0),  # never below the share
        (12, 34, 8, 1),  # above the share plus the slack: as before
        (300, 1000, 200, 1),  # share 250, slack 12: far below 238
        (260, 1000, 240, 0),  # within 250 + 12, nobody below 238
    ],
)
def test_down_to_the_share_while_a_gateway_is_far_below_it(
    owned: int, total: int, lightest: int | None, expected: int
) -> None:
    assert to_shed(owned, total, 4, per_tick=1, lightest=lightest) == expected


@pytest.mark.parametrize("load", [[11, 11, 11], [12, 11, 11], [14, 13, 13], [300, 300, 300]])
def test_a_newcomer_gets_its_share_less_the_slack_and_then_nothing_moves(
    load: list[int],
) -> None:
    """Each tick every gateway decides on the others' counts of the tick before (a
    heartbeat late); what is shed lands on the lightest gateway (haproxy's leastconn)."""
    load = [*load, 0]
    total, live = sum(load), len(load)
    fair = -(-total // live)
    slack = max(2, fair // 20)
    heard = list(load)
    quiet = 0
    for _ in range(200):
        shed = []
        for i, n in enumerate(load):
            others = [h for j, h in enumerate(heard) if j != i]
            shed.append(to_shed(n, sum(others) + n, live, per_tick=1, lightest=min(others)))
        heard = list(load)
        for i, k in enumerate(shed):
            load[i] -= k
            load[load.index(min(load))] += k
        quiet = 0 if any(shed) else quiet + 1
        if quiet == 10:
            break
    assert quiet == 10, load  # settled: no ping-pong
    assert sum(load) == total and min(load) >= total // live - slack, load
    assert max(load) <= fair + slack, load


def test_the_gateway_passes_the_lightest_members_count() -> None:
    cluster, shed = holding("gw-a", 11)
    cluster.members = [
        Member("gw-a", "a:1", 0.1, 11, 60.0),
        Member("gw-b", "b:1", 0.1, 11, 60.0),
        Member("gw-c", "c:1", 0.1, 11, 60.0),
        Member("gw-d", "d:1", 0.1, 0, 1.0),  # joined
    ]
    cluster._shed()
    assert shed == []  # once could be the others' counts lagging a heartbeat
    cluster._shed()
    assert shed == [["edge-000"]]  # 1 per heartbeat of 0.5 s, the longest held first
    del cluster.owned["edge-000"]  # released when its connection closed
    cluster.members[1:] = [
        Member("gw-b", "b:1", 0.1, 9, 60.0),
        Member("gw-c", "c:1", 0.1, 9, 60.0),
        Member("gw-d", "d:1", 0.1, 7, 3.0),  # 35 nodes: share 9, 9 - 2: the slack again
    ]
    cluster._shed()
    cluster._shed()
    assert shed == [["edge-000"]]


def test_agents_in_flight_do_not_lower_the_share() -> None:
    """Between a GOODBYE and its claim elsewhere an agent is counted on no gateway (1-3 s
    of reconnecting): the fleet seems smaller, the share too, and an old gateway shed below
    the true share onto another old one (34 nodes seen as 31: share 8, not 9)."""
    cluster, shed = holding("gw-b", 9)
    cluster.members = [
        Member("gw-a", "a:1", 0.1, 11, 60.0),
        Member("gw-b", "b:1", 0.1, 9, 60.0),
        Member("gw-c", "c:1", 0.1, 11, 60.0),
        Member("gw-d", "d:1", 0.1, 3, 3.0),
    ]
    cluster._shed()  # 34: share 9
    cluster.members[0] = Member("gw-a", "a:1", 0.1, 10, 60.0)
    cluster.members[2] = Member("gw-c", "c:1", 0.1, 9, 60.0)
    for _ in range(3):  # 31, three agents reconnecting
        cluster._shed()
    assert shed == []


def holding(gateway: str, nodes: int) -> tuple[Cluster, list[list[str]]]:
    """A member ``gateway`` of a cluster without a directory (heartbeat 0.5 s, ttl 3 s)
    owning ``nodes`` nodes, and the lists of nodes it sheds."""
    shed: list[list[str]] = []
    directory = SimpleNamespace(gateway=gateway, on_claim=None)
    cluster = Cluster(
        directory,  # type: ignore[arg-type]
        advertise="127.0.0.1:1",
        heartbeat_seconds=0.5,
        ttl_seconds=3.0,
        on_lost=lambda node, owner: None,
        on_fenced=lambda reason: None,
        on_shed=shed.append,
    )
    cluster.owned = {f"edge-{i:03d}": 1 for i in range(nodes)}
    return cluster, shed
