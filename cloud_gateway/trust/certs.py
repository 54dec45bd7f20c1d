"""The fleet PKI: two CAs, node and gateway certificates, revocation. No subprocess.

A CA directory (made by :func:`init_ca`, mode 0700) holds::

    user_ca, user_ca.pub    signs agents' user certificates; the gateway trusts user_ca.pub
    host_ca, host_ca.pub    signs gateways' host certificates
    known_hosts             for agents: "@cert-authority * <host_ca.pub>"
    revocations             the revocation list (format: cloud_gateway.trust.revocation)
    serial                  the last serial number issued (one counter for both CAs)
    issued.log              one JSON line per certificate issued (serial, name, validity, key)
    nodes/                  default output of issue_node: <node>, <node>.pub, <node>-cert.pub
    gateways/               default output of issue_gateway: <host>, <host>.pub, ...

Private keys are created with ``os.open(..., 0o600)`` and never overwritten: issuing again
for a name whose key exists renews the certificate for that key, and a lone ``<node>.pub``
(a key made on the node, so the private half never travels) is signed as it is. Functions
return paths and facts; none prints, and nothing secret is ever in what they return.
"""

from __future__ import annotations

import fcntl
import getpass
import json
import os
import re
import socket
import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import asyncssh
from asyncssh.public_key import SSHOpenSSHCertificate

from cloud_gateway.errors import CaExistsError, CaNotFoundError, CertError, InvalidInput
from cloud_gateway.names import node_name_problem
from cloud_gateway.trust.auth_policy import format_time, is_node_name, validate_node_name
from cloud_gateway.trust.revocation import RevocationList, Rule, normalize_fingerprint
from gpurelay.files import write_atomic
from gpurelay.ssh_cert import certificate_info

if TYPE_CHECKING:
    from collections.abc import Iterator

BACKDATE_SECONDS = 300  # tolerate clocks a little behind ours, like `ssh-keygen -V -5m:`
DAY = 86400
REVOCATIONS_HEADER = """\
# edge-gpu-relay revocation list; the gateway re-reads it on change (no restart needed).
# One rule a line:  node <name> | key SHA256:<fingerprint> | serial <n> | keyid <id>
# Add rules with `cloud-gateway certs revoke NODE|KEYFILE --ca-dir DIR`.
"""

_HOST_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.:-]*[A-Za-z0-9])?")


@dataclass(frozen=True)
class CaPaths:
    """Where the files of a CA directory are (whether they exist yet or not)."""

    dir: Path

    @property
    def user_ca(self) -> Path:
        return self.dir / "user_ca"

    @property
    def user_ca_pub(self) -> Path:
        return self.dir / "user_ca.pub"

    @property
    def host_ca(self) -> Path:
        return self.dir / "host_ca"

    @property
    def host_ca_pub(self) -> Path:
        return self.dir / "host_ca.pub"

    @property
    def known_hosts(self) -> Path:
        return self.dir / "known_hosts"

    @property
    def revocations(self) -> Path:
        return self.dir / "revocations"

    @property
    def serial(self) -> Path:
        return self.dir / "serial"

    @property
    def issued_log(self) -> Path:
        return self.dir / "issued.log"

    @property
    def ca_keys(self) -> tuple[Path, Path, Path, Path]:
        return (self.user_ca, self.user_ca_pub, self.host_ca, self.host_ca_pub)


@dataclass(frozen=True, kw_only=True)
class Credentials:
    """A key pair and the certificate just issued for it."""

    name: str
    private_key: Path | None  # None when only a public key was given to sign
    public_key: Path
    certificate: Path
    new_key: bool
    key_fingerprint: str
    key_id: str
    principals: tuple[str, ...]
    serial: int
    valid_after: datetime
    expires: datetime


NodeCredentials = Credentials
GatewayCredentials = Credentials


@dataclass(frozen=True, kw_only=True)
class Revocation:
    """What :func:`revoke` did: ``added`` is False when the rule was already in force."""

    file: Path
    rule: Rule
    added: bool
    source: str


# -- the CA --------------------------------------------------------------------------------


