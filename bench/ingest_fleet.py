"""The agents' side of bench/gateway_ingest.py, seen from the bench: the worker processes
(bench/ingest_agents.py), each driven by JSON lines over its stdin and stdout, and the
spec each one reads."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.ingest_report import BenchError
from bench.ingest_steady import shares
from harness.fleet import Pki
from harness.process import ROOT, HarnessError, Process, ProcSample

COMMAND_TIMEOUT = 60.0  # a worker's reply to one command
STOP_SECONDS = 15.0  # a worker stopping its tunnels after its stdin closed
WORKER = Path(__file__).with_name("ingest_agents.py")


class Worker(Process):
    """One worker process of agents (bench/ingest_agents.py), driven by JSON lines over
    its stdin and stdout; its log (stderr) is ``log``."""

    def __init__(self, index: int, spec: Path, log: Path) -> None:
        super().__init__(f"agents worker {index}", [sys.executable, str(WORKER), str(spec)], log)
        self._reader: asyncio.StreamReader | None = None
        self._transport: asyncio.BaseTransport | None = None

    def start(self) -> None:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                self.argv, cwd=ROOT, env=self.env, stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=log,
            )  # fmt: skip

    async def attach(self) -> int:
        """Read its stdout on this loop; the number of nodes it is ready with."""
        assert self.proc is not None and self.proc.stdout is not None
        loop = asyncio.get_running_loop()
        self._reader = reader = asyncio.StreamReader(limit=64 * 1024 * 1024)
        self._transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), self.proc.stdout
        )
        return int((await self._read(COMMAND_TIMEOUT, "its start"))["ready"])

    async def _read(self, timeout: float, what: str) -> dict[str, Any]:
        assert self._reader is not None
        try:
            line = await asyncio.wait_for(self._reader.readline(), timeout)
        except TimeoutError:
            raise BenchError(f"{self.name} did not answer {what} within {timeout:g} s") from None
        if not line:
            self.proc.wait(timeout=5) if self.proc is not None else None
            raise HarnessError(f"{self.name} exited while asked for {what}\n{self.tail(20)}")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise BenchError(f"{self.name}: {reply['error']}")
        return reply

    async def call(self, cmd: str, **args: Any) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin is not None
        self.check_alive()
        try:
            self.proc.stdin.write((json.dumps({"cmd": cmd, **args}) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            self.check_alive()
            raise
        return await self._read(COMMAND_TIMEOUT, repr(cmd))

    def hang_up(self) -> None:
        """Close its stdin: it stops its tunnels and exits."""
        if self.proc is not None and self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()

    def finish(self) -> None:
        """After :meth:`hang_up`: wait for it to exit, SIGTERM then SIGKILL if it does not."""
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=STOP_SECONDS)
        self.stop(timeout=5)
        if self._transport is not None:
            self._transport.close()


class Fleet:
    """Every worker; a command goes to all of them at once."""

    def __init__(self, workers: Sequence[Worker]) -> None:
        self.workers = list(workers)

    async def call(self, cmd: str, **args: Any) -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(w.call(cmd, **args) for w in self.workers)))

    async def status(self) -> dict[str, Any]:
        """Connected nodes, connects, fewest batches sent by a node, batches not acked yet,
        failed sessions by reason: all workers."""
        replies = await self.call("status")
        failures: Counter[str] = Counter()
        for r in replies:
            failures.update(r["failures"])
        return {
            "connected": sum(r["connected"] for r in replies),
            "connects": sum(r["connects"] for r in replies),
            "min_sent": min(r["min_sent"] for r in replies),
            "unacked": sum(r["unacked"] for r in replies),
            "failures": dict(failures),
        }

    def samples(self) -> list[ProcSample]:
        return [w.sample() for w in self.workers]


def write_specs(
    args: argparse.Namespace,
    tmp: Path,
    pki: Pki,
    ssh_port: int,
    timeline: Path,
    connect_timeout: float,
    *,
    agent_backoff: bool = False,
) -> list[Path]:
    """One JSON spec per worker: the gateway, the data, its nodes and their credentials.
    ``agent_backoff``: the agent's own reconnect backoff (else a quick 0.2-2 s one, for
    benches that only measure a steady state)."""
    specs = []
    for p, indices in enumerate(shares(args.nodes, args.procs)):
        nodes = []
        for k in indices:
            name = f"bench-node-{k:04d}"
            creds = pki.node(name)
            nodes.append(
                {"index": k, "name": name, "key": str(creds.private_key),
                 "certificate": str(creds.certificate)}
            )  # fmt: skip
        spec = {
            "ssh_port": ssh_port,
            "known_hosts": str(pki.ca.known_hosts),
            "interval": args.interval,
            "spread": args.spread,
            "connect_timeout": connect_timeout,
            "ack_delay": getattr(args, "ack_delay", None),  # None: the agent's default
            "agent_backoff": agent_backoff,
            "timeline": str(timeline),
            "nodes": nodes,
        }
        path = tmp / f"worker-{p}.json"
        path.write_text(json.dumps(spec))
        specs.append(path)
    return specs
