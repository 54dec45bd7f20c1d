"""TLS and basic auth on the HTTP listeners (issue 12, item 7), with the web-config file
users already have for node_exporter and Prometheus (``--web.config.file``).

A gateway and an agent serve HTTPS with a throwaway CA (``harness.tls``); httpx and a
real Prometheus scrape them with the CA, basic auth and (where required) a client
certificate.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import ssl
import time
from pathlib import Path

import bcrypt
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cloud_gateway.config import GatewayConfig
from edge_agent.http_server import listener_warning
from harness.fleet import (
    TOKEN,
    agent_config,
    gateway_config,
    make_pki,
    running_agent,
    running_gateway,
)
from harness.prometheus import running_prometheus
from harness.tls import TlsFiles, make_tls

USER, PASSWORD = "prometheus", "correct horse"
HASH = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()
UP_DEADLINE = 60.0  # Prometheus start -> up == 1 (its first scrape comes within ~1 s)


def web_config(tls: TlsFiles, *, client_ca: bool = False, min_version: str = "TLS12") -> str:
    text = (
        "tls_server_config:\n"
        f"  cert_file: {tls.server_cert}\n"
        f"  key_file: {tls.server_key}\n"
        f"  min_version: {min_version}\n"
    )
    if client_ca:
        text += "  client_auth_type: RequireAndVerifyClientCert\n"
        text += f"  client_ca_file: {tls.ca}\n"
    return text + f"basic_auth_users:\n  {USER}: '{HASH}'\n"


def trusting(tls: TlsFiles) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(tls.ca))


def tls_gateway(tmp_path: Path, text: str, **http: object) -> GatewayConfig:
    path = tmp_path / "web-config.yml"
    path.write_text(text)
    cfg = gateway_config(make_pki(tmp_path))
    http = {"web_config_file": path, "protect_metrics": True, **http}
    return dataclasses.replace(cfg, http=dataclasses.replace(cfg.http, **http))


def auth_failures(text: str) -> dict[str, float]:
    return {
        s.labels["reason"]: s.value
        for f in text_string_to_metric_families(text)
        if f.name == "gpurelay_gateway_http_auth_failures"
        for s in f.samples
    }


async def test_gateway_serves_https_with_basic_auth_beside_bearer_tokens(tmp_path: Path) -> None:
    tls = make_tls(tmp_path / "tls")
    async with running_gateway(tls_gateway(tmp_path, web_config(tls))) as gw:
        url = f"https://127.0.0.1:{gw.http_port}"
        async with httpx.AsyncClient(base_url=url, verify=trusting(tls), timeout=5) as client:
            ok = await client.get("/metrics", auth=(USER, PASSWORD))
            assert ok.status_code == 200, ok.text
            assert "gpurelay_gateway_info" in ok.text
            api = await client.get("/api/v1/nodes", auth=(USER, PASSWORD))
            assert api.status_code == 200, api.text
            sd = await client.get("/api/v1/sd", auth=(USER, PASSWORD))
            assert sd.status_code == 200, sd.text
            token = await client.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
            assert token.status_code == 200, token.text

            wrong = await client.get("/metrics", auth=(USER, "wrong"))
            assert wrong.status_code == 401
            assert wrong.headers["WWW-Authenticate"] == 'Basic realm="edge-gpu-relay"'
            stranger = await client.get("/api/v1/nodes", auth=("mallory", PASSWORD))
            assert stranger.status_code == 401
            missing = await client.get("/metrics")
            assert missing.status_code == 401
            assert 'Basic realm="edge-gpu-relay"' in missing.headers.get_list("WWW-Authenticate")
            assert (await client.get("/healthz")).status_code == 200  # open, as without TLS

        # Plain HTTP on the TLS port is refused.
        with pytest.raises(httpx.TransportError):
            async with httpx.AsyncClient(timeout=5) as plain:
                await plain.get(f"http://127.0.0.1:{gw.http_port}/healthz")
        # A client that does not trust the CA refuses the gateway.
        with pytest.raises(httpx.ConnectError):
            async with httpx.AsyncClient(timeout=5) as untrusting:
                await untrusting.get(f"{url}/healthz")
        gw._refresh()
        async with httpx.AsyncClient(verify=trusting(tls), timeout=5) as client:
            text = (await client.get(f"{url}/metrics", auth=(USER, PASSWORD))).text
        failures = auth_failures(text)
        assert gw.connections.stats.tls_handshake_failures >= 1  # the plain-HTTP client
    assert failures["bad_password"] == 2 and failures["missing"] >= 1, failures


async def test_wrong_passwords_are_throttled_per_client_address(tmp_path: Path) -> None:
    """Issue 24 #6: after BasicAuth's failure budget from one address, that address gets a
    401 without a bcrypt, the right password too; a bearer token is not a password."""
    cfg = tls_gateway(tmp_path, f"basic_auth_users:\n  {USER}: '{HASH}'\n")
    async with running_gateway(cfg) as gw:
        url = f"http://127.0.0.1:{gw.http_port}"
        async with httpx.AsyncClient(base_url=url, timeout=5) as client:
            for guess in range(20):
                wrong = await client.get("/metrics", auth=(USER, f"wrong {guess}"))
                assert wrong.status_code == 401
            right = await client.get("/metrics", auth=(USER, PASSWORD))
            assert right.status_code == 401, "127.0.0.1 is throttled after 20 wrong passwords"
            token = await client.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
            assert token.status_code == 200


async def test_forward_proxy_takes_basic_users_and_the_token_as_password(tmp_path: Path) -> None:
    tls = make_tls(tmp_path / "tls")
    async with running_gateway(tls_gateway(tmp_path, web_config(tls))) as gw:
        url = f"https://127.0.0.1:{gw.http_port}"
        context = trusting(tls)

        async def proxied(user: str, password: str) -> int:
            """Status of ``GET http://edge-x:9400/metrics`` sent to the gateway as a proxy."""
            creds = base64.b64encode(f"{user}:{password}".encode()).decode()
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", gw.http_port, ssl=context, server_hostname="localhost"
            )
            writer.write(
                b"GET http://edge-x:9400/metrics HTTP/1.1\r\nHost: edge-x:9400\r\n"
                + f"Proxy-Authorization: Basic {creds}\r\n".encode()
                + b"Connection: close\r\n\r\n"
            )
            status = await asyncio.wait_for(reader.readline(), 5)
            writer.close()
            return int(status.split()[1])

        assert url.startswith("https://")
        # Past authentication: the node is unknown, so not 401/403.
        assert await proxied(USER, PASSWORD) not in (401, 403)
        assert await proxied("prometheus", TOKEN) not in (401, 403)
        assert await proxied(USER, "wrong") == 401


