"""The fleet bench: the real ``cloud-gateway`` process under a fleet of real agent tunnels,
measured from outside, as a user measures it (``/proc`` of the gateway, the client's clock).

Setup: a throwaway fleet PKI (one certificate per node); the gateway runs as its own
process (``python -m cloud_gateway run``) on loopback; the agents are real
:class:`edge_agent.tunnel.Tunnel` s (asyncssh, node certificate, the agent's own reconnect
backoff) spread over worker processes (bench/ingest_agents.py, 250 per process by
default: the bench prints each worker's share of a core, which must stay well below one
for the figures to be the gateway's). Their data is the simulator's (8 GPUs with their
processes, ~500 series per node), 10 s apart, replayed by node k from collection k mod 30.

Phases, one run, one gateway:

1. connect every node (HELLO only); **idle**: connected, nothing sent, ``--idle-seconds``.
2. send every ``--interval`` (10 s), first batches spread over a ramp; after the warm-up,
   a ``--seconds`` window: **CPU per batch at 10 s** (whole process / batches applied),
   **RSS per held series** (process RSS / series the gateway holds, and above the idle RSS).
3. **GET /metrics under ingest**, one interval apart (every node sent new data in
   between): latency on the client's clock, p50/p95, identity and gzip.
4. stop sending; ``--gets`` times: one round of new data from every node, wait until the
   gateway applied it, GET at once: **GET right after new data**, latency and the gateway's
   CPU for it (``/proc``); then the same series PUT into a stock Debian
   ``prometheus-pushgateway`` (one group per node) and GET there: **the ratio**, same run.
5. the first ``--fast-nodes`` nodes send every second for ``--fast-seconds``: **CPU per
   batch at 1 s** (the other nodes stay connected; their idle cost is in it).
6. everyone sends at ``--interval`` again; ``kill -9`` of the gateway, restarted at once
   on the same ports: **the time until every node has connected again and had a batch
   acknowledged**, and the busiest second of connects as a share of the fleet.

Targets (issue 26) are printed beside each figure with the ratio measured / target.

Run: .venv/bin/python bench/fleet.py [--nodes 1000] [--interval 10] [--seconds 30]
     [--idle-seconds 30] [--gets 5] [--fast-nodes 100] [--fast-seconds 20] [--procs N]
     [--no-kill] [--logs DIR] [--profile DIR]  (py-spy of the gateway over the idle and
     the steady window and the restarted one's first 40 s: DIR/idle.txt, DIR/steady.txt,
     DIR/herd.txt, raw stacks)
     [--tracemalloc FILE]  (the gateway under tracemalloc: its biggest allocations by line
     written to FILE after phase 2; slows it ~2x, so its CPU figures are not comparable)
Needs for phase 4's comparison: apt-get install prometheus-pushgateway (else it says so).
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import http.client
import math
import os
import pickle
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gateway_ingest import (
    GatewayClient,
    make_snapshots,
    start_profiler,
    started,
    take,
    until,
)
from bench.ingest_fleet import Fleet, Worker, write_specs
from bench.ingest_report import BenchError, Window
from bench.ingest_steady import default_procs, pct, shares
from harness.fleet import make_pki
from harness.process import HarnessError
from harness.services import GatewayProc
from harness.waiting import wait_for

CONNECT_TIMEOUT = 120.0
FIRST_BATCHES_PER_SECOND = 20
TRACED = Path(__file__).with_name("traced_gateway.py")

TARGETS = {  # issue 26
    "rss_per_series": 400.0,  # bytes
    "idle_cpu": 1.0,  # % of a core, 1,000 nodes connected
    "cpu_per_batch": 150.0,  # us, at 10 s and at 1 s
    "pushgateway_ratio": 50.0,  # pushgateway GET / ours, right after new data
    "back_seconds": 15.0,  # every agent back after kill -9
    "busiest_share": 10.0,  # % of the fleet connecting in the busiest second
}


class Table:
    """The figures, printed at the end as one table with the targets."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str]] = []

    def add(self, what: str, shown: str, target: str = "", ratio: float | None = None) -> None:
        tail = target
        if ratio is not None:
            tail += f"  ({ratio:.2f}x the target: {'met' if ratio <= 1 else 'MISSED'})"
        self.rows.append((what, shown, tail))
        print(f"  {what:<52} {shown:<34} {tail}", flush=True)


