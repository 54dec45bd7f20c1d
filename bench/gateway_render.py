"""Gateway /metrics cost for 1,000 nodes x 8 GPUs (default counters plus process series).

One simulated 8-GPU node (harness/pipeline.make_pipeline) is collected twice (10 s
apart); its samples are replayed as 1,000 nodes (own node names, GPU UUIDs, container
ids and slightly different values) through Declare/Batch frames into the Registry.

Targets (DESIGN "Gateway hot path"): (b) a body from cached blocks after a generation bump
within 1.5x of (c) a plain join of the same bytes; (b) at least 100x faster than (d)
prometheus_client's generate_latest over a collector yielding the same samples.

Run: .venv/bin/python bench/gateway_render.py [--nodes 1000] [--reps 7]
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import itertools
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.render_http import over_http
from cloud_gateway.exposition.body import Exposition
from cloud_gateway.registry.store import Registry, stamp_node
from gpurelay.model import Family, Labels, Sample, Snapshot
from gpurelay.wire import Batch, Declare, Hello, SeriesDecl
from harness.pipeline import make_pipeline

GPUS = 8
WARMUP = 3  # untimed runs ahead of the timed ones
REWRITTEN = ("UUID", "container_id", "PodName")  # differ from node to node in a real fleet


def two_snapshots() -> tuple[Snapshot, Snapshot]:
    with tempfile.TemporaryDirectory() as tmp:
        pipeline, _sim, clock = make_pipeline(Path(tmp), gpus=GPUS)
        try:
            first = pipeline.collection.collect()
            clock.advance(10.0)
            return first, pipeline.collection.collect()
        finally:
            pipeline.close()


def node_labels(labels: Labels, node: str) -> Labels:
    def fresh(v: str) -> str:
        return v[:4] + hashlib.blake2b((node + v).encode(), digest_size=8).hexdigest() if v else v

    return tuple((k, fresh(v) if k in REWRITTEN else v) for k, v in labels)


def nudge(value: float, i: int) -> float:
    return value + i % 13 if value.is_integer() else value * (1 + (i % 13) / 100)


class Fleet:
    """1,000 agents replaying one node's snapshots, each as its own node."""

    def __init__(self, reg: Registry, snaps: tuple[Snapshot, Snapshot], nodes: int) -> None:
        self.reg, self.snaps, self.seq = reg, snaps, 1
        self.names = [f"edge-{i:04d}" for i in range(nodes)]
        self.conns: dict[str, int] = {}
        snap = snaps[0]
        self.labels = {n: [node_labels(s.labels, n) for s in snap.samples] for n in self.names}
        fams = {f.name: f for f in snap.families}
        self.frames = {
            node: (
                Declare(
                    series=tuple(
                        SeriesDecl(
                            id=j,
                            name=s.name,
                            type=fams[s.name].type,
                            help=fams[s.name].help,
                            labels=lab,
                        )
                        for j, (s, lab) in enumerate(
                            zip(snap.samples, self.labels[node], strict=True)
                        )
                    )
                ),
                Batch(
                    seq=1,
                    timestamp=0.0,
                    values=tuple((j, nudge(s.value, i)) for j, s in enumerate(snap.samples)),
                    full=True,
                ),
            )
            for i, node in enumerate(self.names)
        }

    def connect_all(self) -> None:
        """What the gateway does when every agent (re)connects: hello, declare, full batch."""
        gpus = self.snaps[0].gpus
        for node, (declare, batch) in self.frames.items():
            hello = Hello(agent_version="0.1.0", node=node, gpus=gpus)
            conn = self.reg.connect(node, remote="r", hello=hello, now=0.0).conn_id
            self.conns[node] = conn
            self.reg.declare(node, conn, declare)
            self.reg.apply(node, conn, batch, now=0.0, size_bytes=0)

    def steady_batches(self, flip: bool) -> list[tuple[str, Batch]]:
        """What each node sends one interval later: only the values that changed."""
        old, new = (self.snaps[1], self.snaps[0]) if flip else self.snaps
        self.seq += 1
        out = []
        # the second collection may carry series the first had not (two-sample rates):
        # only the first's series are declared, matched by name and labels
        later = {(s.name, s.labels): s.value for s in new.samples}
        earlier = {(s.name, s.labels): s.value for s in old.samples}
        pairs = [
            (j, earlier.get((s.name, s.labels), s.value), later.get((s.name, s.labels), s.value))
            for j, s in enumerate(self.snaps[0].samples)
        ]
        for i, node in enumerate(self.names):
            values = tuple((j, nudge(b, i)) for j, a, b in pairs if a != b)
            out.append((node, Batch(seq=self.seq, timestamp=0.0, values=values)))
        return out

    def rewrite(self) -> None:
        """Every node sends a new value for every series (the worst case)."""
        self.seq += 1
        n = len(self.snaps[0].samples)
        values = tuple((j, self.seq + j + 0.5) for j in range(n))
        for node in self.names:
            batch = Batch(seq=self.seq, timestamp=0.0, values=values)
            self.reg.apply(node, self.conns[node], batch, now=time.time(), size_bytes=0)

    def apply(self, batches: list[tuple[str, Batch]], now: float) -> None:
        for node, batch in batches:
            self.reg.apply(node, self.conns[node], batch, now=now, size_bytes=0)

    def samples(self) -> list[tuple[str, str, list[Sample]]]:
        """(family, type, samples) as a naive gateway would hold them, for generate_latest."""
        snap = self.snaps[0]
        fams = {f.name: f for f in snap.families}
        by_family: dict[str, list[Sample]] = {name: [] for name in sorted(fams)}
        for i, node in enumerate(self.names):
            for s, lab in zip(snap.samples, self.labels[node], strict=True):
                by_family[s.name].append(Sample(s.name, stamp_node(lab, node), nudge(s.value, i)))
        return [(name, fams[name].type, samples) for name, samples in by_family.items() if samples]


