"""gpurelay.ssh_cert: what both binaries read from an OpenSSH certificate (certificates made
by asyncssh here; test_auth_policy reads ssh-keygen's)."""

from __future__ import annotations

import asyncssh
import pytest

from gpurelay.ssh_cert import CERT_TYPE_HOST, FOREVER, certificate_info

CA = asyncssh.generate_private_key("ssh-ed25519")


@pytest.mark.parametrize(
    ("alg", "size"), [("ssh-ed25519", None), ("ssh-rsa", 2048), ("ecdsa-sha2-nistp256", None)]
)
def test_reads_serial_key_id_principals_and_validity(alg: str, size: int | None) -> None:
    key = asyncssh.generate_private_key(alg, **({"key_size": size} if size else {}))
    cert = CA.generate_user_certificate(
        key, "node:edge-1", principals=["edge-1"], serial=77, valid_after=1_000, valid_before=4_000
    )
    info = certificate_info(cert)
    assert (info.serial, info.key_id, info.principals) == (77, "node:edge-1", ("edge-1",))
    assert (info.valid_after, info.valid_before, info.is_user) == (1_000, 4_000, True)
    assert info.key_fingerprint == key.get_fingerprint("sha256")
    assert info.ca_fingerprint == CA.get_fingerprint("sha256")


def test_a_host_certificate_without_expiry() -> None:
    key = asyncssh.generate_private_key("ssh-ed25519")
    cert = CA.generate_host_certificate(key, "gw", principals=["gw.example"])
    info = certificate_info(cert)
    assert (info.cert_type, info.is_user, info.valid_before) == (CERT_TYPE_HOST, False, FOREVER)


def test_refuses_what_is_not_an_openssh_certificate() -> None:
    """An X.509 certificate (built bare: generating one needs PyOpenSSL) is no node's."""
    key = asyncssh.generate_private_key("ssh-ed25519")
    x509 = asyncssh.SSHCertificate(b"x509v3-ssh-ed25519", [], [], key, b"0\x82", None)
    with pytest.raises(ValueError, match="not an OpenSSH certificate"):
        certificate_info(x509)
