"""Which node keys get a certificate (issue 24 #7).

Ed25519 and ECDSA keys (and their FIDO ``sk-`` forms) are certified; RSA keys only from
``min_rsa_bits`` bits up (3072 by default, never below 2048); DSA and anything else never.
The gateway checks a key at enrollment and renewal before it spends a token or asks a
signer (``[enroll] min_rsa_bits``), and ``cloud-gateway signer`` checks it again before it
signs (``--min-rsa-bits``): each refuses with a message that says what would be accepted.
"""

from __future__ import annotations

import asyncssh
from cryptography.hazmat.primitives.asymmetric import rsa

from cloud_gateway.trust.signing import SigningRefused, parse_public_key

REASON_WEAK_KEY = "weak key"

_ALWAYS = (b"ssh-ed25519", b"sk-ssh-ed25519@openssh.com", b"sk-ecdsa-sha2-nistp256@openssh.com")


def key_problem(key: asyncssh.SSHKey, *, min_rsa_bits: int) -> str | None:
    """None when ``key`` may be certified, else what is wrong with it and what would do."""
    algorithm = bytes(key.algorithm)
    if algorithm in _ALWAYS or algorithm.startswith(b"ecdsa-sha2-"):
        return None
    accepted = f"use Ed25519, ECDSA or RSA of at least {min_rsa_bits} bits"
    if algorithm == b"ssh-rsa":
        pyca = key.pyca_key
        bits = pyca.key_size if isinstance(pyca, rsa.RSAPublicKey) else 0
        if bits >= min_rsa_bits:
            return None
        return f"an RSA key of {bits} bits is too weak: {accepted}"
    name = "DSA" if algorithm == b"ssh-dss" else algorithm.decode("ascii", "replace")
    return f"{name} keys are not accepted: {accepted}"


def check_node_key(public_key: str, *, min_rsa_bits: int) -> asyncssh.SSHKey:
    """The key of an OpenSSH public key line, or SigningRefused (``weak key``, or not a
    public key at all)."""
    key = parse_public_key(public_key)
    problem = key_problem(key, min_rsa_bits=min_rsa_bits)
    if problem is not None:
        raise SigningRefused(f"{REASON_WEAK_KEY}: {problem}", problem)
    return key
