"""The certificate policy, fed real certificates: ours (asyncssh) and plain ``ssh-keygen``'s."""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncssh
import pytest
from asyncssh.public_key import SSHOpenSSHCertificate

from cloud_gateway.errors import CertError, InvalidNodeName
from cloud_gateway.names import node_name_problem
from cloud_gateway.trust import certs
from cloud_gateway.trust.auth_policy import (
    REASONS,
    check_user_certificate,
    describe,
    load_trusted_cas,
    validate_node_name,
)
from cloud_gateway.trust.revocation import RevocationList
from gpurelay.ssh_cert import certificate_info

SSH_KEYGEN = shutil.which("ssh-keygen")
needs_ssh_keygen = pytest.mark.skipif(
    SSH_KEYGEN is None, reason="ssh-keygen not found (Debian package openssh-client)"
)

NOW = 1_700_000_000  # 2023-11-14T22:13:20Z
HOUR = 3600
NO_REVOCATIONS = RevocationList()


def keygen(*args: str | Path) -> str:
    assert SSH_KEYGEN is not None
    done = subprocess.run(
        [SSH_KEYGEN, *map(str, args)], check=True, capture_output=True, text=True, timeout=30
    )
    return done.stdout


@dataclass
class KeygenPki:
    """A CA and an agent key made by ssh-keygen, and a second CA nobody trusts."""

    dir: Path
    ca: Path
    other_ca: Path
    agent: Path

    def sign(
        self, *options: str, ca: Path | None = None, name: str = "cert"
    ) -> SSHOpenSSHCertificate:
        """``ssh-keygen -s CA <options> agent.pub``, read back with asyncssh."""
        pub = self.dir / f"{name}.pub"
        shutil.copyfile(self.agent.with_suffix(".pub"), pub)
        keygen("-q", "-s", ca or self.ca, *options, pub)
        cert = asyncssh.read_certificate(self.dir / f"{name}-cert.pub")
        assert isinstance(cert, SSHOpenSSHCertificate)
        return cert

    @property
    def trusted(self) -> list[asyncssh.SSHKey]:
        return load_trusted_cas(self.ca.with_suffix(".pub"))


@pytest.fixture
def kpki(tmp_path: Path) -> KeygenPki:
    if SSH_KEYGEN is None:
        pytest.skip("ssh-keygen not found (Debian package openssh-client)")
    for name in ("ca", "other_ca", "agent"):
        keygen("-q", "-t", "ed25519", "-N", "", "-C", name, "-f", tmp_path / name)
    return KeygenPki(tmp_path, tmp_path / "ca", tmp_path / "other_ca", tmp_path / "agent")


@dataclass
class OurPki:
    """The same CA and agent key, loaded in asyncssh, signing the asyncssh way."""

    ca: asyncssh.SSHKey
    other_ca: asyncssh.SSHKey
    agent: asyncssh.SSHKey

    def sign(
        self, *, ca: asyncssh.SSHKey | None = None, host: bool = False, **kw: Any
    ) -> SSHOpenSSHCertificate:
        signer = ca or self.ca
        make = signer.generate_host_certificate if host else signer.generate_user_certificate
        cert = make(self.agent, kw.pop("key_id"), **kw)
        # Round-trip through the file format, as the gateway receives certificates.
        imported = asyncssh.import_certificate(cert.export_certificate())
        assert isinstance(imported, SSHOpenSSHCertificate)
        return imported


@pytest.fixture
def ours(kpki: KeygenPki) -> OurPki:
    return OurPki(
        asyncssh.read_private_key(kpki.ca),
        asyncssh.read_private_key(kpki.other_ca),
        asyncssh.read_public_key(kpki.agent.with_suffix(".pub")),
    )


def check(
    username: str,
    cert: SSHOpenSSHCertificate,
    trusted: list[asyncssh.SSHKey],
    *,
    revoked: RevocationList = NO_REVOCATIONS,
    now: float = NOW,
) -> str | None:
    return check_user_certificate(username, cert, trusted_cas=trusted, revoked=revoked, now=now)


VALID = f"0x{NOW - HOUR:x}:0x{NOW + HOUR:x}"
WINDOW = {"valid_after": NOW - HOUR, "valid_before": NOW + HOUR}

