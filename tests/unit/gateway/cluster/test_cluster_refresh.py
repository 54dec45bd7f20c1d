"""The fleet view is re-read after every claim NOTIFY, even one heard while a read of
the fleet is under way (issue 16 follow-up, haproxy redispatch).

A claim's NOTIFY can arrive while the fleet is being read on a pooled connection whose
snapshot predates the claim's commit: that read returns the row as it was before the
claim (an agent shed by its gateway and back on the same gateway within a few ms: the
release wrote ``connected = false``, without NOTIFY, then the claim). Before, the read
that ended after the NOTIFY marked the view fresh and wiped the re-read the NOTIFY had
asked for: the node stayed listed offline (owner alive, ``connected`` false) until the
next periodic refresh (``refresh_seconds``, 30 s) while its owner held it."""

from __future__ import annotations

import asyncio
from typing import Any

from cloud_gateway.cluster.directory import NodeEntry, NodeFacts
from cloud_gateway.cluster.members import Member
from cloud_gateway.cluster.membership import Cluster


def entry(connected: bool, epoch: int) -> NodeEntry:
    return NodeEntry(
        node="edge-1",
        gateway="gw-c",
        epoch=epoch,
        first_seen=1.0,
        last_seen=2.0,
        facts=NodeFacts(),
        connected=connected,
        last_disconnect_reason="",
    )


class SlowDirectory:
    """Heartbeats at once; each read of the fleet returns ``rows`` as they were when the
    read began, and ends only when ``finish`` is set."""

    def __init__(self) -> None:
        self.gateway, self.instance = "gw-b", "b" * 16
        self.on_claim: Any = None
        self.rows = [entry(connected=False, epoch=7)]  # released by gw-c, no NOTIFY
        self.reads = 0
        self.started = asyncio.Event()
        self.finish = asyncio.Event()

    async def heartbeat(self, **_: object) -> list[Member]:
        return [
            Member(id=g, advertise="x:1", heartbeat_age=0, nodes=1, up_seconds=1)
            for g in ("gw-b", "gw-c")
        ]

    async def ensure_listening(self) -> bool:
        return False

    async def lead(self) -> bool:
        return False

    def step_down(self) -> None:
        pass

    async def entries(self) -> list[NodeEntry]:
        snapshot = list(self.rows)
        self.reads += 1
        self.started.set()
        await self.finish.wait()
        return snapshot


async def test_a_claim_heard_during_a_read_of_the_fleet_is_read_next_tick() -> None:
    directory = SlowDirectory()
    cluster = Cluster(
        directory,  # type: ignore[arg-type]
        advertise="10.0.0.2:7000",
        heartbeat_seconds=1.0,
        ttl_seconds=5.0,
        on_lost=lambda node, owner: None,
        on_fenced=lambda reason: None,
        refresh_seconds=3600.0,
    )
    tick = asyncio.create_task(cluster.tick())  # first tick: the fleet is read
    await directory.started.wait()
    # gw-c claims the node again meanwhile: committed, and NOTIFY heard, before the read
    # (its snapshot older than the claim) returns
    directory.rows = [entry(connected=True, epoch=8)]
    directory.on_claim("edge-1", "gw-c", 8)
    directory.finish.set()
    await tick
    assert directory.reads == 1
    assert not cluster.entries["edge-1"].connected  # the read's snapshot: before the claim
    await cluster.tick()  # the NOTIFY asked for a fresh read: this tick makes it
    assert directory.reads == 2, "the claim heard during the read was never read"
    assert cluster.entries["edge-1"] == entry(connected=True, epoch=8)
    owner = cluster.owner_of("edge-1")
    assert owner is not None and owner.id == "gw-c"
    await cluster.tick()  # nothing heard since: no read before refresh_seconds
    assert directory.reads == 2
