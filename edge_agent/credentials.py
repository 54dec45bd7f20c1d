"""The node's credentials: its key and certificate, read and replaced safely, and the
certificate the gateway answers to enrollment or renewal (:func:`certificate_answer`).

Shared by enrollment (:mod:`edge_agent.enroll`), renewal (:mod:`edge_agent.renew`) and the
tunnel, which reads them again before every connection. A file is always replaced whole
(:func:`gpurelay.files.write_atomic`); a new key is swapped in crash-safely (see
:func:`load_pair`).
"""

from __future__ import annotations

import logging
import os
import struct
from datetime import datetime
from pathlib import Path

import asyncssh
from asyncssh.public_key import SSHOpenSSHCertificate

from edge_agent.errors import AgentError
from gpurelay.compat import UTC
from gpurelay.enrollment import EXIT_OK, refusal_said
from gpurelay.files import sync_dir
from gpurelay.ssh_cert import FOREVER, CertInfo, certificate_info

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


def certificate_answer(
    result: asyncssh.SSHCompletedProcess,
    *,
    key: asyncssh.SSHKey,
    node: str,
    error: type[AgentError],
    gateway: str = "the gateway",
    refused: str = "refused",
) -> tuple[SSHOpenSSHCertificate, CertInfo]:
    """The certificate in the gateway's answer to an enroll or renew subsystem (the
    contract in :mod:`gpurelay.enrollment`), and its validity.

    Raises ``error`` when the gateway refused (``"{gateway} {refused}: <its reason>"``),
    answered something that is no OpenSSH certificate, or one for another key than ``key``
    or other principals than ``node`` alone."""
    if result.exit_status != EXIT_OK:
        said = refusal_said(result.stderr, result.exit_status)
        raise error(f"{gateway} {refused}: {said}")
    try:
        cert = openssh_certificate(asyncssh.import_certificate(str(result.stdout).strip()))
        validity = certificate_info(cert)
    except (asyncssh.KeyImportError, ValueError, struct.error) as exc:
        raise error(f"{gateway} answered no certificate: {exc}") from exc
    if cert.key.public_data != key.public_data:
        raise error("the gateway's certificate is for another key than this node's")
    if list(cert.principals) != [node]:
        raise error(f"the gateway's certificate names {list(cert.principals)}, not node {node}")
    return cert, validity


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
