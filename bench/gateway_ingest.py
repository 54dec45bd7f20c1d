"""Gateway ingest over real SSH: gateway CPU per batch and bytes per batch, many agents.

Setup: a throwaway fleet PKI (one certificate per node); the gateway runs as its own
process (``python -m cloud_gateway run --config FILE``) on loopback, so its CPU time can be
read from ``/proc/<pid>/stat``. This process runs every agent's real
:class:`edge_agent.tunnel.Tunnel` (asyncssh, node certificate, one telemetry channel) on
one event loop. The data is precomputed once with the simulator (8 GPUs with their
processes attributed through a fake host tree, the collector's real timer, one collection
every 10 s of simulated time); node k replays that timeline from snapshot k mod
``--spread``, one batch every ``--interval`` seconds, its batches spread evenly over the
interval, so the gateway sees realistic 10-second-apart data from every node.

Phases: connect all nodes (HELLO only); idle window (connected, nothing sent); start
sending and skip each node's first ``--warmup`` batches after the first (DECLARE + full)
one; measurement window; stop sending, let the acks drain, cross-check the counts.

Figures:
(a) gateway CPU per batch = gateway utime+stime over the window / batches the gateway
    applied in it (summed ``batches_received`` of ``/api/v1/nodes``, which is live; the
    ``gpurelay_gateway_batches_total`` counter on ``/metrics`` is refreshed by the 1 s tick
    and is cross-checked at the end). Nothing is subtracted: the 1 s tick, keepalives and
    one API read are in it; the idle CPU over an equal window is shown beside it.
    Target: <= 150 us per 8-GPU batch (and <= 15 % of one core at 1,000 nodes at 1 s).
(b) bytes per steady-state batch, as written into the SSH channel after the wire's
    compression (``Tunnel.stats.bytes_sent`` delta / ``batches_sent`` delta per node over
    the window; SSH framing and encryption not included). Median and p95 over nodes.
    Target: <= 512 bytes for an 8-GPU node.

Run: .venv/bin/python bench/gateway_ingest.py [--nodes 100] [--gpus 8] [--interval 1]
     [--seconds 20] [--idle-seconds SECONDS] [--warmup 5] [--spread 30]
     [--profile FILE]   (py-spy record of the gateway over the measurement window,
                         raw/collapsed stacks; needs py-spy on PATH or in the venv)
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edge_agent import __version__
from edge_agent.config import TunnelConfig
from edge_agent.tunnel import Tunnel
from edge_agent.tunnel_stats import TunnelStats
from gpurelay.model import GpuInventory, Snapshot
from gpurelay.wire import Hello
from harness.fleet import TOKEN, Pki, make_pki
from harness.pipeline import simulated_snapshots
from harness.process import HarnessError, ProcSample
from harness.services import GatewayProc
from harness.waiting import wait_for

SEED = 7
DATA_STEP = 10.0  # simulated seconds between two collections (the agent's default interval)
TIMESTAMP_JITTER = 0.02  # a real collection loop starts a few ms late; so do these stamps
CPU_TARGET_US = 150.0
CORE_TARGET = 0.15  # share of one core at 1,000 nodes, 1 s
BYTES_TARGET = 512
CONNECT_TIMEOUT = 90.0
SETTLE_SECONDS = 1.5  # after the last connect: handshakes and their logging are over
DRAIN_TIMEOUT = 10.0


# --- data ------------------------------------------------------------------------------------


def make_snapshots(gpus: int, processes_per_gpu: int, count: int) -> list[Snapshot]:
    """``count`` collections of one simulated node, DATA_STEP seconds of data apart."""
    return simulated_snapshots(
        gpus=gpus, processes_per_gpu=processes_per_gpu, count=count, step=DATA_STEP, seed=SEED
    )


# --- the gateway ------------------------------------------------------------------------------


class BenchError(Exception):
    """The bench could not take its measurement; the message says why."""


def metric(text: str, name: str, labels: str = "") -> float:
    """The value of the sample ``name{labels}`` in a text exposition (0 when absent)."""
    prefix = f"{name}{labels} "
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix) :].split()[0])
    return 0.0


def metric_sum(text: str, name: str) -> float:
    """The sum of every sample of family ``name`` (any labels)."""
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)", re.MULTILINE)
    return sum(float(m.group(1)) for m in pattern.finditer(text))


class GatewayClient:
    def __init__(self, url: str) -> None:
        # identity: a gzip'd /metrics would be compressed in a gateway worker thread
        self._http = httpx.AsyncClient(
            base_url=url, timeout=30.0, headers={"Accept-Encoding": "identity"}
        )
        self._auth = {"Authorization": f"Bearer {TOKEN}"}

    async def close(self) -> None:
        await self._http.aclose()

    async def ready(self) -> bool:
        try:
            return (await self._http.get("/readyz")).status_code == 200
        except httpx.TransportError:
            return False

    async def metrics(self) -> str:
        r = await self._http.get("/metrics")
        r.raise_for_status()
        return r.text

    async def nodes(self) -> list[dict[str, Any]]:
        r = await self._http.get("/api/v1/nodes", headers=self._auth)
        r.raise_for_status()
        nodes: list[dict[str, Any]] = r.json()["nodes"]
        return nodes

    async def batches(self) -> int:
        """Batches the gateway has applied, all nodes, counted live by the registry."""
        return sum(int(n["batches_received"]) for n in await self.nodes())


# --- the agents ------------------------------------------------------------------------------


class RecordingStats(TunnelStats):
    """``TunnelStats`` that also notes when each batch was written and when it was
    acknowledged, and the size of every frame before the first batch (HELLO, DECLARE,
    BATCH).

    The tunnel only ever assigns to its public ``stats`` fields, so watching those
    assignments needs nothing private. A batch is identified by its sequence number (the
    outbox's ``latest`` when ``batches_sent`` goes up: the tunnel sends the newest
    snapshot and counts it without yielding in between). ``acked_seq`` is the highest
    acknowledged seq, and the gateway acknowledges in order on one channel, so an increase
    from ``a`` to ``b`` acknowledges every sent seq in ``(a, b]`` -- however many ACKs (or
    a range) arrived in one read. Counting increases instead undercounts.
    """

    def __init__(self, outbox: Any = None) -> None:
        self.outbox = outbox  # the tunnel's Outbox: its public ``latest`` names the seq
        self.sent_at: list[float] = []
        self.sent_seqs: list[int] = []
        self.acked_at: list[float] = []  # acked_at[i] is for sent_seqs[i]
        self.first_frames: list[int] = []
        super().__init__()

    def __setattr__(self, name: str, value: Any) -> None:
        seen = self.__dict__
        if name in seen and "first_frames" in seen:  # an update by the tunnel
            if name == "bytes_sent" and seen["batches_sent"] == 0:
                self.first_frames.append(value - seen["bytes_sent"])
            elif name == "batches_sent" and value > seen[name]:
                latest = getattr(self.outbox, "latest", None)
                self.sent_seqs.append(latest[0] if latest is not None else -1)
                self.sent_at.append(time.monotonic())
            elif name == "acked_seq" and value > seen[name]:
                now = time.monotonic()
                sent, acked = self.sent_seqs, self.acked_at
                while len(acked) < len(sent) and sent[len(acked)] <= value:
                    acked.append(now)
        super().__setattr__(name, value)

    @property
    def unacked(self) -> int:
        """Batches sent and not yet acknowledged."""
        return len(self.sent_seqs) - len(self.acked_at)


@dataclass
class Node:
    name: str
    tunnel: Tunnel
    stats: RecordingStats
    start: int  # index of its first snapshot in the timeline
    submitted: int = 0
    wrapped: int = 0  # submissions that ran past the end of the timeline (restarted at 0)
    task: asyncio.Task[None] | None = None
    sender: asyncio.Task[None] | None = None


def _constant(hello: Hello) -> Callable[[], Hello]:
    return lambda: hello


def make_nodes(
    pki: Pki,
    count: int,
    ssh_port: int,
    spread: int,
    hello_gpus: tuple[GpuInventory, ...],
    interval: float,
) -> list[Node]:
    nodes = []
    for k in range(count):
        name = f"bench-node-{k:04d}"
        creds = pki.node(name)
        cfg = TunnelConfig(
            address=f"127.0.0.1:{ssh_port}",
            known_hosts=pki.ca.known_hosts,
            key=creds.private_key,
            certificate=creds.certificate,
            connect_timeout_seconds=CONNECT_TIMEOUT / 2,
            backoff_initial_seconds=0.2,
            backoff_max_seconds=2.0,
        )
        hello = Hello(
            agent_version=__version__,
            node=name,
            domain=name,
            backend="simulated",
            hostname=name,
            interval_seconds=interval,
            gpus=hello_gpus,
        )
        tunnel = Tunnel(cfg, node=name, hello=_constant(hello))
        stats = RecordingStats(tunnel.outbox)
        tunnel.stats = stats
        nodes.append(Node(name, tunnel, stats, start=k % spread))
    return nodes


async def send_loop(
    node: Node, timeline: Sequence[Snapshot], interval: float, first_at: float, seed: int
) -> None:
    """Submit the node's next snapshot every ``interval`` s (absolute schedule, no burst)."""
    loop = asyncio.get_running_loop()
    jitter = random.Random(seed)
    base = timeline[0].timestamp
    next_at = first_at
    while True:
        await asyncio.sleep(max(0.0, next_at - loop.time()))
        position = node.start + node.submitted
        if position >= len(timeline):
            node.wrapped += 1
        snapshot = timeline[position % len(timeline)]
        stamp = base + DATA_STEP * position + jitter.uniform(0, TIMESTAMP_JITTER)
        node.tunnel.submit(dataclasses.replace(snapshot, timestamp=stamp))
        node.submitted += 1
        next_at += interval
        if next_at < loop.time():  # this process fell behind: do not burst
            next_at = loop.time() + interval


