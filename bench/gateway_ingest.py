"""Gateway ingest over real SSH: gateway CPU per batch and bytes per batch, many agents.

Setup: a throwaway fleet PKI (one certificate per node); the gateway runs as its own
process (``python -m cloud_gateway run --config FILE``) on loopback, so its CPU time can be
read from ``/proc/<pid>/stat``. The agents are spread over ``--procs`` worker processes
(bench/ingest_agents.py; default one up to 200 nodes, else one per 250 nodes): each runs
its share of real :class:`edge_agent.tunnel.Tunnel` s (asyncssh, node certificate, one
telemetry channel) on its own event loop and reports its per-node figures to this process
as JSON over a pipe. One process of 1,000 agents cannot keep a 1 s schedule on a small
machine, and a run whose agents fall behind measures the gateway at a lower rate than the
one it states. The data is precomputed once with the simulator (8 GPUs with their
processes attributed through a fake host tree, the collector's real timer, one collection
every 10 s of simulated time); node k replays that timeline from snapshot k mod
``--spread``, one batch every ``--interval`` seconds, the fleet's batches spread evenly
over the interval, so the gateway sees realistic 10-second-apart data from every node.

Phases: connect all nodes (HELLO only); idle window (connected, nothing sent); start
sending, the nodes' first batches (DECLARE + full) spread over ``--ramp`` seconds
(default nodes / 20: 1,000 of them in one second stall the gateway past the agents'
silence timeout), and skip each node's first ``--warmup`` batches after its first one;
measurement window; stop sending, let the acks drain, cross-check the counts; say
whether the run was a valid steady state (the gateway applied what the agents offered in
the window, within 3 %; no session re-established; no agents' process saturated, none
running late; the machine not saturated) -- "VALID" or "NOT A STEADY STATE: why".

The gateway closes a connection on which nothing arrived for ``offline_after_intervals``
x interval + 2 s (8 s at 1 s). Connected, not sending is what the idle window is, and the
connect phase itself lasts seconds at 1,000 nodes; so the bench's gateway gets
``[registry] offline_after_intervals`` long enough for connect + idle + start (printed;
the sweep costs the same whatever the threshold). With the default, the nodes whose first
batch came last were closed and reconnected (112-135 connects for 100 nodes).

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
The agents' CPU per batch (every worker process, same window), the ratio of the
gateway's CPU to theirs, and the gateway's CPU for a node's first batch (DECLARE + full,
from the ramp) are printed beside them. Exit status 0: VALID; 2: measured, but not a
steady state; 1: no measurement (the reason on stderr).

Run: .venv/bin/python bench/gateway_ingest.py [--nodes 100] [--procs N] [--gpus 8]
     [--interval 1] [--seconds 20] [--idle-seconds SECONDS] [--warmup 5] [--spread 30]
     [--ramp SECONDS]     (spread the first batches; default nodes / 20)
     [--timeout SECONDS]  (abort the whole run after this long; default from the phases)
     [--logs DIR]         (keep the gateway's and the workers' logs there)
     [--profile FILE]     (py-spy record of the gateway over the measurement window,
                           raw/collapsed stacks; needs py-spy on PATH or in the venv)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import math
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from bench.ingest_agents import DATA_STEP
from bench.ingest_fleet import Fleet, Worker, write_specs
from bench.ingest_report import BenchError, Window, metric, report
from bench.ingest_steady import default_procs, machine_jiffies, pct, shares, spread_line
from gpurelay.model import Snapshot
from harness.fleet import TOKEN, make_pki
from harness.pipeline import simulated_snapshots
from harness.process import HarnessError
from harness.services import GatewayProc
from harness.waiting import wait_for

__all__ = ["BenchError", "pct", "spread_line"]

SEED = 7
CONNECT_TIMEOUT = 90.0
SETTLE_SECONDS = 1.5  # after the last connect: handshakes and their logging are over
DRAIN_TIMEOUT = 10.0
# A node's first batch (DECLARE of every series + a full batch) costs the gateway ~17 ms,
# ~18x a steady one (printed): 1,000 of them within one interval stall its loop for longer
# than the agents' silence timeout, and the sessions it has not answered are dropped.
FIRST_BATCHES_PER_SECOND = 20


# --- data ------------------------------------------------------------------------------------


def make_snapshots(gpus: int, processes_per_gpu: int, count: int) -> list[Snapshot]:
    """``count`` collections of one simulated node, DATA_STEP seconds of data apart."""
    return simulated_snapshots(
        gpus=gpus, processes_per_gpu=processes_per_gpu, count=count, step=DATA_STEP, seed=SEED
    )


# --- the gateway ------------------------------------------------------------------------------


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


# --- figures ---------------------------------------------------------------------------------


async def take(gw: GatewayProc, client: GatewayClient, fleet: Fleet, label: str) -> Window:
    batches = await client.batches()
    cpu = gw.sample()  # right after the count: the window holds one API read, no more
    workers = [s.cpu_seconds for s in fleet.samples()]
    machine = machine_jiffies()
    marks = await fleet.call("mark", label=label)
    return Window(
        wall=time.monotonic(),
        cpu=cpu,
        gateway_batches=batches,
        workers_cpu=workers,
        machine=machine,
        bytes_sent=[b for m in marks for b in m["bytes_sent"]],
        batches_sent=[b for m in marks for b in m["batches_sent"]],
        wrapped=sum(m["wrapped"] for m in marks),
    )


# --- the run ---------------------------------------------------------------------------------


def offline_intervals(args: argparse.Namespace) -> float:
    """``[registry] offline_after_intervals`` of the bench's gateway: long enough that a
    node stays connected through the connect phase, the idle window and the ramp to its
    first batch (6, the default, closes the early nodes of a large fleet while the rest are
    still connecting, and the late-phase nodes before their first batch)."""
    quiet = CONNECT_TIMEOUT + args.idle_seconds + args.ramp + 2 * args.interval + 30
    return float(max(6, math.ceil(quiet / args.interval)))


def ramp_intervals(args: argparse.Namespace) -> int:
    """Intervals over which the nodes' first batches are spread (``--ramp`` seconds)."""
    ramp: float = args.ramp
    interval: float = args.interval
    return max(1, math.ceil(ramp / interval))


