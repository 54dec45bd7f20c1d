"""The report of bench/gateway_ingest.py: every figure, the cross-checks and whether the
run was a valid steady state (bench/ingest_steady.py)."""

from __future__ import annotations

import argparse
import math
import os
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.ingest_steady import RunFacts, pct, spread_line, steady_state_problems, verdict
from harness.process import ProcSample

CPU_TARGET_US = 150.0
CORE_TARGET = 0.15  # share of one core at 1,000 nodes, 1 s
BYTES_TARGET = 512
MACHINE_SHARE = 0.8  # of all cores, for "what fits": room for the tick, logging, the OS


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


def label(text: str) -> str:
    return f"  {text:<46}"


@dataclass
class Window:
    wall: float
    cpu: ProcSample
    gateway_batches: int
    workers_cpu: list[float]
    machine: tuple[int, int]  # busy, total jiffies of all cores
    bytes_sent: list[int] = field(default_factory=list)
    batches_sent: list[int] = field(default_factory=list)
    wrapped: int = 0


def first_batches(ramp: tuple[Window, Window], nodes: int, steady_cpu: float) -> None:
    """The gateway's CPU for a node's first batch (DECLARE of every series + a full
    batch): its CPU while the first batches came in, less the later batches of that time
    at the window's cost per batch."""
    r0, r1 = ramp
    wall = r1.wall - r0.wall
    cpu = r1.cpu.cpu_seconds - r0.cpu.cpu_seconds
    later = r1.gateway_batches - r0.gateway_batches - nodes
    each = max(cpu - later * steady_cpu, 0.0) / nodes
    print(
        label("    first batch (DECLARE + full), each")
        + f"~{each * 1000:.1f} ms = {each / steady_cpu:.0f}x a steady batch (gateway CPU "
        f"{cpu * 1000:.0f} ms over {wall:.1f} s = {cpu / wall:.0%} of a core while {nodes} "
        f"first and {later} later batches came in)"
    )


