"""The SSH listener behind a balancer: read the PROXY header, then hand over to asyncssh.

With ``[ssh] proxy_protocol`` on, every connection starts with a PROXY protocol header
(:mod:`cloud_gateway.ssh.balancer_header`) from the balancer. :class:`ProxiedListener` is
handed to ``asyncssh.listen`` as its ``tunnel`` (any object with ``create_server`` is
one): it binds the socket itself (with the same backlog), and for each connection a small
protocol reads the header within ``timeout`` seconds, then makes asyncssh's connection
the transport's protocol (``set_protocol``: no copy, no cost per byte afterwards) with
the bytes after the header, and a transport whose ``peername`` is the client's address
from the header. Everything that asks asyncssh for the peer (logs, ``/api/v1/nodes``,
the conflict policy) sees the client, not the balancer.

A connection from outside ``allowed`` (when it is not empty), without a header, with a
bad, oversized or slow one is closed before SSH says anything, logged once with the
source and the reason, and counted by reason (:data:`~cloud_gateway.ssh.balancer_header.REFUSALS`).
A v2 LOCAL header (the balancer's own connection, e.g. a health check) keeps the
balancer's address.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from cloud_gateway.ssh.balancer_header import ProxyHeaderError, Reason, parse
from cloud_gateway.ssh.config import parse_networks
from gpurelay.logs import Throttled

log = logging.getLogger("cloud_gateway.ssh_server.proxy")

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def _ip(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped  # a dual-stack socket's view of an IPv4 balancer
    return ip


def _show(peer: Any) -> str:
    return f"{peer[0]}:{peer[1]}" if peer else "an unknown address"


class _ProxiedTransport:
    """The real transport, with the client's address from the header as ``peername``."""

    def __init__(self, transport: asyncio.Transport, extra: dict[str, Any]) -> None:
        self._transport = transport
        self._extra = extra
        self.write = transport.write  # the hot path: no lookup per call

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name in self._extra:
            return self._extra[name]
        return self._transport.get_extra_info(name, default)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _HeaderReader(asyncio.Protocol):
    def __init__(self, listener: ProxiedListener, factory: Callable[[], asyncio.Protocol]):
        self._listener = listener
        self._factory = factory
        self._transport: asyncio.Transport | None = None
        self._peer: Any = None
        self._buffer = bytearray()
        self._timer: asyncio.TimerHandle | None = None
        self._done = False  # handed over, or refused

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        self._peer = transport.get_extra_info("peername")
        if not self._listener.allowed(self._peer):
            self._refuse("source", "not a balancer in ssh.proxy_protocol_from")
            return
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self._listener.timeout, self._timed_out)

    def _timed_out(self) -> None:
        self._refuse(
            "timeout",
            f"no whole PROXY header within {self._listener.timeout:g}s "
            f"({len(self._buffer)} bytes; ssh.proxy_protocol_timeout_seconds)",
        )

    def data_received(self, data: bytes) -> None:
        if self._done:
            return
        self._buffer += data
        try:
            header = parse(self._buffer)
        except ProxyHeaderError as exc:
            self._refuse(exc.reason, str(exc))
            return
        if header is None:
            return
        self._done = True
        if self._timer is not None:
            self._timer.cancel()
        transport = self._transport
        assert transport is not None
        extra: dict[str, Any] = {}
        if header.source is not None:
            host, port = header.source
            extra["peername"] = (host, port) if header.family == "tcp4" else (host, port, 0, 0)
            extra["proxy_peername"] = self._peer  # the balancer
        rest = bytes(self._buffer[header.length :])
        self._buffer.clear()
        inner = self._factory()
        transport.set_protocol(inner)
        inner.connection_made(_ProxiedTransport(transport, extra))  # type: ignore[arg-type]
        if rest and not transport.is_closing():
            inner.data_received(rest)

    def eof_received(self) -> bool:
        self._gone()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._gone()

    def _gone(self) -> None:
        if self._done:
            return
        if not self._buffer:  # a TCP probe (a balancer's plain check, a port scan): quiet
            self._done = True
            if self._timer is not None:
                self._timer.cancel()
            return
        self._refuse("closed", f"closed after {len(self._buffer)} bytes of a PROXY header")

    def _refuse(self, reason: Reason, detail: str) -> None:
        if self._done:
            return
        self._done = True
        if self._timer is not None:
            self._timer.cancel()
        self._listener.refused[reason] += 1
        self._listener.log_refused(reason)(
            "refused a connection from %s before SSH (%s): %s", _show(self._peer), reason, detail
        )
        if self._transport is not None:
            self._transport.abort()


class ProxiedListener:
    """``asyncssh.listen(tunnel=...)``: a TCP listener whose connections start with a
    PROXY header, from ``allowed`` networks (empty: from anywhere)."""

    def __init__(
        self,
        *,
        allowed: Sequence[Network] = (),
        timeout: float = 5.0,
        backlog: int = 100,
    ) -> None:
        self.allowed_networks = tuple(allowed)
        self.timeout = timeout
        self.backlog = backlog
        self.refused: Counter[str] = Counter()
        self._log_refused: dict[str, Throttled] = {}  # a flood: a line per reason per 10 s

    def log_refused(self, reason: str) -> Throttled:
        """The refusals' log line for ``reason``: one per 10 s at most, counting the rest."""
        if reason not in self._log_refused:
            self._log_refused[reason] = Throttled(log, logging.WARNING)
        return self._log_refused[reason]

    def allowed(self, peer: Any) -> bool:
        if not self.allowed_networks:
            return True
        ip = _ip(str(peer[0])) if peer else None
        return ip is not None and any(ip in net for net in self.allowed_networks)

    async def create_server(
        self, session_factory: Callable[[str, int], Any], listen_host: str, listen_port: int
    ) -> asyncio.AbstractServer:
        loop = asyncio.get_running_loop()
        return await loop.create_server(
            lambda: _HeaderReader(self, lambda: session_factory("", 0)),
            listen_host or None,
            listen_port,
            backlog=self.backlog,
        )

    def close(self) -> None:
        """asyncssh's tunnel interface; the listener itself is closed through asyncssh."""

    async def wait_closed(self) -> None:
        """asyncssh's tunnel interface."""


def proxied_listener(*, on: bool, allowed: Sequence[str], timeout: float) -> ProxiedListener | None:
    """The listener for ``[ssh] proxy_protocol`` (None when off), said once in the log."""
    if not on:
        return None
    if allowed:
        log.info("ssh: a PROXY protocol header first, from %s only", ", ".join(allowed))
    else:
        log.warning(
            "ssh: a PROXY protocol header first, from ANY address (ssh.proxy_protocol_from "
            "is empty): whoever reaches the SSH port can claim any client address; list the "
            "balancers' addresses there"
        )
    return ProxiedListener(allowed=parse_networks(allowed), timeout=timeout)
