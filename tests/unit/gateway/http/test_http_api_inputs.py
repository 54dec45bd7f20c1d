"""Numbers in the query and the path that look like digits to ``str.isdigit`` but are not
decimal ASCII (``²``), or are too long for ``int()`` (over 4,300 digits), are a 400 with the
reason, not a 500: found while describing these parameters for /openapi.json."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp.test_utils import TestClient, TestServer

from cloud_gateway.exposition.body import Exposition
from cloud_gateway.exposition.shards import ShardError, parse_shard
from cloud_gateway.http.api import HttpState, make_app
from cloud_gateway.registry.store import Registry
from cloud_gateway.relay.endpoints import EndpointTable
from cloud_gateway.relay.relay import Relay

AUTH = {"Authorization": "Bearer t0ken"}
LONG = "1" * 5000  # int() refuses more than 4,300 digits


@pytest.fixture
async def client() -> AsyncIterator[TestClient[object, object]]:
    registry = Registry()
    endpoints = EndpointTable()
    state = HttpState(
        registry,
        Exposition(registry),
        frozenset({"t0ken"}),
        endpoints=endpoints,
        relay=Relay(registry, endpoints),
    )
    async with TestClient(TestServer(make_app(state))) as c:
        yield c


@pytest.mark.parametrize(
    "url",
    [
        "/metrics?shard=%C2%B2&shards=3",  # shard=²
        "/metrics?shard=0&shards=%C2%B2",
        f"/metrics?shard=0&shards={LONG}",
        f"/metrics?shard={LONG}&shards=2",
        "/api/v1/sd/metrics?shards=%C2%B2",
        f"/api/v1/sd/metrics?shards={LONG}",
        "/proxy/edge-a/%C2%B2/metrics",  # port ²
        "/proxy/edge-a/%D9%A1/metrics",  # port U+0661 (Arabic-Indic one): not a port either
        f"/proxy/edge-a/{LONG}/metrics",
    ],
)
async def test_a_number_that_is_not_one_is_a_400(
    client: TestClient[object, object], url: str
) -> None:
    response = await client.get(url, headers=AUTH)
    assert response.status == 400, await response.text()
    assert "number" in (await response.text())


@pytest.mark.parametrize("value", ["\u00b2", "\u0661", "\u0663", LONG, "+1", " 1", "1_0"])
def test_parse_shard_takes_ascii_digits_only(value: str) -> None:
    with pytest.raises(ShardError):
        parse_shard({"shard": "0", "shards": value})
    with pytest.raises(ShardError):
        parse_shard({"shard": value, "shards": "4"})
