"""Failover of several gateways on one PostgreSQL behind haproxy: ``kill -9`` of one (issue 16).

``--agents`` simulated agents (real :class:`edge_agent.tunnel.Tunnel` instances in one
worker process, :mod:`harness.cluster`) dial haproxy (TCP, leastconn, health check every
second, ``fall 2``) in front of ``--gateways`` gateway processes sharing one throwaway
PostgreSQL node directory. One run measures:

- **steady state**, once every node is online and no claim happened for a few seconds:
  the directory's load over ``--window`` seconds, counted as PostgreSQL *transactions* of
  the gateways' database (``pg_stat_database``: the change of ``xact_commit +
  xact_rollback`` for the database ``relay``, read from another database so the readings
  do not count themselves; every backend of that database counts: the gateways' pools,
  their LISTEN and leader-lock connections, autovacuum). asyncpg runs each statement
  outside an explicit transaction as its own, so this is statements plus explicit
  transactions. Also each gateway's CPU over the window;
- **kill -9** of the gateway owning the most nodes: the time until both survivors list
  every node it owned as online on a survivor (polling their ``/api/v1/nodes``); the time
  until every one of them has sent data on its new connection (``last_seen`` later than
  ``connected_since``, itself later than the kill, on its new owner); and the reconnects'
  spread (each node's ``connected_since`` on its new owner): the busiest whole second after
  the kill as a share of the moved nodes, against what the agents' backoff predicts (after
  a lost session an agent pauses uniformly in 0..10 x ``backoff_initial``: a share of
  1 / (10 x backoff_initial) per second).

Agents and gateways use the product defaults unless told: a batch every 10 s, backoff 1 s
initial / 60 s max, heartbeat 2 s, ttl 10 s. Everything started is stopped at the end, also
on failure; past ``--timeout`` seconds the bench aborts with what it was waiting for.

Run: .venv/bin/python bench/cluster_failover.py [--agents 1000] [--gateways 3] [--window 30]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gateway_ingest import BenchError
from harness.cluster import Cluster, ClusterSpec, running_cluster
from harness.process import HarnessError
from harness.waiting import wait_until

CLAIMS = "gpurelay_gateway_cluster_claims_total"
# s without a claim anywhere before the steady window opens: more than PostgreSQL's 10 s
# (PGSTAT_IDLE_INTERVAL) that an idle backend may hold its counts back, so the start's
# claims are not counted in the window (a 6 s quiet counted them: 3x the steady rate)
QUIET = 12.0
STEP = 5.0  # s: the window is read in steps, to show how even the rate is
POLL = 0.5  # s between two polls of the survivors' node lists after the kill


class FailoverError(BenchError):
    """The failover could not be measured: a node never came back, a survivor stopped
    answering, or the run took longer than --timeout."""


@dataclass(frozen=True)
class Steady:
    window: float  # s
    transactions: int  # xact_commit + xact_rollback of the database relay over the window
    steps: list[float]  # transactions per second in each STEP of the window
    backends: int  # connections to the database relay at the end of the window
    claims: int  # claims by any gateway during the window (0: a quiet steady state)
    cpu: dict[str, float]  # per gateway: CPU seconds per second over the window


@dataclass(frozen=True)
class Failover:
    victim: str
    moved: list[str]
    owned_after: float  # s from kill -9 until every moved node is listed online on a survivor
    fresh_after: float  # s until every moved node sent data on its new connection
    reconnects: list[float]  # per moved node: s from kill -9 to its new connection
    claims: int  # the survivors' claims from the kill until all fresh
    cpu: dict[str, float]  # CPU seconds of each survivor and the agents' worker meanwhile


def main() -> int:
    args = parse_args()
    cores = os.cpu_count() or 0
    usable = len(os.sched_getaffinity(0))
    spec = ClusterSpec(
        gateways=args.gateways,
        simulated=args.agents,
        real=0,
        interval=args.interval,
        backoff_initial=args.backoff,
        backoff_max=args.backoff_max,
        heartbeat_seconds=args.heartbeat,
        ttl_seconds=args.ttl,
        redispatch=args.redispatch,
    )
    print(f"machine: {cores} cores ({usable} usable by this process), python "
          f"{sys.version.split()[0]}, everything on loopback")  # fmt: skip
    print(
        f"cluster: {spec.gateways} gateways behind haproxy (leastconn, check every 1 s, fall 2, "
        + (
            "a refused connection retried elsewhere and marking its server down), "
            if spec.redispatch
            else "haproxy's defaults: no redispatch, no observe), "
        )
        + f"{spec.simulated} agents (1 GPU, a batch every {spec.interval:g} s, backoff "
        f"{spec.backoff_initial:g} s initial / {spec.backoff_max:g} s max), heartbeat "
        f"{spec.heartbeat_seconds:g} s, ttl {spec.ttl_seconds:g} s",
        flush=True,
    )
    signal.signal(signal.SIGALRM, _too_long(args.timeout))
    with tempfile.TemporaryDirectory(prefix="cluster-failover-") as tmp:
        started = time.monotonic()
        try:
            with running_cluster(Path(tmp), spec) as cluster:
                signal.alarm(int(args.timeout))
                try:
                    run(cluster, args, started)
                except (BenchError, HarnessError, httpx.HTTPError) as exc:
                    print(cluster.logs(15), file=sys.stderr)
                    print(f"cluster_failover: {exc}", file=sys.stderr)
                    return 1
                finally:
                    signal.alarm(0)  # not while the cluster stops
        except HarnessError as exc:  # the cluster did not start
            print(f"cluster_failover: {exc}", file=sys.stderr)
            return 1
    return 0


def run(cluster: Cluster, args: argparse.Namespace, started: float) -> None:
    version = subprocess.run(
        [str(cluster.postgres.bindir / "postgres"), "--version"],
        capture_output=True, text=True, check=False, timeout=10,
    ).stdout.strip()  # fmt: skip
    print(f"directory: {version}, fsync off (a throwaway server)")
    cluster.wait_settled(args.settle)
    nodes = len(cluster.node_names)
    owners = cluster.owners(next(iter(cluster.gateways)))
    spread = Counter(owners.values())
    print(
        f"start: all {nodes} nodes online on every gateway's list after "
        f"{time.monotonic() - started:.1f} s (certificates, servers, every agent dialing at "
        f"once); per gateway {dict(sorted(spread.items()))}",
        flush=True,
    )
    quiet(cluster, args.settle)
    steady = measure_steady(cluster, args.window)
    print_steady(steady, nodes, len(cluster.gateways))
    failover = kill_one(cluster, args.failover_timeout)
    print_failover(failover, nodes, args.backoff)


def quiet(cluster: Cluster, timeout: float) -> None:
    """Wait until no gateway has claimed a node for QUIET seconds (the start's moves and
    the gateways' shedding above their fair share are over)."""
    last = [claims(cluster, cluster.live()), time.monotonic()]

    def settled() -> bool:
        now = claims(cluster, cluster.live())
        if now != last[0]:
            last[:] = [now, time.monotonic()]
        return time.monotonic() - last[1] >= QUIET

    wait_until(settled, timeout, f"{QUIET:g} s without a claim", poll=1.0)


def measure_steady(cluster: Cluster, window: float) -> Steady:
    live = cluster.live()
    claims0, (xacts0, _) = claims(cluster, live), database_counters(cluster)
    cpu0 = {g: cluster.gateways[g].sample().cpu_seconds for g in live}
    t0 = time.monotonic()
    steps: list[float] = []
    last, at, backends = xacts0, t0, 0
    while at - t0 < window - 0.5:
        time.sleep(min(STEP, window - (at - t0)))
        xacts1, backends = database_counters(cluster)
        now = time.monotonic()
        steps.append((xacts1 - last) / (now - at))
        last, at = xacts1, now
    elapsed = at - t0
    cpu = {g: (cluster.gateways[g].sample().cpu_seconds - cpu0[g]) / elapsed for g in live}
    return Steady(elapsed, last - xacts0, steps, backends, claims(cluster, live) - claims0, cpu)


def print_steady(s: Steady, nodes: int, gateways: int) -> None:
    rate = s.transactions / s.window
    cpu = ", ".join(f"{g} {c * 100:.1f}%" for g, c in sorted(s.cpu.items()))
    print(
        f"steady state ({s.window:.0f} s, {s.claims} claims meanwhile): directory "
        f"{s.transactions} transactions (pg_stat_database xact_commit + xact_rollback of "
        f"database relay) = {rate:.2f}/s = {rate / gateways:.2f}/s per gateway = "
        f"{rate / (nodes / 1000):.2f}/s per 1,000 nodes at {nodes} nodes; "
        f"{s.backends} connections to it ({s.backends / gateways:.1f} per gateway); "
        f"per {STEP:g} s step: {' '.join(f'{r:.1f}' for r in s.steps)}/s"
    )
    print(
        f"steady state: gateway CPU (one core = 100%): {cpu}; "
        f"{sum(s.cpu.values()) / (nodes / 1000) * 100:.1f}% of a core per 1,000 nodes, "
        "all gateways together",
        flush=True,
    )


def kill_one(cluster: Cluster, timeout: float) -> Failover:
    """kill -9 of the gateway owning the most nodes; poll the survivors until both list each
    of its nodes online on a survivor, and until each has sent data on its new connection
    (on its new owner's list; the other survivor hears of the claim on its next
    heartbeat's read of the directory)."""
    gateways = cluster.live()
    owners = cluster.owners(gateways[0])
    victim = max(gateways, key=lambda g: (sum(o == g for o in owners.values()), g))
    moved = sorted(n for n, o in owners.items() if o == victim)
    survivors = [g for g in gateways if g != victim]
    claims0 = claims(cluster, survivors)
    procs = {g: cluster.gateways[g] for g in survivors}
    assert cluster.fleet is not None
    cpu0 = {g: p.sample().cpu_seconds for g, p in {**procs, "agents": cluster.fleet}.items()}
    print(f"kill -9 of {victim}, owner of {len(moved)} of {len(owners)} nodes", flush=True)
    killed = time.time()
    cluster.kill9(victim)
    owned_after: float | None = None
    fresh_after: float | None = None
    reconnects: list[float] = []
    while owned_after is None or fresh_after is None:
        now = time.time()
        if now - killed > timeout:
            raise FailoverError(
                f"after {timeout:g} s not every node of {victim} is back: "
                + progress(cluster, survivors, moved, killed)
            )
        for proc in [*procs.values(), cluster.fleet]:
            proc.check_alive()
        views = {g: cluster.nodes(g) for g in survivors}
        if owned_after is None and all(
            n in views[g] and views[g][n]["gateway"] in survivors
            and views[g][n]["state"] == "online"
            for g in survivors for n in moved
        ):  # fmt: skip
            owned_after = now - killed
        docs = {n: own_doc(views, n) for n in moved}
        if fresh_after is None and all(is_fresh(d, killed) for d in docs.values()):
            fresh_after = now - killed
            reconnects = sorted(float(d["connected_since"]) - killed for d in docs.values())
        time.sleep(POLL)
    cpu = {
        g: p.sample().cpu_seconds - cpu0[g] for g, p in {**procs, "agents": cluster.fleet}.items()
    }
    return Failover(
        victim=victim,
        moved=moved,
        owned_after=owned_after,
        fresh_after=fresh_after,
        reconnects=reconnects,
        claims=claims(cluster, survivors) - claims0,
        cpu=cpu,
    )


def print_failover(f: Failover, nodes: int, backoff: float) -> None:
    moved = len(f.moved)
    per_second = Counter(int(t) for t in f.reconnects)
    busiest_at, busiest = max(per_second.items(), key=lambda kv: (kv[1], -kv[0]))
    pause = 10 * backoff
    expected = min(1.0, 1 / pause)
    share = busiest / moved
    last = max(f.reconnects)
    q = statistics.quantiles(f.reconnects, n=10) if moved >= 2 else [last] * 9
    print(
        f"failover: all {moved} nodes of {f.victim} listed online on a survivor by both "
        f"survivors after {f.owned_after:.1f} s (polled every {POLL:g} s; the last new "
        f"connection {last:.1f} s after the kill); all of them sent data on the new "
        f"connection after {f.fresh_after:.1f} s"
    )
    print(
        f"failover: reconnects after the kill: first {f.reconnects[0]:.1f} s, median "
        f"{q[4]:.1f} s, 90% {q[8]:.1f} s, last {last:.1f} s, over {len(per_second)} distinct "
        f"seconds; survivors' claims {f.claims} for {moved} moved nodes"
    )
    print(
        f"failover: busiest reconnect second: {busiest} of {moved} moved nodes "
        f"({share * 100:.1f}%, second {busiest_at} after the kill, "
        f"{busiest / nodes * 100:.1f}% of the fleet); the agents' pause after a lost session "
        f"is uniform in 0..{pause:g} s (10 x backoff_initial): {expected * 100:.1f}% per "
        f"second expected, measured/expected {share / expected:.2f}; last reconnect / pause "
        f"ceiling {last / pause:.2f}"
    )
    shape = " ".join(f"{k}:{per_second[k]}" for k in range(int(last) + 1))
    print(f"failover: reconnects in each whole second after the kill: {shape}")
    cpu = ", ".join(f"{g} {c:.1f} s" for g, c in sorted(f.cpu.items()))
    print(f"failover: CPU from the kill until all fresh: {cpu}", flush=True)


# -- readings ------------------------------------------------------------------------------


def own_doc(views: dict[str, dict[str, dict[str, Any]]], node: str) -> dict[str, Any]:
    """``node``'s entry on the survivor that owns it ({} while none lists itself owner):
    only the owner knows its connection (connected_since, last_seen of this session)."""
    for gid, view in views.items():
        doc = view.get(node)
        if doc is not None and doc.get("gateway") == gid and doc.get("state") == "online":
            return doc
    return {}


def is_fresh(doc: dict[str, Any], killed: float) -> bool:
    """A connection made after the kill, and data on it (a batch sets last_seen again)."""
    since = doc.get("connected_since") or 0.0
    return bool(since > killed and (doc.get("last_seen") or 0.0) > since)


def progress(cluster: Cluster, survivors: list[str], moved: list[str], killed: float) -> str:
    try:
        views = {g: cluster.nodes(g) for g in survivors}
    except httpx.HTTPError as exc:
        return f"a survivor does not answer /api/v1/nodes: {exc!r}"
    docs = {n: own_doc(views, n) for n in moved}
    owned = sum(bool(d) for d in docs.values())
    fresh = [n for n, d in docs.items() if is_fresh(d, killed)]
    missing = sorted(set(moved) - set(fresh))[:5]
    return f"{owned} of {len(moved)} owned, {len(fresh)} fresh (not yet: {missing}...)"


def claims(cluster: Cluster, gateways: list[str]) -> int:
    """Claims so far, summed over ``gateways``' /metrics."""
    total = 0.0
    for gid in gateways:
        body = httpx.get(f"{cluster.gateways[gid].url}/metrics", timeout=30).text
        total += sum(
            float(line.rsplit(" ", 1)[1])
            for line in body.splitlines()
            if line.startswith(CLAIMS) and not line.startswith(CLAIMS + "_")
        )
    return int(total)


def database_counters(cluster: Cluster) -> tuple[int, int]:
    """(xact_commit + xact_rollback, numbackends) of the database ``relay``, read through
    the database ``postgres`` (its own transactions are not counted in ``relay``)."""
    pg = cluster.postgres
    proc = subprocess.run(
        [
            str(pg.bindir / "psql"), "-h", "127.0.0.1", "-p", str(pg.port), "-U", "relay",
            "-d", "postgres", "-Atc",
            "SELECT xact_commit + xact_rollback, numbackends FROM pg_stat_database "
            "WHERE datname = 'relay'",
        ],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    if proc.returncode != 0 or "|" not in proc.stdout:
        raise FailoverError(f"psql could not read pg_stat_database: {proc.stderr.strip()}")
    xacts, backends = proc.stdout.strip().split("|")
    return int(xacts), int(backends)


def _too_long(timeout: float) -> Callable[[int, FrameType | None], None]:
    def handler(signum: int, frame: FrameType | None) -> None:
        raise FailoverError(f"the bench ran past --timeout {timeout:g} s: aborted")

    return handler


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    add = parser.add_argument
    add("--agents", type=int, default=1000, help="simulated agents (one worker process)")
    add("--gateways", type=int, default=3)
    add("--interval", type=float, default=10.0, help="s between two batches of an agent")
    add("--backoff", type=float, default=1.0, help="the agents' backoff_initial_seconds")
    add("--backoff-max", type=float, default=60.0, help="the agents' backoff_max_seconds")
    add("--heartbeat", type=float, default=2.0, help="[cluster] heartbeat_seconds")
    add("--ttl", type=float, default=10.0, help="[cluster] ttl_seconds")
    add("--window", type=float, default=30.0, help="s of steady state measured")
    add("--settle", type=float, default=300.0, help="s for every agent to be online at start")
    add("--failover-timeout", type=float, default=180.0, help="s for the kill's nodes to return")
    add("--timeout", type=float, default=900.0, help="s for the whole run, then abort")
    add(
        "--redispatch",
        action="store_true",
        help="haproxy retries a refused connection on another gateway and marks the refusing "
        "one down at once (retries 2, option redispatch 1, observe layer4): the dead gateway "
        "gets no agent in the seconds before its health check fails",
    )
    args = parser.parse_args()
    if args.gateways < 2:
        parser.error("--gateways must be at least 2 (one is killed)")
    return args


if __name__ == "__main__":
    sys.exit(main())
