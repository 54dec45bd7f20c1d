"""Two gateways on one PostgreSQL directory, with a real agent: every gateway answers for
the whole fleet, a scrape of a node owned elsewhere takes one hop to its owner, and a node
that moves is let go at once by its old gateway (its series leave that /metrics)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import httpx
import pytest

from cloud_gateway.app import Gateway
from cloud_gateway.cli import main
from cloud_gateway.cluster.config import ClusterConfig
from harness.fleet import (
    TOKEN,
    agent_config,
    cluster_member,
    gateway_config,
    make_pki,
    running_agent,
    running_gateway,
)
from harness.waiting import wait_for

AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def database(pg_database: str) -> str:
    return pg_database


async def nodes(client: httpx.AsyncClient, gw: Gateway) -> dict[str, dict[str, object]]:
    r = await client.get(f"http://127.0.0.1:{gw.http_port}/api/v1/nodes", headers=AUTH)
    r.raise_for_status()
    return {n["name"]: n for n in r.json()["nodes"]}


async def test_two_gateways_answer_for_the_fleet_and_a_moved_node_is_let_go(
    tmp_path: Path, database: str
) -> None:
    pki = make_pki(tmp_path)
    token = tmp_path / "peer.token"
    token.write_text("peer-token-0123456789abcdef\n")
    async with (
        running_gateway(cluster_member(pki, database, "gw-a", token)) as a,
        running_gateway(cluster_member(pki, database, "gw-b", token)) as b,
        httpx.AsyncClient(timeout=20) as client,
    ):
        async with running_agent(agent_config(pki, "edge-1", a)) as agent:
            await wait_for(lambda: a.ingest.stats.batches >= 1)
            assert a.link.cluster is not None and a.link.cluster.owned.keys() == {"edge-1"}

            async def b_sees_it_on_a() -> bool:
                entry = (await nodes(client, b)).get("edge-1")
                return entry is not None and entry["gateway"] == "gw-a"

            await wait_for(b_sees_it_on_a, timeout=10)
            on_b = (await nodes(client, b))["edge-1"]
            on_a = (await nodes(client, a))["edge-1"]
            assert on_b["state"] == on_a["state"] == "online"
            assert on_b["gateway"] == on_a["gateway"] == "gw-a"
            assert on_b["gpu_count"] == on_a["gpu_count"] == 1
            # the gateways, from either
            r = await client.get(f"http://127.0.0.1:{b.http_port}/api/v1/gateways", headers=AUTH)
            gws = {g["id"]: g for g in r.json()["gateways"]}
            assert set(gws) == {"gw-a", "gw-b"} and gws["gw-a"]["alive"] and gws["gw-b"]["this"]
            # discovered on either: the endpoints a node publishes, as its owner wrote them
            own = f"edge-1:{agent.port}"

            async def sd(gw: Gateway) -> list[dict[str, object]]:
                url = f"http://127.0.0.1:{gw.http_port}/api/v1/sd"
                r = await client.get(url, headers=AUTH)
                r.raise_for_status()
                groups: list[dict[str, object]] = r.json()
                return groups

            async def b_discovers_it() -> bool:
                return any(g["targets"] == [own] for g in await sd(b))

            await wait_for(b_discovers_it, timeout=10)
            assert await sd(a) == await sd(b)
            [group] = [g for g in await sd(b) if g["targets"] == [own]]
            assert group["labels"] == {
                "node": "edge-1",
                "via": "edge-1",
                "domain": "edge-1",
                "agent_version": on_a["agent_version"],
                "gpu_count": "1",
            }
            # a scrape through b takes one hop to a
            r = await client.get(
                f"http://127.0.0.1:{b.http_port}/proxy/edge-1/{agent.port}/metrics", headers=AUTH
            )
            assert r.status_code == 200 and "DCGM_FI_DEV_GPU_UTIL" in r.text
            # /metrics: the node's series only where it is owned
            body_a = (await client.get(f"http://127.0.0.1:{a.http_port}/metrics")).text
            body_b = (await client.get(f"http://127.0.0.1:{b.http_port}/metrics")).text
            assert 'Hostname="edge-1"' in body_a and 'Hostname="edge-1"' not in body_b

        # the node comes back through b (a balancer sent it there): a lets it go at once
        async with running_agent(agent_config(pki, "edge-1", b)):
            await wait_for(lambda: b.ingest.stats.batches >= 1)
            await wait_for(lambda: "edge-1" not in (a.link.cluster.owned if a.link.cluster else {}))
            await wait_for(lambda: a.registry.node("edge-1", now=a.clock()) is None, timeout=10)
            body_a = (await client.get(f"http://127.0.0.1:{a.http_port}/metrics")).text
            assert 'Hostname="edge-1"' not in body_a
            # it had left a before it came back through b: forgotten, not "lost" from a
            assert a.link.cluster is not None and a.link.cluster.stats.lost_claims == 0

            async def a_sees_it_on_b() -> bool:
                entry = (await nodes(client, a)).get("edge-1")
                return entry is not None and entry["gateway"] == "gw-b"

            await wait_for(a_sees_it_on_b, timeout=10)


async def cli(command: str, gw: Gateway, capsys: pytest.CaptureFixture[str]) -> list[list[str]]:
    """``cloud-gateway COMMAND`` against ``gw``: its table, one list of cells per line."""
    argv = [command, "--gateway", f"http://127.0.0.1:{gw.http_port}", "--token", TOKEN]
    assert await asyncio.to_thread(main, argv) == 0
    return [line.split("  ") for line in capsys.readouterr().out.splitlines()]


def cells(table: list[list[str]], first: str) -> dict[str, str]:
    """The row of ``table`` whose first cell is ``first``, by column (cells of a table
    are apart by at least two spaces)."""
    header = [c.strip() for c in table[0] if c.strip()]
    [row] = [[c.strip() for c in r if c.strip()] for r in table[1:] if r[0].strip() == first]
    return dict(zip(header, row, strict=True))


async def test_any_gateway_lists_a_nodes_gateway_and_endpoints_and_no_nodes_on_a_dead_one(
    tmp_path: Path,
    database: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``cloud-gateway nodes`` on b shows the GATEWAY of a node held by a and what it
    PUBLISHED (as a wrote it to the directory); once a stops heartbeating (frozen, or
    killed), ``cloud-gateway gateways`` counts no nodes for it and the node is offline,
    publishing nothing."""
    pki = make_pki(tmp_path)
    token = tmp_path / "peer.token"
    token.write_text("peer-token-0123456789abcdef\n")
    async with (
        running_gateway(cluster_member(pki, database, "gw-a", token)) as a,
        running_gateway(cluster_member(pki, database, "gw-b", token)) as b,
        httpx.AsyncClient(timeout=20) as client,
        running_agent(agent_config(pki, "edge-1", a)) as agent,
    ):
        own = f"edge-1:{agent.port}"

        async def b_discovers_it() -> bool:  # a wrote the endpoints, b re-read them
            r = await client.get(f"http://127.0.0.1:{b.http_port}/api/v1/sd", headers=AUTH)
            return any(g["targets"] == [own] for g in r.json())

        await wait_for(b_discovers_it, timeout=10)
        on_b = (await nodes(client, b))["edge-1"]
        assert on_b["gateway"] == "gw-a" and on_b["state"] == "online"
        assert on_b["published"] == (await nodes(client, a))["edge-1"]["published"] == [own]
        for gw in (a, b):
            row = cells(await cli("nodes", gw, capsys), "edge-1")
            assert row["STATE"] == "online" and row["GATEWAY"] == "gw-a", row
            assert row["PUBLISHED"] == own, row
        gateways = cells(await cli("gateways", b, capsys), "gw-a")
        assert gateways["ALIVE"] == "yes" and gateways["NODES"] == "1", gateways

        async def frozen(monotonic: float) -> None:  # a's heartbeats stop, as after kill -9
            return None

        monkeypatch.setattr(a.link, "tick", frozen)

        async def gw_a_is_dead() -> bool:
            r = await client.get(f"http://127.0.0.1:{b.http_port}/api/v1/gateways", headers=AUTH)
            return not {g["id"]: g for g in r.json()["gateways"]}["gw-a"]["alive"]

        await wait_for(gw_a_is_dead, timeout=15)
        r = await client.get(f"http://127.0.0.1:{b.http_port}/api/v1/gateways", headers=AUTH)
        assert {g["id"]: g for g in r.json()["gateways"]}["gw-a"]["nodes"] == 0
        gateways = cells(await cli("gateways", b, capsys), "gw-a")
        assert gateways["ALIVE"] == "no" and gateways["NODES"] == "-", gateways
        on_b = (await nodes(client, b))["edge-1"]
        assert on_b["state"] == "offline" and on_b["published"] == []
        row = cells(await cli("nodes", b, capsys), "edge-1")
        assert row["STATE"] == "offline" and row["GATEWAY"] == "gw-a (dead)", row
        assert row["PUBLISHED"] == "-", row


