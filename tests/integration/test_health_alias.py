"""``/health`` answers as ``/healthz`` does, on the agent and the gateway (probes written
for dcgm-exporter ask for ``/health``), open like it, over real HTTP on port 0."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import bcrypt
import httpx
import pytest
from aiohttp import web

from cloud_gateway.exposition.body import Exposition
from cloud_gateway.http.api import HttpState
from cloud_gateway.http.api import make_app as make_gateway_app
from cloud_gateway.registry.store import Registry
from edge_agent import http_server
from gpurelay.web_config import BasicAuth
from harness.pipeline import make_pipeline

PROBES = ("/healthz", "/health")


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


@pytest.fixture
async def agent(tmp_path: Path) -> AsyncIterator[tuple[http_server.LatestSnapshot, object, str]]:
    """The agent's app with basic auth on (every path but the probes needs a user)."""
    pipeline, _sim, clock = make_pipeline(tmp_path, gpus=1)
    published = http_server.LatestSnapshot(clock=clock)
    users = BasicAuth({"prom": bcrypt.hashpw(b"secret", bcrypt.gensalt(rounds=4))})
    server = http_server.make_app(published, users)
    port = await server.start("127.0.0.1", 0, None)
    try:
        yield published, pipeline, f"http://127.0.0.1:{port}"
    finally:
        await server.cleanup()
        pipeline.close()


async def test_agent_health_is_healthz_and_needs_no_credentials(agent) -> None:  # type: ignore[no-untyped-def]
    published, pipeline, base = agent
    async with httpx.AsyncClient(base_url=base) as client:
        assert (await client.get("/metrics")).status_code == 401  # auth is on
        before = {p: await client.get(p) for p in PROBES}
        assert [r.status_code for r in before.values()] == [503, 503]  # nothing collected
        assert before["/health"].text == before["/healthz"].text
        published.publish(pipeline.collection.collect())
        after = {p: await client.get(p) for p in PROBES}
        assert [r.status_code for r in after.values()] == [200, 200]
        assert "edge-node-1" in after["/health"].text
        assert after["/health"].text == after["/healthz"].text
        published.clock.advance(published.max_age + 1)
        stale = {p: await client.get(p) for p in PROBES}
        assert [r.status_code for r in stale.values()] == [503, 503]
        assert (await client.get("/healthy")).status_code == 401  # only the alias is open


def _gateway_state() -> HttpState:
    registry = Registry()
    return HttpState(
        registry=registry,
        exposition=Exposition(registry),
        tokens=frozenset({"t0ken"}),
        protect_metrics=True,
    )


async def test_gateway_health_is_healthz_open_and_counted_under_its_own_template() -> None:
    state = _gateway_state()
    runner, base = await _serve(make_gateway_app(state))
    try:
        async with httpx.AsyncClient(base_url=base) as client:
            assert (await client.get("/metrics")).status_code == 401  # protected
            health = await client.get("/health")
            healthz = await client.get("/healthz")
            await client.get("/health?probe=1")
            await client.get("/health/../health")
    finally:
        await runner.cleanup()
    assert health.status_code == 200 and health.text == healthz.text
    assert state.requests["/health"] == 3  # the query string and dot segments fold in
    assert state.requests["/healthz"] == 1


async def test_gateway_openapi_lists_health() -> None:
    state = _gateway_state()
    runner, base = await _serve(make_gateway_app(state))
    try:
        async with httpx.AsyncClient(base_url=base) as client:
            paths = (await client.get("/openapi.json")).json()["paths"]
    finally:
        await runner.cleanup()
    assert paths["/health"]["get"]["responses"] == paths["/healthz"]["get"]["responses"]
