"""Fuzz target: the gateway proxy's HTTP handling (:mod:`cloud_gateway.relay.upstream`).

Two modes, picked by the control byte's top bit:

- *response* (bit clear): the bytes are what the node's endpoint answers on the SSH
  channel. :class:`UpstreamChannel` runs over a fake reader and writer (no sockets, no
  event loop: the fake never waits, so ``common.run_sync`` drives the coroutines) for up
  to three keep-alive exchanges. Contract: ``response()`` and ``body()`` raise nothing but
  :class:`UpstreamError`; ``reusable()`` answers and raises nothing; a body is never longer
  than what arrived. Bit 6 asks with HEAD rather than GET; the low bits pick the chunking.
- *target* (bit set): the bytes become the path and query a client asked for (bit 6: any
  code points, lone surrogates included; else UTF-8 with surrogate escapes, as aiohttp
  decodes). Contract of :func:`request_target`: printable ASCII, no space, starts with
  ``/``, every ``%`` starts an escape, h11 accepts it, it is a fixed point (an encoded
  target passes unchanged), and it stands for the same bytes when nothing was escaped.
"""

from __future__ import annotations

import re
import sys
from urllib.parse import unquote_to_bytes

import atheris

with atheris.instrument_imports(include=["cloud_gateway.relay.upstream", "h11", "common"]):
    import h11
    from common import run_sync, split

    from cloud_gateway.relay.upstream import UpstreamChannel, UpstreamError, request_target

TARGET = 0x80
HEAD = 0x40
HOST = [(b"Host", b"edge-node-1:9400")]
ESCAPABLE = range(0xDC80, 0xDD00)  # what errors="surrogateescape" can encode
LONE_PERCENT = re.compile(rb"%(?![0-9A-Fa-f]{2})")


class FakeReader:
    """An SSH channel's reader that hands out the fuzz input, then end of file."""

    def __init__(self, chunks: tuple[bytes, ...]) -> None:
        self._chunks = list(reversed(chunks))

    async def read(self, n: int = -1) -> bytes:
        if not self._chunks:
            return b""
        chunk = self._chunks.pop()
        if 0 <= n < len(chunk):
            self._chunks.append(chunk[n:])
            chunk = chunk[:n]
        return chunk


class FakeWriter:
    def __init__(self) -> None:
        self.closed = False

    def write(self, data: bytes) -> None:
        assert data

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


def exchange(channel: UpstreamChannel, method: bytes) -> int:
    """One request and its response; the body's length."""
    channel.send(h11.Request(method=method, target=b"/metrics", headers=HOST), b"")
    run_sync(channel.response())
    size = 0
    body = channel.body()
    while True:
        try:
            size += len(run_sync(body.__anext__()))
        except StopAsyncIteration:
            return size


def upstream(data: bytes, control: int) -> None:
    writer = FakeWriter()
    channel = UpstreamChannel(None, FakeReader(split(data, control)), writer)  # type: ignore[arg-type]
    method = b"HEAD" if control & HEAD else b"GET"
    total = 0
    try:
        for _ in range(3):
            total += exchange(channel, method)
            assert total <= len(data), (total, len(data))
            if not channel.reusable():
                break
    except UpstreamError:
        pass
    channel.close()


def target(text: str) -> None:
    try:
        result = request_target(text)
    except UnicodeEncodeError:
        # the proxy answers 400 for these; only a lone surrogate surrogateescape cannot
        # encode may cause it
        assert any(0xD800 <= ord(c) <= 0xDFFF and ord(c) not in ESCAPABLE for c in text)
        return
    assert result.startswith(b"/"), result
    assert all(0x21 <= b <= 0x7E for b in result), result
    assert LONE_PERCENT.search(result) is None, result
    assert request_target(result.decode("ascii")) == result, "not a fixed point"
    h11.Request(method=b"GET", target=result, headers=HOST)
    if "%" not in text:
        path, sep, query = text.partition("?")
        want = path if path.startswith("/") else "/" + path
        got_path, got_sep, got_query = result.partition(b"?")
        assert unquote_to_bytes(got_path) == want.encode("utf-8", "surrogateescape"), result
        assert got_sep == sep.encode()
        assert unquote_to_bytes(got_query) == query.encode("utf-8", "surrogateescape"), result


def test_one_input(data: bytes) -> None:
    if not data:
        return
    control, rest = data[0], data[1:]
    if not control & TARGET:
        upstream(rest, control)
    elif control & HEAD:
        target(atheris.FuzzedDataProvider(rest).ConsumeUnicode(len(rest)))
    else:
        target(rest.decode("utf-8", "surrogateescape"))


def main() -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