async def test_the_single_gateways_inventory_survives_a_restart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pki = make_pki(tmp_path)
    cfg = dataclasses.replace(
        gateway_config(pki), cluster=ClusterConfig(directory=str(tmp_path / "nodes.db"))
    )
    async with running_gateway(cfg) as gw, running_agent(agent_config(pki, "edge-1", gw)):
        await wait_for(lambda: gw.ingest.stats.batches >= 1)
    async with running_gateway(cfg) as gw, httpx.AsyncClient(timeout=20) as client:
        known = await nodes(client, gw)
        entry = known["edge-1"]
        assert entry["state"] == "offline"
        assert entry["gpu_count"] == 1 and entry["backend"] == "simulated"
        assert entry["certificate_serial"] is not None
        assert entry["last_disconnect_reason"]
        # one gateway names no owner (the API's `gateway`: with [cluster]), nor does its table
        assert "gateway" not in entry and "gateway_alive" not in entry
        table = await cli("nodes", gw, capsys)
        assert "GATEWAY" not in table[0] and cells(table, "edge-1")["STATE"] == "offline"
        r = await client.get(f"http://127.0.0.1:{gw.http_port}/api/v1/nodes/edge-1", headers=AUTH)
        assert r.status_code == 200 and len(r.json()["gpus"]) == 1


