"""Signing node keys that arrive over SSH (enrollment and renewal, issue 17 §1).

:func:`sign_node_key` makes the same user certificate as ``certs issue-node`` (principal
[NODE], key id ``node:NODE``, remote forwards only) for a public key given in memory,
with a lifetime in seconds, and writes nothing but the CA directory's serial counter and
its ``issued.log`` line (under the directory's lock, like every issuer). It refuses a
revoked node or key.

Two :class:`Signer` s give it to the gateway: :class:`LocalSigner` (``[enroll]
user_ca_key``: the gateway reads the CA key) and
:class:`cloud_gateway.trust.signer_socket.SocketSigner`
(``[enroll] signer_socket``: a separate ``cloud-gateway signer`` process holds the key).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import asyncssh

from cloud_gateway.errors import GatewayError, InvalidInput
from cloud_gateway.names import node_name_problem
from cloud_gateway.trust import certs
from cloud_gateway.trust.auth_policy import format_validity, validate_node_name
from cloud_gateway.trust.config import MIN_LIFETIME_SECONDS
from cloud_gateway.trust.revocation import RevocationList, RevocationWatcher
from gpurelay.enrollment import NONCE_BYTES, REASON_NOT_A_KEY, REASON_REVOKED, sign_token

log = logging.getLogger("cloud_gateway.signing")

REASONS = ("enroll", "renew")


class SigningRefused(GatewayError):
    """The signer would not sign: ``reason`` is the short text the agent is told."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(detail or reason)
        self.reason = reason


@dataclass(frozen=True, kw_only=True)
class Issued:
    certificate: str  # the OpenSSH certificate line (export_certificate())
    serial: int
    node: str
    valid_after: int
    valid_before: int
    key_fingerprint: str

    def describe(self, reason: str) -> str:
        return (
            f"issued certificate serial={self.serial} node={self.node} "
            f"valid={format_validity(self.valid_after, self.valid_before)} "
            f"key={self.key_fingerprint} ({reason})"
        )


def parse_public_key(text: str) -> asyncssh.SSHKey:
    """One OpenSSH public key line (not a certificate, not a private key)."""
    line = text.strip()
    if not line or "\n" in line or "-cert-v01@openssh.com" in line.split(" ", 1)[0]:
        raise SigningRefused(REASON_NOT_A_KEY, "expected one OpenSSH public key line")
    try:
        return asyncssh.import_public_key(line)
    except (asyncssh.KeyImportError, ValueError) as exc:
        raise SigningRefused(REASON_NOT_A_KEY, f"not an OpenSSH public key: {exc}") from None


def sign_node_key(
    ca_dir: Path,
    node: str,
    public_key: asyncssh.SSHKey,
    *,
    lifetime_seconds: int,
    reason: str,
    ca_key: asyncssh.SSHKey | None = None,
    revoked: RevocationList | None = None,
    now: float | None = None,
) -> Issued:
    """A user certificate for ``node`` on ``public_key``, valid ``lifetime_seconds`` from
    now (backdated like ``certs issue-node``). ``ca_key``: the user CA (default
    ``ca_dir/user_ca``); ``ca_dir`` holds the serial counter and ``issued.log``."""
    problem = node_name_problem(node)
    if problem is not None:
        raise SigningRefused("not a node name", f"node {node!r}: {problem}")
    if reason not in REASONS:
        raise SigningRefused("bad request", f"reason must be one of {', '.join(REASONS)}")
    if lifetime_seconds < MIN_LIFETIME_SECONDS:
        raise SigningRefused("bad request", f"lifetime below {MIN_LIFETIME_SECONDS} seconds")
    fingerprint = public_key.get_fingerprint("sha256")
    rule = (revoked or RevocationList()).is_revoked(node=node, key_fingerprint=fingerprint)
    if rule is not None:
        raise SigningRefused(REASON_REVOKED, f"node {node!r}: revoked by rule '{rule}'")
    paths = certs.CaPaths(ca_dir)
    ca = ca_key if ca_key is not None else certs._load_ca(paths.user_ca)
    start = int(time.time() if now is None else now)
    validity = (start - certs.BACKDATE_SECONDS, start + lifetime_seconds)
    with certs._locked(paths.dir):
        serial = certs._next_serial(paths)
        cert = certs._certify(
            ca, public_key, key_id=f"node:{node}", principals=(node,), serial=serial,
            validity=validity, host=False,
        )  # fmt: skip
        certs.log_issued(paths, cert, reason=reason)
    return Issued(
        certificate=cert.export_certificate().decode("ascii").strip(),
        serial=serial,
        node=node,
        valid_after=validity[0],
        valid_before=validity[1],
        key_fingerprint=fingerprint,
    )


def make_enroll_token(
    ca_dir: Path, node: str, *, ttl_seconds: int, now: float | None = None
) -> tuple[str, int]:
    """A one-time token for ``node`` signed by ``ca_dir``'s user CA, and its expiry."""
    validate_node_name(node)
    if ttl_seconds < MIN_LIFETIME_SECONDS:
        raise InvalidInput(f"a token must be valid for at least {MIN_LIFETIME_SECONDS}s (--ttl)")
    ca = certs._load_ca(certs.CaPaths(ca_dir).user_ca)
    exp = int(time.time() if now is None else now) + ttl_seconds
    return sign_token(ca, node, exp, secrets.token_hex(NONCE_BYTES)), exp


class Signer(Protocol):
    async def sign(
        self, node: str, public_key: str, *, reason: str, lifetime_seconds: int
    ) -> Issued:
        """Raise SigningRefused (refused), or GatewayError (the signer cannot be reached)."""
        ...


class LocalSigner:
    """The gateway signs itself with the CA key it read at start (``[enroll] user_ca_key``);
    the key's directory holds the serial counter and ``issued.log``."""

    def __init__(self, key_path: Path, *, revocations: RevocationWatcher | None) -> None:
        self.ca_dir = key_path.parent
        self.ca_key = certs._load_ca(key_path)
        self.revocations = revocations

    async def sign(
        self, node: str, public_key: str, *, reason: str, lifetime_seconds: int
    ) -> Issued:
        key = parse_public_key(public_key)
        revoked = self.revocations.current() if self.revocations else None
        return await asyncio.to_thread(
            sign_node_key,
            self.ca_dir,
            node,
            key,
            lifetime_seconds=lifetime_seconds,
            reason=reason,
            ca_key=self.ca_key,
            revoked=revoked,
        )