def per_second(cpu_seconds: float, wall: float) -> float:
    return 100.0 * cpu_seconds / wall if wall > 0 else math.nan


# --- GET ---------------------------------------------------------------------------------------


def timed_get(port: int, path: str, gz: bool) -> tuple[float, bytes]:
    """One GET on a fresh connection (as a scraper does per scrape): ms on this clock, body
    (decompressed)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    headers = {"Accept-Encoding": "gzip" if gz else "identity"}
    start = time.perf_counter()
    conn.request("GET", path, headers=headers)
    resp = conn.getresponse()
    body = resp.read()
    ms = (time.perf_counter() - start) * 1000
    conn.close()
    if resp.status != 200:
        raise BenchError(f"GET {path} on port {port}: HTTP {resp.status}")
    if resp.getheader("Content-Encoding") == "gzip":
        body = gzip.decompress(body)
    return ms, body


async def aget(port: int, path: str, gz: bool) -> tuple[float, bytes]:
    return await asyncio.to_thread(timed_get, port, path, gz)


# every node series carries one of these (stamped by the gateway); a Pushgateway group of
# the node adds its grouping label Hostname to the NodeName-only (ACK-style) ones
NODE_LABEL = re.compile(rb'(?:Hostname|NodeName)="([^"]*)"')


def per_node_groups(body: bytes) -> dict[str, bytes]:
    """The node series of a gateway body, each node's lines (with their families' HELP and
    TYPE) as one text a Pushgateway group takes; the gateway's own families are left out."""
    groups: dict[str, list[bytes]] = {}
    header: list[bytes] = []
    headed: set[str] = set()
    for line in body.split(b"\n"):
        if not line:
            continue
        if line.startswith(b"# HELP "):
            header, headed = [line], set()
            continue
        if line.startswith(b"#"):
            header.append(line)
            continue
        m = NODE_LABEL.search(line)
        if m is None:
            continue
        node = m.group(1).decode()
        out = groups.setdefault(node, [])
        if node not in headed:
            out.extend(header)
            headed.add(node)
        out.append(line)
    return {node: b"\n".join(lines) + b"\n" for node, lines in groups.items()}


def samples_in(body: bytes) -> int:
    """Node samples in a body (not the Pushgateway's own push_time_seconds and
    push_failure_time_seconds of each group)."""
    return sum(
        1
        for line in body.split(b"\n")
        if line and not line.startswith((b"#", b"push_")) and NODE_LABEL.search(line)
    )


def start_pushgateway(tmp: Path) -> tuple[Any, int] | None:
    import subprocess

    from harness.ports import free_ports

    binary = shutil.which("prometheus-pushgateway") or shutil.which("pushgateway")
    if binary is None:
        return None
    (port,) = free_ports(1)
    log = (tmp / "pushgateway.log").open("ab")
    proc = subprocess.Popen(
        [binary, f"--web.listen-address=127.0.0.1:{port}", "--persistence.file=",
         "--push.disable-consistency-check", "--log.level=warn"],
        stdout=log, stderr=log,
    )  # fmt: skip
    return proc, port


def push_all(port: int, groups: dict[str, bytes]) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    deadline = time.monotonic() + 30
    while True:
        try:
            conn.request("GET", "/-/ready")
            resp = conn.getresponse()
            resp.read()
            if resp.status == 200:
                break
        except OSError:
            conn.close()
            if time.monotonic() > deadline:
                raise BenchError("the pushgateway did not become ready") from None
            time.sleep(0.1)
    start = time.perf_counter()
    for node, text in groups.items():
        conn.request(
            "PUT", f"/metrics/job/gpurelay/Hostname/{node}", body=text,
            headers={"Content-Type": "text/plain; version=0.0.4"},
        )  # fmt: skip
        resp = conn.getresponse()
        answer = resp.read()
        if resp.status not in (200, 202):
            raise BenchError(f"pushgateway PUT for {node}: HTTP {resp.status}: {answer[:300]!r}")
    conn.close()
    return time.perf_counter() - start


