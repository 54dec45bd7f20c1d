"""The Prometheus web-config file: TLS and basic auth for both binaries' HTTP listeners.

The same YAML file node_exporter, Prometheus and every exporter-toolkit exporter take as
``--web.config.file``, so a user moving from node_exporter points ``web_config_file`` at
the file they already have::

    tls_server_config:
      cert_file: server.crt            # relative paths: to the file's directory
      key_file: server.key
      client_auth_type: RequireAndVerifyClientCert   # the default once client_ca_file is set
      client_ca_file: clients-ca.crt
      min_version: TLS12               # TLS10..TLS13; TLS12 by default
    basic_auth_users:
      prometheus: $2y$10$...           # bcrypt (htpasswd -nBC 10 "" | tr -d ':\\n')

What this module cannot honour is an error that names the key, never silently ignored:
``RequestClientCert``/``RequireAnyClientCert`` (an unverified client certificate),
``cipher_suites``, ``curve_preferences``, ``client_allowed_sans``, inline ``cert``/``key``.
Python's OpenSSL picks ciphers and curves itself (TLS 1.2 with forward secrecy, and 1.3).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import re
import ssl
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from gpurelay.settings import SettingsError

REALM: Final = "edge-gpu-relay"
BASIC_CHALLENGE: Final = f'Basic realm="{REALM}"'
TLS_VERSIONS: Final = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
CLIENT_AUTH: Final = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
_TLS_KEYS: Final = {"cert_file", "key_file", "client_auth_type", "client_ca_file"} | {
    "min_version",
    "max_version",
    "prefer_server_cipher_suites",  # ignored by Go since 1.17 too
}
_UNSUPPORTED: Final = {
    "cert",
    "key",
    "client_ca",
    "cipher_suites",
    "curve_preferences",
    "client_allowed_sans",
}
# $2a$/$2b$/$2y$ (htpasswd writes 2y), a two-digit cost, 22 characters of salt, 31 of hash.
_BCRYPT: Final = re.compile(r"\$2[aby]\$(0[4-9]|[12]\d|3[01])\$[./A-Za-z0-9]{53}")


class WebConfigError(SettingsError):
    """The web-config file is invalid; the message names the file and the key."""


@dataclass(frozen=True, kw_only=True)
class TlsServerConfig:
    cert_file: Path
    key_file: Path
    client_auth_type: str = "NoClientCert"
    client_ca_file: Path | None = None
    min_version: str = "TLS12"
    max_version: str = ""  # "": the newest


@dataclass(frozen=True, kw_only=True)
class WebConfig:
    path: Path
    tls: TlsServerConfig | None = None
    basic_auth_users: Mapping[str, bytes] = field(default_factory=dict)

    def ssl_context(self) -> ssl.SSLContext | None:
        """A server context for the listener, or None without ``tls_server_config``."""
        return None if self.tls is None else server_context(self.tls)


def load_web_config(path: Path, *, key: str) -> WebConfig:
    """Read and check the file; the certificate and key are loaded once to check them.
    Errors start with ``"<key> <path>: "`` and name the key in the file."""

    def fail(message: str) -> WebConfigError:
        return WebConfigError(f"{key} {path}: {message}")

    import yaml  # type: ignore[import-untyped]  # only with a web config; no types-PyYAML

    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise fail(f"cannot be read: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise fail(f"is not valid YAML: {exc}") from exc
    doc = {} if doc is None else doc
    if not isinstance(doc, dict):
        raise fail("must be a mapping of tls_server_config, basic_auth_users")
    unknown = sorted(set(doc) - {"tls_server_config", "basic_auth_users", "http_server_config"})
    if unknown:
        raise fail(f"unknown key(s): {', '.join(map(str, unknown))}")
    _check_http_server_config(doc.get("http_server_config"), fail)
    try:
        tls = _tls(doc.get("tls_server_config"), path.parent)
        users = _users(doc.get("basic_auth_users"))
        cfg = WebConfig(path=path, tls=tls, basic_auth_users=users)
        cfg.ssl_context()
    except ValueError as exc:
        raise fail(str(exc)) from exc
    return cfg


def _check_http_server_config(value: object, fail: Callable[[str], WebConfigError]) -> None:
    # http2 means nothing to an HTTP/1.1 server; response headers are not supported.
    if value is None:
        return
    if not isinstance(value, dict):
        raise fail("http_server_config must be a mapping")
    extra = sorted(set(value) - {"http2"})
    if extra:
        raise fail(f"http_server_config.{extra[0]} is not supported by edge-gpu-relay")


def _tls(value: object, base: Path) -> TlsServerConfig | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("tls_server_config must be a mapping")
    for name in sorted(value):
        if name in _UNSUPPORTED:
            raise ValueError(f"tls_server_config.{name} is not supported by edge-gpu-relay")
        if name not in _TLS_KEYS:
            raise ValueError(f"unknown key tls_server_config.{name}")
    files: dict[str, Path | None] = {}
    for name in ("cert_file", "key_file", "client_ca_file"):
        raw = value.get(name)
        if raw in (None, ""):
            if name != "client_ca_file":
                raise ValueError(f"tls_server_config.{name} is required")
            files[name] = None
            continue
        if not isinstance(raw, str):
            raise ValueError(f"tls_server_config.{name} must be a path, not {raw!r}")
        resolved = base / Path(raw).expanduser()
        if not resolved.is_file():
            raise ValueError(f"tls_server_config.{name}: {resolved} does not exist")
        files[name] = resolved
    ca = files["client_ca_file"]
    auth = value.get("client_auth_type") or ("RequireAndVerifyClientCert" if ca else "NoClientCert")
    if auth not in CLIENT_AUTH:
        supported = ", ".join(CLIENT_AUTH)
        if auth in ("RequestClientCert", "RequireAnyClientCert"):
            raise ValueError(
                f"tls_server_config.client_auth_type {auth!r} is not supported (a client "
                f"certificate nobody verifies); use one of {supported}"
            )
        raise ValueError(f"tls_server_config.client_auth_type must be one of {supported}")
    if auth != "NoClientCert" and ca is None:
        raise ValueError(f"tls_server_config.client_ca_file is required for {auth}")
    if auth == "NoClientCert" and ca is not None:
        raise ValueError(
            "tls_server_config.client_ca_file is set but client_auth_type is NoClientCert"
        )
    versions = {}
    for name, default in (("min_version", "TLS12"), ("max_version", "")):
        version = value.get(name) or default
        if version and version not in TLS_VERSIONS:
            raise ValueError(
                f"tls_server_config.{name} must be one of {', '.join(TLS_VERSIONS)}, "
                f"not {version!r}"
            )
        versions[name] = version
    assert files["cert_file"] is not None and files["key_file"] is not None
    return TlsServerConfig(
        cert_file=files["cert_file"],
        key_file=files["key_file"],
        client_auth_type=auth,
        client_ca_file=ca,
        **versions,
    )


def _users(value: object) -> dict[str, bytes]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError("basic_auth_users must be a mapping of user name to bcrypt hash")
    users = {}
    for user, hashed in value.items():
        if not isinstance(hashed, str) or not _BCRYPT.fullmatch(hashed):
            raise ValueError(
                f"basic_auth_users.{user} is not a bcrypt hash ($2y$10$ and 53 characters; "
                "make one with: htpasswd -nBC 10 '' | tr -d ':\\n')"
            )
        users[str(user)] = hashed.encode()
    return users


def server_context(tls: TlsServerConfig) -> ssl.SSLContext:
    """The listener's context; ValueError naming the key when a file does not load."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = TLS_VERSIONS[tls.min_version]
    if tls.max_version:
        ctx.maximum_version = TLS_VERSIONS[tls.max_version]
    try:
        ctx.load_cert_chain(tls.cert_file, tls.key_file)
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(
            f"tls_server_config.cert_file/key_file: {tls.cert_file} and {tls.key_file} do not "
            f"load as a certificate and its key: {exc}"
        ) from exc
    if tls.client_ca_file is not None:
        try:
            ctx.load_verify_locations(cafile=tls.client_ca_file)
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(
                f"tls_server_config.client_ca_file: {tls.client_ca_file} does not load: {exc}"
            ) from exc
    ctx.verify_mode = CLIENT_AUTH[tls.client_auth_type]
    return ctx


