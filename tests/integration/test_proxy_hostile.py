"""The proxy against hostile clients and hostile upstreams (issue 12).

A raw TCP upstream on the node's side (published by a real agent over a real SSH tunnel)
records every byte it receives, so a test can say exactly what reached it; it answers as
the request's path tells it to: normally, with headers that never end, with a header
block larger than any sane limit, or with a body cut short.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from cloud_gateway.app import Gateway
from cloud_gateway.relay.upstream import request_target
from edge_agent.config import PublishConfig
from harness.fleet import (
    TOKEN,
    agent_config,
    gateway_config,
    make_pki,
    running_agent,
    running_gateway,
)
from harness.waiting import wait_for

AUTH = {"Authorization": f"Bearer {TOKEN}"}
PORT = 9500  # the published port of the recording upstream on node edge-a
SMUGGLE = "/a?q=1%20HTTP/1.1%0d%0aX-Injected:%20yes%0d%0a%0d%0aGET%20/smuggled"  # as in issue 12


@dataclass
class Upstream:
    """What the recording upstream saw: one entry per TCP connection (= per channel)."""

    port: int = 0
    received: list[bytearray] = field(default_factory=list)
    closed: list[bool] = field(default_factory=list)

    def heads(self) -> list[list[str]]:
        """Every request head received, as lines, over all connections."""
        out = []
        for raw in self.received:
            for head in bytes(raw).split(b"\r\n\r\n")[:-1]:
                out.append(head.decode("latin-1").split("\r\n"))
        return out


async def _until_closed(reader: asyncio.StreamReader) -> None:
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(30):
            while await reader.read(65536):
                pass


def _answer(target: str) -> bytes:
    body = f"you asked for {target}\n".encode()
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )


async def _serve(up: Upstream, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    index = len(up.received)
    up.received.append(bytearray())
    up.closed.append(False)
    buf = b""
    answered = 0
    try:
        while True:
            while b"\r\n\r\n" not in buf:
                data = await reader.read(65536)
                if not data:
                    return
                up.received[index] += data
                buf += data
            head, _, buf = buf.partition(b"\r\n\r\n")
            target = head.split(b"\r\n", 1)[0].split(b" ")[1].decode("latin-1")
            if answered:
                await asyncio.sleep(0.05)  # a little slow on a busy channel, like any server
            answered += 1
            if target.startswith("/never-ending-head"):
                writer.write(b"HTTP/1.1 200 OK\r\nX-A: 1\r\n")
                while True:  # one more header byte every 50 ms, never the blank line
                    await asyncio.sleep(0.05)
                    writer.write(b"X-B: 2\r\n")
                    await writer.drain()
            if target.startswith("/huge-head"):
                writer.write(b"HTTP/1.1 200 OK\r\nX-Pad: " + b"a" * (1 << 20))
                await writer.drain()
                await _until_closed(reader)
            if target.startswith("/cut-short"):
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n" + b"x" * 10)
                await writer.drain()
                await _until_closed(reader)  # the other 990 bytes never come
            writer.write(_answer(target))
            if target.startswith("/extra-at-once"):  # an answer to nothing, right behind
                writer.write(_answer("/unasked"))
            if target.startswith("/extra-later"):  # the same, after a while
                await writer.drain()
                await asyncio.sleep(0.1)
                writer.write(_answer("/unasked"))
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        up.closed[index] = True
        writer.close()


@contextlib.asynccontextmanager
async def recording_upstream() -> AsyncIterator[Upstream]:
    up = Upstream()
    tasks: set[asyncio.Task[None]] = set()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        await _serve(up, reader, writer)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    up.port = server.sockets[0].getsockname()[1]
    try:
        yield up
    finally:
        server.close()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.wait_closed()


@contextlib.asynccontextmanager
async def fleet(tmp_path: Path) -> AsyncIterator[tuple[Gateway, Upstream]]:
    pki = make_pki(tmp_path)
    async with recording_upstream() as up, running_gateway(gateway_config(pki)) as gw:
        cfg = dataclasses.replace(
            agent_config(pki, "edge-a", gw),
            publish=(PublishConfig(name="recorder", port=PORT, target_port=up.port),),
        )
        async with running_agent(cfg):
            await wait_for(lambda: gw.endpoints.lookup("edge-a", PORT) is not None)
            yield gw, up


def _pooled(gw: Gateway) -> int:
    return sum(len(v) for v in gw.relay._idle.values())


async def test_no_request_smuggling_through_the_path_form(tmp_path: Path) -> None:
    async with fleet(tmp_path) as (gw, up):
        base = f"http://127.0.0.1:{gw.http_port}"
        async with httpx.AsyncClient(base_url=base, timeout=20) as client:
            first = await client.get(f"/proxy/edge-a/{PORT}{SMUGGLE}", headers=AUTH)
            await asyncio.sleep(0.3)  # a smuggled response would be on its way back by now
            second = await client.get(f"/proxy/edge-a/{PORT}/metrics", headers=AUTH)
        heads = up.heads()
        assert not [h for h in heads if any(line.lower().startswith("x-injected") for line in h)]
        # one request line upstream per client request, and nothing else
        assert [h[0].rsplit(" ", 1)[0] for h in heads] == [
            "GET /a?q=1%20HTTP/1.1%0D%0AX-Injected:%20yes%0D%0A%0D%0AGET%20/smuggled",
            "GET /metrics",
        ], heads
        assert first.status_code == 200 and first.text.startswith("you asked for /a?q=1%20")
        assert second.status_code == 200 and second.text == "you asked for /metrics\n"


async def test_no_request_smuggling_through_the_forward_proxy(tmp_path: Path) -> None:
    async with fleet(tmp_path) as (gw, up):
        proxy = f"http://prometheus:{TOKEN}@127.0.0.1:{gw.http_port}"
        async with httpx.AsyncClient(proxy=proxy, timeout=20) as client:
            first = await client.get(f"http://edge-a:{PORT}{SMUGGLE}")
            await asyncio.sleep(0.3)
            second = await client.get(f"http://edge-a:{PORT}/metrics")
        heads = up.heads()
        assert not [h for h in heads if any(line.lower().startswith("x-injected") for line in h)]
        assert len(heads) == 2 and heads[1][0] == "GET /metrics HTTP/1.1", heads
        assert " " not in heads[0][0].split(" ", 1)[1].rsplit(" ", 1)[0]
        assert first.status_code == 200 and "HTTP/1.1%0" in first.text.upper()
        assert second.status_code == 200 and second.text == "you asked for /metrics\n"


async def test_control_bytes_in_the_decoded_path_never_reach_the_upstream(
    tmp_path: Path,
) -> None:
    async with fleet(tmp_path) as (gw, up):
        base = f"http://127.0.0.1:{gw.http_port}"
        async with httpx.AsyncClient(base_url=base, timeout=20) as client:
            r = await client.get(
                f"/proxy/edge-a/{PORT}/x%00%7f%20y/%E2%82%AC%09?a=%0d%0aX:%20y%00&b=%E2%82%AC#",
                headers=AUTH,
            )
        assert r.status_code == 200
        (raw,) = up.received
        line = bytes(raw).split(b"\r\n", 1)[0]
        target = b"/x%00%7F%20y/%E2%82%AC%09?a=%0D%0AX:%20y%00&b=%E2%82%AC"
        assert line == b"GET " + target + b" HTTP/1.1", line
        assert all(0x21 <= b < 0x7F for b in line.split(b" ")[1])


async def test_a_head_that_never_ends_is_cut_off_at_the_scrape_timeout(tmp_path: Path) -> None:
    async with fleet(tmp_path) as (gw, up):
        base = f"http://127.0.0.1:{gw.http_port}"
        async with httpx.AsyncClient(base_url=base, timeout=20) as client:
            started = time.monotonic()
            r = await client.get(
                f"/proxy/edge-a/{PORT}/never-ending-head",
                headers={**AUTH, "X-Prometheus-Scrape-Timeout-Seconds": "0.5"},
            )
            assert r.status_code == 504 and f"edge-a:{PORT}" in r.text
            assert time.monotonic() - started < 5.0  # the 0.5 s asked, not the 10 s default
            await wait_for(lambda: up.closed[0])  # the channel was closed, not pooled
            assert _pooled(gw) == 0
            r = await client.get(f"/proxy/edge-a/{PORT}/metrics", headers=AUTH)
            assert r.text == "you asked for /metrics\n"
        assert len(up.received) == 2  # the next scrape went on a fresh channel


async def test_a_head_larger_than_the_limit_is_refused(tmp_path: Path) -> None:
    async with fleet(tmp_path) as (gw, up):
        base = f"http://127.0.0.1:{gw.http_port}"
        async with httpx.AsyncClient(base_url=base, timeout=20) as client:
            started = time.monotonic()
            r = await client.get(f"/proxy/edge-a/{PORT}/huge-head", headers=AUTH)
            assert r.status_code == 502 and f"edge-a:{PORT}" in r.text
            assert "head larger than 64 KiB" in r.text
            assert time.monotonic() - started < 5.0  # well before the 10 s proxy timeout
            await wait_for(lambda: up.closed[0])
            assert _pooled(gw) == 0
            r = await client.get(f"/proxy/edge-a/{PORT}/metrics", headers=AUTH)
            assert r.text == "you asked for /metrics\n"
        assert len(up.received) == 2


async def test_a_response_cut_short_is_not_pooled(tmp_path: Path) -> None:
    async with fleet(tmp_path) as (gw, up):
        base = f"http://127.0.0.1:{gw.http_port}"
        async with httpx.AsyncClient(base_url=base, timeout=20) as client:
            started = time.monotonic()
            # the head went out before the body broke off: the client must see an error,
            # never a complete (shorter) response
            with pytest.raises(httpx.RemoteProtocolError):
                await client.get(
                    f"/proxy/edge-a/{PORT}/cut-short",
                    headers={**AUTH, "X-Prometheus-Scrape-Timeout-Seconds": "0.5"},
                )
            assert time.monotonic() - started < 5.0  # the 0.5 s asked, not the 10 s default
            await wait_for(lambda: up.closed[0])
            assert _pooled(gw) == 0
            assert gw.relay.requests == {504: 1}
        async with httpx.AsyncClient(base_url=base, timeout=20) as client:
            r = await client.get(f"/proxy/edge-a/{PORT}/metrics", headers=AUTH)
            assert r.text == "you asked for /metrics\n"
        assert len(up.received) == 2


@pytest.mark.parametrize("path", ["/extra-at-once", "/extra-later"])
async def test_an_answer_to_nothing_is_never_handed_to_the_next_client(
    tmp_path: Path, path: str
) -> None:
    async with fleet(tmp_path) as (gw, up):
        base = f"http://127.0.0.1:{gw.http_port}"
        async with httpx.AsyncClient(base_url=base, timeout=20) as client:
            r = await client.get(f"/proxy/edge-a/{PORT}{path}", headers=AUTH)
            assert r.text == f"you asked for {path}\n"
            await asyncio.sleep(0.3)  # the unasked answer has arrived
            await wait_for(lambda: up.closed[0])  # and the channel was dropped for it
            r = await client.get(f"/proxy/edge-a/{PORT}/metrics", headers=AUTH)
            assert r.text == "you asked for /metrics\n"
        assert len(up.received) == 2


@pytest.mark.parametrize(
    ("given", "sent"),
    [
        ("", b"/"),
        ("/metrics", b"/metrics"),
        ("metrics?x=1", b"/metrics?x=1"),
        ("/a b\r\nX: y", b"/a%20b%0D%0AX:%20y"),
        ("/a?q=1 HTTP/1.1\r\n\r\nGET /s", b"/a?q=1%20HTTP/1.1%0D%0A%0D%0AGET%20/s"),
        ("/already%20encoded?a=%0d%0a&b=c/d?e", b"/already%20encoded?a=%0d%0a&b=c/d?e"),
        ("/100%?x=%zz%4", b"/100%25?x=%25zz%254"),
        ("/\x00\x7f\t€#frag", b"/%00%7F%09%E2%82%AC%23frag"),
        ("/a?b#c", b"/a?b%23c"),
    ],
)
def test_request_target_is_printable_ascii(given: str, sent: bytes) -> None:
    assert request_target(given) == sent
    assert all(0x21 <= b < 0x7F for b in sent)