class NaiveCollector(Collector):
    def __init__(
        self, families: list[tuple[str, str, list[Sample]]], helps: dict[str, str]
    ) -> None:
        self.families, self.helps = families, helps

    def collect(self) -> Iterator[Metric]:
        for name, typ, samples in self.families:
            m = Metric(name, self.helps[name], typ)
            for s in samples:
                m.add_sample(s.name, dict(s.labels), s.value)
            yield m


def timed(
    fn: Callable[[], object],
    reps: int,
    before: Callable[[], object] | None = None,
    warmup: int = WARMUP,
) -> float:
    """Median wall time of ``fn`` in ms; ``before`` runs untimed ahead of each run. The
    warm-up runs let the allocator settle (the first large joins fault fresh pages in)."""
    out = []
    for _ in range(warmup + reps):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        out.append((time.perf_counter() - start) * 1000)
    return statistics.median(out[warmup:])


def line(label: str, ms: float, note: str = "") -> None:
    print(f"{label:<62} {ms:10.3f} ms  {note}")


def tick(expo: Exposition, n: int) -> None:
    """What the gateway's 1 s tick does to the exposition: its own counters move."""
    own = Family(name="gpurelay_gateway_batches_total", type="counter", help="Batches.")
    expo.set_extra([(own, [Sample(own.name, (), float(n))])])


def cached_bodies(fleet: Fleet, expo: Exposition, reps: int) -> float:
    """(a) a scrape with no new device data: only the gateway's own counters and a node's
    last_seen moved (before issue 15 that rebuilt the whole body); (b) the same in the
    old way, a body joined whole; (c) the bare join of the body's chunks."""
    reg, first = fleet.reg, fleet.names[0]
    dup = Batch(seq=0, timestamp=0.0, values=())
    ticks = itertools.count()

    def bump() -> None:  # a duplicate batch: last_seen moves, no device block gets dirty
        reg.apply(first, fleet.conns[first], dup, now=time.time(), size_bytes=0)
        tick(expo, next(ticks))

    for gz in (False, True):
        expo.scrape(openmetrics=False, gzip=gz)  # the fleet pieces exist (and are packed)
        a_ms = timed(partial(expo.scrape, openmetrics=False, gzip=gz), reps * 10, before=bump)
        kind = "gzip" if gz else "identity"
        line(f"(a) scrape, no new device data, tick + last_seen moved, {kind}", a_ms)
    b_ms = timed(partial(expo.body, openmetrics=False, gzip=False), reps, before=bump)
    line("(b) the same as one joined bytes (the whole body copied)", b_ms)
    chunks = expo.scrape(openmetrics=False, gzip=False).chunks
    c_ms = timed(partial(b"".join, chunks), reps)
    note = f"(b)/(c) = {b_ms / c_ms:.2f}"
    line(f"(c) plain b''.join of the same {len(chunks)} bytes objects", c_ms, note)
    return b_ms


