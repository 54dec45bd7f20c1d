"""A proxied scrape of a node owned by another gateway takes one authenticated hop to the
owner's peer listener (cloud_gateway.relay.peers), and never more than one."""

from __future__ import annotations

import ssl
from pathlib import Path

import httpx
import pytest

from cloud_gateway.cluster.config import ClusterConfig, peer_tls
from cloud_gateway.errors import GatewayConfigError
from cloud_gateway.relay.peers import PEER_PREFIX, PeerClient
from harness.fleet import (
    TOKEN,
    agent_config,
    gateway_config,
    make_pki,
    running_agent,
    running_gateway,
)
from harness.peers import PEER_TOKEN, peer_listener
from harness.tls import make_tls
from harness.waiting import wait_for

AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def test_a_node_owned_by_another_gateway_is_scraped_through_it(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    async with (
        running_gateway(gateway_config(pki)) as a,
        running_gateway(gateway_config(pki)) as b,
        peer_listener(a) as a_listener,
        peer_listener(b) as b_listener,
    ):
        a_peer, b_peer = a_listener.address, b_listener.address
        # the fleet view: edge-1 is on a; b's view says so, a's view (wrongly) says b —
        # a request that arrives at a from a peer must not bounce back to b
        b.relay.peers = b_client = PeerClient(
            PEER_TOKEN, lambda n: ("gw-a", a_peer) if n == "edge-1" else None
        )
        a.relay.peers = a_client = PeerClient(PEER_TOKEN, lambda n: ("gw-b", b_peer))
        async with running_agent(agent_config(pki, "edge-1", a)) as agent:
            await wait_for(lambda: a.ingest.stats.batches >= 1)
            base_a = f"http://127.0.0.1:{a.http_port}"
            base_b = f"http://127.0.0.1:{b.http_port}"
            async with httpx.AsyncClient(timeout=20) as client:
                direct = await client.get(
                    f"{base_a}/proxy/edge-1/{agent.port}/metrics", headers=AUTH
                )
                hop = await client.get(f"{base_b}/proxy/edge-1/{agent.port}/metrics", headers=AUTH)
                assert direct.status_code == hop.status_code == 200
                assert "DCGM_FI_DEV_GPU_UTIL" in hop.text
                assert hop.headers["Content-Type"] == direct.headers["Content-Type"]
                assert b_client.requests == 1
                # errors still name the node: a node nobody owns is unknown on b
                r = await client.get(f"{base_b}/proxy/nope/9100/metrics", headers=AUTH)
                assert r.status_code == 404 and "unknown node 'nope'" in r.text
                # the peer listener: only with the peer token, and it never hops again
                url = f"http://{a_peer}{PEER_PREFIX}/edge-1/{agent.port}/metrics"
                assert (await client.get(url)).status_code == 401
                assert (await client.get(url, headers=AUTH)).status_code == 401  # not a peer
                peer = {"Authorization": f"Bearer {PEER_TOKEN}"}
                assert (await client.get(url, headers=peer)).status_code == 200
                r = await client.get(f"http://{a_peer}{PEER_PREFIX}/elsewhere/9100/m", headers=peer)
                assert r.status_code == 404 and "unknown node 'elsewhere'" in r.text
                assert a_client.requests == 0  # a did not forward it to b
        await a_client.close()
        await b_client.close()
        # the owner goes away: b answers 502 naming it
    async with running_gateway(gateway_config(pki)) as b:
        b.relay.peers = b_client = PeerClient(PEER_TOKEN, lambda n: ("gw-a", a_peer))
        async with httpx.AsyncClient(timeout=20) as client:
            r = await client.get(
                f"http://127.0.0.1:{b.http_port}/proxy/edge-1/9400/metrics", headers=AUTH
            )
            assert r.status_code == 502
            assert f"node 'edge-1' is on gateway gw-a ({a_peer}), which cannot be reached" in r.text
        await b_client.close()


async def test_a_hopped_scrape_comes_back_in_the_encoding_the_client_asked_for(
    tmp_path: Path,
) -> None:
    """The hop adds no header of its own: a client that sent no Accept-Encoding gets the
    body as text (aiohttp's client would ask the owner for gzip, and the hop passes the
    compressed body through untouched), one that asked for gzip gets gzip, as directly."""
    pki = make_pki(tmp_path)
    async with (
        running_gateway(gateway_config(pki)) as a,
        running_gateway(gateway_config(pki)) as b,
        peer_listener(a) as a_listener,
    ):
        b.relay.peers = b_client = PeerClient(PEER_TOKEN, lambda n: ("gw-a", a_listener.address))
        async with running_agent(agent_config(pki, "edge-1", a)) as agent:
            await wait_for(lambda: a.ingest.stats.batches >= 1)
            url = f"http://127.0.0.1:{{}}/proxy/edge-1/{agent.port}/metrics"
            async with httpx.AsyncClient(timeout=20) as client:
                del client.headers["Accept-Encoding"]  # httpx's default asks for gzip
                for asked in (None, "identity", "gzip"):
                    headers = dict(AUTH) if asked is None else {**AUTH, "Accept-Encoding": asked}
                    direct = await client.get(url.format(a.http_port), headers=headers)
                    hop = await client.get(url.format(b.http_port), headers=headers)
                    assert direct.status_code == hop.status_code == 200, asked
                    sent = hop.headers.get("Content-Encoding")
                    assert sent == direct.headers.get("Content-Encoding"), asked
                    assert sent == ("gzip" if asked == "gzip" else None), asked
                    assert "DCGM_FI_DEV_GPU_UTIL" in hop.text, asked
            assert b_client.requests == 3
        await b_client.close()


async def test_the_peer_hop_runs_over_tls_when_configured(tmp_path: Path) -> None:
    """Issue 24, item 10: the peer token went over plain http. With ``[cluster]
    peer_tls_*`` the hop is https, the owner's certificate checked against the peer CA;
    plain http to that listener gets nothing, and a peer without the CA gets a 502."""
    pki = make_pki(tmp_path)
    tls_files = make_tls(tmp_path / "tls")
    section = ClusterConfig(
        peer_tls_cert_file=str(tls_files.server_cert),
        peer_tls_key_file=str(tls_files.server_key),
        peer_tls_ca_file=str(tls_files.ca),
    )
    contexts = peer_tls(section)
    assert contexts is not None
    server_tls, client_tls = contexts
    async with (
        running_gateway(gateway_config(pki)) as a,
        running_gateway(gateway_config(pki)) as b,
        peer_listener(a, tls=server_tls) as a_listener,
    ):
        a_peer = a_listener.address
        b.relay.peers = b_client = PeerClient(
            PEER_TOKEN, lambda n: ("gw-a", a_peer), tls=client_tls
        )
        async with running_agent(agent_config(pki, "edge-1", a)) as agent:
            await wait_for(lambda: a.ingest.stats.batches >= 1)
            url = f"http://127.0.0.1:{b.http_port}/proxy/edge-1/{agent.port}/metrics"
            async with httpx.AsyncClient(timeout=20) as client:
                hop = await client.get(url, headers=AUTH)
                assert hop.status_code == 200 and "DCGM_FI_DEV_GPU_UTIL" in hop.text
                assert b_client.requests == 1
                peer = {"Authorization": f"Bearer {PEER_TOKEN}"}
                with pytest.raises(httpx.HTTPError):  # the token never goes out in clear
                    await client.get(f"http://{a_peer}{PEER_PREFIX}/edge-1/9400/m", headers=peer)
            await b_client.close()
            # a peer that does not trust the peer CA (the system's CAs only) gets a 502
            b.relay.peers = stranger = PeerClient(
                PEER_TOKEN, lambda n: ("gw-a", a_peer), tls=ssl.create_default_context()
            )
            async with httpx.AsyncClient(timeout=20) as client:
                r = await client.get(url, headers=AUTH)
            assert r.status_code == 502 and "cannot be reached" in r.text, r.text
            await stranger.close()


def test_peer_tls_needs_all_three_files_and_says_which_are_missing(tmp_path: Path) -> None:
    with pytest.raises(GatewayConfigError, match=r"missing cluster\.peer_tls_ca_file"):
        peer_tls(ClusterConfig(peer_tls_cert_file="c", peer_tls_key_file="k"))
    with pytest.raises(GatewayConfigError, match="cannot be used"):
        peer_tls(
            ClusterConfig(
                peer_tls_cert_file=str(tmp_path / "none.crt"),
                peer_tls_key_file=str(tmp_path / "none.key"),
                peer_tls_ca_file=str(tmp_path / "none.ca"),
            )
        )
    assert peer_tls(ClusterConfig()) is None
