"""The embedded node directory: a real SQLite file, reopened as a restarted gateway would."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from cloud_gateway.directory import DirectoryError, NodeFacts
from cloud_gateway.directory_sqlite import VERSION, SqliteDirectory
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


async def test_the_inventory_survives_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "nodes.db"
    d = SqliteDirectory(path, gateway="gw-a")
    assert await d.open() == []
    claim = await d.claim("edge-1", facts(), now=100.0)
    assert (claim.epoch, claim.previous_gateway) == (1, None)
    await d.seen({"edge-1": 130.0, "edge-unknown": 131.0})
    await d.close()

    again = SqliteDirectory(path, gateway="gw-a")
    [entry] = await again.open()
    assert entry.node == "edge-1"
    assert (entry.first_seen, entry.last_seen) == (100.0, 130.0)
    assert entry.facts == facts()
    assert entry.facts.gpus[0].name == "NVIDIA H100"
    assert entry.facts.cert_serial == 7
    # the gateway stopped while the node was connected: not connected any more, and why
    assert not entry.connected
    assert entry.last_disconnect_reason == "gateway restarted"
    await again.close()


async def test_each_claim_grows_the_epoch_and_a_stale_release_is_ignored(tmp_path: Path) -> None:
    d = SqliteDirectory(tmp_path / "nodes.db", gateway="gw-a")
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


async def test_a_claim_reports_the_gateway_that_owned_the_node_before(tmp_path: Path) -> None:
    path = tmp_path / "nodes.db"
    a = SqliteDirectory(path, gateway="gw-a")
    await a.open()
    await a.claim("edge-1", facts(), now=1.0)
    await a.close()
    b = SqliteDirectory(path, gateway="gw-b")  # the gateway renamed ([cluster] gateway_id)
    await b.open()
    claim = await b.claim("edge-1", facts(), now=2.0)
    assert (claim.epoch, claim.previous_gateway) == (2, "gw-a")
    await b.close()


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
    with pytest.raises(DirectoryError, match=r"schema version 2, written by a newer gateway"):
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
