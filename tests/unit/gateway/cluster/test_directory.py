"""The node directory's stores: a real SQLite file and a real PostgreSQL server
(harness.postgres), reopened as a restarted gateway would. The contract tests run against
both; the rest are one store's own failure modes."""

from __future__ import annotations

import asyncio
import itertools
import json
import sqlite3
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from cloud_gateway.cluster import store_pg as directory_pg
from cloud_gateway.cluster.directory import Claim, Directory, DirectoryError, NodeFacts
from cloud_gateway.cluster.store_pg import PostgresDirectory
from cloud_gateway.cluster.store_sqlite import MIGRATIONS, VERSION, SqliteDirectory
from gpurelay.model import GpuInventory
from gpurelay.wire import Hello

GPU = GpuInventory(
    index=0,
    uuid="GPU-0",
    name="NVIDIA H100",
    pci_bus_id="00000000:01:00.0",
    minor=0,
    memory_total_bytes=80 << 30,
    memory_used_bytes=1 << 30,
)


def facts(version: str = "1.0", serial: int | None = 7) -> NodeFacts:
    hello = Hello(
        agent_version=version,
        node="edge-1",
        hostname="edge-1.example",
        backend="simulated",
        interval_seconds=1.0,
        gpus=(GPU,),
    )
    return NodeFacts.from_hello(hello, cert_serial=serial, remote="127.0.0.1:5000")


Make = Callable[[str], Directory]  # a store for the gateway with this id


_databases = itertools.count()


@pytest.fixture(params=["sqlite", "postgres"])
async def make(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Make]:
    """A factory of stores on one fresh directory: a file, or a new PostgreSQL database."""
    if request.param == "sqlite":
        yield lambda gateway: SqliteDirectory(tmp_path / "nodes.db", gateway=gateway)
        return
    from harness.postgres import create_database

    # postgres_dsn, not pg_database: an async fixture cannot be asked for from here
    server: str = request.getfixturevalue("postgres_dsn")
    dsn = await create_database(server, f"directory_{next(_databases)}")
    yield lambda gateway: PostgresDirectory(dsn, gateway=gateway)


async def test_the_inventory_survives_a_restart(make: Make) -> None:
    d = make("gw-a")
    assert await d.open() == []
    claim = await d.claim("edge-1", facts(), now=100.0)
    assert (claim.epoch, claim.previous_gateway) == (1, None)
    await d.seen({"edge-1": 130.0, "edge-unknown": 131.0})
    await d.close()

    again = make("gw-a")
    [entry] = await again.open()
    assert entry.node == "edge-1"
    assert (entry.first_seen, entry.last_seen) == (100.0, 130.0)
    assert entry.facts == facts()
    assert entry.facts.gpus[0].name == "NVIDIA H100"
    assert entry.facts.cert_serial == 7
    # the gateway stopped while the node was connected: not connected any more, and why
    assert not entry.connected
    # (PostgreSQL: released to nobody, so the reason names the gateway; see
    # tests/integration/test_cluster_hygiene.py)
    assert entry.last_disconnect_reason in ("gateway restarted", "gateway gw-a restarted")
    await again.close()


async def test_each_claim_grows_the_epoch_and_a_stale_release_is_ignored(make: Make) -> None:
    d = make("gw-a")
    await d.open()
    first = await d.claim("edge-1", facts("1.0"), now=10.0)
    second = await d.claim("edge-1", facts("1.1"), now=20.0)  # a newer connection
    assert (first.epoch, second.epoch) == (1, 2)
    # the old connection's end arrives after the new claim: it must not mark it gone
    assert not await d.release("edge-1", first.epoch, reason="replaced", now=21.0)
    [entry] = await d.entries()
    assert entry.connected and entry.facts.agent_version == "1.1"
    assert entry.first_seen == 10.0
    assert await d.release("edge-1", second.epoch, reason="agent disconnected", now=30.0)
    [entry] = await d.entries()
    assert not entry.connected
    assert (entry.last_seen, entry.last_disconnect_reason) == (30.0, "agent disconnected")
    await d.close()


async def test_a_claim_reports_the_gateway_that_owned_the_node_before(make: Make) -> None:
    a = make("gw-a")
    await a.open()
    await a.claim("edge-1", facts(), now=1.0)
    await a.close()
    b = make("gw-b")  # the gateway renamed ([cluster] gateway_id), or another gateway
    await b.open()
    claim = await b.claim("edge-1", facts(), now=2.0)
    assert (claim.epoch, claim.previous_gateway) == (2, "gw-a")
    # the loser's late writes change nothing of the new owner's entry
    await b.close()
    a = make("gw-a")
    await a.open()
    assert not await a.release("edge-1", 1, reason="late", now=3.0)
    await a.seen({"edge-1": 99.0})
    [entry] = await a.entries()
    assert (entry.gateway, entry.epoch, entry.connected, entry.last_seen) == ("gw-b", 2, True, 2.0)
    await a.close()


