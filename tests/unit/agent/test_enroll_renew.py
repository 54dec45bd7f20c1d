"""The agent's side of enrollment and renewal (issue 17 §1), its pure parts and files:
token checks before anything is sent, the host CA pin (a real asyncssh server that must
never see the token), atomic replacement, the key swap a crash interrupted, renewal timing
and the config keys. The whole exchange with a real gateway is
tests/integration/test_enroll_renew_e2e.py."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import asyncssh
import pytest

from edge_agent.cli import main
from edge_agent.config import TunnelConfig, load
from edge_agent.credentials import load_pair, next_key_path
from edge_agent.enroll import (
    EnrollRefused,
    check_fingerprint,
    enroll,
    node_key,
    read_token,
)
from edge_agent.errors import AgentError, ConfigError
from edge_agent.renew import RETRY_SECONDS, Renewer
from gpurelay.enrollment import ENROLL_USER_PREFIX, sign_token
from gpurelay.files import write_atomic
from gpurelay.model import Family
from tests.conftest import small_tmpfs
from tests.unit.agent.test_certificate_answer import answer

NODE = "edge-7"
NONCE = "0123456789abcdef0123456789abcdef"


def user_cert(
    ca: asyncssh.SSHKey,
    key: asyncssh.SSHKey,
    *,
    valid_after: int,
    valid_before: int,
    serial: int = 5,
    node: str = NODE,
) -> asyncssh.SSHCertificate:
    return ca.generate_user_certificate(
        key,
        f"node:{node}",
        serial=serial,
        principals=[node],
        valid_after=valid_after,
        valid_before=valid_before,
    )


@pytest.fixture
def ca() -> asyncssh.SSHKey:
    return asyncssh.generate_private_key("ssh-ed25519")


def credentials(
    tmp_path: Path, cert: asyncssh.SSHCertificate, key: asyncssh.SSHKey
) -> TunnelConfig:
    key_path = tmp_path / "node.key"
    key_path.write_bytes(key.export_private_key())
    key_path.chmod(0o600)
    (tmp_path / "node.key-cert.pub").write_bytes(cert.export_certificate())
    os.utime(tmp_path / "node.key-cert.pub", (0, 0))  # written before the validity starts
    return credentials_in(tmp_path)


def credentials_in(directory: Path) -> TunnelConfig:
    return TunnelConfig(key=directory / "node.key", known_hosts=directory / "known_hosts")


# -- files -------------------------------------------------------------------------------------


def test_write_atomic_replaces_whole_with_the_mode_and_leaves_nothing_behind(
    tmp_path: Path,
) -> None:
    path = tmp_path / "node.key-cert.pub"
    path.write_text("old\n")
    os.chmod(path, 0o600)
    reader = path.open()  # a reader of the old file keeps reading the old file
    old_inode = path.stat().st_ino
    write_atomic(path, b"new\n", 0o644)
    assert path.read_text() == "new\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert path.stat().st_ino != old_inode
    assert reader.read() == "old\n"
    reader.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["node.key-cert.pub"]


def test_write_atomic_sets_a_private_mode_despite_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        write_atomic(tmp_path / "cert", b"x", 0o644)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "cert").stat().st_mode) == 0o644


def test_write_atomic_into_a_missing_directory_fails_and_leaves_no_temporary(
    tmp_path: Path,
) -> None:
    with pytest.raises(OSError):
        write_atomic(tmp_path / "nope" / "cert", b"x", 0o644)
    assert list(tmp_path.iterdir()) == []


def test_node_key_is_made_once_private_and_then_reused(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "node.key"
    key, made = node_key(path)
    assert made and stat.S_IMODE(path.stat().st_mode) == 0o600
    again, made_again = node_key(path)
    assert not made_again and again.public_data == key.public_data


def test_node_key_that_is_no_key_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "node.key"
    path.write_text("ssh-ed25519 AAAA not a private key\n")
    with pytest.raises(ConfigError, match=f"node key {path} cannot be used"):
        node_key(path)


# -- certificates ------------------------------------------------------------------------------


def test_load_pair_refuses_a_certificate_for_another_key(
    tmp_path: Path, ca: asyncssh.SSHKey
) -> None:
    key, other = (asyncssh.generate_private_key("ssh-ed25519") for _ in range(2))
    cfg = credentials(tmp_path, user_cert(ca, other, valid_after=0, valid_before=10), key)
    assert cfg.key is not None and cfg.certificate_path is not None
    with pytest.raises(AgentError, match="is not for the key"):
        load_pair(cfg.key, cfg.certificate_path)


def test_load_pair_finishes_a_key_swap_a_crash_interrupted(
    tmp_path: Path, ca: asyncssh.SSHKey
) -> None:
    old, new = (asyncssh.generate_private_key("ssh-ed25519") for _ in range(2))
    # The renewal wrote <key>.next and the new certificate, then died before the rename.
    cfg = credentials(tmp_path, user_cert(ca, new, valid_after=0, valid_before=10), old)
    assert cfg.key is not None and cfg.certificate_path is not None
    write_atomic(next_key_path(cfg.key), new.export_private_key(), 0o600)
    key, cert = load_pair(cfg.key, cfg.certificate_path)
    assert key.public_data == new.public_data == cert.key.public_data
    assert not next_key_path(cfg.key).exists()
    assert asyncssh.read_private_key(str(cfg.key)).public_data == new.public_data


# -- renewal timing ----------------------------------------------------------------------------


def renewer_for(tmp_path: Path, cert: asyncssh.SSHCertificate, key: asyncssh.SSHKey) -> Renewer:
    renewer = Renewer(credentials(tmp_path, cert, key), node=NODE, clock=lambda: 0.0)
    renewer.loaded(cert)
    return renewer


def test_renewal_is_due_from_two_thirds_of_the_lifetime(
    tmp_path: Path, ca: asyncssh.SSHKey
) -> None:
    key = asyncssh.generate_private_key("ssh-ed25519")
    renewer = renewer_for(tmp_path, user_cert(ca, key, valid_after=0, valid_before=90), key)
    assert not renewer.due(59.0)
    assert renewer.due(60.0)
    assert renewer.due(1_000.0)  # expired: still worth asking (the gateway may refuse)
    assert renewer.stats.expiry == 90.0


def test_a_backdated_short_certificate_counts_its_lifetime_from_when_it_was_written(
    tmp_path: Path, ca: asyncssh.SSHKey
) -> None:
    """Signed at t with 5 minutes of backdating and 60 s to live: two thirds of
    valid_after..valid_before lie before t, so counted from valid_after it would be renewed
    as soon as it arrived, again and again."""
    t = 1_000_000.0
    key = asyncssh.generate_private_key("ssh-ed25519")
    cert = user_cert(ca, key, valid_after=int(t) - 300, valid_before=int(t) + 60)
    renewer = renewer_for(tmp_path, cert, key)
    os.utime(tmp_path / "node.key-cert.pub", (t, t))
    renewer.loaded(cert)
    assert not renewer.due(t)
    assert not renewer.due(t + 39)
    assert renewer.due(t + 40)


def test_a_certificate_without_expiry_is_never_renewed(tmp_path: Path, ca: asyncssh.SSHKey) -> None:
    key = asyncssh.generate_private_key("ssh-ed25519")
    cert = user_cert(ca, key, valid_after=0, valid_before=0xFFFF_FFFF_FFFF_FFFF)
    renewer = renewer_for(tmp_path, cert, key)
    assert not renewer.due(time.time())
    assert renewer.stats.expiry is None


class RefusingConnection:
    """Stands in for the SSH connection (a network seam): the gateway answers the renewal
    subsystem with a refusal, as the contract says it does."""

    def __init__(self) -> None:
        self.asked = 0

    async def run(self, **kwargs: object) -> asyncssh.SSHCompletedProcess:
        self.asked += 1
        assert kwargs["subsystem"] == "gpurelay-renew"
        return answer(1, stderr="error: node revoked\n")


async def test_a_failed_renewal_is_counted_logged_and_retried_after_five_minutes(
    tmp_path: Path, ca: asyncssh.SSHKey, caplog: pytest.LogCaptureFixture
) -> None:
    key = asyncssh.generate_private_key("ssh-ed25519")
    cert = user_cert(ca, key, valid_after=0, valid_before=900)
    cfg = credentials(tmp_path, cert, key)
    now = [700.0]
    renewer = Renewer(cfg, node=NODE, clock=lambda: now[0])
    renewer.loaded(cert)
    conn = RefusingConnection()
    assert renewer.due(now[0])
    assert not await renewer.renew(conn)  # type: ignore[arg-type]
    assert renewer.stats.failures == 1 and renewer.stats.renewals == 0
    assert "node revoked" in caplog.text and NODE in caplog.text
    assert not renewer.due(now[0] + RETRY_SECONDS - 1)
    assert renewer.due(now[0] + RETRY_SECONDS)
    # The same refusal 5 minutes later is counted, but not warned about again within the hour.
    caplog.clear()
    now[0] += RETRY_SECONDS
    assert not await renewer.renew(conn)  # type: ignore[arg-type]
    assert renewer.stats.failures == 2
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    now[0] += 3600
    assert not await renewer.renew(conn)  # type: ignore[arg-type]
    assert [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert cfg.certificate_path is not None
    assert cfg.certificate_path.read_bytes() == cert.export_certificate()  # untouched


@contextlib.contextmanager
def read_only(directory: Path) -> Iterator[Path]:
    """``directory`` (in it: the credentials) made read-only for this process: a mode
    without write for a user; for root, which a mode does not stop, a read-only
    filesystem (a tmpfs remounted read-only, like a Kubernetes Secret's volume)."""
    if os.geteuid() != 0:
        directory.chmod(0o500)
        try:
            yield directory
        finally:
            directory.chmod(0o700)
        return
    with small_tmpfs(directory.parent / "ro-mount", "1m") as mnt:
        for item in directory.iterdir():
            shutil.copy2(item, mnt / item.name)
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True, timeout=10)
        yield mnt


