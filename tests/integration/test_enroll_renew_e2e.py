"""Issue 17 §1, done when: a fresh agent enrolls with a token and runs past a renewal
without a gap in its data; a token is never used twice; an expired, reused or wrong-node
token is refused with a clear message.

Real processes throughout: a gateway with ``[enroll]`` on (the user CA key in its config,
certificates of 60 s), the token made by ``cloud-gateway certs enroll-token``, ``edge-agent
enroll`` run as a command, then the agent itself (2 simulated GPUs, a collection every
second) remote-written through the gateway into a real Prometheus. The certificate lives
60 s, so the agent renews it about 40 s after it was written, over its tunnel, and
reconnects with it; the TSDB must then hold every series at every collection.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import asyncssh
import pytest

from gpurelay.enrollment import sign_token
from gpurelay.ssh_cert import certificate_info
from harness.fleet import (
    Pki,
    agent_config,
    gateway_config,
    make_pki,
    running_agent,
    running_gateway,
)
from harness.process import ROOT, Process, clean_env
from harness.prometheus import Receiver, assert_nothing_lost
from harness.services import AgentProc, GatewayProc
from harness.waiting import wait_until

NODE = "edge-enrolled"
LIFETIME_SECONDS = 60


def command(*argv: str | Path, prefix: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *map(str, argv)],
        cwd=ROOT,
        env=clean_env(prefix),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def enroll_token(ca_dir: Path, node: str, out: Path, ttl: str = "10m") -> str:
    """``cloud-gateway certs enroll-token``: the token in ``out``, and what it printed."""
    proc = command(
        "cloud_gateway", "certs", "enroll-token", node, "--ttl", ttl, "--dir", ca_dir,
        "--out", out, prefix="CLOUD_GATEWAY_",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    token = out.read_text().strip()
    assert token.startswith("gpr1.")
    assert token not in proc.stdout + proc.stderr  # printed only with --print
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    return proc.stdout


def edge_agent_enroll(
    config: Path, gateway: GatewayProc, token: Path, *extra: str
) -> tuple[int, str]:
    proc = command(
        "edge_agent", "enroll", "--config", config, "--gateway",
        f"127.0.0.1:{gateway.ssh_port}", "--token-file", token, *extra, prefix="EDGE_AGENT_",
    )  # fmt: skip
    return proc.returncode, proc.stdout + proc.stderr


def logged(proc: Process) -> str:
    return proc.log.read_text(errors="replace")


def one_line_error(rc: int, out: str, status: int, *needles: str) -> None:
    assert rc == status, out
    assert out.count("\n") == 1 and out.startswith("edge-agent: error: "), out
    for needle in needles:
        assert needle in out, out


def test_enroll_then_renew_over_the_tunnel_without_a_gap(
    prometheus_bin: Path, tmp_path: Path
) -> None:
    pki = make_pki(tmp_path)
    host_ca = asyncssh.read_public_key(str(pki.ca.host_ca_pub)).get_fingerprint("sha256")
    user_ca = asyncssh.read_private_key(str(pki.ca.user_ca))
    receiver = Receiver(prometheus_bin, tmp_path)
    gateway = GatewayProc(
        pki,
        tmp_path,
        receiver.url,
        enroll={
            "enabled": True,
            "user_ca_key": str(pki.ca.user_ca),
            "lifetime_seconds": LIFETIME_SECONDS,
        },
    )
    edge = tmp_path / "edge"
    edge.mkdir()
    key, cert, known_hosts = edge / "node.key", edge / "node.key-cert.pub", edge / "known_hosts"
    config = edge / "agent.toml"
    config.write_text(
        f'node_name = "{NODE}"\n\n[gateway]\naddress = "127.0.0.1:{gateway.ssh_port}"\n'
        f'known_hosts = "{known_hosts}"\nkey = "{key}"\n'
    )
    procs: list[Process] = [receiver, gateway]
    try:
        receiver.start()
        wait_until(receiver.ready, 60, "prometheus ready")
        gateway.start()
        wait_until(gateway.ready, 60, "gateway ready")

        printed = enroll_token(pki.ca.dir, NODE, tmp_path / "node.token")
        assert host_ca in printed and NODE in printed and "edge-agent enroll" in printed

        # Refused before anything is sent: no way to verify the gateway, a token for another
        # node, an expired token (all input errors: exit 2).
        rc, out = edge_agent_enroll(config, gateway, tmp_path / "node.token")
        one_line_error(rc, out, 2, "--host-ca-fingerprint", str(known_hosts))
        enroll_token(pki.ca.dir, "edge-other", tmp_path / "other.token")
        rc, out = edge_agent_enroll(
            config, gateway, tmp_path / "other.token", "--host-ca-fingerprint", host_ca
        )
        one_line_error(rc, out, 2, "for node 'edge-other', not this node 'edge-enrolled'")
        expired = tmp_path / "expired.token"
        expired.write_text(sign_token(user_ca, NODE, int(time.time()) - 60, "ab" * 16))
        rc, out = edge_agent_enroll(config, gateway, expired, "--host-ca-fingerprint", host_ca)
        one_line_error(rc, out, 2, "expired at", "make a new one")
        # A gateway the pin does not match never sees the token (which then still works).
        rc, out = edge_agent_enroll(
            config,
            gateway,
            tmp_path / "node.token",
            "--host-ca-fingerprint",
            user_ca.get_fingerprint("sha256"),
        )
        one_line_error(rc, out, 1, "did not show a host certificate signed by", "not sent")
        assert not known_hosts.exists() and not cert.exists()

        rc, out = edge_agent_enroll(
            config, gateway, tmp_path / "node.token", "--host-ca-fingerprint", host_ca
        )
        assert rc == 0, out + gateway.tail()
        print(out)
        enrolled = asyncssh.read_certificate(str(cert))
        first = certificate_info(enrolled)
        assert f"serial {first.serial}" in out
        assert first.valid_before - time.time() <= LIFETIME_SECONDS
        assert list(enrolled.principals) == [NODE]  # type: ignore[attr-defined]
        assert enrolled.key.public_data == asyncssh.read_private_key(str(key)).public_data
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
        assert stat.S_IMODE(cert.stat().st_mode) == 0o644
        # The same @cert-authority line as the CA directory's (less the key's comment).
        assert known_hosts.read_text().split() == pki.ca.known_hosts.read_text().split()[:4]
        wait_until(lambda: "(enroll)" in logged(gateway), 10, "the gateway logs the issue")

        # The same token again: refused by the gateway, which says why in its log.
        rc, out = edge_agent_enroll(config, gateway, tmp_path / "node.token")
        one_line_error(rc, out, 1, "refused the token for node edge-enrolled", "already used")
        assert certificate_info(asyncssh.read_certificate(str(cert))) == first  # untouched
        log_text = logged(gateway)
        assert re.search(r"edge-enrolled.*(already used|used already)", log_text), log_text
        assert (tmp_path / "node.token").read_text().strip() not in log_text

        agent = AgentProc(
            pki, tmp_path, NODE, gateway, spool_dir=tmp_path / "spool", credentials=(key, cert)
        )
        procs.append(agent)
        started = time.time()
        agent.start()
        wait_until(lambda: agent.metric("gpurelay_agent_gateway_acked_seq") > 0, 60, "first ACK")
        expiry = agent.metric("gpurelay_agent_certificate_expiry_timestamp_seconds")
        assert expiry == first.valid_before
        wait_until(
            lambda: agent.metric("gpurelay_agent_certificate_renewals_total") >= 1,
            LIFETIME_SECONDS + 30,
            "a renewal over the tunnel",
            poll=1.0,
        )
        renewed = certificate_info(asyncssh.read_certificate(str(cert)))
        assert renewed.serial > first.serial
        assert renewed.valid_before > first.valid_before
        wait_until(
            lambda: (
                agent.metric("gpurelay_agent_certificate_expiry_timestamp_seconds")
                == renewed.valid_before
            ),
            30,
            "the agent reconnected with the renewed certificate",
        )
        assert agent.metric("gpurelay_agent_gateway_connects_total") >= 2
        assert agent.metric("gpurelay_agent_certificate_renewal_failures_total") == 0
        wait_until(lambda: "(renew)" in logged(gateway), 10, "the gateway logs the renewal")
        assert "certificate renewed" in logged(agent)

        report = assert_nothing_lost(
            receiver,
            NODE,
            started=started,
            what=f"renewal of serial {first.serial} -> {renewed.serial}",
            drained=lambda: (
                agent.metric("gpurelay_agent_spool_batches") == 0
                and agent.metric("gpurelay_agent_gateway_connected") == 1
            ),
            logs=lambda: "\n".join(p.tail() for p in procs),
        )
        print(report)
    finally:
        for proc in reversed(procs):
            proc.stop()


def due_credentials(
    pki: Pki, edge: Path, *, serial: int, now: int
) -> tuple[asyncssh.SSHKey, Path, Path]:
    """A node key and its certificate in ``edge``, valid from ``now - 100`` to ``now + 50``
    and written when issued: past two thirds of its life, so due for renewal at once."""
    user_ca = asyncssh.read_private_key(str(pki.ca.user_ca))
    key_pair = asyncssh.generate_private_key("ssh-ed25519")
    edge.mkdir()
    key, cert = edge / "node.key", edge / "node.key-cert.pub"
    key.write_bytes(key_pair.export_private_key())
    key.chmod(0o600)
    cert.write_bytes(
        user_ca.generate_user_certificate(
            key_pair, f"node:{NODE}", principals=[NODE], serial=serial,
            valid_after=now - 100, valid_before=now + 50,
        ).export_certificate()
    )  # fmt: skip
    os.utime(cert, (now - 100, now - 100))
    return key_pair, key, cert


async def test_renewal_with_a_new_key_swaps_key_and_certificate(tmp_path: Path) -> None:
    """[gateway] renew_new_key = true, both in this process (the gateway and a real agent):
    a certificate already past two thirds of its life is renewed for a key made then; the
    key file and the certificate are swapped, no <key>.next is left, and the agent is back
    on the gateway with the new pair."""
    pki = make_pki(tmp_path)
    now = int(time.time())
    old_key, key, cert = due_credentials(pki, tmp_path / "edge", serial=900, now=now)
    gw_cfg = gateway_config(pki)
    gw_cfg = dataclasses.replace(
        gw_cfg,
        enroll=dataclasses.replace(
            gw_cfg.enroll, enabled=True, user_ca_key=str(pki.ca.user_ca), lifetime_seconds=600
        ),
    )
    async with running_gateway(gw_cfg) as gateway:
        cfg = agent_config(pki, NODE, gateway)
        cfg = dataclasses.replace(
            cfg,
            gateway=dataclasses.replace(cfg.gateway, key=key, certificate=cert, renew_new_key=True),
        )
        async with running_agent(cfg) as agent:
            tunnel = agent.tunnel
            assert tunnel is not None and tunnel.renewer is not None
            renewer = tunnel.renewer
            for _ in range(300):
                if renewer.stats.renewals and tunnel.stats.connects >= 2 and tunnel.stats.connected:
                    break
                await asyncio.sleep(0.1)
            assert renewer.stats.renewals == 1, renewer.stats
            assert renewer.stats.failures == 0
            new_key = asyncssh.read_private_key(str(key))
            new_cert = asyncssh.read_certificate(str(cert))
            assert new_key.public_data != old_key.public_data
            assert new_cert.key.public_data == new_key.public_data
            assert not (key.parent / "node.key.next").exists()
            assert stat.S_IMODE(key.stat().st_mode) == 0o600
            v = certificate_info(new_cert)
            assert v.serial != 900 and v.valid_before >= now + 600 - 5
            assert renewer.stats.expiry == v.valid_before
            assert tunnel.stats.connected and tunnel.stats.connects >= 2


async def test_a_refused_renewal_keeps_the_session_and_the_certificate(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A gateway with enrollment off refuses the renewal: the agent counts it, keeps its
    session and its certificate file as it was, and does not ask again for 5 minutes."""
    pki = make_pki(tmp_path)
    _, key, cert = due_credentials(pki, tmp_path / "edge", serial=901, now=int(time.time()))
    before = cert.read_bytes()
    async with running_gateway(gateway_config(pki)) as gateway:  # [enroll] off
        cfg = agent_config(pki, NODE, gateway)
        cfg = dataclasses.replace(
            cfg, gateway=dataclasses.replace(cfg.gateway, key=key, certificate=cert)
        )
        async with running_agent(cfg) as agent:
            tunnel = agent.tunnel
            assert tunnel is not None and tunnel.renewer is not None
            for _ in range(300):
                if tunnel.renewer.stats.failures:
                    break
                await asyncio.sleep(0.1)
            assert tunnel.renewer.stats.failures == 1
            await asyncio.sleep(1.0)  # several collections and renewal checks later
            assert tunnel.renewer.stats.failures == 1 and tunnel.renewer.stats.renewals == 0
            assert tunnel.stats.connected and tunnel.stats.connects == 1
            assert cert.read_bytes() == before
    assert "certificate renewal failed" in caplog.text and "enrollment disabled" in caplog.text