# --- figures ---------------------------------------------------------------------------------


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def spread_line(values: Sequence[float], fmt: str = ".0f") -> str:
    if not values:
        return "n/a"
    return (
        f"median {statistics.median(values):{fmt}}  p95 {pct(values, 0.95):{fmt}}  "
        f"max {max(values):{fmt}}"
    )


def label(text: str) -> str:
    return f"  {text:<46}"


@dataclass
class Window:
    wall: float
    cpu: ProcSample
    gateway_batches: int
    bytes_sent: list[int] = field(default_factory=list)
    batches_sent: list[int] = field(default_factory=list)
    wrapped: int = 0
    bench_cpu: float = 0.0


async def take(gw: GatewayProc, client: GatewayClient, nodes: Sequence[Node]) -> Window:
    batches = await client.batches()
    cpu = gw.sample()  # right after the count: the window holds one API read, no more
    return Window(
        wall=time.monotonic(),
        cpu=cpu,
        gateway_batches=batches,
        bytes_sent=[n.stats.bytes_sent for n in nodes],
        batches_sent=[n.stats.batches_sent for n in nodes],
        wrapped=sum(n.wrapped for n in nodes),
        bench_cpu=time.process_time(),
    )


# --- the run ---------------------------------------------------------------------------------


async def run(args: argparse.Namespace, tmp: Path) -> None:
    t_setup = time.monotonic()
    per_node = args.warmup + 3 + math.ceil(args.seconds / args.interval) + 5
    timeline = make_snapshots(args.gpus, args.processes_per_gpu, args.spread + per_node)
    series = len(timeline[0].samples)
    pki = make_pki(tmp)
    gw = GatewayProc(pki, tmp, log_level="info")
    nodes = make_nodes(pki, args.nodes, gw.ssh_port, args.spread, timeline[0].gpus, args.interval)
    setup_seconds = time.monotonic() - t_setup

    print(
        f"setup: {args.nodes} nodes x {args.gpus} simulated GPUs ({args.processes_per_gpu} "
        f"processes per GPU, {series} series per node), one batch per node every "
        f"{args.interval:g} s carrying data {DATA_STEP:g} s apart; node k replays a "
        f"{len(timeline)}-collection timeline from collection k mod {args.spread}"
    )
    print(
        f"       measurement window {args.seconds:g} s after {args.warmup} warm-up batches per "
        f"node; idle window {args.idle_seconds:g} s; gateway pid in its own process, "
        f"SSH 127.0.0.1:{gw.ssh_port}, HTTP 127.0.0.1:{gw.http_port}; PKI, certificates and "
        f"data prepared in {setup_seconds:.1f} s"
    )

    client = GatewayClient(gw.url)
    try:
        gw.start()
        await wait_for(client.ready, 30, "the gateway to be ready", poll=0.1, alive=(gw,))
        await measure(args, gw, client, nodes, timeline)
    except BaseException:
        print(gw.tail(20), file=sys.stderr)
        raise
    finally:
        await stop_agents(nodes)
        await client.close()
        status = gw.stop()
        if status not in (0, None, -signal.SIGTERM):
            print(f"gateway exited with status {status}", file=sys.stderr)