async def test_a_read_only_directory_fails_before_the_gateway_is_asked(
    tmp_path: Path, ca: asyncssh.SSHKey
) -> None:
    key = asyncssh.generate_private_key("ssh-ed25519")
    cert = user_cert(ca, key, valid_after=0, valid_before=900)
    written = tmp_path / "creds"
    written.mkdir()
    credentials(written, cert, key)
    with read_only(written) as where:
        cfg = credentials_in(where)
        renewer = Renewer(cfg, node=NODE, clock=lambda: 800.0)
        renewer.loaded(cert)
        conn = RefusingConnection()
        assert not await renewer.renew(conn)  # type: ignore[arg-type]
    assert conn.asked == 0 and renewer.stats.failures == 1


def test_renewal_metrics_follow_the_certificate(tmp_path: Path, ca: asyncssh.SSHKey) -> None:
    key = asyncssh.generate_private_key("ssh-ed25519")
    renewer = renewer_for(tmp_path, user_cert(ca, key, valid_after=0, valid_before=1234), key)

    class Sink:
        def __init__(self) -> None:
            self.families: list[str] = []
            self.values: dict[str, float] = {}

        def declare(self, family: Family) -> None:
            self.families.append(family.name)

        def add(self, name: str, labels: object, value: float) -> None:
            self.values[name] = value

    sink = Sink()
    renewer.metrics(sink)  # type: ignore[arg-type]
    assert sink.values == {
        "gpurelay_agent_certificate_expiry_timestamp_seconds": 1234.0,
        "gpurelay_agent_certificate_renewals_total": 0,
        "gpurelay_agent_certificate_renewal_failures_total": 0,
    }


