"""One HTTP/1.1 exchange at a time with an upstream over an SSH channel, framed by h11.

:func:`request_target` turns the path and query the proxy was given (decoded, from the
path form, or as sent, from the forward-proxy form) into a request target of RFC 3986
characters only: everything else, control bytes, space, CR/LF and non-ASCII included,
is percent-encoded, and a ``%`` that starts no valid escape becomes ``%25``. h11 then
writes the request line and headers (and would refuse CR/LF in either, which we never
give it) and parses the response: a head of at most :data:`MAX_HEADER_BYTES`, then the
body as the response frames it (Content-Length, chunked, or until the upstream closes).

:class:`UpstreamChannel` says whether it can carry another request: only after a
complete response to a complete request, with no byte left over and no close announced
(:meth:`UpstreamChannel.reusable`). While it waits in the pool it watches its channel;
anything that arrives unasked, or the upstream closing, makes it unusable
(:meth:`UpstreamChannel.park`, :meth:`UpstreamChannel.unpark`).

Time is the caller's to bound (the proxy runs each exchange under the scrape deadline).

:func:`sandbox` is what every answer of the proxy says to a browser: a node's page is
served from the gateway's origin, where an operator's browser holds its credentials, so
it must neither run script there (``Content-Security-Policy: sandbox`` gives it an
opaque origin of its own), nor be sniffed into HTML, nor be framed; and the headers with
which a response sets policy for the whole origin (cookies, CORS, HSTS, Clear-Site-Data,
reporting) are the gateway's to set, never a node's.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable
from urllib.parse import quote

import asyncssh
import h11
from multidict import CIMultiDict

MAX_HEADER_BYTES = 64 * 1024  # the response's status line and headers, together
CHUNK = 65536
# RFC 3986 pchar without "%" (kept only where it starts an escape), then "?" in the query.
_SAFE_PATH = "/:@!$&'()*+,;=-._~"
_SAFE_QUERY = _SAFE_PATH + "?"
_LONE_PERCENT = re.compile(r"%(?![0-9A-Fa-f]{2})")
# On every answer of the proxy, in place of whatever the node said.
SANDBOX_HEADERS = (
    ("Content-Security-Policy", "sandbox"),
    ("X-Content-Type-Options", "nosniff"),
    ("X-Frame-Options", "DENY"),
)
# A node's headers that would loosen those or set policy for the gateway's whole origin.
_ORIGIN_WIDE = frozenset(
    h.lower()
    for h in (
        "Content-Security-Policy", "Content-Security-Policy-Report-Only",
        "X-Content-Type-Options", "X-Frame-Options", "Set-Cookie", "Set-Cookie2",
        "Strict-Transport-Security", "Clear-Site-Data", "Service-Worker-Allowed",
        "Alt-Svc", "NEL", "Report-To", "Reporting-Endpoints",
    )
)  # fmt: skip


class UpstreamError(Exception):
    """The upstream broke HTTP: a malformed or oversized head, bad framing, or it closed
    the channel in the middle of a response."""


def _encode(text: str, safe: str) -> str:
    return _LONE_PERCENT.sub("%25", quote(text, safe=safe + "%", errors="surrogateescape"))


def request_target(path_qs: str) -> bytes:
    """The request target for ``path_qs``: printable ASCII without space, never empty.

    Existing ``%XX`` escapes are kept, so a target that is already encoded passes
    unchanged; a decoded one is encoded again (a literal ``?`` in a decoded path still
    starts the query: the path form cannot tell it from the real one)."""
    path, sep, query = path_qs.partition("?")
    target = _encode(path, _SAFE_PATH) or "/"
    if not target.startswith("/"):
        target = "/" + target
    if sep:
        target += "?" + _encode(query, _SAFE_QUERY)
    return target.encode("ascii")


def header_bytes(text: str) -> bytes:
    """A header name or value back to the bytes the client sent (aiohttp decodes them as
    UTF-8 with surrogate escapes)."""
    return text.encode("utf-8", errors="surrogateescape")


def origin_wide(name: str) -> bool:
    """True for a response header a node may not send to a browser through the proxy."""
    name = name.lower()
    return name in _ORIGIN_WIDE or name.startswith("access-control-")


def sandbox(headers: CIMultiDict[str]) -> None:
    """Take the :func:`origin_wide` headers out of a response's ``headers`` (a node's,
    passed on) and put :data:`SANDBOX_HEADERS` in."""
    for name in {n for n in headers if origin_wide(n)}:
        del headers[name]
    headers.update(SANDBOX_HEADERS)


class UpstreamChannel:
    """An SSH channel to one NODE:PORT and the h11 state of the HTTP exchange on it."""

    def __init__(
        self,
        conn: asyncssh.SSHServerConnection,
        reader: asyncssh.SSHReader[bytes],
        writer: asyncssh.SSHWriter[bytes],
    ) -> None:
        self.conn = conn
        self._reader = reader
        self._writer = writer
        self._http = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEADER_BYTES)
        self._watch: asyncio.Task[bytes] | None = None
        self._on_activity: Callable[[], None] | None = None

    def send(self, request: h11.Request, body: bytes) -> None:
        """Write the whole request: its head, ``body`` (framed by the request's
        Content-Length) and its end."""
        data = self._http.send(request) or b""
        if body:
            data += self._http.send(h11.Data(data=body)) or b""
        data += self._http.send(h11.EndOfMessage()) or b""
        self._writer.write(data)

    async def _next_event(self) -> h11.Event:
        try:
            while True:
                event = self._http.next_event()
                if isinstance(event, h11.Event):
                    return event
                if event is h11.PAUSED:  # never while a response is due
                    raise UpstreamError("h11 paused in the middle of a response")
                self._http.receive_data(await self._reader.read(CHUNK))  # b"": closed
        except h11.RemoteProtocolError as exc:
            if exc.error_status_hint == 431:  # h11's max_incomplete_event_size
                raise UpstreamError(f"head larger than {MAX_HEADER_BYTES // 1024} KiB") from exc
            raise UpstreamError(str(exc)) from exc

    async def response(self) -> h11.Response:
        """The final response's head (interim 1xx responses are skipped)."""
        while True:
            event = await self._next_event()
            if isinstance(event, h11.Response):
                return event
            if not isinstance(event, h11.InformationalResponse):
                raise UpstreamError("connection closed before a response")

    async def body(self) -> AsyncIterator[bytes]:
        """The response body, piece by piece, up to its framed end."""
        while True:
            event = await self._next_event()
            if isinstance(event, h11.Data):
                yield bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                return
            else:
                raise UpstreamError("connection closed in the middle of a response")

    def reusable(self) -> bool:
        """True, with h11 ready for the next request, only after a complete request and a
        complete response, nothing received beyond it and no close announced."""
        http = self._http
        if http.our_state is not h11.DONE or http.their_state is not h11.DONE:
            return False
        if any(http.trailing_data) or self._writer.is_closing():
            return False
        try:
            http.start_next_cycle()
        except h11.LocalProtocolError:
            return False
        return True

    def park(self, on_activity: Callable[[], None]) -> None:
        """Idle in the pool: call ``on_activity`` if the upstream sends anything or closes."""
        self._on_activity = on_activity
        self._watch = asyncio.ensure_future(self._reader.read(1))
        self._watch.add_done_callback(self._watched)

    def _watched(self, task: asyncio.Task[bytes]) -> None:
        if not task.cancelled():
            task.exception()  # a byte, EOF or an error: all the same, the channel is done
        if self._on_activity is not None:
            self._on_activity()

    async def unpark(self) -> bool:
        """Leave the pool: True if the channel stayed quiet and can carry a request."""
        watch, self._watch, self._on_activity = self._watch, None, None
        if watch is None or watch.done():
            return False
        watch.remove_done_callback(self._watched)
        watch.cancel()
        await asyncio.wait([watch])  # the read must be over before ours begins
        return watch.cancelled()

    def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        self._writer.close()
