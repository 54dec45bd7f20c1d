"""Reconnect storm: many agents connected to a gateway that is restarted.

N agent tunnels (real asyncssh clients, one process, each with its own node certificate)
push a small snapshot to a gateway running as its own process. The gateway is restarted
(SIGTERM: GOODBYE to every agent, drain, exit; then started again on the same ports).
Reports the time until every agent is back and the spread of their reconnect times: the
agents' full-jitter backoff must keep them from all returning in the same second.

The measurement is :func:`run_storm` (tests/integration/test_reconnect_storm.py runs it
in CI); this script prints its report.

Run: .venv/bin/python bench/reconnect_storm.py [--nodes 500] [--backoff 1.0]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gateway_ingest import BenchError
from edge_agent.config import TunnelConfig
from edge_agent.tunnel import Tunnel
from gpurelay.model import Family, Sample, Snapshot
from gpurelay.wire import Hello
from harness.fleet import make_pki
from harness.process import HarnessError
from harness.services import GatewayProc
from harness.waiting import wait_for

FAMILY = Family(name="DCGM_FI_DEV_GPU_UTIL", type="gauge", help="util")
READY_TIMEOUT = 60.0  # a fresh gateway process: imports, host key, listeners


class StormError(BenchError):
    """The storm could not be measured: agents did not come back, no gateway was ready, or
    the gateway process exited on its own."""


@dataclass(frozen=True)
class StormResult:
    """One reconnect storm. Times in seconds; "after the restart" counts from the moment
    the old gateway was sent SIGTERM."""

    nodes: int
    backoff: float
    certificate_seconds: float  # issuing every node certificate
    initial_connect_seconds: float  # every agent dialling at once, until all connected
    gateway_stop_seconds: float  # SIGTERM to exit: GOODBYE to every agent, drain
    gateway_exit_status: int | None  # the old gateway's exit status (0: clean shutdown)
    ready_seconds: float  # restart until the new gateway answers /readyz with 200
    all_back_seconds: float  # restart until every agent is connected again
    reconnect_seconds: tuple[float, ...]  # per agent: restart until it was connected again
    busiest_second: int  # most reconnects within one whole second after the restart
    seconds_with_reconnects: int  # distinct whole seconds that saw a reconnect
    failures: int  # failed connection attempts, all agents, whole run
    gateway_cpu_seconds: float  # CPU of the new gateway from its start until all back
    final_exit_status: int | None = None  # the new gateway's status when stopped at the end

    @property
    def busiest_share(self) -> float:
        return self.busiest_second / max(1, len(self.reconnect_seconds))

    def lines(self) -> list[str]:
        """The report, one figure per line (what ``main`` prints)."""
        times = self.reconnect_seconds
        return [
            f"issued {self.nodes} node certificates in {self.certificate_seconds:.1f}s",
            f"initial connect of all agents: {self.initial_connect_seconds:.1f}s "
            "(they all dial at once)",
            f"gateway stop (GOODBYE + drain) took {self.gateway_stop_seconds:.1f}s "
            f"(exit status {self.gateway_exit_status}); "
            f"ready again {self.ready_seconds:.1f}s after the restart began",
            f"all {len(times)} agents back {self.all_back_seconds:.1f}s after the restart began",
            f"reconnect times after the restart began: min {min(times):.2f}  "
            f"median {statistics.median(times):.2f}  p95 {pct(times, 0.95):.2f}  "
            f"max {max(times):.2f} s",
            f"busiest second: {self.busiest_second} reconnects "
            f"({self.busiest_share:.0%} of the fleet); "
            f"seconds with reconnects: {self.seconds_with_reconnects}",
            f"failed attempts during the storm (all agents): {self.failures}",
            f"new gateway CPU from start to all back: {self.gateway_cpu_seconds:.2f}s",
        ]


def snapshot(node: str) -> Snapshot:
    labels = (("gpu", "0"), ("Hostname", node))
    return Snapshot(
        node=node,
        timestamp=time.time(),
        families=(FAMILY,),
        samples=(Sample(FAMILY.name, labels, 50.0),),
    )


def pct(values: tuple[float, ...] | list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _back(tunnel: Tunnel, since: float) -> bool:
    return tunnel.stats.connected and tunnel.stats.connected_since >= since


def _log(gateway: GatewayProc) -> str:
    """The gateway's log tail, unless it has exited (the error then already holds it)."""
    return "\n" + gateway.tail() if gateway.running() else ""


async def wait_all(
    tunnels: list[Tunnel], gateway: GatewayProc, *, since: float, timeout: float
) -> list[float]:
    """Per tunnel, how long after ``since`` (wall clock, like ``connected_since``) it was
    connected; raises StormError when some are not connected within ``timeout``."""
    try:
        await wait_for(
            lambda: all(_back(t, since) for t in tunnels),
            timeout,
            "every agent to be connected",
            alive=(gateway,),
        )
    except HarnessError as exc:
        missing = sum(1 for t in tunnels if not _back(t, since))
        raise StormError(
            f"{missing} of {len(tunnels)} agents did not come back within {timeout:g}s: "
            f"{exc}{_log(gateway)}"
        ) from exc
    return [t.stats.connected_since - since for t in tunnels]