async def test_mtls_refuses_a_client_without_a_certificate(tmp_path: Path) -> None:
    tls = make_tls(tmp_path / "tls")
    cfg = tls_gateway(tmp_path, web_config(tls, client_ca=True, min_version="TLS13"))
    async with running_gateway(cfg) as gw:
        url = f"https://127.0.0.1:{gw.http_port}/healthz"
        with pytest.raises(httpx.TransportError):
            async with httpx.AsyncClient(verify=trusting(tls), timeout=5) as anonymous:
                await anonymous.get(url)
        context = trusting(tls)
        context.load_cert_chain(tls.client_cert, tls.client_key)
        async with httpx.AsyncClient(verify=context, timeout=5) as client:
            assert (await client.get(url)).status_code == 200
        # The guard still counts the connections of the TLS listener.
        assert gw.connections.stats.open >= 0


async def test_agent_serves_https_with_basic_auth(tmp_path: Path) -> None:
    tls = make_tls(tmp_path / "tls")
    path = tmp_path / "agent-web.yml"
    path.write_text(web_config(tls))
    pki = make_pki(tmp_path)
    async with running_gateway(gateway_config(pki)) as gw:
        cfg = dataclasses.replace(agent_config(pki, "edge-tls", gw), web_config_file=path)
        async with running_agent(cfg) as agent:
            url = f"https://127.0.0.1:{agent.port}"
            async with httpx.AsyncClient(base_url=url, verify=trusting(tls), timeout=5) as client:
                ok = await client.get("/metrics", auth=(USER, PASSWORD))
                assert ok.status_code == 200 and "DCGM_FI_DEV_GPU_UTIL" in ok.text
                wrong = await client.get("/metrics", auth=(USER, "nope"))
                assert wrong.status_code == 401
                assert wrong.headers["WWW-Authenticate"] == 'Basic realm="edge-gpu-relay"'
                assert (await client.get("/metrics")).status_code == 401
                assert (await client.get("/healthz")).status_code == 200  # kubelet probes
            # Through the tunnel the agent's exporter is still reachable: the gateway checked
            # the scraper's token and speaks plain HTTP to a loopback listener, inside SSH.
            async with httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{gw.http_port}",
                headers={"Authorization": f"Bearer {TOKEN}"},
                timeout=5,
            ) as client:
                deadline = time.monotonic() + 15
                while True:
                    r = await client.get(
                        f"/proxy/edge-tls/{agent.port}/metrics",
                        headers={"Authorization": f"Bearer {TOKEN}"},
                    )
                    if r.status_code != 404 or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.2)
                assert r.status_code == 200, r.text
                assert "DCGM_FI_DEV_GPU_UTIL" in r.text
                assert agent.local_port != agent.port


