"""The node's credentials on disk: its key and certificate, read and replaced safely.

Shared by enrollment (:mod:`edge_agent.enroll`), renewal (:mod:`edge_agent.renew`) and the
tunnel, which reads them again before every connection. A file is always replaced whole
(:func:`gpurelay.files.write_atomic`); a new key is swapped in crash-safely (see
:func:`load_pair`).
"""

from __future__ import annotations

import logging
import os
from datetime import UTC, datetime
from pathlib import Path

import asyncssh
from asyncssh.public_key import SSHOpenSSHCertificate

from edge_agent.errors import AgentError
from gpurelay.files import sync_dir
from gpurelay.ssh_cert import FOREVER

log = logging.getLogger(__name__)


def expiry_text(valid_before: int) -> str:
    if valid_before >= FOREVER:
        return "never"
    return datetime.fromtimestamp(valid_before, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def openssh_certificate(cert: asyncssh.SSHCertificate) -> SSHOpenSSHCertificate:
    """``cert`` as the OpenSSH certificate a node uses (not X.509), else ValueError."""
    if not isinstance(cert, SSHOpenSSHCertificate):
        raise ValueError("not an OpenSSH certificate")
    return cert


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
