"""The fleet PKI (cloud_gateway.trust.certs) and its CLI (cloud_gateway.commands.certs)."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import asyncssh
import pytest
from asyncssh.public_key import SSHOpenSSHCertificate

from cloud_gateway.commands.certs import add_certs_parser, run_certs
from cloud_gateway.errors import (
    CaExistsError,
    CaNotFoundError,
    CertError,
    InvalidInput,
    InvalidNodeName,
    RevocationFileError,
)
from cloud_gateway.trust import certs
from cloud_gateway.trust.revocation import RevocationList, Rule
from gpurelay.ssh_cert import certificate_info

SSH_KEYGEN = shutil.which("ssh-keygen")
needs_ssh_keygen = pytest.mark.skipif(
    SSH_KEYGEN is None, reason="ssh-keygen not found (Debian package openssh-client)"
)
NOW = 1_700_000_000
DAY = 86400


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def keygen(*args: str | Path) -> str:
    assert SSH_KEYGEN is not None
    done = subprocess.run(
        [SSH_KEYGEN, *map(str, args)], check=True, capture_output=True, text=True, timeout=30
    )
    return done.stdout


def read_cert(path: Path) -> SSHOpenSSHCertificate:
    cert = asyncssh.read_certificate(path)
    assert isinstance(cert, SSHOpenSSHCertificate)
    return cert


@pytest.fixture
def ca(tmp_path: Path) -> certs.CaPaths:
    return certs.init_ca(tmp_path / "ca")


@pytest.fixture
def umask_zero() -> Iterator[None]:
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


# -- init_ca -------------------------------------------------------------------------------


def test_init_ca_writes_both_cas_with_private_modes(ca: certs.CaPaths) -> None:
    assert mode(ca.dir) == 0o700
    assert mode(ca.user_ca) == mode(ca.host_ca) == 0o600
    assert mode(ca.user_ca_pub) == mode(ca.host_ca_pub) == 0o644
    user, host = asyncssh.read_private_key(ca.user_ca), asyncssh.read_private_key(ca.host_ca)
    assert user.public_data != host.public_data
    assert asyncssh.read_public_key(ca.user_ca_pub).public_data == user.public_data
    assert user.get_algorithm() == "ssh-ed25519"
    assert len(RevocationList.load(ca.revocations)) == 0


def test_private_modes_do_not_depend_on_the_umask(tmp_path: Path, umask_zero: None) -> None:
    ca = certs.init_ca(tmp_path / "ca")
    issued = certs.issue_node(ca.dir, "edge-1")
    assert mode(ca.dir) == 0o700
    assert mode(ca.user_ca) == mode(ca.host_ca) == 0o600
    assert issued.private_key is not None and mode(issued.private_key) == 0o600
    assert mode(issued.private_key.parent) == 0o700


def test_init_ca_tightens_an_existing_directory(tmp_path: Path) -> None:
    tmp_path.joinpath("ca").mkdir(mode=0o755)
    assert mode(certs.init_ca(tmp_path / "ca").dir) == 0o700


def test_known_hosts_trusts_gateways_signed_by_the_host_ca(ca: certs.CaPaths) -> None:
    line = ca.known_hosts.read_text()
    assert line == f"@cert-authority * {ca.host_ca_pub.read_text().strip()}\n"
    gateway = certs.issue_gateway(ca.dir, "gw.example.com", now=NOW)
    host_cert = read_cert(gateway.certificate)
    known = asyncssh.read_known_hosts(str(ca.known_hosts))
    _, ca_keys, *_ = known.match("gw.example.com", "192.0.2.1", 2222)
    assert [k.public_data for k in ca_keys] == [host_cert.signing_key.public_data]


def test_init_ca_refuses_to_overwrite(ca: certs.CaPaths) -> None:
    before = {p: p.read_bytes() for p in ca.ca_keys}
    with pytest.raises(CaExistsError, match=r"already holds CA keys .*refusing to overwrite"):
        certs.init_ca(ca.dir)
    assert {p: p.read_bytes() for p in ca.ca_keys} == before


def test_init_ca_refuses_when_any_one_ca_file_exists(tmp_path: Path) -> None:
    tmp_path.joinpath("host_ca.pub").write_text("ssh-ed25519 AAAA\n")
    with pytest.raises(CaExistsError, match=r"\(host_ca.pub\)"):
        certs.init_ca(tmp_path)
    assert not tmp_path.joinpath("user_ca").exists()


# -- issue_node ----------------------------------------------------------------------------


def test_issue_node_certificate(ca: certs.CaPaths) -> None:
    issued = certs.issue_node(ca.dir, "edge-1", now=NOW)
    out = ca.dir / "nodes"
    assert issued.private_key == out / "edge-1"
    assert issued.public_key == out / "edge-1.pub"
    assert issued.certificate == out / "edge-1-cert.pub"
    assert mode(out / "edge-1") == 0o600
    assert issued.new_key

    cert = read_cert(issued.certificate)
    info = certificate_info(cert)
    assert info.is_user
    assert info.principals == ("edge-1",)
    assert info.key_id == "node:edge-1"
    assert info.serial == issued.serial == 1
    assert info.valid_after == NOW - 300
    assert info.valid_before == NOW + 90 * DAY == int(issued.expires.timestamp())
    assert cert.signing_key.public_data == asyncssh.read_public_key(ca.user_ca_pub).public_data
    key = asyncssh.read_private_key(out / "edge-1")
    assert cert.key.public_data == key.public_data
    assert issued.key_fingerprint == key.get_fingerprint("sha256")
    # Least privilege: an agent needs remote forwards, nothing else.
    assert set(cert.options) == {"permit-port-forwarding"}


@needs_ssh_keygen
def test_openssh_reads_what_we_issue(ca: certs.CaPaths) -> None:
    issued = certs.issue_node(ca.dir, "edge-1", now=NOW, days=30)
    listing = keygen("-L", "-f", issued.certificate)
    assert "user certificate" in listing
    assert 'Key ID: "node:edge-1"' in listing
    assert "Serial: 1" in listing
    assert "permit-port-forwarding" in listing and "permit-pty" not in listing
    assert issued.private_key is not None
    derived = keygen("-y", "-f", issued.private_key).split()[:2]
    assert derived == issued.public_key.read_text().split()[:2]


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("Foo_1", "only lowercase letters a-z, digits 0-9 and '-' are allowed (found 'F', '_')"),
        ("edge-", "it must start and end with a lowercase letter or a digit"),
        ("x" * 64, "it has 64 characters, at most 63 are allowed"),
        ("../evil", "only lowercase letters a-z, digits 0-9 and '-' are allowed (found '.', '/')"),
    ],
)
def test_issue_node_validates_the_name(ca: certs.CaPaths, name: str, problem: str) -> None:
    with pytest.raises(InvalidNodeName) as raised:
        certs.issue_node(ca.dir, name)
    assert str(raised.value) == f"node name {name!r} is not a DNS-1123 label: {problem}"
    assert not (ca.dir / "nodes").exists()


def test_serials_are_monotonic_across_nodes_gateways_and_renewals(ca: certs.CaPaths) -> None:
    serials = [
        certs.issue_node(ca.dir, "edge-1").serial,
        certs.issue_node(ca.dir, "edge-2").serial,
        certs.issue_gateway(ca.dir, "gw.example.com").serial,
        certs.issue_node(ca.dir, "edge-1").serial,
    ]
    assert serials == [1, 2, 3, 4]
    assert ca.serial.read_text() == "4\n"
    ca.serial.write_text("41\n")  # e.g. restored from a backup that was ahead
    assert certs.issue_node(ca.dir, "edge-3").serial == 42
    assert certificate_info(read_cert(ca.dir / "nodes" / "edge-3-cert.pub")).serial == 42


def test_a_corrupt_serial_counter_is_an_error(ca: certs.CaPaths) -> None:
    ca.serial.write_text("many\n")
    with pytest.raises(CertError, match=r"serial counter .* holds 'many', not a number"):
        certs.issue_node(ca.dir, "edge-1")


def test_issuing_again_renews_for_the_same_key(ca: certs.CaPaths) -> None:
    first = certs.issue_node(ca.dir, "edge-1", now=NOW)
    assert first.private_key is not None
    secret = first.private_key.read_bytes()
    second = certs.issue_node(ca.dir, "edge-1", now=NOW + 60 * DAY)
    assert not second.new_key
    assert second.private_key == first.private_key
    assert first.private_key.read_bytes() == secret
    assert second.key_fingerprint == first.key_fingerprint
    assert second.serial == first.serial + 1
    assert certificate_info(read_cert(second.certificate)).valid_before == NOW + 150 * DAY


def test_a_lone_public_key_is_signed_as_it_is(ca: certs.CaPaths, tmp_path: Path) -> None:
    """The node made its own key; only edge-1.pub came to the CA."""
    key = asyncssh.generate_private_key("ssh-ed25519")
    out = tmp_path / "incoming"
    out.mkdir()
    (out / "edge-1.pub").write_bytes(key.export_public_key())
    issued = certs.issue_node(ca.dir, "edge-1", out_dir=out)
    assert issued.private_key is None
    assert not (out / "edge-1").exists()
    assert read_cert(issued.certificate).key.public_data == key.public_data


def test_a_public_key_that_does_not_match_is_refused(ca: certs.CaPaths) -> None:
    certs.issue_node(ca.dir, "edge-1")
    other = asyncssh.generate_private_key("ssh-ed25519")
    (ca.dir / "nodes" / "edge-1.pub").write_bytes(other.export_public_key())
    with pytest.raises(CertError, match="is not the public half of"):
        certs.issue_node(ca.dir, "edge-1")


def test_issue_needs_a_ca(tmp_path: Path) -> None:
    with pytest.raises(CaNotFoundError, match="certs init-ca --dir"):
        certs.issue_node(tmp_path, "edge-1")


def test_issue_rejects_a_non_positive_validity(ca: certs.CaPaths) -> None:
    with pytest.raises(InvalidInput, match="at least 1 day"):
        certs.issue_node(ca.dir, "edge-1", days=0)


# -- issue_gateway -------------------------------------------------------------------------


def test_issue_gateway_host_certificate(ca: certs.CaPaths) -> None:
    issued = certs.issue_gateway(
        ca.dir, "gw.example.com", extra_names=["gw", "192.0.2.10"], now=NOW, days=10
    )
    assert issued.certificate == ca.dir / "gateways" / "gw.example.com-cert.pub"
    cert = read_cert(issued.certificate)
    info = certificate_info(cert)
    assert not info.is_user
    assert info.principals == ("gw.example.com", "gw", "192.0.2.10")
    assert info.key_id == "gateway:gw.example.com"
    assert info.valid_before == NOW + 10 * DAY
    assert cert.signing_key.public_data == asyncssh.read_public_key(ca.host_ca_pub).public_data
    assert issued.private_key is not None and mode(issued.private_key) == 0o600


@pytest.mark.parametrize("host", ["", "*.example.com", "gw example", "gw/../x", "-gw"])
def test_issue_gateway_validates_names(ca: certs.CaPaths, host: str) -> None:
    with pytest.raises(InvalidInput, match="is not a host name or IP address"):
        certs.issue_gateway(ca.dir, host)


# -- revoke --------------------------------------------------------------------------------


def test_revoke_a_node_appends_a_comment_and_the_rule(ca: certs.CaPaths) -> None:
    done = certs.revoke(ca.dir, "edge-7", now=NOW, who="ops@bastion")
    assert done.added and done.file == ca.revocations and done.rule == Rule("node", "edge-7")
    lines = ca.revocations.read_text().splitlines()
    assert lines[-2:] == [
        "# revoked 2023-11-14T22:13:20Z by ops@bastion: node edge-7",
        "node edge-7",
    ]
    assert RevocationList.load(ca.revocations).is_revoked(node="edge-7") == "node edge-7"


def test_revoke_is_idempotent(ca: certs.CaPaths) -> None:
    certs.revoke(ca.dir, "edge-7")
    before = ca.revocations.read_bytes()
    again = certs.revoke(ca.dir, "edge-7")
    assert not again.added
    assert ca.revocations.read_bytes() == before


@needs_ssh_keygen
@pytest.mark.parametrize("which", ["public_key", "certificate", "private_key"])
def test_revoke_a_key_file_by_its_fingerprint(ca: certs.CaPaths, which: str) -> None:
    issued = certs.issue_node(ca.dir, "edge-1")
    target = getattr(issued, which)
    done = certs.revoke(ca.dir, target)
    fingerprint = keygen("-lf", issued.public_key).split()[1]
    assert done.rule == Rule("key", fingerprint)
    assert str(target) in done.source
    assert f"key {fingerprint}" in ca.revocations.read_text().splitlines()


def test_revoke_accepts_a_fingerprint_and_a_relative_key_path(
    ca: certs.CaPaths, monkeypatch: pytest.MonkeyPatch
) -> None:
    issued = certs.issue_node(ca.dir, "edge-1")
    assert certs.revoke(ca.dir, issued.key_fingerprint).rule == Rule("key", issued.key_fingerprint)
    monkeypatch.chdir(ca.dir / "nodes")
    by_path = certs.revoke(ca.dir, "./edge-1")  # a file named like a node: say it is a path
    assert by_path.rule == Rule("key", issued.key_fingerprint) and not by_path.added
    assert certs.revoke(ca.dir, "edge-1").rule == Rule("node", "edge-1")


def test_revoke_into_a_named_file_without_a_trailing_newline(tmp_path: Path) -> None:
    path = tmp_path / "revoked.txt"
    path.write_text("node edge-1")
    certs.revoke(path, "edge-2")
    assert RevocationList.load(path).nodes == {"edge-1", "edge-2"}


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("Edge_7", "no key or certificate file 'Edge_7', and 'Edge_7' is not a node name"),
        ("./missing.pub", "no key or certificate file './missing.pub'"),
        ("SHA256:nope", "is not a SHA256 fingerprint"),
    ],
)
def test_revoke_explains_a_bad_target(ca: certs.CaPaths, target: str, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        certs.revoke(ca.dir, target)


def test_revoke_a_file_that_is_no_key(ca: certs.CaPaths) -> None:
    with pytest.raises(InvalidInput, match="is not an OpenSSH public key, certificate or private"):
        certs.revoke(ca.dir, ca.known_hosts)


def test_revoke_refuses_to_append_to_a_malformed_list(ca: certs.CaPaths) -> None:
    ca.revocations.write_text("node edge-1\nban edge-2\n")
    with pytest.raises(RevocationFileError, match=r"revocations:2: unknown rule 'ban'"):
        certs.revoke(ca.dir, "edge-3")


# -- the CLI -------------------------------------------------------------------------------


def cli(*argv: str | Path) -> int:
    parser = argparse.ArgumentParser(prog="cloud-gateway")
    add_certs_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["certs", *map(str, argv)])
    code = run_certs(args)
    assert args.func is run_certs  # what the gateway CLI dispatches on
    return code


def test_cli_walkthrough_never_prints_key_material(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "ca"
    steps = [
        ("init-ca", "--dir", d),
        ("issue-node", "edge-1", "--ca-dir", d, "--days", "30"),
        ("issue-node", "edge-1", "--ca-dir", d, "--out", tmp_path / "out"),
        ("issue-gateway", "gw.example.com", "--name", "192.0.2.10", "--ca-dir", d),
        ("revoke", "edge-1", "--ca-dir", d),
        ("revoke", d / "nodes" / "edge-1-cert.pub", "--revocation-file", d / "revocations"),
    ]
    printed = ""
    for step in steps:
        assert cli(*step) == 0, step
        out, err = capsys.readouterr()
        assert err == ""
        printed += out
    assert "PRIVATE KEY" not in printed
    secrets = [d / "user_ca", d / "host_ca", d / "nodes" / "edge-1", tmp_path / "out" / "edge-1"]
    for secret in secrets:
        body = secret.read_text().splitlines()[1:-1]  # between the BEGIN and END lines
        assert all(chunk not in printed for chunk in body)
    assert f"created the fleet CAs in {d} (mode 0700)" in printed
    assert re.search(rf"^  {re.escape(str(d / 'user_ca'))} +0600  ", printed, re.M)
    assert re.search(rf"^  {re.escape(str(d / 'nodes' / 'edge-1'))} +0600  ", printed, re.M)
    assert "serial 1, valid until" in printed and "(30 days)" in printed
    assert "certificate for gw.example.com, 192.0.2.10" in printed
    assert "added 'node edge-1' to" in printed
    # it says when a gateway applies it, not that one does (issue 24, item 10)
    revocations = (d / "revocations").resolve()
    assert f"only if its [ssh] revocation_file is {revocations}" in printed


@pytest.mark.parametrize(
    ("argv", "code", "message"),
    [
        (("issue-node", "Foo_1"), 2, "node name 'Foo_1' is not a DNS-1123 label: "),
        (("issue-node", "edge-1", "--days", "0"), 2, "at least 1 day"),
        (("issue-gateway", "*.example.com"), 2, "is not a host name"),
        (("revoke", "Foo_1"), 2, "no key or certificate file 'Foo_1'"),
        (("init-ca", "--dir"), 1, "already holds CA keys"),
    ],
)
def test_cli_errors_are_one_line_with_exit_codes(
    ca: certs.CaPaths,
    capsys: pytest.CaptureFixture[str],
    argv: tuple[str, ...],
    code: int,
    message: str,
) -> None:
    where = ("--ca-dir", str(ca.dir)) if argv[0] != "init-ca" else (str(ca.dir),)
    assert cli(*argv, *where) == code
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"cloud-gateway certs {argv[0]}: error: ")
    assert message in err
    assert err.count("\n") == 1


def test_cli_missing_ca_is_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli("issue-node", "edge-1", "--ca-dir", tmp_path / "nowhere") == 1
    assert "no CA key at" in capsys.readouterr().err


def test_cli_revoke_needs_a_destination(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as raised:
        cli("revoke", "edge-1")
    assert raised.value.code == 2
    assert "one of the arguments --ca-dir --revocation-file is required" in capsys.readouterr().err