async def wait_ready(gateway: GatewayProc, timeout: float = READY_TIMEOUT) -> None:
    async with httpx.AsyncClient(timeout=5.0) as client:

        async def ready() -> bool:
            return (await client.get(gateway.url + "/readyz")).status_code == 200

        try:
            await wait_for(ready, timeout, "the gateway to be ready", poll=0.1, alive=(gateway,))
        except HarnessError as exc:
            raise StormError(f"{exc}{_log(gateway)}") from exc


def _constant(hello: Hello) -> Callable[[], Hello]:
    return lambda: hello


async def run_storm(
    nodes: int, backoff: float, tmp: Path, *, timeout: float, crash: bool = False
) -> StormResult:
    """Connect ``nodes`` agents (backoff_initial_seconds ``backoff``) to a gateway process,
    restart it (``crash``: kill -9 it instead of a clean stop) and measure how they come
    back. ``tmp``: an empty directory for the PKI,
    the gateway's config and its log (``gateway.log``). ``timeout`` bounds the initial
    connect and, from the restart on, the wait for every agent to be back.
    Raises StormError when the storm cannot be measured."""
    started = time.monotonic()
    pki = make_pki(tmp)
    names = [f"edge-{i:04d}" for i in range(nodes)]
    creds = [pki.node(name) for name in names]
    certificate_seconds = time.monotonic() - started
    gateway = GatewayProc(pki, tmp)  # drain_seconds 1.0
    ssh_port = gateway.ssh_port
    tunnels: list[Tunnel] = []
    for name, c in zip(names, creds, strict=True):
        gw_cfg = TunnelConfig(
            address=f"127.0.0.1:{ssh_port}",
            known_hosts=pki.ca.known_hosts,
            key=c.private_key,
            certificate=c.certificate,
            backoff_initial_seconds=backoff,
            backoff_max_seconds=30.0,
            connect_timeout_seconds=30.0,
        )
        hello = Hello(agent_version="bench", node=name)
        # No outbox: without a spool there is nothing to replay, only the reconnect.
        tunnel = Tunnel(gw_cfg, node=name, hello=_constant(hello))
        tunnel.submit(snapshot(name))
        tunnels.append(tunnel)
    tasks: list[asyncio.Task[None]] = []
    try:
        gateway.start()
        await wait_ready(gateway)
        t0 = time.time()
        tasks = [asyncio.create_task(t.run()) for t in tunnels]
        await wait_all(tunnels, gateway, since=0.0, timeout=timeout)
        initial = time.time() - t0
        # A steady fleet: every agent's snapshot acknowledged. An agent the gateway has not
        # answered yet has no session that worked: a drop then is a failed attempt, retried
        # within 2 x backoff, and would crowd the first seconds after a crash by load luck.
        await wait_for(
            lambda: all(t.stats.acked_seq >= 1 for t in tunnels),
            timeout,
            "every agent's first batch to be acknowledged",
            alive=(gateway,),
        )
        # --- the restart ---
        restart = time.time()
        cpu_before = gateway.sample().cpu_seconds
        if crash:
            await asyncio.to_thread(gateway.kill9)
            exit_status = gateway.proc.returncode if gateway.proc is not None else None
        else:
            exit_status = await asyncio.to_thread(gateway.stop)
        stopped = time.time()
        gateway.start()
        await wait_ready(gateway)
        up = time.time()
        times = await wait_all(tunnels, gateway, since=restart, timeout=timeout)
        back = time.time()
        cpu = gateway.sample().cpu_seconds - cpu_before
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        final_status = await asyncio.to_thread(gateway.stop)
    per_second = Counter(int(t) for t in times)
    return StormResult(
        nodes=nodes,
        backoff=backoff,
        certificate_seconds=certificate_seconds,
        initial_connect_seconds=initial,
        gateway_stop_seconds=stopped - restart,
        gateway_exit_status=exit_status,
        ready_seconds=up - restart,
        all_back_seconds=back - restart,
        reconnect_seconds=tuple(times),
        busiest_second=max(per_second.values()),
        seconds_with_reconnects=len(per_second),
        failures=sum(sum(t.stats.failures.values()) for t in tunnels),
        gateway_cpu_seconds=cpu,
        final_exit_status=final_status,
    )


async def main() -> None:
    logging.basicConfig(level=logging.ERROR)  # every refused dial would log a warning
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--nodes", type=int, default=500)
    parser.add_argument(
        "--backoff",
        type=float,
        default=1.0,
        help="agents' backoff_initial_seconds (the after-restart pause is uniform in 0..10x this)",
    )
    parser.add_argument(
        "--mode",
        choices=("restart", "crash", "both"),
        default="both",
        help="a clean restart, a kill -9, or both side by side",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds to wait for all agents (initial connect; back after the restart)",
    )
    args = parser.parse_args()
    print(
        f"reconnect storm: {args.nodes} agents, backoff_initial {args.backoff:g}s; "
        f"python {sys.version.split()[0]}, loopback"
    )
    modes = ("restart", "crash") if args.mode == "both" else (args.mode,)
    for mode in modes:
        with tempfile.TemporaryDirectory(prefix="storm-") as tmp_name:
            try:
                result = await run_storm(
                    args.nodes,
                    args.backoff,
                    Path(tmp_name),
                    timeout=args.timeout,
                    crash=mode == "crash",
                )
            except (BenchError, HarnessError) as exc:
                raise SystemExit(str(exc)) from None
        print(f" gateway {'kill -9' if mode == 'crash' else 'clean restart'}:")
        for line in result.lines():
            print("  " + line)


if __name__ == "__main__":
    asyncio.run(main())
