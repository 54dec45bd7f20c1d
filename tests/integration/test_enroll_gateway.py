"""Enrollment and renewal on a real gateway, with a real asyncssh client doing exactly what
the contract (gpurelay/enrollment.py) says: log in as ``enroll:NODE`` with the token as
password, send the public key on ``gpurelay-enroll``, read the certificate. Every refusal
is counted and logged with its reason and node, and no log line ever holds the token."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import logging
import os
import stat
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import asyncssh
import pytest

from cloud_gateway.app import Gateway
from cloud_gateway.cluster.config import ClusterConfig
from cloud_gateway.config import GatewayConfig
from cloud_gateway.trust import certs
from cloud_gateway.trust.config import EnrollConfig
from cloud_gateway.trust.signing import SigningRefused, make_enroll_token
from gpurelay.enrollment import ENROLL_SUBSYSTEM, RENEW_SUBSYSTEM, sign_token
from gpurelay.ssh_cert import certificate_info
from gpurelay.wire import SUBSYSTEM, FrameEncoder, Hello
from harness.fleet import (
    Pki,
    auth_failures,
    cluster_member,
    gateway_config,
    make_pki,
    metrics_text,
    running_gateway,
)
from harness.waiting import wait_for

LIFETIME = 3600


def enrolling(pki: Pki, cfg: GatewayConfig | None = None, **section: object) -> GatewayConfig:
    cfg = cfg or gateway_config(pki)
    options: dict[str, object] = {"user_ca_key": str(pki.ca.user_ca)}
    options.update(section)
    enroll = EnrollConfig(enabled=True, lifetime_seconds=LIFETIME, **options)  # type: ignore[arg-type]
    return dataclasses.replace(cfg, enroll=enroll)


@dataclasses.dataclass
class Outcome:
    status: int | None
    stdout: str
    stderr: str

    @property
    def certificate(self) -> asyncssh.SSHCertificate:
        return asyncssh.import_certificate(self.stdout)


@asynccontextmanager
async def connected(
    pki: Pki, gw: Gateway, username: str, **auth: object
) -> AsyncIterator[asyncssh.SSHClientConnection]:
    async with asyncssh.connect(
        "127.0.0.1",
        gw.ssh_port,
        username=username,
        known_hosts=str(pki.ca.known_hosts),
        agent_path=None,
        config=None,
        **auth,  # type: ignore[arg-type]
    ) as conn:
        yield conn


async def run_subsystem(conn: asyncssh.SSHClientConnection, subsystem: str, line: str) -> Outcome:
    result = await asyncio.wait_for(conn.run(subsystem=subsystem, input=line, encoding="utf-8"), 30)
    return Outcome(result.exit_status, str(result.stdout), str(result.stderr))


async def enroll(pki: Pki, gw: Gateway, node: str, token: str, key: asyncssh.SSHKey) -> Outcome:
    """What ``edge-agent enroll`` does, by the contract."""
    async with connected(
        pki, gw, f"enroll:{node}", password=token, client_keys=None, preferred_auth="password"
    ) as conn:
        return await run_subsystem(conn, ENROLL_SUBSYSTEM, key.export_public_key().decode())


@contextmanager
def every_log_line(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    with caplog.at_level(logging.DEBUG):  # asyncssh's own lines too
        yield


def assert_secret_kept(caplog: pytest.LogCaptureFixture, *tokens: str) -> None:
    for token in tokens:
        secrets = [part for part in token.removeprefix("gpr1.").split(".") if len(part) > 8]
        for record in caplog.records:
            text = record.getMessage()
            assert token not in text and not any(part in text for part in secrets), text


def issued_log(pki: Pki) -> list[dict[str, object]]:
    lines = pki.ca.issued_log.read_text().splitlines()
    return [json.loads(line) for line in lines]


async def telemetry_accepted(
    pki: Pki, gw: Gateway, node: str, key: asyncssh.SSHKey, cert: asyncssh.SSHCertificate
) -> None:
    async with connected(pki, gw, node, client_keys=[(key, cert)]) as conn:
        writer, _, _ = await conn.open_session(subsystem=SUBSYSTEM, encoding=None)
        writer.write(FrameEncoder().encode(Hello(agent_version="0", node=node)))
        await wait_for(
            lambda: gw.registry.node(node, now=time.time()) is not None,
            what=f"{node} in the registry",
        )


async def test_a_token_gets_a_certificate_the_gateway_then_accepts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pki = make_pki(tmp_path)
    token, _ = make_enroll_token(pki.ca.dir, "edge-1", ttl_seconds=3600)
    key = asyncssh.generate_private_key("ssh-ed25519")
    with every_log_line(caplog):
        async with running_gateway(enrolling(pki)) as gw:
            outcome = await enroll(pki, gw, "edge-1", token, key)
            assert outcome.status == 0, outcome
            cert = outcome.certificate
            await telemetry_accepted(pki, gw, "edge-1", key, cert)
    info = certificate_info(cert)  # type: ignore[arg-type]
    assert info.principals == ("edge-1",) and info.key_id == "node:edge-1"
    assert info.key_fingerprint == key.get_fingerprint("sha256")
    assert info.valid_before - info.valid_after == LIFETIME + certs.BACKDATE_SECONDS
    assert abs(info.valid_before - (time.time() + LIFETIME)) < 600
    (line,) = issued_log(pki)[-1:]
    assert line["serial"] == info.serial and line["reason"] == "enroll"
    assert line["key"] == info.key_fingerprint and line["principals"] == ["edge-1"]
    issued = [r.getMessage() for r in caplog.records if "issued certificate" in r.getMessage()]
    assert issued == [
        f"issued certificate serial={info.serial} node=edge-1 valid="
        f"{issued[0].split('valid=')[1].split(' ')[0]} key={info.key_fingerprint} (enroll)"
    ]
    assert_secret_kept(caplog, token)


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def forged(pki: Pki, node: str) -> str:
    other = asyncssh.generate_private_key("ssh-ed25519")
    return sign_token(other, node, int(time.time()) + 3600, "ab" * 16)


@pytest.mark.parametrize(
    ("case", "username", "code", "says"),
    [
        ("expired", "enroll:edge-1", "enroll_expired", "token expired at"),
        ("other node", "enroll:edge-1", "enroll_other_node", "token is for node 'edge-2'"),
        ("revoked", "enroll:edge-1", "enroll_revoked", "'edge-1' is revoked"),
        ("forged", "enroll:edge-1", "enroll_bad_signature", "not signed by a trusted user CA"),
        ("garbage", "enroll:edge-1", "enroll_bad_token", "not an enrollment token"),
        ("deeply nested", "enroll:edge-1", "enroll_bad_token", "nested too deeply"),
        ("node user", "edge-1", "password_for_node", "nodes log in with a certificate only"),
        ("too long", "enroll:edge-1", "enroll_ttl_too_long", "enroll.token_max_ttl_seconds"),
    ],
)
async def test_a_bad_token_is_refused_with_its_reason(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    case: str,
    username: str,
    code: str,
    says: str,
) -> None:
    pki = make_pki(tmp_path)
    now = time.time()
    token = {
        "expired": lambda: make_enroll_token(pki.ca.dir, "edge-1", ttl_seconds=60, now=now - 61)[0],
        "other node": lambda: make_enroll_token(pki.ca.dir, "edge-2", ttl_seconds=3600)[0],
        "forged": lambda: forged(pki, "edge-1"),
        "garbage": lambda: "gpr1.not-a-token",
        "deeply nested": lambda: "gpr1." + b64url(b"[" * 3000) + ".c2ln",
        "too long": lambda: make_enroll_token(pki.ca.dir, "edge-1", ttl_seconds=30 * 86400)[0],
    }.get(case, lambda: make_enroll_token(pki.ca.dir, "edge-1", ttl_seconds=3600)[0])()
    if case == "revoked":
        certs.revoke(pki.ca.dir, "edge-1")
    key = asyncssh.generate_private_key("ssh-ed25519")
    with every_log_line(caplog):
        async with running_gateway(enrolling(pki)) as gw:
            with pytest.raises(asyncssh.PermissionDenied):
                async with connected(
                    pki, gw, username, password=token, client_keys=None, preferred_auth="password"
                ) as conn:
                    await run_subsystem(conn, ENROLL_SUBSYSTEM, key.export_public_key().decode())
            await wait_for(lambda: auth_failures(gw, code) == 1, what=f"{code} counted")
    refusals = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused ")]
    assert len(refusals) == 1, refusals
    assert refusals[0].startswith(f"refused {username!r} from 127.0.0.1:"), refusals
    assert f": {code} (" in refusals[0] and says in refusals[0], refusals
    assert not pki.ca.issued_log.exists() or all(
        line["principals"] != ["edge-1"] or line["reason"] != "enroll" for line in issued_log(pki)
    )
    assert_secret_kept(caplog, token)


async def test_enrollment_disabled_accepts_no_password(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pki = make_pki(tmp_path)
    token, _ = make_enroll_token(pki.ca.dir, "edge-1", ttl_seconds=3600)
    creds = pki.node("edge-1")
    with every_log_line(caplog):
        async with running_gateway(gateway_config(pki)) as gw:
            for username in ("enroll:edge-1", "edge-1"):
                with pytest.raises(asyncssh.PermissionDenied):
                    async with connected(pki, gw, username, password=token, client_keys=None):
                        pass
            await wait_for(lambda: auth_failures(gw, "enroll_disabled") == 1, what="counted")
            # a node's renewal on its normal connection: refused, it is told why
            key = asyncssh.read_private_key(str(creds.private_key))
            cert = asyncssh.read_certificate(str(creds.certificate))
            async with connected(pki, gw, "edge-1", client_keys=[(key, cert)]) as conn:
                outcome = await run_subsystem(
                    conn, RENEW_SUBSYSTEM, key.export_public_key().decode()
                )
            assert "gpurelay_gateway_certificates_issued_total" not in await metrics_text(gw)
    assert (outcome.status, outcome.stderr) == (1, "error: enrollment disabled\n")
    assert "enrollment is disabled ([enroll] enabled = false)" in caplog.text
    assert_secret_kept(caplog, token)


async def test_a_token_is_used_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pki = make_pki(tmp_path)
    token, _ = make_enroll_token(pki.ca.dir, "edge-1", ttl_seconds=3600)
    key = asyncssh.generate_private_key("ssh-ed25519")
    with every_log_line(caplog):
        async with running_gateway(enrolling(pki)) as gw:
            assert (await enroll(pki, gw, "edge-1", token, key)).status == 0
            with pytest.raises(asyncssh.PermissionDenied):
                await enroll(pki, gw, "edge-1", token, key)
            await wait_for(lambda: auth_failures(gw, "enroll_used") == 1, what="counted")
            series = (
                'gpurelay_gateway_auth_failures_total{reason="enroll_used"} 1',
                'gpurelay_gateway_certificates_issued_total{reason="enroll"} 1',
                'gpurelay_gateway_certificates_issued_total{reason="renew"} 0',
            )

            async def exported() -> bool:
                text = await metrics_text(gw)
                return all(line in text for line in series)

            await wait_for(exported, what="the refusal in /metrics")
    assert "'edge-1': the token was used already" in caplog.text
    assert [line["reason"] for line in issued_log(pki)] == ["issue-gateway", "enroll"]
    assert_secret_kept(caplog, token)


async def test_an_enrollment_connection_can_do_nothing_else(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    token, _ = make_enroll_token(pki.ca.dir, "edge-1", ttl_seconds=3600)
    key = asyncssh.generate_private_key("ssh-ed25519")
    async with running_gateway(enrolling(pki)) as gw:
        async with connected(pki, gw, "enroll:edge-1", password=token, client_keys=None) as conn:
            for subsystem in (SUBSYSTEM, RENEW_SUBSYSTEM):
                outcome = await run_subsystem(conn, subsystem, key.export_public_key().decode())
                assert outcome.status == 1, outcome
                assert "only the gpurelay-enroll subsystem" in outcome.stderr, outcome
            shell = await asyncio.wait_for(conn.run("id", input="x\n"), 30)
            assert shell.exit_status == 1 and "only the gpurelay-enroll" in str(shell.stderr)
            with pytest.raises(asyncssh.ChannelListenError):
                await conn.forward_remote_port("edge-1", 9100, "127.0.0.1", 9100)
            with pytest.raises(asyncssh.ChannelOpenError):
                await conn.open_connection("127.0.0.1", gw.http_port)
            # the token is still unused: a junk key line does not cost it (the answer
            # ends the connection: tests/integration/test_enroll_limits.py)
            junk = await run_subsystem(conn, ENROLL_SUBSYSTEM, "ssh-ed25519 AAAAnot-a-key\n")
            assert (junk.status, junk.stderr) == (1, "error: not a public key\n")
        assert (await enroll(pki, gw, "edge-1", token, key)).status == 0
        with pytest.raises(asyncssh.PermissionDenied):
            await enroll(pki, gw, "edge-1", token, key)


async def test_renewal_is_for_the_connections_own_node(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pki = make_pki(tmp_path)
    creds = pki.node("edge-1")
    key = asyncssh.read_private_key(str(creds.private_key))
    cert = asyncssh.read_certificate(str(creds.certificate))
    other = asyncssh.read_public_key(str(pki.node("edge-2").public_key))
    with caplog.at_level(logging.INFO):
        async with running_gateway(enrolling(pki)) as gw:
            assert gw.ssh is not None and gw.ssh.policy.enrollment is not None
            budget = gw.ssh.policy.enrollment.renew_interval
            async with connected(pki, gw, "edge-1", client_keys=[(key, cert)]) as conn:
                own = await run_subsystem(conn, RENEW_SUBSYSTEM, key.export_public_key().decode())
                # one renewal per RENEW_INTERVAL_SECONDS per node: a node cannot flood issued.log
                again = await run_subsystem(conn, RENEW_SUBSYSTEM, key.export_public_key().decode())
                assert (again.status, again.stderr) == (1, "error: renewed too recently\n")
                assert budget >= 10
                gw.ssh.policy.enrollment.renew_interval = 0
                theirs = await run_subsystem(
                    conn, RENEW_SUBSYSTEM, other.export_public_key().decode()
                )
            assert own.status == 0 and theirs.status == 0, (own, theirs)
            await telemetry_accepted(pki, gw, "edge-1", key, own.certificate)
    mine = certificate_info(own.certificate)  # type: ignore[arg-type]
    assert mine.principals == ("edge-1",) and mine.key_fingerprint == key.get_fingerprint("sha256")
    assert mine.valid_before - mine.valid_after == LIFETIME + certs.BACKDATE_SECONDS
    stolen = certificate_info(theirs.certificate)  # type: ignore[arg-type]
    assert stolen.principals == ("edge-1",) and stolen.key_id == "node:edge-1"
    assert stolen.key_fingerprint == other.get_fingerprint("sha256")
    renewals = [line for line in issued_log(pki) if line["reason"] == "renew"]
    assert [line["serial"] for line in renewals] == [mine.serial, stolen.serial]
    assert caplog.text.count("node=edge-1") >= 2 and "(renew)" in caplog.text


def rsa_1024(tmp_path: Path) -> asyncssh.SSHKey:
    path = tmp_path / "weak"
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "rsa", "-b", "1024", "-N", "", "-f", str(path)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return asyncssh.read_private_key(str(path))


async def test_a_weak_key_gets_no_certificate_at_enrollment_or_renewal(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 24 #7: an RSA-1024 key was certified and its certificate logged in."""
    pki = make_pki(tmp_path)
    weak = rsa_1024(tmp_path).export_public_key().decode()
    token, _ = make_enroll_token(pki.ca.dir, "edge-1", ttl_seconds=3600)
    creds = pki.node("edge-2")
    key = asyncssh.read_private_key(str(creds.private_key))
    cert = asyncssh.read_certificate(str(creds.certificate))
    says = (
        "error: weak key: an RSA key of 1024 bits is too weak: "
        "use Ed25519, ECDSA or RSA of at least 3072 bits\n"
    )
    with caplog.at_level(logging.INFO):
        async with running_gateway(enrolling(pki)) as gw:
            async with connected(
                pki, gw, "enroll:edge-1", password=token, client_keys=None
            ) as conn:
                refused = await run_subsystem(conn, ENROLL_SUBSYSTEM, weak)
            assert (refused.status, refused.stderr) == (1, says)
            async with connected(pki, gw, "edge-2", client_keys=[(key, cert)]) as conn:
                renewal = await run_subsystem(conn, RENEW_SUBSYSTEM, weak)
            assert (renewal.status, renewal.stderr) == (1, says)
            strong = asyncssh.generate_private_key("ssh-ed25519")
            assert (await enroll(pki, gw, "edge-1", token, strong)).status == 0  # not spent
    assert "refused to enroll 'edge-1': an RSA key of 1024 bits is too weak" in caplog.text
    assert "refused to renew 'edge-2': an RSA key of 1024 bits is too weak" in caplog.text
    reasons = [line["reason"] for line in issued_log(pki)]
    assert reasons == ["issue-gateway", "issue-node", "enroll"]


