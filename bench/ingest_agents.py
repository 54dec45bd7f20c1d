"""A worker of bench/gateway_ingest.py: its share of the agents, each a real
:class:`edge_agent.tunnel.Tunnel` (asyncssh, node certificate, one telemetry channel), on
this process's own event loop.

Run by the bench as ``python bench/ingest_agents.py SPEC.json``. The spec (JSON) names
the gateway, the interval, the pickled data timeline and this worker's nodes (global
index, name, key, certificate). The bench then drives it with one JSON command per line
on stdin and reads one JSON reply per line on stdout:

- ``connect``: start every tunnel (HELLO only);
- ``status``: connected nodes, connects, fewest batches sent by a node, batches not
  acknowledged yet;
- ``send`` (``first_at``: a ``time.monotonic()`` instant, the same clock in every process
  on Linux; ``total``: nodes in the whole fleet; ``ramp``: intervals): node i sends every
  ``interval`` s from ``first_at + interval * first_send(i, total, ramp)``;
- ``mark`` (``label``): each node's bytes and batches sent so far, and this process's CPU;
- ``stop_sending``; ``final``: per-node figures, ack latencies and send lateness between
  the marks ``w0`` and ``w1``; ``quit``;
- for bench/fleet.py: ``send`` also takes ``interval`` (instead of the spec's) and
  ``below`` (only nodes whose global index is below it send); ``round``: every node
  submits its next collection now (one round of new data); ``connects_since``
  (``t``): the ``time.monotonic()`` instants of every connect after ``t``, and how many
  nodes have sent a batch that was acknowledged after ``t``.

The worker exits when its stdin closes (the bench is gone), on SIGTERM, or on ``quit``,
stopping every tunnel first. Logs (tunnel reconnects and their reasons) go to stderr,
which the bench sends to a file.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import pickle
import random
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.ingest_steady import first_send
from edge_agent import __version__
from edge_agent.config import TunnelConfig
from edge_agent.tunnel import Tunnel
from edge_agent.tunnel_stats import TunnelStats
from gpurelay.model import Snapshot
from gpurelay.wire import Hello

DATA_STEP = 10.0  # simulated seconds between two collections (the agent's default interval)
TIMESTAMP_JITTER = 0.02  # a real collection loop starts a few ms late; so do these stamps
STOP_TIMEOUT = 10.0


class RecordingStats(TunnelStats):
    """``TunnelStats`` that also notes when each batch was written and when it was
    acknowledged, and the size of every frame before the first batch (HELLO, DECLARE,
    BATCH).

    The tunnel only ever assigns to its public ``stats`` fields, so watching those
    assignments needs nothing private. A batch is identified by its sequence number (the
    outbox's ``latest`` when ``batches_sent`` goes up: the tunnel sends the newest
    snapshot and counts it without yielding in between). ``acked_seq`` is the highest
    acknowledged seq, and the gateway acknowledges in order on one channel, so an increase
    from ``a`` to ``b`` acknowledges every sent seq in ``(a, b]`` -- however many ACKs (or
    a range) arrived in one read. Counting increases instead undercounts.
    """

    def __init__(self, outbox: Any = None) -> None:
        self.outbox = outbox  # the tunnel's Outbox: its public ``latest`` names the seq
        self.sent_at: list[float] = []
        self.sent_seqs: list[int] = []
        self.acked_at: list[float] = []  # acked_at[i] is for sent_seqs[i]
        self.first_frames: list[int] = []
        self.connected_at: list[float] = []  # every connect (session established)
        super().__init__()

    def __setattr__(self, name: str, value: Any) -> None:
        seen = self.__dict__
        if name in seen and "first_frames" in seen:  # an update by the tunnel
            if name == "bytes_sent" and seen["batches_sent"] == 0:
                self.first_frames.append(value - seen["bytes_sent"])
            elif name == "batches_sent" and value > seen[name]:
                latest = getattr(self.outbox, "latest", None)
                self.sent_seqs.append(latest[0] if latest is not None else -1)
                self.sent_at.append(time.monotonic())
            elif name == "connects" and value > seen[name]:
                self.connected_at.append(time.monotonic())
            elif name == "acked_seq" and value > seen[name]:
                now = time.monotonic()
                sent, acked = self.sent_seqs, self.acked_at
                while len(acked) < len(sent) and sent[len(acked)] <= value:
                    acked.append(now)
        super().__setattr__(name, value)

    @property
    def unacked(self) -> int:
        """Batches sent and not yet acknowledged."""
        return len(self.sent_seqs) - len(self.acked_at)


@dataclass
class Node:
    index: int  # in the whole fleet
    name: str
    tunnel: Tunnel
    stats: RecordingStats
    start: int  # index of its first snapshot in the timeline
    submitted: int = 0
    wrapped: int = 0  # submissions that ran past the end of the timeline (restarted at 0)
    task: asyncio.Task[None] | None = None
    sender: asyncio.Task[None] | None = None


def _constant(hello: Hello) -> Callable[[], Hello]:
    return lambda: hello


def make_nodes(spec: dict[str, Any], timeline: Sequence[Snapshot]) -> list[Node]:
    nodes = []
    interval = float(spec["interval"])
    for entry in spec["nodes"]:
        name = entry["name"]
        cfg = TunnelConfig(
            address=f"127.0.0.1:{spec['ssh_port']}",
            known_hosts=Path(spec["known_hosts"]),
            key=Path(entry["key"]),
            certificate=Path(entry["certificate"]),
            connect_timeout_seconds=float(spec["connect_timeout"]),
        )
        if not spec.get("agent_backoff"):  # the agent's own (1 s, 60 s) for a herd's return
            cfg = dataclasses.replace(cfg, backoff_initial_seconds=0.2, backoff_max_seconds=2.0)
        if spec.get("ack_delay") is not None:  # [gateway] ack_delay_seconds (0: one ACK/batch)
            cfg = dataclasses.replace(cfg, ack_delay_seconds=float(spec["ack_delay"]))
        hello = Hello(
            agent_version=__version__,
            node=name,
            domain=name,
            backend="simulated",
            hostname=name,
            interval_seconds=interval,
            gpus=timeline[0].gpus,
        )
        tunnel = Tunnel(cfg, node=name, hello=_constant(hello))
        stats = RecordingStats(tunnel.outbox)
        tunnel.stats = stats
        index = int(entry["index"])
        nodes.append(Node(index, name, tunnel, stats, start=index % int(spec["spread"])))
    return nodes


class Agents:
    """This worker's nodes and what it measured of them."""

    def __init__(self, spec: dict[str, Any], timeline: Sequence[Snapshot]) -> None:
        self.spec = spec
        self.interval = float(spec["interval"])
        self.timeline = timeline
        self.nodes = make_nodes(spec, timeline)
        self.lateness: list[tuple[float, float]] = []  # (when, seconds behind schedule)
        self.marks: dict[str, dict[str, Any]] = {}

    def connect(self) -> dict[str, Any]:
        for node in self.nodes:
            node.task = asyncio.create_task(node.tunnel.run(), name=f"tunnel {node.name}")
        return {}

    def status(self) -> dict[str, Any]:
        stats = [n.stats for n in self.nodes]
        return {
            "connected": sum(s.connected for s in stats),
            "connects": sum(s.connects for s in stats),
            "min_sent": min(s.batches_sent for s in stats),
            "unacked": sum(s.unacked for s in stats),
            "failures": dict(sum((Counter(s.failures) for s in stats), Counter())),
        }

    def send(
        self,
        first_at: float,
        total: int,
        ramp: int,
        interval: float | None = None,
        below: int | None = None,
    ) -> dict[str, Any]:
        every = self.interval if interval is None else interval
        for node in self.nodes:
            if below is not None and node.index >= below:
                continue
            start = first_at + every * first_send(node.index, below or total, ramp)
            node.sender = asyncio.create_task(
                self._send_loop(node, start, every), name=f"sender {node.name}"
            )
        return {}

    def _submit(self, node: Node) -> None:
        """Hand the node's tunnel its next collection of the timeline."""
        timeline = self.timeline
        position = node.start + node.submitted
        if position >= len(timeline):
            node.wrapped += 1
        snapshot = timeline[position % len(timeline)]
        jitter = random.Random(node.index * 1_000_003 + position).uniform(0, TIMESTAMP_JITTER)
        stamp = timeline[0].timestamp + DATA_STEP * position + jitter
        node.tunnel.submit(dataclasses.replace(snapshot, timestamp=stamp))
        node.submitted += 1

    async def _send_loop(self, node: Node, first_at: float, interval: float) -> None:
        """Submit the node's next snapshot every interval (absolute schedule, no burst)."""
        loop = asyncio.get_running_loop()
        next_at = first_at
        while True:
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            now = loop.time()
            self.lateness.append((now, now - next_at))
            self._submit(node)
            next_at += interval
            if next_at < loop.time():  # this process fell behind: do not burst
                next_at = loop.time() + interval

    def round(self) -> dict[str, Any]:
        """Every node submits its next collection now."""
        for node in self.nodes:
            self._submit(node)
        return {}

    def connects_since(self, t: float) -> dict[str, Any]:
        """Connect instants after ``t``; nodes with a batch acknowledged after ``t``."""
        return {
            "connected_at": [c for n in self.nodes for c in n.stats.connected_at if c > t],
            "acked_after": sum(1 for n in self.nodes if n.stats.acked_at[-1:] > [t]),
            "connected": sum(n.stats.connected for n in self.nodes),
        }

    def mark(self, label: str) -> dict[str, Any]:
        mark = {
            "t": time.monotonic(),
            "cpu": time.process_time(),
            "bytes_sent": [n.stats.bytes_sent for n in self.nodes],
            "batches_sent": [n.stats.batches_sent for n in self.nodes],
            "wrapped": sum(n.wrapped for n in self.nodes),
        }
        self.marks[label] = mark
        return mark

    def stop_sending(self) -> dict[str, Any]:
        for node in self.nodes:
            if node.sender is not None:
                node.sender.cancel()
        return {}

    def final(self) -> dict[str, Any]:
        w0, w1 = self.marks.get("w0"), self.marks.get("w1")
        latencies: list[float] = []  # ms; acked_at[b] is for sent_seqs[b]
        late: list[float] = []
        if w0 is not None and w1 is not None:
            for i, node in enumerate(self.nodes):
                sent_at, acked_at = node.stats.sent_at, node.stats.acked_at
                end = min(w1["batches_sent"][i], len(acked_at))
                for b in range(w0["batches_sent"][i], end):
                    latencies.append((acked_at[b] - sent_at[b]) * 1000)
            late = [s for t, s in self.lateness if w0["t"] <= t <= w1["t"]]
        return {
            "nodes": [
                {
                    "name": n.name,
                    "connects": n.stats.connects,
                    "failures": n.stats.failures,
                    "last_error": n.stats.last_error,
                    "first_frames": n.stats.first_frames,
                    "batches_sent": n.stats.batches_sent,
                    "acked": len(n.stats.acked_at),
                    "bytes_sent": n.stats.bytes_sent,
                }
                for n in self.nodes
            ],
            "latencies_ms": latencies,
            "late_s": late,
        }

    async def stop(self) -> None:
        tasks = [t for n in self.nodes for t in (n.sender, n.task) if t is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=STOP_TIMEOUT)


