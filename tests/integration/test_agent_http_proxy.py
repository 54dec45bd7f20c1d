"""The agent reaches its gateway through a real HTTP CONNECT proxy (tinyproxy, Debian).

tinyproxy runs in the foreground on a free loopback port with a config written here
(``Allow 127.0.0.1``, CONNECT only to the gateway's SSH port, basic auth): a real agent
with ``[gateway] proxy`` connects through it to a real gateway, its data arrives and the
proxy's log has the CONNECT; with the proxy's port wrong, the agent logs a clear error and
keeps retrying (a wrong password too); with NO_PROXY naming the gateway, it connects
directly (the proxy, still configured, sees nothing); ``edge-agent enroll`` goes through
the proxy as well.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from cloud_gateway.app import Gateway
from cloud_gateway.trust.config import EnrollConfig
from cloud_gateway.trust.signing import make_enroll_token
from edge_agent.config import AgentConfig, TunnelConfig
from edge_agent.enroll import enroll
from edge_agent.tunnel_stats import TunnelStats
from harness.fleet import (
    Pki,
    agent_config,
    gateway_config,
    make_pki,
    metrics_text,
    running_agent,
    running_gateway,
)
from harness.ports import free_ports
from harness.process import Process
from harness.waiting import wait_for, wait_until

USER, PASSWORD = "edge", "pr0xy-s3cret"


class TinyProxy(Process):
    """tinyproxy in the foreground (``-d``) with its own config and log in ``tmp``."""

    def __init__(self, binary: Path, tmp: Path, connect_port: int) -> None:
        (self.port,) = free_ports(1)
        self.access_log = tmp / "tinyproxy-access.log"
        config = tmp / "tinyproxy.conf"
        config.write_text(
            f"Port {self.port}\nListen 127.0.0.1\nTimeout 30\nAllow 127.0.0.1\n"
            f"ConnectPort {connect_port}\nMaxClients 20\nLogLevel Info\n"
            f'LogFile "{self.access_log}"\nBasicAuth {USER} {PASSWORD}\n'
        )
        super().__init__("tinyproxy", [str(binary), "-d", "-c", str(config)], tmp / "tp.out")

    def ready(self) -> bool:
        self.check_alive()
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", self.port)) == 0

    def connects(self) -> list[str]:
        """The CONNECT requests in its log (not the readiness probe's bare connection)."""
        if not self.access_log.exists():
            return []
        lines = self.access_log.read_text().splitlines()
        return [line for line in lines if re.search(r"Request \(.*\): CONNECT ", line)]


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return make_pki(tmp_path)


@pytest.fixture
def proxy_factory(tinyproxy_bin: Path, tmp_path: Path) -> Iterator[type[TinyProxy]]:
    started: list[TinyProxy] = []

    def start(connect_port: int) -> TinyProxy:
        proxy = TinyProxy(tinyproxy_bin, tmp_path, connect_port)
        proxy.start()
        started.append(proxy)
        wait_until(proxy.ready, 30, "tinyproxy listening")
        return proxy

    yield start  # type: ignore[misc]
    for proxy in started:
        proxy.stop()


def via_proxy(pki: Pki, node: str, gw: Gateway, port: int, password: str = PASSWORD) -> AgentConfig:
    """An agent of ``node`` dialling ``gw`` through the proxy on 127.0.0.1:``port``."""
    cfg = agent_config(pki, node, gw)
    url = f"http://{USER}:{password}@127.0.0.1:{port}"
    return dataclasses.replace(cfg, gateway=dataclasses.replace(cfg.gateway, proxy=url))


def node_series(text: str, node: str) -> int:
    return sum(1 for line in text.splitlines() if f'Hostname="{node}"' in line)


async def sent_with_a_proxy_configured(
    pki: Pki, proxy_factory: type[TinyProxy], node: str
) -> tuple[Gateway, TinyProxy, TunnelStats, str]:
    """A gateway, tinyproxy in front of its SSH port and an agent of ``node`` told to use
    it, until three batches were acknowledged: the gateway (stopped by then), the proxy,
    the agent's tunnel stats and the gateway's /metrics text."""
    async with running_gateway(gateway_config(pki)) as gw:
        proxy = proxy_factory(gw.ssh_port)
        cfg = via_proxy(pki, node, gw, proxy.port)
        async with running_agent(cfg) as agent:
            assert agent.tunnel is not None
            stats = agent.tunnel.stats
            await wait_for(lambda: stats.acked_seq >= 3, 30, f"ACKs from {node}")
            text = await metrics_text(gw)
    return gw, proxy, stats, text


async def test_the_agent_sends_through_tinyproxy(
    pki: Pki, proxy_factory: type[TinyProxy], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    gw, proxy, stats, text = await sent_with_a_proxy_configured(pki, proxy_factory, "edge-proxied")
    assert node_series(text, "edge-proxied") > 0
    (connect,) = proxy.connects()  # one tunnel, to the gateway's SSH port
    assert f"CONNECT 127.0.0.1:{gw.ssh_port} HTTP/1.1" in connect
    assert stats.failures == {}


async def test_a_wrong_proxy_port_is_a_clear_error_and_retried(
    pki: Pki, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    caplog.set_level(logging.INFO, logger="edge_agent")
    (dead,) = free_ports(1)
    async with running_gateway(gateway_config(pki)) as gw:
        cfg = via_proxy(pki, "edge-misproxied", gw, dead)
        async with running_agent(cfg) as agent:
            assert agent.tunnel is not None
            stats = agent.tunnel.stats
            await wait_for(lambda: stats.failures.get("proxy", 0) >= 3, 30, "three retries")
            assert not stats.connected
    said = [r.getMessage() for r in caplog.records]
    assert f"gateway 127.0.0.1:{gw.ssh_port}: through HTTP proxy http://{USER}@127.0.0.1:{dead}" \
        " (gateway.proxy)" in said  # fmt: skip
    failed = [m for m in said if "cannot reach HTTP proxy" in m]
    assert len(failed) >= 2, said
    assert f"cannot reach HTTP proxy http://{USER}@127.0.0.1:{dead}" in failed[0]
    assert "retrying in" in failed[0]
    assert not any(PASSWORD in m for m in said)


async def test_no_proxy_naming_the_gateway_connects_directly(
    pki: Pki, proxy_factory: type[TinyProxy], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NO_PROXY", "gw.other.example, 127.0.0.0/8")
    monkeypatch.delenv("no_proxy", raising=False)
    _, proxy, _, text = await sent_with_a_proxy_configured(pki, proxy_factory, "edge-direct")
    assert node_series(text, "edge-direct") > 0
    assert proxy.connects() == []


async def test_a_wrong_proxy_password_is_named_as_such(
    pki: Pki,
    proxy_factory: type[TinyProxy],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    caplog.set_level(logging.INFO, logger="edge_agent")
    async with running_gateway(gateway_config(pki)) as gw:
        proxy = proxy_factory(gw.ssh_port)
        cfg = via_proxy(pki, "edge-wrong-password", gw, proxy.port, password="not-it")
        async with running_agent(cfg) as agent:
            assert agent.tunnel is not None
            stats = agent.tunnel.stats
            await wait_for(lambda: stats.failures.get("proxy", 0) >= 2, 30, "two refusals")
    # tinyproxy answers 401 (not 407) to a CONNECT with a wrong password: both mean it
    refused = [r.getMessage() for r in caplog.records if "refused CONNECT" in r.getMessage()]
    assert refused and "refused the user and password in gateway.proxy" in refused[0]
    assert "not-it" not in caplog.text


async def test_enrollment_goes_through_the_proxy_too(
    pki: Pki, proxy_factory: type[TinyProxy], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``edge-agent enroll`` on a box that reaches the gateway only through the proxy."""
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    cfg = gateway_config(pki)
    enrolling = EnrollConfig(enabled=True, lifetime_seconds=3600, user_ca_key=pki.ca.user_ca)
    async with running_gateway(dataclasses.replace(cfg, enroll=enrolling)) as gw:
        proxy = proxy_factory(gw.ssh_port)
        token, _ = make_enroll_token(pki.ca.dir, "edge-enrolled", ttl_seconds=3600)
        token_file = tmp_path / "enroll.token"
        token_file.write_text(token)
        tunnel = TunnelConfig(
            known_hosts=pki.ca.known_hosts,
            key=tmp_path / "enrolled" / "node.key",
            proxy=f"http://{USER}:{PASSWORD}@127.0.0.1:{proxy.port}",
        )
        (tmp_path / "enrolled").mkdir()
        done = await enroll(
            tunnel,
            node="edge-enrolled",
            gateway=("127.0.0.1", gw.ssh_port),
            token_file=token_file,
            fingerprint=None,
        )
    assert done.certificate.exists() and done.new_key
    (connect,) = proxy.connects()
    assert f"CONNECT 127.0.0.1:{gw.ssh_port} HTTP/1.1" in connect