def default_timeout(args: argparse.Namespace) -> float:
    """Seconds after which the whole run aborts: every phase at its own limit, and more."""
    phases = CONNECT_TIMEOUT + 10 + SETTLE_SECONDS + args.idle_seconds
    phases += (args.warmup + 2 + ramp_intervals(args)) * args.interval + 60
    phases += args.seconds + DRAIN_TIMEOUT + 10
    return float(120 + 0.1 * args.nodes + phases)  # setup: certificates, data, processes


async def run(args: argparse.Namespace, tmp: Path) -> bool:
    t_setup = time.monotonic()
    per_node = args.warmup + 3 + math.ceil(args.seconds / args.interval) + 5
    timeline = make_snapshots(args.gpus, args.processes_per_gpu, args.spread + per_node)
    timeline_path = tmp / "timeline.pickle"
    timeline_path.write_bytes(pickle.dumps(timeline))
    series = len(timeline[0].samples)
    pki = make_pki(tmp)
    offline = offline_intervals(args)
    gw = GatewayProc(pki, tmp, log_level="info", registry={"offline_after_intervals": offline})
    specs = write_specs(args, tmp, pki, gw.ssh_port, timeline_path, CONNECT_TIMEOUT / 2)
    workers = [Worker(p, spec, tmp / f"worker-{p}.log") for p, spec in enumerate(specs)]
    fleet = Fleet(workers)
    setup_seconds = time.monotonic() - t_setup

    print(
        f"setup: {args.nodes} nodes x {args.gpus} simulated GPUs ({args.processes_per_gpu} "
        f"processes per GPU, {series} series per node), one batch per node every "
        f"{args.interval:g} s carrying data {DATA_STEP:g} s apart; node k replays a "
        f"{len(timeline)}-collection timeline from collection k mod {args.spread}"
    )
    print(
        f"       agents in {len(workers)} worker process(es) of "
        f"{'/'.join(str(len(r)) for r in shares(args.nodes, args.procs))} nodes; gateway in "
        f"its own process, SSH 127.0.0.1:{gw.ssh_port}, HTTP 127.0.0.1:{gw.http_port}, "
        f"[registry] offline_after_intervals = {offline:g} (connected and idle is silent)"
    )
    print(
        f"       first batches (DECLARE + full) spread over {ramp_intervals(args)} interval(s) "
        f"(--ramp); measurement window {args.seconds:g} s after {args.warmup} warm-up batches "
        f"per node; idle window {args.idle_seconds:g} s; PKI, certificates and data prepared in "
        f"{setup_seconds:.1f} s; the run aborts after {args.timeout:.0f} s"
    )

    client = GatewayClient(gw.url)
    async with started(gw, workers, client, args.nodes, args.logs):
        return await measure(args, gw, client, fleet)