# --- the run -----------------------------------------------------------------------------------


async def run(args: argparse.Namespace, tmp: Path) -> Table:
    timeline = make_snapshots(args.gpus, args.processes_per_gpu, args.spread + 40)
    path = tmp / "timeline.pickle"
    path.write_bytes(pickle.dumps(timeline))
    pki = make_pki(tmp)
    quiet = CONNECT_TIMEOUT + args.idle_seconds + args.ramp + 120
    offline = float(max(6, math.ceil(quiet / args.interval)))
    gw = GatewayProc(pki, tmp, log_level="info", registry={"offline_after_intervals": offline})
    if args.tracemalloc:
        gw.argv[1:2] = [str(TRACED), args.tracemalloc]  # python TRACED FILE -m... see there
    specs = write_specs(args, tmp, pki, gw.ssh_port, path, CONNECT_TIMEOUT / 4, agent_backoff=True)
    workers = [Worker(p, spec, tmp / f"worker-{p}.log") for p, spec in enumerate(specs)]
    fleet = Fleet(workers)
    sizes = "/".join(str(len(r)) for r in shares(args.nodes, args.procs))
    print(
        f"setup: {args.nodes} nodes x {args.gpus} simulated GPUs ({args.processes_per_gpu} "
        f"processes per GPU, {len(timeline[0].samples)} series per node) in {len(workers)} "
        f"agent worker process(es) of {sizes} nodes (the agent's own reconnect backoff); "
        f"gateway in its own process, SSH "
        f"127.0.0.1:{gw.ssh_port}, HTTP 127.0.0.1:{gw.http_port}",
        flush=True,
    )
    client = GatewayClient(gw.url)
    table = Table()
    async with started(gw, workers, client, args.nodes, args.logs):
        base = gw.sample()
        table.add("gateway RSS, started, no node", f"{base.rss_kib / 1024:.1f} MiB")
        await phases(args, gw, client, fleet, table, tmp, base.rss_kib)
    return table


def per_batch(table: Table, what: str, w0: Window, w1: Window) -> tuple[float, int, float]:
    """The gateway's CPU per batch applied between two marks, added to the table as
    ``what``; (CPU seconds, batches, wall seconds)."""
    batches = w1.gateway_batches - w0.gateway_batches
    cpu = w1.cpu.cpu_seconds - w0.cpu.cpu_seconds
    wall = w1.wall - w0.wall
    each = cpu / max(batches, 1) * 1e6
    table.add(
        f"{what}, {batches / wall:.0f} batches/s",
        f"{each:.0f} us ({per_second(cpu, wall):.1f} % of a core)",
        f"<= {TARGETS['cpu_per_batch']:g} us", each / TARGETS["cpu_per_batch"],
    )  # fmt: skip
    return cpu, batches, wall


def worker_load(w0: Window, w1: Window) -> str:
    wall = w1.wall - w0.wall
    shares_ = [(b - a) / wall for a, b in zip(w0.workers_cpu, w1.workers_cpu, strict=True)]
    return f"busiest agent worker {max(shares_):.0%} of a core"


async def profile(args: argparse.Namespace, gw: GatewayProc, phase: str, seconds: float) -> Any:
    """py-spy sampling the gateway over a window (``--profile DIR``: DIR/PHASE.txt, raw
    stacks), or None."""
    if not args.profile:
        return None
    Path(args.profile).mkdir(parents=True, exist_ok=True)
    return await start_profiler(str(Path(args.profile) / f"{phase}.txt"), gw.pid, seconds)


