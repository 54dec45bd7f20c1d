"""What an ``enroll:`` login may hold and cost on a real gateway, with a real asyncssh
client: the gateway closes the connection right after its answer on ``gpurelay-enroll``
and closes one that opens no such subsystem in time; password logins are bounded per
source address and in all, refused over the bound as ``enroll_throttled``, logged
throttled."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
from pathlib import Path

import asyncssh
import pytest

from cloud_gateway.app import Gateway
from cloud_gateway.ssh.enrollment import Enrollment
from cloud_gateway.trust.login_limit import LoginLimiter
from cloud_gateway.trust.signing import make_enroll_token
from gpurelay.enrollment import ENROLL_SUBSYSTEM
from gpurelay.wire import SUBSYSTEM
from harness.fleet import auth_failures, make_pki, running_gateway
from harness.waiting import wait_for
from tests.integration.test_enroll_gateway import connected, enrolling, run_subsystem

BALANCER = "127.0.0.3"  # the one source allowed to send a PROXY header
# How long the gateway may take to close a connection it should close (generous: a
# connection it never closes fails the test after this).
CLOSE_BOUND = 60.0


def enrollment_of(gw: Gateway) -> Enrollment:
    assert gw.ssh is not None and gw.ssh.policy.enrollment is not None
    return gw.ssh.policy.enrollment


async def closed_by_the_gateway(conn: asyncssh.SSHClientConnection) -> bool:
    try:
        await asyncio.wait_for(conn.wait_closed(), CLOSE_BOUND)
    except TimeoutError:
        return False
    return True


@pytest.mark.parametrize("line", ["good", "junk"])
async def test_the_gateway_closes_an_enrollment_connection_after_its_answer(
    tmp_path: Path, line: str
) -> None:
    pki = make_pki(tmp_path)
    token, _ = make_enroll_token(pki.ca.dir, "edge-1", ttl_seconds=3600)
    key = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode()
    async with running_gateway(enrolling(pki)) as gw:
        enrollment_of(gw).idle_seconds = 3600  # only the answer may close it here
        async with connected(pki, gw, "enroll:edge-1", password=token, client_keys=None) as conn:
            sent = key if line == "good" else "ssh-ed25519 AAAAnot-a-key\n"
            outcome = await run_subsystem(conn, ENROLL_SUBSYSTEM, sent)
            assert outcome.status == (0 if line == "good" else 1), outcome
            assert await closed_by_the_gateway(conn), "the connection stayed open"


async def test_an_enrollment_connection_that_opens_nothing_is_closed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pki = make_pki(tmp_path)
    token, _ = make_enroll_token(pki.ca.dir, "edge-1", ttl_seconds=3600)
    with caplog.at_level(logging.INFO):
        async with running_gateway(enrolling(pki)) as gw:
            enrollment_of(gw).idle_seconds = 0.5
            async with connected(
                pki, gw, "enroll:edge-1", password=token, client_keys=None
            ) as idle:
                assert await closed_by_the_gateway(idle)
            # another subsystem (refused) does not keep it open either
            async with connected(
                pki, gw, "enroll:edge-1", password=token, client_keys=None
            ) as other:
                refused = await run_subsystem(other, SUBSYSTEM, "x\n")
                assert refused.status == 1, refused
                assert await closed_by_the_gateway(other)
            # the token was not spent: a client that opens the subsystem at once enrolls
            enrollment_of(gw).idle_seconds = 3600
            async with connected(pki, gw, "enroll:edge-1", password=token, client_keys=None) as ok:
                key = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode()
                assert (await run_subsystem(ok, ENROLL_SUBSYSTEM, key)).status == 0
    lines = [r.getMessage() for r in caplog.records if "closed the enrollment" in r.getMessage()]
    assert lines and lines[0] == (
        "closed the enrollment connection of 'edge-1': no gpurelay-enroll subsystem within 0.5s"
    ), lines


async def attempt(
    gw: Gateway, pki_known_hosts: str, password: str, *, via: str | None = None
) -> None:
    """A refused ``enroll:edge-1`` login; ``via``: behind a PROXY header from that address."""
    where: dict[str, object] = {"host": "127.0.0.1", "port": gw.ssh_port}
    if via is not None:
        sock = socket.create_connection(("127.0.0.1", gw.ssh_port), source_address=(BALANCER, 0))
        sock.sendall(f"PROXY TCP4 {via} 192.0.2.1 50123 2222\r\n".encode())
        where = {"host": "localhost", "sock": sock}
    with pytest.raises(asyncssh.PermissionDenied):
        async with asyncssh.connect(
            **where,  # type: ignore[arg-type]
            username="enroll:edge-1",
            password=password,
            client_keys=None,
            known_hosts=pki_known_hosts,
            agent_path=None,
            config=None,
            preferred_auth="password",
        ):
            pass


async def test_password_logins_are_bounded_per_address_and_in_all(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pki = make_pki(tmp_path)
    token, _ = make_enroll_token(pki.ca.dir, "edge-1", ttl_seconds=3600)
    hosts = str(pki.ca.known_hosts)
    with caplog.at_level(logging.INFO):
        async with running_gateway(enrolling(pki)) as gw:
            enrollment = enrollment_of(gw)
            # no refill: the bound does not depend on how fast this machine is
            enrollment.limiter = LoginLimiter(per_address_burst=3, per_address_rate=0)
            enrollment.limiter.log_every = 3600
            for _ in range(3):
                await attempt(gw, hosts, "gpr1.not-a-token")
            await wait_for(lambda: auth_failures(gw, "enroll_bad_token") == 3, what="3 checked")
            for _ in range(4):  # a good token too: over the bound, nothing is checked
                await attempt(gw, hosts, token)
            await wait_for(lambda: auth_failures(gw, "enroll_throttled") == 4, what="throttled")
            assert auth_failures(gw, "enroll_bad_token") == 3
            assert auth_failures(gw, "enroll_used") == 0
            # the whole gateway's bound, whatever the address
            enrollment.limiter = LoginLimiter(global_burst=1, global_rate=0)
            await attempt(gw, hosts, "gpr1.not-a-token")
            await attempt(gw, hosts, token)
            await wait_for(lambda: auth_failures(gw, "enroll_throttled") == 5, what="global")
            # within the bound again, the token (never checked) still works
            enrollment.limiter = LoginLimiter()
            async with connected(pki, gw, "enroll:edge-1", password=token, client_keys=None) as ok:
                key = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode()
                assert (await run_subsystem(ok, ENROLL_SUBSYSTEM, key)).status == 0
    throttled = [r for r in caplog.records if "too many logins" in r.getMessage()]
    # one line per limiter (log_every 3600 s on the first; the second logs its first)
    assert [r.levelno for r in throttled] == [logging.WARNING, logging.WARNING], throttled
    assert throttled[0].getMessage() == (
        "refused the enrollment login 'enroll:edge-1': too many logins, "
        "over 3 logins at once and 0/s from 127.0.0.1"
    )
    assert "for the whole gateway" in throttled[1].getMessage()
    refusals = [r.getMessage() for r in caplog.records if "enroll_throttled" in r.getMessage()]
    assert refusals == [], "no per-connection line for a throttled login"
    assert token.split(".")[1] not in caplog.text


async def test_behind_a_balancer_the_bound_is_per_client_address(tmp_path: Path) -> None:
    """With ssh.proxy_protocol, the address in the header is the one bounded, not the
    balancer's (which every client shares)."""
    pki = make_pki(tmp_path)
    cfg = enrolling(pki)
    ssh = dataclasses.replace(cfg.ssh, proxy_protocol=True, proxy_protocol_from=(f"{BALANCER}/32",))
    hosts = str(pki.ca.known_hosts)
    async with running_gateway(dataclasses.replace(cfg, ssh=ssh)) as gw:
        enrollment_of(gw).limiter = LoginLimiter(per_address_burst=1, per_address_rate=0)
        await attempt(gw, hosts, "gpr1.not-a-token", via="198.51.100.7")
        await attempt(gw, hosts, "gpr1.not-a-token", via="198.51.100.7")
        await attempt(gw, hosts, "gpr1.not-a-token", via="198.51.100.8")
        await wait_for(lambda: auth_failures(gw, "enroll_throttled") == 1, what="throttled")
        await wait_for(lambda: auth_failures(gw, "enroll_bad_token") == 2, what="checked")
