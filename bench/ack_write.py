"""The gateway's cost of acknowledging: one ACK frame per batch vs gathered ACK_RANGES.

One process, real SSH on loopback: a gateway (:class:`cloud_gateway.app.Gateway`) and
``--nodes`` agent tunnels (:class:`edge_agent.tunnel.Tunnel`, node certificates) that
each submit a simulated 8-GPU collection every ``--interval`` seconds. Two phases of
``--seconds`` each, in the same run, with fresh tunnels: agents asking
``ack_delay_seconds = 0`` (one ACK frame per batch, as every agent did before range ACKs)
and ``--ack-delay`` (ACK_RANGES). The gateway's acknowledging is timed with
``time.perf_counter`` around everything it takes (only inside those calls, so the agents'
work in the same process is not counted; a call of microseconds is seldom preempted, and
the clock costs ~0.1 us where ``thread_time``, a system call, costs more than the
gathering it would measure):

- the write: ``_TelemetryChannel._send`` of ACK / ACK_RANGES frames (encode, SSH packet
  with its MAC and cipher, the socket write);
- the gathering: ``AckGatherer.add`` and ``AckGatherer.take`` (the frames for what waits),
  called by the connection's ``Acknowledger`` per read and on the tick.

Prints ACK frames per batch and the gateway CPU per batch spent acknowledging in each
mode, and their ratio (the wrappers' own two clock reads per call are included in both).

Run: .venv/bin/python bench/ack_write.py [--nodes 20] [--interval 0.5] [--seconds 15]
     [--ack-delay 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cloud_gateway.ingest import acks as acks_module
from cloud_gateway.ssh import server as ssh_server
from edge_agent.config import TunnelConfig
from edge_agent.tunnel import Tunnel
from gpurelay.wire import Ack, AckRanges, Hello
from harness.fleet import gateway_config, make_pki, running_gateway
from harness.pipeline import simulated_snapshots


@dataclasses.dataclass
class Spent:
    write: float = 0.0  # seconds inside the gateway's writes of ACK frames
    gather: float = 0.0  # seconds inside gathering them (add, flush)
    calls: int = 0  # wrapped calls timed (each carries the timer's own cost)


SPENT = Spent()


def timed(fn: Callable[..., Any], field: str, only: Callable[..., bool] | None = None) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if only is not None and not only(*args, **kwargs):
            return fn(*args, **kwargs)
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            setattr(SPENT, field, getattr(SPENT, field) + time.perf_counter() - t0)
            SPENT.calls += 1

    return wrapper


def timer_cost() -> float:
    """What one timed call of a no-op adds to the tally (the timer measuring itself)."""
    noop = timed(lambda: None, "gather")
    before, n = SPENT.gather, 20_000
    for _ in range(n):
        noop()
    cost = (SPENT.gather - before) / n
    SPENT.gather, SPENT.calls = before, 0
    return cost


def instrument() -> None:
    channel = ssh_server._TelemetryChannel
    channel._send = timed(  # type: ignore[method-assign]
        channel._send, "write", only=lambda self, frame: isinstance(frame, Ack | AckRanges)
    )
    gatherer = acks_module.AckGatherer
    gatherer.add = timed(gatherer.add, "gather")  # type: ignore[method-assign]
    gatherer.take = timed(gatherer.take, "gather")  # type: ignore[method-assign]


def same(hello: Hello) -> Hello:
    return hello


async def phase(args: argparse.Namespace, tmp: Path, delay: float) -> dict[str, float]:
    snaps = simulated_snapshots(gpus=8, processes_per_gpu=4, count=20)
    pki = make_pki(tmp)
    async with running_gateway(gateway_config(pki)) as gw:
        tasks: list[asyncio.Task[None]] = []
        tunnels: list[Tunnel] = []
        for k in range(args.nodes):
            name = f"edge-{k:03d}"
            creds = pki.node(name)
            cfg = TunnelConfig(
                address=f"127.0.0.1:{gw.ssh_port}",
                known_hosts=pki.ca.known_hosts,
                key=creds.private_key,
                certificate=creds.certificate,
                ack_delay_seconds=delay,
            )
            hello = Hello(agent_version="bench", node=name, interval_seconds=args.interval)
            tunnel = Tunnel(cfg, node=name, hello=functools.partial(same, hello))
            tunnels.append(tunnel)
            tasks.append(asyncio.create_task(tunnel.run()))

        async def send(k: int, tunnel: Tunnel) -> None:
            await asyncio.sleep(args.interval * k / args.nodes)
            i = 0
            while True:
                tunnel.submit(snaps[i % len(snaps)])
                i += 1
                await asyncio.sleep(args.interval)

        senders = [asyncio.create_task(send(k, t)) for k, t in enumerate(tunnels)]
        await asyncio.sleep(3.0)  # connect, DECLARE, first batches
        stats = gw.ingest.stats
        b0, f0, spent0 = stats.batches, stats.ack_frames, dataclasses.replace(SPENT)
        await asyncio.sleep(args.seconds)
        batches, frames = stats.batches - b0, stats.ack_frames - f0
        write, gather = SPENT.write - spent0.write, SPENT.gather - spent0.gather
        calls = SPENT.calls - spent0.calls
        for task in senders + tasks:
            task.cancel()
        for task in senders + tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    return {
        "batches": batches,
        "frames": frames,
        "write_us": write / batches * 1e6,
        "gather_us": gather / batches * 1e6,
        "timer_us": calls * args.timer_cost / batches * 1e6,
    }


async def main_async(args: argparse.Namespace) -> None:
    args.timer_cost = timer_cost()
    instrument()
    results = {}
    with tempfile.TemporaryDirectory(prefix="ack-write-") as tmp:
        for delay in (0.0, args.ack_delay):
            results[delay] = await phase(args, Path(tmp) / f"d{delay:g}", delay)
    print(
        f"ACK cost in the gateway, {args.nodes} agents at {args.interval:g} s over real SSH, "
        f"{args.seconds:g} s per mode; {os.cpu_count()} cores; time inside the calls"
    )
    for delay, r in results.items():
        what = (
            "one ACK per batch (ack_delay 0)" if not delay else f"ACK_RANGES, ack_delay {delay:g}s"
        )
        r["total_us"] = r["write_us"] + r["gather_us"] - r["timer_us"]
        print(
            f"  {what:34s} {r['batches']:6.0f} batches  {r['frames'] / r['batches']:.3f} "
            f"frames/batch  write {r['write_us']:6.1f} us  gather {r['gather_us']:5.1f} us  "
            f"- timer {r['timer_us']:4.1f} us = {r['total_us']:6.1f} us per batch"
        )
    old, new = results[0.0], results[args.ack_delay]
    print(
        f"  ratio ACK_RANGES / one ACK per batch: {new['total_us'] / old['total_us']:.2f} of "
        f"the CPU per batch (the timer: {args.timer_cost * 1e6:.2f} us per timed call, "
        "measured on a no-op and taken off)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=20)
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--ack-delay", type=float, default=3.0)
    args = parser.parse_args()
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