async def serve(spec_path: Path) -> None:
    spec = json.loads(spec_path.read_text())
    timeline: list[Snapshot] = pickle.loads(Path(spec["timeline"]).read_bytes())
    agents = Agents(spec, timeline)
    loop = asyncio.get_running_loop()
    this = asyncio.current_task()
    assert this is not None
    loop.add_signal_handler(signal.SIGTERM, this.cancel)
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    out = sys.stdout

    def reply(body: dict[str, Any]) -> None:
        out.write(json.dumps(body) + "\n")
        out.flush()

    reply({"ready": len(agents.nodes)})
    try:
        while line := await reader.readline():  # b"": the bench is gone
            command = json.loads(line)
            cmd = command["cmd"]
            if cmd == "quit":
                break
            if cmd == "connect":
                reply(agents.connect())
            elif cmd == "status":
                reply(agents.status())
            elif cmd == "send":
                first_at, total = float(command["first_at"]), int(command["total"])
                every, below = command.get("interval"), command.get("below")
                reply(agents.send(first_at, total, int(command["ramp"]), every, below))
            elif cmd == "round":
                reply(agents.round())
            elif cmd == "connects_since":
                reply(agents.connects_since(float(command["t"])))
            elif cmd == "mark":
                reply(agents.mark(str(command["label"])))
            elif cmd == "stop_sending":
                reply(agents.stop_sending())
            elif cmd == "final":
                reply(agents.final())
            else:
                reply({"error": f"unknown command {cmd!r}"})
    finally:
        await agents.stop()


def main() -> int:
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("asyncssh").setLevel(logging.WARNING)
    with contextlib.suppress(asyncio.CancelledError, KeyboardInterrupt):  # SIGTERM, SIGINT
        asyncio.run(serve(Path(sys.argv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