def init_ca(dir: Path) -> CaPaths:
    """Create both CAs in ``dir`` (made mode 0700); refuse if any CA key file exists."""
    paths = CaPaths(dir)
    existing = [p.name for p in paths.ca_keys if p.exists() or p.is_symlink()]
    if existing:
        raise CaExistsError(
            f"{dir} already holds CA keys ({', '.join(existing)}); refusing to overwrite "
            "them (that would orphan every certificate they signed); choose another --dir"
        )
    dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    dir.chmod(0o700)  # mkdir's mode passes through the umask, and dir may have existed
    for key_path, pub_path, role in (
        (paths.user_ca, paths.user_ca_pub, "user CA"),
        (paths.host_ca, paths.host_ca_pub, "host CA"),
    ):
        key = asyncssh.generate_private_key("ssh-ed25519", comment=f"edge-gpu-relay {role}")
        _write_new(key_path, key.export_private_key(), 0o600)
        _write_new(pub_path, key.export_public_key(), 0o644)
    host_ca_line = paths.host_ca_pub.read_text(encoding="ascii").strip()
    write_atomic(paths.known_hosts, f"@cert-authority * {host_ca_line}\n".encode(), 0o644)
    if not paths.revocations.exists():
        _write_new(paths.revocations, REVOCATIONS_HEADER.encode(), 0o644)
    return paths


def _load_ca(path: Path) -> asyncssh.SSHKey:
    try:
        return asyncssh.read_private_key(path)
    except FileNotFoundError as exc:
        raise CaNotFoundError(
            f"no CA key at {path}; create one with `cloud-gateway certs init-ca --dir "
            f"{path.parent}`"
        ) from exc
    except OSError as exc:
        raise CertError(f"CA key {path} cannot be read: {exc.strerror}") from exc
    except (asyncssh.KeyImportError, ValueError) as exc:
        hint = ""
        if "passphrase" in str(exc).lower():
            hint = " (this tool needs an unencrypted CA key; sign with `ssh-keygen -s` instead)"
        raise CertError(f"CA key {path} cannot be used: {exc}{hint}") from exc