# (expected reason, login name, ssh-keygen options, the same certificate made with asyncssh)
CASES: list[tuple[str | None, str, tuple[str, ...], dict[str, Any]]] = [
    (None, "edge-1", ("-I", "node:edge-1", "-n", "edge-1", "-z", "7", "-V", VALID),
     {"principals": ["edge-1"], "serial": 7, **WINDOW}),
    ("not_a_user_cert", "edge-1", ("-h", "-I", "node:edge-1", "-n", "edge-1", "-V", VALID),
     {"host": True, "principals": ["edge-1"], **WINDOW}),
    ("unknown_ca", "edge-1", ("-I", "node:edge-1", "-n", "edge-1", "-V", VALID),
     {"foreign_ca": True, "principals": ["edge-1"], **WINDOW}),
    ("bad_node_name", "Foo_1", ("-I", "node:Foo_1", "-n", "Foo_1", "-V", VALID),
     {"principals": ["Foo_1"], **WINDOW}),
    ("no_principal", "edge-1", ("-I", "node:edge-1", "-V", VALID),
     {"principals": [], **WINDOW}),
    ("multiple_principals", "edge-1", ("-I", "node:edge-1", "-n", "edge-1,edge-2", "-V", VALID),
     {"principals": ["edge-1", "edge-2"], **WINDOW}),
    ("principal_mismatch", "edge-2", ("-I", "node:edge-1", "-n", "edge-1", "-V", VALID),
     {"principals": ["edge-1"], **WINDOW}),
    ("not_yet_valid", "edge-1",
     ("-I", "node:edge-1", "-n", "edge-1", "-V", f"0x{NOW + 60:x}:0x{NOW + HOUR:x}"),
     {"principals": ["edge-1"], "valid_after": NOW + 60, "valid_before": NOW + HOUR}),
    ("expired", "edge-1", ("-I", "node:edge-1", "-n", "edge-1", "-V", "20200101:20200102"),
     {"principals": ["edge-1"], "valid_after": 1577836800, "valid_before": 1577923200}),
]  # fmt: skip


@needs_ssh_keygen
@pytest.mark.parametrize(("expected", "username", "options", "same"), CASES,
                         ids=[str(c[0]) for c in CASES])  # fmt: skip
def test_ssh_keygen_and_asyncssh_certificates_are_judged_alike(
    kpki: KeygenPki,
    ours: OurPki,
    expected: str | None,
    username: str,
    options: tuple[str, ...],
    same: dict[str, Any],
) -> None:
    kw = {"key_id": "node:edge-1", **same}
    foreign = kw.pop("foreign_ca", False)
    made_by_keygen = kpki.sign(*options, ca=kpki.other_ca if foreign else kpki.ca)
    made_by_asyncssh = ours.sign(ca=ours.other_ca if foreign else ours.ca, **kw)

    assert check(username, made_by_keygen, kpki.trusted) == expected
    assert check(username, made_by_asyncssh, kpki.trusted) == expected
    a, b = certificate_info(made_by_keygen), certificate_info(made_by_asyncssh)
    assert (a.cert_type, a.serial, a.principals, a.key_fingerprint, a.ca_fingerprint) == (
        b.cert_type,
        b.serial,
        b.principals,
        b.key_fingerprint,
        b.ca_fingerprint,
    )
    if "0x" in options[-1]:  # "20200101" is local time to ssh-keygen
        assert (a.valid_after, a.valid_before) == (b.valid_after, b.valid_before)


def test_every_reason_code_is_exercised() -> None:
    assert {c[0] for c in CASES} - {None} | {"revoked"} == set(REASONS)


@needs_ssh_keygen
def test_certificate_info_reads_what_ssh_keygen_wrote(kpki: KeygenPki) -> None:
    cert = kpki.sign("-I", "node:edge-1 (rack 4)", "-n", "edge-1", "-z", "42", "-V", VALID)
    info = certificate_info(cert)
    assert info.is_user
    assert info.serial == 42
    assert info.key_id == "node:edge-1 (rack 4)"
    assert info.principals == ("edge-1",)
    assert (info.valid_after, info.valid_before) == (NOW - HOUR, NOW + HOUR)
    listing = keygen("-L", "-f", kpki.dir / "cert-cert.pub")
    assert f"Public key: ED25519-CERT {info.key_fingerprint}" in listing
    assert f"Signing CA: ED25519 {info.ca_fingerprint}" in listing


