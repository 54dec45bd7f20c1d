"""Hostile or broken nodes over real SSH on loopback (issue 12): refusals name the peer and
the real reason; what a node sends is quoted in the gateway's log."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import shutil
import subprocess
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import asyncssh
import pytest

from cloud_gateway.app import Gateway
from cloud_gateway.trust import certs
from gpurelay.wire import SUBSYSTEM, ErrorFrame, FrameDecoder, FrameEncoder, Hello
from harness.fleet import (
    Pki,
    agent_config,
    auth_failures,
    gateway_config,
    make_pki,
    running_agent,
    running_gateway,
)
from harness.waiting import wait_for
from tests.conftest import required_tool


def refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused ")]


async def test_a_refused_login_names_the_peer_address(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """It said ``refused edge-a from None``: the peer was read after the transport closed."""
    pki = make_pki(tmp_path)
    creds = pki.node("edge-a", days=1, now=time.time() - 3 * 86400)  # expired
    with caplog.at_level(logging.WARNING, logger="cloud_gateway"):
        async with running_gateway(gateway_config(pki)) as gw:
            async with running_agent(agent_config(pki, "edge-a", gw, creds=creds)):
                await wait_for(lambda: auth_failures(gw, "expired") >= 1, what="a refusal")
    lines = refusals(caplog)
    assert lines, caplog.text
    assert all(" from 127.0.0.1:" in line for line in lines), lines
    assert "from None" not in caplog.text


async def test_a_certificate_with_an_unknown_critical_option_is_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Refused (right), but it was counted as ``not_a_certificate`` (wrong): asyncssh drops
    a certificate it cannot decode and the client falls back to its plain key."""
    keygen = required_tool("ssh-keygen", "EDGE_GPU_RELAY_REQUIRE_SSH_KEYGEN", "openssh-client")
    pki = make_pki(tmp_path)
    creds = pki.node("edge-a")
    signed = tmp_path / "odd"
    signed.mkdir()
    public = signed / "edge-a.pub"
    shutil.copy(creds.public_key, public)
    subprocess.run(
        [str(keygen), "-q", "-s", str(pki.ca.dir / "user_ca"), "-I", "edge-a", "-n", "edge-a",
         "-O", "critical:frobnicate=yes", "-V", "+1d", str(public)],
        check=True, capture_output=True, timeout=30,
    )  # fmt: skip
    ssh = required_tool("ssh", "EDGE_GPU_RELAY_REQUIRE_SSH_KEYGEN", "openssh-client")
    with caplog.at_level(logging.WARNING, logger="cloud_gateway"):
        async with running_gateway(gateway_config(pki)) as gw:
            # OpenSSH's own client: asyncssh cannot even load such a certificate
            login = await asyncio.create_subprocess_exec(
                str(ssh), "-F", "/dev/null", "-p", str(gw.ssh_port),
                "-i", str(creds.private_key), "-o", f"CertificateFile={signed / 'edge-a-cert.pub'}",
                "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
                "-o", "UserKnownHostsFile=/dev/null", "-o", "ConnectTimeout=10",
                "-s", "edge-a@127.0.0.1", "gpurelay",
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            _, err = await asyncio.wait_for(login.communicate(), 30)
            assert login.returncode != 0, err
            await wait_for(
                lambda: auth_failures(gw, "bad_certificate") >= 1, what="bad_certificate"
            )
            assert auth_failures(gw, "not_a_certificate") == 0
    assert any("frobnicate" in line for line in refusals(caplog)), caplog.text


async def test_a_gateway_without_a_host_certificate_is_a_host_key_failure(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The agent trusts the host CA (an @cert-authority line) and the gateway has a key but
    no certificate: asyncssh says "Unable to find compatible server host key", which was
    counted as `connect` (network trouble, says the guide). It is a host key problem."""
    pki = make_pki(tmp_path)
    bare = tmp_path / "bare" / "host_key"  # the gateway's key without its -cert.pub
    bare.parent.mkdir()
    shutil.copy(pki.gateway_key, bare)
    cfg = gateway_config(pki)
    cfg = dataclasses.replace(cfg, ssh=dataclasses.replace(cfg.ssh, host_key=bare))
    with caplog.at_level(logging.WARNING, logger="edge_agent"):
        async with running_gateway(cfg) as gw:
            async with running_agent(agent_config(pki, "edge-a", gw)) as agent:
                tunnel = agent.tunnel
                assert tunnel is not None
                await wait_for(
                    lambda: tunnel.stats.failures.get("host_key", 0) >= 1, what="host_key"
                )
                assert tunnel.stats.failures.get("connect", 0) == 0
    assert "host certificate" in caplog.text and "issue-gateway" in caplog.text


@asynccontextmanager
async def raw_node(
    pki: Pki, gw: Gateway, name: str, creds: certs.Credentials | None = None
) -> AsyncIterator[asyncssh.SSHClientConnection]:
    """A hand-driven SSH client with a valid node certificate: what a stolen key can do."""
    creds = creds or pki.node(name)
    key = asyncssh.read_private_key(str(creds.private_key))
    cert = asyncssh.read_certificate(str(creds.certificate))
    async with asyncssh.connect(
        "127.0.0.1",
        gw.ssh_port,
        username=name,
        client_keys=[(key, cert)],
        known_hosts=str(pki.ca.known_hosts),
        agent_path=None,
        config=None,
    ) as conn:
        yield conn


def hello_frame() -> bytes:
    return FrameEncoder().encode(Hello(agent_version="0", node="evil"))


async def test_a_partial_frame_is_dropped_at_its_deadline(tmp_path: Path) -> None:
    """40 channels each parking a 4 MiB partial frame held +127 MiB with no timeout."""
    pki = make_pki(tmp_path)
    cfg = gateway_config(pki)
    cfg = dataclasses.replace(cfg, ssh=dataclasses.replace(cfg.ssh, frame_timeout_seconds=1.0))
    async with running_gateway(cfg) as gw:
        async with raw_node(pki, gw, "evil") as conn:
            writer, reader, _ = await conn.open_session(subsystem=SUBSYSTEM, encoding=None)
            writer.write(hello_frame())
            writer.write(b"\x00\x40\x00\x00" + b"\x01\x03" + b"\x00" * 60_000)  # 4 MiB promised
            data = await asyncio.wait_for(reader.read(65536), 10)
        (frame,) = FrameDecoder().feed(data)
        assert isinstance(frame, ErrorFrame) and frame.code == "incomplete", frame
        assert "ssh.frame_timeout_seconds" in frame.message
        assert gw.ssh is not None and gw.ssh.protocol_errors["incomplete"] == 1


async def test_one_connection_gets_one_telemetry_channel(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    async with running_gateway(gateway_config(pki)) as gw:
        async with raw_node(pki, gw, "evil") as conn:
            first, _, _ = await conn.open_session(subsystem=SUBSYSTEM, encoding=None)
            first.write(hello_frame())
            await wait_for(lambda: gw.ssh is not None and gw.ssh.channels == 1, what="a channel")
            extra = []
            for _ in range(5):
                _, _, stderr = await conn.open_session(subsystem=SUBSYSTEM, encoding=None)
                extra.append(await asyncio.wait_for(stderr.read(), 5))
            assert gw.ssh is not None and gw.ssh.channels == 1
            assert gw.ssh.protocol_errors["too_many_channels"] == 5
            assert all(b"too many telemetry channels" in e for e in extra), extra


async def test_a_stolen_certificate_fighting_the_real_node_is_a_security_event(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A second client with the same certificate, reconnecting every ~0.3 s, evicted the
    real node again and again and only replaced_connections showed it."""
    pki = make_pki(tmp_path)
    creds = pki.node("edge-a")
    with caplog.at_level(logging.ERROR, logger="cloud_gateway"):
        async with running_gateway(gateway_config(pki)) as gw:
            async with running_agent(agent_config(pki, "edge-a", gw, creds=creds)):
                await wait_for(lambda: gw.ingest.stats.batches >= 1, what="the real node")
                for _ in range(4):
                    async with raw_node(pki, gw, "edge-a", creds) as conn:
                        writer, _, _ = await conn.open_session(subsystem=SUBSYSTEM, encoding=None)
                        writer.write(hello_frame())
                        await asyncio.sleep(0.3)
                await wait_for(lambda: gw.ingest.stats.connection_conflicts >= 1, what="a fight")
                view = gw.registry.node("edge-a", now=time.time())
                assert view is not None and view.connection_conflicts >= 1
    announced = [r.getMessage() for r in caplog.records if "two connections use" in r.getMessage()]
    assert len(announced) == 1, announced
    assert "127.0.0.1:" in announced[0]
