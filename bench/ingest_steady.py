"""Pure helpers of bench/gateway_ingest.py: how the agents are spread over worker
processes, the spread of a list of figures, and whether a run was a valid steady state."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

NODES_PER_PROC = 250  # agents one worker process carries when --procs is not given
SINGLE_PROC_NODES = 200  # up to this many nodes, one worker process
RATE_TOLERANCE = 0.03  # batches applied vs offered in the window
WORKER_CORE_LIMIT = 0.85  # a worker busier than this share of a core cannot keep time
LATE_LIMIT = 0.10  # p95 of a send's lateness, as a share of the interval
MACHINE_BUSY_LIMIT = 0.95  # share of all cores busy: the gateway shared its cores


def default_procs(nodes: int) -> int:
    """Worker processes for ``nodes`` agents: one up to 200, else one per 250 nodes."""
    if nodes <= SINGLE_PROC_NODES:
        return 1
    return math.ceil(nodes / NODES_PER_PROC)


def shares(nodes: int, procs: int) -> list[range]:
    """Node indices of each worker: contiguous, sizes differing by at most one, none empty
    (never more workers than nodes)."""
    procs = max(1, min(procs, nodes))
    base, extra = divmod(nodes, procs)
    out = []
    start = 0
    for p in range(procs):
        size = base + (1 if p < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def first_send(index: int, total: int, ramp: int) -> float:
    """When node ``index`` of ``total`` sends its first batch, in intervals from the
    start: at phase ``index / total`` of an interval (the fleet's batches spread evenly
    over each interval), in interval ``floor(ramp * index / total)`` (the fleet's first
    batches -- DECLARE and a full batch, far costlier for the gateway than a steady one --
    spread over ``ramp`` intervals)."""
    return index * ramp // total + index / total


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


@dataclass(frozen=True)
class RunFacts:
    """What the steady-state check looks at, all measured over the measurement window
    (connect and reconnect counts: over the whole run)."""

    nodes: int
    interval: float
    wall: float  # seconds
    gateway_batches: int  # batches the gateway applied in the window
    connects: int  # telemetry channels opened, all agents, whole run
    silent_closed: int  # connections the gateway closed for silence
    replaced: int  # connections replaced by a newer one of the same node
    worker_cores: Sequence[float]  # each worker's CPU / wall
    late_p95: float  # seconds a send ran behind its schedule, p95 over every send
    machine_busy: float  # share of all cores busy (every process on the machine)
    consistent: bool  # sent == acked == counted by the gateway, bytes equal


def steady_state_problems(f: RunFacts) -> list[str]:
    """Why the run is not a valid steady state ([] when it is): the gateway must have
    applied what the agents offered, no session may have been re-established, and neither
    the agents' processes nor the machine may have been saturated."""
    problems = []
    expected = f.nodes * f.wall / f.interval
    if expected > 0 and abs(f.gateway_batches / expected - 1) > RATE_TOLERANCE:
        problems.append(
            f"the gateway applied {f.gateway_batches} batches, {f.gateway_batches / expected:.1%}"
            f" of the {expected:.0f} offered (nodes x window / interval; within "
            f"{RATE_TOLERANCE:.0%} required)"
        )
    if f.connects != f.nodes:
        problems.append(f"{f.connects} connects for {f.nodes} nodes: sessions were re-established")
    if f.silent_closed:
        problems.append(f"the gateway closed {f.silent_closed} connections as silent")
    if f.replaced:
        problems.append(f"the gateway replaced {f.replaced} connections")
    busy = [c for c in f.worker_cores if c > WORKER_CORE_LIMIT]
    if busy:
        problems.append(
            f"{len(busy)} agents' process(es) saturated (up to {max(busy):.0%} of a core; "
            f"limit {WORKER_CORE_LIMIT:.0%}): use more --procs or fewer nodes"
        )
    if f.late_p95 > LATE_LIMIT * f.interval:
        problems.append(
            f"the agents' sends ran {f.late_p95 * 1000:.0f} ms behind schedule (p95; limit "
            f"{LATE_LIMIT:.0%} of the interval): their processes cannot keep time"
        )
    if f.machine_busy > MACHINE_BUSY_LIMIT:
        problems.append(
            f"the machine was {f.machine_busy:.0%} busy (all cores, every process): the "
            "gateway and the agents competed for CPU"
        )
    if not f.consistent:
        problems.append("the agents' and the gateway's counts disagree (see check:)")
    return problems


def verdict(problems: Sequence[str]) -> str:
    if not problems:
        return "steady state: VALID"
    return "steady state: NOT A STEADY STATE: " + "; ".join(problems)


def machine_jiffies(stat: str | None = None) -> tuple[int, int]:
    """(busy, total) jiffies of all cores since boot, from /proc/stat's ``cpu`` line (idle
    and iowait are not busy)."""
    text = Path("/proc/stat").read_text() if stat is None else stat
    for line in text.splitlines():
        if line.startswith("cpu "):
            fields = [int(x) for x in line.split()[1:]]
            total = sum(fields[:8])  # guest time is already in user and nice
            idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
            return total - idle, total
    raise ValueError("no cpu line in /proc/stat")
