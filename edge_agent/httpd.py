"""A small HTTP/1.1 server on asyncio streams, for the agent's few read-only endpoints.

The agent serves four fixed GET paths from a cached snapshot; aiohttp (about 16 MB of
resident memory once imported, a quarter of the agent's) is far more than that needs.
h11 parses and frames HTTP, as in uvicorn's ``h11_impl``; this module owns the
connections, their time and the cap, and bounds everything a client controls:

- requests: GET and HEAD (405 with ``Allow`` otherwise), origin-form or absolute-form
  targets, the query string ignored; keep-alive and pipelining as h11 has them (HTTP/1.1
  unless ``Connection: close``; an HTTP/1.0 connection closes after its response);
- limits: the request head (request line and headers) at most ``MAX_HEAD`` bytes and
  ``MAX_HEADERS`` fields (431), a body at most ``MAX_BODY`` bytes, read and discarded
  (413; a chunked body is refused with 411), a path that is not UTF-8 once
  percent-decoded, or anything h11 refuses, 400; every error response closes the
  connection, and none is logged (any client could flood the log);
- time: a request head must arrive whole within ``HEAD_TIMEOUT`` of its first byte
  being awaited (slowloris), an idle keep-alive connection is closed after
  ``IDLE_TIMEOUT``, a response must be taken by the client within ``WRITE_TIMEOUT``;
- the cap: at ``MAX_CONNECTIONS`` a new connection makes room by closing the oldest idle
  one, as the gateway's ``ConnectionGuard`` does: first one that has not yet sent a whole
  request, else a kept-alive one answered at least ``SETTLE_SECONDS`` ago with nothing
  left to send. Only when every connection is busy is the new one refused (a 503). A
  client holding the cap's worth of idle connections thus cannot keep the liveness
  probe (``/healthz``) or a scrape out;
- TLS through an ``ssl.SSLContext`` (the handshake bounded by ``HEAD_TIMEOUT``).

Handlers get a :class:`Request` and return a :class:`Response`; HEAD is answered from
GET's response without its body.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from email.utils import formatdate
from typing import Final
from urllib.parse import unquote_to_bytes

import h11

from gpurelay import compat
from gpurelay.compat import TIMEOUTS
from gpurelay.logs import Throttled

log = logging.getLogger("edge_agent.http")

MAX_HEAD: Final = 16 * 1024
MAX_HEADERS: Final = 100
MAX_BODY: Final = 64 * 1024
HEAD_TIMEOUT: Final = 10.0
IDLE_TIMEOUT: Final = 75.0  # as aiohttp's keep-alive; longer than any scrape interval
WRITE_TIMEOUT: Final = 30.0
MAX_CONNECTIONS: Final = 256
# A kept-alive connection is evicted only this long after its response was handed to the
# kernel: a client's next request may be on its way, and would meet a reset.
SETTLE_SECONDS: Final = 0.5
LOG_EVERY_SECONDS: Final = 10.0
READ_SIZE: Final = 16 * 1024
REASONS: Final = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    411: "Length Required",
    413: "Content Too Large",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
    505: "HTTP Version Not Supported",
}


@dataclass(frozen=True)
class Request:
    method: str
    path: str  # percent-decoded, without the query string
    headers: Mapping[str, str]  # names in lower case; repeated fields joined with ", "
    version: str = "HTTP/1.1"
    peer: str = ""  # the client's address (for per-source limits), "" where unknown

    def header(self, name: str, default: str = "") -> str:
        return self.headers.get(name.lower(), default)


@dataclass
class Response:
    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def text(cls, text: str, status: int = 200, **headers: str) -> Response:
        return cls(status, text.encode(), {"Content-Type": "text/plain; charset=utf-8", **headers})


Handler = Callable[[Request], Awaitable[Response]]


class BadRequest(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


class _Idle(Exception):
    """The client closed, or sent nothing of a next request in time: close quietly."""


_date_cache: list[object] = [0, ""]


def closing_answer(status: int, text: str, **headers: str) -> bytes:
    """A whole response that closes the connection, for when h11 has no request to answer
    (the 503 at the cap, a 408 while a head is still arriving)."""
    body = text.encode()
    lines = [f"HTTP/1.1 {status} {REASONS[status]}", "Content-Type: text/plain; charset=utf-8"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    lines += [f"Content-Length: {len(body)}", f"Date: {http_date()}", "Connection: close"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def http_date() -> str:
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache[:] = [now, formatdate(now, usegmt=True)]
    return str(_date_cache[1])


def request_from(event: h11.Request, peer: str = "") -> Request:
    """Our :class:`Request` from h11's, within our limits; raises :class:`BadRequest`."""
    if event.http_version not in (b"1.0", b"1.1"):
        raise BadRequest(505, "only HTTP/1.0 and HTTP/1.1")
    if len(event.headers) > MAX_HEADERS:
        raise BadRequest(431, f"more than {MAX_HEADERS} header fields")
    # h11 bounds an incomplete head only; one that arrived whole is measured here
    size = len(event.method) + len(event.target) + 12
    size += sum(len(name) + len(value) + 4 for name, value in event.headers)
    if size > MAX_HEAD:
        raise BadRequest(431, f"request head over {MAX_HEAD} bytes")
    headers: dict[str, str] = {}
    for name_b, value_b in event.headers:
        key, text = name_b.decode("ascii"), value_b.decode("latin-1")
        headers[key] = f"{headers[key]}, {text}" if key in headers else text
    if "transfer-encoding" in headers:
        raise BadRequest(411, "a request body must come with Content-Length")
    length = headers.get("content-length", "0")  # h11 has checked it is a number
    if len(length) > 18 or int(length) > MAX_BODY:
        raise BadRequest(413, f"request body over {MAX_BODY} bytes")
    version = "HTTP/" + event.http_version.decode()
    return Request(event.method.decode("ascii"), _path(event.target), headers, version, peer)


