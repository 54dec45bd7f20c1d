"""The gateway's HTTP listener: a cap on connections, a deadline for the first request's
headers, an idle timeout. Clients that connect and say nothing (or say it slowly) can
neither hold the listener nor keep ``/metrics``, ``/healthz`` or SSH logins out
(DESIGN.md, "Trust boundaries").

aiohttp (3.14) bounds header sizes (8190-byte lines and fields, 128 headers) and closes a
connection that has no complete request ``keepalive_timeout`` after it connected or after
its last response; that timer is our idle timeout. It caps nothing and has no shorter
deadline for a first request. Both live here, in a protocol wrapped around aiohttp's own
per-connection handler:

- **header timeout**: a new connection must deliver its first request's headers within
  ``header_timeout_seconds`` (:func:`track_requests` sees the request start) or is closed;
- **cap**: at ``max_connections`` a new connection makes room by closing the oldest idle
  one: first one that never sent a whole request, else a kept-alive one with no request
  in flight and nothing left to write. Only if every connection is busy is the new one
  refused (a 503). A flood of silent sockets thus churns among itself, and a scraper that
  connects and sends its request at once is always served. (A reserved share for
  ``/metrics`` would not do: the path is unknown until the headers arrive, and by then
  the connection already holds its slot.)

A request aiohttp cannot parse (a NUL byte in a header, a bad ``Transfer-Encoding``...)
gets its 400 and the connection is closed; aiohttp would log a whole ERROR traceback for
each (logger ``aiohttp.server``), so any client could flood the log. Here it is one
WARNING line with the client and the reason, at most every ``LOG_EVERY_SECONDS`` with the
count of those left out, and ``closed{reason="bad_request"}`` counts them all.

With TLS (``http.web_config_file``) the guard admits the TCP connection first and only
then runs the handshake (``loop.start_tls``): a handshake counts against the cap and must
finish, with the first request's headers, within the header timeout.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Final

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from cloud_gateway.errors import listen_error
from gpurelay.logs import Throttled

log = logging.getLogger("cloud_gateway.http")

# Values of gpurelay_gateway_http_connections_closed_total{reason}.
CLOSE_REASONS: Final = ("header_timeout", "evicted", "refused", "bad_request")
# A kept-alive connection is only evicted this long after its last response ended (its
# bytes have left by then unless the client stopped reading: the write buffer says so).
SETTLE_SECONDS: Final = 1.0
LOG_EVERY_SECONDS: Final = 10.0
_BUSY: Final = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: 37\r\n"
    b"Retry-After: 1\r\nConnection: close\r\n\r\ntoo many busy connections, try again\n"
)


@dataclass
class ConnectionStats:
    open: int = 0
    tls_handshake_failures: int = 0
    closed: Counter[str] = field(default_factory=lambda: Counter(dict.fromkeys(CLOSE_REASONS, 0)))


class _ParseErrors(logging.LoggerAdapter):  # type: ignore[type-arg]
    """aiohttp's server logger for one connection: a request it could not parse goes to
    :meth:`ConnectionGuard.bad_request`; everything else to ``aiohttp.server`` as before
    (a handler's exception keeps its traceback)."""

    def __init__(self, logger: logging.Logger, conn: _Connection) -> None:
        super().__init__(logger, {})
        self.conn = conn

    def _unparsable(self, exc_info: object) -> bool:
        if not isinstance(exc_info, HttpProcessingError):
            return False
        self.conn.guard.bad_request(self.conn, exc_info)
        return True

    def exception(self, msg: object, *args: object, exc_info: Any = True, **kw: Any) -> None:
        if not self._unparsable(exc_info):
            self.logger.exception(msg, *args, exc_info=exc_info, **kw)

    def debug(self, msg: object, *args: object, **kw: Any) -> None:
        # aiohttp logs a first request with a bad method (TLS on a plain port) at debug
        if not self._unparsable(kw.get("exc_info")):
            self.logger.debug(msg, *args, **kw)


class _Connection(asyncio.Protocol):
    """One client connection: aiohttp's handler inside, the guard's bookkeeping around."""

    def __init__(self, guard: ConnectionGuard, server: web.Server) -> None:
        self.guard = guard
        self._server = server
        self.handler: asyncio.Protocol | None = None
        self.transport: asyncio.Transport | None = None
        self.peer: Any = None
        self.in_flight = 0
        self.ended = 0.0  # monotonic time the last request ended
        self.timer: asyncio.TimerHandle | None = None
        # TLS: what arrives between the handshake's end and the handler's start.
        self._early: list[bytes] | None = None
        self._handshake: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.peer = transport.get_extra_info("peername")
        if not self.guard.admit(self):
            if self.guard.tls is None:
                transport.write(_BUSY)
            transport.close()
            return
        if self.guard.tls is None:
            self._serve(transport)
            return
        self._early = []
        self._handshake = asyncio.ensure_future(self._start_tls(transport, self.guard.tls))

    async def _start_tls(self, raw: asyncio.Transport, context: ssl.SSLContext) -> None:
        try:
            tls = await asyncio.get_running_loop().start_tls(
                raw,
                self,
                context,
                server_side=True,
                ssl_handshake_timeout=self.guard.header_timeout,
            )
        except Exception as exc:  # SSLError, reset, timeout: the handshake did not finish
            self.guard.handshake_failed(self, exc)
            raw.abort()
            return
        if tls is None or raw.is_closing():
            return
        assert isinstance(tls, asyncio.Transport)
        self.guard.rebind(self, tls)
        self._serve(tls)

    def _serve(self, transport: asyncio.Transport) -> None:
        self.handler = self._server()
        if hasattr(self.handler, "logger"):  # aiohttp's RequestHandler
            server_log = self.handler.logger
            self.handler.logger = _ParseErrors(server_log, self)  # type: ignore[assignment]
        self.handler.connection_made(transport)
        early, self._early = self._early, None
        for data in early or ():
            self.handler.data_received(data)

    def data_received(self, data: bytes) -> None:
        if self.handler is not None:
            self.handler.data_received(data)
        elif self._early is not None:
            self._early.append(data)

    def eof_received(self) -> bool | None:
        return self.handler.eof_received() if self.handler is not None else None

    def pause_writing(self) -> None:
        if self.handler is not None:
            self.handler.pause_writing()

    def resume_writing(self) -> None:
        if self.handler is not None:
            self.handler.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.forget(self)
        if self.handler is not None:
            self.handler.connection_lost(exc)

    def idle(self, now: float) -> bool:
        """No request in flight, none for a while, nothing left to send."""
        assert self.transport is not None
        return (
            self.in_flight == 0
            and now - self.ended >= self.guard.settle
            and self.transport.get_write_buffer_size() == 0
        )


class ConnectionGuard:
    """Admits, times and evicts the HTTP listener's connections (see the module doc)."""

    def __init__(
        self,
        *,
        max_connections: int,
        header_timeout: float,
        settle: float = SETTLE_SECONDS,
        tls: ssl.SSLContext | None = None,
        name: str = "HTTP",
        settings: tuple[str, str] = ("http.max_connections", "http.header_timeout_seconds"),
    ) -> None:
        """``name`` and ``settings`` (the cap's, the timeout's) are for the log lines."""
        self.name, self.settings = name, settings
        self.max_connections = max_connections
        self.header_timeout = header_timeout
        self.settle = settle
        self.tls = tls
        self.stats = ConnectionStats()
        # Insertion order is age. Fresh: no request started yet; served: at least one.
        self._fresh: dict[_Connection, None] = {}
        self._served: dict[_Connection, None] = {}
        self._by_transport: dict[asyncio.BaseTransport, _Connection] = {}
        self._log_timeout = Throttled(log, logging.INFO, LOG_EVERY_SECONDS)
        self._log_evicted = Throttled(log, logging.WARNING, LOG_EVERY_SECONDS)
        self._log_refused = Throttled(log, logging.WARNING, LOG_EVERY_SECONDS)
        self._log_handshake = Throttled(log, logging.INFO, LOG_EVERY_SECONDS)
        self.log_bad_request = Throttled(log, logging.WARNING, LOG_EVERY_SECONDS)

    def protocol_factory(self, server: web.Server) -> Callable[[], asyncio.Protocol]:
        return lambda: _Connection(self, server)

    def admit(self, conn: _Connection) -> bool:
        if len(self._fresh) + len(self._served) >= self.max_connections:
            victim = self._idlest()
            if victim is None:
                self.stats.closed["refused"] += 1
                self._log_refused(
                    "%s connections at the cap (%d), all busy: refused %r with a 503 (%s)",
                    self.name,
                    self.max_connections,
                    conn.peer,
                    self.settings[0],
                )
                return False
            self._close(victim, "evicted")
            self._log_evicted(
                "%s connections at the cap (%d): closed the oldest idle one, from %r, "
                "to admit %r (%s)",
                self.name,
                self.max_connections,
                victim.peer,
                conn.peer,
                self.settings[0],
            )
        assert conn.transport is not None
        self._fresh[conn] = None
        self._by_transport[conn.transport] = conn
        self.stats.open += 1
        conn.timer = asyncio.get_running_loop().call_later(
            self.header_timeout, self._header_timeout, conn
        )
        return True

    def forget(self, conn: _Connection) -> None:
        if conn.timer is not None:
            conn.timer.cancel()
            conn.timer = None
        if conn.transport is not None and self._by_transport.pop(conn.transport, None) is not None:
            self._fresh.pop(conn, None)
            self._served.pop(conn, None)
            self.stats.open -= 1

    def rebind(self, conn: _Connection, transport: asyncio.Transport) -> None:
        """After the TLS handshake: the connection's transport is the TLS one."""
        if conn.transport is not None and conn.transport in self._by_transport:
            del self._by_transport[conn.transport]
            self._by_transport[transport] = conn
        conn.transport = transport

    def handshake_failed(self, conn: _Connection, exc: BaseException) -> None:
        if conn.transport is None or conn.transport not in self._by_transport:
            return  # the guard closed it (header timeout, eviction) and counted that
        self.stats.tls_handshake_failures += 1
        self.forget(conn)
        self._log_handshake(
            "TLS handshake with %r failed: %s (a plain-HTTP client, or a certificate the "
            "other side does not accept; see http.web_config_file)",
            conn.peer,
            str(exc) or type(exc).__name__,
        )

    def bad_request(self, conn: _Connection, exc: HttpProcessingError) -> None:
        """aiohttp could not parse a request: it answers 400 and closes the connection."""
        self.stats.closed["bad_request"] += 1
        reason = " ".join(str(exc.message).split())[:200] or type(exc).__name__
        self.log_bad_request(
            "%s request from %r could not be parsed, answered 400 and closed: %s",
            self.name,
            conn.peer,
            reason,
        )

    @contextmanager
    def request(self, transport: asyncio.BaseTransport | None) -> Iterator[None]:
        """Marks the connection busy while a request is handled."""
        conn = self._by_transport.get(transport) if transport is not None else None
        if conn is None:
            yield
            return
        if conn.timer is not None:
            conn.timer.cancel()
            conn.timer = None
        if conn in self._fresh:
            del self._fresh[conn]
            self._served[conn] = None
        conn.in_flight += 1
        try:
            yield
        finally:
            conn.in_flight -= 1
            conn.ended = time.monotonic()

    def _idlest(self) -> _Connection | None:
        for conn in self._fresh:
            return conn
        now = time.monotonic()
        return next((c for c in self._served if c.idle(now)), None)

    def _header_timeout(self, conn: _Connection) -> None:
        conn.timer = None
        if conn in self._fresh:
            self._close(conn, "header_timeout")
            self._log_timeout(
                "closed the %s connection from %r: no complete request within %gs (%s)",
                self.name,
                conn.peer,
                self.header_timeout,
                self.settings[1],
            )

    def _close(self, conn: _Connection, reason: str) -> None:
        self.stats.closed[reason] += 1
        self.forget(conn)
        assert conn.transport is not None
        conn.transport.close()


class GuardedSite(web.BaseSite):
    """A TCP site whose connections pass through a :class:`ConnectionGuard`. ``listener``
    (what it is, the setting of its address) names it when its address cannot be bound."""

    __slots__ = ("_guard", "_host", "_listener", "_port", "port")

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        guard: ConnectionGuard,
        *,
        listener: tuple[str, str] = ("HTTP", "http.listen"),
    ) -> None:
        super().__init__(runner)
        self._host, self._port, self._guard = host, port, guard
        self._listener = listener
        self.port = port  # the bound port once started

    @property
    def name(self) -> str:
        scheme = "http" if self._guard.tls is None else "https"
        return f"{scheme}://{self._host}:{self.port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        try:
            self._server = await asyncio.get_running_loop().create_server(
                self._guard.protocol_factory(server), self._host, self._port, reuse_address=True
            )
        except OSError as exc:  # taken, not this machine's address, no permission
            raise listen_error(*self._listener, self._host, self._port, exc) from exc
        if self._server.sockets:
            self.port = int(self._server.sockets[0].getsockname()[1])
