"""What the gateway's address said first, so that a peer that is not an SSH server is named
as one: not "cannot reach gateway HOST:PORT: Connection lost".

``asyncssh.connect(tunnel=Greeting(sock))`` runs SSH over the socket the agent dialled, as
``sock=`` does, through a small protocol that keeps the first bytes the peer sends until a
line starting ``SSH-`` has come (RFC 4253 lets a server send other lines before its version
line). Then it steps aside (``transport.set_protocol``) and asyncssh reads the socket
directly. When the handshake fails before such a line, :meth:`Greeting.failure` explains it
by what came instead: an HTTP server's ``HTTP/1.1 400 Bad Request``, a TLS alert, nothing.
What the peer sent is data: quoted, non-printable bytes escaped, cut short.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Any

from asyncssh.logging import logger as asyncssh_logger

from gpurelay.compat import TIMEOUTS

_KEEP = 1024  # bytes kept while waiting for the SSH line; past that, asyncssh decides alone
_SHOWN = 60  # bytes of the peer's first line quoted


class Greeting:
    """asyncssh's ``tunnel`` for one dialled socket; ``heard`` keeps what the peer sent
    before its SSH version line, ``greeted`` says whether that line came."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.heard = bytearray()
        self.greeted = False
        self.logger = _SocketLog()

    async def create_connection(
        self, session_factory: Callable[[], Any], remote_host: str, remote_port: int
    ) -> tuple[Any, Any]:
        """asyncssh's tunnel interface: its connection, on our socket (host and port are
        where the socket goes already)."""
        loop = asyncio.get_running_loop()
        transport, tap = await loop.create_connection(
            lambda: _Tap(self, session_factory()), sock=self._sock
        )
        return transport, tap.session

    def close(self) -> None:
        """asyncssh's tunnel interface; the connection closes the socket itself."""

    async def wait_closed(self) -> None:
        """asyncssh's tunnel interface."""

    def failure(self, address: str, timeout: float, exc: BaseException) -> tuple[str, str]:
        """(failure reason, message) for a handshake with ``address`` that failed with
        ``exc``: ``connect`` and ``default`` when the peer greeted as an SSH server."""
        if self.greeted:
            return "connect", f"cannot reach gateway {address}: {exc}"
        if self.heard:
            lines = bytes(self.heard).strip().splitlines()
            line = lines[0] if lines else bytes(self.heard)
            shown = repr(line[:_SHOWN])[2:-1] + ("..." if len(line) > _SHOWN else "")
            return "not_ssh", (
                f"gateway {address} answered but is not an SSH server (it sent '{shown}')"
            )
        if isinstance(exc, TIMEOUTS):
            return "no_greeting", (
                f"gateway {address} accepted the connection but sent no SSH greeting within "
                f"{timeout:g}s (not an SSH server, or one too busy to answer)"
            )
        return "no_greeting", (
            f"gateway {address} accepted the connection and closed it without an SSH "
            "greeting (not an SSH server, or one turning connections away)"
        )


class _Tap(asyncio.Protocol):
    """Passes everything to asyncssh's connection, keeping a copy of the greeting."""

    def __init__(self, greeting: Greeting, session: asyncio.Protocol) -> None:
        self._greeting = greeting
        self.session = session
        self._transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        self.session.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        g = self._greeting
        g.heard += data[: _KEEP - len(g.heard)]
        g.greeted = g.heard.startswith(b"SSH-") or b"\nSSH-" in g.heard
        if (g.greeted or len(g.heard) >= _KEEP) and self._transport is not None:
            self._transport.set_protocol(self.session)  # asyncssh reads alone from here
        self.session.data_received(data)

    def eof_received(self) -> bool | None:
        return self.session.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self.session.connection_lost(exc)

    def pause_writing(self) -> None:
        self.session.pause_writing()

    def resume_writing(self) -> None:
        self.session.resume_writing()


class _SocketLog:
    """The ``logger`` asyncssh announces a tunnelled connection with ("... via SSH
    tunnel"): it says what it says for a socket handed over (``sock=``), which this is."""

    def info(self, msg: object, *args: object) -> None:
        asyncssh_logger.info("%s already-connected socket", args[0] if args else msg)
