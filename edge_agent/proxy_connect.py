"""Reaching the gateway through an HTTP CONNECT proxy (``[gateway] proxy``).

Where an edge network lets out only what goes through a forward proxy, the agent asks the
proxy to open a TCP tunnel to the gateway (``CONNECT gw:2222 HTTP/1.1``) and runs SSH inside
it; the proxy sees only the SSH handshake's ciphertext. The head of the proxy's answer is
read with ``MSG_PEEK`` so that not one byte after it leaves the kernel's buffer: the
gateway's SSH banner often arrives in the same segment as ``200``, and the connected socket
is handed as it is to asyncssh (through :mod:`edge_agent.tunnel_greeting`).

Which proxy: ``proxy = "http://[USER:PASSWORD@]HOST:PORT"``, or ``"env"`` for
``https_proxy``/``HTTPS_PROXY`` then ``all_proxy``/``ALL_PROXY``, or ``""`` (the default):
none. Never an environment proxy unasked: those are set for HTTP clients and often forbid
CONNECT to any port but 443. ``no_proxy``/``NO_PROXY`` (hosts, domain suffixes, ``*``, IP
addresses and CIDRs, each with an optional ``:PORT``) names gateway addresses dialled
directly, whichever way the proxy was chosen. ``https://`` proxies (TLS to the proxy) are
not supported: the SSH session inside the tunnel is encrypted and authenticated either way.
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import logging
import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

from edge_agent import __version__
from edge_agent.dial import PathSilent, dial, show
from edge_agent.errors import AgentError, ConfigError
from gpurelay import compat
from gpurelay.compat import TIMEOUTS

MAX_HEAD_BYTES = 8192  # the proxy's whole answer head; squid's and tinyproxy's are < 300
ENV_PROXY_VARIABLES = ("https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY")
_STATUS_LINE = re.compile(rb"HTTP/1\.[01] ([0-9]{3})(?: ([^\r\n]*))?\r?\n")
_HEAD_END = re.compile(rb"\r?\n\r?\n")


class ProxyError(AgentError):
    """The proxy could not be reached, refused the CONNECT or answered something else."""


@dataclass(frozen=True)
class HttpProxy:
    host: str
    port: int
    username: str = ""
    password: str = field(default="", repr=False)
    source: str = field(default="gateway.proxy", compare=False)  # where it was set, for logs

    def __str__(self) -> str:
        """``http://USER@HOST:PORT``: never the password."""
        user = f"{self.username}@" if self.username else ""
        return f"http://{user}{show((self.host, self.port))}"

    def authorization(self) -> str:
        """The ``Proxy-Authorization`` value (basic), or "" without credentials."""
        if not self.username and not self.password:
            return ""
        pair = f"{self.username}:{self.password}".encode()
        return "Basic " + base64.b64encode(pair).decode("ascii")


def parse_proxy_url(value: str, key: str = "gateway.proxy") -> HttpProxy:
    """``http://[USER[:PASSWORD]@]HOST:PORT[/]`` (``HOST:PORT`` alone means http://);
    a ConfigError naming ``key`` (and never the password) for anything else."""
    text = value.strip()
    if "://" not in text:
        text = "http://" + text
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"{key}: {_safe(text)} is not a proxy URL ({exc})") from None
    scheme = parts.scheme.lower()
    if scheme != "http":
        extra = (
            ": TLS to the proxy is not supported; the SSH session inside an http:// proxy's "
            "tunnel is encrypted end to end anyway"
            if scheme == "https"
            else ""
        )
        raise ConfigError(f"{key}: a {scheme}:// proxy is not supported, only http://{extra}")
    if not parts.hostname:
        raise ConfigError(f"{key}: {_safe(text)} names no proxy host")
    if port is None or not 1 <= port <= 65535:
        raise ConfigError(f"{key}: {_safe(text)} needs a port 1..65535 (http://HOST:PORT)")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ConfigError(f"{key}: {_safe(text)}: a proxy URL has no path, query or fragment")
    return HttpProxy(
        host=parts.hostname,
        port=port,
        username=unquote(parts.username or ""),
        password=unquote(parts.password or ""),
        source=key,
    )


def _safe(url: str) -> str:
    """``url`` quoted for a message, its password (if any) replaced by ``***``."""
    return repr(re.sub(r"(//[^/@:]*:)[^/@]*@", r"\1***@", url))


@dataclass(frozen=True)
class _Rule:
    everything: bool = False
    network: ipaddress.IPv4Network | ipaddress.IPv6Network | None = None
    domain: str = ""
    port: int = 0  # 0: any


