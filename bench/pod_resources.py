"""The kubelet pod-resources path: List latency, and what it costs the agent in memory.

1. List over gRPC on a Unix socket against a real PodResourcesServer (the proto the kubelet
   speaks) holding ``--pods`` pods with one GPU container each: wall time of the client's
   ``List`` (connection kept open, as the agent keeps it) and of the agent's refresh
   (List + resolving the device ids against 8 GPUs).
2. Agent RSS, same run, same settings (``edge-agent run --simulate 8``, 8 processes per GPU,
   no fake host tree, so that only the socket differs):
   - ``--before REV`` (repeatable): the agent of that commit, e.g. the one before
     pod-resources (179f30d) and the one that added it (553e6e0)
   - ``no socket``: this tree on a box without the kubelet's socket (outside Kubernetes)
   - ``kubelet``: this tree reading a kubelet stand-in served by this bench process

Run: .venv/bin/python bench/pod_resources.py [--pods 110] [--calls 500] [--before REV ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edge_agent.attribute.pod_resources import PodDevices
from edge_agent.nvml.devices import enumerate_gpus
from edge_agent.podresources.client import PodResourcesClient
from edge_agent.podresources.model import ContainerDevices
from edge_agent.sim.nvml import SimulatedNvml
from edge_agent.sim.pod_resources_server import PodResourcesServer
from harness.ports import free_ports
from harness.process import ROOT, Process, clean_env
from harness.waiting import wait_until

GPUS = 8


def kubelet_rows(pods: int, uuids: list[str]) -> list[ContainerDevices]:
    return [
        ContainerDevices(
            namespace=f"ns-{i % 7}",
            pod=f"pod-{i}",
            container="main",
            resource="nvidia.com/gpu",
            device_ids=(f"{uuids[i % len(uuids)]}::{i // len(uuids)}",),
        )
        for i in range(pods)
    ]


def _ms(samples: list[float]) -> str:
    s = sorted(samples)
    return (
        f"median {statistics.median(s) * 1000:6.3f} ms   "
        f"p95 {s[int(len(s) * 0.95) - 1] * 1000:6.3f} ms   (n={len(s)})"
    )


def list_latency(directory: Path, pods: int, calls: int) -> None:
    sim = SimulatedNvml(GPUS)
    sim.nvmlInit()
    devices, _ = enumerate_gpus(sim)
    sock = directory / "kubelet.sock"
    server = PodResourcesServer(sock, kubelet_rows(pods, [d.uuid for d in devices])).start()
    client = PodResourcesClient(sock, timeout=1.0)
    now = [0.0]
    source = PodDevices(sock, devices, ttl=1.0, clock=lambda: now[0])
    try:
        client.list()  # connect
        listed = []
        for _ in range(calls):
            start = time.perf_counter()
            client.list()
            listed.append(time.perf_counter() - start)
        refreshed = []
        for _ in range(calls):
            now[0] += 1.0
            start = time.perf_counter()
            source.current()
            refreshed.append(time.perf_counter() - start)
    finally:
        client.close()
        source.close()
        server.stop()
    print(f"setup: {pods} pods on {GPUS} GPUs, one container and one GPU replica each")
    print(f"{'List (client, socket kept open)':<36} {_ms(listed)}")
    print(f"{'refresh (List + resolve ids)':<36} {_ms(refreshed)}")


def _rss(argv: list[str], cwd: Path, env: dict[str, str], log: Path, port: int) -> float:
    url = f"http://127.0.0.1:{port}/metrics"
    agent = Process("agent", argv, log, env)
    if cwd == ROOT:
        agent.start()
    else:  # another tree: `python -m edge_agent` imports from the working directory
        _start_in(agent, cwd)
    try:
        wait_until(
            lambda: httpx.get(url, timeout=1).status_code == 200,
            60,
            "the agent's /metrics",
            poll=0.1,
            alive=(agent,),
        )
        for _ in range(20):  # let it collect and serve for a while
            httpx.get(url, timeout=2)
            time.sleep(0.25)
        return agent.sample().rss_kib / 1024
    finally:
        agent.stop()


def _start_in(agent: Process, cwd: Path) -> None:
    with agent.log.open("ab") as log:
        agent.proc = subprocess.Popen(
            agent.argv, cwd=cwd, env=agent.env, stdout=log, stderr=subprocess.STDOUT
        )


def agent_rss(directory: Path, revisions: list[str]) -> None:
    sim = SimulatedNvml(GPUS)  # the agent's simulator: same seed, same UUIDs
    sim.nvmlInit()
    uuids = [d.uuid for d in enumerate_gpus(sim)[0]]
    base_env = {
        **clean_env("EDGE_AGENT_"),
        "EDGE_AGENT_SIMULATE_PROCESSES_PER_GPU": "8",
        "EDGE_AGENT_SIMULATE_FAKE_HOST": "false",
    }
    cases: list[tuple[str, Path, dict[str, str]]] = []
    for rev in revisions:
        tree = directory / f"tree-{rev}"
        tree.mkdir()
        archive = subprocess.run(
            ["git", "archive", rev], cwd=ROOT, check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        cases.append((f"at {rev}, no socket", tree, {**base_env, "PYTHONPATH": str(tree)}))
    absent = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
    assert not absent.exists(), "this box has a kubelet: the no-socket case would not be one"
    cases.append(("no socket (outside Kubernetes)", ROOT, base_env))
    sock = directory / "kubelet.sock"
    server = PodResourcesServer(sock, kubelet_rows(32, uuids)).start()
    env = {**base_env, "EDGE_AGENT_ATTRIBUTION_POD_RESOURCES_SOCKET": str(sock)}
    cases.append(("kubelet (pod labels, allocations)", ROOT, env))
    try:
        for n, (name, cwd, case_env) in enumerate(cases):
            (port,) = free_ports(1)
            argv = [sys.executable, "-m", "edge_agent", "run", "--simulate", str(GPUS)]
            argv += ["--listen", f"127.0.0.1:{port}", "--interval", "0.5"]
            log = directory / f"agent-{n}.log"
            mb = _rss(argv, cwd, case_env, log, port)
            print(f"{'agent RSS, ' + name:<52} {mb:6.1f} MB")
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=110)  # the kubelet's default max pods
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument(
        "--before", action="append", default=[], help="a git revision to measure the RSS of too"
    )
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]} on {os.uname().machine}, {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory(prefix="podres-", dir="/tmp") as tmp:
        list_latency(Path(tmp), args.pods, args.calls)
        agent_rss(Path(tmp), args.before)


if __name__ == "__main__":
    main()
