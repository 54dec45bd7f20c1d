"""Reconnect storm: many agents connected to a gateway that is restarted.

N agent tunnels (real asyncssh clients, one process, each with its own node certificate)
push a small snapshot to a gateway running as its own process. The gateway is restarted
(SIGTERM: GOODBYE to every agent, drain, exit; then started again on the same ports).
Reports the time until every agent is back and the spread of their reconnect times: the
agents' full-jitter backoff must keep them from all returning in the same second.

Run: .venv/bin/python bench/reconnect_storm.py [--nodes 500] [--backoff 1.0]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gateway_ingest import GatewayProcess, free_ports, gateway_toml
from edge_agent.config import GatewayConfig as AgentGatewayConfig
from edge_agent.model import Family, Sample, Snapshot
from edge_agent.tunnel import Tunnel
from edge_agent.wire import Hello
from tests.gateway_support import gateway_config, make_pki

FAMILY = Family(name="DCGM_FI_DEV_GPU_UTIL", type="gauge", help="util")


def snapshot(node: str) -> Snapshot:
    labels = (("gpu", "0"), ("Hostname", node))
    return Snapshot(
        node=node,
        timestamp=time.time(),
        families=(FAMILY,),
        samples=(Sample(FAMILY.name, labels, 50.0),),
    )


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def wait_all(tunnels: list[Tunnel], *, since: float, timeout: float) -> list[float]:
    """Per tunnel, when it (re)connected after ``since`` (monotonic-free: wall clock)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        back = [t.stats.connected and t.stats.connected_since >= since for t in tunnels]
        if all(back):
            return [t.stats.connected_since - since for t in tunnels]
        await asyncio.sleep(0.05)
    missing = sum(
        1 for t in tunnels if not (t.stats.connected and t.stats.connected_since >= since)
    )
    raise SystemExit(f"{missing} of {len(tunnels)} agents did not come back within {timeout:.0f}s")


async def main() -> None:
    logging.basicConfig(level=logging.ERROR)  # every refused dial would log a warning
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=500)
    parser.add_argument(
        "--backoff",
        type=float,
        default=1.0,
        help="agents' backoff_initial_seconds (the after-restart pause is uniform in 0..10x this)",
    )
    args = parser.parse_args()
    print(
        f"reconnect storm: {args.nodes} agents, backoff_initial {args.backoff:g}s; "
        f"python {sys.version.split()[0]}, loopback"
    )
    with tempfile.TemporaryDirectory(prefix="storm-") as tmp_name:
        tmp = Path(tmp_name)
        started = time.monotonic()
        pki = make_pki(tmp)
        creds = [pki.node(f"edge-{i:04d}") for i in range(args.nodes)]
        print(f"  issued {args.nodes} node certificates in {time.monotonic() - started:.1f}s")
        ssh_port, http_port = free_ports(2)
        cfg = gateway_config(pki, ssh_port=ssh_port)
        cfg = dataclasses.replace(
            cfg,
            drain_seconds=1.0,
            http=dataclasses.replace(cfg.http, listen=f"127.0.0.1:{http_port}"),
        )
        config = tmp / "gateway.toml"
        config.write_text(gateway_toml(cfg))
        gateway = GatewayProcess(config, tmp / "gateway.log", http_port)
        gateway.start()
        await _ready(gateway)
        tunnels = []
        for i, c in enumerate(creds):
            node = f"edge-{i:04d}"
            gw_cfg = AgentGatewayConfig(
                address=f"127.0.0.1:{ssh_port}",
                known_hosts=pki.ca.known_hosts,
                key=c.private_key,
                certificate=c.certificate,
                backoff_initial_seconds=args.backoff,
                backoff_max_seconds=30.0,
                connect_timeout_seconds=30.0,
            )
            tunnel = Tunnel(
                gw_cfg, node=node, hello=lambda n=node: Hello(agent_version="bench", node=n)
            )
            tunnel.submit(snapshot(node))
            tunnels.append(tunnel)
        t0 = time.time()
        tasks = [asyncio.create_task(t.run()) for t in tunnels]
        first = await wait_all(tunnels, since=0.0, timeout=300)
        print(f"  initial connect of all agents: {time.time() - t0:.1f}s (they all dial at once)")
        del first
        # --- the restart ---
        restart = time.time()
        cpu_before = gateway.sample().cpu_seconds
        gateway.stop()
        stopped = time.time()
        gateway.start()
        await _ready(gateway)
        up = time.time()
        times = await wait_all(tunnels, since=restart, timeout=600)
        back = time.time()
        cpu = gateway.sample().cpu_seconds - cpu_before
        failures = sum(sum(t.stats.failures.values()) for t in tunnels)
        per_second: dict[int, int] = {}
        for t in times:
            per_second[int(t)] = per_second.get(int(t), 0) + 1
        print(
            f"  gateway stop (GOODBYE + drain) took {stopped - restart:.1f}s; "
            f"ready again {up - restart:.1f}s after the restart began"
        )
        print(f"  all {len(times)} agents back {back - restart:.1f}s after the restart began")
        print(
            f"  reconnect times after the restart began: min {min(times):.2f}  "
            f"median {statistics.median(times):.2f}  p95 {pct(times, 0.95):.2f}  "
            f"max {max(times):.2f} s"
        )
        print(
            f"  busiest second: {max(per_second.values())} reconnects "
            f"({max(per_second.values()) / len(times):.0%} of the fleet); "
            f"seconds with reconnects: {len(per_second)}"
        )
        print(f"  failed attempts during the storm (all agents): {failures}")
        print(f"  new gateway CPU from start to all back: {cpu:.2f}s")
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        gateway.stop()


async def _ready(gateway: GatewayProcess) -> None:
    import httpx

    deadline = time.monotonic() + 30
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            gateway.check_alive()
            try:
                if (await client.get(gateway.url + "/readyz")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.1)
    raise SystemExit("the gateway did not become ready: " + gateway.log_tail())


if __name__ == "__main__":
    asyncio.run(main())
