"""Two in-process gateways on one PostgreSQL: http_sd lists both gateways' /metrics per
shard, the cluster metrics are on /metrics, one leader answers for a dead gateway's node,
and the union of every gateway's shards holds each series once."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import httpx
import pytest

from cloud_gateway.cluster.store_pg import PostgresDirectory
from harness.fleet import agent_config, make_pki, running_agent, running_gateway
from harness.fleet import cluster_member as member
from harness.waiting import wait_for
from tests.integration.test_cluster_gateways import AUTH
from tests.integration.test_cluster_membership import FACTS


@pytest.fixture
def dsn(pg_database: str) -> str:
    return pg_database


async def _dead_gateway(dsn: str, node: str) -> None:
    import asyncpg

    dead = PostgresDirectory(dsn, gateway="gw-dead")
    await dead.open()
    try:
        await dead.heartbeat(advertise="127.0.0.1:1", nodes=1, started=True)
        await dead.claim(node, FACTS, now=1000.0)
    finally:
        await dead.close()
    conn = await asyncpg.connect(dsn)
    await conn.execute("UPDATE gpurelay_gateways SET heartbeat = now() - interval '1 hour'")
    await conn.close()


def _samples(body: str) -> Counter[str]:
    """Series (a line without its value: values move between scrapes), counted."""
    return Counter(
        line.rsplit(" ", 1)[0] for line in body.splitlines() if line and not line.startswith("#")
    )


def _value(body: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", body, re.M)
    assert m is not None, name
    return float(m.group(1))


async def test_sd_metrics_leader_and_shards_across_two_gateways(tmp_path: Path, dsn: str) -> None:
    await _dead_gateway(dsn, "edge-dead")
    pki = make_pki(tmp_path)
    token = tmp_path / "peer.token"
    token.write_text("peer-token-0123456789abcdef\n")
    async with (
        running_gateway(member(pki, dsn, "gw-a", token)) as a,
        running_gateway(member(pki, dsn, "gw-b", token)) as b,
        running_agent(agent_config(pki, "edge-1", a)),
        httpx.AsyncClient(timeout=20) as client,
    ):
        urls = {"gw-a": f"127.0.0.1:{a.http_port}", "gw-b": f"127.0.0.1:{b.http_port}"}
        await wait_for(lambda: a.ingest.stats.batches >= 1)

        async def sd(gw: str) -> list[dict[str, object]]:
            r = await client.get(f"http://{urls[gw]}/api/v1/sd/metrics?shards=3", headers=AUTH)
            r.raise_for_status()
            groups: list[dict[str, object]] = r.json()
            return groups

        async def both_listed() -> bool:
            return [len(await sd(gw)) for gw in urls] == [6, 6]

        await wait_for(both_listed, timeout=10)
        groups = await sd("gw-b")
        assert groups == await sd("gw-a")
        targets = Counter((g["targets"][0], g["labels"]["__param_shard"]) for g in groups)  # type: ignore[index]
        assert set(targets) == {(u, str(k)) for u in urls.values() for k in range(3)}

        async def body(url: str, query: str = "") -> str:
            r = await client.get(f"http://{url}/metrics{query}")
            r.raise_for_status()
            return r.text

        async def one_leader_shows_the_dead_node() -> bool:
            bodies = [await body(u) for u in urls.values()]
            leaders = [_value(x, "gpurelay_gateway_cluster_leader") for x in bodies]
            dead = [x.count('gpurelay_node_up{Hostname="edge-dead"} 0') for x in bodies]
            return sorted(leaders) == [0.0, 1.0] and sorted(dead) == [0, 1]

        await wait_for(one_leader_shows_the_dead_node, timeout=15)
        for x in [await body(u) for u in urls.values()]:
            assert _value(x, "gpurelay_gateway_cluster_members") == 2
            assert 'gpurelay_gateway_cluster_directory_errors_total{operation="claim"} 0' in x
        assert _value(await body(urls["gw-a"]), "gpurelay_gateway_cluster_owned_nodes") == 1
        assert _value(await body(urls["gw-a"]), "gpurelay_gateway_cluster_claims_total") == 1

        # every series of the fleet (edge-1's on a, edge-dead's on the leader) once in the
        # union of both gateways' shards (gateways' own families apart: their values move)
        def fleet(c: Counter[str]) -> Counter[str]:
            return Counter({k: v for k, v in c.items() if not k.startswith("gpurelay_gateway_")})

        shards = Counter[str]()
        for g in groups:
            labels = g["labels"]
            assert isinstance(labels, dict)
            query = f"?shard={labels['__param_shard']}&shards={labels['__param_shards']}"
            shards += fleet(_samples(await body(g["targets"][0], query)))  # type: ignore[index]
        node_lines = [k for k in shards if 'Hostname="edge-' in k]
        assert max(shards.values()) == 1
        assert any('Hostname="edge-1"' in k for k in node_lines)
        assert 'gpurelay_node_up{Hostname="edge-dead"}' in shards
