"""A throwaway fleet on loopback: its PKI, gateway and agent configs, and both run in this
process (``running_gateway``, ``running_agent``); :mod:`harness.services` runs them as
processes instead."""

from __future__ import annotations

import asyncio
import dataclasses
import tempfile
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from aiohttp import web

from cloud_gateway.app import Gateway
from cloud_gateway.cluster.config import ClusterConfig
from cloud_gateway.config import GatewayConfig
from cloud_gateway.http.config import HttpConfig
from cloud_gateway.registry.config import RegistryConfig
from cloud_gateway.ssh.config import SshConfig
from cloud_gateway.trust import certs
from edge_agent.app import Agent
from edge_agent.config import AgentConfig, SimulateConfig, SpoolConfig, TunnelConfig
from gpurelay.tasks import stop_task
from harness.process import HarnessError

TOKEN = "test-operator-token"
# running_gateway/running_agent: how long run() may take to end once told to stop, and
# shutdown() to finish; above aiohttp's 60 s for a request still being handled at
# cleanup, well below pytest-timeout's 600 s
STOP_SECONDS = 120.0


@dataclass
class Pki:
    ca: certs.CaPaths
    gateway_key: Path

    def node(self, name: str, **kwargs: object) -> certs.Credentials:
        return certs.issue_node(self.ca.dir, name, **kwargs)  # type: ignore[arg-type]


def make_pki(tmp: Path, *, gateway_names: Sequence[str] = ()) -> Pki:
    """A fleet CA and a gateway certificate for localhost, 127.0.0.1 and ``gateway_names``
    (e.g. :attr:`harness.netns.Uplink.gateway_host`)."""
    ca = certs.init_ca(tmp / "ca")
    gw = certs.issue_gateway(ca.dir, "localhost", extra_names=["127.0.0.1", *gateway_names])
    assert gw.private_key is not None
    return Pki(ca=ca, gateway_key=gw.private_key)


def gateway_config(
    pki: Pki,
    *,
    ssh_port: int = 0,
    http_port: int = 0,
    siblings: tuple[str, ...] = (),
    ssh_host: str = "127.0.0.1",
    **registry: Any,  # [registry] keys: floats, and node_label
) -> GatewayConfig:
    """A gateway on loopback (port 0: any free port), trusting the fleet's user CA and
    accepting the operator token TOKEN; ``siblings``: its ``[ssh] siblings`` rules;
    ``ssh_host``: where the SSH listener binds instead of loopback (HTTP stays there)."""
    return GatewayConfig(
        drain_seconds=1.0,
        ssh=SshConfig(
            listen=f"{ssh_host}:{ssh_port}",
            host_key=pki.gateway_key,
            user_ca=pki.ca.user_ca_pub,
            revocation_file=pki.ca.revocations,
            siblings=siblings,
        ),
        http=HttpConfig(listen=f"127.0.0.1:{http_port}", tokens=(TOKEN,)),
        registry=RegistryConfig(**registry),
    )


def cluster_member(pki: Pki, dsn: str, gateway_id: str, token_file: Path) -> GatewayConfig:
    """:func:`gateway_config` as a ``[cluster]`` member on the PostgreSQL ``dsn``, with a
    peer listener on loopback, the peer token in ``token_file`` and quick heartbeats
    (0.5 s, expiring after 3 s)."""
    return dataclasses.replace(
        gateway_config(pki),
        cluster=ClusterConfig(
            database=dsn,
            gateway_id=gateway_id,
            peer_listen="127.0.0.1:0",
            peer_token_file=str(token_file),
            heartbeat_seconds=0.5,
            ttl_seconds=3.0,
        ),
    )


@asynccontextmanager
async def running_gateway(cfg: GatewayConfig) -> AsyncIterator[Gateway]:
    gateway = Gateway(cfg)
    await gateway.startup()
    task = asyncio.create_task(gateway.run())
    try:
        yield gateway
    finally:
        await _stop(gateway, task, "gateway")