def parse_basic(credentials: str) -> tuple[str, str] | None:
    """``(user, password)`` from the base64 part of ``Authorization: Basic ...``."""
    if not credentials.isascii():  # a header value is Latin-1; base64 raises ValueError
        return None
    try:
        decoded = base64.b64decode(credentials.strip(), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None
    user, sep, password = decoded.partition(":")
    return (user, password) if sep else None


CheckPw = Callable[[bytes, bytes], bool]
# A hash no password matches quickly: unknown users pay the same bcrypt as known ones.
_DUMMY: Final = b"$2b$10$" + b"." * 53


# bcrypt reads 72 bytes at most; bcrypt >= 5 (and Go's) refuses longer passwords.
MAX_PASSWORD_BYTES: Final = 72


class BasicAuth:
    """Checks ``basic_auth_users``. bcrypt costs ~100 ms (cost 10) by design, so answers
    are cached for ``ttl`` seconds in a bounded LRU keyed by a SHA-256 of the user, the
    hash and the password (no password is kept), as exporter-toolkit does; a scrape every
    15 s pays one bcrypt a minute. bcrypt runs in a thread, ``concurrency`` at a time, so
    a flood of wrong passwords neither blocks the event loop nor takes every core.

    Wrong passwords must not starve real users (issue 24 #6): at most ``max_waiting``
    checks wait for a bcrypt slot, and one more is refused at once, without a bcrypt (the
    caller answers 401 fast), so no one waits behind more than ``concurrency +
    max_waiting`` bcrypts however many guesses arrive; and a ``source`` (the client's
    address) with ``max_failures`` wrong passwords within ``failure_window`` seconds is
    refused without a bcrypt until the window has passed. ``refused_fast`` counts both."""

    def __init__(
        self,
        users: Mapping[str, bytes],
        *,
        checkpw: CheckPw | None = None,  # bcrypt.checkpw
        ttl: float = 60.0,
        max_entries: int = 256,
        concurrency: int = 2,
        max_waiting: int = 8,
        max_failures: int = 10,
        failure_window: float = 60.0,
        max_sources: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.users = dict(users)
        if checkpw is None:  # imported only where basic auth is configured
            import bcrypt

            checkpw = bcrypt.checkpw
        self._checkpw = checkpw
        self._ttl, self._max, self._clock = ttl, max_entries, clock
        self._cache: OrderedDict[bytes, tuple[float, bool]] = OrderedDict()
        self._slots = asyncio.Semaphore(concurrency)
        self._pending, self._max_pending = 0, concurrency + max_waiting
        self._max_failures, self._window, self._max_sources = (
            max_failures,
            failure_window,
            max_sources,
        )
        self._failures: OrderedDict[str, tuple[float, int]] = OrderedDict()  # until, count
        self.refused_fast = 0

    def __bool__(self) -> bool:
        return bool(self.users)

    def cached(self) -> int:
        return len(self._cache)

    async def verify(self, user: str, password: str, *, source: str | None = None) -> bool:
        hashed = self.users.get(user)
        known = hashed is not None
        hashed = hashed if hashed is not None else _DUMMY
        key = hashlib.sha256(b"\0".join((user.encode(), hashed, password.encode()))).digest()
        now = self._clock()
        hit = self._cache.get(key)
        if hit is not None and hit[0] > now:
            self._cache.move_to_end(key)
            return hit[1]
        secret = password.encode()
        if len(secret) > MAX_PASSWORD_BYTES:
            return False
        if self._throttled(source, now) or self._pending >= self._max_pending:
            self.refused_fast += 1
            return False
        self._pending += 1
        try:
            async with self._slots:
                ok = await asyncio.to_thread(self._checkpw, secret, hashed)
        finally:
            self._pending -= 1
        ok = ok and known
        if not ok:
            self._failed(source, self._clock())
        self._cache[key] = (now + self._ttl, ok)
        self._cache.move_to_end(key)
        while len(self._cache) > self._max:
            self._cache.popitem(last=False)
        return ok

    def _throttled(self, source: str | None, now: float) -> bool:
        entry = self._failures.get(source) if source is not None else None
        return entry is not None and entry[0] > now and entry[1] >= self._max_failures

    def _failed(self, source: str | None, now: float) -> None:
        if source is None:
            return
        until, count = self._failures.pop(source, (0.0, 0))
        self._failures[source] = (until, count + 1) if until > now else (now + self._window, 1)
        while len(self._failures) > self._max_sources:  # the oldest sources are forgotten
            self._failures.popitem(last=False)
