"""The node's credentials on disk: its key and certificate, read and replaced safely.

Shared by enrollment (:mod:`edge_agent.enroll`), renewal (:mod:`edge_agent.renew`) and the
tunnel, which reads them again before every connection. A file is always replaced whole
(:func:`write_atomic`); a new key is swapped in crash-safely (see :func:`load_pair`).
"""

from __future__ import annotations

import logging
import os
import struct
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import asyncssh
from asyncssh.public_key import SSHOpenSSHCertificate

from edge_agent.errors import AgentError

log = logging.getLogger(__name__)

FOREVER = 0xFFFF_FFFF_FFFF_FFFF  # OpenSSH's valid_before for "no expiry"


# -- files -----------------------------------------------------------------------------------


def write_atomic(path: Path, data: bytes, mode: int) -> None:
    """Replace ``path`` by ``data`` with ``mode`` so that a reader sees the old file or the
    new one, never half of either, even across a crash: a temporary file in the same
    directory (``mode`` from its first byte), fsync, rename, fsync of the directory."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fchmod(handle.fileno(), mode)  # O_CREAT's mode passed through the umask
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    sync_dir(path.parent)


def sync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (best effort where a directory cannot be
    opened for that)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def expiry_text(valid_before: int) -> str:
    if valid_before >= FOREVER:
        return "never"
    return datetime.fromtimestamp(valid_before, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


@dataclass(frozen=True, slots=True)
class CertValidity:
    serial: int
    valid_after: int
    valid_before: int


def openssh_certificate(cert: asyncssh.SSHCertificate) -> SSHOpenSSHCertificate:
    """``cert`` as the OpenSSH certificate a node uses (not X.509), else ValueError."""
    if not isinstance(cert, SSHOpenSSHCertificate):
        raise ValueError("not an OpenSSH certificate")
    return cert


def cert_validity(cert: asyncssh.SSHCertificate) -> CertValidity:
    """Serial and validity of an OpenSSH certificate, from its wire encoding
    (PROTOCOL.certkeys: ``string alg, string nonce, <key fields>, uint64 serial, uint32
    type, string key_id, string principals, uint64 valid_after, uint64 valid_before``);
    asyncssh keeps them private. The key fields are those of the key's own blob."""
    blob = cert.public_data
    pos = _skip_string(blob, _skip_string(blob, 0))
    key_blob = cert.key.public_data
    key_fields = key_blob[_skip_string(key_blob, 0) :]
    if blob[pos : pos + len(key_fields)] != key_fields:
        raise ValueError("certificate does not embed its own public key where expected")
    pos += len(key_fields)
    (serial,) = struct.unpack_from(">Q", blob, pos)
    pos = _skip_string(blob, _skip_string(blob, pos + 12))  # key id, principals
    valid_after, valid_before = struct.unpack_from(">QQ", blob, pos)
    return CertValidity(serial=serial, valid_after=valid_after, valid_before=valid_before)


def _skip_string(blob: bytes, pos: int) -> int:
    (length,) = struct.unpack_from(">I", blob, pos)
    end = pos + 4 + length
    if end > len(blob):
        raise ValueError("truncated certificate")
    return int(end)


def next_key_path(key: Path) -> Path:
    return key.with_name(key.name + ".next")


def load_pair(key_path: Path, cert_path: Path) -> tuple[asyncssh.SSHKey, asyncssh.SSHCertificate]:
    """The node key and its certificate, errors naming the file.

    A renewal with a new key writes it next to the key as ``<key>.next``, then the
    certificate (for the new key) over the old one, then renames ``<key>.next`` over the
    key. A crash between the last two renames leaves a certificate for ``<key>.next``:
    that swap is finished here."""
    try:
        cert = asyncssh.read_certificate(str(cert_path))
    except (OSError, asyncssh.KeyImportError) as exc:
        raise AgentError(f"node certificate {cert_path} cannot be used: {exc}") from exc
    try:
        key = asyncssh.read_private_key(str(key_path))
    except (OSError, asyncssh.KeyImportError) as exc:
        raise AgentError(f"node key {key_path} cannot be used: {exc}") from exc
    if cert.key.public_data == key.public_data:
        return key, cert
    pending = next_key_path(key_path)
    try:
        new = asyncssh.read_private_key(str(pending))
    except (OSError, asyncssh.KeyImportError):
        new = None
    if new is None or new.public_data != cert.key.public_data:
        raise AgentError(
            f"node certificate {cert_path} is not for the key {key_path} "
            f"({cert.key.get_fingerprint('sha256')} vs {key.get_fingerprint('sha256')})"
        )
    os.replace(pending, key_path)  # the swap a renewal with a new key had not finished
    sync_dir(key_path.parent)
    log.warning("finished swapping in the renewed key %s (from %s)", key_path, pending)
    return new, cert