# -- config ------------------------------------------------------------------------------------


def test_renewal_settings_default_on_with_the_same_key_and_come_from_the_environment() -> None:
    gw = load(None, {}).gateway
    assert (gw.renew, gw.renew_new_key) == (True, False)
    env = {"EDGE_AGENT_GATEWAY_RENEW": "false", "EDGE_AGENT_GATEWAY_RENEW_NEW_KEY": "true"}
    gw = load(None, env).gateway
    assert (gw.renew, gw.renew_new_key) == (False, True)


# -- enrollment input --------------------------------------------------------------------------


def token_file(tmp_path: Path, ca: asyncssh.SSHKey, node: str = NODE, exp: int = 0) -> Path:
    path = tmp_path / "token"
    path.write_text(sign_token(ca, node, exp or int(time.time()) + 3600, NONCE) + "\n")
    return path


def test_read_token_checks_node_and_expiry_before_anything_is_sent(
    tmp_path: Path, ca: asyncssh.SSHKey
) -> None:
    path = token_file(tmp_path, ca)
    assert read_token(path, NODE, time.time()).startswith("gpr1.")
    with pytest.raises(ConfigError, match="is for node 'edge-7', not this node 'edge-8'"):
        read_token(path, "edge-8", time.time())
    with pytest.raises(ConfigError, match=r"expired at .*make a new one"):
        read_token(path, NODE, time.time() + 7200)
    path.write_text("gpr1.nonsense")
    with pytest.raises(ConfigError, match="holds no enrollment token") as err:
        read_token(path, NODE, time.time())
    assert "nonsense" not in str(err.value)  # the token is never echoed
    with pytest.raises(ConfigError, match="no such file"):
        read_token(tmp_path / "missing", NODE, time.time())


