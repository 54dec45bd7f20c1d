"""Scrape edge ports by node name through the gateway (forward proxy and path form)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import httpx
from aiohttp import web

from edge_agent.config import PublishConfig
from harness.fleet import (
    TOKEN,
    agent_config,
    fake_exporter,
    gateway_config,
    make_pki,
    running_agent,
    running_gateway,
)
from harness.waiting import wait_for

AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def test_scrape_by_node_name_through_the_tunnel(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    async with (
        fake_exporter("node_load1 0.5\n") as sibling_port,
        fake_exporter("x 1\n", delay=5) as slow_port,
    ):
        async with running_gateway(gateway_config(pki, siblings=("edge-a=edge-cam-*",))) as gw:
            cfg = agent_config(pki, "edge-a", gw)
            cfg = dataclasses.replace(
                cfg,
                publish=(
                    PublishConfig(
                        name="node_exporter", node="edge-cam-1", port=9100, target_port=sibling_port
                    ),
                    PublishConfig(name="slow", port=9200, target_port=slow_port),
                    PublishConfig(name="closed", port=9300, target_port=1),
                ),
            )
            async with running_agent(cfg) as agent:
                await wait_for(lambda: gw.ingest.stats.batches >= 1)
                await wait_for(lambda: len(gw.endpoints.published_via("edge-a")) == 4)
                own = f"edge-a:{agent.port}"
                base = f"http://127.0.0.1:{gw.http_port}"
                async with httpx.AsyncClient(base_url=base, timeout=20) as client:
                    # path form
                    r = await client.get(f"/proxy/edge-a/{agent.port}/metrics", headers=AUTH)
                    assert r.status_code == 200 and "DCGM_FI_DEV_GPU_UTIL" in r.text
                    r = await client.get("/proxy/edge-cam-1/9100/metrics", headers=AUTH)
                    assert r.status_code == 200 and r.text == "node_load1 0.5\n"
                    # errors a user can read
                    r = await client.get("/proxy/nope/9100/metrics", headers=AUTH)
                    assert r.status_code == 404 and "unknown node 'nope'" in r.text
                    r = await client.get("/proxy/edge-a/9999/metrics", headers=AUTH)
                    assert r.status_code == 403 and "port 9999 of node 'edge-a'" in r.text
                    r = await client.get("/proxy/edge-a/9300/metrics", headers=AUTH)
                    assert r.status_code == 502 and "edge-a:9300" in r.text
                    r = await client.get(
                        "/proxy/edge-a/9200/metrics",
                        headers={**AUTH, "X-Prometheus-Scrape-Timeout-Seconds": "0.5"},
                    )
                    assert r.status_code == 504 and "edge-a:9200" in r.text
                    assert (
                        await client.get(f"/proxy/edge-a/{agent.port}/metrics")
                    ).status_code == 401
                    # service discovery
                    sd = (await client.get("/api/v1/sd", headers=AUTH)).json()
                    targets = {g["targets"][0]: g["labels"] for g in sd}
                    assert set(targets) == {own, "edge-cam-1:9100", "edge-a:9200", "edge-a:9300"}
                    assert targets[own]["node"] == "edge-a" and targets[own]["gpu_count"] == "1"
                    assert targets["edge-cam-1:9100"]["via"] == "edge-a"
                    nodes = (await client.get("/api/v1/nodes", headers=AUTH)).json()["nodes"]
                    assert "edge-cam-1:9100" in nodes[0]["published"]
                # forward proxy, as Prometheus uses proxy_url
                async with httpx.AsyncClient(
                    proxy=f"http://prometheus:{TOKEN}@127.0.0.1:{gw.http_port}", timeout=20
                ) as client:
                    r = await client.get(f"http://{own}/metrics")
                    assert r.status_code == 200 and "DCGM_FI_DEV_FB_USED" in r.text
                    r = await client.get("http://edge-cam-1:9100/metrics")
                    assert r.text == "node_load1 0.5\n"
                async with httpx.AsyncClient(proxy=f"http://127.0.0.1:{gw.http_port}") as client:
                    assert (await client.get(f"http://{own}/metrics")).status_code == 401
            # the agent is gone: its endpoints answer 503 with the last-seen time
            await wait_for(lambda: gw.registry.states(time.time())["edge-a"] == "offline")
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.http_port}") as client:
                r = await client.get("/proxy/edge-a/9200/metrics", headers=AUTH)
                assert r.status_code == 503 and "offline (last seen" in r.text
                r = await client.get("/proxy/edge-cam-1/9100/metrics", headers=AUTH)
                assert r.status_code == 503 and "reached through edge-a" in r.text
                assert (await client.get("/api/v1/sd", headers=AUTH)).json() == []
            assert gw.relay.requests[200] >= 4 and gw.relay.requests[404] == 1


async def test_the_agent_refuses_what_it_did_not_publish(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    async with running_gateway(gateway_config(pki)) as gw:
        async with running_agent(agent_config(pki, "edge-a", gw)) as agent:
            await wait_for(lambda: gw.ingest.stats.batches >= 1)
            endpoint = gw.endpoints.lookup("edge-a", agent.port)
            assert endpoint is not None
            # a gateway (compromised or buggy) asks for something else: refused at the agent
            import asyncssh

            try:
                await endpoint.conn.open_connection("edge-a", 22)
            except asyncssh.ChannelOpenError:
                pass
            else:
                raise AssertionError("the agent accepted an unpublished endpoint")
            assert agent.tunnel is not None
            await wait_for(lambda: agent.tunnel.stats.proxy_refused == 1)


async def test_a_node_cannot_publish_another_tunnel_nodes_name(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    async with running_gateway(gateway_config(pki)) as gw:
        async with running_agent(agent_config(pki, "edge-b", gw)) as b:
            await wait_for(lambda: gw.ingest.stats.batches >= 1)
            cfg = dataclasses.replace(
                agent_config(pki, "edge-a", gw),
                publish=(PublishConfig(name="hijack", node="edge-b", port=b.port),),
            )
            async with running_agent(cfg):
                await wait_for(lambda: gw.endpoints.refused >= 1)
            endpoint = gw.endpoints.lookup("edge-b", b.port)
            assert endpoint is not None and endpoint.via == "edge-b"


async def test_keep_alive_channels_are_reused_and_chunked_bodies_relayed(tmp_path: Path) -> None:
    """Upstreams answer with Content-Length or chunked; channels carry many scrapes."""

    async def chunked(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)  # no Content-Length: chunked on HTTP/1.1
        for i in range(50):
            await response.write(f"series_{i} {i}\n".encode())
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/metrics", chunked)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    expected = "".join(f"series_{i} {i}\n" for i in range(50))
    pki = make_pki(tmp_path)
    try:
        async with running_gateway(gateway_config(pki)) as gw:
            cfg = dataclasses.replace(
                agent_config(pki, "edge-a", gw),
                publish=(PublishConfig(name="chunky", port=9500, target_port=port),),
            )
            async with running_agent(cfg) as agent:
                await wait_for(lambda: gw.endpoints.lookup("edge-a", 9500) is not None)
                base = f"http://127.0.0.1:{gw.http_port}"
                async with httpx.AsyncClient(base_url=base, timeout=20) as client:
                    for _ in range(5):
                        r = await client.get("/proxy/edge-a/9500/metrics", headers=AUTH)
                        assert r.status_code == 200 and r.text == expected
                        r = await client.get(f"/proxy/edge-a/{agent.port}/healthz", headers=AUTH)
                        assert r.status_code == 200 and r.text.startswith("ok")
                assert gw.relay.requests[200] == 10
                # one channel per endpoint carried all five scrapes
                assert [len(v) for v in gw.relay._idle.values()] == [1, 1]
    finally:
        await runner.cleanup()