def _path(target: bytes) -> str:
    """The percent-decoded path of an origin-form or absolute-form target (h11 has checked
    it is visible ASCII)."""
    text = target.decode("ascii")
    if text.startswith(("http://", "https://")):  # absolute form: keep the path
        rest = text.split("://", 1)[1]
        text = "/" + rest.split("/", 1)[1] if "/" in rest else "/"
    if not text.startswith("/"):
        raise BadRequest(400, "malformed request target")
    try:
        path = unquote_to_bytes(text.split("?", 1)[0].split("#", 1)[0]).decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequest(400, "the request path is not UTF-8 once decoded") from None
    if "\0" in path:
        raise BadRequest(400, "malformed request target")
    return path


@dataclass(eq=False)
class _Conn:
    task: asyncio.Task[None]
    writer: asyncio.StreamWriter
    peer: object
    answered: float = 0.0  # monotonic time its last response was handed to the kernel
    evicted: bool = False

    def settled(self, now: float) -> bool:
        return (
            now - self.answered >= SETTLE_SECONDS
            and self.writer.transport.get_write_buffer_size() == 0
        )


class HttpServer:
    """Routes (exact paths, GET and HEAD) on one listening socket."""

    def __init__(
        self,
        routes: Mapping[str, Handler],
        *,
        guard: Callable[[Request, Handler], Awaitable[Response]] | None = None,
    ) -> None:
        self.routes = dict(routes)
        self.guard = guard  # e.g. basic auth: called with the request and the router
        self.connections: dict[asyncio.Task[None], _Conn] = {}
        self.requests = 0
        self.closed: Counter[str] = Counter(evicted=0, refused=0)
        # Insertion order is age. Fresh: no whole request yet; kept: answered, waiting for
        # the next. A connection handling a request or sending its response is in neither.
        self._fresh: dict[_Conn, None] = {}
        self._kept: dict[_Conn, None] = {}
        self._log_evicted = Throttled(log, logging.WARNING, LOG_EVERY_SECONDS)
        self._log_refused = Throttled(log, logging.WARNING, LOG_EVERY_SECONDS)
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None) -> int:
        """Listen (port 0 picks one); returns the bound port."""
        self._server = await asyncio.start_server(
            self._connection,
            host,
            port,
            ssl=ssl_context,
            ssl_handshake_timeout=HEAD_TIMEOUT if ssl_context else None,
            reuse_address=True,
            limit=MAX_HEAD,
        )
        return int(self._server.sockets[0].getsockname()[1])

    async def cleanup(self) -> None:
        """Stop listening and close every connection."""
        if self._server is not None:
            self._server.close()
        for conn in self.connections.values():
            conn.writer.transport.abort()  # a pending read ends; the connection's task returns
        if self.connections:
            _done, stuck = await asyncio.wait(list(self.connections), timeout=1.0)
            for task in stuck:
                task.cancel()
        if self._server is not None:
            await self._server.wait_closed()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        conn = _Conn(task, writer, writer.get_extra_info("peername"))
        if not self._admit(conn):
            busy = closing_answer(
                503, "too many busy connections, try again\n", **{"Retry-After": "1"}
            )
            writer.write(busy)
            writer.close()
            return
        self.connections[task] = conn
        try:
            await self._serve(reader, conn)
        except (ConnectionError, *TIMEOUTS, ssl.SSLError, _Idle):
            pass
        except asyncio.CancelledError:
            pass  # only cleanup() cancels, and the task ends here (asyncio's stream
            # server would log a cancelled connection task as an error)
        finally:
            self.connections.pop(task, None)  # gone already when evicted
            self._forget(conn)
            writer.close()

    def _admit(self, conn: _Conn) -> bool:
        if len(self.connections) >= MAX_CONNECTIONS:
            victim = next(iter(self._fresh), None)
            if victim is None:
                now = time.monotonic()
                victim = next((c for c in self._kept if c.settled(now)), None)
            if victim is None:
                self.closed["refused"] += 1
                self._log_refused(
                    "HTTP connections at the cap (%d), all busy: refused %r with a 503",
                    MAX_CONNECTIONS,
                    conn.peer,
                )
                return False
            self._forget(victim)
            victim.evicted = True
            victim.writer.transport.close()  # its task sees the end of file and returns
            del self.connections[victim.task]
            self.closed["evicted"] += 1
            self._log_evicted(
                "HTTP connections at the cap (%d): closed the oldest idle one, from %r, "
                "to admit %r",
                MAX_CONNECTIONS,
                victim.peer,
                conn.peer,
            )
        self._fresh[conn] = None
        return True

    def _forget(self, conn: _Conn) -> None:
        self._fresh.pop(conn, None)
        self._kept.pop(conn, None)

    async def _serve(self, reader: asyncio.StreamReader, conn: _Conn) -> None:
        h = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        first = True
        while True:
            head = False  # h11 frames a response to HEAD without a body, errors too
            try:
                event = await self._next_request(reader, h, first)
                head = event.method == b"HEAD"
                req = request_from(event, _host(conn.peer))
                await self._skip_body(reader, h)
            except (h11.RemoteProtocolError, BadRequest) as exc:
                code = exc.status if isinstance(exc, BadRequest) else exc.error_status_hint
                error = Response.text(f"{exc}\n", code if code in REASONS else 400)
                await self._send(conn, h, error, close=True, head_only=head)
                return
            first = False
            self._forget(conn)  # busy: not to be evicted until it is answered
            resp = await self._respond(req)
            await self._send(conn, h, resp, close=False, head_only=head)
            if h.our_state is h11.MUST_CLOSE:
                return
            h.start_next_cycle()
            if not conn.evicted:
                self._kept[conn] = None

    async def _next_request(
        self, reader: asyncio.StreamReader, h: h11.Connection, first: bool
    ) -> h11.Request:
        """The next request's head; its first byte may wait ``IDLE_TIMEOUT`` on a
        kept-alive connection, the whole head then has ``HEAD_TIMEOUT``."""
        started = False
        while True:
            event = h.next_event()
            if isinstance(event, h11.Request):
                return event
            if event is h11.PAUSED or isinstance(event, h11.ConnectionClosed):
                raise _Idle
            if h.their_state is h11.IDLE and h.trailing_data[0] == b"" and not started:
                wait = HEAD_TIMEOUT if first else IDLE_TIMEOUT
            else:
                wait, started = HEAD_TIMEOUT, True
            data = await self._read(reader, wait, started)
            h.receive_data(data)

    async def _read(self, reader: asyncio.StreamReader, wait: float, started: bool) -> bytes:
        try:
            async with compat.timeout(wait):
                return await reader.read(READ_SIZE)
        except TIMEOUTS:
            if not started:
                raise _Idle from None
            raise BadRequest(408, "request not received in time") from None

    async def _skip_body(self, reader: asyncio.StreamReader, h: h11.Connection) -> None:
        size = 0
        while True:
            event = h.next_event()
            if isinstance(event, h11.EndOfMessage):
                return
            if isinstance(event, h11.Data):
                size += len(event.data)
                if size > MAX_BODY:
                    raise BadRequest(413, f"request body over {MAX_BODY} bytes")
            elif event is h11.NEED_DATA:
                h.receive_data(await self._read(reader, HEAD_TIMEOUT, True))
            elif isinstance(event, h11.ConnectionClosed):
                raise _Idle

    async def _respond(self, req: Request) -> Response:
        self.requests += 1
        try:
            if self.guard is not None:  # before routing: unknown paths are guarded too
                return await self.guard(req, self._dispatch)
            return await self._dispatch(req)
        except Exception:
            log.exception("handling %s %s", req.method, req.path)
            return Response.text("500: Internal Server Error\n", 500)

    async def _dispatch(self, req: Request) -> Response:
        handler = self.routes.get(req.path)
        if handler is None:
            return Response.text("404: Not Found\n", 404)
        if req.method not in ("GET", "HEAD"):
            return Response.text("405: Method Not Allowed\n", 405, Allow="GET, HEAD")
        return await handler(req)

    async def _send(
        self,
        conn: _Conn,
        h: h11.Connection,
        resp: Response,
        *,
        close: bool,
        head_only: bool = False,
    ) -> None:
        """The response through h11 (it adds ``Connection: close`` where the connection
        cannot be kept); a HEAD request gets the head alone."""
        if conn.writer.is_closing():
            return
        if h.our_state is h11.IDLE and h.their_state is not h11.ERROR:  # no request yet
            conn.writer.write(closing_answer(resp.status, resp.body.decode()))
            h.send(h11.ConnectionClosed())
        else:
            conn.writer.write(self._encode(h, resp, close=close, head_only=head_only))
        async with compat.timeout(WRITE_TIMEOUT):
            await conn.writer.drain()
        conn.answered = time.monotonic()

    @staticmethod
    def _encode(h: h11.Connection, resp: Response, *, close: bool, head_only: bool) -> bytes:
        headers = [*resp.headers.items(), ("Content-Length", str(len(resp.body)))]
        headers.append(("Date", http_date()))
        if close:
            headers.append(("Connection", "close"))
        reason = REASONS.get(resp.status, "Unknown")
        data = h.send(h11.Response(status_code=resp.status, headers=headers, reason=reason))
        if resp.body and not head_only:
            data = (data or b"") + (h.send(h11.Data(data=resp.body)) or b"")
        return (data or b"") + (h.send(h11.EndOfMessage()) or b"")


def _host(peer: object) -> str:
    """The address part of a peername ((host, port) for IP, a path or "" for Unix)."""
    return str(peer[0]) if isinstance(peer, tuple) and peer else ""
