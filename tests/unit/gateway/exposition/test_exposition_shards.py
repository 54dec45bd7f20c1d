"""``/metrics?shard=K&shards=N``: each shard is a valid body, and the N shards together
hold every series of the whole body exactly once (the gateway's own families in shard 0,
every series about a node, its certificate expiry too, in that node's shard)."""

from __future__ import annotations

import dataclasses
import gzip
from collections import Counter
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from cloud_gateway.exposition.body import Exposition
from cloud_gateway.exposition.shards import shard_of
from cloud_gateway.http.api import HttpState, make_app
from cloud_gateway.registry.store import Registry
from cloud_gateway.registry.types import Liveness
from cloud_gateway.trust.cert_expiry import CERT_EXPIRY, DAY, CertificateExpiry
from gpurelay.model import Snapshot
from tests.promtool_support import unexpected_findings
from tests.unit.gateway.exposition.test_gateway_exposition import OWN, T0, Agent, snapshot

NODES = [f"edge-{i:02d}" for i in range(14)]
DEAD = Liveness("dead-node", "offline", T0 - 100.0, None)  # a dead gateway's node
EXPIRES = {node: int(T0 + 30 * DAY) + i for i, node in enumerate(NODES)}  # certificates


@pytest.fixture(scope="module")
def snaps(tmp_path_factory: pytest.TempPathFactory) -> list[Snapshot]:
    tmp = tmp_path_factory.mktemp("snaps")
    return [snapshot(tmp / str(i), gpus=1 + i, seed=i, mig=i == 1) for i in range(3)]


@pytest.fixture
def expo(snaps: list[Snapshot]) -> Exposition:
    reg = Registry()
    for i, node in enumerate(NODES):
        snap = snaps[i % len(snaps)]
        Agent(reg, node, dataclasses.replace(snap, node=node))
    reg.disconnect(NODES[3], reg.live_connection(NODES[3])[0], now=T0, reason="test")  # type: ignore[index]
    expo = Exposition(reg)
    expo.set_extra([OWN, certificates()])
    expo.set_orphans([DEAD])
    return expo


def certificates() -> tuple[object, ...]:
    """Every node's certificate expiry, as the gateway renders it among its own families,
    from :class:`CertificateExpiry` (here its inventory path)."""
    watch = CertificateExpiry()
    watch.refresh(T0, live={}, stored={n: (when, 1) for n, when in EXPIRES.items()})
    family = watch.family("Hostname")
    assert family[0] is CERT_EXPIRY
    return family


def samples(body: bytes) -> Counter[str]:
    return Counter(line for line in body.decode().splitlines() if not line.startswith("#"))


def headers(body: bytes) -> Counter[str]:
    return Counter(line for line in body.decode().splitlines() if line.startswith("# TYPE"))


async def shard_body(expo: Exposition, k: int, n: int, *, om: bool = False) -> bytes:
    plain = await expo.scrape_shard_async(k, n, openmetrics=om, gzip=False)
    packed = await expo.scrape_shard_async(k, n, openmetrics=om, gzip=True)
    assert packed.gzip and gzip.decompress(packed.join()) == plain.join()
    return plain.join()


@pytest.mark.parametrize("om", [False, True])
async def test_the_shards_partition_the_body(expo: Exposition, om: bool) -> None:
    whole = expo.scrape(openmetrics=om, gzip=False).join()
    assert 'Hostname="dead-node"' in whole.decode()
    for n in range(1, 6):
        bodies = [await shard_body(expo, k, n, om=om) for k in range(n)]
        union = sum((samples(b) for b in bodies), Counter[str]())
        assert union == samples(whole), n
        assert max(union.values()) == 1  # no series twice
        for k, body in enumerate(bodies):
            assert max(headers(body).values(), default=1) == 1  # a family's header once
            assert (b"gpurelay_gateway_batches_total" in body) == (k == 0)
            assert body.endswith(b"# EOF\n") == om
            for node in [*NODES, DEAD.name]:  # a node's series all in its own shard
                assert (f'"{node}"'.encode() in body) == (shard_of(node, n) == k)
    assert await shard_body(expo, 0, 1, om=om) == whole


async def test_a_nodes_certificate_expiry_is_in_its_nodes_shard(expo: Exposition) -> None:
    """The operator guide: a shard holds only the nodes that hash to it. The expiry gauge
    is rendered beside the gateway's own families, but it is about a node."""
    gauge = CERT_EXPIRY.name
    n = 4
    for k in range(n):
        body = (await shard_body(expo, k, n)).decode()
        lines = [line for line in body.splitlines() if line.startswith(gauge + "{")]
        mine = [node for node in sorted(NODES) if shard_of(node, n) == k]
        assert lines == [f'{gauge}{{Hostname="{node}"}} {EXPIRES[node]}' for node in mine], k
        assert (f"# TYPE {gauge} gauge" in body) == bool(mine), k


async def test_each_shard_passes_promtool(expo: Exposition, promtool: Path) -> None:
    for n in range(1, 6):
        for k in range(n):
            assert unexpected_findings(promtool, await shard_body(expo, k, n)) == [], (k, n)


async def test_a_shard_follows_new_data(expo: Exposition, snaps: list[Snapshot]) -> None:
    n = 3
    k = shard_of(NODES[0], n)
    before = await shard_body(expo, k, n)
    reg = expo.registry
    conn = reg.live_connection(NODES[0])
    assert conn is not None
    agent = Agent.__new__(Agent)
    agent.reg, agent.node, agent.snap, agent.seq, agent.conn = reg, NODES[0], snaps[0], 1, conn[0]
    agent.send([(0, 123456.0)], now=T0 + 1)
    after = await shard_body(expo, k, n)
    assert after != before and b" 123456\n" in after
    assert samples(after) - samples(before)  # a changed sample line
    others = [await shard_body(expo, j, n) for j in range(n) if j != k]
    assert all(b" 123456\n" not in b for b in others)


async def test_bad_shard_parameters_are_a_400(expo: Exposition) -> None:
    state = HttpState(registry=expo.registry, exposition=expo, tokens=frozenset())
    async with TestClient(TestServer(make_app(state))) as client:
        for query in (
            "shard=1",
            "shards=2",
            "shard=2&shards=2",
            "shard=a&shards=2",
            "shard=0&shards=0",
        ):
            resp = await client.get(f"/metrics?{query}")
            assert resp.status == 400, query
            assert "shard" in (await resp.json())["error"]
        ok = await client.get("/metrics?shard=1&shards=2", headers={"Accept-Encoding": "gzip"})
        assert ok.status == 200 and ok.headers["Content-Encoding"] == "gzip"
        assert (await ok.read()) == await shard_body(expo, 1, 2)  # the client inflates it


async def test_a_shard_survives_its_own_cache_filling_up(expo: Exposition) -> None:
    """Found by schemathesis (tests/integration/test_api_schemathesis.py): storing one
    scrape's N fleet parts can fill the cache (MAX_CACHED parts), which is then cleared
    mid-way, dropping the part just stored for the asked shard: KeyError, HTTP 500."""
    whole = samples(await shard_body(expo, 0, 1))
    for n in (1024, 1023, 1022, 980):  # 4,049 parts kept; 47 more fill the cache
        await expo.scrape_shard_async(0, n, openmetrics=False, gzip=False)
    got: Counter[str] = Counter()
    for k in range(900):  # the first asks for shard 18 of 900: stored, then cleared
        got += samples(await shard_body(expo, (k + 18) % 900, 900))
    assert got == whole
