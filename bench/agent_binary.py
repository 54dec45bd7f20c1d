"""The running agent binary's own cost: CPU per cycle and RSS over time, tunnel and spool on.

Setup: a real gateway (``python -m cloud_gateway run``) and a real agent (``python -m
edge_agent run``) on loopback, 8 simulated GPUs with 8 processes each, collecting every
second, spool on, pushing through the SSH tunnel; the process-attribution interval is the
default (10 s) unless ``--process-interval`` says otherwise. After a warm-up, the agent's
CPU time (utime + stime of /proc/PID/stat, all threads) and RSS (VmRSS) are sampled every
second. Printed: CPU ms per cycle, RSS at start and end and its slope per hour (least
squares over every sample), the core count, and, measured in this same run and process
tree, the device cycle alone (in this bench process, with and without the simulator's own
Python cost) as the reference the whole binary is compared against.

The simulator computes every NVML answer in Python inside the agent; the row "minus the
simulator's own cost" subtracts its cost measured in this process, which predicts a real box
better but undercounts it: in the binary the GPM sample windows are a little over 1 s, so
the simulator integrates two points per window instead of one, and its per-second caches
miss more. With ``--profile`` the row "minus the simulator, sampled" subtracts instead the
share of py-spy ``--gil`` samples (Python CPU time, all threads) whose stack passes through
the simulator, taken in the same run right after the measured span.

Measured from outside as well: after the first binary, the same gateway gets a second one,
``bench/replayed_agent.py``, the same agent with each NVML answer replayed from a cache
filled by the first call (the simulator computes each answer once): its CPU is the agent's
own plus a dict lookup per NVML call. Its values stop changing, so its batches are smaller
than a real box's; the real box adds a driver call per NVML call, and the bench prints how
many calls one device cycle makes and what they would cost at 2.5-12 us each (the range
measured on data-centre GPUs). "By thread" splits each binary's CPU between the event loop,
the NVML worker and the attribution thread (10 ms clock ticks: about 1 ms per cycle of
resolution over 10 s). The kernel's share (stime) is printed apart.

Targets (issues 15 and 26): <= 3 ms CPU per 1 s cycle, RSS <= 60 MB and flat.

Run: .venv/bin/python bench/agent_binary.py [--seconds 120] [--warmup 15] [--profile 40]
     [--profile-out FILE] [--no-replay]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import suppress
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.agent_cycle import GPUS, PROCS_PER_GPU, ReplayNvml, _cpu_ms
from edge_agent.backend import Backend
from edge_agent.config import load
from edge_agent.pipeline import build_pipeline
from edge_agent.sim import host as simhost
from edge_agent.sim.nvml import SimulatedNvml
from gpurelay.model import SampleSink
from harness.fleet import make_pki
from harness.ports import free_ports
from harness.process import HarnessError, Process, clean_env
from harness.services import GatewayProc
from harness.waiting import wait_until


def device_cycle(cycles: int) -> tuple[float, float, collections.Counter[str]]:
    """Median CPU ms of one device cycle in this process, with the simulator and agent
    alone, and the NVML calls of one steady cycle by function."""
    clock_now = [1_790_000_000.0]
    with tempfile.TemporaryDirectory() as tmp:
        pids = simhost.default_pids(GPUS * PROCS_PER_GPU)
        host = simhost.build(Path(tmp), pids)
        base = load(None, {})
        cfg = dataclasses.replace(
            base, node_name="bench", attribution=simhost.attribution_config(host, base.attribution)
        )

        def sim() -> SimulatedNvml:
            s = SimulatedNvml(
                GPUS, clock=lambda: clock_now[0], pids=pids, processes_per_gpu=PROCS_PER_GPU
            )
            s.nvmlInit()
            return s

        full = build_pipeline(Backend(sim(), "simulated", cfg), clock=lambda: clock_now[0])
        dev = full.collection._device
        dev.collect(SampleSink())

        def advance() -> None:
            clock_now[0] += 1.0

        with_sim = _cpu_ms(lambda: dev.collect(SampleSink()), cycles, advance)
        full.close()
        nvml = ReplayNvml(sim())
        replay = build_pipeline(Backend(nvml, "simulated", cfg))  # type: ignore[arg-type]
        rdev = replay.collection._device
        rdev.collect(SampleSink())
        nvml.calls.clear()
        rdev.collect(SampleSink())
        calls = collections.Counter(nvml.calls)
        alone = _cpu_ms(lambda: rdev.collect(SampleSink()), cycles, lambda: None)
        replay.close()
    return statistics.median(with_sim), statistics.median(alone), calls


def agent_toml(tmp: Path, pki: object, gateway: GatewayProc, port: int, pinterval: float) -> Path:
    creds = pki.node("bench-node")  # type: ignore[attr-defined]
    ca = pki.ca  # type: ignore[attr-defined]
    extra = f"process_interval_seconds = {pinterval}\n" if pinterval else ""
    path = tmp / "agent.toml"
    path.write_text(
        f"""node_name = "bench-node"