async def phases(
    args: argparse.Namespace,
    gw: GatewayProc,
    client: GatewayClient,
    fleet: Fleet,
    table: Table,
    tmp: Path,
    base_rss_kib: int,
) -> None:
    n = args.nodes
    # 1. connect, idle
    t0 = time.monotonic()
    await fleet.call("connect")
    await until(fleet, gw, lambda s: s["connected"] == n, CONNECT_TIMEOUT, f"all {n} to connect")
    print(f"connect: {n} nodes in {time.monotonic() - t0:.1f} s", flush=True)
    await asyncio.sleep(3.0)  # handshakes' logging over
    spy = await profile(args, gw, "idle", args.idle_seconds)
    i0 = await take(gw, client, fleet, "i0")
    await asyncio.sleep(args.idle_seconds)
    i1 = await take(gw, client, fleet, "i1")
    if spy is not None:
        await spy.wait()
    idle = per_second(i1.cpu.cpu_seconds - i0.cpu.cpu_seconds, i1.wall - i0.wall)
    table.add(
        f"gateway CPU, {n} nodes connected, idle", f"{idle:.2f} % of a core",
        f"<= {TARGETS['idle_cpu']:g} % at 1,000 nodes", idle / TARGETS["idle_cpu"] * 1000 / n,
    )  # fmt: skip
    table.add(
        "gateway RSS, idle, per connected node",
        f"{(i1.cpu.rss_kib - base_rss_kib) * 1024 / n / 1024:.1f} KiB "
        f"({i1.cpu.rss_kib / 1024:.1f} MiB)",
    )

    # 2. steady sending at --interval
    ramp = max(1, math.ceil(args.ramp / args.interval))
    await fleet.call("send", first_at=time.monotonic() + 0.2, total=n, ramp=ramp)

    async def every_first_batch(status: dict[str, Any]) -> bool:
        if status["min_sent"] < 1:
            return False
        nodes = await client.nodes()
        return len(nodes) == n and all(int(x["batches_received"]) >= 1 for x in nodes)

    await until(
        fleet, gw, every_first_batch, (ramp + 2) * args.interval + 90,
        f"the gateway to apply {n} first batches", nodes=n,
    )  # fmt: skip
    await until(
        fleet, gw, lambda s: s["min_sent"] >= 2 + args.warmup,
        (args.warmup + 3 + ramp) * args.interval + 60, "the warm-up", nodes=n,
    )  # fmt: skip
    spy = await profile(args, gw, "steady", args.seconds)
    w0 = await take(gw, client, fleet, "w0")
    await asyncio.sleep(args.seconds)
    w1 = await take(gw, client, fleet, "w1")
    if spy is not None:
        await spy.wait()
    per_batch(table, f"gateway CPU per batch at {args.interval:g} s", w0, w1)
    print(f"    ({worker_load(w0, w1)})")
    held = sum(int(x["series"]) for x in await client.nodes())
    rss = gw.sample().rss_kib * 1024
    table.add(
        f"gateway RSS per held series ({held} series)",
        f"{rss / held:.0f} B ({rss / 2**20:.1f} MiB)",
        f"<= {TARGETS['rss_per_series']:g} B", rss / held / TARGETS["rss_per_series"],
    )  # fmt: skip
    table.add(
        "    above the idle, connected gateway",
        f"{(rss - i1.cpu.rss_kib * 1024) / held:.0f} B",
    )
    if args.tracemalloc:
        os.kill(gw.pid, signal.SIGUSR2)
        await asyncio.sleep(15)
        print(f"tracemalloc snapshot of the gateway: {args.tracemalloc}")

    if args.gets > 0:  # 3. and 4.
        await gets_under_ingest(args, gw, table)
        await fleet.call("stop_sending")
        await until(
            fleet, gw, lambda s: s["unacked"] == 0, 30, "the last acknowledgements", nodes=n
        )
        await gets_after_new_data(args, gw, client, fleet, table, tmp)
    else:
        await fleet.call("stop_sending")

    # 5. 1 s interval from the first --fast-nodes nodes
    fast = min(args.fast_nodes, n)
    if fast and args.fast_seconds > 0:
        await fleet.call("send", first_at=time.monotonic() + 0.2, total=n, ramp=1,
                         interval=1.0, below=fast)  # fmt: skip
        await asyncio.sleep(5.0)
        f0 = await take(gw, client, fleet, "f0")
        await asyncio.sleep(args.fast_seconds)
        f1 = await take(gw, client, fleet, "f1")
        await fleet.call("stop_sending")
        what = f"gateway CPU per batch at 1 s ({fast} nodes sending)"
        cpu, batches, wall = per_batch(table, what, f0, f1)
        idle_share = idle * (n - fast) / n
        table.add(
            "    less the idle nodes' share (idle rate x their share)",
            f"{(cpu - idle_share / 100 * wall) / max(batches, 1) * 1e6:.0f} us",
        )
        print(f"    ({worker_load(f0, f1)})")
        await until(fleet, gw, lambda s: s["unacked"] == 0, 30, "the acknowledgements", nodes=n)

    # 6. kill -9 with the fleet sending, restart at once
    if args.kill:
        await fleet.call("send", first_at=time.monotonic() + 0.2, total=n, ramp=1)
        await asyncio.sleep(2 * args.interval)
        killed = time.monotonic()
        gw.kill9()
        gw.start()
        spy = await profile(args, gw, "herd", 40.0)  # the restarted gateway taking them back
        await wait_for(client.ready, 30, "the restarted gateway", poll=0.05, alive=(gw,))
        last: dict[str, Any] = {}

        async def all_back() -> bool:
            replies = await fleet.call("connects_since", t=killed)
            last["connected_at"] = [c for r in replies for c in r["connected_at"]]
            last["acked"] = sum(r["acked_after"] for r in replies)
            return bool(last["acked"] == n)

        try:
            await wait_for(all_back, args.back_timeout, "every node back", poll=0.1, alive=(gw,))
        except HarnessError:
            raise BenchError(
                f"after {args.back_timeout:g} s only {last.get('acked')} of {n} nodes were back"
            ) from None
        back = time.monotonic() - killed
        if spy is not None:
            await spy.wait()
        per_sec = Counter(int(c - killed) for c in last["connected_at"])
        busiest_s, busiest = per_sec.most_common(1)[0]
        table.add(
            f"every node back after kill -9 ({len(last['connected_at'])} connects)",
            f"{back:.1f} s", f"<= {TARGETS['back_seconds']:g} s", back / TARGETS["back_seconds"],
        )  # fmt: skip
        failures = (await fleet.status())["failures"]
        print(f"    failed attempts by reason, whole run: {failures or 'none'}", flush=True)
        share = 100.0 * busiest / n
        table.add(
            "    busiest second of connects",
            f"{busiest} ({share:.0f} % of the fleet, second {busiest_s})",
            f"<= {TARGETS['busiest_share']:g} %", share / TARGETS["busiest_share"],
        )  # fmt: skip
        await fleet.call("stop_sending")


