"""No shedding while another member's heartbeat is late (issue 16 follow-up, haproxy
redispatch): a gateway killed with ``kill -9`` stays "alive" for the ttl, with the node
count of its last heartbeat. Its agents are back on the survivors within a second, so
they counted those nodes twice (measured: "gw-c holds 17 of 44 node(s) on 3 gateway(s):
letting 1 go", 34 nodes in all, 2 s after the kill) and, the dead one looking like a
light newcomer, let agents go towards it: those came back through haproxy onto a
survivor after their backoff, offline meanwhile, one more reconnect each."""

from __future__ import annotations

from cloud_gateway.cluster.membership import Cluster
from cloud_gateway.cluster.store_pg import Member
from tests.unit.gateway.cluster.test_cluster_shedding import holding


def survivor() -> tuple[Cluster, list[list[str]]]:
    return holding("gw-c", 17)  # 12 of its own, 5 of gw-a's


def test_a_member_silent_for_more_than_two_heartbeats_stops_the_shedding() -> None:
    cluster, shed = survivor()
    for _ in range(4):  # gw-a killed 2 s ago: not ttl-old yet, its last count kept
        cluster.members = [
            Member("gw-a", "a:1", 2.0, 10, 60.0),
            Member("gw-b", "b:1", 0.2, 17, 60.0),
            Member("gw-c", "c:1", 0.0, 17, 60.0),
        ]
        cluster._shed()
    assert shed == [], "shed towards a gateway that no longer heartbeats"
    for _ in range(3):  # gw-a ttl-old: two live gateways, 17 each: the share
        cluster.members[0] = Member("gw-a", "a:1", 3.5, 10, 60.0)
        cluster._shed()
    assert shed == []


def test_shedding_goes_on_when_every_member_heartbeats() -> None:
    cluster, shed = survivor()
    cluster.owned = {f"edge-{i:03d}": 1 for i in range(20)}
    for _ in range(2):
        cluster.members = [
            Member("gw-a", "a:1", 0.4, 4, 60.0),  # joined: the lightest, on time
            Member("gw-b", "b:1", 0.2, 10, 60.0),
            Member("gw-c", "c:1", 0.0, 20, 60.0),
        ]
        cluster._shed()
    assert shed == [["edge-000"]]