listen = "127.0.0.1:{port}"
interval_seconds = 1.0
{extra}
[simulate]
gpus = {GPUS}
processes_per_gpu = {PROCS_PER_GPU}

[gateway]
address = "127.0.0.1:{gateway.ssh_port}"
known_hosts = "{ca.known_hosts}"
key = "{creds.private_key}"
certificate = "{creds.certificate}"

[spool]
directory = "{tmp / "spool"}"
"""
    )
    return path


def slope_per_hour(points: list[tuple[float, float]]) -> float:
    xs = [t for t, _ in points]
    ys = [v for _, v in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in points) / den * 3600 if den else 0.0


SIMULATOR_FRAMES = ("edge_agent/sim/",)  # the NVML simulator, its host tree and kubelet


def profile(pid: int, seconds: int, out: Path, keep: str = "") -> float | None:
    """py-spy record with ``--gil`` (only the thread holding the GIL is sampled, so
    samples follow Python CPU time, not wall time spent waiting in a syscall or for the
    GIL); prints the top functions, the share of each thread and where the CPU goes with
    the simulator split off. Returns the simulator's share of the samples (a stack with a
    simulator frame in it), or None without py-spy. ``keep``: also copy the collapsed
    stacks there (for flame graphs or a closer look)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        print("py-spy not installed (pip install py-spy): no profile")
        return None
    raw = out / "agent.collapsed"
    subprocess.run(
        f"{spy} record --pid {pid} -d {seconds} -r 1000 --threads --gil -f raw -o {raw}".split(),
        check=False,
        capture_output=True,
    )
    if keep and raw.exists():
        shutil.copyfile(raw, keep)
    own: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    threads: collections.Counter[str] = collections.Counter()
    ours: collections.Counter[str] = collections.Counter()  # by place, simulator split off
    busy = 0
    for line in raw.read_text().splitlines() if raw.exists() else []:
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        leaf = frames[-1]
        if any(w in leaf for w in ("select (", "epoll", "wait (threading", "_worker (")):
            continue  # idle: waiting for the next cycle or event
        n = int(count)
        busy += n
        own[leaf] += n
        threads[frames[0].rpartition(":")[2].strip() or frames[0]] += n
        sim = any(any(m in f for m in SIMULATOR_FRAMES) for f in frames)
        ours["(the simulator, whole stacks)" if sim else place(leaf)] += n
        for f in set(frames[1:]):
            incl[f] += n
    pct = 100 / max(busy, 1)
    print(f"py-spy --gil, {seconds} s at 1000 Hz: {busy} samples ({busy / seconds:.2f} ms/s)")
    print("  by thread: " + ", ".join(f"{t} {n * pct:.0f}%" for t, n in threads.most_common()))
    print("  top own:")
    for name, n in own.most_common(15):
        print(f"    {n:5d} {n * pct:5.1f}%  {name}")
    print("  own, by where the leaf lives (stacks through the simulator apart):")
    for name, n in ours.most_common(12):
        print(f"    {n:5d} {n * pct:5.1f}%  {name}")
    print("  top inclusive:")
    for name, n in incl.most_common(25):
        print(f"    {n:5d} {n * pct:5.1f}%  {name}")
    return ours["(the simulator, whole stacks)"] / busy if busy else None


