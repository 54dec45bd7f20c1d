"""[ssh] proxy_protocol with a real haproxy: the shipped deploy/haproxy/haproxy.cfg (only
its addresses changed) sends PROXY v2 to one real gateway, and a real agent behind it is
seen by the gateway at the agent's own address, not haproxy's.

haproxy connects to the gateway from 127.0.0.3 (``source``), the only address in
``ssh.proxy_protocol_from``; the agent dials haproxy from 127.0.0.1. Without the header the
gateway would report 127.0.0.3 for the agent; with it, the agent's socket (checked in
/proc/net/tcp: that port is the agent's connection to haproxy). Then the hostile cases,
straight at the gateway's SSH port: a header from a source outside the list, no header,
garbage, a header that never ends (the timeout), each closed before the gateway says a
byte, with a log line naming the source and the reason and a count by reason; a v2 LOCAL
header (the balancer's own connection) gets SSH; a real SSH client after a v1 header is
served under the header's address (its refused login names it); and the agent behind
haproxy is still connected after all that.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, closing
from pathlib import Path

import asyncssh
import httpx
import pytest

from cloud_gateway.app import Gateway
from cloud_gateway.config import GatewayConfig
from cloud_gateway.ssh.balancer_header import V2_SIGNATURE
from gpurelay.wire import SUBSYSTEM, FrameEncoder, Hello
from harness.fleet import (
    TOKEN,
    Pki,
    agent_config,
    gateway_config,
    make_pki,
    metrics_text,
    running_agent,
    running_gateway,
)
from harness.ports import free_ports
from harness.process import Process
from harness.waiting import wait_for

CFG = Path(__file__).resolve().parents[2] / "deploy" / "haproxy" / "haproxy.cfg"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BALANCER = "127.0.0.3"  # haproxy's source address towards the gateway
HEADER_TIMEOUT = 1.0  # ssh.proxy_protocol_timeout_seconds here (5 s by default)


def shipped_config(gw: Gateway, lb_port: int, admin: Path) -> str:
    """The shipped file in front of ``gw`` alone: loopback addresses, no syslog, one
    server (from 127.0.0.3); every other line as shipped, send-proxy-v2 included."""
    text = CFG.read_text(encoding="utf-8")
    assert " send-proxy-v2" in text  # what this test is about
    text = text.replace("    log /dev/log local0\n", "")
    text = text.replace("    maxconn 20000\n", "    maxconn 100\n")
    text = re.sub(r"stats socket \S+", f"stats socket {admin}", text)
    text = text.replace("bind :2222", f"bind 127.0.0.1:{lb_port}")
    text = text.replace(" port 9410 ", f" port {gw.http_port} ")
    text = re.sub(r"^    server gw[23] \S+\n", "", text, flags=re.MULTILINE)
    return re.sub(
        r"^    server gw1 \S+$",
        f"    server gw1 127.0.0.1:{gw.ssh_port} source {BALANCER}",
        text,
        flags=re.MULTILINE,
    )


@asynccontextmanager
async def haproxy(binary: Path, tmp: Path, gw: Gateway) -> AsyncIterator[int]:
    (lb_port,) = free_ports(1)
    cfg = tmp / "haproxy.cfg"
    cfg.write_text(shipped_config(gw, lb_port, tmp / "haproxy.sock"))
    proc = Process("haproxy", [str(binary), "-db", "-f", str(cfg)], tmp / "haproxy.log")
    proc.start()
    try:

        def listening() -> bool:
            with closing(socket.socket()) as s:
                return s.connect_ex(("127.0.0.1", lb_port)) == 0

        await wait_for(listening, timeout=20, what="haproxy listening", alive=[proc])
        yield lb_port
    finally:
        proc.stop()


def _ip(word: str) -> str:
    return socket.inet_ntoa(bytes.fromhex(word)[::-1])  # /proc/net/tcp: host order


def tcp_peers() -> set[tuple[str, int, str, int]]:
    """Established IPv4 connections (local address, port, remote address, port)."""
    out = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] != "01":  # ESTABLISHED
            continue
        (la, lp), (ra, rp) = (f.split(":") for f in fields[1:3])
        out.add((_ip(la), int(lp, 16), _ip(ra), int(rp, 16)))
    return out


async def nodes(gw: Gateway) -> dict[str, dict[str, object]]:
    async with httpx.AsyncClient(timeout=10) as client:
        r = await client.get(f"http://127.0.0.1:{gw.http_port}/api/v1/nodes", headers=AUTH)
        r.raise_for_status()
        return {n["name"]: n for n in r.json()["nodes"]}


async def refused_by_gateway(port: int, source: str, payload: bytes) -> bytes:
    """Connect from ``source``, send ``payload``, return what the gateway sent before it
    closed (nothing at all, if it refused before SSH)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    try:
        writer.write(payload)
        await writer.drain()
        got = b""
        while chunk := await asyncio.wait_for(reader.read(4096), timeout=30):
            got += chunk
        return got
    except ConnectionError:  # reset: refused before it read everything
        return b""
    finally:
        writer.close()