@contextmanager
def _locked(dir: Path) -> Iterator[None]:
    """Serialise issuers of one CA directory (an flock on the directory itself)."""
    fd = os.open(dir, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _next_serial(paths: CaPaths) -> int:
    """Bump the counter in ``serial`` (call with the directory locked); never reuses one."""
    try:
        text = paths.serial.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        text = "0"
    if not text.isdigit():
        raise CertError(f"serial counter {paths.serial} holds {text[:20]!r}, not a number")
    serial = int(text) + 1
    write_atomic(paths.serial, f"{serial}\n".encode(), 0o644)
    return serial


# -- issuing -------------------------------------------------------------------------------


def issue_node(
    ca_dir: Path,
    node: str,
    *,
    out_dir: Path | None = None,
    days: int = 90,
    now: float | None = None,
) -> NodeCredentials:
    """A user certificate for ``node``: principal [node], key id ``node:<node>``."""
    validate_node_name(node)
    paths = CaPaths(ca_dir)
    return _issue(
        paths,
        name=node,
        out_dir=ca_dir / "nodes" if out_dir is None else out_dir,
        key_id=f"node:{node}",
        principals=(node,),
        days=days,
        now=now,
        host=False,
    )


def issue_gateway(
    ca_dir: Path,
    host: str,
    *,
    extra_names: Sequence[str] = (),
    out_dir: Path | None = None,
    days: int = 365,
    now: float | None = None,
) -> GatewayCredentials:
    """A host certificate for the gateway ``host`` (and ``extra_names``, e.g. an IP)."""
    names = (host, *extra_names)
    for name in names:
        _validate_host_name(name)
    return _issue(
        CaPaths(ca_dir),
        name=host,
        out_dir=ca_dir / "gateways" if out_dir is None else out_dir,
        key_id=f"gateway:{host}",
        principals=tuple(dict.fromkeys(names)),
        days=days,
        now=now,
        host=True,
    )


def _validate_host_name(name: str) -> None:
    if not (_HOST_NAME.fullmatch(name) and len(name) <= 253):
        raise InvalidInput(
            f"gateway name {name!r} is not a host name or IP address (letters, digits, "
            "'.', '-' and ':' only; agents compare it exactly, so no wildcards)"
        )


def _issue(
    paths: CaPaths,
    *,
    name: str,
    out_dir: Path,
    key_id: str,
    principals: tuple[str, ...],
    days: int,
    now: float | None,
    host: bool,
) -> Credentials:
    if days < 1:
        raise InvalidInput(f"validity must be at least 1 day (--days), got {days}")
    ca = _load_ca(paths.host_ca if host else paths.user_ca)
    out_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # an existing one is left as is
    private_path, public_path = out_dir / name, out_dir / f"{name}.pub"
    key, new_key = _subject_key(private_path, public_path, comment=key_id)
    start = int(time.time() if now is None else now)
    valid_after, valid_before = start - BACKDATE_SECONDS, start + days * DAY
    with _locked(paths.dir):
        serial = _next_serial(paths)
        cert = _certify(
            ca, key, key_id=key_id, principals=principals, serial=serial,
            validity=(valid_after, valid_before), host=host,
        )  # fmt: skip
        log_issued(paths, cert, reason="issue-gateway" if host else "issue-node")
    cert_path = out_dir / f"{name}-cert.pub"
    write_atomic(cert_path, cert.export_certificate(), 0o644)
    return Credentials(
        name=name,
        private_key=private_path if private_path.exists() else None,
        public_key=public_path,
        certificate=cert_path,
        new_key=new_key,
        key_fingerprint=key.get_fingerprint("sha256"),
        key_id=key_id,
        principals=principals,
        serial=serial,
        valid_after=datetime.fromtimestamp(valid_after, UTC),
        expires=datetime.fromtimestamp(valid_before, UTC),
    )


def _certify(
    ca: asyncssh.SSHKey,
    key: asyncssh.SSHKey,
    *,
    key_id: str,
    principals: tuple[str, ...],
    serial: int,
    validity: tuple[int, int],
    host: bool,
) -> SSHOpenSSHCertificate:
    """The certificate, in memory: every issuer (CLI, gateway, signer) signs through this."""
    if host:
        return ca.generate_host_certificate(
            key, key_id, serial=serial, principals=list(principals),
            valid_after=validity[0], valid_before=validity[1], comment=key_id,
        )  # fmt: skip
    # an agent needs remote forwards and nothing else (no pty, X11, agent forwarding, rc)
    return ca.generate_user_certificate(
        key, key_id, serial=serial, principals=list(principals),
        valid_after=validity[0], valid_before=validity[1], permit_x11_forwarding=False,
        permit_agent_forwarding=False, permit_port_forwarding=True, permit_pty=False,
        permit_user_rc=False, comment=key_id,
    )  # fmt: skip


def log_issued(paths: CaPaths, cert: SSHOpenSSHCertificate, *, reason: str) -> dict[str, Any]:
    """Append one JSON line about ``cert`` to ``issued.log`` (call with the directory locked,
    so the lines are in serial order); the record written."""
    info = certificate_info(cert)
    record: dict[str, Any] = {
        "time": format_time(time.time()), "serial": info.serial, "key_id": info.key_id,
        "principals": list(info.principals), "valid_after": format_time(info.valid_after),
        "valid_before": format_time(info.valid_before), "key": info.key_fingerprint,
        "reason": reason,
    }  # fmt: skip
    line = json.dumps(record, separators=(",", ":")) + "\n"
    fd = os.open(paths.issued_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())  # one write of one line: no torn record
        os.fsync(fd)
    finally:
        os.close(fd)
    return record


def _subject_key(private: Path, public: Path, *, comment: str) -> tuple[asyncssh.SSHKey, bool]:
    """The public key to certify: from an existing key file, else a new ed25519 pair."""
    if private.exists():
        key = _read_public(private)  # OpenSSH private key files carry the public key in clear
        if public.exists() and _read_public(public).public_data != key.public_data:
            raise CertError(f"{public} is not the public half of {private}; remove one of them")
        if not public.exists():
            _write_new(public, key.export_public_key(), 0o644)
        return key, False
    if public.exists():
        return _read_public(public), False
    new = asyncssh.generate_private_key("ssh-ed25519", comment=comment)
    _write_new(private, new.export_private_key(), 0o600)
    _write_new(public, new.export_public_key(), 0o644)
    return new.convert_to_public(), True


def _read_public(path: Path) -> asyncssh.SSHKey:
    try:
        return asyncssh.read_public_key(path)
    except OSError as exc:
        raise CertError(f"{path} cannot be read: {exc.strerror}") from exc
    except (asyncssh.KeyImportError, ValueError) as exc:
        raise CertError(f"{path} is not an OpenSSH key: {exc}") from exc


# -- revoking ------------------------------------------------------------------------------


def revoke(
    ca_dir_or_revocation_file: Path,
    target: str | Path,
    *,
    now: float | None = None,
    who: str | None = None,
) -> Revocation:
    """Add a rule for ``target`` to the revocation list; nothing happens if it is there.

    ``target`` is a node name (a DNS-1123 label, so it never contains '.' or '/'), a
    ``SHA256:`` key fingerprint, or a path to a public key, certificate or private key file,
    which revokes that key (every certificate issued for it). A :class:`Path` is always a
    file; write ``./edge-7`` on the command line to mean the private key file ``edge-7``.
    """
    file = ca_dir_or_revocation_file
    if file.is_dir():
        file = CaPaths(file).revocations
    rule, source = _rule_for(target)
    stamp = format_time(time.time() if now is None else now)
    comment = _one_line(f"# revoked {stamp} by {who or _operator()}: {source}")
    fd = os.open(file, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    with os.fdopen(fd, "rb+") as handle:  # O_APPEND: every write goes to the end
        fcntl.flock(handle, fcntl.LOCK_EX)
        existing = handle.read().decode("utf-8", errors="replace")
        if rule in RevocationList.parse(existing, source=str(file)):
            return Revocation(file=file, rule=rule, added=False, source=source)
        separator = "" if not existing or existing.endswith("\n") else "\n"
        handle.write(f"{separator}{comment}\n{rule}\n".encode())  # one write: no torn rule
        handle.flush()
        os.fsync(handle.fileno())
    return Revocation(file=file, rule=rule, added=True, source=source)


def _rule_for(target: str | Path) -> tuple[Rule, str]:
    if isinstance(target, str) and is_node_name(target):
        return Rule("node", target), f"node {target}"
    if isinstance(target, str) and target.startswith("SHA256:"):
        try:
            fingerprint = normalize_fingerprint(target)
        except ValueError as exc:
            raise InvalidInput(str(exc)) from None
        return Rule("key", fingerprint), f"key {fingerprint}"
    path = Path(target)
    if not path.is_file():
        hint = ""
        if isinstance(target, str) and "/" not in target:
            hint = f", and {target!r} is not a node name: {node_name_problem(target)}"
        raise InvalidInput(f"no key or certificate file {str(target)!r}{hint}")
    return _rule_for_file(path)


def _rule_for_file(path: Path) -> tuple[Rule, str]:
    try:
        cert = asyncssh.read_certificate(path)
    except (asyncssh.KeyImportError, ValueError, OSError):
        pass
    else:
        if not isinstance(cert, SSHOpenSSHCertificate):
            raise InvalidInput(f"{path} is an X.509 certificate; give the agent's OpenSSH key")
        fingerprint = cert.key.get_fingerprint("sha256")
        return Rule("key", fingerprint), f"key {fingerprint} of certificate {path}"
    try:
        key = asyncssh.read_public_key(path)
    except (asyncssh.KeyImportError, ValueError, OSError):
        try:
            key = asyncssh.read_private_key(path)
        except (asyncssh.KeyImportError, ValueError, OSError) as exc:
            raise InvalidInput(
                f"{path} is not an OpenSSH public key, certificate or private key ({exc})"
            ) from None
    fingerprint = key.get_fingerprint("sha256")
    return Rule("key", fingerprint), f"key {fingerprint} of {path}"


def _operator() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no login name in some containers
        user = f"uid {os.getuid()}"
    return f"{user}@{socket.gethostname()}"


def _one_line(text: str) -> str:
    return "".join(c if c.isprintable() else "?" for c in text)


# -- files ---------------------------------------------------------------------------------


def _write_new(path: Path, data: bytes, mode: int) -> None:
    """Create ``path`` with ``mode`` from the first byte on; fail if it exists."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError as exc:
        raise CertError(f"{path} already exists; refusing to overwrite it") from exc
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException:
        path.unlink(missing_ok=True)
        raise
