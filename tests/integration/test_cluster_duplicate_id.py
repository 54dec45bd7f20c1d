"""Two gateways with one ``[cluster] gateway_id`` against a real PostgreSQL (issue 16
follow-up): a second gateway started with the id of a live one is refused, with a message
naming the id, the other's address and heartbeat age, and what to change, and the first
keeps its nodes (before, the second started and released them all, as for a restart). A
row left by a run that died (silent beyond the ttl) is a restart: the id starts again. A
running gateway whose row another instance took fences itself rather than fight."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from pathlib import Path

import pytest

from cloud_gateway.cluster.directory import DirectoryError
from cloud_gateway.cluster.members import DuplicateGateway
from cloud_gateway.cluster.membership import ClaimRefused, Cluster
from cloud_gateway.cluster.store_pg import MIGRATIONS, VERSION, PostgresDirectory
from harness.cluster import ClusterSpec, running_cluster
from harness.ports import free_ports
from harness.services import GatewayProc
from harness.waiting import wait_until
from tests.integration.test_cluster_membership import FACTS

HEARTBEAT, TTL = 0.2, 1.5


class Gw:
    """A Cluster on the real directory, with what it was told recorded."""

    def __init__(self, dsn: str, gateway: str, advertise: str) -> None:
        self.fenced: list[str] = []
        self.cluster = Cluster(
            PostgresDirectory(dsn, gateway=gateway),
            advertise=advertise,
            heartbeat_seconds=HEARTBEAT,
            ttl_seconds=TTL,
            on_lost=lambda node, owner: None,
            on_fenced=self.fenced.append,
            refresh_seconds=0.0,
        )

    async def run(self, *, start: bool = True) -> None:
        """Start (unless started), then heartbeat as the gateway does, until cancelled."""
        if start:
            await self.cluster.start()
        while True:
            await asyncio.sleep(HEARTBEAT)
            await self.cluster.tick()


@pytest.fixture
def dsn(pg_database: str) -> str:
    return pg_database


async def _sql(dsn: str, sql: str, *args: object) -> list[dict[str, object]]:
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        return [dict(r) for r in await conn.fetch(sql, *args)]
    finally:
        await conn.close()


async def _stop(task: asyncio.Task[None], gw: Gw) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, DuplicateGateway):  # refused: ended
        await task
    await gw.cluster.stop()


async def test_a_second_gateway_with_a_live_id_is_refused_and_the_first_keeps_its_nodes(
    dsn: str,
) -> None:
    first = Gw(dsn, "gw-a", "127.0.0.1:7101")
    await first.cluster.start()
    await first.cluster.claim("edge-1", FACTS)
    await first.cluster.claim("edge-2", FACTS)
    beating = asyncio.create_task(first.run(start=False))
    second = Gw(dsn, "gw-a", "127.0.0.1:7102")
    try:
        with pytest.raises(DirectoryError) as refused:
            await second.cluster.start()
        message = str(refused.value)
        for part in ("'gw-a'", "127.0.0.1:7101", "heartbeat", "[cluster] gateway_id", "hostname"):
            assert part in message, (part, message)
        await second.cluster.stop()
        await asyncio.sleep(3 * HEARTBEAT)  # the first goes on heartbeating, unbothered
        assert not beating.done()
        entries = {
            e.node: (e.gateway, e.connected) for e in await first.cluster.directory.entries()
        }
        assert entries == {"edge-1": ("gw-a", True), "edge-2": ("gw-a", True)}
        assert first.cluster.owned.keys() == {"edge-1", "edge-2"}
        assert not first.cluster.fenced and first.fenced == []
        (row,) = await _sql(dsn, "SELECT instance, advertise FROM gpurelay_gateways")
        assert row == {"instance": first.cluster.directory.instance, "advertise": "127.0.0.1:7101"}
    finally:
        await _stop(beating, first)


async def test_the_row_of_a_run_that_died_lets_the_same_id_start(dsn: str) -> None:
    first = Gw(dsn, "gw-a", "127.0.0.1:7101")
    await first.cluster.start()
    await first.cluster.claim("edge-1", FACTS)
    await first.cluster.tick()
    await first.cluster.directory.close()  # killed: no goodbye, the row left behind
    again = Gw(dsn, "gw-a", "127.0.0.1:7103")
    await again.cluster.start()  # once the row is older than the ttl
    try:
        assert again.cluster.directory.released == ["edge-1"]
        entry = again.cluster.entries["edge-1"]
        assert (entry.gateway, entry.connected) == ("", False)
        assert entry.last_disconnect_reason == "gateway gw-a restarted"
        (row,) = await _sql(dsn, "SELECT instance, advertise FROM gpurelay_gateways")
        assert row == {"instance": again.cluster.directory.instance, "advertise": "127.0.0.1:7103"}
        assert await again.cluster.claim("edge-1", FACTS) == entry.epoch + 1
    finally:
        await again.cluster.stop()


async def test_a_gateway_stopped_cleanly_is_replaced_at_once(dsn: str) -> None:
    """A clean stop clears the row's instance: a rolling restart does not wait the ttl."""
    first = Gw(dsn, "gw-a", "127.0.0.1:7101")
    await first.cluster.start()
    await first.cluster.stop()
    (row,) = await _sql(dsn, "SELECT instance FROM gpurelay_gateways")
    assert row == {"instance": ""}
    again = Gw(dsn, "gw-a", "127.0.0.1:7101")
    await again.cluster.start()
    await again.cluster.stop()


