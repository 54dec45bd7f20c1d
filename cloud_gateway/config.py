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

from cloud_gateway.cluster.config import ClusterConfig, check_cluster
from cloud_gateway.errors import GatewayConfigError
from cloud_gateway.http.config import HttpConfig
from cloud_gateway.registry.config import RegistryConfig
from cloud_gateway.remote_write.config import (
    OtlpConfig,
    RemoteWriteConfig,
    check_otlp,
    check_remote_write,
)
from cloud_gateway.ssh.config import SshConfig, check_ssh
from cloud_gateway.trust.config import EnrollConfig, check_enroll
from gpurelay.logs import FORMATS as LOG_FORMATS
from gpurelay.model import NODE_LABEL_NAMES
from gpurelay.settings import SettingsError, load_settings, split_host_port

ENV_PREFIX = "CLOUD_GATEWAY_"
_RESERVED = frozenset({"CLOUD_GATEWAY_CONFIG", "CLOUD_GATEWAY_URL", "CLOUD_GATEWAY_TOKEN"})


@dataclass(frozen=True, kw_only=True)
class GatewayConfig:
    log_level: str = "info"
    log_format: str = "text"  # or "json": one JSON object per line (gpurelay.logs)
    drain_seconds: float = 5.0
    ssh: SshConfig = field(default_factory=SshConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    registry: RegistryConfig = field(default_factory=RegistryConfig)
    # Declared with the client that reads it (cloud_gateway.remote_write.client); url = "": off.
    remote_write: RemoteWriteConfig = field(default_factory=RemoteWriteConfig)
    # OTLP/HTTP metrics, also or instead (cloud_gateway.remote_write.otlp); url = "": off.
    otlp: OtlpConfig = field(default_factory=OtlpConfig)
    # Where the node inventory lives; several gateways on one PostgreSQL database.
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    # Nodes get and renew their certificates over SSH (cloud_gateway.ssh.enrollment); off.
    enroll: EnrollConfig = field(default_factory=EnrollConfig)

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
    check_otlp(cfg.otlp)
    check_cluster(cfg.cluster)
    check_enroll(cfg.enroll)
    return cfg
