"""A small HTTP/1.1 server on asyncio streams, for the agent's few read-only endpoints.

The agent serves four fixed GET paths from a cached snapshot; aiohttp (about 16 MB of
resident memory once imported, a quarter of the agent's) is far more than that needs.
This server does exactly what those endpoints need, and bounds everything a client
controls:

- requests: GET and HEAD (405 with ``Allow`` otherwise), origin-form or absolute-form
  targets, the query string ignored; keep-alive (HTTP/1.1 unless ``Connection: close``,
  HTTP/1.0 only with ``Connection: keep-alive``), pipelined requests answered in order;
- limits: the request head (request line and headers) at most ``MAX_HEAD`` bytes and
  ``MAX_HEADERS`` fields (431), a body at most ``MAX_BODY`` bytes, read and discarded
  (413; a chunked body is refused with 411), anything malformed 400; every error
  response closes the connection;
- time: a request head must arrive whole within ``HEAD_TIMEOUT`` of its first byte
  being awaited (slowloris), an idle keep-alive connection is closed after
  ``IDLE_TIMEOUT``, a response must be taken by the client within ``WRITE_TIMEOUT``;
  at most ``MAX_CONNECTIONS`` connections at once (more are closed at once);
- TLS through an ``ssl.SSLContext`` (the handshake bounded by ``HEAD_TIMEOUT``).

Handlers get a :class:`Request` and return a :class:`Response`; HEAD is answered from
GET's response without its body.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from email.utils import formatdate
from typing import Final
from urllib.parse import unquote

log = logging.getLogger("edge_agent.http")

MAX_HEAD: Final = 16 * 1024
MAX_HEADERS: Final = 100
MAX_BODY: Final = 64 * 1024
HEAD_TIMEOUT: Final = 10.0
IDLE_TIMEOUT: Final = 75.0  # as aiohttp's keep-alive; longer than any scrape interval
WRITE_TIMEOUT: Final = 30.0
MAX_CONNECTIONS: Final = 256
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
_TOKEN_CHARS: Final = frozenset(
    b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
)


@dataclass(frozen=True)
class Request:
    method: str
    path: str  # percent-decoded, without the query string
    headers: Mapping[str, str]  # names in lower case; repeated fields joined with ", "
    version: str = "HTTP/1.1"

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


_date_cache: list[object] = [0, ""]


def http_date() -> str:
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache[:] = [now, formatdate(now, usegmt=True)]
    return str(_date_cache[1])


def parse_head(head: bytes) -> tuple[str, str, str, dict[str, str]]:
    """Method, decoded path, version and headers of one request head (CRLF CRLF
    included); raises :class:`BadRequest`."""
    lines = head[:-4].split(b"\r\n")
    try:
        method_b, target_b, version_b = lines[0].split(b" ")
    except ValueError:
        raise BadRequest(400, "malformed request line") from None
    if not method_b or not set(method_b) <= _TOKEN_CHARS:
        raise BadRequest(400, "malformed method")
    if version_b not in (b"HTTP/1.1", b"HTTP/1.0"):
        if version_b.startswith(b"HTTP/") and len(version_b) == 8:
            raise BadRequest(505, "only HTTP/1.0 and HTTP/1.1")
        raise BadRequest(400, "malformed version")
    if len(lines) - 1 > MAX_HEADERS:
        raise BadRequest(431, f"more than {MAX_HEADERS} header fields")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not name or not set(name) <= _TOKEN_CHARS:
            raise BadRequest(400, "malformed header field")  # obs-fold included
        try:
            key, text = name.decode("ascii").lower(), value.strip(b" \t").decode("latin-1")
        except UnicodeDecodeError:
            raise BadRequest(400, "malformed header field") from None
        if any(c in text for c in "\r\n\0"):
            raise BadRequest(400, "malformed header value")
        headers[key] = f"{headers[key]}, {text}" if key in headers else text
    return method_b.decode(), _path(target_b), version_b.decode(), headers


def _path(target: bytes) -> str:
    try:
        text = target.decode("ascii")
    except UnicodeDecodeError:
        raise BadRequest(400, "non-ASCII request target") from None
    if text.startswith(("http://", "https://")):  # absolute form: keep the path
        rest = text.split("://", 1)[1]
        text = "/" + rest.split("/", 1)[1] if "/" in rest else "/"
    if not text.startswith("/"):
        raise BadRequest(400, "malformed request target")
    path = unquote(text.split("?", 1)[0].split("#", 1)[0], errors="strict")
    if "\0" in path:
        raise BadRequest(400, "malformed request target")
    return path


def encode_response(resp: Response, *, head_only: bool, close: bool) -> bytes:
    lines = [f"HTTP/1.1 {resp.status} {REASONS.get(resp.status, 'Unknown')}"]
    lines += [f"{k}: {v}" for k, v in resp.headers.items()]
    lines.append(f"Content-Length: {len(resp.body)}")
    lines.append(f"Date: {http_date()}")
    if close:
        lines.append("Connection: close")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return head if head_only else head + resp.body


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
        self.connections: dict[asyncio.Task[None], asyncio.StreamWriter] = {}
        self.requests = 0
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
        for writer in self.connections.values():
            writer.transport.abort()  # a pending read ends; the connection's task returns
        if self.connections:
            _done, stuck = await asyncio.wait(list(self.connections), timeout=1.0)
            for task in stuck:
                task.cancel()
        if self._server is not None:
            await self._server.wait_closed()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if len(self.connections) >= MAX_CONNECTIONS:
            writer.close()
            return
        self.connections[task] = writer
        try:
            await self._serve(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError, ssl.SSLError):
            pass
        except asyncio.CancelledError:
            pass  # only cleanup() cancels, and the task ends here (asyncio's stream
            # server would log a cancelled connection task as an error)
        finally:
            del self.connections[task]
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first = True
        while True:
            try:
                head = await self._read_head(reader, first)
                if head is None:
                    return  # the client closed, or idle too long
                method, path, version, headers = parse_head(head)
                await self._skip_body(reader, headers)
            except BadRequest as exc:
                await self._send(writer, Response.text(f"{exc}\n", exc.status), False, True)
                return
            first = False
            req = Request(method, path, headers, version)
            conn = headers.get("connection", "").lower()
            keep = "keep-alive" in conn if version == "HTTP/1.0" else "close" not in conn
            resp = await self._respond(req)
            await self._send(writer, resp, method == "HEAD", not keep)
            if not keep:
                return

    async def _read_head(self, reader: asyncio.StreamReader, first: bool) -> bytes | None:
        """The next request head, or None when the client closed or stayed idle; its
        first byte may wait ``IDLE_TIMEOUT`` on a kept-alive connection, the rest of it
        then has ``HEAD_TIMEOUT``."""
        try:
            async with asyncio.timeout(HEAD_TIMEOUT if first else IDLE_TIMEOUT):
                start = await reader.readexactly(1)
        except (TimeoutError, asyncio.IncompleteReadError):
            return None
        try:
            async with asyncio.timeout(HEAD_TIMEOUT):
                head = start + await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            raise BadRequest(400, "incomplete request head") from None
        except asyncio.LimitOverrunError:
            raise BadRequest(431, f"request head over {MAX_HEAD} bytes") from None
        except TimeoutError:
            raise BadRequest(408, "request head not received in time") from None
        return head.lstrip(b"\r\n")  # RFC 9112 2.2: ignore empty lines before a request

    async def _skip_body(self, reader: asyncio.StreamReader, headers: Mapping[str, str]) -> None:
        if "transfer-encoding" in headers:
            raise BadRequest(411, "a request body must come with Content-Length")
        length = headers.get("content-length", "0")
        if not (length.isascii() and length.isdigit()) or len(length) > 18:  # "²".isdigit()
            raise BadRequest(400, "malformed Content-Length")
        size = int(length)
        if size > MAX_BODY:
            raise BadRequest(413, f"request body over {MAX_BODY} bytes")
        if size:
            try:
                async with asyncio.timeout(HEAD_TIMEOUT):
                    await reader.readexactly(size)
            except TimeoutError:
                raise BadRequest(408, "request body not received in time") from None

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
        self, writer: asyncio.StreamWriter, resp: Response, head_only: bool, close: bool
    ) -> None:
        writer.write(encode_response(resp, head_only=head_only, close=close))
        async with asyncio.timeout(WRITE_TIMEOUT):
            await writer.drain()
