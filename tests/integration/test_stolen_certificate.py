"""Issue 24 §1 and §4, the stolen-certificate drill on a real gateway: a thief holds a
node's certificate on a connection that carries no telemetry, only a published endpoint.
Revoked (by node or by serial) or expired, that connection is closed on the next tick with
its endpoint, and it can neither renew nor log in again. Parallel renewals get one
certificate, not one each."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import asyncssh
import httpx
import pytest

from cloud_gateway.app import Gateway
from cloud_gateway.trust import certs
from gpurelay.enrollment import RENEW_SUBSYSTEM
from gpurelay.ssh_cert import certificate_info
from gpurelay.wire import SUBSYSTEM, FrameEncoder, Hello
from harness.fleet import TOKEN, Pki, make_pki, running_gateway
from harness.waiting import wait_for
from tests.integration.test_enroll_gateway import (
    connected,
    enrolling,
    issued_log,
    run_subsystem,
)

NODE = "edge-1"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def exporter() -> asyncio.Server:
    """The endpoint the thief publishes: answers every request with one sample."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 13\r\n\r\nforged_up 1\n\n")
        await writer.drain()
        writer.close()

    return await asyncio.start_server(answer, "127.0.0.1", 0)


async def published(gw: Gateway) -> tuple[int, set[str]]:
    """What an operator and Prometheus see: /proxy's status and SD's targets."""
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.http_port}", timeout=10) as c:
        proxied = await c.get(f"/proxy/{NODE}/9100/metrics", headers=AUTH)
        sd = (await c.get("/api/v1/sd", headers=AUTH)).json()
    return proxied.status_code, {g["targets"][0] for g in sd}


def thief_keys(pki: Pki) -> tuple[asyncssh.SSHKey, asyncssh.SSHCertificate]:
    creds = pki.node(NODE)
    return (
        asyncssh.read_private_key(str(creds.private_key)),
        asyncssh.read_certificate(str(creds.certificate)),
    )


async def closes_on_the_tick(
    gw: Gateway, conn: asyncssh.SSHClientConnection, key: asyncssh.SSHKey
) -> None:
    assert gw.ssh is not None and gw.endpoints is not None
    gw._refresh()  # one tick
    await asyncio.wait_for(conn.wait_closed(), 5)
    await wait_for(lambda: gw.endpoints.lookup(NODE, 9100) is None, 5, "endpoint withdrawn")
    status, targets = await published(gw)
    assert status in (404, 503) and f"{NODE}:9100" not in targets, (status, targets)


async def refused_renewal(pki: Pki, gw: Gateway, key: asyncssh.SSHKey, cert: object) -> None:
    """Renewal on a fresh connection is impossible: the login itself is refused."""
    with pytest.raises(asyncssh.PermissionDenied):
        async with connected(pki, gw, NODE, client_keys=[(key, cert)]):
            pass


