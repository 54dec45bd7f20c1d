"""Replay throughput: how fast a backlog drains from an agent's spool into a real TSDB.

An agent's spool is filled with N collections of an 8-GPU node (64 GPU processes, ~740
series each) taken ``--step`` seconds apart up to now, as if the link had been down that
long. Then a gateway (its own process, remote write on) and a real Prometheus receiver
(``--web.enable-remote-write-receiver``, out-of-order window 2 h) are started, and the
agent (its own process, replay rate unbounded by default) drains the spool. Reports
batches per second end to end and the gateway's CPU per replayed batch, and checks that
Prometheus holds every sample.

Run: .venv/bin/python bench/replay_throughput.py [--batches 600] [--rate 1000]
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from edge_agent.spool import Spool
from gpurelay.record import RecordEncoder
from harness.fleet import make_pki
from harness.pipeline import simulated_snapshots
from harness.prometheus import Receiver
from harness.services import AgentProc, GatewayProc
from harness.waiting import wait_until

NODE = "edge-bench"


def fill_spool(path: Path, batches: int, node: str, step: float) -> tuple[int, int]:
    """N spooled records ending now; (series per record, total bytes)."""
    snaps = simulated_snapshots(gpus=8, processes_per_gpu=8, count=min(batches, 50))
    encoder = RecordEncoder()
    now = time.time()
    spool = Spool(path)
    first_seq = int(now * 1000) - 10 * batches - 1000
    total = 0
    for i in range(batches):
        base = snaps[i % len(snaps)]
        snap = dataclasses.replace(
            base,
            node=node,
            timestamp=now - (batches - i) * step,
            samples=tuple(
                dataclasses.replace(
                    s,
                    labels=tuple(
                        (k, node if k in ("Hostname", "NodeName") else v) for k, v in s.labels
                    ),
                )
                for s in base.samples
            ),
        )
        payload = encoder.encode(snap)
        total += len(payload)
        assert spool.put(first_seq + i, snap.timestamp, payload)
    spool.close()
    return len(snaps[0].samples), total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=600)
    parser.add_argument("--rate", type=float, default=1000.0, help="replay_batches_per_second")
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument(
        "--step", type=float, default=2.0, help="seconds between spooled collections"
    )
    args = parser.parse_args()
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        sys.exit("needs the prometheus binary (Debian package prometheus)")
    with tempfile.TemporaryDirectory(prefix="replay-") as name:
        tmp = Path(name)
        pki = make_pki(tmp)
        spool_dir = tmp / "spool"
        series, size = fill_spool(spool_dir / "spool.sqlite", args.batches, NODE, args.step)
        print(
            f"replay throughput: {args.batches} spooled collections x {series} series "
            f"({size / args.batches / 1024:.1f} KiB each), replay rate limit {args.rate:g}/s, "
            f"in flight {args.in_flight}"
        )
        receiver = Receiver(Path(prometheus), tmp)
        receiver.start()
        gateway = agent = None
        try:
            wait_until(receiver.ready, 60, "prometheus")
            gateway = GatewayProc(pki, tmp, receiver.url)
            gateway.start()
            wait_until(gateway.ready, 60, "gateway", alive=(gateway,))
            agent = AgentProc(
                pki,
                tmp,
                NODE,
                gateway,
                spool_dir=spool_dir,
                replay_rate=args.rate,
                max_in_flight=args.in_flight,
            )
            cpu0 = gateway.sample().cpu_seconds
            started = time.monotonic()
            agent.start()
            wait_until(
                lambda: (
                    agent.metric("gpurelay_agent_replayed_batches_total") >= args.batches
                    and agent.metric("gpurelay_agent_spool_batches") == 0
                ),
                600,
                "the backlog to drain",
                poll=0.1,
                alive=(gateway, agent),
            )
            elapsed = time.monotonic() - started
            cpu = gateway.sample().cpu_seconds - cpu0
            print(
                f"  drained in {elapsed:.1f}s (agent start included): "
                f"{args.batches / elapsed:.0f} batches/s, "
                f"{args.batches * series / elapsed:,.0f} samples/s"
            )
            print(
                f"  gateway CPU {cpu:.1f}s: {cpu / args.batches * 1000:.1f} ms per replayed batch "
                f"(decode, remote-write encode, snappy, HTTP; live batches of the same period "
                f"included)"
            )
            at = time.time()
            data = receiver.raw(
                '{__name__="DCGM_FI_DEV_GPU_TEMP"}',
                window_s=int(args.step * args.batches) + 120,
                at=at,
            )
            counts = sorted(len(v) for v in data.values())
            full = sum(1 for n in counts if n == args.batches)
            print(
                f"  Prometheus: {full} of the 8 backlog GPU temperature series hold all "
                f"{args.batches} samples (all series' counts: {counts}; the rest are the "
                f"agent's own live collections)"
            )
        finally:
            for proc in (agent, gateway, receiver):
                if proc is not None:
                    proc.stop()


if __name__ == "__main__":
    main()