async def gets_under_ingest(args: argparse.Namespace, gw: GatewayProc, table: Table) -> None:
    """3. GET /metrics while the fleet sends, one interval apart (every node sent new
    data in between)."""
    for gz in (False, True):
        times, cpus = [], []
        for _ in range(args.gets):
            await asyncio.sleep(args.interval)
            c0 = gw.sample().cpu_seconds
            ms, body = await aget(gw.http_port, "/metrics", gz)
            cpus.append((gw.sample().cpu_seconds - c0) * 1000)
            times.append(ms)
        table.add(
            f"GET /metrics under ingest, {'gzip' if gz else 'identity'} ({len(body) / 1e6:.0f} MB)",
            f"p50 {statistics.median(times):.0f} ms, p95 {pct(times, 0.95):.0f} ms",
            f"gateway CPU over the GET p50 {statistics.median(cpus):.0f} ms",
        )


async def gets_after_new_data(
    args: argparse.Namespace,
    gw: GatewayProc,
    client: GatewayClient,
    fleet: Fleet,
    table: Table,
    tmp: Path,
) -> None:
    """4. With the fleet quiet: one round of new data from every node, applied, then a GET
    at once; the same series in a Pushgateway, GET there."""
    n = args.nodes
    ours: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    body = b""
    for _ in range(args.gets):
        for gz in (False, True):
            before = await client.batches()
            await fleet.call("round")
            await wait_for(
                _applied(client, before + n), 60, "a round of new data to be applied",
                poll=0.05, alive=(gw,),
            )  # fmt: skip
            c0 = gw.sample().cpu_seconds
            ms, got = await aget(gw.http_port, "/metrics", gz)
            ours[gz].append((ms, (gw.sample().cpu_seconds - c0) * 1000))
            body = got if not gz else body
    node_samples = samples_in(body)
    pgw = start_pushgateway(tmp)
    theirs: dict[bool, list[float]] = {False: [], True: []}
    if pgw is not None:
        proc, port = pgw
        try:
            groups = per_node_groups(body)
            took = await asyncio.to_thread(push_all, port, groups)
            print(f"pushgateway: {len(groups)} groups PUT in {took:.1f} s", flush=True)
            for gz in (False, True):
                for _ in range(args.gets):
                    ms, pbody = await aget(port, "/metrics", gz)
                    theirs[gz].append(ms)
            if samples_in(pbody) != node_samples:
                raise BenchError(
                    f"the pushgateway serves {samples_in(pbody)} node samples, ours {node_samples}"
                )
        finally:
            proc.terminate()
            proc.wait(10)
    for gz in (False, True):
        ms = statistics.median(t for t, _ in ours[gz])
        cpu_ms = statistics.median(c for _, c in ours[gz])
        kind = "gzip" if gz else "identity"
        table.add(
            f"GET right after new data, {kind} ({node_samples} node samples)",
            f"p50 {ms:.0f} ms, p95 {pct([t for t, _ in ours[gz]], 0.95):.0f} ms; "
            f"CPU {cpu_ms:.0f} ms",
        )
        if theirs[gz]:
            them = statistics.median(theirs[gz])
            table.add(
                f"    Pushgateway, same series, same run, {kind}",
                f"p50 {them:.0f} ms: ours {them / ms:.1f}x faster",
                f">= {TARGETS['pushgateway_ratio']:g}x",
                TARGETS["pushgateway_ratio"] / (them / ms),
            )
        else:
            table.add(f"    Pushgateway, {kind}", "not installed (apt-get install "
                      "prometheus-pushgateway)")  # fmt: skip


