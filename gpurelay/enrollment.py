"""Enrollment and renewal: what the agent and the gateway agree on (issue 17 §1).

Pure: no sockets, no files, no clock read inside (``now`` is passed in).

A token is ``gpr1.`` + base64url(payload JSON) + ``.`` + base64url(signature), both
without padding. The payload is ``{"node": NODE, "exp": unix seconds, "nonce": 32 hex}``;
the signature is the fleet user CA's SSH signature over the exact payload bytes, so any
gateway verifies it with the user CA *public* key alone. The gateway records the nonce
when it signs, which makes a token single use.

Over SSH the agent logs in as ``enroll:NODE`` with the token as its password and opens
the :data:`ENROLL_SUBSYSTEM`; an agent that already has a certificate opens the
:data:`RENEW_SUBSYSTEM` on its normal connection. Either writes one OpenSSH public key
line and EOF; the gateway answers the certificate line on stdout and exit status 0, or
``error: <reason>`` on stderr and exit status 1.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import asyncssh

ENROLL_USER_PREFIX = "enroll:"
ENROLL_SUBSYSTEM = "gpurelay-enroll"
RENEW_SUBSYSTEM = "gpurelay-renew"
TOKEN_PREFIX = "gpr1."
MAX_TOKEN_LENGTH = 4096
# The most a public key line sent to either subsystem may hold (an RSA 16384 key is ~2.8 KiB).
MAX_PUBLIC_KEY_LINE = 8192
NONCE_BYTES = 16
ERROR_PREFIX = "error: "
EXIT_OK = 0
EXIT_REFUSED = 1

# Reasons a gateway gives (stderr ``error: <reason>``, and its own log).
REASON_EXPIRED = "expired token"
REASON_USED = "token already used"
REASON_OTHER_NODE = "token for another node"
REASON_REVOKED = "node revoked"
REASON_NOT_A_KEY = "not a public key"
REASON_DISABLED = "enrollment disabled"

_NONCE = re.compile(r"[0-9a-f]{32}")
_B64URL = re.compile(r"[A-Za-z0-9_-]*")
# A node name as it may appear in a token; the gateway applies its own node name rules too.
_NODE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")
_FIELDS = frozenset({"node", "exp", "nonce"})


class TokenError(ValueError):
    """A token that is not one: the message says what is wrong, never the token itself."""


@dataclass(frozen=True, kw_only=True)
class Token:
    node: str
    exp: int
    nonce: str
    payload: bytes
    signature: bytes


def enroll_username(node: str) -> str:
    return ENROLL_USER_PREFIX + node


def node_from_username(username: str) -> str | None:
    """The node of an ``enroll:NODE`` user name, else None."""
    if not username.startswith(ENROLL_USER_PREFIX):
        return None
    return username[len(ENROLL_USER_PREFIX) :]


def _b64url_encode(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _b64url_decode(text: str, what: str) -> bytes:
    if not text:
        raise TokenError(f"the token's {what} is empty")
    if not _B64URL.fullmatch(text) or len(text) % 4 == 1:
        raise TokenError(f"the token's {what} is not unpadded base64url")
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError) as exc:
        raise TokenError(f"the token's {what} is not unpadded base64url") from exc


def encode_payload(node: str, exp: int, nonce: str) -> bytes:
    """The exact payload bytes that are signed (compact JSON, keys sorted)."""
    return json.dumps(
        {"exp": exp, "node": node, "nonce": nonce}, separators=(",", ":"), sort_keys=True
    ).encode("utf-8")


def format_token(payload: bytes, signature: bytes) -> str:
    return f"{TOKEN_PREFIX}{_b64url_encode(payload)}.{_b64url_encode(signature)}"


def parse_token(text: str) -> Token:
    """Split and check a token's shape; the signature is *not* verified here."""
    if not isinstance(text, str):
        raise TokenError("the token is not text")
    text = text.strip()
    if len(text) > MAX_TOKEN_LENGTH:
        raise TokenError(f"the token is longer than {MAX_TOKEN_LENGTH} characters")
    if not text.startswith(TOKEN_PREFIX):
        raise TokenError(f"the token does not start with {TOKEN_PREFIX!r}")
    parts = text[len(TOKEN_PREFIX) :].split(".")
    if len(parts) != 2:
        raise TokenError("the token is not gpr1.<payload>.<signature>")
    payload = _b64url_decode(parts[0], "payload")
    signature = _b64url_decode(parts[1], "signature")
    try:
        fields = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise TokenError("the token's payload is not JSON") from exc
    except RecursionError:  # a few thousand '[' fit the length cap; data, not a crash
        raise TokenError("the token's payload is JSON nested too deeply") from None
    if not isinstance(fields, dict):
        raise TokenError("the token's payload is not a JSON object")
    if set(fields) != _FIELDS:
        raise TokenError("the token's payload must hold exactly node, exp and nonce")
    node, exp, nonce = fields["node"], fields["exp"], fields["nonce"]
    if not isinstance(node, str) or not _NODE.fullmatch(node):
        raise TokenError("the token's node is not a node name")
    if isinstance(exp, bool) or not isinstance(exp, int) or not 0 < exp < 2**63:
        raise TokenError("the token's exp is not a positive integer (unix seconds)")
    if not isinstance(nonce, str) or not _NONCE.fullmatch(nonce):
        raise TokenError(f"the token's nonce is not {2 * NONCE_BYTES} lowercase hex characters")
    return Token(node=node, exp=exp, nonce=nonce, payload=payload, signature=signature)


def _sig_algorithm(key: asyncssh.SSHKey) -> bytes:
    # rsa-sha2-256 for an RSA key (not the SHA-1 ssh-rsa), the key's own algorithm otherwise.
    return bytes(key.sig_algorithms[0])


def sign_token(ca_key: asyncssh.SSHKey, node: str, exp: int, nonce: str) -> str:
    """A token for ``node`` signed by the user CA's private key."""
    payload = encode_payload(node, exp, nonce)
    token = format_token(payload, ca_key.sign(payload, _sig_algorithm(ca_key)))
    parse_token(token)  # what we hand out must be what we accept
    return token


def verify_token(token: Token, trusted: Iterable[asyncssh.SSHKey]) -> bool:
    """True if one of the trusted user CA keys made the token's signature.

    A private key is reduced to its public half first (asyncssh verifies Ed25519 with the
    public key only)."""
    return any(key.convert_to_public().verify(token.payload, token.signature) for key in trusted)


def renew_due(valid_after: float, valid_before: float, now: float) -> bool:
    """True from two thirds of the certificate's lifetime on (and once it is past)."""
    if valid_before <= valid_after:
        return True
    return now >= valid_after + (valid_before - valid_after) * 2 / 3


def error_line(reason: str) -> str:
    return f"{ERROR_PREFIX}{reason}\n"


def refusal_said(stderr: object, exit_status: int | None) -> str:
    """What the gateway said when it refused (the last line of its stderr, normally an
    :func:`error_line`), at most 300 characters; else its exit status."""
    lines = str(stderr or "").strip().splitlines()
    return lines[-1][:300] if lines else f"exit status {exit_status}"