@needs_ssh_keygen
@pytest.mark.parametrize("key_type", [("rsa", "-b", "2048"), ("ecdsa", "-b", "256")])
def test_certificate_info_works_for_other_key_types(
    kpki: KeygenPki, key_type: tuple[str, ...]
) -> None:
    """The key fields are skipped generically, so RSA and ECDSA agents are read right too."""
    kpki.agent.unlink()  # replace the ed25519 agent key
    kpki.agent.with_suffix(".pub").unlink()
    keygen("-q", "-t", *key_type, "-N", "", "-f", kpki.agent)
    cert = kpki.sign("-I", "node:edge-1", "-n", "edge-1", "-z", "9", "-V", VALID)
    info = certificate_info(cert)
    assert (info.serial, info.key_id, info.valid_before) == (9, "node:edge-1", NOW + HOUR)
    assert check("edge-1", cert, kpki.trusted) is None


@needs_ssh_keygen
def test_host_certificate_from_ssh_keygen_is_not_a_user_certificate(kpki: KeygenPki) -> None:
    cert = kpki.sign("-h", "-I", "gw", "-n", "gw.example.com", "-V", "+52w")
    assert check("gw.example.com", cert, kpki.trusted, now=time.time()) == "not_a_user_cert"


@needs_ssh_keygen
@pytest.mark.parametrize(
    ("rule", "matches"),
    [
        ("node edge-1", True),
        ("node edge-2", False),
        ("serial 7", True),
        ("serial 8", False),
        ("keyid node:edge-1", True),
        ("keyid node:edge-2", False),
    ],
)
def test_revoked_by_rule(kpki: KeygenPki, rule: str, matches: bool) -> None:
    cert = kpki.sign("-I", "node:edge-1", "-n", "edge-1", "-z", "7", "-V", VALID)
    revoked = RevocationList.parse(rule)
    assert check("edge-1", cert, kpki.trusted, revoked=revoked) == ("revoked" if matches else None)


@needs_ssh_keygen
def test_revoked_by_key_fingerprint_as_ssh_keygen_prints_it(kpki: KeygenPki) -> None:
    cert = kpki.sign("-I", "node:edge-1", "-n", "edge-1", "-V", VALID)
    fingerprint = keygen("-lf", kpki.agent.with_suffix(".pub")).split()[1]
    revoked = RevocationList.parse(f"key {fingerprint}")
    assert check("edge-1", cert, kpki.trusted, revoked=revoked) == "revoked"


@needs_ssh_keygen
def test_revocation_outranks_expiry_but_not_an_unknown_ca(kpki: KeygenPki) -> None:
    revoked = RevocationList.parse("node edge-1")
    expired = kpki.sign("-I", "node:edge-1", "-n", "edge-1", "-V", "20200101:20200102")
    assert check("edge-1", expired, kpki.trusted, revoked=revoked) == "revoked"
    foreign = kpki.sign("-I", "node:edge-1", "-n", "edge-1", "-V", VALID, ca=kpki.other_ca)
    assert check("edge-1", foreign, kpki.trusted, revoked=revoked) == "unknown_ca"


@needs_ssh_keygen
def test_validity_edges_follow_openssh(kpki: KeygenPki) -> None:
    cert = kpki.sign("-I", "node:edge-1", "-n", "edge-1", "-V", VALID)
    trusted = kpki.trusted
    assert check("edge-1", cert, trusted, now=NOW - HOUR) is None  # valid_after is inclusive
    assert check("edge-1", cert, trusted, now=NOW - HOUR - 0.5) == "not_yet_valid"
    assert check("edge-1", cert, trusted, now=NOW + HOUR - 0.5) is None
    assert check("edge-1", cert, trusted, now=NOW + HOUR) == "expired"  # valid_before is not


