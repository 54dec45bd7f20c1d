"""What an OpenSSH certificate says, read from its wire encoding (PROTOCOL.certkeys).

asyncssh keeps a certificate's serial, type, key id and validity in private attributes, so
both binaries read them here from the public blob: the gateway to judge a login
(:mod:`cloud_gateway.trust.auth_policy`) and to report expiries, the agent to know when to renew
(:mod:`edge_agent.renew`). Certificates made with plain ``ssh-keygen -s`` read the same.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import asyncssh
from asyncssh.public_key import SSHOpenSSHCertificate

CERT_TYPE_USER = 1
CERT_TYPE_HOST = 2
FOREVER = 0xFFFF_FFFF_FFFF_FFFF  # OpenSSH's valid_before for "no expiry"


@dataclass(frozen=True, kw_only=True)
class CertInfo:
    """What an OpenSSH certificate says, read from its wire encoding (PROTOCOL.certkeys)."""

    cert_type: int
    serial: int
    key_id: str
    principals: tuple[str, ...]
    valid_after: int
    valid_before: int
    key_fingerprint: str
    ca_fingerprint: str

    @property
    def is_user(self) -> bool:
        return self.cert_type == CERT_TYPE_USER


def certificate_info(cert: asyncssh.SSHCertificate) -> CertInfo:
    """Serial, type, key id and validity of ``cert``; ValueError (or struct.error for a
    truncated blob) when it is not an OpenSSH certificate that reads as one.

    Decoded from the public blob: ``string algorithm, string nonce, <public key fields>,
    uint64 serial, uint32 type, string key_id, string principals, uint64 valid_after,
    uint64 valid_before, ...``. The public key fields are byte for byte those of the
    certified key's own public blob after its algorithm name, whatever the key type, which
    is how they are skipped.
    """
    if not isinstance(cert, SSHOpenSSHCertificate):
        raise ValueError("not an OpenSSH certificate")
    blob = cert.public_data
    _, pos = _string(blob, 0)  # certificate algorithm
    _, pos = _string(blob, pos)  # nonce
    key_blob = cert.key.public_data
    _, key_fields_at = _string(key_blob, 0)  # key algorithm
    key_fields = key_blob[key_fields_at:]
    if blob[pos : pos + len(key_fields)] != key_fields:
        raise ValueError("certificate does not embed its own public key where expected")
    pos += len(key_fields)
    serial, cert_type = struct.unpack_from(">QI", blob, pos)
    key_id, pos = _string(blob, pos + 12)
    _, pos = _string(blob, pos)  # principals: asyncssh has decoded them already
    valid_after, valid_before = struct.unpack_from(">QQ", blob, pos)
    return CertInfo(
        cert_type=cert_type,
        serial=serial,
        key_id=key_id.decode("utf-8", errors="replace"),
        principals=tuple(cert.principals),
        valid_after=valid_after,
        valid_before=valid_before,
        key_fingerprint=cert.key.get_fingerprint("sha256"),
        ca_fingerprint=cert.signing_key.get_fingerprint("sha256"),
    )


def _string(blob: bytes, pos: int) -> tuple[bytes, int]:
    (length,) = struct.unpack_from(">I", blob, pos)
    start = pos + 4
    end = start + length
    if end > len(blob):
        raise ValueError("truncated certificate")
    return blob[start:end], end