class NoProxy:
    """A ``NO_PROXY`` list: which gateway addresses are dialled directly. Entries are
    compared with the address as configured; a host name is never resolved for a CIDR."""

    def __init__(self, value: str) -> None:
        self.value = value
        self.rules = tuple(r for r in (_rule(e) for e in value.split(",")) if r is not None)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NoProxy) and other.rules == self.rules

    def __hash__(self) -> int:
        return hash(self.rules)

    def matches(self, host: str, port: int) -> bool:
        name = host.strip().strip("[]").rstrip(".").lower()
        try:
            address: ipaddress.IPv4Address | ipaddress.IPv6Address | None
            address = ipaddress.ip_address(name)
        except ValueError:
            address = None
        for rule in self.rules:
            if rule.port and rule.port != port:
                continue
            if rule.everything:
                return True
            if rule.network is not None:
                if address is not None and address in rule.network:
                    return True
            elif name == rule.domain or name.endswith("." + rule.domain):
                return True
        return False


def _rule(entry: str) -> _Rule | None:
    entry = entry.strip().lower()
    if not entry:
        return None
    if entry == "*":
        return _Rule(everything=True)
    port = 0
    net = _network(entry)
    if net is None:
        match = re.fullmatch(r"(.+):([0-9]{1,5})", entry)
        if match:
            entry, port = match.group(1), int(match.group(2))
            net = _network(entry)
    if net is not None:
        return _Rule(network=net, port=port)
    domain = entry.removeprefix("*").lstrip(".").rstrip(".")
    return _Rule(domain=domain, port=port) if domain else None