def test_our_issued_certificate_is_accepted(tmp_path: Path) -> None:
    paths = certs.init_ca(tmp_path / "ca")
    issued = certs.issue_node(paths.dir, "edge-1", now=NOW)
    cert = asyncssh.read_certificate(issued.certificate)
    assert isinstance(cert, SSHOpenSSHCertificate)
    trusted = load_trusted_cas(paths.user_ca_pub)
    assert check("edge-1", cert, trusted) is None
    assert check("edge-1", cert, load_trusted_cas(paths.host_ca_pub)) == "unknown_ca"
    revoked = RevocationList.parse(f"serial {issued.serial}")
    assert check("edge-1", cert, trusted, revoked=revoked) == "revoked"
    assert check("edge-1", cert, trusted, now=NOW + 91 * 86400) == "expired"


@needs_ssh_keygen
def test_describe_is_one_line_with_the_facts_and_no_secret(kpki: KeygenPki) -> None:
    cert = kpki.sign("-I", "node:edge-1", "-n", "edge-1", "-z", "7", "-V", VALID)
    line = describe("expired", "edge-1\nFAKE LOG LINE", cert)
    assert "\n" not in line
    assert "refused (expired)" in line
    assert "'edge-1\\nFAKE LOG LINE'" in line
    assert "key_id='node:edge-1'" in line
    assert "serial=7" in line
    assert "valid=2023-11-14T21:13:20Z..2023-11-14T23:13:20Z" in line
    assert certificate_info(cert).key_fingerprint in line
    assert "PRIVATE" not in line
    assert describe(None, "edge-1", cert).startswith("node 'edge-1' accepted:")


@needs_ssh_keygen
def test_describe_open_ended_validity(kpki: KeygenPki) -> None:
    cert = kpki.sign("-I", "node:edge-1", "-n", "edge-1")
    assert "valid=always..forever" in describe(None, "edge-1", cert)


@needs_ssh_keygen
def test_load_trusted_cas_reads_several_keys_and_comments(kpki: KeygenPki) -> None:
    both = kpki.dir / "trusted"
    both.write_text(
        "# fleet user CAs\n\n"
        + kpki.ca.with_suffix(".pub").read_text()
        + "   # rotated in 2025\n"
        + kpki.other_ca.with_suffix(".pub").read_text()
    )
    keys = load_trusted_cas(both)
    assert [k.get_comment() for k in keys] == ["ca", "other_ca"]


@needs_ssh_keygen
def test_load_trusted_cas_errors_name_the_line(kpki: KeygenPki) -> None:
    kpki.sign("-I", "x", "-n", "edge-1")
    bad = kpki.dir / "trusted"
    bad.write_text("# ok\n" + (kpki.dir / "cert-cert.pub").read_text())
    with pytest.raises(CertError, match=r"trusted:2: not an OpenSSH public key \(a certificate"):
        load_trusted_cas(bad)
    bad.write_text("# nothing here\n")
    with pytest.raises(CertError, match="holds no public key"):
        load_trusted_cas(bad)
    with pytest.raises(CertError, match="cannot be read"):
        load_trusted_cas(kpki.dir / "missing.pub")


@pytest.mark.parametrize("name", ["a", "0", "edge-1", "gpu-box-07", "a" * 63, "1-2-3"])
def test_dns1123_labels_are_node_names(name: str) -> None:
    assert node_name_problem(name) is None
    assert validate_node_name(name) == name


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("Foo_1", "only lowercase letters a-z, digits 0-9 and '-' are allowed (found 'F', '_')"),
        ("edge.1", "only lowercase letters a-z, digits 0-9 and '-' are allowed (found '.')"),
        ("", "it is empty"),
        ("-edge", "it must start and end with a lowercase letter or a digit"),
        ("edge-", "it must start and end with a lowercase letter or a digit"),
        ("a" * 64, "it has 64 characters, at most 63 are allowed"),
        ("edge\n", "only lowercase letters a-z, digits 0-9 and '-' are allowed (found '\\n')"),
        ("édge", "only lowercase letters a-z, digits 0-9 and '-' are allowed (found 'é')"),
    ],
)
def test_node_name_problems_are_explained(name: str, problem: str) -> None:
    with pytest.raises(InvalidNodeName) as raised:
        validate_node_name(name)
    assert str(raised.value) == f"node name {name!r} is not a DNS-1123 label: {problem}"
