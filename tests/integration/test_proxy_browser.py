"""The proxy against a browser that holds the operator's credentials (issue 24, item 3).

With ``basic_auth_users`` set, an operator's browser sends its basic credentials to
``/proxy/...`` by itself. A hostile node's page must not run on the gateway's origin, and
no other website may make that browser send requests to the node's devices. A real
gateway with a basic user, a real agent over a real SSH tunnel, and an endpoint on the
node's side that records every request and answers with an HTML page and every header a
hostile page would use to loosen the browser's guard.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import bcrypt
import httpx
import pytest
from aiohttp import web

from cloud_gateway.app import Gateway
from cloud_gateway.config import load
from cloud_gateway.errors import GatewayConfigError
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

USER, PASSWORD = "operator", "correct horse battery"
BASIC = httpx.BasicAuth(USER, PASSWORD)
PORT = 9600  # the published port of the hostile endpoint on node edge-a
PAGE = "<html><script>fetch('/api/v1/nodes').then(r => r.text()).then(steal)</script>"
HOSTILE = {
    "Content-Security-Policy": "script-src * 'unsafe-inline'",
    "X-Frame-Options": "ALLOWALL",
    "X-Content-Type-Options": "sniff-away",
    "Set-Cookie": "session=planted; Path=/",
    "Access-Control-Allow-Origin": "https://evil.example",
    "Access-Control-Allow-Credentials": "true",
    "Strict-Transport-Security": "max-age=31536000; includeSubDomains",
    "Clear-Site-Data": '"*"',
    "NEL": '{"report_to": "evil", "max_age": 31536000}',
    "Report-To": '{"group": "evil", "endpoints": [{"url": "https://evil.example/r"}]}',
    "X-Device": "kept",  # an ordinary header of the node's goes through
}
SECURE = {
    "Content-Security-Policy": "sandbox",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
}
DROPPED = (
    "Set-Cookie",
    "Access-Control-Allow-Origin",
    "Access-Control-Allow-Credentials",
    "Strict-Transport-Security",
    "Clear-Site-Data",
    "NEL",
    "Report-To",
)


@dataclasses.dataclass
class Fleet:
    gw: Gateway
    seen: list[tuple[str, str, bytes]]  # (method, path, body) the endpoint received

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.gw.http_port}"


@contextlib.asynccontextmanager
async def fleet(tmp_path: Path, methods: tuple[str, ...] | None = None) -> AsyncIterator[Fleet]:
    """A gateway with a basic user (and ``http.proxy_methods = methods`` if given) and
    node edge-a publishing the hostile endpoint as port PORT."""
    seen: list[tuple[str, str, bytes]] = []

    async def hostile(request: web.Request) -> web.Response:
        seen.append((request.method, request.path_qs, await request.read()))
        return web.Response(text=PAGE, content_type="text/html", headers=HOSTILE)

    app = web.Application()
    app.router.add_route("*", "/{path:.*}", hostile)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    pki = make_pki(tmp_path)
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()
    web_config = tmp_path / "web.yml"
    web_config.write_text(f"basic_auth_users:\n  {USER}: '{hashed}'\n")
    cfg = gateway_config(pki)
    http = dataclasses.replace(cfg.http, web_config_file=web_config)
    if methods is not None:
        http = dataclasses.replace(http, proxy_methods=methods)
    cfg = dataclasses.replace(cfg, http=http)
    try:
        async with running_gateway(cfg) as gw:
            agent = dataclasses.replace(
                agent_config(pki, "edge-a", gw),
                publish=(PublishConfig(name="device", port=PORT, target_port=port),),
            )
            async with running_agent(agent):
                await wait_for(lambda: gw.endpoints.lookup("edge-a", PORT) is not None)
                yield Fleet(gw, seen)
    finally:
        await runner.cleanup()


def _assert_sandboxed(r: httpx.Response) -> None:
    for name, value in SECURE.items():
        assert r.headers.get_list(name) == [value], (name, r.headers)
    for name in DROPPED:
        assert name not in r.headers, (name, r.headers)


async def test_a_proxied_page_is_sandboxed_whatever_the_node_says(tmp_path: Path) -> None:
    async with fleet(tmp_path) as f:
        async with httpx.AsyncClient(base_url=f.base, auth=BASIC, timeout=20) as client:
            r = await client.get(f"/proxy/edge-a/{PORT}/index.html")
            assert r.status_code == 200 and r.text == PAGE
            assert r.headers["content-type"].startswith("text/html")
            assert r.headers["x-device"] == "kept"
            _assert_sandboxed(r)
            r = await client.head(f"/proxy/edge-a/{PORT}/index.html")
            assert r.status_code == 200
            _assert_sandboxed(r)
            # the proxy's own errors are served on the gateway's origin too
            r = await client.get("/proxy/nope/9100/metrics")
            assert r.status_code == 404
            _assert_sandboxed(r)
        # the forward-proxy form, as Prometheus uses it, gets the same headers
        proxy = f"http://prometheus:{TOKEN}@127.0.0.1:{f.gw.http_port}"
        async with httpx.AsyncClient(proxy=proxy, timeout=20) as client:
            r = await client.get(f"http://edge-a:{PORT}/metrics")
            assert r.status_code == 200 and r.text == PAGE
            _assert_sandboxed(r)
        assert [m for m, _, _ in f.seen] == ["GET", "HEAD", "GET"]


CROSS_SITE = [
    {"Origin": "https://evil.example"},
    {"Origin": "null"},  # a sandboxed frame, a data: URL
    {"Origin": "http://127.0.0.1:1"},  # another port is another origin
    {"Sec-Fetch-Site": "cross-site"},
    {"Sec-Fetch-Site": "same-site"},  # a sibling host (evil.gateway-domain) is not us
    {"Sec-Fetch-Site": "cross-site", "Origin": "SELF"},
    {"Sec-Fetch-Site": "same-origin", "Origin": "https://evil.example"},
]


@pytest.mark.parametrize("method", ["GET", "POST"])
async def test_a_cross_site_request_is_refused_and_reaches_nothing(
    tmp_path: Path, method: str
) -> None:
    allow = ("GET", "HEAD", "POST") if method == "POST" else None
    async with fleet(tmp_path, allow) as f:
        own = f"http://127.0.0.1:{f.gw.http_port}"
        async with httpx.AsyncClient(base_url=f.base, auth=BASIC, timeout=20) as client:
            for given in CROSS_SITE:
                headers = {k: own if v == "SELF" else v for k, v in given.items()}
                r = await client.request(
                    method, f"/proxy/edge-a/{PORT}/reboot", headers=headers, content=b"now=1"
                )
                assert r.status_code == 403, (headers, r.status_code, r.text)
                assert "cross-site" in r.text, r.text
                _assert_sandboxed(r)
            assert f.seen == []  # the endpoint received nothing
            # the gateway's own pages, an address typed in, and Prometheus still pass
            for headers in (
                {"Origin": own, "Sec-Fetch-Site": "same-origin"},
                {"Origin": own},
                {"Sec-Fetch-Site": "same-origin"},
                {"Sec-Fetch-Site": "none"},
                {},
            ):
                r = await client.request(
                    method, f"/proxy/edge-a/{PORT}/reboot", headers=headers, content=b"now=1"
                )
                assert r.status_code == 200, (headers, r.status_code, r.text)
        assert [(m, p) for m, p, _ in f.seen] == [(method, "/reboot")] * 5


async def test_only_get_and_head_are_relayed_by_default(tmp_path: Path) -> None:
    async with fleet(tmp_path) as f:
        async with httpx.AsyncClient(base_url=f.base, auth=BASIC, timeout=20) as client:
            for method in ("POST", "PUT", "DELETE", "PATCH", "OPTIONS"):
                r = await client.request(method, f"/proxy/edge-a/{PORT}/reboot", content=b"x")
                assert r.status_code == 405, (method, r.status_code, r.text)
                assert r.headers["allow"] == "GET, HEAD"
                assert "http.proxy_methods" in r.text
                _assert_sandboxed(r)
            assert (await client.get(f"/proxy/edge-a/{PORT}/metrics")).status_code == 200
        proxy = f"http://prometheus:{TOKEN}@127.0.0.1:{f.gw.http_port}"
        async with httpx.AsyncClient(proxy=proxy, timeout=20) as client:
            r = await client.post(f"http://edge-a:{PORT}/reboot", content=b"x")
            assert r.status_code == 405 and r.headers["allow"] == "GET, HEAD"
        assert [(m, p) for m, p, _ in f.seen] == [("GET", "/metrics")]
        assert f.gw.relay.requests[405] == 6


async def test_the_operator_can_allow_more_methods(tmp_path: Path) -> None:
    async with fleet(tmp_path, ("GET", "HEAD", "POST")) as f:
        async with httpx.AsyncClient(base_url=f.base, auth=BASIC, timeout=20) as client:
            r = await client.post(f"/proxy/edge-a/{PORT}/reboot", content=b"now=1")
            assert r.status_code == 200 and r.text == PAGE
            r = await client.put(f"/proxy/edge-a/{PORT}/reboot", content=b"now=1")
            assert r.status_code == 405 and r.headers["allow"] == "GET, HEAD, POST"
        assert f.seen == [("POST", "/reboot", b"now=1")]


def test_proxy_methods_setting(tmp_path: Path) -> None:
    assert load(None, {}).http.proxy_methods == ("GET", "HEAD")
    cfg = load(None, {"CLOUD_GATEWAY_HTTP_PROXY_METHODS": "get,head,post"})
    assert cfg.http.proxy_methods == ("GET", "HEAD", "POST")
    f = tmp_path / "gateway.toml"
    f.write_text('[http]\nproxy_methods = ["GET", "HEAD", "DELETE"]\n')
    assert load(f, {}).http.proxy_methods == ("GET", "HEAD", "DELETE")
    for bad in ("GET,FROB", "GET,CONNECT", ""):
        with pytest.raises(GatewayConfigError, match=r"http\.proxy_methods"):
            load(None, {"CLOUD_GATEWAY_HTTP_PROXY_METHODS": bad})
