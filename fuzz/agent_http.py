"""Fuzz target: the agent's own HTTP server (:mod:`edge_agent.httpd`), one connection's
worth of client bytes through ``HttpServer._connection`` on a real event loop and a real
:class:`asyncio.StreamReader`, with a fake writer in place of the socket (no sockets).

Contract: nothing escapes the connection's task (an exception there is a traceback in the
agent's log and no answer, as ``GET /%ff`` once was); nothing a client sends is logged;
what the server writes is empty or starts with an HTTP/1.1 status line whose status this
server knows; the connection's slot is given back. The routes are the agent's own
(:func:`edge_agent.http_server.make_app`, before a first collection) behind its basic
auth, with a user list that refuses every pair without a bcrypt.

Input: a control byte (its low bits pick the chunking, ``common.split``: each chunk
arrives on its own turn of the loop), then the bytes the client sends before it closes.
"""

from __future__ import annotations

import asyncio
import logging
import re
import sys

import atheris

with atheris.instrument_imports(
    include=["edge_agent.httpd", "edge_agent.http_server", "h11", "common"]
):
    from common import split

    from edge_agent.http_server import LatestSnapshot, make_app
    from edge_agent.httpd import REASONS

STATUS_LINE = re.compile(rb"HTTP/1\.1 (\d{3}) ")


class FakeTransport:
    def __init__(self) -> None:
        self.closed = False

    def get_write_buffer_size(self) -> int:
        return 0

    def close(self) -> None:
        self.closed = True

    abort = close


class FakeWriter:
    """What ``HttpServer`` uses of an :class:`asyncio.StreamWriter`."""

    def __init__(self) -> None:
        self.transport = FakeTransport()
        self.out = bytearray()

    def write(self, data: bytes) -> None:
        assert not self.transport.closed, "written after close"
        self.out += data

    async def drain(self) -> None:
        pass

    def is_closing(self) -> bool:
        return self.transport.closed

    def close(self) -> None:
        self.transport.close()

    def get_extra_info(self, name: str) -> object:
        return ("127.0.0.1", 1) if name == "peername" else None


class Loud(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        raise AssertionError(f"logged: {record.getMessage()!r}")


class NoUsers:
    """``basic_auth_users`` without bcrypt: no user name and password pair is right."""

    async def verify(self, user: str, password: str, *, source: str | None = None) -> bool:
        return False


async def one_connection(chunks: tuple[bytes, ...]) -> bytes:
    server = make_app(LatestSnapshot(), NoUsers())  # type: ignore[arg-type]
    reader = asyncio.StreamReader(limit=1 << 16)
    writer = FakeWriter()

    async def client() -> None:
        for chunk in chunks:
            reader.feed_data(chunk)
            await asyncio.sleep(0)
        reader.feed_eof()

    feeding = asyncio.ensure_future(client())
    await server._connection(reader, writer)  # type: ignore[arg-type]
    await feeding
    assert not server.connections, "a slot was not given back"
    assert writer.transport.closed, "the connection was left open"
    return bytes(writer.out)


LOOP = asyncio.new_event_loop()


def test_one_input(data: bytes) -> None:
    if not data:
        return
    control, rest = data[0], data[1:]
    out = LOOP.run_until_complete(one_connection(split(rest, control)))
    if out:
        match = STATUS_LINE.match(out)
        assert match is not None, out[:200]
        assert int(match[1]) in REASONS, out[:200]


def main() -> None:
    logging.getLogger().addHandler(Loud())
    logging.getLogger().setLevel(logging.DEBUG)
    asyncio.get_event_loop_policy().set_event_loop(LOOP)
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
