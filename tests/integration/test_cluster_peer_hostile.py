"""The peer listener (cloud_gateway.relay.peers) under hostile clients: a flood of silent
connections, wrong and missing tokens, slow headers and a slow body. Each gets a clear
answer or is closed, the listener holds at most PEER_MAX_CONNECTIONS connections, and a
real proxied scrape through the peer hop still works during and after the flood."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from cloud_gateway.relay.peers import PEER_MAX_CONNECTIONS, PEER_PREFIX, PeerClient
from harness.fleet import (
    TOKEN,
    agent_config,
    gateway_config,
    make_pki,
    running_agent,
    running_gateway,
)
from harness.peers import PEER_TOKEN, peer_listener
from harness.waiting import wait_for

AUTH = {"Authorization": f"Bearer {TOKEN}"}
BOUND = 60.0  # generous: a noisy machine


async def _closed_by_server(reader: asyncio.StreamReader) -> bytes:
    """What the server sent before closing (bounded)."""
    async with asyncio.timeout(BOUND):
        return await reader.read()


async def test_the_peer_listener_survives_hostile_clients(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    async with (
        running_gateway(gateway_config(pki)) as a,
        running_gateway(gateway_config(pki)) as b,
        peer_listener(a) as listener,
    ):
        a_peer, port, guard = listener.address, listener.port, listener.guard
        b.relay.peers = b_client = PeerClient(PEER_TOKEN, lambda n: ("gw-a", a_peer))
        writers: list[asyncio.StreamWriter] = []
        try:
            async with running_agent(agent_config(pki, "edge-1", a)) as agent:
                await wait_for(lambda: a.ingest.stats.batches >= 1)
                hop_url = f"http://127.0.0.1:{b.http_port}/proxy/edge-1/{agent.port}/metrics"
                peer_url = f"http://{a_peer}{PEER_PREFIX}/edge-1/{agent.port}/metrics"
                async with httpx.AsyncClient(timeout=BOUND) as client:

                    async def scrape() -> None:
                        r = await client.get(hop_url, headers=AUTH)
                        assert r.status_code == 200, r.text
                        assert "DCGM_FI_DEV_GPU_UTIL" in r.text

                    await scrape()
                    # wrong and missing tokens: 401, in constant time, nothing relayed
                    for headers in (
                        {},
                        {"Authorization": "Bearer"},
                        {"Authorization": f"Bearer {PEER_TOKEN[:-1]}x"},
                        {"Authorization": f"Bearer {PEER_TOKEN}{PEER_TOKEN}"},
                        {"Authorization": f"Basic {PEER_TOKEN}"},
                        AUTH,  # an API token is not a peer token
                    ):
                        r = await client.get(peer_url, headers=headers)
                        assert r.status_code == 401
                        assert r.text == "peer token missing or wrong\n"

                    # a flood of silent connections, past the cap
                    for _ in range(PEER_MAX_CONNECTIONS + 50):
                        _, w = await asyncio.open_connection("127.0.0.1", port)
                        writers.append(w)
                    await wait_for(lambda: guard.stats.closed["evicted"] >= 50, timeout=BOUND)
                    assert guard.stats.open <= PEER_MAX_CONNECTIONS
                    await scrape()  # evicts one more silent connection to get in

                    # slow headers: closed at the header timeout, with nothing sent
                    reader, w = await asyncio.open_connection("127.0.0.1", port)
                    writers.append(w)
                    w.write(f"GET {PEER_PREFIX}/edge-1/{agent.port}/metrics HTTP/1.1\r\n".encode())
                    await w.drain()
                    assert await _closed_by_server(reader) == b""

                    # a slow body with the right token: 408 at the body timeout
                    reader, w = await asyncio.open_connection("127.0.0.1", port)
                    writers.append(w)
                    w.write(
                        f"POST {PEER_PREFIX}/edge-1/{agent.port}/metrics HTTP/1.1\r\n"
                        f"Host: {a_peer}\r\nAuthorization: Bearer {PEER_TOKEN}\r\n"
                        "Content-Length: 100\r\n\r\n0123456789".encode()
                    )
                    await w.drain()
                    answer = await _closed_by_server(reader)
                    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
                    assert b"request body not received within 5s" in answer

                    # the silent flood is closed at the header timeout; a scrape works
                    await wait_for(lambda: guard.stats.open <= 1, timeout=BOUND)
                    assert guard.stats.closed["header_timeout"] >= PEER_MAX_CONNECTIONS - 2
                    await scrape()
                    assert b_client.requests == 3
        finally:
            for w in writers:
                w.close()
            await b_client.close()