def report(
    args: argparse.Namespace,
    finals: Sequence[dict[str, Any]],
    idle: tuple[Window, Window],
    ramp: tuple[Window, Window],
    window: tuple[Window, Window],
    text: str,
    api_batches: int,
) -> bool:
    """Print every figure; True when the run was a valid steady state."""
    idle0, idle1 = idle
    w0, w1 = window
    nodes = [node for f in finals for node in f["nodes"]]  # in fleet order, as the marks
    wall = w1.wall - w0.wall
    batches = w1.gateway_batches - w0.gateway_batches
    cpu = w1.cpu.cpu_seconds - w0.cpu.cpu_seconds
    idle_wall = idle1.wall - idle0.wall
    idle_cpu = idle1.cpu.cpu_seconds - idle0.cpu.cpu_seconds
    tick_ms = 1000 / os.sysconf("SC_CLK_TCK")
    if batches <= 0:
        raise BenchError("the gateway applied no batch in the measurement window")
    cpu_us = cpu / batches * 1e6
    verdict_a = "meets" if cpu_us <= CPU_TARGET_US else "MISSES"

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

    frames = [node["first_frames"] for node in nodes]
    hellos = [f[0] for f in frames if f]
    firsts = [sum(f[1:]) for f in frames if len(f) > 1]
    shapes = {len(f) for f in frames}
    declares = [f[1] for f in frames if len(f) == 3]
    fulls = [f[2] for f in frames if len(f) == 3]
    latencies = [x for f in finals for x in f["latencies_ms"]]
    late = [x for f in finals for x in f["late_s"]]

    print(f"measurement window: {wall:.1f} s")
    print(
        label("batches applied by the gateway")
        + f"{batches} ({batches / wall:.1f} batches/s; {args.nodes / args.interval:.1f} offered)"
    )
    print(
        label("(a) gateway CPU per batch")
        + f"{cpu_us:.0f} us   ({verdict_a} target <= {CPU_TARGET_US:.0f} us: "
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
    first_batches(ramp, len(nodes), cpu / batches)
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
    worker_cpu = [b - a for a, b in zip(w0.workers_cpu, w1.workers_cpu, strict=True)]
    agents_cpu = sum(worker_cpu)
    worker_cores = [c / wall for c in worker_cpu]
    print(
        label("agents' CPU per batch (same window)")
        + f"{agents_cpu / max(total_batches, 1) * 1e6:.0f} us "
        f"({agents_cpu / wall * 100:.1f}% of one core for all {args.nodes} agents in "
        f"{len(worker_cpu)} process(es); busiest {max(worker_cores) * 100:.0f}% of a core)"
    )
    print(
        label("gateway CPU / agents' CPU")
        + f"{cpu / max(agents_cpu, 1e-9):.2f} (gateway {cpu * 1000:.0f} ms, agents "
        f"{agents_cpu * 1000:.0f} ms in the window)"
    )
    print(
        label("agents' sends behind schedule")
        + (f"{spread_line([x * 1000 for x in late], '.1f')} ms" if late else "n/a")
    )
    jiffies = w1.machine[1] - w0.machine[1]
    machine_busy = (w1.machine[0] - w0.machine[0]) / max(jiffies, 1)
    print(
        label("machine")
        + f"{os.cpu_count()} cores, {machine_busy:.0%} busy over the window (every process, "
        "other users' included)"
    )
    cores = os.cpu_count() or 1
    per_batch = cpu / batches + agents_cpu / max(total_batches, 1)  # gateway + one agent
    print(
        label("what fits at these costs")
        + f"~{MACHINE_SHARE * cores * args.interval / per_batch:.0f} nodes at "
        f"{args.interval:g} s with gateway and agents on these {cores} cores "
        f"({MACHINE_SHARE:.0%} of them); the gateway alone saturates one core at "
        f"~{args.interval * batches / cpu:.0f} nodes"
    )

    sent = sum(node["batches_sent"] for node in nodes)
    acked = sum(node["acked"] for node in nodes)
    bytes_sent = sum(node["bytes_sent"] for node in nodes)
    connects = sum(node["connects"] for node in nodes)
    counter = metric(text, "gpurelay_gateway_batches_total")
    received = metric(text, "gpurelay_gateway_received_bytes_total")
    duplicates = metric(text, "gpurelay_gateway_duplicate_batches_total")
    errors = metric_sum(text, "gpurelay_gateway_protocol_errors_total")
    replaced = metric(text, "gpurelay_gateway_replaced_connections_total")
    silent = metric(text, "gpurelay_gateway_silent_connections_closed_total")
    wrapped = w1.wrapped - w0.wrapped
    consistent = sent == acked == api_batches == counter and bytes_sent == received
    print(
        f"check: agents sent {sent} batches ({bytes_sent} bytes), acked {acked}; gateway "
        f"counted {api_batches} (API) / {counter:.0f} (gpurelay_gateway_batches_total), "
        f"received {received:.0f} bytes; duplicates {duplicates:.0f}, protocol errors "
        f"{errors:.0f}, replaced connections {replaced:.0f}, closed as silent {silent:.0f}, "
        f"connects {connects} for {len(nodes)} nodes" + ("" if consistent else "  <-- MISMATCH")
    )
    reconnected = [node for node in nodes if node["connects"] != 1 or node["failures"]]
    if reconnected:
        reasons: Counter[str] = Counter()
        for node in reconnected:
            reasons.update(node["failures"])
        print(
            f"      {len(reconnected)} nodes connected more than once or failed (failures by "
            f"reason: {dict(reasons) or 'none: the gateway ended the session'}), e.g. "
            + ", ".join(
                f"{node['name']} ({node['connects']} connects {node['last_error'][:80]!r})"
                for node in reconnected[:3]
            )
        )
    if wrapped:
        print(f"note: {wrapped} batches in the window restarted the data timeline (a jump back)")
    facts = RunFacts(
        nodes=len(nodes),
        interval=args.interval,
        wall=wall,
        gateway_batches=batches,
        connects=connects,
        silent_closed=int(silent),
        replaced=int(replaced),
        worker_cores=worker_cores,
        late_p95=pct(late, 0.95) if late else 0.0,
        machine_busy=machine_busy,
        consistent=consistent,
    )
    problems = steady_state_problems(facts)
    print(verdict(problems))
    return not problems