async def test_a_second_gateway_on_the_same_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "nodes.db"
    a = SqliteDirectory(path, gateway="gw-a")
    await a.open()
    b = SqliteDirectory(path, gateway="gw-b")
    with pytest.raises(DirectoryError, match="in use by another gateway process"):
        await b.open()
    await a.close()
    await b.open()  # free again once the first one closed
    await b.close()


async def test_a_file_from_a_newer_gateway_is_refused_and_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "nodes.db"
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {VERSION + 1}")
    conn.execute("CREATE TABLE future (x)")
    conn.commit()
    conn.close()
    d = SqliteDirectory(path, gateway="gw-a")
    with pytest.raises(DirectoryError, match=rf"schema version {VERSION + 1}, written by a newer"):
        await d.open()
    await d.close()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == VERSION + 1
    conn.close()


async def test_a_file_that_is_not_a_database_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "nodes.db"
    path.write_bytes(b"this is not SQLite" * 100)
    d = SqliteDirectory(path, gateway="gw-a")
    with pytest.raises(DirectoryError, match=rf"node directory {path}: file is not a database"):
        await d.open()
    await d.close()
    assert path.read_bytes() == b"this is not SQLite" * 100  # nothing overwritten


async def test_a_path_that_cannot_be_made_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")  # its "directory" is a file: fails for root too
    d = SqliteDirectory(tmp_path / "file" / "nodes.db", gateway="gw-a")
    with pytest.raises(DirectoryError, match="cannot open node directory"):
        await d.open()
    await d.close()


async def test_stored_facts_from_a_newer_gateway_keep_what_this_one_knows(tmp_path: Path) -> None:
    stored = json.loads(facts().to_json())
    stored["future_field"] = {"x": 1}
    stored["gpus"][0]["future_gpu_field"] = True
    parsed = NodeFacts.from_json(json.dumps(stored))
    assert parsed == facts()


@pytest.mark.parametrize(
    "text",
    ["[]", "not json", '{"hostname": 5}', '{"gpus": [{"index": 0}]}', '{"cert_serial": "x"}'],
)
def test_damaged_facts_are_a_directory_error(text: str) -> None:
    with pytest.raises(DirectoryError, match="stored facts are unreadable"):
        NodeFacts.from_json(text)


async def test_a_damaged_row_names_the_node(tmp_path: Path) -> None:
    path = tmp_path / "nodes.db"
    d = SqliteDirectory(path, gateway="gw-a")
    await d.open()
    await d.claim("edge-1", facts(), now=1.0)
    await d.close()
    conn = sqlite3.connect(path)
    conn.execute("UPDATE nodes SET facts = '[1]'")
    conn.commit()
    conn.close()
    d = SqliteDirectory(path, gateway="gw-a")
    with pytest.raises(DirectoryError, match=r"node 'edge-1': a node's stored facts"):
        await d.open()
    await d.close()


async def test_postgres_notifies_the_previous_owner_of_a_claim(pg_database: str) -> None:

    dsn = pg_database
    heard: list[tuple[str, str, int]] = []
    got = asyncio.Event()

    def on_claim(node: str, gateway: str, epoch: int) -> None:
        heard.append((node, gateway, epoch))
        if gateway == "gw-b":
            got.set()

    a = PostgresDirectory(dsn, gateway="gw-a", on_claim=on_claim)
    b = PostgresDirectory(dsn, gateway="gw-b")
    await a.open()
    await b.open()
    await a.claim("edge-1", facts(), now=1.0)
    claim = await b.claim("edge-1", facts(), now=2.0)
    assert claim == Claim(2, "gw-a")
    await asyncio.wait_for(got.wait(), 10)
    assert heard == [("edge-1", "gw-a", 1), ("edge-1", "gw-b", 2)]
    await a.close()
    await b.close()


async def test_postgres_claims_of_one_node_from_many_gateways_at_once_are_serialised(
    pg_database: str,
) -> None:
    """Every claim gets its own epoch: no two gateways can both believe they own it."""

    dsn = pg_database
    stores = [PostgresDirectory(dsn, gateway=f"gw-{k}") for k in range(6)]
    await asyncio.gather(*(s.open() for s in stores))  # six gateways migrating at once
    claims = await asyncio.gather(
        *(s.claim("edge-1", facts(), now=float(k)) for k in range(5) for s in stores)
    )
    assert sorted(c.epoch for c in claims) == list(range(1, 31))
    [entry] = await stores[0].entries()
    assert entry.epoch == 30
    winner = max(claims, key=lambda c: c.epoch)
    assert winner.epoch == 30
    await asyncio.gather(*(s.close() for s in stores))


