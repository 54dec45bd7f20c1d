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

from cloud_gateway.errors import GatewayConfigError
from cloud_gateway.remote_write import RemoteWriteConfig
from gpurelay.settings import SettingsError, load_settings, split_host_port

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
    max_frame_bytes: int = 4 * 1024 * 1024
    max_series_per_node: int = 50_000

    @property
    def host_certificate_path(self) -> Path | None:
        if self.host_certificate is not None:
            return self.host_certificate
        candidate = self.host_key.with_name(self.host_key.name + "-cert.pub")
        return candidate if candidate.exists() else None


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


@dataclass(frozen=True, kw_only=True)
class RegistryConfig:
    stale_after_intervals: float = 3.0
    offline_grace_seconds: float = 300.0


@dataclass(frozen=True, kw_only=True)
class RemoteWriteSection:
    """Forward every node's samples (live and replayed) by Prometheus remote write 1.0;
    see :mod:`cloud_gateway.remote_write` for receivers. ``url = ""``: off."""

    url: str = ""
    bearer_token: str = ""
    bearer_token_file: Path | None = None  # re-read on every request (rotation)
    basic_user: str = ""
    basic_password: str = ""
    tls_ca_file: Path | None = None
    tls_insecure_skip_verify: bool = False
    headers: tuple[str, ...] = ()  # "Name: value", e.g. "X-Scope-OrgID: edge"
    timeout_seconds: float = 30.0
    max_samples_per_send: int = 2000  # per HTTP request
    max_pending_samples: int = 500_000  # in flight across all nodes
    min_backoff_seconds: float = 0.05
    max_backoff_seconds: float = 5.0
    max_retries: int = 10  # then the batch waits (1 s to 30 s) and is tried again
    max_queued_batches_per_node: int = 256  # more waiting: stop reading that node's channel

    def client_config(self) -> RemoteWriteConfig | None:
        """The writer's config; ``None`` when remote write is off. ValueError if invalid."""
        if not self.url:
            return None
        return RemoteWriteConfig(
            url=self.url,
            bearer_token=self.bearer_token,
            bearer_token_file=self.bearer_token_file,
            basic_user=self.basic_user,
            basic_password=self.basic_password,
            tls_ca_file=self.tls_ca_file,
            tls_insecure_skip_verify=self.tls_insecure_skip_verify,
            headers=self.headers,
            timeout_seconds=self.timeout_seconds,
            max_samples_per_send=self.max_samples_per_send,
            max_pending_samples=self.max_pending_samples,
            min_backoff_seconds=self.min_backoff_seconds,
            max_backoff_seconds=self.max_backoff_seconds,
            max_retries=self.max_retries,
        )


@dataclass(frozen=True, kw_only=True)
class GatewayConfig:
    log_level: str = "info"
    drain_seconds: float = 5.0
    ssh: SshConfig = field(default_factory=SshConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    registry: RegistryConfig = field(default_factory=RegistryConfig)
    remote_write: RemoteWriteSection = field(default_factory=RemoteWriteSection)

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
    if cfg.registry.stale_after_intervals <= 0 or cfg.registry.offline_grace_seconds < 0:
        raise GatewayConfigError("registry.stale_after_intervals must be > 0, grace >= 0")
    check_remote_write(cfg.remote_write)
    return cfg


def check_remote_write(section: RemoteWriteSection) -> RemoteWriteConfig | None:
    """The writer's config (``None``: off); GatewayConfigError naming what is wrong."""
    if section.max_queued_batches_per_node < 1:
        raise GatewayConfigError("remote_write.max_queued_batches_per_node must be >= 1")
    try:
        return section.client_config()
    except ValueError as exc:
        raise GatewayConfigError(f"remote_write: {exc}") from exc