@pytest.mark.parametrize("text", ["", "SHA256:short", "MD5:" + "a" * 43, "SHA256:" + "!" * 43])
def test_a_bad_fingerprint_is_refused(text: str) -> None:
    with pytest.raises(ConfigError, match="is not a fingerprint like SHA256"):
        check_fingerprint(text)


async def test_no_known_hosts_and_no_fingerprint_is_refused(
    tmp_path: Path, ca: asyncssh.SSHKey
) -> None:
    cfg = TunnelConfig(key=tmp_path / "node.key", known_hosts=tmp_path / "known_hosts")
    with pytest.raises(ConfigError, match="pass --host-ca-fingerprint"):
        await enroll(
            cfg,
            node=NODE,
            gateway=("127.0.0.1", 1),
            token_file=token_file(tmp_path, ca),
            fingerprint=None,
        )
    assert not cfg.key.exists()  # type: ignore[union-attr]


class RecordingServer(asyncssh.SSHServer):
    passwords: ClassVar[list[str]] = []

    def begin_auth(self, username: str) -> bool:
        return True

    def password_auth_supported(self) -> bool:
        return True

    def validate_password(self, username: str, password: str) -> bool:
        RecordingServer.passwords.append(password)
        return False


async def test_a_gateway_signed_by_another_host_ca_never_sees_the_token(
    tmp_path: Path, ca: asyncssh.SSHKey
) -> None:
    """A real SSH server with a host certificate from a CA that is not the pinned one: the
    agent drops the connection at the host key check, before any password is sent."""
    other_ca = asyncssh.generate_private_key("ssh-ed25519")
    pinned_ca = asyncssh.generate_private_key("ssh-ed25519")
    host_key = asyncssh.generate_private_key("ssh-ed25519")
    host_cert = other_ca.generate_host_certificate(
        host_key, "gateway:x", principals=["127.0.0.1"], valid_after=0, valid_before=2**40
    )
    RecordingServer.passwords = []
    server = await asyncssh.listen(
        "127.0.0.1",
        0,
        server_factory=RecordingServer,
        server_host_keys=[(host_key, host_cert)],
    )
    port = server.sockets[0].getsockname()[1]
    cfg = TunnelConfig(key=tmp_path / "node.key", known_hosts=tmp_path / "known_hosts")
    try:
        with pytest.raises(EnrollRefused, match="did not show a host certificate signed by"):
            await enroll(
                cfg,
                node=NODE,
                gateway=("127.0.0.1", port),
                token_file=token_file(tmp_path, ca),
                fingerprint=pinned_ca.get_fingerprint("sha256"),
            )
        assert RecordingServer.passwords == []
        assert not (tmp_path / "known_hosts").exists()
        # The right pin gets as far as the login, which this server refuses.
        with pytest.raises(EnrollRefused, match="refused the token for node edge-7"):
            await enroll(
                cfg,
                node=NODE,
                gateway=("127.0.0.1", port),
                token_file=token_file(tmp_path, ca),
                fingerprint=other_ca.get_fingerprint("sha256"),
            )
        assert len(RecordingServer.passwords) == 1
        assert RecordingServer.passwords[0].startswith("gpr1.")
        assert not (tmp_path / "known_hosts").exists()  # written only after success
    finally:
        server.close()
        await server.wait_closed()