def test_agent_warns_when_it_listens_beyond_loopback_without_tls() -> None:
    assert listener_warning("127.0.0.1", tls=False) is None
    assert listener_warning("::1", tls=False) is None
    assert listener_warning("0.0.0.0", tls=True) is None
    message = listener_warning("0.0.0.0", tls=False)
    assert message is not None and "web_config_file" in message


async def test_prometheus_scrapes_the_gateway_over_tls(
    prometheus_bin: Path, tmp_path: Path
) -> None:
    tls = make_tls(tmp_path / "tls")
    async with running_gateway(tls_gateway(tmp_path, web_config(tls))) as gw:
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n"
            "scrape_configs:\n"
            "  - job_name: edge-gpu-tls\n"
            "    scheme: https\n"
            "    tls_config:\n"
            f"      ca_file: {tls.ca}\n"
            "    basic_auth:\n"
            f"      username: {USER}\n"
            f"      password: {PASSWORD}\n"
            "    static_configs:\n"
            f"      - targets: ['localhost:{gw.http_port}']\n"
        )
        (tmp_path / "prom").mkdir()
        with running_prometheus(prometheus_bin, config, tmp_path / "prom") as (prom_url, log):
            async with httpx.AsyncClient(base_url=prom_url, timeout=5) as client:
                deadline = time.monotonic() + UP_DEADLINE
                seen: object = "no answer yet"
                while time.monotonic() < deadline:
                    try:
                        r = await client.get(
                            "/api/v1/query", params={"query": 'up{job="edge-gpu-tls"}'}
                        )
                        seen = r.json()["data"]["result"] if r.status_code == 200 else r.text
                    except httpx.TransportError as exc:  # not listening yet
                        seen = exc
                    if isinstance(seen, list) and seen and seen[0]["value"][1] == "1":
                        break
                    await asyncio.sleep(0.25)
                else:
                    tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
                    raise AssertionError(f"up never 1: {seen!r}\n--- prometheus log ---\n{tail}")
                gateway_info = await client.get(
                    "/api/v1/query", params={"query": "gpurelay_gateway_info"}
                )
                assert gateway_info.json()["data"]["result"], gateway_info.text


async def test_a_silent_connection_on_the_tls_port_meets_the_header_timeout(
    tmp_path: Path,
) -> None:
    """The guard admits TCP first and runs the handshake inside the header timeout: a
    client that never sends its ClientHello holds a slot for a second, not for minutes."""
    tls = make_tls(tmp_path / "tls")
    cfg = tls_gateway(tmp_path, web_config(tls), header_timeout_seconds=1.0)
    async with running_gateway(cfg) as gw:
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.http_port)
        try:
            await asyncio.sleep(0.2)
            assert gw.connections.stats.open == 1  # counted while it has not shaken hands
            assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the gateway
        finally:
            writer.close()
        assert gw.connections.stats.closed["header_timeout"] == 1
        assert gw.connections.stats.open == 0
