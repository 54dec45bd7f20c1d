"""The attacks of issue 12 that were already refused, kept as regression tests: whatever
they try, the gateway refuses it and an honest node keeps fresh data.

SSH with a valid node certificate: exec, shell, sftp, direct-tcpip to the gateway's own
loopback. SSH without one: a bounded flood of logins that never finish. HTTP: proxy
targets that are not published endpoints (the gateway's sshd, a cloud metadata address),
path traversal out of /proxy, CL+TE request framing, oversized headers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import asyncssh
import httpx
import pytest

from harness.fleet import (
    TOKEN,
    agent_config,
    gateway_config,
    make_pki,
    running_agent,
    running_gateway,
)
from harness.waiting import wait_for

AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def raw_http(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        return await asyncio.wait_for(reader.read(65536), 10)
    finally:
        writer.close()


async def test_a_node_certificate_opens_nothing_but_the_telemetry_subsystem(
    tmp_path: Path,
) -> None:
    pki = make_pki(tmp_path)
    creds = pki.node("evil")
    async with running_gateway(gateway_config(pki)) as gw:
        async with running_agent(agent_config(pki, "honest", gw)):
            await wait_for(lambda: gw.ingest.stats.batches >= 1, what="the honest node")
            async with asyncssh.connect(
                "127.0.0.1",
                gw.ssh_port,
                username="evil",
                client_keys=[
                    (
                        asyncssh.read_private_key(str(creds.private_key)),
                        asyncssh.read_certificate(str(creds.certificate)),
                    )
                ],
                known_hosts=str(pki.ca.known_hosts),
                agent_path=None,
                config=None,
            ) as conn:
                shell = await conn.run("id", check=False, timeout=10)
                assert shell.exit_status != 0 and "gpurelay" in str(shell.stderr)
                interactive = await conn.run(check=False, timeout=10)  # a shell
                assert interactive.exit_status != 0
                with pytest.raises((asyncssh.Error, OSError)):
                    await asyncio.wait_for(conn.start_sftp_client(), 10)
                for host, port in (("127.0.0.1", gw.ssh_port), ("169.254.169.254", 80)):
                    with pytest.raises(asyncssh.ChannelOpenError):
                        await conn.open_connection(host, port)
            before = gw.ingest.stats.batches
            await wait_for(lambda: gw.ingest.stats.batches > before, what="the honest node on")


async def test_a_flood_of_unfinished_logins_is_cut_by_the_login_timeout(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    cfg = gateway_config(pki)
    cfg = dataclasses.replace(cfg, ssh=dataclasses.replace(cfg.ssh, login_timeout_seconds=1.0))
    async with running_gateway(cfg) as gw:
        floods = [await asyncio.open_connection("127.0.0.1", gw.ssh_port) for _ in range(100)]
        for _, writer in floods:
            writer.write(b"SSH-2.0-flood\r\n")  # then nothing: no key exchange, no login
        started = time.monotonic()
        async with running_agent(agent_config(pki, "honest", gw)):
            await wait_for(lambda: gw.ingest.stats.batches >= 1, what="an honest login")
        closed = 0
        for reader, writer in floods:
            with_eof = await asyncio.wait_for(reader.read(), 15)  # the gateway hangs up
            closed += with_eof is not None
            writer.close()
        assert closed == 100 and time.monotonic() - started < 15


async def test_proxy_targets_outside_the_published_endpoints(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    async with running_gateway(gateway_config(pki)) as gw:
        async with running_agent(agent_config(pki, "edge-a", gw)) as agent:
            await wait_for(lambda: len(gw.endpoints.published_via("edge-a")) >= 1)
            base = f"http://127.0.0.1:{gw.http_port}"
            async with httpx.AsyncClient(base_url=base, headers=AUTH, timeout=10) as client:
                for target in (
                    f"/proxy/127.0.0.1/{gw.ssh_port}/",  # the gateway's own sshd
                    "/proxy/169.254.169.254/80/latest/meta-data/",  # cloud metadata
                    "/proxy/edge-a/22/",  # a port the node did not publish
                ):
                    r = await client.get(target)
                    assert r.status_code in (400, 403, 404), (target, r.status_code, r.text)
            # traversal out of /proxy never reaches the API without a token (raw: an HTTP
            # client would normalise the path before sending it)
            answer = await raw_http(
                gw.http_port,
                f"GET /proxy/edge-a/{agent.port}/../../../api/v1/nodes HTTP/1.1\r\n"
                "Host: x\r\nConnection: close\r\n\r\n".encode(),
            )
            assert b'"nodes"' not in answer, answer[:200]
            forward = httpx.AsyncClient(proxy=f"http://prometheus:{TOKEN}@127.0.0.1:{gw.http_port}")
            async with forward:
                r = await forward.get("http://169.254.169.254/latest/meta-data/", timeout=10)
                assert r.status_code in (400, 403, 404)


async def test_request_framing_attacks_are_refused(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    async with running_gateway(gateway_config(pki)) as gw:
        both = (
            b"POST /api/v1/nodes HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        answer = await raw_http(gw.http_port, both)
        assert answer.split(b" ", 2)[1] == b"400", answer[:80]
        huge = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n"
        answer = await raw_http(gw.http_port, huge)
        assert answer.split(b" ", 2)[1] in (b"400", b"431"), answer[:80]
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.http_port}") as client:
            assert (await client.get("/healthz")).status_code == 200  # still serving