def place(frame: str) -> str:
    """The package (``asyncssh``, ``asyncio``...) or our module a frame lives in."""
    path = frame.rpartition("(")[2].rstrip(")").split(":")[0]
    parts = path.split("/")
    return "/".join(parts[:2]) if parts[0] in ("edge_agent", "gpurelay") else parts[0]


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds so far of each of the process's threads."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with suppress(OSError):
            stat = (task / "stat").read_text()
            rest = stat[stat.rindex(")") + 2 :].split()
            out[int(task.name)] = (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")
    return out


@dataclasses.dataclass
class Run:
    """One agent binary's measured span."""

    cpu_ms: float  # CPU per 1 s cycle, all threads
    sys_ms: float  # of which in the kernel
    points: list[tuple[float, float]]  # (seconds, RSS MB)
    peak_mb: float
    threads: list[float]  # CPU ms per cycle of each busy thread, 10 s after the span
    sim_share: float | None  # py-spy's share of samples through the simulator
    rows: int  # this node's series at the gateway


def measure(
    argv: list[str], tmp: Path, pki: object, gateway: GatewayProc, args: argparse.Namespace
) -> Run:
    """Start one agent binary against ``gateway``, wait for its tunnel, then measure."""
    tmp.mkdir()
    (port,) = free_ports(1)
    config = agent_toml(tmp, pki, gateway, port, args.process_interval)
    agent = Process(
        "agent",
        [*argv, "run", "--config", str(config)],
        tmp / "agent.log",
        clean_env("EDGE_AGENT_"),
    )
    try:
        agent.start()
        url = f"http://127.0.0.1:{port}/metrics"
        wait_until(
            lambda: httpx.get(url, timeout=1).status_code == 200,
            30,
            "the agent's /metrics",
            poll=0.2,
            alive=(agent,),
        )
        wait_until(lambda: "connected to gateway" in agent.log.read_text(), 30, "the tunnel")
        time.sleep(args.warmup)
        start, t0 = agent.sample(), time.monotonic()
        points = [(0.0, start.rss_kib / 1024)]
        while time.monotonic() - t0 < args.seconds:
            time.sleep(1.0)
            agent.check_alive()
            points.append((time.monotonic() - t0, agent.sample().rss_kib / 1024))
        end, cycles = agent.sample(), (time.monotonic() - t0) / 1.0
        threads = thread_cpu(agent.pid)
        time.sleep(10)
        threads = {k: v - threads.get(k, 0.0) for k, v in thread_cpu(agent.pid).items()}
        sim_share = None
        if args.profile:  # after the measured span: py-spy's sampling costs the agent CPU
            sim_share = profile(agent.pid, args.profile, tmp, args.profile_out)
        rows = sum(1 for line in gateway.metrics().splitlines() if "bench-node" in line)
    except HarnessError:
        print(agent.tail(), file=sys.stderr)
        raise
    finally:
        agent.stop()
    return Run(
        cpu_ms=(end.cpu_seconds - start.cpu_seconds) * 1000 / cycles,
        sys_ms=(end.system_seconds - start.system_seconds) * 1000 / cycles,
        points=points,
        peak_mb=end.peak_rss_kib / 1024,
        threads=sorted((v * 100 for v in threads.values() if v), reverse=True),
        sim_share=sim_share,
        rows=rows,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=int, default=120, help="measured span after warm-up")
    p.add_argument("--warmup", type=int, default=15)
    p.add_argument("--process-interval", type=float, default=0.0, help="0: the default")
    p.add_argument("--profile", type=int, default=0, help="py-spy for this many seconds")
    p.add_argument("--profile-out", default="", help="keep py-spy's collapsed stacks here")
    p.add_argument("--cycles", type=int, default=300, help="in-process device cycles")
    p.add_argument(
        "--no-replay", action="store_true", help="skip the binary with NVML answers replayed"
    )
    args = p.parse_args()
    print(f"python {sys.version.split()[0]} on {os.uname().machine}, {os.cpu_count()} CPUs")
    sim_ms, alone_ms, calls = device_cycle(args.cycles)
    binaries = {"simulator": [sys.executable, "-m", "edge_agent"]}
    if not args.no_replay:
        binaries["replayed"] = [sys.executable, str(Path(__file__).with_name("replayed_agent.py"))]
    runs: dict[str, Run] = {}
    with tempfile.TemporaryDirectory(prefix="agent-binary-") as tmp_:
        tmp = Path(tmp_)
        pki = make_pki(tmp)
        gateway = GatewayProc(pki, tmp)
        gateway.start()
        try:
            wait_until(gateway.ready, 30, "the gateway", alive=(gateway,))
            for name, argv in binaries.items():
                runs[name] = measure(argv, tmp / name, pki, gateway, args)
        except HarnessError as exc:
            print(exc, file=sys.stderr)
            sys.exit(1)
        finally:
            gateway.stop()
    run = runs["simulator"]
    sim_cost = sim_ms - alone_ms
    print(f"setup: {GPUS} simulated GPUs x {PROCS_PER_GPU} processes, 1 s interval, spool on,")
    print(f"  tunnel to a gateway on loopback ({run.rows} of this node's series there)")
    print(f"device cycle in this process, with simulator   {sim_ms:7.3f} ms (median)")
    print(f"device cycle in this process, agent alone      {alone_ms:7.3f} ms (median)")
    print(f"agent binary CPU per cycle ({args.seconds} s)          {run.cpu_ms:7.3f} ms")
    print(f"  of which in the kernel (stime)               {run.sys_ms:7.3f} ms")
    print(f"  minus the simulator's own cost               {run.cpu_ms - sim_cost:7.3f} ms")
    if run.sim_share is not None:
        ours = run.cpu_ms * (1 - run.sim_share)
        print(f"  minus the simulator, sampled ({100 * run.sim_share:4.1f}% of it)  {ours:7.3f} ms")
    print(f"  ratio to the device cycle (with simulator)   {run.cpu_ms / sim_ms:7.2f}x")
    if "replayed" in runs:
        rep = runs["replayed"]
        print(f"agent binary, NVML answers replayed ({args.seconds} s)  {rep.cpu_ms:7.3f} ms")
        print(f"  of which in the kernel (stime)               {rep.sys_ms:7.3f} ms")
        print(f"  ratio to the binary on the simulator         {rep.cpu_ms / run.cpu_ms:7.2f}x")
    n = sum(calls.values())
    top = ", ".join(f"{k} {v}" for k, v in calls.most_common(6))
    print(f"NVML calls per device cycle: {n} ({n / GPUS:.1f} per GPU): {top}")
    print(f"  at 2.5-12 us per call on a real driver: {n * 2.5e-3:.2f}-{n * 12e-3:.2f} ms")
    for name, r in runs.items():
        pts = r.points
        print(
            f"{name}: RSS {pts[0][1]:.1f} -> {pts[-1][1]:.1f} MB (peak {r.peak_mb:.1f}), "
            f"slope {slope_per_hour(pts):+.2f} MB/h over {len(pts)} samples; CPU ms per "
            f"cycle by thread, 10 s after the span: {', '.join(f'{v:.1f}' for v in r.threads)}"
        )


if __name__ == "__main__":
    main()