async def start_profiler(path: str, pid: int, seconds: float) -> Any:
    """py-spy sampling the gateway for the window (it adds a little CPU of its own, in
    its own process, not the gateway's)."""
    exe = Path(sys.executable).with_name("py-spy")
    cmd = [str(exe) if exe.exists() else "py-spy", "record", "--pid", str(pid)]
    cmd += ["--duration", str(max(1, int(seconds))), "--format", "raw", "--output", path]
    cmd += ["--rate", "200", "--nonblocking"]
    return await asyncio.create_subprocess_exec(
        *cmd, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
    )


async def stop_agents(nodes: Sequence[Node]) -> None:
    tasks = [t for n in nodes for t in (n.sender, n.task) if t is not None]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=DRAIN_TIMEOUT)


async def measure(
    args: argparse.Namespace,
    gw: GatewayProc,
    client: GatewayClient,
    nodes: list[Node],
    timeline: Sequence[Snapshot],
) -> None:
    n = len(nodes)
    loop = asyncio.get_running_loop()

    # 1. connect every node: HELLO only, no data yet
    t0 = time.monotonic()
    for node in nodes:
        node.task = asyncio.create_task(node.tunnel.run(), name=f"tunnel {node.name}")
    await wait_for(
        lambda: all(node.stats.connected for node in nodes),
        CONNECT_TIMEOUT,
        f"all {n} nodes to connect",
        poll=0.1,
        alive=(gw,),
    )
    connect_seconds = time.monotonic() - t0

    async def every_channel() -> bool:  # the gauge is refreshed by the gateway's 1 s tick
        return metric(await client.metrics(), "gpurelay_gateway_channels") == n

    await wait_for(every_channel, 10, f"the gateway to count {n} channels", poll=0.25, alive=(gw,))
    await asyncio.sleep(SETTLE_SECONDS)
    connects = sum(node.stats.connects for node in nodes)
    print(f"connect: {n} nodes connected in {connect_seconds:.1f} s ({connects} connects)")

    # 2. idle window: connected, nothing sent (the 1 s tick, keepalives, one API read).
    # The gateway closes a connection silent for 6 intervals + 2 s (cloud_gateway.liveness):
    # end the window 1 s before the first-connected node would be closed (a reconnect
    # storm of every node at 1,000 nodes otherwise).
    silent_for = time.monotonic() - t0
    idle_seconds = min(args.idle_seconds, 6 * args.interval + 2 - 1 - silent_for)
    if idle_seconds < args.idle_seconds:
        print(
            f"idle window shortened to {max(idle_seconds, 0.5):.1f} s: nodes silent for "
            f"{silent_for:.1f} s already, the gateway closes them after "
            f"{6 * args.interval + 2:g} s"
        )
    idle_seconds = max(idle_seconds, 0.5)
    idle0 = await take(gw, client, nodes)
    await asyncio.sleep(idle_seconds)
    idle1 = await take(gw, client, nodes)
    if idle1.gateway_batches != idle0.gateway_batches:
        raise BenchError("batches arrived during the idle window")

    # 3. send; skip each node's first batch (DECLARE + full) and the warm-up batches
    first_at = loop.time() + 0.1
    for k, node in enumerate(nodes):
        phase = args.interval * k / n
        node.sender = asyncio.create_task(
            send_loop(node, timeline, args.interval, first_at + phase, seed=k),
            name=f"sender {node.name}",
        )
    await wait_for(
        lambda: min(node.stats.batches_sent for node in nodes) >= 1 + args.warmup,
        (args.warmup + 2) * args.interval + 60,
        f"every node to send {1 + args.warmup} batches",
        poll=0.1,
        alive=(gw,),
    )

    # 4. measurement window
    profiler = await start_profiler(args.profile, gw.pid, args.seconds) if args.profile else None
    w0 = await take(gw, client, nodes)
    await asyncio.sleep(args.seconds)
    w1 = await take(gw, client, nodes)
    if profiler is not None:
        await profiler.wait()

    # 5. stop sending, let the acks drain, cross-check the gateway's own counters
    for node in nodes:
        if node.sender is not None:
            node.sender.cancel()
    await wait_for(
        lambda: all(node.stats.unacked == 0 for node in nodes),
        DRAIN_TIMEOUT,
        "the last acknowledgements",
        poll=0.1,
        alive=(gw,),
    )
    await asyncio.sleep(1.2)  # one gateway tick: its own counters catch up
    text = await client.metrics()
    api_batches = await client.batches()

    report(args, nodes, idle0, idle1, w0, w1, text, api_batches)


