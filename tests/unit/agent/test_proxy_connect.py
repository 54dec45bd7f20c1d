"""edge_agent.proxy_connect: the CONNECT handshake against a scripted asyncio server, the
proxy URL, and NO_PROXY matching."""

from __future__ import annotations

import asyncio
import base64
import re
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from edge_agent.dial import PathSilent
from edge_agent.errors import ConfigError
from edge_agent.proxy_connect import (
    MAX_HEAD_BYTES,
    HttpProxy,
    NoProxy,
    ProxyError,
    ProxyRoute,
    connect_through,
    parse_proxy_url,
    proxy_route,
)
from harness.ports import free_ports

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
BANNER = b"SSH-2.0-gateway\r\n"


class Scripted:
    """A one-connection-at-a-time proxy that records each request head and runs ``script``."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.requests: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            self.requests.append(await reader.readuntil(b"\r\n\r\n"))
            await self.script(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@asynccontextmanager
async def proxy_server(script: Script) -> AsyncIterator[tuple[Scripted, HttpProxy]]:
    scripted = Scripted(script)
    server = await asyncio.start_server(scripted.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield scripted, HttpProxy(host="127.0.0.1", port=port)
    finally:
        server.close()
        await server.wait_closed()


def answer(*chunks: bytes, hold: bool = False) -> Script:
    """Write ``chunks`` one by one (each its own segment), then keep the connection open
    while the client holds it (``hold``) or close it."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for chunk in chunks:
            writer.write(chunk)
            await writer.drain()
            await asyncio.sleep(0.01)
        if hold:
            await reader.read()  # until the client closes

    return script


async def through(proxy: HttpProxy, timeout: float = 10.0) -> socket.socket:
    return await connect_through(
        proxy, "gw.example.com", 2222, dial_timeout=5.0, answer_timeout=timeout
    )


async def recv_all(sock: socket.socket, count: int) -> bytes:
    loop = asyncio.get_running_loop()
    data = b""
    while len(data) < count:
        chunk = await asyncio.wait_for(loop.sock_recv(sock, count - len(data)), 10)
        if not chunk:
            break
        data += chunk
    return data


@pytest.mark.parametrize(
    "chunks",
    [
        [b"HTTP/1.1 200 Connection established\r\n\r\n" + BANNER],  # one segment
        [b"HTTP/1.0 200 OK\r\nVia: p\r\n\r\n" + BANNER[:5], BANNER[5:]],
        [b"HTTP/1.1 200 OK\r", b"\n", b"Proxy-Agent: x\r\n\r", b"\n", BANNER],  # in pieces
    ],
)
async def test_success_keeps_every_byte_after_the_head(chunks: list[bytes]) -> None:
    async with proxy_server(answer(*chunks, hold=True)) as (scripted, proxy):
        sock = await through(proxy)
        try:
            assert await recv_all(sock, len(BANNER)) == BANNER
        finally:
            sock.close()
    (request,) = scripted.requests
    lines = request.decode().split("\r\n")
    assert lines[0] == "CONNECT gw.example.com:2222 HTTP/1.1"
    assert "Host: gw.example.com:2222" in lines
    assert not any(line.startswith("Proxy-Authorization") for line in lines)


async def test_credentials_go_as_basic_auth_and_never_into_messages() -> None:
    async with proxy_server(answer(b"HTTP/1.1 407 Proxy Authentication Required\r\n"
                                   b"Proxy-Authenticate: Basic realm=\"p\"\r\n\r\n")) as (
        scripted,
        plain,
    ):  # fmt: skip
        proxy = parse_proxy_url(f"http://alice:s%40cret@127.0.0.1:{plain.port}")
        with pytest.raises(ProxyError) as refused:
            await through(proxy)
    (request,) = scripted.requests
    (auth,) = [x for x in request.decode().split("\r\n") if x.startswith("Proxy-Authorization")]
    assert base64.b64decode(auth.split()[-1]) == b"alice:s@cret"
    message = str(refused.value)
    assert "407" in message and "refused the user and password" in message
    assert f"http://alice@127.0.0.1:{plain.port}" in message and "s@cret" not in message


async def test_401_as_tinyproxy_answers_is_about_credentials_too() -> None:
    async with proxy_server(answer(b"HTTP/1.1 401 Unauthorized\r\n\r\n")) as (_, plain):
        proxy = HttpProxy(host=plain.host, port=plain.port, username="u", password="p")
        with pytest.raises(ProxyError, match="401 'Unauthorized': it refused the user and"):
            await through(proxy)


async def test_407_without_credentials_says_how_to_give_them() -> None:
    async with proxy_server(answer(b"HTTP/1.1 407 Proxy Authentication Required\r\n\r\n")) as (
        _,
        proxy,
    ):
        with pytest.raises(ProxyError, match=r"407 .*wants credentials.*USER:PASSWORD@"):
            await through(proxy)


