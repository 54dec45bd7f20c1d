"""Gateway memory under hostile nodes: RSS growth per hostile connection, per attack.

A gateway process, one honest agent, then for each attack ``--nodes`` hostile nodes (each
with a valid certificate of its own, driven by a raw asyncssh client in this process) do
the worst their budgets allow and hold it. Printed per attack: the gateway's RSS growth
per hostile connection, whether the honest node stayed fresh, and whether /metrics stayed
promtool-clean (when promtool is installed). Issue 12 measured +1.7 GB from one 63 KiB
REPLAY frame, +127 MiB from 40 parked partial frames, +141 MiB from 0.19 MiB of labels.

Attacks:
  labels    series with 32 labels of long random values, up to and past the label budget
  partial   a 4 MiB frame promised, most of it sent, the rest never (until the deadline)
  bomb      REPLAY records of ~16 MiB inflated ([[],[],...] and friends), again and again
  churn     100k series ids declared and retired
  families  20 rounds of 100 new families (2,000 series) declared, valued, removed, with
            /metrics scraped whole and by shard each round (issue 24, attack W20)

After each attack the hostile connections close; the RSS then (after 10 s) is printed
too: memory a closed connection held must be given back.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Awaitable, Callable
from pathlib import Path

import asyncssh
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # harness/, beside bench/

from gpurelay.wire import SUBSYSTEM, Batch, Declare, FrameEncoder, Hello, Replay, SeriesDecl
from harness.fleet import Pki, make_pki
from harness.services import AgentProc, GatewayProc
from harness.waiting import wait_until

MIB = 1024 * 1024


async def connect(pki: Pki, gw: GatewayProc, name: str) -> asyncssh.SSHClientConnection:
    creds = pki.node(name)
    return await asyncssh.connect(
        "127.0.0.1",
        gw.ssh_port,
        username=name,
        client_keys=[(asyncssh.read_private_key(str(creds.private_key)),
                      asyncssh.read_certificate(str(creds.certificate)))],
        known_hosts=str(pki.ca.known_hosts),
        agent_path=None,
        config=None,
    )  # fmt: skip


async def labels_attack(writer: asyncssh.SSHWriter[bytes], enc: FrameEncoder) -> None:
    for frame_no in range(40):  # ~6 MiB of label text in all: past the 4 MiB budget
        series = tuple(
            SeriesDecl(
                id=frame_no * 50 + i,
                name="evil_labels",
                type="gauge",
                help="h",
                labels=(
                    ("l0", os.urandom(1000).hex()),
                    ("l1", os.urandom(1000).hex()),
                    ("l2", os.urandom(1000).hex()),
                    ("i", str(frame_no * 50 + i)),
                ),
            )
            for i in range(50)
        )
        writer.write(enc.encode(Declare(series=series)))
        values = tuple((s.id, 1.0) for s in series)
        writer.write(enc.encode(Batch(seq=frame_no + 1, timestamp=time.time(), values=values)))
        await writer.drain()


async def partial_attack(writer: asyncssh.SSHWriter[bytes], enc: FrameEncoder) -> None:
    writer.write(struct.pack(">IBB", 4 * MIB - 16, 1, 3) + os.urandom(4 * MIB - 4096))
    await writer.drain()


def bomb_record() -> bytes:
    head = b"[" + b"[]," * (5 * MIB) + b"[]]"
    body = struct.pack(">qI", int(time.time() * 1000), len(head)) + head + bytes(8)
    return b"GR1" + zlib.compress(body, 9)


async def bomb_attack(writer: asyncssh.SSHWriter[bytes], enc: FrameEncoder) -> None:
    writer.write(enc.encode(Replay(seq=1, record=bomb_record())))
    await writer.drain()


async def churn_attack(writer: asyncssh.SSHWriter[bytes], enc: FrameEncoder) -> None:
    for start in range(0, 100_000, 1000):
        series = tuple(
            SeriesDecl(id=start + i, name="churn", type="gauge", help="h",
                       labels=(("i", str(start + i)),))
            for i in range(1000)
        )  # fmt: skip
        writer.write(enc.encode(Declare(series=series)))
        seq = start // 1000 * 2 + 1
        values = tuple((s.id, 1.0) for s in series)
        writer.write(enc.encode(Batch(seq=seq, timestamp=time.time(), values=values)))
        ids = tuple(s.id for s in series)
        writer.write(enc.encode(Batch(seq=seq + 1, timestamp=time.time(), values=(), removed=ids)))
        await writer.drain()


async def families_attack(
    writer: asyncssh.SSHWriter[bytes],
    enc: FrameEncoder,
    scrape: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """``scrape``: /metrics read between the steps (what keeps caches of the families)."""
    sid = seq = 0
    for round_ in range(20):
        series = tuple(
            SeriesDecl(id=sid + k, name=f"evil_r{round_}_f{k // 20}", type="gauge", help="h",
                       labels=(("i", str(k % 20)),))
            for k in range(2000)
        )  # fmt: skip
        sid += len(series)
        writer.write(enc.encode(Declare(series=series)))
        seq += 1
        values = tuple((s.id, 1.0) for s in series)
        writer.write(enc.encode(Batch(seq=seq, timestamp=time.time(), values=values)))
        await writer.drain()
        await asyncio.sleep(0.5)
        if scrape is not None:
            await scrape()
        seq += 1
        ids = tuple(s.id for s in series)
        writer.write(enc.encode(Batch(seq=seq, timestamp=time.time(), values=(), removed=ids)))
        await writer.drain()
        await asyncio.sleep(0.5)
        if scrape is not None:
            await scrape()


ATTACKS = {
    "labels": labels_attack,
    "partial": partial_attack,
    "bomb": bomb_attack,
    "churn": churn_attack,
    "families": families_attack,
}


def rss_mib(gw: GatewayProc) -> float:
    return gw.sample().rss_kib / 1024


def peak_mib(gw: GatewayProc) -> float:
    return gw.sample().peak_rss_kib / 1024


async def settled_rss(gw: GatewayProc, timeout: float = 60.0) -> float:
    """The gateway's RSS once its CPU time stops moving (it has worked through its input)."""
    deadline = time.monotonic() + timeout
    last = gw.sample().cpu_seconds
    while time.monotonic() < deadline:
        await asyncio.sleep(1.0)
        now = gw.sample().cpu_seconds
        if now - last < 0.05:
            break
        last = now
    return rss_mib(gw)