def refused_count(gw: Gateway, reason: str) -> int:
    assert gw.ssh is not None and gw.ssh.proxied is not None
    return gw.ssh.proxied.refused[reason]


def proxied_gateway(pki: Pki) -> GatewayConfig:
    cfg = gateway_config(pki)
    ssh = dataclasses.replace(
        cfg.ssh,
        proxy_protocol=True,
        proxy_protocol_from=(f"{BALANCER}/32",),
        proxy_protocol_timeout_seconds=HEADER_TIMEOUT,
    )
    return dataclasses.replace(cfg, ssh=ssh)


async def test_behind_haproxy_the_gateway_sees_the_agent_and_refuses_the_rest(
    haproxy_bin: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="cloud_gateway")
    pki = make_pki(tmp_path)
    async with (
        running_gateway(proxied_gateway(pki)) as gw,
        haproxy(haproxy_bin, tmp_path, gw) as lb_port,
    ):
        cfg = agent_config(pki, "edge-1", gw)
        cfg = dataclasses.replace(
            cfg, gateway=dataclasses.replace(cfg.gateway, address=f"127.0.0.1:{lb_port}")
        )
        async with running_agent(cfg):
            await wait_for(lambda: gw.ingest.stats.batches >= 1, timeout=30, what="a batch")
            entry = (await nodes(gw))["edge-1"]
            host, port = str(entry["remote"]).rsplit(":", 1)
            assert host == "127.0.0.1", entry["remote"]  # the agent, not 127.0.0.3
            # that port is the agent's end of its connection to haproxy
            assert ("127.0.0.1", int(port), "127.0.0.1", lb_port) in tcp_peers()
            assert sum(gw.ssh.proxied.refused.values()) == 0  # type: ignore[union-attr]

            # --- hostile, straight at the gateway ---------------------------------------
            v2_local = V2_SIGNATURE + bytes([0x20, 0x00, 0, 0])
            assert await refused_by_gateway(gw.ssh_port, "127.0.0.1", v2_local) == b""
            assert refused_count(gw, "source") == 1
            banner = b"SSH-2.0-OpenSSH_9.6\r\n"
            assert await refused_by_gateway(gw.ssh_port, BALANCER, banner) == b""
            assert await refused_by_gateway(gw.ssh_port, BALANCER, b"\x00" * 64) == b""
            assert refused_count(gw, "missing") == 2
            bad = b"PROXY TCP4 1.2.3.4 5.6.7.8 99999 22\r\n"
            assert await refused_by_gateway(gw.ssh_port, BALANCER, bad) == b""
            assert refused_count(gw, "malformed") == 1
            slow = b"PROXY TCP4 198.51.100.7 "  # and then nothing: closed at the timeout
            assert await refused_by_gateway(gw.ssh_port, BALANCER, slow) == b""
            assert refused_count(gw, "timeout") == 1

            log = caplog.text
            assert "refused a connection from 127.0.0.1:" in log and "(source)" in log
            assert f"refused a connection from {BALANCER}:" in log
            for reason in ("missing", "malformed", "timeout"):
                assert f"before SSH ({reason})" in log
            counted = 'gpurelay_gateway_proxy_header_refused_total{reason="timeout"} 1'

            async def exported() -> bool:
                return counted in await metrics_text(gw)

            await wait_for(exported, timeout=20, what=counted)

            # a v2 LOCAL header (the balancer's own connection): SSH follows, as is
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", gw.ssh_port, local_addr=(BALANCER, 0)
            )
            writer.write(v2_local)
            assert (await asyncio.wait_for(reader.readline(), 30)).startswith(b"SSH-2.0-")
            writer.close()

            # --- a real SSH client after a v1 header: SSH runs, under the header's address;
            # a plain key (no certificate) is refused, and the refusal names that address
            plain = asyncssh.generate_private_key("ssh-ed25519")  # no certificate with it
            sock = socket.create_connection(
                ("127.0.0.1", gw.ssh_port), source_address=(BALANCER, 0)
            )
            sock.sendall(b"PROXY TCP4 198.51.100.7 192.0.2.1 50123 2222\r\n")
            with pytest.raises(asyncssh.PermissionDenied):
                await asyncssh.connect(
                    "localhost",
                    sock=sock,
                    username="edge-2",
                    client_keys=[plain],
                    known_hosts=str(pki.ca.known_hosts),
                )
            refusal = "refused 'edge-2' from 198.51.100.7:50123: not_a_certificate"
            await wait_for(lambda: refusal in caplog.text, what=refusal)

            # the agent behind haproxy was not disturbed
            before = gw.ingest.stats.batches
            await wait_for(lambda: gw.ingest.stats.batches > before, timeout=30)
            assert (await nodes(gw))["edge-1"]["remote"] == entry["remote"]