@pytest.mark.parametrize(
    ("status", "says"),
    [
        (b"403 Forbidden", "access rules forbid"),
        (b"502 Bad Gateway", "could not reach the gateway itself"),
        (b"504 Gateway Timeout", "could not reach the gateway itself"),
        (b"405 Method Not Allowed", "refused CONNECT gw.example.com:2222: 405"),
    ],
)
async def test_refusals_say_what_the_proxy_answered(status: bytes, says: str) -> None:
    async with proxy_server(answer(b"HTTP/1.1 " + status + b"\r\nContent-Length: 0\r\n\r\n")) as (
        _,
        proxy,
    ):
        with pytest.raises(ProxyError, match=says):
            await through(proxy)


@pytest.mark.parametrize(
    ("reply", "says"),
    [
        (BANNER, "not HTTP: is it an HTTP proxy"),  # the gateway's own SSH port
        (b"\x16\x03\x01\x00\xa5garbage", "not HTTP"),  # TLS
        (b"HTTP/1.1 2xx\r\n\r\n", "not an HTTP status line"),
        (b"HTTP/1.1 200 OK\r\nX: y", "closed the connection before its answer"),
        (b"", "closed the connection before answering CONNECT"),
    ],
)
async def test_what_is_not_an_http_answer_is_refused(reply: bytes, says: str) -> None:
    async with proxy_server(answer(reply)) as (_, proxy):
        with pytest.raises(ProxyError, match=says):
            await through(proxy)


async def test_an_oversized_head_is_refused_without_waiting_for_its_end() -> None:
    flood = b"HTTP/1.1 200 OK\r\n" + b"X-Pad: " + b"a" * (2 * MAX_HEAD_BYTES)
    async with proxy_server(answer(flood, hold=True)) as (_, proxy):
        with pytest.raises(ProxyError, match=f"over {MAX_HEAD_BYTES} bytes"):
            await through(proxy)


async def test_a_proxy_that_never_answers_times_out() -> None:
    async with proxy_server(answer(b"HTTP/1.1 200", hold=True)) as (_, proxy):
        with pytest.raises(ProxyError, match=r"did not answer CONNECT gw.example.com:2222 within"):
            await through(proxy, timeout=0.5)


async def test_a_closed_proxy_port_is_a_proxy_error_naming_it() -> None:
    (port,) = free_ports(1)
    proxy = HttpProxy(host="127.0.0.1", port=port)
    with pytest.raises(ProxyError, match=f"cannot reach HTTP proxy http://127.0.0.1:{port}"):
        await through(proxy)


async def test_a_host_with_a_line_break_is_not_sent() -> None:
    async with proxy_server(answer(b"HTTP/1.1 200 OK\r\n\r\n")) as (_, proxy):
        with pytest.raises(ProxyError, match="cannot go into a CONNECT request"):
            await connect_through(proxy, "gw\r\nX: y", 2222, dial_timeout=5.0, answer_timeout=5.0)


