"""Gateway registry memory per held series, and the registry's per-batch apply cost.

One simulated 8-GPU node (harness/pipeline.make_pipeline, collected twice 10 s apart)
is fed in-process as ``--nodes`` nodes (own node names, GPU UUIDs, container ids,
slightly different values) through real Declare/Batch frames (encoded and decoded by
gpurelay.wire, so the strings the registry keeps are the decoder's) into one Registry:
hello, declare, a first full batch. Frames are made node by node and dropped, so what
stays allocated is what the gateway holds. Reported:

* bytes per held series: tracemalloc's traced total after / series held (the Python
  allocations the registry keeps), and the RSS delta / series, for comparison with the
  series' own exposition text (the body's bytes / series, measured in the same run);
* per-batch apply time: every node sends one steady batch (the values that changed
  between the two collections), median over runs, against a bare loop over the same
  values (the floor of touching each value once in Python);
* the /metrics body build after such a round of batches (every touched block rendered).

Run: .venv/bin/python bench/gateway_memory.py [--nodes 1000] [--reps 5] [--trace]
(10,000 nodes: --nodes 10000 --no-body, memory only; --trace adds tracemalloc's count of
live Python allocations, exact but 4x slower: use it with --nodes 100)
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gateway_render import GPUS, node_labels, nudge, two_snapshots
from cloud_gateway.exposition.body import Exposition
from cloud_gateway.registry.store import Registry
from gpurelay.model import Snapshot
from gpurelay.wire import Batch, Declare, FrameDecoder, FrameEncoder, Hello, SeriesDecl


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def roundtrip(*frames: Hello | Declare | Batch) -> list[object]:
    """The frames as the gateway sees them: encoded by an agent, decoded by the gateway."""
    enc = FrameEncoder()
    return list(FrameDecoder().feed(b"".join(enc.encode(f) for f in frames)))


class Feeder:
    def __init__(self, reg: Registry, snaps: tuple[Snapshot, Snapshot]) -> None:
        self.reg, self.snaps = reg, snaps
        self.fams = {f.name: f for f in snaps[1].families}
        ids = {(s.name, s.labels): j for j, s in enumerate(snaps[1].samples)}
        old = {(s.name, s.labels): s.value for s in snaps[0].samples}
        # (id, value in the first collection, in the second) of the series that changed
        self.changes = [
            (j, old[(s.name, s.labels)], s.value)
            for s in snaps[1].samples
            if (j := ids[(s.name, s.labels)]) is not None
            and (s.name, s.labels) in old
            and old[(s.name, s.labels)] != s.value
        ]
        self.conns: dict[str, int] = {}
        self.seq = 1

    def node(self, i: int) -> None:
        name = f"edge-{i:05d}"
        snap = self.snaps[1]  # the fuller one: two-sample rates have a value from the 2nd on
        decl = Declare(
            series=tuple(
                SeriesDecl(
                    id=j,
                    name=s.name,
                    type=self.fams[s.name].type,
                    help=self.fams[s.name].help,
                    labels=node_labels(s.labels, name),
                )
                for j, s in enumerate(snap.samples)
            )
        )
        batch = Batch(
            seq=1,
            timestamp=0.0,
            values=tuple((j, nudge(s.value, i)) for j, s in enumerate(snap.samples)),
            full=True,
        )
        hello = Hello(agent_version="0.1.0", node=name, gpus=snap.gpus)
        hello, decl, batch = roundtrip(hello, decl, batch)  # type: ignore[assignment]
        conn = self.reg.connect(name, remote="r", hello=hello, now=0.0).conn_id
        self.conns[name] = conn
        self.reg.declare(name, conn, decl)
        self.reg.apply(name, conn, batch, now=0.0, size_bytes=0)

    def steady(self, flip: bool) -> list[tuple[str, Batch]]:
        self.seq += 1
        out = []
        for i, name in enumerate(self.conns):
            values = tuple((j, nudge(a if flip else b, i)) for j, a, b in self.changes)
            out.append((name, Batch(seq=self.seq, timestamp=0.0, values=values)))
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--per-scrape", type=int, default=15, help="batch rounds per GET")
    parser.add_argument("--trace", action="store_true", help="tracemalloc too (4x slower)")
    parser.add_argument("--no-body", action="store_true", help="memory only (10,000 nodes)")
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]} on {os.uname().machine}, {os.cpu_count()} CPUs")
    snaps = two_snapshots()
    reg = Registry()
    feeder = Feeder(reg, snaps)
    gc.collect()
    trace = args.trace
    if trace:
        tracemalloc.start()
    traced0, rss0 = (tracemalloc.get_traced_memory()[0] if trace else 0), rss_bytes()
    start = time.perf_counter()
    for i in range(args.nodes):
        feeder.node(i)
    feed_s = time.perf_counter() - start
    gc.collect()
    traced1, rss1 = (tracemalloc.get_traced_memory()[0] if trace else 0), rss_bytes()
    held = sum(v.series_count for v in reg.nodes(0.0))
    print(
        f"fed {args.nodes} nodes x {GPUS} GPUs, {len(snaps[1].samples)} series each: "
        f"{held} series in {feed_s:.1f} s (hello, declare, full batch)"
    )
    start = time.perf_counter()
    # every block rendered once, one at a time (the text is the exposition's to keep:
    # measured apart below, so the registry's own bytes are not hidden in a render spike)
    text = sum(len(reg.render(g)) for _, groups in reg.family_groups() for g in groups)
    render_s = time.perf_counter() - start
    gc.collect()
    traced2, rss2 = (tracemalloc.get_traced_memory()[0] if trace else 0), rss_bytes()
    if trace:
        tracemalloc.stop()
    own = text / held
    print(f"series' own text (the device blocks of the body): {own:.0f} B per series")
    print(f"first render of every block: {render_s * 1000:.0f} ms")
    for label, traced, rss in (
        ("after feeding, before any scrape", traced1, rss1),
        ("blocks rendered (steady state)", traced2, rss2),
    ):
        line = f"held {label}: RSS delta {(rss - rss0) / held:.0f} B per series"
        line += f" ({(rss - rss0) / 2**20:.0f} MiB)"
        if trace:
            line += f", tracemalloc {(traced - traced0) / held:.0f} B per series"
        print(f"{line}; {(rss - rss0) / held / own:.2f}x the text")
    if args.no_body:
        return
    expo = Exposition(reg)
    expo.scrape(openmetrics=False, gzip=False)  # the fleet pieces: the text served, held once
    gc.collect()
    rss3 = rss_bytes()
    print(
        f"the exposition's cached pieces (the body's device text, held once): RSS "
        f"{(rss3 - rss2) / held:.0f} B per series; registry + pieces "
        f"{(rss3 - rss0) / held:.0f} B per series"
    )
    expo.body(openmetrics=False, gzip=False)

    applies, builds, joins, floors = [], [], [], []
    changed = 0
    for r in range(args.reps):
        batches = feeder.steady(r % 2 == 1)
        changed = sum(len(b.values) for _, b in batches)
        start = time.perf_counter()
        for name, batch in batches:
            reg.apply(name, feeder.conns[name], batch, now=1.0, size_bytes=0)
        applies.append(time.perf_counter() - start)
        start = time.perf_counter()
        expo.body(openmetrics=False, gzip=False)
        builds.append(time.perf_counter() - start)
        blocks = [b for _, family in reg.family_blocks() for b in family]
        start = time.perf_counter()
        b"".join(blocks)
        joins.append(time.perf_counter() - start)
        sink: dict[int, float] = {}
        start = time.perf_counter()
        for _name, batch in batches:
            for sid, value in batch.values:
                sink[sid] = float(value)
        floors.append(time.perf_counter() - start)
    nodes = len(feeder.conns)
    apply_us = statistics.median(applies) / nodes * 1e6
    floor_us = statistics.median(floors) / nodes * 1e6
    print(
        f"apply one steady batch ({changed / nodes:.0f} changed values): {apply_us:.1f} us per "
        f"batch; a bare dict-store loop over the same values {floor_us:.1f} us: "
        f"{apply_us / floor_us:.1f}x"
    )
    intervals = []
    for _ in range(args.reps):  # a scrape every --per-scrape rounds of batches
        rounds = [feeder.steady(r % 2 == 1) for r in range(args.per_scrape)]
        start = time.perf_counter()
        for batches in rounds:
            for name, batch in batches:
                reg.apply(name, feeder.conns[name], batch, now=1.0, size_bytes=0)
        expo.body(openmetrics=False, gzip=False)
        intervals.append(time.perf_counter() - start)
    interval_ms = statistics.median(intervals) * 1000
    print(
        f"{args.per_scrape} rounds of batches and one GET (a scrape interval at 1 s batches): "
        f"{interval_ms:.0f} ms = {interval_ms / nodes / args.per_scrape * 1000:.1f} us per batch"
    )
    build_ms, join_ms = statistics.median(builds) * 1000, statistics.median(joins) * 1000
    print(
        f"GET body build after a round of batches (dirty blocks rendered): {build_ms:.0f} ms; "
        f"a plain join of the device blocks {join_ms:.0f} ms: {build_ms / join_ms:.1f}x "
        f"(medians of {args.reps})"
    )


if __name__ == "__main__":
    main()