@contextlib.asynccontextmanager
async def started(
    gw: GatewayProc,
    workers: Sequence[Worker],
    client: GatewayClient,
    nodes: int,
    logs: str | None,
) -> AsyncIterator[None]:
    """The gateway and the agents' workers started, the workers ready with ``nodes`` nodes
    in all. On the way out, whatever happened, every process is stopped (the ends of their
    logs printed on an error) and the logs are copied to ``logs`` when given."""
    try:
        gw.start()
        for worker in workers:
            worker.start()
        await wait_for(client.ready, 30, "the gateway to be ready", poll=0.1, alive=(gw,))
        ready = await asyncio.gather(*(w.attach() for w in workers))
        if sum(ready) != nodes:
            raise BenchError(f"the workers hold {sum(ready)} nodes, not {nodes}")
        yield
    except BaseException:
        print(gw.tail(20), file=sys.stderr)
        for worker in workers:
            print(worker.tail(10), file=sys.stderr)
        raise
    finally:
        for worker in workers:
            worker.hang_up()
        for worker in workers:
            worker.finish()
        await client.close()
        status = gw.stop()
        if status not in (0, None, -signal.SIGTERM):
            print(f"gateway exited with status {status}", file=sys.stderr)
        if logs:
            keep = Path(logs)
            keep.mkdir(parents=True, exist_ok=True)
            for log in [gw.log, *(w.log for w in workers)]:
                if log.exists():
                    shutil.copy(log, keep / log.name)
            print(f"logs kept in {keep}", file=sys.stderr)


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


async def until(
    fleet: Fleet,
    gw: GatewayProc,
    done: Callable[[dict[str, Any]], Awaitable[bool] | bool],
    timeout: float,
    what: str,
    *,
    nodes: int = 0,
) -> None:
    """Poll the workers' status until ``done(status)``; abort with the last status, and
    at once when a session was re-established (more connects than ``nodes``, once all are
    connected): the run can no longer be a steady state, and a fleet that reconnects
    while it sends its first batches may never settle."""
    last: dict[str, Any] = {}
    since = (time.monotonic(), gw.sample().cpu_seconds, machine_jiffies())

    async def check() -> bool:
        last.update(await fleet.status())
        if nodes and last["connects"] > nodes:
            wall = time.monotonic() - since[0]
            busy, total = (a - b for a, b in zip(machine_jiffies(), since[2], strict=True))
            raise BenchError(
                f"NOT A STEADY STATE: {last['connects'] - nodes} session(s) re-established "
                f"while waiting for {what} ({last['connected']} of {nodes} connected now; "
                f"failures by reason {last['failures']}; 'silent': the gateway sent nothing "
                "for the agents' silence timeout, it did not keep up; over the last "
                f"{wall:.0f} s the gateway used {(gw.sample().cpu_seconds - since[1]) / wall:.0%}"
                f" of a core, the machine was {busy / max(total, 1):.0%} busy). Fewer nodes, "
                "more --ramp, a quieter or bigger machine; --logs DIR keeps the logs"
            )
        result = done(last)
        return bool(await result if inspect.isawaitable(result) else result)

    try:
        await wait_for(check, timeout, what, poll=0.2, alive=(gw, *fleet.workers))
    except HarnessError as exc:
        raise BenchError(f"{exc} (last: {last})") from None


