"""``[remote_write]``: where and how the gateway writes, owned here, assembled by
:mod:`cloud_gateway.config`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from cloud_gateway import __version__
from cloud_gateway.errors import GatewayConfigError

# A node's collections waiting for remote write before its channel is no longer read
# (back-pressure); the default of [remote_write] max_queued_batches_per_node, and the one
# place it is written.
MAX_QUEUED_BATCHES: Final = 256

USER_AGENT = f"edge-gpu-relay/{__version__}"
PROTOCOL_HEADERS: dict[str, str] = {
    "Content-Encoding": "snappy",
    "Content-Type": "application/x-protobuf",
    "X-Prometheus-Remote-Write-Version": "0.1.0",
    "User-Agent": USER_AGENT,
}
_RESERVED_HEADERS = frozenset(h.lower() for h in (*PROTOCOL_HEADERS, "Content-Length", "Host"))


@dataclass(frozen=True, kw_only=True)
class RemoteWriteConfig:
    """Remote write settings, declared once: the ``[remote_write]`` section of
    gateway.toml (every key overridable by ``CLOUD_GATEWAY_REMOTE_WRITE_<KEY>``), read by
    the writer (the request) and the forwarders (backoff, queue). ``url = ""``: off.
    Checked by :meth:`validate` (the config loader and :class:`RemoteWriter` call it)."""

    url: str = ""
    bearer_token: str = ""
    bearer_token_file: Path | None = None  # re-read on every request (rotation)
    basic_user: str = ""
    basic_password: str = ""
    tls_ca_file: Path | None = None
    tls_insecure_skip_verify: bool = False
    headers: tuple[str, ...] = ()  # "Name: value", e.g. "X-Scope-OrgID: edge"
    timeout_seconds: float = 30.0  # per request
    max_samples_per_send: int = 2000  # per request
    max_pending_samples: int = 500_000  # in flight across all nodes (back-pressure bound)
    min_backoff_seconds: float = 0.05  # the forwarder's retry backoff, doubling with jitter
    max_backoff_seconds: float = 5.0  # ... up to this (a longer Retry-After is honoured)
    max_queued_batches_per_node: int = MAX_QUEUED_BATCHES  # more: stop reading that node
    max_retries: int | None = field(
        default=None,
        metadata={"deprecated": "batches are retried until the receiver accepts or refuses them"},
    )

    def validate(self) -> None:
        """ValueError naming the first setting that is wrong (the url only when set)."""
        if self.url and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"remote write url must be http(s)://, got {self.url!r}")
        if self.bearer_token and self.bearer_token_file is not None:
            raise ValueError("set bearer_token or bearer_token_file, not both")
        bearer = bool(self.bearer_token) or self.bearer_token_file is not None
        if bearer and (self.basic_user or self.basic_password):
            raise ValueError("set bearer or basic auth, not both")
        if self.basic_password and not self.basic_user:
            raise ValueError("basic_password without basic_user")
        if self.timeout_seconds <= 0:
            raise ValueError("timeout_seconds must be > 0")
        if self.max_samples_per_send < 1:
            raise ValueError("max_samples_per_send must be >= 1")
        if self.max_pending_samples < 1:
            raise ValueError("max_pending_samples must be >= 1")
        if not 0 <= self.min_backoff_seconds <= self.max_backoff_seconds:
            raise ValueError("need 0 <= min_backoff_seconds <= max_backoff_seconds")
        if self.max_queued_batches_per_node < 1:
            raise ValueError("max_queued_batches_per_node must be >= 1")
        self.extra_headers()  # validates

    def deprecated(self) -> list[str]:
        """One line for each deprecated key that is set (accepted, ignored): for the log."""
        return [
            f"remote_write.{f.name} is deprecated and ignored ({f.metadata['deprecated']}); "
            "remove it from the config"
            for f in dataclasses.fields(self)
            if "deprecated" in f.metadata and getattr(self, f.name) is not None
        ]

    def extra_headers(self) -> list[tuple[str, str]]:
        """``headers`` parsed; protocol headers (and Authorization when auth is set) are
        reserved and cannot be overridden."""
        out: list[tuple[str, str]] = []
        auth_set = bool(self.bearer_token or self.bearer_token_file or self.basic_user)
        for raw in self.headers:
            name, sep, value = raw.partition(":")
            name, value = name.strip(), value.strip()
            if not sep or not name or any(c in name for c in " \t\r\n"):
                raise ValueError(f"header must be 'Name: value', got {raw!r}")
            if "\r" in value or "\n" in value:
                raise ValueError(f"header value of {name!r} contains a line break")
            lowered = name.lower()
            if lowered in _RESERVED_HEADERS or (auth_set and lowered == "authorization"):
                raise ValueError(f"header {name!r} is set by the remote write client")
            out.append((name, value))
        return out


def check_remote_write(section: RemoteWriteConfig) -> RemoteWriteConfig | None:
    """The writer's config (``None``: off); GatewayConfigError naming what is wrong."""
    try:
        section.validate()
    except ValueError as exc:
        raise GatewayConfigError(f"remote_write: {exc}") from exc
    return section if section.url else None


@dataclass(frozen=True, kw_only=True)
class OtlpConfig:
    """``[otlp]``: where to send OTLP/HTTP metrics (``url = ""``: off). Set beside
    ``[remote_write] url`` the gateway writes both and acknowledges a batch once both took
    it; alone, OTLP instead. The retry backoff and per-node queue are ``[remote_write]``'s
    (``min_backoff_seconds``, ``max_queued_batches_per_node``), shared."""

    url: str = ""  # e.g. http://otel-collector:4318/v1/metrics
    bearer_token: str = ""
    bearer_token_file: Path | None = None
    basic_user: str = ""
    basic_password: str = ""
    tls_ca_file: Path | None = None
    tls_insecure_skip_verify: bool = False
    headers: tuple[str, ...] = ()
    timeout_seconds: float = 30.0
    max_samples_per_send: int = 2000
    max_pending_samples: int = 500_000
    # Also send the OpenTelemetry hardware conventions' hw.* metrics, made from the DCGM
    # series (cloud_gateway.remote_write.otlp_hw); the DCGM names are sent either way.
    semantic_conventions: bool = True

    def writer_config(self) -> RemoteWriteConfig:
        """The same settings as the writer's (validated like ``[remote_write]``'s)."""
        own = {f.name for f in dataclasses.fields(self)} - {"semantic_conventions"}
        return RemoteWriteConfig(**{name: getattr(self, name) for name in own})


def check_otlp(section: OtlpConfig) -> RemoteWriteConfig | None:
    """The writer's config (``None``: off); GatewayConfigError naming what is wrong."""
    cfg = section.writer_config()
    try:
        cfg.validate()
    except ValueError as exc:
        raise GatewayConfigError(f"otlp: {str(exc).replace('remote write ', '')}") from exc
    return cfg if cfg.url else None