async def test_a_used_token_stays_used_after_a_restart_on_sqlite(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    cfg = enrolling(pki)
    cfg = dataclasses.replace(cfg, cluster=ClusterConfig(directory=str(tmp_path / "nodes.db")))
    token, _ = make_enroll_token(pki.ca.dir, "edge-1", ttl_seconds=3600)
    key = asyncssh.generate_private_key("ssh-ed25519")
    async with running_gateway(cfg) as gw:
        assert (await enroll(pki, gw, "edge-1", token, key)).status == 0
    async with running_gateway(cfg) as gw:
        with pytest.raises(asyncssh.PermissionDenied):
            await enroll(pki, gw, "edge-1", token, key)
        await wait_for(lambda: auth_failures(gw, "enroll_used") == 1, what="counted")


def member(pki: Pki, dsn: str, gateway_id: str, token_file: Path) -> GatewayConfig:
    return enrolling(pki, cluster_member(pki, dsn, gateway_id, token_file))


async def test_a_token_is_used_once_across_a_cluster(tmp_path: Path, pg_database: str) -> None:
    pki = make_pki(tmp_path)
    peer_token = tmp_path / "peer.token"
    peer_token.write_text("p" * 32)
    key = asyncssh.generate_private_key("ssh-ed25519")
    first, _ = make_enroll_token(pki.ca.dir, "edge-1", ttl_seconds=3600)
    race, _ = make_enroll_token(pki.ca.dir, "edge-2", ttl_seconds=3600)
    async with (
        running_gateway(member(pki, pg_database, "gw-a", peer_token)) as a,
        running_gateway(member(pki, pg_database, "gw-b", peer_token)) as b,
    ):
        assert (await enroll(pki, a, "edge-1", first, key)).status == 0
        with pytest.raises(asyncssh.PermissionDenied):
            await enroll(pki, b, "edge-1", first, key)
        await wait_for(lambda: auth_failures(b, "enroll_used") == 1, what="counted on gw-b")
        # both log in before either uses it: the database decides, exactly one gets it
        line = key.export_public_key().decode()
        async with (
            connected(pki, a, "enroll:edge-2", password=race, client_keys=None) as on_a,
            connected(pki, b, "enroll:edge-2", password=race, client_keys=None) as on_b,
        ):
            outcomes = await asyncio.gather(
                run_subsystem(on_a, ENROLL_SUBSYSTEM, line),
                run_subsystem(on_b, ENROLL_SUBSYSTEM, line),
            )
    assert sorted(o.status or 0 for o in outcomes) == [0, 1], outcomes
    assert "error: token already used\n" in [o.stderr for o in outcomes]
    enrolled = [line["principals"] for line in issued_log(pki) if line["reason"] == "enroll"]
    assert enrolled == [["edge-1"], ["edge-2"]]


@asynccontextmanager
async def signer_process(ca_dir: Path, socket: Path) -> AsyncIterator[Path]:
    """``cloud-gateway signer`` as a process of its own; yields its log file."""
    log_file = socket.with_suffix(".log")
    with log_file.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cloud_gateway", "signer", "--ca-dir", str(ca_dir),
             "--socket", str(socket), "--lifetime", str(LIFETIME)],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        await wait_for(lambda: socket.exists() or proc.poll() is not None, what="the signer")
        assert proc.poll() is None, log_file.read_text()
        yield log_file
    finally:
        proc.terminate()
        proc.wait(timeout=30)