def versus_prometheus_client(fleet: Fleet, b_ms: float, reps: int) -> None:
    """(d) what a gateway built on prometheus_client would pay per body."""
    helps = {f.name: f.help for f in fleet.snaps[0].families}
    prom = CollectorRegistry()
    prom.register(NaiveCollector(fleet.samples(), helps))
    d_ms = timed(partial(generate_latest, prom), max(2, reps // 3), warmup=0)
    note = f"(d)/(b) = {d_ms / b_ms:.0f}x  target >= 100x"
    line("(d) prometheus_client generate_latest, same samples", d_ms, note)


def steady_state(fleet: Fleet, expo: Exposition, reps: int) -> None:
    """(e) every node sent one batch: applying them, then a scrape (dirty blocks, the
    changed pieces re-joined, and for gzip recompressed), against (f) the whole body's
    gzip as it was before issue 15."""
    reg, nodes = fleet.reg, len(fleet.names)
    flips = itertools.count()
    pending: list[list[tuple[str, Batch]]] = []

    def make() -> None:
        pending.append(fleet.steady_batches(next(flips) % 2 == 1))

    apply_ms = timed(lambda: fleet.apply(pending.pop(), time.time()), reps, before=make)
    changed = sum(len(b.values) for _, b in fleet.steady_batches(False)) / nodes
    note = f"= {apply_ms / nodes * 1000:.1f} us per batch"
    line(f"(e) apply one steady batch per node ({changed:.0f} changed values each)", apply_ms, note)

    def steady() -> None:
        make()
        fleet.apply(pending.pop(), time.time())

    out = {}
    for label, before in (("after those", steady), ("when every value changed", fleet.rewrite)):
        for gz in (False, True):
            rendered = reg.blocks_rendered
            scrape = partial(expo.scrape, openmetrics=False, gzip=gz)
            e_ms = out[label, gz] = timed(scrape, reps, before=before)
            dirty = (reg.blocks_rendered - rendered) / (WARMUP + reps)
            kind = "gzip" if gz else "identity"
            line(f"(e) scrape {label}, {kind} ({dirty:.0f} dirty blocks)", e_ms)
    body = expo.body(openmetrics=False, gzip=False)
    f_ms = timed(partial(gzip.compress, body, compresslevel=1, mtime=0), max(2, reps // 2))
    note = f"(f)/(e gzip) = {f_ms / out['after those', True]:.1f}x"
    line("(f) gzip level 1 of the whole body (before issue 15)", f_ms, note)


def granularity(fleet: Fleet, reps: int) -> None:
    """(g) gzip members per piece of N (family, node) blocks: size and times."""
    body = Exposition(fleet.reg).body(openmetrics=False, gzip=False)
    whole = len(gzip.compress(body, compresslevel=1, mtime=0))
    flips = itertools.count()
    for n in (1, 16, 64, 256, 1024):
        expo = Exposition(fleet.reg, piece_blocks=n)
        start = time.perf_counter()
        size = expo.scrape(openmetrics=False, gzip=True).size
        cold = (time.perf_counter() - start) * 1000

        def steady() -> None:
            fleet.apply(fleet.steady_batches(next(flips) % 2 == 1), time.time())

        warm = timed(partial(expo.scrape, openmetrics=False, gzip=True), reps, before=steady)
        note = f"{size / 1e6:.1f} MB ({size / whole:.2f}x one member); cold {cold:.0f} ms"
        line(f"(g) pieces of {n} blocks: gzip scrape after steady batches", warm, note)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=15.0, help="of GETs under ingest")
    parser.add_argument("--granularity", action="store_true", help="(g): piece sizes")
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]} on {os.uname().machine}, {os.cpu_count()} CPUs")

    snaps = two_snapshots()
    reg = Registry()
    fleet = Fleet(reg, snaps, args.nodes)
    start = time.perf_counter()
    fleet.connect_all()
    setup_s = time.perf_counter() - start
    expo = Exposition(reg)
    body = expo.body(openmetrics=False, gzip=False)
    blocks = [b for _, family in reg.family_blocks() for b in family]
    n_samples = sum(b.count(b"\n") for b in blocks)
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"fleet: {args.nodes} nodes x {GPUS} GPUs, {len(snaps[0].samples)} series per node, "
        f"{n_samples} samples (+{2 * args.nodes} node_up/last_seen) in {len(blocks)} "
        f"(family, node) blocks; body {len(body) / 1e6:.1f} MB"
    )
    per_series = setup_s / n_samples * 1e6
    print(
        f"connect + declare + first full batch of all nodes: {setup_s:.2f} s "
        f"({per_series:.1f} us a series)"
    )
    print(f"peak RSS {rss_mb:.0f} MB; medians of {args.reps} runs unless said")

    b_ms = cached_bodies(fleet, expo, args.reps)
    versus_prometheus_client(fleet, b_ms, args.reps)
    steady_state(fleet, expo, args.reps)
    if args.granularity:
        granularity(fleet, args.reps)
    over_http(fleet, expo, args.seconds)


if __name__ == "__main__":
    main()
