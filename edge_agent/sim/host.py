"""A fake host for simulated GPUs: ``/proc/<pid>/cgroup`` and kubelet log links.

Simulated processes need somewhere to be attributed *from*. This writes a small tree
that looks like a real edge node running a mix of Kubernetes pods (containerd and
CRI-O, cgroup v2), a plain Docker container (cgroup v1) and host processes, so the
whole attribution path runs for real in the demo, tests and benchmarks. Only used with
``--simulate``; the tree lives in a temporary directory and says so in its README.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from edge_agent.config import AttributionConfig

_WORKLOADS = (
    ("inference", "ml-serving", "triton"),
    ("trainer", "research", "pytorch"),
    ("video-analytics", "edge-apps", "deepstream"),
    ("embedder", "ml-serving", "encoder"),
)


@dataclass(frozen=True, slots=True, kw_only=True)
class FakeHost:
    root: Path
    proc_root: Path
    container_log_dir: Path
    pod_log_dir: Path
    pids: tuple[int, ...]
    # pid -> (namespace, pod, container) of the processes that run in Kubernetes pods
    pods: Mapping[int, tuple[str, str, str]] = field(default_factory=dict)


def attribution_config(host: FakeHost, base: AttributionConfig) -> AttributionConfig:
    """``base`` pointed at the fake tree (and at no container runtime socket, and no
    kubelet: :mod:`edge_agent.sim.kubelet` can add one)."""
    return replace(
        base,
        proc_root=host.proc_root,
        container_log_dir=host.container_log_dir,
        pod_log_dir=host.pod_log_dir,
        runtime_sockets=(),
        pod_resources_socket=None,
    )


def _hex(*key: object, n: int = 64) -> str:
    return hashlib.sha256(":".join(map(str, key)).encode()).hexdigest()[:n]


def _uid(*key: object) -> str:
    h = _hex("uid", *key, n=32)
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def default_pids(count: int, seed: int = 0) -> tuple[int, ...]:
    return tuple(4000 + 37 * i + seed % 7 for i in range(count))


def build(root: Path, pids: Sequence[int], seed: int = 0) -> FakeHost:
    """Write the tree under ``root``; pid i gets layout i % 4 (pod, pod, docker, host)."""
    proc = root / "proc"
    logs = root / "var" / "log" / "containers"
    pods = root / "var" / "log" / "pods"
    in_pods: dict[int, tuple[str, str, str]] = {}
    for d in (proc, logs, pods):
        d.mkdir(parents=True, exist_ok=True)
    (root / "README").write_text(
        "Simulated host tree written by edge-gpu-relay --simulate. Not a real /proc.\n"
    )
    for i, pid in enumerate(pids):
        pdir = proc / str(pid)
        pdir.mkdir(exist_ok=True)
        cid = _hex("container", seed, pid)
        pod_name, namespace, container = _WORKLOADS[(i // 4) % len(_WORKLOADS)]
        pod = f"{pod_name}-{_hex('pod', seed, i, n=5)}"
        uid = _uid(seed, i)
        kind = i % 4
        if kind in (0, 1):
            qos = "burstable" if kind == 0 else "besteffort"
            scope = "cri-containerd" if kind == 0 else "crio"
            cgroup = (
                f"0::/kubepods.slice/kubepods-{qos}.slice/kubepods-{qos}-pod"
                f"{uid.replace('-', '_')}.slice/{scope}-{cid}.scope\n"
            )
            (logs / f"{pod}_{namespace}_{container}-{cid}.log").touch()
            cdir = pods / f"{namespace}_{pod}_{uid}" / container
            cdir.mkdir(parents=True, exist_ok=True)
            comm = "python3" if kind == 0 else "tritonserver"
            in_pods[pid] = (namespace, pod, container)
        elif kind == 2:
            cgroup = "".join(
                f"{n}:{c}:/docker/{cid}\n"
                for n, c in enumerate(("memory", "cpu,cpuacct", "devices", "pids"), start=1)
            )
            comm = "ffmpeg"
        else:
            cgroup = "0::/system.slice/gpu-burn.service\n"
            comm = "gpu_burn"
        (pdir / "cgroup").write_text(cgroup)
        (pdir / "comm").write_text(comm + "\n")
    return FakeHost(
        root=root,
        proc_root=proc,
        container_log_dir=logs,
        pod_log_dir=pods,
        pids=tuple(pids),
        pods=in_pods,
    )
