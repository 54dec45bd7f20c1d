"""What the running agent holds: no module it does not need (aiohttp, grpc without a
kubelet), and its collections on one thread."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
import threading
from pathlib import Path

from edge_agent.app import Agent
from edge_agent.cli import _config, _parser
from harness.ports import free_ports

ROOT = Path(__file__).resolve().parents[2]


_AGENT_RUNS = r"""
import os, signal, sys, threading, time, urllib.request
from edge_agent.cli import main

url = f"http://127.0.0.1:{sys.argv[1]}/metrics"


def scrape_then_stop():
    for _ in range(300):
        try:
            if urllib.request.urlopen(url, timeout=2).status == 200:
                break
        except OSError:
            time.sleep(0.1)
    os.kill(os.getpid(), signal.SIGTERM)


threading.Thread(target=scrape_then_stop, daemon=True).start()
rc = main(["run", "--simulate", "1", "--listen", f"127.0.0.1:{sys.argv[1]}"])
heavy = ("aiohttp", "multidict", "yarl", "grpc", "prometheus_client")
print(rc, sorted({m.split(".")[0] for m in sys.modules} & set(heavy)))
"""


def test_the_running_agent_never_imports_aiohttp() -> None:
    """aiohttp alone is ~16 MB of the agent's RSS; the agent serves without it."""
    (port,) = free_ports(1)
    out = subprocess.run(
        [sys.executable, "-c", _AGENT_RUNS, str(port)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=False,
    )
    assert out.stdout.strip() == "0 []", out.stderr[-2000:]


async def test_collections_run_on_one_thread_of_their_own() -> None:
    """asyncio.to_thread's shared pool handed them to whichever thread was idle (two
    collector threads in bench/agent_binary.py, each with its own malloc arena)."""
    (port,) = free_ports(1)
    cfg = _config(_parser().parse_args(["run", "--simulate", "1", "--listen", f"127.0.0.1:{port}"]))
    agent = Agent(dataclasses.replace(cfg, interval_seconds=0.02))
    await agent.startup()
    assert agent.pipeline is not None
    collect = agent.pipeline.collection.collect
    names: list[str] = []

    def recording():  # type: ignore[no-untyped-def]
        names.append(threading.current_thread().name)
        return collect()

    agent.pipeline.collection.collect = recording  # type: ignore[method-assign]
    busy = [asyncio.to_thread(lambda: None) for _ in range(4)]  # others use the shared pool
    task = asyncio.create_task(agent.run())
    await asyncio.gather(*busy)
    while len(names) < 12:
        await asyncio.sleep(0.02)
    agent.stop.set()
    await task
    await agent.shutdown()
    assert len(set(names)) == 1 and names[0].startswith("collect"), names
