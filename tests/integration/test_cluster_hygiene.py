"""Cluster hygiene against a real PostgreSQL (cloud_gateway.cluster.membership): a gateway restarted
with the same id hands the nodes of its earlier run to the leader (they must not vanish
from every /metrics until their agents return), and the leader forgets gateways that have
been silent for ``forget_gateways_after_seconds``."""

from __future__ import annotations

import asyncio

import pytest

from cloud_gateway.cluster.store_pg import PostgresDirectory
from tests.integration.test_cluster_membership import FACTS, Member


@pytest.fixture
def dsn(pg_database: str) -> str:
    return pg_database


async def _execute(dsn: str, sql: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


async def test_a_restarted_gateway_hands_its_old_nodes_to_the_leader(dsn: str) -> None:
    a, b = Member(dsn, "gw-a"), Member(dsn, "gw-b")
    await b.cluster.start()
    await b.cluster.tick()  # b leads
    await a.cluster.start()
    try:
        await a.cluster.claim("edge-1", FACTS)
        await a.cluster.claim("edge-2", FACTS)
        await a.cluster.tick()
        await b.cluster.tick()
        assert b.cluster.leader and b.cluster.orphans(here=set()) == []  # a answers for them
    finally:
        await a.cluster.stop()  # a crash: nothing released
    # edge-2's agent is back already, on b, before a's new run starts
    await b.cluster.claim("edge-2", FACTS)
    again = Member(dsn, "gw-a")
    await again.cluster.start()  # what the gateway does before its SSH listener accepts
    try:
        await again.cluster.tick()
        await b.cluster.tick()
        assert again.cluster.owned == {}
        assert [e.node for e in b.cluster.orphans(here={"edge-2"})] == ["edge-1"]
        entry = b.cluster.entries["edge-1"]
        assert (entry.gateway, entry.connected) == ("", False)
        assert entry.last_disconnect_reason == "gateway gw-a restarted"
        assert b.cluster.entries["edge-2"].gateway == "gw-b"  # b's claim stands
        assert b.cluster.owned.keys() == {"edge-2"}
        # the node comes back on the restarted gateway: a claim like any other
        assert await again.cluster.claim("edge-1", FACTS) == entry.epoch + 1
        await b.cluster.tick()
        assert b.cluster.orphans(here={"edge-2"}) == []
    finally:
        await again.cluster.stop()
        await b.cluster.stop()


async def test_releasing_a_previous_run_never_wipes_a_fresh_claim(dsn: str) -> None:
    """Compare-and-set on the epoch read before: a claim made since, on this gateway or
    another, stays as it is."""
    directory = PostgresDirectory(dsn, gateway="gw-a")
    await directory.open()
    try:
        for node in ("edge-1", "edge-2", "edge-3"):
            await directory.claim(node, FACTS, now=1000.0)
        stale = {e.node: e.epoch for e in await directory.entries()}
        await directory.claim("edge-2", FACTS, now=1001.0)  # reconnected here meanwhile
        other = PostgresDirectory(dsn, gateway="gw-b")
        await other.open()
        try:
            await other.claim("edge-3", FACTS, now=1001.0)  # and there
        finally:
            await other.close()
        released = await directory.release_left(stale, reason="gateway gw-a restarted")
        assert released == ["edge-1"]
        entries = {e.node: e for e in await directory.entries()}
        assert (entries["edge-1"].gateway, entries["edge-1"].connected) == ("", False)
        assert (entries["edge-2"].gateway, entries["edge-2"].connected) == ("gw-a", True)
        assert (entries["edge-3"].gateway, entries["edge-3"].connected) == ("gw-b", True)
        # a claim of a released node names no previous gateway
        claim = await directory.claim("edge-1", FACTS, now=1002.0)
        assert claim.previous_gateway is None
    finally:
        await directory.close()


async def _gone(dsn: str, gateway: str, node: str, age: str) -> None:
    """``gateway`` claimed ``node`` and died: its heartbeat is ``age`` old."""
    gone = PostgresDirectory(dsn, gateway=gateway)
    await gone.open()
    try:
        await gone.heartbeat(advertise="127.0.0.1:1", nodes=1, started=True)
        await gone.claim(node, FACTS, now=1000.0)
    finally:
        await gone.close()
    await _execute(
        dsn,
        f"UPDATE gpurelay_gateways SET heartbeat = now() - interval '{age}' WHERE id = '{gateway}'",
    )


async def test_the_leader_forgets_gateways_silent_for_a_day(dsn: str) -> None:
    await _gone(dsn, "gw-old", "edge-old", "2 days")
    await _gone(dsn, "gw-recent", "edge-recent", "1 hour")
    a = Member(dsn, "gw-a")
    assert a.cluster.forget_after_seconds == 86400  # the default
    await a.cluster.start()
    try:
        for _ in range(2):  # leads at the first; the members it read then are forgotten
            await a.cluster.tick()
        assert a.cluster.leader
        assert [m.id for m in a.cluster.members] == ["gw-a", "gw-recent"]
        old, recent = a.cluster.entries["edge-old"], a.cluster.entries["edge-recent"]
        assert (old.gateway, old.connected) == ("", False)
        assert old.last_disconnect_reason == "gateway gw-old forgotten (silent too long)"
        assert recent.gateway == "gw-recent"
        # both stay in the fleet, offline, answered for by the leader
        assert [e.node for e in a.cluster.orphans(here=set())] == ["edge-old", "edge-recent"]
        assert a.cluster.stats.directory_errors == {}
        # nothing older left: no statement on the next heartbeats
        forget = a.cluster.directory.forget_gateways
        calls: list[float] = []

        async def counted(older_than: float) -> list[str]:
            calls.append(older_than)
            return await forget(older_than)

        a.cluster.directory.forget_gateways = counted  # type: ignore[method-assign]
        await a.cluster.tick()
        assert calls == []
    finally:
        await a.cluster.stop()


async def _transactions(dsn: str) -> int:
    """Commits and rollbacks of ``dsn``'s database, once its backends are gone (a backend
    reports its counts as it exits) and the figure is steady (bounded: 20 s)."""
    import asyncpg

    server, _, db = dsn.rpartition("/")
    conn = await asyncpg.connect(f"{server}/postgres")
    try:
        deadline = asyncio.get_running_loop().time() + 20
        sql = "SELECT count(*) FROM pg_stat_activity WHERE datname = $1"
        while await conn.fetchval(sql, db):
            assert asyncio.get_running_loop().time() < deadline, "backends still there"
            await asyncio.sleep(0.05)
        last = -1
        while True:
            await conn.execute("SELECT pg_stat_clear_snapshot()")
            now = await conn.fetchval(
                "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = $1", db
            )
            if now == last:
                return int(now)
            assert asyncio.get_running_loop().time() < deadline, "the count keeps changing"
            last = now
            await asyncio.sleep(0.5)
    finally:
        await conn.close()


async def test_a_heartbeat_costs_two_transactions(dsn: str) -> None:
    """The last-seen times, the heartbeat and the member list in one transaction, the
    leader's check on its own connection, and no reset transaction when a pooled
    connection goes back (asyncpg's default made it 5). Counted by PostgreSQL."""

    async def run(ticks: int) -> int:
        before = await _transactions(dsn)
        a = Member(dsn, "gw-a")
        a.cluster.refresh_seconds = 3600.0  # the fleet's re-read is not a heartbeat's
        await a.cluster.start()
        try:
            await a.cluster.claim("edge-1", FACTS)
            for k in range(ticks):
                a.cluster.seen("edge-1", 1000.0 + k)
                await a.cluster.tick()
        finally:
            await a.cluster.stop()
        return await _transactions(dsn) - before

    await run(1)  # the schema
    few, many = await run(5), await run(45)
    assert 2 * 40 <= many - few <= 2 * 40 + 4  # autovacuum may add one or two
