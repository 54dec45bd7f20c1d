"""``edge-agent enroll``: get this node's first certificate with a one-time token.

The key is made here (or the configured one reused): the private key never leaves the box.
The agent logs in to the gateway's SSH port as ``enroll:NODE`` with the token as its
password, opens the ``gpurelay-enroll`` subsystem, writes its public key line and reads
back the certificate the gateway signed with the fleet user CA (issue 17 §1, the contract
in :mod:`gpurelay.enrollment`).

The gateway is trusted through the agent's known_hosts file when it has one; otherwise
only through ``--host-ca-fingerprint``, the host CA fingerprint ``cloud-gateway certs
enroll-token`` printed: a host certificate signed by a CA of exactly that fingerprint is
accepted (:class:`_PinnedHostCa`), and that CA is then written to known_hosts as an
``@cert-authority`` line for every later connection. Without either the agent refuses:
a token sent to an unverified host could be taken by whoever answers.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import asyncssh
from asyncssh.public_key import SSHOpenSSHCertificate

from edge_agent.config import TunnelConfig, gateway_host_port
from edge_agent.credentials import certificate_answer, expiry_text
from edge_agent.dial import PathSilent
from edge_agent.errors import AgentError, ConfigError
from edge_agent.proxy_connect import ProxyError, proxy_route
from gpurelay import compat
from gpurelay.compat import TIMEOUTS
from gpurelay.enrollment import ENROLL_SUBSYSTEM, TokenError, enroll_username, parse_token
from gpurelay.files import write_atomic
from gpurelay.settings import SettingsError
from gpurelay.ssh_cert import CertInfo

_FINGERPRINT = re.compile(r"SHA256:[A-Za-z0-9+/]{43}")
ENROLL_TIMEOUT_SECONDS = 30.0
# Where install-edge-agent.sh --enroll-token puts them (the key and certificate in the
# unit's StateDirectory, writable for renewals); used when the config names none.
DEFAULT_CONFIG = Path("/etc/edge-gpu-relay/agent.toml")
DEFAULT_KEY = Path("/var/lib/edge-gpu-relay/node.key")
DEFAULT_KNOWN_HOSTS = Path("/etc/edge-gpu-relay/known_hosts")


class EnrollRefused(AgentError):
    """The gateway (or the path to it) did not give this node a certificate."""


def node_key(path: Path) -> tuple[asyncssh.SSHKey, bool]:
    """The node's private key at ``path``, made (ed25519, mode 0600) when there is none;
    True when it was made now."""
    if path.exists():
        try:
            return asyncssh.read_private_key(str(path)), False
        except (OSError, asyncssh.KeyImportError) as exc:
            raise ConfigError(f"node key {path} cannot be used: {exc}") from exc
    key = asyncssh.generate_private_key("ssh-ed25519")
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_atomic(path, key.export_private_key(), 0o600)
    except OSError as exc:
        raise AgentError(f"cannot write the new node key {path}: {exc.strerror or exc}") from exc
    return key, True


# -- the gateway's host CA ---------------------------------------------------------------------


def check_fingerprint(text: str) -> str:
    text = text.strip()
    if not _FINGERPRINT.fullmatch(text):
        raise ConfigError(
            f"--host-ca-fingerprint {text[:80]!r} is not a fingerprint like SHA256:<43 base64 "
            "characters> (the one `cloud-gateway certs enroll-token` printed)"
        )
    return text


class _PinnedHostCa(asyncssh.SSHClient):
    """Trusts a gateway host certificate only when signed by the CA of ``fingerprint``;
    remembers that CA key (for known_hosts) and what else it was shown (for the error)."""

    def __init__(self, fingerprint: str) -> None:
        self.fingerprint = fingerprint
        self.ca_key: asyncssh.SSHKey | None = None
        self.seen: list[str] = []

    def validate_host_ca_key(self, host: str, addr: str, port: int, key: asyncssh.SSHKey) -> bool:
        fingerprint = key.get_fingerprint("sha256")
        if fingerprint == self.fingerprint:
            self.ca_key = key
            return True
        self.seen.append(fingerprint)
        return False


# -- enrolling ---------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Enrolled:
    node: str
    key: Path
    new_key: bool
    certificate: Path
    serial: int
    valid_before: int
    known_hosts: Path
    wrote_known_hosts: bool
    ca_fingerprint: str
    unconfigured: tuple[str, ...] = ()  # [gateway] lines the config lacks

    def report(self) -> str:
        lines = [
            f"enrolled node {self.node}: certificate serial {self.serial}, valid until "
            f"{expiry_text(self.valid_before)}",
            f"wrote      {self.certificate} (certificate, mode 0644)",
            f"{'wrote ' if self.new_key else 'kept  '}     {self.key} (private key, mode 0600"
            f"{', made here' if self.new_key else ', already there'})",
        ]
        if self.wrote_known_hosts:
            lines.append(
                f"wrote      {self.known_hosts} (@cert-authority {self.ca_fingerprint}, the "
                "gateways' host CA)"
            )
        else:
            lines.append(f"kept       {self.known_hosts} (already there, used as is)")
        if self.unconfigured:
            lines.append("the agent's config must say where they are; under [gateway]:")
            lines.extend(f"  {line}" for line in self.unconfigured)
        return "\n".join(lines)


def read_token(path: Path, node: str, now: float) -> str:
    """The token text from ``path``, checked for shape, node and expiry before anything is
    sent (the gateway checks again, and the signature and single use)."""
    try:
        text = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        raise ConfigError(f"--token-file {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--token-file {path} cannot be read: {exc}") from exc
    try:
        token = parse_token(text)
    except TokenError as exc:
        raise ConfigError(f"--token-file {path} holds no enrollment token: {exc}") from exc
    if token.node != node:
        raise ConfigError(
            f"the token in {path} is for node {token.node!r}, not this node {node!r}: make one "
            f"for {node} (cloud-gateway certs enroll-token {node}), or set node_name"
        )
    if token.exp <= now:
        raise ConfigError(
            f"the token in {path} expired at {expiry_text(token.exp)}: make a new one "
            f"(cloud-gateway certs enroll-token {node})"
        )
    return text


def gateway_address(cfg: TunnelConfig, given: str | None) -> tuple[str, int]:
    try:
        if given:
            return gateway_host_port(given, "--gateway")
    except SettingsError as exc:
        raise ConfigError(str(exc)) from exc
    if cfg.gateways:
        return cfg.gateways[0]
    raise ConfigError("no gateway to enroll with: pass --gateway HOST:PORT")


async def enroll(
    cfg: TunnelConfig,
    *,
    node: str,
    gateway: tuple[str, int],
    token_file: Path,
    fingerprint: str | None,
    timeout: float = ENROLL_TIMEOUT_SECONDS,
    defaults: tuple[Path, Path] = (DEFAULT_KEY, DEFAULT_KNOWN_HOSTS),
) -> Enrolled:
    """Enroll ``node`` with the gateway; write the key (if new), certificate and known_hosts
    (if absent) where ``cfg`` says, else at ``defaults`` (the installer's places). Raises
    ConfigError for bad input, EnrollRefused when no certificate came."""
    unconfigured = []
    if cfg.key is None:
        cfg = dataclasses.replace(cfg, key=defaults[0], certificate=None)
        unconfigured.append(f'key = "{defaults[0]}"')
    if cfg.known_hosts is None:
        cfg = dataclasses.replace(cfg, known_hosts=defaults[1])
        unconfigured.append(f'known_hosts = "{defaults[1]}"')
    assert cfg.key is not None and cfg.known_hosts is not None
    cert_path = cfg.certificate_path
    assert cert_path is not None
    token = read_token(token_file, node, time.time())
    if fingerprint is not None:
        fingerprint = check_fingerprint(fingerprint)
    have_known_hosts = cfg.known_hosts.exists()
    if not have_known_hosts and fingerprint is None:
        raise ConfigError(
            f"{cfg.known_hosts} does not exist, so the gateway cannot be verified: pass "
            "--host-ca-fingerprint SHA256:... as printed by `cloud-gateway certs enroll-token`"
        )
    key, new_key = node_key(cfg.key)
    pinned = _PinnedHostCa(fingerprint or "")
    host, port = gateway
    certificate, validity = await _request(
        host,
        port,
        node=node,
        token=token,
        key=key,
        cfg=cfg,
        pinned=pinned,
        have_known_hosts=have_known_hosts,
        timeout=timeout,
    )
    try:
        cert_path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        write_atomic(cert_path, certificate.export_certificate(), 0o644)
    except OSError as exc:
        raise AgentError(
            f"the gateway signed a certificate, but {cert_path} cannot be written: "
            f"{exc.strerror or exc}"
        ) from exc
    wrote = False
    ca_fingerprint = fingerprint or certificate.signing_key.get_fingerprint("sha256")
    if not have_known_hosts and pinned.ca_key is not None:
        line = b"@cert-authority * " + pinned.ca_key.export_public_key().strip() + b"\n"
        cfg.known_hosts.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        write_atomic(cfg.known_hosts, line, 0o644)
        wrote = True
    return Enrolled(
        node=node,
        key=cfg.key,
        new_key=new_key,
        certificate=cert_path,
        serial=validity.serial,
        valid_before=validity.valid_before,
        known_hosts=cfg.known_hosts,
        wrote_known_hosts=wrote,
        unconfigured=tuple(unconfigured),
        ca_fingerprint=(
            pinned.ca_key.get_fingerprint("sha256") if pinned.ca_key else ca_fingerprint
        ),
    )


async def _through_proxy(
    cfg: TunnelConfig, host: str, port: int, timeout: float
) -> socket.socket | None:
    """A socket through ``[gateway] proxy``'s CONNECT tunnel, as the tunnel dials; None
    where no proxy applies to this gateway (asyncssh connects itself)."""
    route = proxy_route(cfg.proxy, os.environ)
    if route.proxy_for(host, port) is None:
        return None
    return await route.open(
        host, port, dial_timeout=cfg.dial_timeout_seconds, answer_timeout=timeout
    )


async def _request(
    host: str,
    port: int,
    *,
    node: str,
    token: str,
    key: asyncssh.SSHKey,
    cfg: TunnelConfig,
    pinned: _PinnedHostCa,
    have_known_hosts: bool,
    timeout: float,
) -> tuple[SSHOpenSSHCertificate, CertInfo]:
    """The certificate the gateway signed for ``key`` and ``node``, and its validity."""
    # With no known_hosts file: an empty trust set, so that only the pinned CA's callback
    # can accept the gateway (known_hosts=None would accept anyone; b"" would fall back to
    # ~/.ssh/known_hosts).
    known: asyncssh.SSHKnownHosts | str = (
        str(cfg.known_hosts) if have_known_hosts else asyncssh.import_known_hosts("")
    )
    where = f"{host}:{port}"
    try:
        async with compat.timeout(timeout):
            sock = await _through_proxy(cfg, host, port, timeout)
            async with asyncssh.connect(
                host,
                port,
                sock=sock,
                client_factory=lambda: pinned,
                username=enroll_username(node),
                password=token,
                preferred_auth=["password"],
                client_keys=None,
                known_hosts=known,
                agent_path=None,
                config=None,
                encryption_algs=list(cfg.ciphers),
            ) as conn:
                public = key.export_public_key("openssh").decode("ascii")
                result = await conn.run(
                    subsystem=ENROLL_SUBSYSTEM, input=public, check=False, encoding="utf-8"
                )
    except asyncssh.PermissionDenied as exc:
        raise EnrollRefused(
            f"the gateway {where} refused the token for node {node}: it was already used, or "
            "the node is revoked, or the token was not made by this fleet's CA, or enrollment "
            "is off on that gateway ([enroll] enabled); the gateway's log says which. Make a "
            f"new token with `cloud-gateway certs enroll-token {node}`"
        ) from exc
    except asyncssh.HostKeyNotVerifiable as exc:
        raise EnrollRefused(_host_untrusted(where, cfg, pinned, have_known_hosts, exc)) from exc
    except asyncssh.KeyExchangeFailed as exc:
        raise EnrollRefused(
            _host_untrusted(where, cfg, pinned, have_known_hosts, exc)
            if "host key" in exc.reason
            else f"cannot agree on SSH algorithms with {where}: {exc.reason}"
        ) from exc
    except TIMEOUTS:
        raise EnrollRefused(f"no answer from the gateway {where} within {timeout:g}s") from None
    except (ProxyError, PathSilent) as exc:
        raise EnrollRefused(f"cannot reach the gateway {where}: {exc}") from exc
    except (OSError, asyncssh.Error) as exc:
        raise EnrollRefused(f"cannot reach the gateway {where}: {exc}") from exc
    return certificate_answer(
        result,
        key=key,
        node=node,
        error=EnrollRefused,
        gateway=f"the gateway {where}",
        refused=f"refused to enroll node {node}",
    )


def _host_untrusted(
    where: str, cfg: TunnelConfig, pinned: _PinnedHostCa, have_known_hosts: bool, exc: Exception
) -> str:
    if have_known_hosts:
        return (
            f"the gateway {where} is not trusted by {cfg.known_hosts} ({exc}); the token was "
            "not sent"
        )
    shown = f" (its host certificate is signed by {', '.join(pinned.seen)})" if pinned.seen else ""
    return (
        f"the gateway {where} did not show a host certificate signed by the host CA "
        f"{pinned.fingerprint}{shown}; the token was not sent. Check --host-ca-fingerprint "
        "against the one `cloud-gateway certs enroll-token` printed"
    )
