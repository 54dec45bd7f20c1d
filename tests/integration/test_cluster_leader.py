"""One leader among the gateways (a PostgreSQL advisory lock, tried on every heartbeat)
answers for the nodes of dead gateways; when its session ends, another takes over on its
next heartbeat. Against a real PostgreSQL; the dead gateway is a members row made old."""

from __future__ import annotations

import asyncio
import time

import pytest

from cloud_gateway.cluster.membership import Cluster, cluster_families
from cloud_gateway.cluster.store_pg import PostgresDirectory
from tests.integration.test_cluster_membership import FACTS, Member


@pytest.fixture
def dsn(pg_database: str) -> str:
    return pg_database


async def _dead_gateway(dsn: str, node: str) -> None:
    """Gateway gw-dead claimed ``node`` and then died: its heartbeat is an hour old."""
    import asyncpg

    dead = PostgresDirectory(dsn, gateway="gw-dead")
    await dead.open()
    try:
        await dead.heartbeat(advertise="127.0.0.1:1", nodes=1, started=True)
        await dead.claim(node, FACTS, now=1000.0)
    finally:
        await dead.close()
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            "UPDATE gpurelay_gateways SET heartbeat = now() - interval '1 hour'"
            " WHERE id = 'gw-dead'"
        )
    finally:
        await conn.close()


async def _terminate_session(dsn: str, pid: int, *, ended: bool = False) -> None:
    """End a backend from outside (what a dead gateway's host or a cut link does), and
    wait until the server has let it go (bounded: 10 s)."""
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        if not ended:
            assert await conn.fetchval("SELECT pg_terminate_backend($1)", pid)
        deadline = time.monotonic() + 10
        while await conn.fetchval("SELECT count(*) FROM pg_stat_activity WHERE pid = $1", pid):
            assert time.monotonic() < deadline, "the terminated backend is still there"
            await asyncio.sleep(0.05)
    finally:
        await conn.close()


async def _heartbeats_until_leading(cluster: Cluster, bound: float = 10.0) -> int:
    """Heartbeats (0.1 s apart) until ``cluster`` leads: the server releases a dead
    session's lock as the backend exits, a moment after the session is seen gone."""
    deadline = time.monotonic() + bound
    beats = 0
    while not cluster.leader:
        assert time.monotonic() < deadline, f"no lead after {beats} heartbeats in {bound} s"
        if beats:
            await asyncio.sleep(0.1)
        await cluster.tick()
        beats += 1
    return beats


def _leader(cluster: Cluster) -> float:
    fams = {f.name: s for f, s in cluster_families(cluster)}
    return fams["gpurelay_gateway_cluster_leader"][0].value


async def test_one_leader_answers_for_dead_gateways_and_another_takes_over(dsn: str) -> None:
    await _dead_gateway(dsn, "edge-dead")
    a, b = Member(dsn, "gw-a"), Member(dsn, "gw-b")
    await a.cluster.start()
    await b.cluster.start()
    try:
        await a.cluster.claim("edge-a", FACTS)
        for _ in range(2):
            await a.cluster.tick()
            await b.cluster.tick()
        assert [a.cluster.leader, b.cluster.leader] == [True, False]  # a tried first
        assert [_leader(a.cluster), _leader(b.cluster)] == [1.0, 0.0]
        assert [e.node for e in a.cluster.orphans(here=set())] == ["edge-dead"]
        assert b.cluster.orphans(here=set()) == []  # not the leader: nothing
        # a's leader session ends: b leads on its next heartbeat, a steps down on its own
        leading = a.cluster.directory._leader
        assert leading is not None
        await _terminate_session(dsn, leading.get_server_pid())
        await _heartbeats_until_leading(b.cluster)
        await a.cluster.tick()
        assert [a.cluster.leader, b.cluster.leader] == [False, True]
        assert [e.node for e in b.cluster.orphans(here=set())] == ["edge-dead"]
        assert a.cluster.orphans(here=set()) == []
        assert a.cluster.stats.directory_errors["leader"] == 0  # a stepped down cleanly
        # the dead gateway's node reconnects through a: nobody answers for it offline
        await a.cluster.claim("edge-dead", FACTS)
        await b.cluster.tick()
        assert b.cluster.orphans(here=set()) == []
        # b stops: a leads at one of its next heartbeats
        leading = b.cluster.directory._leader
        assert leading is not None
        pid = leading.get_server_pid()
        await b.cluster.stop()
        await _terminate_session(dsn, pid, ended=True)
        await _heartbeats_until_leading(a.cluster)
    finally:
        await a.cluster.stop()
        await b.cluster.stop()


async def test_a_gateway_that_cannot_heartbeat_steps_down(dsn: str) -> None:
    a = Member(dsn, "gw-a")
    await a.cluster.start()
    try:
        await a.cluster.tick()
        assert a.cluster.leader
        pool = a.cluster.directory._pool
        a.cluster.directory._pool = None  # every directory call fails, as when PG is gone
        await a.cluster.tick()
        assert not a.cluster.leader and a.cluster.directory._leader is None
        a.cluster.directory._pool = pool
        await _heartbeats_until_leading(a.cluster)
    finally:
        await a.cluster.stop()
