"""Two gateways with one ``[cluster] gateway_id`` (issue 16 follow-up): the pure half.

At join (:func:`cloud_gateway.cluster.join.judge`) a row of another instance that still
heartbeats refuses the newcomer, one that went stale is an earlier run that died (taken
over), one not yet judged is watched for up to the ttl. A running gateway whose heartbeat
finds its row held by another instance fences itself once and counts it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from cloud_gateway.cluster.join import conflict, judge, refusal
from cloud_gateway.cluster.members import DuplicateGateway, Holder, Member, new_instance
from cloud_gateway.cluster.membership import ClaimRefused, Cluster, cluster_families
from cloud_gateway.cluster.store_pg import PostgresDirectory

MINE = "aaaaaaaaaaaaaaaa"
OTHER = Holder(instance="bbbbbbbbbbbbbbbb", advertise="10.0.0.2:7000", heartbeat=500.0, age=1.0)


def test_instances_are_random_and_short() -> None:
    ids = {new_instance() for _ in range(100)}
    assert len(ids) == 100
    assert all(len(i) == 16 and int(i, 16) >= 0 for i in ids)


def test_each_directory_has_its_own_instance() -> None:
    a = PostgresDirectory("postgresql://nowhere/db", gateway="gw-a")
    b = PostgresDirectory("postgresql://nowhere/db", gateway="gw-a")
    assert a.instance != b.instance


@pytest.mark.parametrize(
    ("found", "first", "expected"),
    [
        (None, None, "take"),  # a new id
        (Holder(instance="", advertise="x:1", heartbeat=500.0, age=0.1), None, "take"),  # old row
        (Holder(instance=MINE, advertise="x:1", heartbeat=500.0, age=0.1), None, "take"),
        (Holder(instance=OTHER.instance, advertise="x:1", heartbeat=0.0, age=10.0), None, "take"),
        (OTHER, None, "wait"),  # fresh, not judged yet: does it heartbeat again?
        (OTHER, OTHER, "wait"),  # silent since: maybe an earlier run that died
        (
            Holder(instance=OTHER.instance, advertise="x:1", heartbeat=502.0, age=0.1),
            OTHER,
            "refuse",
        ),
        (
            Holder(instance="cccccccccccccccc", advertise="x:1", heartbeat=500.0, age=0.1),
            OTHER,
            "refuse",
        ),
    ],
)
def test_judge(found: Holder | None, first: Holder | None, expected: str) -> None:
    assert judge(found, instance=MINE, ttl=10.0, first=first) == expected


def test_the_refusal_says_who_holds_the_id_and_what_to_change() -> None:
    text = refusal("gw-a", OTHER)
    for part in ("'gw-a'", "10.0.0.2:7000", "1.0s ago", "[cluster] gateway_id", "hostname"):
        assert part in text, (part, text)
    assert "left alone" in text  # its nodes were not released


def test_the_conflict_names_both_instances_and_addresses() -> None:
    text = conflict("gw-a", instance=MINE, advertise="10.0.0.1:7000", holder=OTHER, nodes=3)
    for part in (MINE, "10.0.0.1:7000", OTHER.instance, "10.0.0.2:7000", "3 node(s)"):
        assert part in text, (part, text)


class FakeDirectory:
    """What Cluster.tick asks of the directory; heartbeats fail with ``duplicate`` while set."""

    def __init__(self) -> None:
        self.gateway, self.instance = "gw-a", MINE
        self.on_claim: Any = None
        self.duplicate: DuplicateGateway | None = None
        self.stepped_down = 0

    async def heartbeat(self, **_: object) -> list[Member]:
        if self.duplicate is not None:
            raise self.duplicate
        return [
            Member(id="gw-a", advertise="10.0.0.1:7000", heartbeat_age=0, nodes=0, up_seconds=1)
        ]

    async def ensure_listening(self) -> bool:
        return False

    async def lead(self) -> bool:
        return True

    def step_down(self) -> None:
        self.stepped_down += 1

    async def entries(self) -> list[object]:
        return []


async def test_a_running_gateway_that_lost_its_row_fences_once_and_heals() -> None:
    directory = FakeDirectory()
    fenced: list[str] = []
    cluster = Cluster(
        directory,  # type: ignore[arg-type]
        advertise="10.0.0.1:7000",
        heartbeat_seconds=1.0,
        ttl_seconds=5.0,
        on_lost=lambda node, owner: None,
        on_fenced=fenced.append,
        refresh_seconds=3600.0,
    )
    cluster.owned = {"edge-1": 3, "edge-2": 4}
    await cluster.tick()
    assert cluster.leader
    directory.duplicate = DuplicateGateway("held by another instance", OTHER)
    await cluster.tick()
    assert cluster.fenced and cluster.owned == {} and not cluster.leader
    assert len(fenced) == 1 and OTHER.instance in fenced[0] and MINE in fenced[0]
    assert cluster.stats.duplicate_ids == 1
    with pytest.raises(ClaimRefused, match="another gateway runs with id gw-a"):
        await cluster.claim("edge-3", SimpleNamespace())  # type: ignore[arg-type]
    await cluster.tick()  # still held: not counted, not told again
    assert cluster.stats.duplicate_ids == 1 and len(fenced) == 1
    assert cluster.stats.fencing_events == 0  # the directory was reachable all along
    exported = {s.name: s.value for _, samples in cluster_families(cluster) for s in samples}
    assert exported["gpurelay_gateway_cluster_duplicate_id_total"] == 1
    assert exported["gpurelay_gateway_cluster_fenced"] == 1
    directory.duplicate = None  # the other left (its row cleared): this one's again
    await cluster.tick()
    assert not cluster.fenced
