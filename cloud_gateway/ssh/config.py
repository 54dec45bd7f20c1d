"""``[ssh]``: the SSH port's section, owned here, assembled by :mod:`cloud_gateway.config`."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from cloud_gateway.errors import GatewayConfigError
from cloud_gateway.names import node_name_problem

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
# ssh.duplicate_connection (cloud_gateway.ssh.conflicts)
POLICIES: Final = ("newest", "oldest", "refuse_both")


@dataclass(frozen=True, kw_only=True)
class SshConfig:
    listen: str = "0.0.0.0:2222"
    host_key: Path = Path("/etc/edge-gpu-relay/gateway/host_key")
    host_certificate: Path | None = None  # default: <host_key>-cert.pub when it exists
    user_ca: Path = Path("/etc/edge-gpu-relay/gateway/user_ca.pub")  # trusted CA key(s)
    revocation_file: Path | None = None  # reloaded on change, no restart needed
    login_timeout_seconds: float = 30.0
    # A frame must arrive whole within this many seconds of its first byte (a 4 MiB frame
    # at 1 Mbit/s takes 34 s; an agent's frames are a few kB): a node cannot park a
    # partial frame, and the memory it holds, on the gateway.
    frame_timeout_seconds: float = 60.0
    max_channels_per_connection: int = 1  # the agent opens one telemetry channel
    # SSH keepalives: the backstop that closes a connection whose peer went silent, after
    # keepalive_seconds x keepalive_count_max without an answer (was 30 s x 3, fixed).
    keepalive_seconds: float = 30.0
    keepalive_count_max: int = 3
    # A node connecting while it is connected: "newest" wins, "oldest" wins, or (when two
    # clients fight over one certificate) "refuse_both"; see cloud_gateway/ssh/conflicts.py.
    duplicate_connection: str = "newest"
    # Which node may publish which sibling machines of its edge LAN under their own names:
    # "NODE=PATTERN[,PATTERN...]" (shell-style), e.g. "edge-gw-1=cam-*". None by default.
    siblings: tuple[str, ...] = ()
    max_endpoints_per_node: int = 64
    max_frame_bytes: int = 4 * 1024 * 1024
    max_series_per_node: int = 50_000
    # Behind a TCP balancer (haproxy send-proxy-v2): every connection starts with a PROXY
    # protocol header (v1 or v2) naming the client, which then stands for the peer in
    # logs, the API and per-address checks (cloud_gateway.ssh.balancer_listener). Only from these
    # CIDRs (empty: from any address, warned at start); a connection from elsewhere, or
    # without a whole header within the timeout, is closed. Off: exactly as before.
    proxy_protocol: bool = False
    proxy_protocol_from: tuple[str, ...] = ()
    proxy_protocol_timeout_seconds: float = 5.0

    @property
    def host_certificate_path(self) -> Path | None:
        if self.host_certificate is not None:
            return self.host_certificate
        candidate = self.host_key.with_name(self.host_key.name + "-cert.pub")
        return candidate if candidate.exists() else None


def check_ssh(ssh: SshConfig) -> None:
    if not ssh.frame_timeout_seconds > 0:
        raise GatewayConfigError("ssh.frame_timeout_seconds must be > 0")
    if ssh.max_channels_per_connection < 1:
        raise GatewayConfigError("ssh.max_channels_per_connection must be >= 1")
    if not ssh.keepalive_seconds > 0 or ssh.keepalive_count_max < 1:
        raise GatewayConfigError("ssh.keepalive_seconds must be > 0, keepalive_count_max >= 1")
    if ssh.max_endpoints_per_node < 1:
        raise GatewayConfigError("ssh.max_endpoints_per_node must be >= 1")
    try:
        parse_sibling_rules(ssh.siblings)
    except ValueError as exc:
        raise GatewayConfigError(f"ssh.siblings: {exc}") from exc
    try:
        parse_networks(ssh.proxy_protocol_from)
    except ValueError as exc:
        raise GatewayConfigError(f"ssh.proxy_protocol_from: {exc}") from exc
    if not ssh.proxy_protocol_timeout_seconds > 0:
        raise GatewayConfigError("ssh.proxy_protocol_timeout_seconds must be > 0")
    if ssh.duplicate_connection not in POLICIES:
        raise GatewayConfigError(
            f"ssh.duplicate_connection must be one of {', '.join(POLICIES)}, "
            f"not {ssh.duplicate_connection!r}"
        )


def parse_sibling_rules(rules: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """``["edge-gw-1=cam-*,plc-2", ...]`` as ``{node: patterns}``; ValueError naming a bad rule."""
    out: dict[str, tuple[str, ...]] = {}
    for rule in rules:
        node, sep, patterns = rule.partition("=")
        names = tuple(p.strip() for p in patterns.split(",") if p.strip())
        if not sep or node_name_problem(node.strip()) is not None or not names:
            raise ValueError(f"sibling rule {rule!r} is not NODE=PATTERN[,PATTERN...]")
        out[node.strip()] = out.get(node.strip(), ()) + names
    return out


def parse_networks(entries: Sequence[str]) -> tuple[Network, ...]:
    """``ssh.proxy_protocol_from``: CIDRs or single addresses (ValueError naming the bad one)."""
    networks = []
    for entry in entries:
        try:
            networks.append(ipaddress.ip_network(entry.strip(), strict=True))
        except ValueError as exc:
            raise ValueError(f"{entry!r} is not an address or network: {exc}") from None
    return tuple(networks)
