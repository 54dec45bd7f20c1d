"""The gateway's side of enrollment without SSH: [enroll] config, signing a node key, the
signer's request handling, and `certs enroll-token`."""

from __future__ import annotations

import asyncio
import grp
import json
import logging
import os
import re
import stat
import subprocess
import time
from pathlib import Path

import asyncssh
import pytest

from cloud_gateway.cli import main
from cloud_gateway.cluster.nonces import MemoryNonces
from cloud_gateway.config import load
from cloud_gateway.errors import GatewayConfigError, GatewayError
from cloud_gateway.ssh import enrollment
from cloud_gateway.ssh.enrollment import Enrollment, Refusal
from cloud_gateway.ssh.logins import AUTH_REASONS
from cloud_gateway.trust import certs
from cloud_gateway.trust.config import EnrollConfig, check_enroll
from cloud_gateway.trust.revocation import RevocationList, RevocationWatcher
from cloud_gateway.trust.signer_socket import SignerServer, SocketSigner
from cloud_gateway.trust.signing import (
    LocalSigner,
    SigningRefused,
    make_enroll_token,
    sign_node_key,
)
from gpurelay.enrollment import parse_token, verify_token
from gpurelay.ssh_cert import certificate_info
from tests.conftest import required_tool


@pytest.fixture
def ca(tmp_path: Path) -> certs.CaPaths:
    return certs.init_ca(tmp_path / "ca")


def new_key() -> asyncssh.SSHKey:
    return asyncssh.generate_private_key("ssh-ed25519").convert_to_public()


# -- [enroll] ------------------------------------------------------------------------------


def test_enrollment_is_off_by_default_and_needs_exactly_one_signer(tmp_path: Path) -> None:
    assert load(None, {}).enroll == EnrollConfig()
    assert not EnrollConfig().enabled
    with pytest.raises(GatewayConfigError, match=r"exactly one of enroll\.user_ca_key"):
        check_enroll(EnrollConfig(enabled=True))
    with pytest.raises(GatewayConfigError, match=r"exactly one of enroll\.user_ca_key"):
        check_enroll(EnrollConfig(enabled=True, user_ca_key="/k", signer_socket="/s"))
    with pytest.raises(GatewayConfigError, match=r"enroll\.lifetime_seconds must be at least 60"):
        check_enroll(EnrollConfig(lifetime_seconds=10))
    config = tmp_path / "gateway.toml"
    config.write_text('[enroll]\nenabled = true\nsigner_socket = "/run/signer.sock"\n')
    section = load(config, {}).enroll
    assert section.signer_socket == "/run/signer.sock" and section.lifetime_seconds == 604800
    env = {"CLOUD_GATEWAY_ENROLL_ENABLED": "true", "CLOUD_GATEWAY_ENROLL_USER_CA_KEY": "/k"}
    assert load(None, env).enroll.user_ca_key == "/k"


async def test_memory_nonces_are_single_use() -> None:
    nonces = MemoryNonces()
    assert not await nonces.enrollment_nonce_used("a" * 32)
    assert await nonces.use_enrollment_nonce("a" * 32, "edge-1", 100, now=10)
    assert not await nonces.use_enrollment_nonce("a" * 32, "edge-1", 100, now=11)
    assert await nonces.enrollment_nonce_used("a" * 32)


# -- signing ---------------------------------------------------------------------------------


def test_a_signed_node_key_is_logged_and_shares_the_serial_counter(ca: certs.CaPaths) -> None:
    first = certs.issue_node(ca.dir, "edge-0")
    key = new_key()
    issued = sign_node_key(ca.dir, "edge-1", key, lifetime_seconds=600, reason="enroll", now=1e9)
    assert issued.serial == first.serial + 1
    assert (issued.valid_after, issued.valid_before) == (1e9 - 300, 1e9 + 600)
    cert = asyncssh.import_certificate(issued.certificate)
    info = certificate_info(cert)  # type: ignore[arg-type]
    assert info.principals == ("edge-1",) and info.key_id == "node:edge-1"
    assert info.key_fingerprint == key.get_fingerprint("sha256") == issued.key_fingerprint
    lines = [json.loads(line) for line in ca.issued_log.read_text().splitlines()]
    assert [line["reason"] for line in lines] == ["issue-node", "enroll"]
    assert lines[-1] == {
        "time": lines[-1]["time"],
        "serial": issued.serial,
        "key_id": "node:edge-1",
        "principals": ["edge-1"],
        "valid_after": "2001-09-09T01:41:40Z",
        "valid_before": "2001-09-09T01:56:40Z",
        "key": issued.key_fingerprint,
        "reason": "enroll",
    }
    assert issued.describe("enroll") == (
        f"issued certificate serial={issued.serial} node=edge-1 "
        "valid=2001-09-09T01:41:40Z..2001-09-09T01:56:40Z "
        f"key={issued.key_fingerprint} (enroll)"
    )
    assert not (ca.dir / "nodes" / "edge-1").exists()  # nothing but the log and the counter