def agent_config(
    pki: Pki,
    node: str,
    gateway: Gateway,
    *,
    creds: certs.Credentials | None = None,
    gpus: int = 1,
    node_name: str | None = None,
    spool_dir: Path | None = None,
) -> AgentConfig:
    """An agent of ``node``; each call gets its own spool directory unless one is given
    (two agents must not share a spool: their sequence numbers would collide)."""
    creds = creds or pki.node(node)
    if spool_dir is None:
        spool_dir = Path(tempfile.mkdtemp(prefix=f"spool-{node}-", dir=pki.ca.dir.parent))
    return AgentConfig(
        node_name=node_name or node,
        listen="127.0.0.1:0",
        interval_seconds=0.2,
        process_interval_seconds=0.2,
        simulate=SimulateConfig(gpus=gpus, seed=3),
        gateway=TunnelConfig(
            address=f"127.0.0.1:{gateway.ssh_port}",
            known_hosts=pki.ca.known_hosts,
            key=creds.private_key,
            certificate=creds.certificate,
            backoff_initial_seconds=0.05,
            backoff_max_seconds=0.5,
            connect_timeout_seconds=5,
        ),
        spool=SpoolConfig(directory=spool_dir),
    )


@asynccontextmanager
async def running_agent(cfg: AgentConfig) -> AsyncIterator[Agent]:
    agent = Agent(cfg)
    await agent.startup()
    task = asyncio.create_task(agent.run())
    try:
        yield agent
    finally:
        await _stop(agent, task, "agent")


async def _stop(app: Agent | Gateway, task: asyncio.Task[None], what: str) -> None:
    """Stop ``app`` as its service does (stop, then shutdown), each within STOP_SECONDS:
    a run that does not end when told, or a shutdown that hangs, fails the test with
    HarnessError now instead of at pytest-timeout's 600 s with nothing named. The run is
    cancelled (again while it swallows that) and the shutdown done all the same."""
    app.stop.set()
    await asyncio.wait([task], timeout=STOP_SECONDS)
    stuck = not task.done()
    if stuck:
        await stop_task(task, grace=STOP_SECONDS, what=f"the {what}'s run()")
    try:
        async with asyncio.timeout(STOP_SECONDS):
            await app.shutdown()
    except TimeoutError:
        raise HarnessError(
            f"the {what}'s shutdown did not finish within {STOP_SECONDS:g} s"
        ) from None
    if stuck:
        raise HarnessError(f"the {what}'s run() did not stop within {STOP_SECONDS:g} s of stop")
    tunnel = getattr(app, "_tunnel_task", None)  # Agent.shutdown only logs one left running
    if tunnel is not None and not tunnel.done():
        raise HarnessError(f"the {what}'s tunnel still runs after its shutdown")
    if not task.cancelled() and (exc := task.exception()) is not None:
        raise exc  # run() failed: as before, the test sees why


def with_port(cfg: GatewayConfig, ssh_port: int) -> GatewayConfig:
    return dataclasses.replace(
        cfg, ssh=dataclasses.replace(cfg.ssh, listen=f"127.0.0.1:{ssh_port}")
    )


async def metrics_text(gateway: Gateway) -> str:
    async with httpx.AsyncClient() as client:
        r = await client.get(f"http://127.0.0.1:{gateway.http_port}/metrics")
        r.raise_for_status()
        return r.text


def auth_failures(gateway: Gateway, reason: str) -> int:
    assert gateway.ssh is not None
    return gateway.ssh.policy.failures.get(reason, 0)


@asynccontextmanager
async def fake_exporter(body: str, delay: float = 0.0) -> AsyncIterator[int]:
    """A stand-in for node_exporter on a sibling machine of the edge LAN (loopback here);
    yields its port. ``delay`` makes it slow, for timeout tests."""

    async def handler(request: web.Request) -> web.Response:
        await asyncio.sleep(delay)
        return web.Response(text=body)

    app = web.Application()
    app.router.add_get("/metrics", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    finally:
        await runner.cleanup()