async def test_the_signer_process_holds_the_key_the_gateway_never_reads_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pki = make_pki(tmp_path)
    token, _ = make_enroll_token(pki.ca.dir, "edge-1", ttl_seconds=3600)
    socket = tmp_path / "signer.sock"
    key = asyncssh.generate_private_key("ssh-ed25519")
    certs.revoke(pki.ca.dir, "edge-2")  # the signer checks the CA directory's list itself
    async with signer_process(pki.ca.dir, socket) as signer_log:
        assert stat.S_IMODE(os.stat(socket).st_mode) == 0o600
        # the key is in the signer's memory only from now on: nobody can open the file
        hidden = pki.ca.user_ca.rename(tmp_path / "user_ca.elsewhere")
        with every_log_line(caplog):
            async with running_gateway(
                enrolling(pki, user_ca_key="", signer_socket=str(socket))
            ) as gw:
                enrolled = await enroll(pki, gw, "edge-1", token, key)
                assert enrolled.status == 0, enrolled
                async with connected(
                    pki, gw, "edge-1", client_keys=[(key, enrolled.certificate)]
                ) as conn:
                    renewed = await run_subsystem(
                        conn, RENEW_SUBSYSTEM, key.export_public_key().decode()
                    )
                assert renewed.status == 0, renewed
                other = asyncssh.generate_private_key("ssh-ed25519").export_public_key()
                assert gw.ssh is not None and gw.ssh.policy.enrollment is not None
                with pytest.raises(SigningRefused) as refused:
                    await gw.ssh.policy.enrollment.signer.sign(
                        "edge-2", other.decode(), reason="enroll", lifetime_seconds=LIFETIME
                    )
                assert refused.value.reason == "node revoked"
        assert not pki.ca.user_ca.exists()
        hidden.rename(pki.ca.user_ca)
    serials = [
        certificate_info(c).serial  # type: ignore[arg-type]
        for c in (enrolled.certificate, renewed.certificate)
    ]
    lines = [line for line in issued_log(pki) if line["reason"] in ("enroll", "renew")]
    assert [(line["serial"], line["reason"]) for line in lines] == list(
        zip(serials, ["enroll", "renew"], strict=True)
    )
    text = signer_log.read_text()
    assert text.count("issued certificate serial=") == 2 and "(renew)" in text, text
    assert "refused to sign for node 'edge-2'" in text, text
    assert not socket.exists()  # removed when it stopped
    assert token.split(".")[1] not in text
    assert_secret_kept(caplog, token)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--ca-dir", "{tmp}/nowhere", "--socket", "{tmp}/s.sock"], "no CA key at"),
        (["--ca-dir", "{ca}", "--socket", "{tmp}/no-dir/s.sock"], "No such file or directory"),
        (["--ca-dir", "{ca}", "--socket", "{ca}/user_ca"], "is not a socket; refusing"),
        (["--ca-dir", "{ca}", "--socket", "{tmp}/s.sock", "--lifetime", "5"], "at least 60"),
        (
            ["--ca-dir", "{ca}", "--socket", "{tmp}/s.sock", "--min-rsa-bits", "1024"],
            "--min-rsa-bits must be an integer of at least 2048",
        ),
    ],
)
def test_the_signer_command_fails_in_one_line(tmp_path: Path, args: list[str], says: str) -> None:
    pki = make_pki(tmp_path)
    argv = [a.format(tmp=tmp_path, ca=pki.ca.dir) for a in args]
    done = subprocess.run(
        [sys.executable, "-m", "cloud_gateway", "signer", *argv],
        check=False, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode in (1, 2), done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cloud-gateway signer: error: "), lines
    assert says in lines[0], lines
    assert pki.ca.user_ca.exists()
