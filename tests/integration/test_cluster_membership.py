"""A gateway's membership of a cluster (cloud_gateway.cluster.membership) against a real PostgreSQL:
newer claims win across gateways, a gateway that loses the directory fences itself before
the others could take its nodes, and heals when the directory is back."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from cloud_gateway.cluster.directory import DirectoryError, NodeFacts
from cloud_gateway.cluster.membership import ClaimRefused, Cluster
from cloud_gateway.cluster.store_pg import PostgresDirectory
from harness.postgres import PostgresServer

FACTS = NodeFacts(agent_version="1.0", hostname="edge", backend="simulated")


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Member:
    """A Cluster with what it was told recorded."""

    def __init__(self, dsn: str, gateway: str, clock: Clock | None = None) -> None:
        self.lost: list[tuple[str, str]] = []
        self.fenced: list[str] = []
        self.moved = asyncio.Event()
        self.clock = clock or Clock()

        def on_lost(node: str, owner: str) -> None:
            self.lost.append((node, owner))
            self.moved.set()

        self.cluster = Cluster(
            PostgresDirectory(dsn, gateway=gateway),
            advertise=f"127.0.0.1:{9400 + len(gateway)}",
            heartbeat_seconds=1.0,
            ttl_seconds=5.0,
            on_lost=on_lost,
            on_fenced=self.fenced.append,
            refresh_seconds=0.0,
            monotonic=self.clock,
        )


@pytest.fixture
def dsn(pg_database: str) -> str:
    return pg_database


async def test_a_newer_claim_on_another_gateway_takes_the_node_away(dsn: str) -> None:
    a, b = Member(dsn, "gw-a"), Member(dsn, "gw-b")
    await a.cluster.start()
    await b.cluster.start()
    try:
        epoch_a = await a.cluster.claim("edge-1", FACTS)
        await a.cluster.claim("edge-2", FACTS)
        epoch_b = await b.cluster.claim("edge-1", FACTS)  # the agent reconnected through b
        assert epoch_b == epoch_a + 1
        await asyncio.wait_for(a.moved.wait(), 10)  # NOTIFY, not a poll
        assert a.lost == [("edge-1", "gw-b")]
        assert a.cluster.owned == {"edge-2": 1} and b.cluster.owned == {"edge-1": 2}
        assert a.cluster.stats.lost_claims == 1
        # a's connection ends late: b's entry stays connected and b's
        a.cluster.release("edge-1", epoch_a, "replaced")
        await a.cluster.tick()
        await b.cluster.tick()  # refreshes b's fleet view
        entry = b.cluster.entries["edge-1"]
        assert (entry.gateway, entry.epoch, entry.connected) == ("gw-b", 2, True)
        # every gateway answers for the whole fleet: who owns what, and where to reach it
        owner = b.cluster.owner_of("edge-2")
        assert owner is not None and owner.id == "gw-a"
        assert {m.id: m.nodes for m in b.cluster.members} == {"gw-a": 1, "gw-b": 1}
    finally:
        await a.cluster.stop()
        await b.cluster.stop()


async def test_last_seen_is_written_in_batches_at_the_heartbeat(dsn: str) -> None:
    a = Member(dsn, "gw-a")
    await a.cluster.start()
    try:
        await a.cluster.claim("edge-1", FACTS)
        before = (await a.cluster.directory.entries())[0].last_seen
        a.cluster.seen("edge-1", before + 50)
        a.cluster.seen("edge-unowned", before + 50)  # not ours: not written
        assert (await a.cluster.directory.entries())[0].last_seen == before  # not yet
        await a.cluster.tick()
        assert [e.last_seen for e in await a.cluster.directory.entries()] == [before + 50]
    finally:
        await a.cluster.stop()


async def test_a_gateway_without_its_directory_fences_itself_then_heals(tmp_path: Path) -> None:
    server = PostgresServer.find()  # its own server: this test stops it
    try:
        server.start()
        a = Member(server.dsn, "gw-a")
        await a.cluster.start()
        await a.cluster.claim("edge-1", FACTS)
        server.stop()  # PostgreSQL down

        # within ttl - heartbeat: owned nodes keep flowing, new claims are refused clearly
        a.clock.t += 1
        await a.cluster.tick()
        assert not a.cluster.fenced and a.cluster.owned == {"edge-1": 1}
        with pytest.raises(ClaimRefused, match="cannot record the claim in the node directory"):
            await a.cluster.claim("edge-2", FACTS)
        assert a.cluster.stats.directory_errors["claim"] == 1

        # ttl - heartbeat after the last heartbeat that got through: fenced, nodes let go
        a.clock.t += 3
        await a.cluster.tick()
        assert a.cluster.fenced and a.cluster.owned == {}
        assert len(a.fenced) == 1 and "lost the node directory" in a.fenced[0]
        assert a.cluster.stats.fencing_events == 1
        with pytest.raises(ClaimRefused, match="fenced"):
            await a.cluster.claim("edge-1", FACTS)
        a.clock.t += 10
        await a.cluster.tick()
        assert a.cluster.stats.fencing_events == 1  # once per outage

        server.start()  # back: the next heartbeat heals, claims resume
        await a.cluster.tick()
        assert not a.cluster.fenced
        assert await a.cluster.claim("edge-1", FACTS) == 2
        await a.cluster.stop()
    finally:
        server.remove()


async def test_asyncpgs_pool_says_a_lost_database_in_one_line_now_and_then(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """asyncpg's pool reconnects to its minimum size after every failed acquire and logs
    each failure with a full traceback (logger ``asyncpg.pool``): during an outage one
    every heartbeat, beside the gateway's own clear lines. One line, now and then."""
    server = PostgresServer.find()  # its own server: this test stops it
    directory = PostgresDirectory(server.dsn, gateway="gw-a")
    # as in a fresh process: no throttle left by an earlier test's outage
    monkeypatch.setattr(logging.getLogger("asyncpg.pool"), "filters", [])
    try:
        server.start()
        await directory.open()
        server.stop()  # PostgreSQL down
        caplog.set_level(logging.WARNING, logger="asyncpg")
        for _ in range(8):  # the gateway's heartbeats, quicker
            with pytest.raises(DirectoryError):
                await directory.members()
            await asyncio.sleep(0.5)
        pool = [r for r in caplog.records if r.name.startswith("asyncpg")]
        assert len(pool) == 1, [r.getMessage() for r in pool]
        [line] = pool
        assert line.exc_info is None and line.exc_text is None, "a traceback"
        text = caplog.text.strip()
        assert "\n" not in line.getMessage()
        assert "PostgreSQL node directory" in line.getMessage(), text
        assert "Connect call failed" in line.getMessage() or "refused" in line.getMessage(), text
    finally:
        await directory.close()
        server.remove()