async def test_postgres_unreachable_is_a_clear_error_without_the_password() -> None:
    from harness.ports import free_ports

    port = free_ports(1)[0]  # nothing listens there
    d = PostgresDirectory(f"postgresql://relay:s3cret@127.0.0.1:{port}/relay", gateway="gw-a")
    with pytest.raises(DirectoryError, match="cannot connect") as info:
        await d.open()
    assert "s3cret" not in str(info.value)
    assert f"postgresql://relay@127.0.0.1:{port}/relay" in str(info.value)
    await d.close()


async def test_postgres_schema_from_a_newer_gateway_is_refused(pg_database: str) -> None:
    import asyncpg

    dsn = pg_database
    conn = await asyncpg.connect(dsn)
    await conn.execute("CREATE TABLE gpurelay_schema (version int NOT NULL)")
    newer = directory_pg.VERSION + 1
    await conn.execute("INSERT INTO gpurelay_schema VALUES (1), ($1)", newer)
    await conn.close()
    d = PostgresDirectory(dsn, gateway="gw-a")
    with pytest.raises(DirectoryError, match=f"schema version {newer}, migrated by a newer gate"):
        await d.open()
    await d.close()


async def test_postgres_members_heartbeat_by_the_databases_clock(pg_database: str) -> None:
    import asyncpg

    dsn = pg_database
    a = PostgresDirectory(dsn, gateway="gw-a")
    b = PostgresDirectory(dsn, gateway="gw-b")
    await a.open()
    await b.open()
    [only] = await a.heartbeat(advertise="127.0.0.1:9411", nodes=3, started=True)
    assert (only.id, only.advertise, only.nodes) == ("gw-a", "127.0.0.1:9411", 3)
    assert only.heartbeat_age < 5 and only.alive(ttl=5)
    members = await b.heartbeat(advertise="127.0.0.1:9412", nodes=0, started=True)
    assert [m.id for m in members] == ["gw-a", "gw-b"]
    # a's heartbeat ages while b's is renewed: age it in the database, not by sleeping
    conn = await asyncpg.connect(dsn)
    await conn.execute(
        "UPDATE gpurelay_gateways SET heartbeat = heartbeat - interval '30 seconds'"
        " WHERE id = 'gw-a'"
    )
    await conn.close()
    members = {m.id: m for m in await b.members()}
    assert members["gw-a"].heartbeat_age >= 30 and not members["gw-a"].alive(ttl=10)
    assert members["gw-b"].alive(ttl=10)
    # a beats again: alive, and its start time is kept unless it restarted
    up_before = members["gw-a"].up_seconds
    [again, _] = await a.heartbeat(advertise="127.0.0.1:9411", nodes=4)
    assert again.alive(ttl=10) and again.nodes == 4 and again.up_seconds >= up_before
    await a.close()
    await b.close()


async def test_an_enrollment_nonce_is_used_once_on_any_gateway(make: Make) -> None:
    """Single-use enrollment tokens (issue 17): the store decides, atomically, for a cluster."""
    a, b = make("gw-a"), make("gw-b")
    if isinstance(a, SqliteDirectory):  # one gateway per file: the same gateway, reopened
        b = a
    await a.open()
    if b is not a:
        await b.open()
    try:
        nonce = "0123456789abcdef" * 2
        assert not await b.enrollment_nonce_used(nonce)
        results = await asyncio.gather(
            a.use_enrollment_nonce(nonce, "edge-1", 2_000, now=1_000),
            b.use_enrollment_nonce(nonce, "edge-1", 2_000, now=1_000),
        )
        assert sorted(results) == [False, True]
        assert await a.enrollment_nonce_used(nonce) and await b.enrollment_nonce_used(nonce)
        # a day after the token expired, its row goes (the token is refused as expired anyway)
        assert await a.use_enrollment_nonce("f" * 32, "edge-2", 200_000, now=2_000 + 86_401)
        assert not await b.enrollment_nonce_used(nonce)
        assert await b.enrollment_nonce_used("f" * 32)
    finally:
        await a.close()
        if b is not a:
            await b.close()
    if isinstance(a, SqliteDirectory):
        again = make("gw-a")
        await again.open()
        assert await again.enrollment_nonce_used("f" * 32)  # it survives a restart
        await again.close()


async def test_a_version_1_file_gains_the_nonce_table(tmp_path: Path) -> None:
    path = tmp_path / "nodes.db"
    conn = sqlite3.connect(path)
    for statement in MIGRATIONS[0]:
        conn.execute(statement)
    conn.execute("INSERT INTO nodes VALUES ('edge-1', 'gw-a', 3, 1, 2, '{}', 0, 'bye')")
    conn.execute("PRAGMA user_version = 1")
    conn.commit()
    conn.close()
    d = SqliteDirectory(path, gateway="gw-a")
    (entry,) = await d.open()
    assert (entry.node, entry.epoch, entry.last_disconnect_reason) == ("edge-1", 3, "bye")
    assert await d.use_enrollment_nonce("a" * 32, "edge-1", 10, now=1)
    await d.close()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == VERSION == 2
    conn.close()