def test_ssh_keygen_reads_a_signed_node_key_like_an_issued_one(
    ca: certs.CaPaths, tmp_path: Path
) -> None:
    keygen = required_tool("ssh-keygen", "EDGE_GPU_RELAY_REQUIRE_SSH_KEYGEN", "openssh-client")
    issued = sign_node_key(ca.dir, "edge-1", new_key(), lifetime_seconds=600, reason="enroll")
    cert = tmp_path / "edge-1-cert.pub"
    cert.write_text(issued.certificate + "\n")
    shown = subprocess.run(
        [str(keygen), "-L", "-f", str(cert)], capture_output=True, text=True, check=True
    ).stdout
    assert "user certificate" in shown and 'Key ID: "node:edge-1"' in shown
    assert f"Serial: {issued.serial}" in shown
    extensions = shown.split("Extensions:")[1].split()
    assert extensions == ["permit-port-forwarding"]
    reference = certs.issue_node(ca.dir, "edge-2")
    listed = subprocess.run(
        [str(keygen), "-L", "-f", str(reference.certificate)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert listed.split("Extensions:")[1].split() == extensions


def test_renewal_checks_the_connections_key_against_the_revocation_list(
    ca: certs.CaPaths,
) -> None:
    creds = certs.issue_node(ca.dir, "edge-1")
    cert = asyncssh.read_certificate(creds.certificate)
    enrolling = Enrollment(
        EnrollConfig(enabled=True, user_ca_key=str(ca.user_ca)),
        trusted_cas=[asyncssh.read_public_key(ca.user_ca_pub)],
        revocations=RevocationWatcher(ca.revocations),
        nonces=MemoryNonces(),
        signer=LocalSigner(ca.user_ca, revocations=None),
    )
    enrolling._check_renewal("edge-1", cert)  # nothing revoked yet
    certs.revoke(ca.dir, creds.certificate)  # its key
    enrolling.revocations = RevocationWatcher(ca.revocations)
    with pytest.raises(SigningRefused) as refused:
        enrolling._check_renewal("edge-1", cert)
    assert refused.value.reason == "node revoked" and "key=SHA256:" in str(refused.value)


def test_revoked_nodes_and_keys_get_nothing(ca: certs.CaPaths) -> None:
    key = new_key()
    by_key = RevocationList(keys=frozenset({key.get_fingerprint("sha256")}))
    for revoked in (RevocationList(nodes=frozenset({"edge-1"})), by_key):
        with pytest.raises(SigningRefused) as refused:
            sign_node_key(
                ca.dir, "edge-1", key, lifetime_seconds=600, reason="renew", revoked=revoked
            )
        assert refused.value.reason == "node revoked"
    with pytest.raises(SigningRefused, match="only lowercase letters"):
        sign_node_key(ca.dir, "Edge_1", key, lifetime_seconds=600, reason="renew")
    with pytest.raises(SigningRefused, match="lifetime below 60"):
        sign_node_key(ca.dir, "edge-1", key, lifetime_seconds=5, reason="renew")
    assert not ca.issued_log.exists()


def test_an_enroll_token_is_signed_by_the_user_ca(ca: certs.CaPaths) -> None:
    text, exp = make_enroll_token(ca.dir, "edge-1", ttl_seconds=3600, now=1000)
    token = parse_token(text)
    assert (token.node, token.exp, exp) == ("edge-1", 4600, 4600)
    assert verify_token(token, [asyncssh.read_public_key(ca.user_ca_pub)])
    assert not verify_token(token, [asyncssh.read_public_key(ca.host_ca_pub)])
    other, _ = make_enroll_token(ca.dir, "edge-1", ttl_seconds=3600, now=1000)
    assert parse_token(other).nonce != token.nonce


# -- the signer ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "error"),
    [
        (b"not json\n", "bad request"),
        (b"[1]\n", "bad request"),
        (b"[" * 60000 + b"\n", "bad request"),
        (b'{"node": ' * 6000 + b"\n", "bad request"),
        (b'{"node": "edge-1", "reason": "enroll", "lifetime_seconds": 60}\n', "bad request"),
        (
            b'{"node": "edge-1", "public_key": "x", "reason": "enroll", "lifetime_seconds": true}',
            "bad request",
        ),
        (
            b'{"node": "edge-1", "public_key": "ssh-ed25519 AAAA", "reason": "enroll",'
            b' "lifetime_seconds": 600}',
            "not a public key",
        ),
        (
            b'{"node": "Edge_1", "public_key": "KEY", "reason": "enroll", "lifetime_seconds": 600}',
            "not a node name",
        ),
        (
            b'{"node": "edge-1", "public_key": "KEY", "reason": "steal", "lifetime_seconds": 600}',
            "bad request",
        ),
        (
            b'{"node": "edge-9", "public_key": "KEY", "reason": "enroll", "lifetime_seconds": 600}',
            "node revoked",
        ),
    ],
)
async def test_the_signer_answers_hostile_requests_with_an_error(
    ca: certs.CaPaths, tmp_path: Path, line: bytes, error: str
) -> None:
    certs.revoke(ca.dir, "edge-9")
    server = SignerServer(ca.dir, tmp_path / "s.sock", max_lifetime_seconds=3600)
    key = new_key().export_public_key().decode().strip()
    assert await server.answer(line.replace(b"KEY", key.encode())) == {"error": error}
    assert not ca.issued_log.exists()


async def test_deeply_nested_json_is_a_logged_bad_request_not_a_crash(
    ca: certs.CaPaths, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 24 #5: json.loads raised RecursionError, which escaped answer()."""
    server = SignerServer(ca.dir, tmp_path / "s.sock", max_lifetime_seconds=3600)
    with caplog.at_level(logging.WARNING):
        assert await server.answer(b"[" * 60000 + b"\n") == {"error": "bad request"}
    (said,) = [r.getMessage() for r in caplog.records]
    assert said == "refused a malformed request: JSON nested too deeply"


async def test_the_signer_over_its_socket_caps_the_lifetime(
    ca: certs.CaPaths, tmp_path: Path
) -> None:
    path = tmp_path / "s.sock"
    server = SignerServer(ca.dir, path, max_lifetime_seconds=600)
    await server.start()
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        key = new_key()
        client = SocketSigner(path)
        issued = await client.sign(
            "edge-1", key.export_public_key().decode(), reason="renew", lifetime_seconds=86400
        )
        assert issued.valid_before - issued.valid_after == 600 + certs.BACKDATE_SECONDS
        assert issued.key_fingerprint == key.get_fingerprint("sha256")
        with pytest.raises(SigningRefused) as refused:
            await client.sign("edge-1", "nonsense", reason="renew", lifetime_seconds=600)
        assert refused.value.reason == "not a public key"
        # a request line over the limit gets an answer, not a hang
        reader, writer = await asyncio.open_unix_connection(str(path))
        writer.write(b"x" * 70_000 + b"\n")
        await writer.drain()
        assert json.loads(await reader.readline()) == {"error": "request too long"}
        writer.close()
    finally:
        await server.close()
    assert not path.exists()


async def test_the_signer_socket_can_be_shared_with_a_group(
    ca: certs.CaPaths, tmp_path: Path
) -> None:
    path = tmp_path / "s.sock"
    group = grp.getgrgid(os.getgid()).gr_name  # one this process may hand the socket to
    server = SignerServer(ca.dir, path, max_lifetime_seconds=600, group=group)
    await server.start()
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o660
        assert os.stat(path).st_gid == os.getgid()
    finally:
        await server.close()
    with pytest.raises(GatewayError, match="no group 'no-such-group-here'"):
        SignerServer(ca.dir, path, max_lifetime_seconds=600, group="no-such-group-here")


def test_a_second_signer_on_a_live_socket_is_refused(ca: certs.CaPaths, tmp_path: Path) -> None:
    async def run() -> None:
        path = tmp_path / "s.sock"
        first = SignerServer(ca.dir, path, max_lifetime_seconds=600)
        await first.start()
        try:
            second = SignerServer(ca.dir, path, max_lifetime_seconds=600)
            with pytest.raises(Exception, match="another signer is listening"):
                await second.start()
        finally:
            await first.close()

    asyncio.run(run())


def test_every_refusal_code_is_a_metric_label() -> None:
    """A code missing from REFUSALS would be counted as reason="other"."""
    source = Path(enrollment.__file__).read_text()
    codes = set(re.findall(r'Refusal\(\s*"(\w+)"', source))
    codes |= set(re.findall(r'self\._refuse\(username, "(\w+)"', source))
    codes.add("enroll_disabled")  # passed through a variable
    assert codes == set(enrollment.REFUSALS)
    assert set(enrollment.REFUSALS) <= set(AUTH_REASONS)
    assert Refusal("enroll_used", "why") == Refusal("enroll_used", "why")


# -- certs enroll-token ---------------------------------------------------------------------


def test_enroll_token_writes_a_private_file_and_prints_no_secret(
    ca: certs.CaPaths, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["certs", "enroll-token", "edge-1", "--dir", str(ca.dir), "--ttl", "2h"]) == 0
    out = capsys.readouterr().out
    file = ca.dir / "enroll" / "edge-1.token"
    assert stat.S_IMODE(file.stat().st_mode) == 0o600
    assert stat.S_IMODE(file.parent.stat().st_mode) == 0o700
    token = parse_token(file.read_text())
    assert token.node == "edge-1"
    assert file.read_text().strip() not in out and token.nonce not in out
    host_ca = asyncssh.read_public_key(ca.host_ca_pub).get_fingerprint("sha256")
    assert f"host CA fingerprint: {host_ca}" in out
    assert (
        f"edge-agent enroll --gateway GATEWAY:2222 --token-file edge-1.token "
        f"--host-ca-fingerprint {host_ca} --node-name edge-1"
    ) in out
    assert "(2h), single use" in out and str(file) in out and "note:" not in out
    # a second one for the same file is refused; --out and --print give another
    assert main(["certs", "enroll-token", "edge-1", "--ca-dir", str(ca.dir)]) == 2
    assert "remove it, or pass --out" in capsys.readouterr().err
    other = ca.dir / "other.token"
    args = ["certs", "enroll-token", "edge-1", "--ca-dir", str(ca.dir), "--out", str(other)]
    assert main([*args, "--print", "--ttl", "8d"]) == 0
    out = capsys.readouterr().out
    assert f"token: {other.read_text().strip()}" in out
    assert "note: gateways refuse tokens valid for longer than [enroll]" in out


@pytest.mark.parametrize("ttl", ["5x", "h", "-1h"])
def test_enroll_token_refuses_a_bad_ttl(
    ca: certs.CaPaths, capsys: pytest.CaptureFixture[str], ttl: str
) -> None:
    with pytest.raises(SystemExit):
        main(["certs", "enroll-token", "edge-1", "--dir", str(ca.dir), f"--ttl={ttl}"])
    assert "not a duration" in capsys.readouterr().err


def test_the_renewal_budget_remembers_only_recent_renewals(ca: certs.CaPaths) -> None:
    """One renewal per node per renew_interval; the memory of who renewed stays bounded
    however many nodes renew over time."""
    enrolling = Enrollment(
        EnrollConfig(enabled=True, user_ca_key=str(ca.user_ca)),
        trusted_cas=[asyncssh.read_public_key(ca.user_ca_pub)],
        revocations=None,
        nonces=MemoryNonces(),
        signer=LocalSigner(ca.user_ca, revocations=None),
    )
    for k in range(5 * enrollment.RENEWED_PRUNE_AT):  # a day of renewals, 1 s apart
        enrolling._note_renewal(f"edge-{k}", float(k))
    assert len(enrolling._renewed) <= enrollment.RENEWED_PRUNE_AT
    enrolling._note_renewal("edge-x", time.monotonic())
    with pytest.raises(SigningRefused) as refused:
        enrolling._renew_budget("edge-x")
    assert refused.value.reason == "renewed too recently"


def test_a_token_for_another_node_is_refused_with_the_contracts_reason() -> None:
    from gpurelay.enrollment import REASON_OTHER_NODE

    assert enrollment._agent_reason("enroll_other_node") == REASON_OTHER_NODE