async def test_no_proxy_dials_directly() -> None:
    """The route sends no CONNECT to an address NO_PROXY names: the gateway gets raw TCP."""
    got: list[bytes] = []

    async def gateway(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(BANNER)
        await writer.drain()
        got.append(await reader.read(100))
        writer.close()

    server = await asyncio.start_server(gateway, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    (dead,) = free_ports(1)  # the proxy: nothing listens, so using it would fail
    route = proxy_route(f"http://127.0.0.1:{dead}", {"NO_PROXY": "localhost,127.0.0.0/8"})
    try:
        sock = await route.open("127.0.0.1", port, dial_timeout=5.0, answer_timeout=5.0)
        try:
            assert await recv_all(sock, len(BANNER)) == BANNER
            await asyncio.get_running_loop().sock_sendall(sock, b"SSH-2.0-agent\r\n")
        finally:
            sock.close()
        await asyncio.sleep(0.1)
    finally:
        server.close()
        await server.wait_closed()
    assert got == [b"SSH-2.0-agent\r\n"]
    with pytest.raises(ProxyError):  # the other way the proxy is used, and is not there
        await route.open("gw.example.com", port, dial_timeout=5.0, answer_timeout=5.0)


async def test_a_silent_proxy_is_a_silent_path(monkeypatch: pytest.MonkeyPatch) -> None:
    async def silent(host: str, port: int, timeout: float) -> socket.socket:
        raise PathSilent(f"no answer from {host}:{port} within {timeout:g}s (a silent path)")

    monkeypatch.setattr("edge_agent.proxy_connect.dial", silent)
    with pytest.raises(PathSilent, match=r"HTTP proxy http://192.0.2.1:3128: no answer"):
        await through(HttpProxy(host="192.0.2.1", port=3128))


@pytest.mark.parametrize(
    ("no_proxy", "host", "port", "direct"),
    [
        ("", "gw.example.com", 2222, False),
        ("*", "gw.example.com", 2222, True),
        ("example.com", "gw.example.com", 2222, True),
        ("example.com", "example.com", 2222, True),
        (".example.com", "gw.example.com", 2222, True),
        (".example.com", "example.com", 2222, True),
        ("*.example.com", "gw.example.com", 2222, True),
        ("example.com", "badexample.com", 2222, False),
        ("EXAMPLE.com.", "GW.Example.COM.", 2222, True),
        (" other.org , gw.example.com ", "gw.example.com", 2222, True),
        ("gw.example.com:2222", "gw.example.com", 2222, True),
        ("gw.example.com:22", "gw.example.com", 2222, False),
        ("10.0.0.0/8", "10.1.2.3", 2222, True),
        ("10.0.0.0/8", "11.1.2.3", 2222, False),
        ("10.1.2.3", "10.1.2.3", 2222, True),
        ("10.1.2.3:2222", "10.1.2.3", 2222, True),
        ("10.0.0.0/8", "gw.example.com", 2222, False),  # names are never resolved
        ("fd00::/8", "fd00::7", 2222, True),
        ("[::1]:2222", "::1", 2222, True),
        ("::1", "[::1]", 2222, True),
        ("localhost", "127.0.0.1", 2222, False),
        (",,", "gw", 2222, False),
    ],
)
def test_no_proxy(no_proxy: str, host: str, port: int, direct: bool) -> None:
    assert NoProxy(no_proxy).matches(host, port) is direct


def test_the_proxy_url() -> None:
    proxy = parse_proxy_url("http://al%3Aice:p%40ss@Proxy.example:3128/")
    assert (proxy.host, proxy.port, proxy.username, proxy.password) == (
        "proxy.example",
        3128,
        "al:ice",
        "p@ss",
    )
    assert str(proxy) == "http://al:ice@proxy.example:3128" and "p@ss" not in repr(proxy)
    assert parse_proxy_url("proxy:3128") == HttpProxy(host="proxy", port=3128)
    assert parse_proxy_url("http://[fd00::1]:3128").host == "fd00::1"
    assert str(parse_proxy_url("http://[fd00::1]:3128")) == "http://[fd00::1]:3128"


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("https://proxy:3128", "https:// proxy is not supported.*TLS to the proxy"),
        ("socks5://proxy:1080", "socks5:// proxy is not supported"),
        ("http://user:hunter2@proxy", "needs a port"),
        ("http://proxy:0", "needs a port"),
        ("http://proxy:99999", "not a proxy URL"),
        ("http://:3128", "names no proxy host"),
        ("http://proxy:3128/path", "no path, query or fragment"),
    ],
)
def test_bad_proxy_urls(url: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says) as caught:
        parse_proxy_url(url)
    assert "hunter2" not in str(caught.value)


def test_the_environment_only_when_asked() -> None:
    env = {"HTTPS_PROXY": "http://a:3128", "all_proxy": "http://b:3128", "NO_PROXY": "gw"}
    assert proxy_route("", env) == ProxyRoute()  # never picked up unasked
    route = proxy_route("env", env)
    assert route.proxy is not None and route.proxy.source == "HTTPS_PROXY (gateway.proxy = env)"
    assert route.proxy == HttpProxy(host="a", port=3128, source="HTTPS_PROXY (gateway.proxy = env)")
    assert route.proxy_for("gw", 2222) is None and route.proxy_for("gw2", 2222) == route.proxy
    assert proxy_route("env", {"https_proxy": "http://c:1", "HTTPS_PROXY": "http://a:2"}).proxy
    assert proxy_route("env", {"ALL_PROXY": "http://b:3128"}).proxy == HttpProxy(
        host="b", port=3128, source="ALL_PROXY (gateway.proxy = env)"
    )
    assert proxy_route("env", {"HTTP_PROXY": "http://h:3128"}).proxy is None  # for http://
    assert proxy_route("http://p:1", {"no_proxy": "x", "NO_PROXY": "y"}).no_proxy.value == "x"
    with pytest.raises(ConfigError, match=r"ALL_PROXY .*socks5"):
        proxy_route("env", {"ALL_PROXY": "socks5://s:1080"})


def test_the_route_is_described_without_the_password() -> None:
    route = proxy_route("http://bob:pw@p:3128", {"NO_PROXY": "gw-b"})
    lines = route.describe([("gw-a", 2222), ("gw-b", 2222)])
    assert lines == [
        "gateway gw-a:2222: through HTTP proxy http://bob@p:3128 (gateway.proxy)",
        "gateway gw-b:2222: directly (NO_PROXY 'gw-b' names it)",
    ]


def test_the_guides_proxy_table_is_the_config() -> None:
    from pathlib import Path

    from edge_agent.config import TunnelConfig

    guide = (Path(__file__).resolve().parents[3] / "docs" / "operator-guide.md").read_text()
    start = guide.index("## Through an HTTP proxy\n")
    section = guide[start : guide.index("\n## ", start + 1)]
    rows = dict(re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", section, re.MULTILINE))
    assert rows == {"proxy": '""'} and TunnelConfig().proxy == ""
