"""Several gateway processes on one PostgreSQL behind haproxy, as operators run them: the
harness of the process-level cluster tests (issue 16).

- a throwaway PostgreSQL (:mod:`harness.postgres`);
- ``gateways`` gateway processes ``gw-a``, ``gw-b``, ... (:class:`GatewayProc`), each a
  ``[cluster]`` member with its own peer listener, one shared peer token, a short
  heartbeat and TTL, and remote write to a shared :class:`~harness.prometheus.Receiver`
  when asked;
- haproxy in TCP mode (:class:`~harness.haproxy.Haproxy`: leastconn, health checks every
  second) in front of their SSH ports; every agent dials haproxy;
- a fleet of simulated agents: real :class:`edge_agent.tunnel.Tunnel` instances (asyncssh,
  node certificates), all in one worker process (``python -m harness.cluster SPEC``), each
  sending a 1-GPU snapshot stamped with the wall clock every ``interval`` seconds; they have
  no spool (what they send while disconnected is superseded, not replayed);
- a few real agent binaries (:class:`AgentProc`, 2 simulated GPUs, a spool), whose every
  collection must reach the receiver (:func:`harness.prometheus.assert_nothing_lost`);
- optionally a real Prometheus scraping every gateway's ``/metrics`` every second.

    with running_cluster(tmp, prometheus_bin=..., haproxy_bin=...) as c:
        c.nodes("gw-a")                   # /api/v1/nodes of gw-a, by name
        c.kill9("gw-b")

Everything is stopped when the block ends, also on failure."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import string
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from cloud_gateway.cluster.config import ClusterConfig
from harness.fleet import TOKEN, Pki, make_pki
from harness.haproxy import Haproxy
from harness.ports import free_ports
from harness.postgres import PostgresServer
from harness.process import HarnessError, Process
from harness.prometheus import PrometheusProcess, Receiver
from harness.services import AgentProc, GatewayProc
from harness.victoria import VictoriaMetrics
from harness.waiting import wait_until

AUTH = {"Authorization": f"Bearer {TOKEN}"}
PEER_TOKEN = "cluster-peer-token-0123456789abcdef"
STATUS_SECONDS = 0.5  # the worker rewrites its status file this often


@dataclass(frozen=True)
class ClusterSpec:
    gateways: int = 3
    simulated: int = 30  # tunnels in the worker process
    real: int = 4  # agent binaries (spool, every collection checked in the receiver)
    interval: float = 1.0  # the simulated agents' period (the real ones collect every 1 s)
    backoff_initial: float = 0.2  # the simulated agents' backoff (after a lost session they
    backoff_max: float = 2.0  # pause uniformly in 0..10 x backoff_initial)
    heartbeat_seconds: float = 0.5
    ttl_seconds: float = 3.0
    remote_write: bool = False  # a shared Receiver, every gateway writing to it
    victoria: bool = False  # VictoriaMetrics instead (single node, /api/v1/write)
    scrape: bool = False  # a Prometheus scraping every gateway's /metrics every second
    joining: int = 0  # gateways started later (Cluster.join): haproxy spares, scraped too
    # haproxy retries a refused connection elsewhere, marks that gateway down (as shipped)
    redispatch: bool = True


@dataclass
class Cluster:
    spec: ClusterSpec
    tmp: Path
    pki: Pki
    postgres: PostgresServer
    gateways: dict[str, GatewayProc] = field(default_factory=dict)
    joining: dict[str, GatewayProc] = field(default_factory=dict)  # not started yet
    lb: Haproxy | None = None
    fleet: SimulatedFleet | None = None
    agents: dict[str, AgentProc] = field(default_factory=dict)
    receiver: Receiver | None = None
    victoria: VictoriaMetrics | None = None
    prometheus: PrometheusProcess | None = None
    started: float = 0.0

    # -- what the tests ask ------------------------------------------------------------------

    @property
    def node_names(self) -> list[str]:
        sim = self.fleet.names if self.fleet is not None else []
        return sorted([*sim, *self.agents])

    def live(self) -> list[str]:
        return [g for g, proc in self.gateways.items() if proc.running()]

    def api(self, gateway: str, path: str) -> Any:
        r = httpx.get(f"{self.gateways[gateway].url}{path}", headers=AUTH, timeout=10)
        r.raise_for_status()
        return r.json()

    def nodes(self, gateway: str) -> dict[str, dict[str, Any]]:
        """``/api/v1/nodes`` of ``gateway``, by node name."""
        return {n["name"]: n for n in self.api(gateway, "/api/v1/nodes")["nodes"]}

    def view(self, gateway: str) -> dict[str, tuple[str, str]]:
        """(owner, state) of every node, as ``gateway`` lists them."""
        return {name: (n.get("gateway", ""), n["state"]) for name, n in self.nodes(gateway).items()}

    def owners(self, gateway: str) -> dict[str, str]:
        return {name: owner for name, (owner, _) in self.view(gateway).items()}

    def all_owned(self, gateway: str, among: list[str]) -> bool:
        """Every node of the fleet listed by ``gateway`` as online on one of ``among``."""
        view = self.view(gateway)
        return all(
            name in view and view[name][0] in among and view[name][1] == "online"
            for name in self.node_names
        )

    def agent_drained(self, node: str) -> bool:
        agent = self.agents[node]
        return (
            agent.metric("gpurelay_agent_spool_batches") == 0
            and agent.metric("gpurelay_agent_gateway_connected") == 1
        )

    def kill9(self, gateway: str) -> None:
        self.gateways[gateway].kill9()

    def drain(self, gateway: str) -> None:
        """haproxy sends no new agent to ``gateway`` and cuts the connections through it:
        its agents reconnect to the others while it runs (a move between live gateways)."""
        assert self.lb is not None
        self.lb.command(f"set server gateways/{gateway} state drain")
        self.lb.command(f"shutdown sessions server gateways/{gateway}")

    def undrain(self, gateway: str) -> None:
        assert self.lb is not None
        self.lb.command(f"set server gateways/{gateway} state ready")

    def logs(self, lines: int = 30) -> str:
        procs: list[Process | None] = [
            *self.gateways.values(), self.lb, self.fleet, *self.agents.values(),
            self.receiver, self.victoria, self.prometheus, self.postgres.server,
        ]  # fmt: skip
        return "\n".join(_tail(p, lines) for p in procs if p is not None)

    def grep(self, gateway: str, text: str) -> list[str]:
        log = self.gateways[gateway].log.read_text(errors="replace")
        return [line for line in log.splitlines() if text in line]

    # -- start and stop ----------------------------------------------------------------------

    def start(self, prometheus_bin: Path | None, haproxy_bin: Path | None) -> None:
        spec, tmp = self.spec, self.tmp
        self.started = time.time()
        dsn = self._database()
        if (spec.remote_write or spec.scrape) and prometheus_bin is None:
            raise HarnessError("remote write and scraping need a Prometheus binary")
        if spec.remote_write:
            assert prometheus_bin is not None
            self.receiver = Receiver(prometheus_bin, _dir(tmp / "receiver"))
            self.receiver.start()
            wait_until(self.receiver.ready, 60, "the receiver ready")
        if spec.victoria:
            self.victoria = VictoriaMetrics(_dir(tmp / "victoria"))
            self.victoria.start()
        token = tmp / "peer.token"
        token.write_text(PEER_TOKEN + "\n")
        for k in range(spec.gateways + spec.joining):
            gid = f"gw-{string.ascii_lowercase[k]}"
            (peer,) = free_ports(1)
            cluster = ClusterConfig(
                database=dsn,
                gateway_id=gid,
                peer_listen=f"127.0.0.1:{peer}",
                peer_token_file=str(token),
                heartbeat_seconds=spec.heartbeat_seconds,
                ttl_seconds=spec.ttl_seconds,
            )
            url = self.receiver.url if self.receiver is not None else ""
            url = self.victoria.url if self.victoria is not None else url
            gw = GatewayProc(self.pki, _dir(tmp / gid), url, cluster=cluster)
            (self.gateways if k < spec.gateways else self.joining)[gid] = gw
        for gw in self.gateways.values():
            gw.start()
        for gw in self.gateways.values():
            wait_until(gw.ready, 60, f"{gw.log.parent.name} ready", alive=[gw])
        if spec.scrape:
            assert prometheus_bin is not None
            self.prometheus = PrometheusProcess(
                prometheus_bin, _dir(tmp / "prometheus"), self._scrape_config()
            )
            self.prometheus.start()
            wait_until(self.prometheus.ready, 60, "prometheus ready")
        backends = [(gid, gw.ssh_port) for gid, gw in self.gateways.items()]
        self.lb = Haproxy(
            _dir(tmp / "haproxy"),
            backends,
            spare=list(self.joining),
            binary=haproxy_bin,
            redispatch=spec.redispatch,
        )
        self.lb.start()
        for k in range(spec.real):
            self.add_agent(f"edge-real-{k}")
        if spec.simulated:
            self.fleet = SimulatedFleet(self.pki, tmp, spec, self.lb.port)
            self.fleet.start()

    def add_agent(self, node: str) -> AgentProc:
        """A real agent of ``node`` dialing haproxy, started."""
        assert self.lb is not None
        first = next(iter(self.gateways.values()))
        agent = AgentProc(
            self.pki, _dir(self.tmp / node), node, first,
            spool_dir=self.tmp / node / "spool", address=f"127.0.0.1:{self.lb.port}",
        )  # fmt: skip
        self.agents[node] = agent
        agent.start()
        return agent

    def join(self) -> str:
        """The next joining gateway started, ready, and added to haproxy (its spare server
        made ready: agents reconnecting from now on may land on it); its id."""
        assert self.lb is not None and self.joining, "ClusterSpec(joining=...) has none left"
        gid = next(iter(self.joining))
        gw = self.joining.pop(gid)
        self.gateways[gid] = gw
        gw.start()
        wait_until(gw.ready, 60, f"{gid} ready", alive=[gw])
        self.lb.add(gid, gw.ssh_port)
        return gid

    def _database(self) -> str:
        self.postgres.start()
        return self.postgres.dsn

    def _scrape_config(self) -> str:
        lines = [
            "global:",
            "  scrape_interval: 1s",
            "  scrape_timeout: 1s",
            "scrape_configs:",
            "  - job_name: gateways",
            "    static_configs:",
        ]
        for gid, gw in {**self.gateways, **self.joining}.items():
            lines += [
                f"      - targets: ['127.0.0.1:{gw.http_port}']",
                f"        labels: {{scraped_from: '{gid}'}}",
            ]
        return "\n".join(lines) + "\n"

    def wait_settled(self, timeout: float = 60.0) -> None:
        """Every node online on a live gateway, as every live gateway lists it, and every
        real agent acknowledged."""
        live = self.live()
        for gid in live:
            wait_until(
                lambda gid=gid: self.all_owned(gid, live),  # type: ignore[misc]
                timeout,
                f"every node listed online by {gid}",
                poll=0.5,
                alive=self._alive(),
            )
        for node, agent in self.agents.items():
            wait_until(
                lambda a=agent: a.metric("gpurelay_agent_gateway_acked_seq") > 0,  # type: ignore[misc]
                timeout,
                f"{node}'s first ACK",
                alive=[agent],
            )

    def _alive(self) -> list[Process]:
        procs: list[Process] = [gw for gw in self.gateways.values() if gw.running()]
        if self.fleet is not None:
            procs.append(self.fleet)
        return procs

    def stop(self) -> None:
        """Everything that was started, in reverse; a failure to stop one does not keep the
        others running."""
        procs: list[Process | None] = [
            self.fleet, *self.agents.values(), self.lb, self.prometheus,
            *self.gateways.values(), self.receiver, self.victoria,
        ]  # fmt: skip
        for proc in procs:
            if proc is not None:
                with contextlib.suppress(Exception):
                    proc.stop(timeout=10)
        with contextlib.suppress(Exception):
            self.postgres.remove()


def _tail(proc: Process, lines: int) -> str:
    """The end of ``proc``'s log without the remote-write client's request lines."""
    try:
        text = proc.log.read_text(errors="replace")
    except OSError:
        return ""
    kept = [line for line in text.splitlines() if "httpx: HTTP Request" not in line]
    return f"--- {proc.name} log ({proc.log}) ---\n" + "\n".join(kept[-lines:])


def _dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def running_cluster(
    tmp: Path,
    spec: ClusterSpec = ClusterSpec(),
    *,
    prometheus_bin: Path | None = None,
    haproxy_bin: Path | None = None,
) -> Iterator[Cluster]:
    """A started cluster (every node not yet known to be listed: see
    :meth:`Cluster.wait_settled`); every process stopped afterwards."""
    cluster = Cluster(spec, tmp, make_pki(tmp), PostgresServer.find())
    try:
        cluster.start(prometheus_bin, haproxy_bin)
        yield cluster
    finally:
        cluster.stop()


# -- the simulated fleet: one worker process of tunnels -----------------------------------------


class SimulatedFleet(Process):
    """``spec.simulated`` tunnels (nodes ``edge-sim-NNN``) in one process dialing
    haproxy; :meth:`status` reads what each one is doing from the file the worker rewrites
    every ``STATUS_SECONDS``."""

    def __init__(self, pki: Pki, tmp: Path, spec: ClusterSpec, port: int) -> None:
        self.names = [f"edge-sim-{k:03d}" for k in range(spec.simulated)]
        self.status_file = tmp / "fleet-status.json"
        nodes = []
        for name in self.names:
            creds = pki.node(name)
            nodes.append(
                {"name": name, "key": str(creds.private_key), "cert": str(creds.certificate)}
            )
        path = tmp / "fleet.json"
        path.write_text(
            json.dumps(
                {
                    "port": port,
                    "known_hosts": str(pki.ca.known_hosts),
                    "interval": spec.interval,
                    "backoff": [spec.backoff_initial, spec.backoff_max],
                    "status": str(self.status_file),
                    "nodes": nodes,
                }
            )
        )
        super().__init__(
            "simulated agents",
            [sys.executable, "-m", "harness.cluster", str(path)],
            tmp / "fleet.log",
        )

    def status(self) -> dict[str, dict[str, Any]]:
        """Per node: connected, connects, batches_sent, acked_seq, last_error."""
        self.check_alive()
        data: dict[str, dict[str, Any]] = json.loads(self.status_file.read_text())
        return data


async def _fleet(spec: dict[str, Any]) -> None:
    from edge_agent import __version__
    from edge_agent.config import TunnelConfig
    from edge_agent.tunnel import Tunnel
    from gpurelay.wire import Hello
    from harness.pipeline import simulated_snapshots

    timeline = simulated_snapshots(gpus=1, processes_per_gpu=1, count=10, step=spec["interval"])
    interval = float(spec["interval"])
    tunnels: dict[str, Tunnel] = {}
    for node in spec["nodes"]:
        name = node["name"]
        cfg = TunnelConfig(
            address=f"127.0.0.1:{spec['port']}",
            known_hosts=Path(spec["known_hosts"]),
            key=Path(node["key"]),
            certificate=Path(node["cert"]),
            connect_timeout_seconds=5.0,
            backoff_initial_seconds=float(spec["backoff"][0]),
            backoff_max_seconds=float(spec["backoff"][1]),
        )
        hello = Hello(
            agent_version=__version__, node=name, domain=name, backend="simulated",
            hostname=name, interval_seconds=interval, gpus=timeline[0].gpus,
        )  # fmt: skip
        tunnels[name] = Tunnel(cfg, node=name, hello=lambda h=hello: h)  # type: ignore[misc]
    tasks = [asyncio.create_task(t.run(), name=n) for n, t in tunnels.items()]
    status = Path(spec["status"])
    loop = asyncio.get_running_loop()
    this = asyncio.current_task()
    assert this is not None
    loop.add_signal_handler(signal.SIGTERM, this.cancel)
    k = 0
    next_send = loop.time()
    next_status = loop.time()
    try:
        while True:
            now = loop.time()
            if now >= next_send:
                snapshot = dataclasses.replace(timeline[k % len(timeline)], timestamp=time.time())
                for tunnel in tunnels.values():
                    tunnel.submit(snapshot)
                k += 1
                next_send = max(next_send + interval, now)
            if now >= next_status:
                _write_status(status, tunnels)
                next_status = now + STATUS_SECONDS
            await asyncio.sleep(max(0.0, min(next_send, next_status) - loop.time()))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks, timeout=10)


def _write_status(path: Path, tunnels: dict[str, Any]) -> None:
    out = {
        name: {
            "connected": t.stats.connected,
            "connects": t.stats.connects,
            "batches_sent": t.stats.batches_sent,
            "acked_seq": t.stats.acked_seq,
            "last_error": t.stats.last_error,
        }
        for name, t in tunnels.items()
    }
    part = path.with_suffix(".part")
    part.write_text(json.dumps(out))
    os.replace(part, path)


def main() -> int:
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )  # fmt: skip
    logging.getLogger("asyncssh").setLevel(logging.WARNING)
    spec = json.loads(Path(sys.argv[1]).read_text())
    with contextlib.suppress(asyncio.CancelledError, KeyboardInterrupt):
        asyncio.run(_fleet(spec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
