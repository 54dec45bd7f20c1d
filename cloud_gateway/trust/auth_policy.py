"""Which OpenSSH user certificates the gateway accepts, and why it refuses the others.

The gateway knows a node only by the login name of an agent's SSH connection, and accepts
that name only when an OpenSSH user certificate vouches for it. :func:`check_user_certificate`
is a pure function (the time is passed in) returning ``None`` for an acceptable certificate
or a stable reason code, used as a metric label. Checks run in this order, so the first
reason reported is the most telling one:

=====================  ============================================================
``not_a_user_cert``    a host certificate (or not an OpenSSH certificate at all)
``unknown_ca``         not signed by a trusted user CA; nothing else in it is believed
``bad_node_name``      the login name is not a DNS-1123 label
``no_principal``       no principal; OpenSSH reads that as "any user", we refuse it
``multiple_principals`` more than one principal; a node certificate names one node
``principal_mismatch`` the login name is not the certificate's principal
``revoked``            a rule of the revocation list matches (node, key, serial, key id)
``not_yet_valid``      before its ``valid_after``
``expired``            at or after its ``valid_before`` (OpenSSH's own comparison)
=====================  ============================================================

Certificates made with plain ``ssh-keygen -s`` are judged exactly like ours: the facts are
read from the certificate's wire encoding (:func:`gpurelay.ssh_cert.certificate_info`), not
from how we issue.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import asyncssh
from asyncssh.public_key import SSHOpenSSHCertificate

from cloud_gateway.errors import CertError, InvalidNodeName
from cloud_gateway.names import node_name_problem
from gpurelay.ssh_cert import CERT_TYPE_HOST, CERT_TYPE_USER, FOREVER, certificate_info

if TYPE_CHECKING:  # revocation.py imports the node-name rule from here
    from cloud_gateway.trust.revocation import RevocationList

REASONS: tuple[str, ...] = (
    "not_a_user_cert",
    "unknown_ca",
    "bad_node_name",
    "no_principal",
    "multiple_principals",
    "principal_mismatch",
    "revoked",
    "not_yet_valid",
    "expired",
)
"""Every reason code :func:`check_user_certificate` can return, in the order it checks."""


# -- node names ----------------------------------------------------------------------------


def is_node_name(name: str) -> bool:
    return node_name_problem(name) is None


def validate_node_name(name: str) -> str:
    """Return ``name`` unchanged, or raise :class:`InvalidNodeName` saying what is wrong."""
    problem = node_name_problem(name)
    if problem is not None:
        raise InvalidNodeName(f"node name {name!r} is not a DNS-1123 label: {problem}")
    return name


# -- the policy ----------------------------------------------------------------------------


def check_user_certificate(
    username: str,
    cert: SSHOpenSSHCertificate,
    *,
    trusted_cas: Sequence[asyncssh.SSHKey],
    revoked: RevocationList,
    now: float,
) -> str | None:
    """None when ``cert`` lets ``username`` in at ``now`` (epoch seconds), else a reason code.

    The certificate's signature was verified by asyncssh when it was decoded; this checks
    who signed it and what it says. Reason codes are listed in :data:`REASONS`.
    """
    if not isinstance(cert, SSHOpenSSHCertificate):
        return "not_a_user_cert"
    info = certificate_info(cert)
    if not info.is_user:
        return "not_a_user_cert"
    ca_blob = cert.signing_key.public_data
    if not any(ca.public_data == ca_blob for ca in trusted_cas):
        return "unknown_ca"
    if not is_node_name(username):
        return "bad_node_name"
    if not info.principals:
        return "no_principal"
    if len(info.principals) > 1:
        return "multiple_principals"
    if info.principals[0] != username:
        return "principal_mismatch"
    rule = revoked.is_revoked(
        node=username, key_fingerprint=info.key_fingerprint, serial=info.serial, key_id=info.key_id
    )
    if rule is not None:
        return "revoked"
    if now < info.valid_after:
        return "not_yet_valid"
    if now >= info.valid_before:
        return "expired"
    return None


def describe(reason: str | None, username: str, cert: SSHOpenSSHCertificate) -> str:
    """One log line about a verdict: node, key id, serial, validity, fingerprints; no secret.

    Everything a client sent is ``repr``-quoted, so a crafted name cannot forge log lines.
    """
    verdict = "accepted" if reason is None else f"refused ({reason})"
    if not isinstance(cert, SSHOpenSSHCertificate):
        return f"node {username!r} {verdict}: {type(cert).__name__} is not an OpenSSH certificate"
    info = certificate_info(cert)
    kind = {CERT_TYPE_USER: "user", CERT_TYPE_HOST: "host"}.get(info.cert_type, "unknown")
    return (
        f"node {username!r} {verdict}: {kind} certificate key_id={info.key_id!r} "
        f"serial={info.serial} principals={list(info.principals)!r} "
        f"valid={format_validity(info.valid_after, info.valid_before)} "
        f"key={info.key_fingerprint} ca={info.ca_fingerprint}"
    )


def format_validity(valid_after: int, valid_before: int) -> str:
    """``2025-01-01T00:00:00Z..2025-04-01T00:00:00Z``, with ``always`` / ``forever`` ends."""
    start = "always" if valid_after == 0 else format_time(valid_after)
    end = "forever" if valid_before == FOREVER else format_time(valid_before)
    return f"{start}..{end}"


def format_time(epoch: float) -> str:
    try:
        return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    except (OverflowError, OSError, ValueError):
        return "forever"


# -- trusted CAs ---------------------------------------------------------------------------


def load_trusted_cas(path: Path) -> list[asyncssh.SSHKey]:
    """The CA public keys in ``path``: one OpenSSH public key a line, ``#`` comments allowed.

    This is the format of sshd's ``TrustedUserCAKeys``; a ``user_ca.pub`` is such a file.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        detail = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise CertError(f"trusted CA file {path} cannot be read: {detail}") from exc
    keys: list[asyncssh.SSHKey] = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            keys.append(asyncssh.import_public_key(line))
        except (asyncssh.KeyImportError, ValueError) as exc:
            hint = " (a certificate? give the CA's public key)" if "-cert-" in line else ""
            raise CertError(f"{path}:{lineno}: not an OpenSSH public key{hint}: {exc}") from exc
    if not keys:
        raise CertError(f"trusted CA file {path} holds no public key")
    return keys


def refusal(
    username: str,
    cert: object,
    *,
    trusted_cas: Sequence[asyncssh.SSHKey],
    revoked: RevocationList,
    now: float,
) -> tuple[str, str] | None:
    """:func:`check_user_certificate` on what a connection presented (``None`` when it
    logged in some other way): its reason code and log line, or None when it logs in now."""
    if not isinstance(cert, SSHOpenSSHCertificate):
        return "not_a_user_cert", f"{username!r} is not authenticated by a certificate"
    reason = check_user_certificate(
        username, cert, trusted_cas=trusted_cas, revoked=revoked, now=now
    )
    return None if reason is None else (reason, describe(reason, username, cert))