def honest_fresh(gw: GatewayProc, node: str) -> bool:
    for line in gw.metrics().splitlines():
        if line.startswith("gpurelay_node_last_seen_timestamp_seconds") and f'"{node}"' in line:
            return time.time() - float(line.split()[-1]) < 5
    return False


def promtool_clean(gw: GatewayProc) -> str:
    promtool = shutil.which("promtool")
    if promtool is None:
        return "promtool not installed"
    body = httpx.get(f"{gw.url}/metrics", timeout=10).content
    proc = subprocess.run(
        [promtool, "check", "metrics"], input=body, capture_output=True, timeout=60, check=False
    )
    ours = [
        line
        for line in (proc.stdout + proc.stderr).decode().splitlines()
        if line.startswith(("gpurelay_", "evil", "churn"))
    ]
    return "clean" if proc.returncode in (0, 3) and not ours else f"findings: {ours[:3]}"


async def run_attack(name: str, pki: Pki, gw: GatewayProc, nodes: int) -> None:
    before, peak_before = await settled_rss(gw), peak_mib(gw)

    async def scrape() -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            for path in ("/metrics", "/metrics?shard=0&shards=2"):
                (
                    await client.get(gw.url + path, headers={"Accept-Encoding": "gzip"})
                ).raise_for_status()

    attack = ATTACKS[name]
    if attack is families_attack:
        attack = functools.partial(families_attack, scrape=scrape)
    conns, tasks = [], []
    for k in range(nodes):
        conn = await connect(pki, gw, f"evil-{name}-{k}")
        writer, _, _ = await conn.open_session(subsystem=SUBSYSTEM, encoding=None)
        enc = FrameEncoder()
        writer.write(enc.encode(Hello(agent_version="0", node=f"evil-{name}-{k}")))
        conns.append(conn)
        tasks.append(asyncio.create_task(attack(writer, enc)))
    await asyncio.gather(*tasks, return_exceptions=True)
    await settled_rss(gw)  # the gateway has taken (or refused) what it was sent
    fresh = honest_fresh(gw, "honest-1")
    clean = promtool_clean(gw)  # /metrics built with the hostile nodes' series in it
    after = await settled_rss(gw)
    peak = peak_mib(gw)
    for conn in conns:
        conn.close()
    await asyncio.sleep(10.0)
    closed = await settled_rss(gw)
    print(
        f"{name:8} {nodes} hostile connections: gateway RSS {before:6.1f} -> {after:6.1f} MiB "
        f"({(after - before) / nodes:5.1f} MiB per connection; peak RSS "
        f"{peak_before:6.1f} -> {peak:6.1f}); {closed:6.1f} MiB 10 s after they closed "
        f"({closed - before:+.1f}); honest node fresh: {fresh}; /metrics {clean}"
    )


async def main_async(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        pki = make_pki(tmp)
        gw = GatewayProc(pki, tmp, log_level="warning")
        gw.start()
        agent = AgentProc(pki, tmp, "honest-1", gw, spool_dir=tmp / "spool")
        try:
            wait_until(gw.ready, 30, "gateway ready", alive=[gw])
            agent.start()
            wait_until(lambda: honest_fresh(gw, "honest-1"), 30, "honest node", alive=[gw])
            print(f"gateway with one honest agent: RSS {rss_mib(gw):.1f} MiB")
            for name in args.attacks:
                await run_attack(name, pki, gw, args.nodes)
        finally:
            agent.stop()
            gw.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=10, help="hostile connections per attack")
    parser.add_argument("--attacks", nargs="*", default=list(ATTACKS), choices=list(ATTACKS))
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