def test_cli_enroll_errors_are_one_line_with_exit_2_for_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], ca: asyncssh.SSHKey
) -> None:
    config = tmp_path / "agent.toml"
    config.write_text(
        f'node_name = "{NODE}"\n[gateway]\naddress = "127.0.0.1:1"\n'
        f'key = "{tmp_path}/node.key"\nknown_hosts = "{tmp_path}/known_hosts"\n'
    )
    token = token_file(tmp_path, ca, node="edge-8")
    rc = main(
        [
            "enroll",
            "--config",
            str(config),
            "--token-file",
            str(token),
            "--host-ca-fingerprint",
            ca.get_fingerprint("sha256"),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and "is for node 'edge-8', not this node 'edge-7'" in err
    assert ENROLL_USER_PREFIX not in err


def test_enrolled_report_names_every_file(tmp_path: Path) -> None:
    from edge_agent.enroll import Enrolled

    text = Enrolled(
        node=NODE,
        key=tmp_path / "k",
        new_key=True,
        certificate=tmp_path / "c",
        serial=9,
        valid_before=1_700_000_000,
        known_hosts=tmp_path / "kh",
        wrote_known_hosts=True,
        ca_fingerprint="SHA256:x",
    ).report()
    assert "serial 9" in text and "2023-11-14" in text
    assert str(tmp_path / "k") in text and str(tmp_path / "kh") in text


async def test_without_configured_paths_the_installers_places_are_used(
    tmp_path: Path, ca: asyncssh.SSHKey
) -> None:
    """`edge-agent enroll` as `certs enroll-token` prints it (no --config): the key and
    known_hosts go where install-edge-agent.sh --enroll-token would configure them."""
    key, known = tmp_path / "state" / "node.key", tmp_path / "etc" / "known_hosts"
    with pytest.raises(ConfigError, match=f"{known} does not exist"):
        await enroll(
            TunnelConfig(), node=NODE, gateway=("127.0.0.1", 1),
            token_file=token_file(tmp_path, ca), fingerprint=None, defaults=(key, known),
        )  # fmt: skip
    from edge_agent.enroll import Enrolled

    report = Enrolled(
        node=NODE, key=key, new_key=True, certificate=tmp_path / "c", serial=1,
        valid_before=1, known_hosts=known, wrote_known_hosts=True, ca_fingerprint="SHA256:x",
        unconfigured=(f'key = "{key}"', f'known_hosts = "{known}"'),
    ).report()  # fmt: skip
    assert f'  key = "{key}"' in report and "under [gateway]" in report
