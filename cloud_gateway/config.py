"""Gateway configuration: frozen dataclasses from TOML, overridable by CLOUD_GATEWAY_*.

``[ssh] listen`` -> ``CLOUD_GATEWAY_SSH_LISTEN``, ``[http] tokens`` ->
``CLOUD_GATEWAY_HTTP_TOKENS`` (comma-separated), ``[remote_write] url`` ->
``CLOUD_GATEWAY_REMOTE_WRITE_URL``, and so on. Unknown keys are errors.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from cloud_gateway.cluster.config import ClusterSection, check_cluster
from cloud_gateway.errors import GatewayConfigError
from cloud_gateway.registry.liveness import LivenessPolicy
from cloud_gateway.relay.endpoints import parse_sibling_rules
from cloud_gateway.remote_write.client import RemoteWriteConfig
from cloud_gateway.ssh.balancer_listener import parse_networks
from cloud_gateway.ssh.conflicts import POLICIES
from cloud_gateway.ssh.enrollment import EnrollSection, check_enroll
from gpurelay.logs import FORMATS as LOG_FORMATS
from gpurelay.model import NODE_LABEL_NAMES
from gpurelay.settings import SettingsError, load_settings, split_host_port
from gpurelay.web_config import WebConfig, WebConfigError, load_web_config

ENV_PREFIX = "CLOUD_GATEWAY_"
_RESERVED = frozenset({"CLOUD_GATEWAY_CONFIG", "CLOUD_GATEWAY_URL", "CLOUD_GATEWAY_TOKEN"})


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


# What http.proxy_methods may list (CONNECT is never proxied: only plain http:// is).
PROXY_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


@dataclass(frozen=True, kw_only=True)
class HttpConfig:
    listen: str = "0.0.0.0:9410"
    tokens: tuple[str, ...] = ()  # bearer tokens accepted on /api/*
    token_files: tuple[Path, ...] = ()  # files holding one token each (e.g. operator.token)
    protect_metrics: bool = False  # require a token on /metrics and /v1/collect too
    # The proxy (forward proxy and /proxy/...) and /api/v1/sd: protected by default, with
    # their own tokens if given, else the API tokens (Prometheus sends them as
    # `authorization` in its scrape/SD config, or as the password in proxy_url).
    protect_proxy: bool = True
    proxy_tokens: tuple[str, ...] = ()
    protect_sd: bool = True
    sd_tokens: tuple[str, ...] = ()
    proxy_timeout_seconds: float = 10.0
    # The methods the proxy relays to a node (both forms); any other is a 405. GET and
    # HEAD are all a scrape needs: a browser holding an operator's credentials cannot be
    # made to change anything on a device unless the operator lists POST, PUT... here.
    proxy_methods: tuple[str, ...] = ("GET", "HEAD")
    # The listener (cloud_gateway.listener). At max_connections a new connection
    # closes the oldest idle one (one that never sent a whole request first), so silent
    # sockets cannot keep /metrics and /healthz out; each takes one file descriptor
    # (LimitNOFILE in the systemd unit). A connection must send its first request's
    # headers within header_timeout_seconds; a kept-alive one is closed after
    # idle_timeout_seconds without a new request (above a 60 s scrape interval).
    max_connections: int = 4096
    header_timeout_seconds: float = 10.0
    idle_timeout_seconds: float = 75.0
    # TLS and basic auth: the Prometheus web-config file node_exporter takes as
    # --web.config.file (tls_server_config, basic_auth_users), see gpurelay.web_config.
    # Basic users are let in wherever a token is; what needs one stays protect_*'s call.
    web_config_file: Path | None = None

    def web_config(self) -> WebConfig | None:
        """The parsed file (GatewayConfigError naming http.web_config_file), or None."""
        if self.web_config_file is None:
            return None
        try:
            return load_web_config(self.web_config_file, key="http.web_config_file")
        except WebConfigError as exc:
            raise GatewayConfigError(str(exc)) from exc

    def __post_init__(self) -> None:
        methods = tuple(m.strip().upper() for m in self.proxy_methods)
        unknown = [m for m in methods if m not in PROXY_METHODS]
        if unknown or not methods:
            raise GatewayConfigError(
                f"http.proxy_methods must name one or more of {', '.join(PROXY_METHODS)}, "
                f"not {', '.join(repr(m) for m in unknown) or 'an empty list'}"
            )
        object.__setattr__(self, "proxy_methods", tuple(dict.fromkeys(methods)))
        if self.max_connections < 1:
            raise GatewayConfigError(
                f"http.max_connections must be at least 1, not {self.max_connections}"
            )
        for name in ("header_timeout_seconds", "idle_timeout_seconds"):
            if not getattr(self, name) > 0:
                raise GatewayConfigError(f"http.{name} must be > 0, not {getattr(self, name)}")


@dataclass(frozen=True, kw_only=True)
class RegistrySection:
    """``[registry]``: node liveness. The store's own
    :class:`~cloud_gateway.registry.store.RegistryConfig` is built from it in ``app.py``."""

    # A connected node is stale (late; gpurelay_node_up 0) after this many of its intervals
    # plus the margin without a batch; its connection is closed (offline) after
    # offline_after_intervals plus the margin with nothing received at all. The margin is
    # margin_seconds or twice the lateness the node's own link showed lately, the larger.
    stale_after_intervals: float = 3.0
    offline_after_intervals: float = 6.0
    margin_seconds: float = 2.0
    offline_grace_seconds: float = 300.0
    # The label naming the node on device series and on gpurelay_node_*: "Hostname"
    # (dcgm-exporter up to 4.8) or "hostname" (its next release, PR #655). Stamped from
    # the node's certificate whatever the agent sent; an agent's other spelling is
    # renamed (cloud_gateway.registry.node_labels). Prometheus relabelling: deploy/prometheus.
    node_label: str = "Hostname"

    def liveness(self) -> LivenessPolicy:
        try:
            return LivenessPolicy(
                stale_after_intervals=self.stale_after_intervals,
                offline_after_intervals=self.offline_after_intervals,
                margin_seconds=self.margin_seconds,
            )
        except ValueError as exc:
            raise GatewayConfigError(f"registry: {exc}") from exc


@dataclass(frozen=True, kw_only=True)
class GatewayConfig:
    log_level: str = "info"
    log_format: str = "text"  # or "json": one JSON object per line (gpurelay.logs)
    drain_seconds: float = 5.0
    ssh: SshConfig = field(default_factory=SshConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    registry: RegistrySection = field(default_factory=RegistrySection)
    # Declared with the client that reads it (cloud_gateway.remote_write.client); url = "": off.
    remote_write: RemoteWriteConfig = field(default_factory=RemoteWriteConfig)
    # Where the node inventory lives; several gateways on one PostgreSQL database.
    cluster: ClusterSection = field(default_factory=ClusterSection)
    # Nodes get and renew their certificates over SSH (cloud_gateway.ssh.enrollment); off.
    enroll: EnrollSection = field(default_factory=EnrollSection)

    def api_tokens(self) -> frozenset[str]:
        """Inline tokens plus those read from token files (errors name the file)."""
        tokens = set(self.http.tokens)
        for path in self.http.token_files:
            try:
                token = path.read_text(encoding="utf-8").strip()
            except OSError as exc:
                raise GatewayConfigError(
                    f"token file {path} cannot be read: {exc.strerror}"
                ) from exc
            if not token:
                raise GatewayConfigError(f"token file {path} is empty")
            tokens.add(token)
        return frozenset(tokens)


def load(path: Path | None = None, environ: Mapping[str, str] | None = None) -> GatewayConfig:
    env = os.environ if environ is None else environ
    try:
        cfg = load_settings(GatewayConfig, path, env, prefix=ENV_PREFIX, reserved=_RESERVED)
        split_host_port(cfg.ssh.listen, "ssh.listen")
        split_host_port(cfg.http.listen, "http.listen")
    except SettingsError as exc:
        raise GatewayConfigError(str(exc)) from exc
    if cfg.log_format not in LOG_FORMATS:
        raise GatewayConfigError(f"log_format must be text or json, not {cfg.log_format!r}")
    cfg.http.web_config()  # a bad file is an error at load, not at the first scrape
    cfg.registry.liveness()  # the thresholds make sense together
    if cfg.registry.offline_grace_seconds < 0:
        raise GatewayConfigError("registry.offline_grace_seconds must be >= 0")
    if cfg.registry.node_label not in NODE_LABEL_NAMES:
        raise GatewayConfigError(
            f"registry.node_label must be one of {', '.join(NODE_LABEL_NAMES)}, "
            f"not {cfg.registry.node_label!r}"
        )
    check_ssh(cfg.ssh)
    check_remote_write(cfg.remote_write)
    check_cluster(cfg.cluster)
    check_enroll(cfg.enroll)
    return cfg


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


def check_remote_write(section: RemoteWriteConfig) -> RemoteWriteConfig | None:
    """The writer's config (``None``: off); GatewayConfigError naming what is wrong."""
    try:
        section.validate()
    except ValueError as exc:
        raise GatewayConfigError(f"remote_write: {exc}") from exc
    return section if section.url else None