async def measure(
    args: argparse.Namespace, gw: GatewayProc, client: GatewayClient, fleet: Fleet
) -> bool:
    n = args.nodes

    # 1. connect every node: HELLO only, no data yet
    t0 = time.monotonic()
    await fleet.call("connect")
    await until(fleet, gw, lambda s: s["connected"] == n, CONNECT_TIMEOUT, f"all {n} to connect")
    connect_seconds = time.monotonic() - t0

    async def every_channel() -> bool:  # the gauge is refreshed by the gateway's 1 s tick
        return bool(metric(await client.metrics(), "gpurelay_gateway_channels") == n)

    await wait_for(every_channel, 10, f"the gateway to count {n} channels", poll=0.25, alive=(gw,))
    await asyncio.sleep(SETTLE_SECONDS)
    connects = (await fleet.status())["connects"]
    print(f"connect: {n} nodes connected in {connect_seconds:.1f} s ({connects} connects)")

    # 2. idle window: connected, nothing sent (the 1 s tick, heartbeats, keepalives, one
    # API read)
    idle0 = await take(gw, client, fleet, "i0")
    await asyncio.sleep(args.idle_seconds)
    idle1 = await take(gw, client, fleet, "i1")
    if idle1.gateway_batches != idle0.gateway_batches:
        raise BenchError("batches arrived during the idle window")

    # 3. send (node i's first batch at first_at + interval * first_send(i, n, ramp): the
    # same clock in every process); skip each node's first batch (DECLARE + full) and the
    # warm-up batches
    ramp = ramp_intervals(args)
    r0 = await take(gw, client, fleet, "r0")
    await fleet.call("send", first_at=time.monotonic() + 0.2, total=n, ramp=ramp)

    async def every_first_batch(status: dict[str, Any]) -> bool:  # applied by the gateway
        if status["min_sent"] < 1:
            return False
        nodes = await client.nodes()
        return len(nodes) == n and all(int(x["batches_received"]) >= 1 for x in nodes)

    await until(
        fleet, gw, every_first_batch, (ramp + 2) * args.interval + 60,
        f"the gateway to apply {n} first batches", nodes=n,
    )  # fmt: skip
    r1 = await take(gw, client, fleet, "r1")
    await until(
        fleet, gw, lambda s: s["min_sent"] >= 1 + args.warmup,
        (args.warmup + 2 + ramp) * args.interval + 60,
        f"every node to send {1 + args.warmup} batches", nodes=n,
    )  # fmt: skip

    # 4. measurement window
    profiler = await start_profiler(args.profile, gw.pid, args.seconds) if args.profile else None
    w0 = await take(gw, client, fleet, "w0")
    await asyncio.sleep(args.seconds)
    w1 = await take(gw, client, fleet, "w1")
    if profiler is not None:
        await profiler.wait()

    # 5. stop sending, let the acks drain, cross-check the gateway's own counters
    await fleet.call("stop_sending")
    await until(
        fleet, gw, lambda s: s["unacked"] == 0, DRAIN_TIMEOUT, "the last acknowledgements", nodes=n
    )
    await asyncio.sleep(1.2)  # one gateway tick: its own counters catch up
    text = await client.metrics()
    api_batches = await client.batches()
    finals = await fleet.call("final")
    return report(args, finals, (idle0, idle1), (r0, r1), (w0, w1), text, api_batches)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument(
        "--procs", type=int, default=None,
        help="agents' worker processes (default: 1 up to 200 nodes, else one per 250)",
    )  # fmt: skip
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
    parser.add_argument(
        "--ramp", type=float, default=None,
        help=f"seconds over which the first batches are spread (default: nodes / "
        f"{FIRST_BATCHES_PER_SECOND})",
    )  # fmt: skip
    parser.add_argument("--timeout", type=float, default=None, help="abort the run after this")
    parser.add_argument("--logs", default=None, help="keep the gateway's and workers' logs here")
    parser.add_argument(
        "--ack-delay", type=float, default=None,
        help="the agents' [gateway] ack_delay_seconds (default: the agent's; 0: an ACK per batch)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.idle_seconds is None:
        args.idle_seconds = args.seconds
    if args.procs is None:
        args.procs = default_procs(args.nodes)
    if args.ramp is None:
        args.ramp = args.nodes / FIRST_BATCHES_PER_SECOND
    if args.timeout is None:
        args.timeout = default_timeout(args)
    if args.nodes < 1 or args.interval <= 0 or args.seconds <= 0 or args.spread < 1:
        parser.error("--nodes and --spread must be >= 1, --interval and --seconds > 0")
    if args.procs < 1:
        parser.error("--procs must be >= 1")
    print(
        f"gateway ingest over real SSH on loopback: python {sys.version.split()[0]} on "
        f"{os.uname().machine}, {os.cpu_count()} cores"
    )
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gateway-ingest-") as tmp:
        try:
            valid = asyncio.run(bounded(args, Path(tmp)))
        except (BenchError, HarnessError, httpx.HTTPError) as exc:
            print(f"gateway_ingest: error: {exc}", file=sys.stderr)
            if not args.logs:
                print("(the logs above go with the run's temporary directory: --logs DIR)")
            return 1
        except (asyncio.CancelledError, KeyboardInterrupt):
            print(
                "gateway_ingest: stopped by a signal; every process it started was stopped",
                file=sys.stderr,
            )
            return 130
        except TimeoutError:
            print(
                f"gateway_ingest: aborted: the run took more than {args.timeout:.0f} s "
                "(--timeout); every process it started was stopped",
                file=sys.stderr,
            )
            return 1
    print(f"total run time {time.monotonic() - started:.0f} s")
    return 0 if valid else 2


async def bounded(args: argparse.Namespace, tmp: Path) -> bool:
    """The run, aborted after ``--timeout`` seconds or on SIGTERM (its ``finally`` stops
    every process it started either way)."""
    this = asyncio.current_task()
    assert this is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, this.cancel)
    return await asyncio.wait_for(run(args, tmp), float(args.timeout))


if __name__ == "__main__":
    sys.exit(main())
