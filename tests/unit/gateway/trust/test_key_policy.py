"""Which node keys get a certificate (issue 24 #7): RSA-1024 and DSA keys were certified."""

from __future__ import annotations

import subprocess
from pathlib import Path

import asyncssh
import pytest

from cloud_gateway.config import load
from cloud_gateway.errors import GatewayConfigError
from cloud_gateway.trust import certs
from cloud_gateway.trust.config import DEFAULT_MIN_RSA_BITS, check_min_rsa_bits
from cloud_gateway.trust.key_policy import check_node_key, key_problem
from cloud_gateway.trust.signer_socket import SignerServer
from cloud_gateway.trust.signing import SigningRefused


def keygen(tmp_path: Path, kind: str, bits: int | None = None) -> str:
    """A public key line made by ssh-keygen; DSA by asyncssh where ssh-keygen dropped it."""
    path = tmp_path / f"{kind}{bits or ''}"
    size = ["-b", str(bits)] if bits else []
    done = subprocess.run(
        ["ssh-keygen", "-q", "-t", kind, *size, "-N", "", "-C", "", "-f", str(path)],
        check=False, capture_output=True, timeout=60,
    )  # fmt: skip
    if done.returncode != 0 and kind == "dsa":  # OpenSSH 9.8+ builds without DSA
        return asyncssh.generate_private_key("ssh-dss").export_public_key().decode()
    assert done.returncode == 0, done
    return path.with_suffix(".pub").read_text()


@pytest.mark.parametrize(
    ("kind", "bits", "says"),
    [
        ("rsa", 1024, "an RSA key of 1024 bits is too weak"),
        ("rsa", 2048, "an RSA key of 2048 bits is too weak"),
        ("dsa", None, "DSA keys are not accepted"),
    ],
)
def test_weak_keys_are_refused_with_what_would_do(
    tmp_path: Path, kind: str, bits: int | None, says: str
) -> None:
    line = keygen(tmp_path, kind, bits)
    with pytest.raises(SigningRefused) as refused:
        check_node_key(line, min_rsa_bits=DEFAULT_MIN_RSA_BITS)
    accepted = "use Ed25519, ECDSA or RSA of at least 3072 bits"
    assert refused.value.reason == f"weak key: {says}: {accepted}"
    assert str(refused.value) == f"{says}: {accepted}"


@pytest.mark.parametrize(
    ("kind", "bits"), [("ed25519", None), ("ecdsa", 256), ("ecdsa", 384), ("ecdsa", 521)]
)
def test_ed25519_and_ecdsa_keys_are_accepted(tmp_path: Path, kind: str, bits: int | None) -> None:
    line = keygen(tmp_path, kind, bits)
    assert check_node_key(line, min_rsa_bits=DEFAULT_MIN_RSA_BITS).export_public_key()


def test_the_rsa_floor_is_3072_by_default_and_configurable() -> None:
    rsa2048 = asyncssh.generate_private_key("ssh-rsa", key_size=2048).convert_to_public()
    rsa3072 = asyncssh.generate_private_key("ssh-rsa", key_size=3072).convert_to_public()
    assert DEFAULT_MIN_RSA_BITS == 3072
    assert key_problem(rsa3072, min_rsa_bits=DEFAULT_MIN_RSA_BITS) is None
    assert key_problem(rsa2048, min_rsa_bits=2048) is None
    assert key_problem(rsa3072, min_rsa_bits=4096) == (
        "an RSA key of 3072 bits is too weak: use Ed25519, ECDSA or RSA of at least 4096 bits"
    )


@pytest.mark.parametrize("bits", [1024, 2047, 0, True, "3072"])
def test_a_floor_below_2048_is_a_config_error(bits: object) -> None:
    with pytest.raises(GatewayConfigError, match=r"enroll\.min_rsa_bits must be an integer"):
        check_min_rsa_bits(bits, "enroll.min_rsa_bits")


async def test_the_signer_refuses_a_weak_key_itself(tmp_path: Path) -> None:
    """The signer process checks again: a gateway that skipped the check gets no cert."""
    ca = certs.init_ca(tmp_path / "ca")
    line = keygen(tmp_path, "rsa", 1024).strip()
    request = (
        b'{"node": "edge-1", "public_key": "' + line.encode() + b'", "reason": "renew",'
        b' "lifetime_seconds": 600}\n'
    )
    server = SignerServer(ca.dir, tmp_path / "s.sock", max_lifetime_seconds=3600)
    answer = await server.answer(request)
    assert answer == {
        "error": "weak key: an RSA key of 1024 bits is too weak: "
        "use Ed25519, ECDSA or RSA of at least 3072 bits"
    }
    assert not ca.issued_log.exists()
    lenient = SignerServer(
        ca.dir, tmp_path / "s.sock", max_lifetime_seconds=3600, min_rsa_bits=2048
    )
    strong = keygen(tmp_path, "rsa", 2048).strip()
    answer = await lenient.answer(request.replace(line.encode(), strong.encode()))
    assert "certificate" in answer, answer


def test_the_gateway_reads_its_floor_from_enroll_min_rsa_bits(tmp_path: Path) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text("[enroll]\nmin_rsa_bits = 4096\n")
    assert load(config, {}).enroll.min_rsa_bits == 4096
    assert load(None, {}).enroll.min_rsa_bits == 3072
    config.write_text("[enroll]\nmin_rsa_bits = 1024\n")
    with pytest.raises(GatewayConfigError, match=r"enroll\.min_rsa_bits must be an integer"):
        load(config, {})