@pytest.mark.parametrize(
    ("header", "remote"),
    [
        (b"PROXY TCP4 198.51.100.7 192.0.2.1 50123 2222\r\n", "198.51.100.7:50123"),
        (b"PROXY TCP6 2001:db8::7 2001:db8::1 4711 2222\r\n", "2001:db8::7:4711"),
        (V2_SIGNATURE + bytes([0x20, 0x00, 0, 0]), f"{BALANCER}:"),  # LOCAL: the balancer
    ],
)
async def test_a_node_after_a_header_is_listed_at_the_headers_address(
    tmp_path: Path, header: bytes, remote: str
) -> None:
    """No haproxy needed: the header by hand, then a real SSH client with a node
    certificate on the same socket, a telemetry channel and a HELLO; the SSH bytes that
    follow the header in the same segment are not lost."""
    pki = make_pki(tmp_path)
    creds = pki.node("edge-2")
    key = asyncssh.read_private_key(str(creds.private_key))
    cert = asyncssh.read_certificate(str(creds.certificate))
    async with running_gateway(proxied_gateway(pki)) as gw:
        sock = socket.create_connection(("127.0.0.1", gw.ssh_port), source_address=(BALANCER, 0))
        sock.sendall(header)
        async with asyncssh.connect(
            "localhost",
            sock=sock,
            username="edge-2",
            client_keys=[(key, cert)],
            known_hosts=str(pki.ca.known_hosts),
            agent_path=None,
            config=None,
        ) as conn:
            writer, _, _ = await conn.open_session(subsystem=SUBSYSTEM, encoding=None)
            writer.write(FrameEncoder().encode(Hello(agent_version="0", node="edge-2")))

            async def listed() -> bool:
                entry = (await nodes(gw)).get("edge-2")
                return entry is not None and str(entry["remote"]).startswith(remote)

            await wait_for(listed, timeout=20, what=f"edge-2 listed from {remote}")
        assert gw.ssh is not None and gw.ssh.proxied is not None
        assert sum(gw.ssh.proxied.refused.values()) == 0