@pytest.mark.parametrize("how", ["node", "serial", "expired"])
async def test_a_stolen_certificate_loses_its_forward_only_connection_and_cannot_renew(
    tmp_path: Path, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pki = make_pki(tmp_path)
    key, cert = thief_keys(pki)
    server = await exporter()
    port = server.sockets[0].getsockname()[1]
    async with running_gateway(enrolling(pki)) as gw:
        assert gw.ssh is not None and gw.endpoints is not None
        enrollment = gw.ssh.policy.enrollment
        assert enrollment is not None
        async with connected(pki, gw, NODE, client_keys=[(key, cert)]) as conn:
            await conn.forward_remote_port(NODE, 9100, "127.0.0.1", port)
            await wait_for(lambda: gw.endpoints.lookup(NODE, 9100) is not None)
            async with connected(pki, gw, NODE, client_keys=[(key, cert)]) as idle:
                # a second connection says HELLO: the node is known, SD lists its endpoint
                writer, _, _ = await idle.open_session(subsystem=SUBSYSTEM, encoding=None)
                writer.write(FrameEncoder().encode(Hello(agent_version="0", node=NODE)))
                await wait_for(lambda: gw.registry.node(NODE, now=time.time()) is not None)
                status, targets = await published(gw)
                assert status == 200 and f"{NODE}:9100" in targets, (status, targets)
                tick = gw.ssh.revalidate
                monkeypatch.setattr(gw.ssh, "revalidate", dict)  # the gateway's ticks wait
                policy = gw.ssh.policy
                if how == "expired":
                    later = time.time() + 2 * 365 * 86400
                    policy.clock = enrollment.clock = lambda: later
                elif how == "node":
                    certs.revoke(pki.ca.dir, NODE)
                else:  # by serial, as an operator adds it to the list
                    with pki.ca.revocations.open("a") as f:
                        f.write(f"serial {certificate_info(cert).serial}\n")
                verdict = "expired" if how == "expired" else "revoked"
                await wait_for(lambda: policy.check(NODE, cert) == verdict, 20, "revocation")  # type: ignore[arg-type]
                # at request time, before the tick: the held connection cannot renew
                renewal = await run_subsystem(
                    idle, RENEW_SUBSYSTEM, key.export_public_key().decode()
                )
                assert renewal.status == 1 and renewal.stderr.startswith("error: "), renewal
                monkeypatch.setattr(gw.ssh, "revalidate", tick)
                await closes_on_the_tick(gw, conn, key)
                await asyncio.wait_for(idle.wait_closed(), 5)
        await refused_renewal(pki, gw, key, cert)
    server.close()
    assert [line for line in issued_log(pki) if line["reason"] == "renew"] == []


async def test_parallel_renewals_get_one_certificate(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    key, cert = thief_keys(pki)
    line = key.export_public_key().decode()
    async with running_gateway(enrolling(pki)) as gw:
        async with connected(pki, gw, NODE, client_keys=[(key, cert)]) as conn:
            outcomes = await asyncio.gather(
                *(run_subsystem(conn, RENEW_SUBSYSTEM, line) for _ in range(20)),
                return_exceptions=True,
            )
    issued = [o for o in outcomes if not isinstance(o, BaseException) and o.status == 0]
    assert len(issued) == 1, outcomes
    assert len([x for x in issued_log(pki) if x["reason"] == "renew"]) == 1


async def test_one_renewal_at_a_time_per_connection(tmp_path: Path) -> None:
    """A second renew channel while one is open is refused at once, not after the key
    timeout: a connection cannot hold many renewals (and signer calls) open."""
    pki = make_pki(tmp_path)
    key, cert = thief_keys(pki)
    async with running_gateway(enrolling(pki)) as gw:
        async with connected(pki, gw, NODE, client_keys=[(key, cert)]) as conn:
            first = await conn.create_process(subsystem=RENEW_SUBSYSTEM, encoding=None)
            await asyncio.sleep(0.2)  # the first is waiting for its key
            second = await asyncio.wait_for(
                conn.run(subsystem=RENEW_SUBSYSTEM, input="", encoding="utf-8"), 5
            )
            assert second.exit_status == 1, second
            assert second.stderr == "error: one renewal at a time per connection\n"
            first.stdin.write(key.export_public_key())
            first.stdin.write_eof()
            assert (await asyncio.wait_for(first.wait(), 10)).exit_status == 0
    assert len([x for x in issued_log(pki) if x["reason"] == "renew"]) == 1


async def test_a_revocation_by_serial_during_signing_keeps_the_new_certificate_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 24 §1, what was left: the presented certificate was checked before the signer
    was awaited, not after; a revocation by serial landing during the signing call let the
    thief have the fresh certificate whenever the answer beat the next tick. It is checked
    again after: the certificate is signed (and logged as issued) but never handed out."""
    pki = make_pki(tmp_path)
    key, cert = thief_keys(pki)
    async with running_gateway(enrolling(pki)) as gw:
        assert gw.ssh is not None
        enrollment = gw.ssh.policy.enrollment
        assert enrollment is not None
        policy = gw.ssh.policy
        sign = enrollment.signer.sign

        async def sign_while_revoked(*args: object, **kwargs: object) -> object:
            issued = await sign(*args, **kwargs)  # type: ignore[arg-type]
            with pki.ca.revocations.open("a") as f:
                f.write(f"serial {certificate_info(cert).serial}\n")
            await wait_for(lambda: policy.check(NODE, cert) == "revoked", 20, "revocation")  # type: ignore[arg-type]
            return issued

        enrollment.signer.sign = sign_while_revoked  # type: ignore[method-assign]
        # the ticks wait: the renewal itself must refuse (a tick may come after the answer)
        monkeypatch.setattr(gw.ssh, "revalidate", dict)
        async with connected(pki, gw, NODE, client_keys=[(key, cert)]) as conn:
            renewal = await run_subsystem(conn, RENEW_SUBSYSTEM, key.export_public_key().decode())
    assert renewal.status == 1 and renewal.stderr == "error: node revoked\n", renewal
    assert "CERTIFICATE" not in renewal.stdout and "cert-v01" not in renewal.stdout