async def test_of_two_started_at_once_one_runs(dsn: str) -> None:
    a, b = Gw(dsn, "gw-a", "127.0.0.1:7101"), Gw(dsn, "gw-a", "127.0.0.1:7102")
    tasks = {asyncio.create_task(a.run()): a, asyncio.create_task(b.run()): b}
    done, running = await asyncio.wait(tasks, timeout=30, return_when=asyncio.FIRST_COMPLETED)
    try:
        assert len(done) == 1 and len(running) == 1
        (refused,) = done
        assert isinstance(refused.exception(), DuplicateGateway)
        await asyncio.sleep(5 * HEARTBEAT)
        (winner,) = running
        assert not winner.done() and not tasks[winner].cluster.fenced
    finally:
        for task, gw in tasks.items():
            await _stop(task, gw)


async def test_a_running_gateway_whose_row_was_taken_fences_itself_once(dsn: str) -> None:
    a = Gw(dsn, "gw-a", "127.0.0.1:7101")
    await a.cluster.start()
    try:
        await a.cluster.claim("edge-1", FACTS)
        await a.cluster.tick()
        intruder = "0123456789abcdef"
        await _sql(  # an operator forcing, or a race lost
            dsn,
            "UPDATE gpurelay_gateways SET instance = $1, advertise = '10.9.9.9:7000'",
            intruder,
        )
        await a.cluster.tick()
        assert a.cluster.fenced and a.cluster.owned == {}
        assert len(a.fenced) == 1 and intruder in a.fenced[0] and "10.9.9.9:7000" in a.fenced[0]
        assert a.cluster.directory.instance in a.fenced[0]
        assert a.cluster.stats.duplicate_ids == 1
        with pytest.raises(ClaimRefused, match="gw-a"):
            await a.cluster.claim("edge-1", FACTS)
        await a.cluster.tick()
        assert a.cluster.stats.duplicate_ids == 1 and len(a.fenced) == 1  # once
        (row,) = await _sql(dsn, "SELECT instance, advertise FROM gpurelay_gateways")
        assert row == {"instance": intruder, "advertise": "10.9.9.9:7000"}  # no fight
        await _sql(dsn, "UPDATE gpurelay_gateways SET instance = ''")  # the intruder left
        await a.cluster.tick()
        assert not a.cluster.fenced
        assert await a.cluster.claim("edge-1", FACTS) == 2
    finally:
        await a.cluster.stop()


async def test_a_row_written_before_instances_still_works(dsn: str) -> None:
    """A database of schema version 1 with a live-looking row of an older gateway: the
    migration adds the column (empty), and the id starts as before."""
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("CREATE TABLE gpurelay_schema (version int NOT NULL)")
        for statement in MIGRATIONS[0]:
            await conn.execute(statement)
        await conn.execute("INSERT INTO gpurelay_schema (version) VALUES (1)")
        await conn.execute(
            "INSERT INTO gpurelay_gateways (id, advertise, started, heartbeat, nodes)"
            " VALUES ('gw-a', '127.0.0.1:7100', now(), now(), 0)"
        )
    finally:
        await conn.close()
    a = Gw(dsn, "gw-a", "127.0.0.1:7101")
    await a.cluster.start()
    try:
        versions = await _sql(dsn, "SELECT max(version) AS v FROM gpurelay_schema")
        assert versions == [{"v": VERSION}] and VERSION >= 2
        (row,) = await _sql(dsn, "SELECT instance FROM gpurelay_gateways")
        assert row == {"instance": a.cluster.directory.instance}
    finally:
        await a.cluster.stop()


def test_gateway_processes_a_copied_config_is_refused_a_dead_ones_id_starts(
    tmp_path: Path, postgres_bin: None, haproxy_bin: Path
) -> None:
    """As operators hit it: a second gateway process with gw-a's config (its own peer
    port) exits 1 with the message, and gw-a keeps every node; once gw-a is killed, the
    same config starts (after the ttl) and answers for the fleet."""
    with running_cluster(
        tmp_path, ClusterSpec(gateways=1, simulated=4, real=0), haproxy_bin=haproxy_bin
    ) as c:
        c.wait_settled(60)
        gw_a = c.gateways["gw-a"]
        (peer,) = free_ports(1)
        section = dataclasses.replace(gw_a.config.cluster, peer_listen=f"127.0.0.1:{peer}")
        (tmp_path / "gw-a-copy").mkdir()
        copy = GatewayProc(c.pki, tmp_path / "gw-a-copy", cluster=section)
        copy.start()
        wait_until(lambda: not copy.running(), 60, "the copy refused")
        assert copy.stop() == 1, copy.tail()
        log = copy.log.read_text()
        assert "gateway id 'gw-a' is in use" in log, copy.tail()
        assert gw_a.config.cluster.peer_listen in log and "[cluster] gateway_id" in log
        assert c.view("gw-a") == {n: ("gw-a", "online") for n in c.node_names}
        assert gw_a.running()

        c.kill9("gw-a")
        copy.start()  # the same id, gw-a's row stale once the ttl passed
        wait_until(copy.ready, 60, "the copy ready", alive=[copy])
        try:
            log = copy.log.read_text()
            assert "takes over from instance" in log, copy.tail()
            released = f"gateway gw-a restarted: released {len(c.node_names)} node(s)"
            assert released in log, copy.tail()
        finally:
            copy.stop()