def _network(text: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
    try:
        return ipaddress.ip_network(text.strip("[]"), strict=False)
    except ValueError:
        return None


@dataclass(frozen=True)
class ProxyRoute:
    """How each gateway address is reached: through ``proxy`` unless ``no_proxy`` names it."""

    proxy: HttpProxy | None = None
    no_proxy: NoProxy = field(default_factory=lambda: NoProxy(""))

    def proxy_for(self, host: str, port: int) -> HttpProxy | None:
        if self.proxy is None or self.no_proxy.matches(host, port):
            return None
        return self.proxy

    def describe(self, addresses: Sequence[tuple[str, int]]) -> list[str]:
        """One line per gateway address, for the log at start."""
        if self.proxy is None:
            return []
        lines = []
        for host, port in addresses:
            how = self.proxy_for(host, port)
            route = (
                f"through HTTP proxy {how} ({how.source})"
                if how
                else f"directly (NO_PROXY {self.no_proxy.value!r} names it)"
            )
            lines.append(f"gateway {show((host, port))}: {route}")
        return lines

    async def open(
        self, host: str, port: int, *, dial_timeout: float, answer_timeout: float
    ) -> socket.socket:
        """A socket connected to the gateway, directly or through the proxy's tunnel.
        :class:`PathSilent` or ``OSError`` for a direct dial, as :func:`dial` raises them;
        through a proxy, PathSilent when the proxy did not answer TCP, else ProxyError."""
        proxy = self.proxy_for(host, port)
        if proxy is None:
            return await dial(host, port, dial_timeout)
        return await connect_through(
            proxy, host, port, dial_timeout=dial_timeout, answer_timeout=answer_timeout
        )


def proxy_route(setting: str, environ: Mapping[str, str]) -> ProxyRoute:
    """The route for ``[gateway] proxy`` = ``setting`` ("", "env" or a URL)."""
    no_proxy = NoProxy(environ.get("no_proxy", environ.get("NO_PROXY", "")))
    setting = setting.strip()
    if not setting:
        return ProxyRoute()
    if setting.lower() != "env":
        return ProxyRoute(parse_proxy_url(setting), no_proxy)
    for name in ENV_PROXY_VARIABLES:
        value = environ.get(name, "").strip()
        if value:
            return ProxyRoute(parse_proxy_url(value, key=f"{name} (gateway.proxy = env)"), no_proxy)
    return ProxyRoute()


def log_route(
    route: ProxyRoute,
    setting: str,
    addresses: Sequence[tuple[str, int]],
    log: logging.LoggerAdapter[logging.Logger],
) -> None:
    """Say at start which way each gateway address goes (never the password)."""
    if setting.strip().lower() == "env" and route.proxy is None:
        log.info(
            "gateway.proxy = env, but none of %s is set: connecting directly",
            "/".join(ENV_PROXY_VARIABLES),
        )
    for line in route.describe(addresses):
        log.info("%s", line)


async def connect_through(
    proxy: HttpProxy, host: str, port: int, *, dial_timeout: float, answer_timeout: float
) -> socket.socket:
    """A socket to ``host:port`` through ``proxy``'s CONNECT tunnel, positioned at the first
    byte the gateway sent. TCP to the proxy within ``dial_timeout`` (else PathSilent), its
    answer's head within ``answer_timeout`` (else ProxyError)."""
    try:
        sock = await dial(proxy.host, proxy.port, dial_timeout)
    except PathSilent as exc:
        raise PathSilent(f"HTTP proxy {proxy}: {exc}") from exc
    except OSError as exc:
        raise ProxyError(f"cannot reach HTTP proxy {proxy}: {exc}") from exc
    try:
        async with compat.timeout(answer_timeout):
            await handshake(sock, proxy, host, port)
    except TIMEOUTS:
        sock.close()
        raise ProxyError(
            f"HTTP proxy {proxy} did not answer CONNECT {show((host, port))} within "
            f"{answer_timeout:g}s"
        ) from None
    except BaseException:
        sock.close()
        raise
    return sock


async def handshake(sock: socket.socket, proxy: HttpProxy, host: str, port: int) -> None:
    """Send CONNECT on the connected, non-blocking ``sock`` and read the answer's head, not
    a byte more; returns on a 2xx, raises ProxyError saying what the proxy answered."""
    target = show((host, port))
    if not host or re.search(r"[\s\x00-\x1f\x7f]", host):
        raise ProxyError(f"gateway host {host!r} cannot go into a CONNECT request")
    lines = [
        f"CONNECT {target} HTTP/1.1",
        f"Host: {target}",
        f"User-Agent: edge-agent/{__version__}",
    ]
    if auth := proxy.authorization():
        lines.append(f"Proxy-Authorization: {auth}")
    loop = asyncio.get_running_loop()
    await loop.sock_sendall(sock, ("\r\n".join(lines) + "\r\n\r\n").encode())
    head = await read_head(sock, str(proxy))
    status = _STATUS_LINE.match(head)
    if status is None:  # read_head checked the start; a malformed status line
        raise ProxyError(f"HTTP proxy {proxy} answered {_excerpt(head)}: not an HTTP status line")
    code, reason = int(status.group(1)), (status.group(2) or b"").decode("latin-1")
    if 200 <= code < 300:
        return
    raise ProxyError(_refusal(proxy, target, code, reason[:80], head))


def _refusal(proxy: HttpProxy, target: str, code: int, reason: str, head: bytes) -> str:
    said = f"HTTP proxy {proxy} refused CONNECT {target}: {code} {reason!r}"
    if code in (401, 407):  # tinyproxy 1.11 answers a CONNECT's bad credentials with 401
        challenge = re.search(rb"(?im)^(?:proxy|www)-authenticate:[ \t]*([^\s,]+)", head)
        scheme = challenge.group(1).decode("latin-1")[:20] if challenge else "?"
        if proxy.username or proxy.password:
            return f"{said}: it refused the user and password in {proxy.source} ({scheme})"
        return (
            f"{said}: it wants credentials (asks for {scheme}): "
            f"http://USER:PASSWORD@HOST:PORT in {proxy.source}"
        )
    if code == 403:
        return (
            f"{said}: its access rules forbid this client or this port (many proxies allow "
            "CONNECT only to 443: allow the gateway's port, e.g. squid's SSL_ports, "
            "tinyproxy's ConnectPort)"
        )
    if code in (502, 503, 504):
        return f"{said}: the proxy could not reach the gateway itself"
    return said


async def read_head(sock: socket.socket, who: str, limit: int = MAX_HEAD_BYTES) -> bytes:
    """The answer's head up to and including its blank line, consumed from ``sock``; what
    follows stays unread in the kernel's buffer (peeked, never received)."""
    loop = asyncio.get_running_loop()
    head = b""
    while True:
        await _readable(loop, sock)
        try:
            peeked = sock.recv(limit + 4 - len(head), socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            continue
        except OSError as exc:
            raise ProxyError(f"HTTP proxy {who}: {exc} while reading its answer") from exc
        if not peeked:
            what = "answering CONNECT" if not head else f"its answer ({_excerpt(head)} so far)"
            raise ProxyError(f"HTTP proxy {who} closed the connection before {what}")
        seen = head + peeked
        if not b"HTTP/".startswith(seen[:5]):
            raise ProxyError(
                f"{who} answered {_excerpt(seen)}, not HTTP: is it an HTTP proxy (and not, "
                "say, the gateway's own SSH port)?"
            )
        end = _HEAD_END.search(seen, max(0, len(head) - 3))
        if end is not None:
            return head + _recv_exactly(sock, end.end() - len(head))
        if len(seen) > limit:
            raise ProxyError(f"HTTP proxy {who} sent an answer head over {limit} bytes")
        head += _recv_exactly(sock, len(peeked))


def _recv_exactly(sock: socket.socket, count: int) -> bytes:
    """``count`` bytes that a peek already saw: they are in the buffer, so no wait."""
    data = b""
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            raise ProxyError("the proxy connection closed while its answer was read")
        data += chunk
    return data


async def _readable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    ready: asyncio.Future[None] = loop.create_future()
    fd = sock.fileno()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(fd, wake)
    try:
        await ready
    finally:
        loop.remove_reader(fd)


def _excerpt(data: bytes) -> str:
    """The first bytes of what arrived, quoted (control characters escaped) for a message."""
    return repr(data[:60]) + ("..." if len(data) > 60 else "")
