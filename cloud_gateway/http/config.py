"""``[http]``: the HTTP port's section (API, page, relay, tokens, TLS), owned here,
assembled by :mod:`cloud_gateway.config`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cloud_gateway.errors import GatewayConfigError
from gpurelay.web_config import WebConfig, WebConfigError, load_web_config

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