def _applied(client: GatewayClient, count: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return await client.batches() >= count

    return check


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--procs", type=int, default=None)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--processes-per-gpu", type=int, default=4)
    parser.add_argument("--interval", type=float, default=10.0)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--idle-seconds", type=float, default=30.0)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--gets", type=int, default=5)
    parser.add_argument("--fast-nodes", type=int, default=100)
    parser.add_argument("--fast-seconds", type=float, default=20.0)
    parser.add_argument("--spread", type=int, default=30)
    parser.add_argument("--ramp", type=float, default=None)
    parser.add_argument("--no-kill", dest="kill", action="store_false")
    parser.add_argument("--back-timeout", type=float, default=120.0)
    parser.add_argument("--logs", default=None)
    parser.add_argument("--profile", default=None, help="py-spy the idle and steady windows")
    parser.add_argument("--tracemalloc", default=None, help="write the gateway's top allocations")
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args()
    args.procs = args.procs or default_procs(args.nodes)
    if args.ramp is None:
        args.ramp = args.nodes / FIRST_BATCHES_PER_SECOND
    print(
        f"fleet bench: real cloud-gateway process, python {sys.version.split()[0]} on "
        f"{os.uname().machine}, {os.cpu_count()} cores (agents and gateway share them)",
        flush=True,
    )
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fleet-bench-") as tmp:
        try:
            asyncio.run(asyncio.wait_for(run(args, Path(tmp)), args.timeout))
        except (BenchError, HarnessError, httpx.HTTPError, TimeoutError) as exc:
            print(f"fleet: error: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
    print(f"total run time {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