async def test_a_database_down_at_start_is_a_retryable_error_not_a_config_error(
    tmp_path: Path,
) -> None:
    """Exit 1 (systemd restarts it), not 2 (a config error, never restarted): a gateway
    that boots while PostgreSQL is down must come up once it is back."""
    from cloud_gateway.errors import GatewayConfigError, GatewayError
    from harness.ports import free_ports

    pki = make_pki(tmp_path)
    token = tmp_path / "peer.token"
    token.write_text("peer-token-0123456789abcdef\n")
    port = free_ports(1)[0]  # nothing listens there
    gw = Gateway(cluster_member(pki, f"postgresql://relay@127.0.0.1:{port}/relay", "gw-a", token))
    try:
        with pytest.raises(GatewayError, match="cannot connect") as info:
            await gw.startup()
        assert not isinstance(info.value, GatewayConfigError)
    finally:
        await gw.shutdown()


async def test_a_fenced_gateway_is_not_ready_so_the_balancer_sends_agents_elsewhere(
    tmp_path: Path, database: str
) -> None:
    """A fenced gateway holds no tunnels, so leastconn would send it every reconnecting
    agent, which it refuses: /readyz (the balancer's health check) says 503 meanwhile."""
    pki = make_pki(tmp_path)
    token = tmp_path / "peer.token"
    token.write_text("peer-token-0123456789abcdef\n")
    async with (
        running_gateway(cluster_member(pki, database, "gw-a", token)) as a,
        httpx.AsyncClient(timeout=20) as client,
    ):
        url = f"http://127.0.0.1:{a.http_port}/readyz"
        assert (await client.get(url)).status_code == 200
        assert a.link.cluster is not None
        a.link.cluster.fenced = True
        r = await client.get(url)
        assert r.status_code == 503 and "fenced" in r.text
        a.link.cluster.fenced = False
        assert (await client.get(url)).status_code == 200