def report(
    args: argparse.Namespace,
    nodes: Sequence[Node],
    idle0: Window,
    idle1: Window,
    w0: Window,
    w1: Window,
    text: str,
    api_batches: int,
) -> None:
    wall = w1.wall - w0.wall
    batches = w1.gateway_batches - w0.gateway_batches
    cpu = w1.cpu.cpu_seconds - w0.cpu.cpu_seconds
    idle_wall = idle1.wall - idle0.wall
    idle_cpu = idle1.cpu.cpu_seconds - idle0.cpu.cpu_seconds
    tick_ms = 1000 / os.sysconf("SC_CLK_TCK")
    if batches <= 0:
        raise BenchError("the gateway applied no batch in the measurement window")
    cpu_us = cpu / batches * 1e6
    verdict = "meets" if cpu_us <= CPU_TARGET_US else "MISSES"

    per_node: list[float] = []
    total_bytes = total_batches = 0
    for i in range(len(nodes)):
        sent = w1.batches_sent[i] - w0.batches_sent[i]
        nbytes = w1.bytes_sent[i] - w0.bytes_sent[i]
        if sent > 0:
            per_node.append(nbytes / sent)
            total_bytes += nbytes
            total_batches += sent
    bytes_p95 = pct(per_node, 0.95) if per_node else math.inf
    bytes_verdict = "meets" if bytes_p95 <= BYTES_TARGET else "MISSES"

    hellos = [s.stats.first_frames[0] for s in nodes if s.stats.first_frames]
    firsts = [sum(s.stats.first_frames[1:]) for s in nodes if len(s.stats.first_frames) > 1]
    shapes = {len(s.stats.first_frames) for s in nodes}
    declares = [s.stats.first_frames[1] for s in nodes if len(s.stats.first_frames) == 3]
    fulls = [s.stats.first_frames[2] for s in nodes if len(s.stats.first_frames) == 3]

    connects = sum(node.stats.connects for node in nodes)
    latencies: list[float] = []  # acked_at[b] is for sent_seqs[b] (see RecordingStats)
    for i, node in enumerate(nodes):
        sent_at, acked_at = node.stats.sent_at, node.stats.acked_at
        for b in range(w0.batches_sent[i], min(w1.batches_sent[i], len(acked_at))):
            latencies.append((acked_at[b] - sent_at[b]) * 1000)

    print(f"measurement window: {wall:.1f} s")
    print(
        label("batches applied by the gateway")
        + f"{batches} ({batches / wall:.1f} batches/s; {args.nodes / args.interval:.1f} offered)"
    )
    print(
        label("(a) gateway CPU per batch")
        + f"{cpu_us:.0f} us   ({verdict} target <= {CPU_TARGET_US:.0f} us: "
        f"{cpu_us / CPU_TARGET_US:.2f}x the target)"
    )
    print(
        label("    gateway CPU in the window")
        + f"{cpu * 1000:.0f} ms = {cpu / wall * 100:.1f}% of one core "
        f"(utime+stime, {tick_ms:.0f} ms ticks; nothing subtracted; "
        f"{cpu / wall / CORE_TARGET:.2f}x the 15% target, {os.cpu_count()} cores here)"
    )
    busy = max(cpu / wall - idle_cpu / idle_wall, 0.0)
    print(
        label("    ingest over idle")
        + f"{busy / max(idle_cpu / idle_wall, 1e-9):.1f}x the idle CPU rate "
        f"({busy * 1e6 / max(batches / wall, 1e-9):.0f} us per batch above idle)"
    )
    print(
        label("    idle baseline, equal window")
        + f"{idle_cpu * 1000:.0f} ms over {idle_wall:.1f} s = "
        f"{idle_cpu / idle_wall * 100:.1f}% of one core "
        f"(= {idle_cpu / batches * 1e6:.0f} us per measured batch); {args.nodes} nodes "
        "connected, not sending"
    )
    print(
        label("    gateway RSS") + f"{w1.cpu.rss_kib / 1024:.1f} MiB (after the idle window "
        f"{idle1.cpu.rss_kib / 1024:.1f} MiB)"
    )
    print(
        label("(b) bytes per steady-state batch, per node")
        + f"{spread_line(per_node)} bytes   ({bytes_verdict} target <= {BYTES_TARGET})"
    )
    print(
        label("    fleet mean")
        + f"{total_bytes / max(total_batches, 1):.0f} bytes over {total_batches} batches "
        "(after the wire's deflate; SSH framing/MAC not included)"
    )
    if hellos:
        print(label("    HELLO frame") + f"{spread_line(hellos)} bytes")
    if declares and len(shapes) == 1:
        print(label("    first DECLARE frame (every series)") + f"{spread_line(declares)} bytes")
        print(label("    first BATCH frame (full)") + f"{spread_line(fulls)} bytes")
    if firsts:
        print(
            label("    first batch after HELLO (DECLARE + full)") + f"{spread_line(firsts)} bytes"
        )
    print(
        label("ack latency (write -> ack seen by agent)")
        + (f"{spread_line(latencies, '.1f')} ms" if latencies else "n/a")
    )
    bench_cpu = w1.bench_cpu - w0.bench_cpu
    print(
        label("agents' process CPU per batch (context)")
        + f"{bench_cpu / max(total_batches, 1) * 1e6:.0f} us "
        f"({bench_cpu / wall * 100:.1f}% of one core for all {args.nodes} agents)"
    )

    sent = sum(node.stats.batches_sent for node in nodes)
    acked = sum(len(node.stats.acked_at) for node in nodes)
    bytes_sent = sum(node.stats.bytes_sent for node in nodes)
    counter = metric(text, "gpurelay_gateway_batches_total")
    received = metric(text, "gpurelay_gateway_received_bytes_total")
    duplicates = metric(text, "gpurelay_gateway_duplicate_batches_total")
    errors = metric_sum(text, "gpurelay_gateway_protocol_errors_total")
    replaced = metric(text, "gpurelay_gateway_replaced_connections_total")
    wrapped = w1.wrapped - w0.wrapped
    consistent = sent == acked == api_batches == counter and bytes_sent == received
    print(
        f"check: agents sent {sent} batches ({bytes_sent} bytes), acked {acked}; gateway "
        f"counted {api_batches} (API) / {counter:.0f} (gpurelay_gateway_batches_total), "
        f"received {received:.0f} bytes; duplicates {duplicates:.0f}, protocol errors "
        f"{errors:.0f}, replaced connections {replaced:.0f}, connects {connects}"
        + ("" if consistent else "  <-- MISMATCH")
    )
    if wrapped:
        print(f"note: {wrapped} batches in the window restarted the data timeline (a jump back)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--processes-per-gpu", type=int, default=4)
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between batches")
    parser.add_argument("--seconds", type=float, default=20.0, help="measurement window")
    parser.add_argument(
        "--idle-seconds", type=float, default=None, help="idle window (default: --seconds)"
    )
    parser.add_argument("--warmup", type=int, default=5, help="batches skipped after the first")
    parser.add_argument("--profile", default=None, help="py-spy raw output file (gateway)")
    parser.add_argument(
        "--spread", type=int, default=30, help="node k starts at collection k mod SPREAD"
    )
    args = parser.parse_args()
    if args.idle_seconds is None:
        args.idle_seconds = args.seconds
    if args.nodes < 1 or args.interval <= 0 or args.seconds <= 0 or args.spread < 1:
        parser.error("--nodes and --spread must be >= 1, --interval and --seconds > 0")
    print(
        f"gateway ingest over real SSH on loopback: python {sys.version.split()[0]} on "
        f"{os.uname().machine}, {os.cpu_count()} CPUs"
    )
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gateway-ingest-") as tmp:
        try:
            asyncio.run(run(args, Path(tmp)))
        except (BenchError, HarnessError, httpx.HTTPError) as exc:
            print(f"gateway_ingest: error: {exc}", file=sys.stderr)
            return 1
    print(f"total run time {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
