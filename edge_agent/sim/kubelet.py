"""A simulated kubelet for ``--simulate``: the fake host's pods, served over pod-resources.

Which pod holds which simulated GPU follows from what runs where: every process of the
fake host that lives in a Kubernetes pod (:mod:`edge_agent.sim.host`) is allocated the GPU
or MIG instance NVML (the simulator) shows it running on, so pod labels, allocations and
per-process series agree. Two modes, as real nodes have them:

- ``nvidia``: NVIDIA's device plugin. ``nvidia.com/gpu`` with the GPU's UUID; a GPU that
  several pods share gets time-slicing replica ids (``<uuid>::<n>``); a MIG instance is
  ``nvidia.com/mig-<profile>`` with its MIG UUID.
- ``gpushare``: ACK GPU sharing. ``aliyun.com/gpu-mem`` in GiB units (``<uuid>-_-<n>``),
  as many as cover the process's memory; MIG instances as with ``nvidia``.

The answer is served by a real gRPC server (:class:`PodResourcesServer`) on a Unix socket
in the fake host's directory, so the agent reads it through the same client and proto as
on a node. Enabled with ``[simulate] pod_resources`` or ``--simulate-pod-resources``.
"""

from __future__ import annotations

import math
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from edge_agent.config import AgentConfig
from edge_agent.nvml.backend import Handle, NvmlLib
from edge_agent.nvml.devices import GpuDevice, MigInstance, enumerate_gpus
from edge_agent.podresources.model import ContainerDevices
from edge_agent.sim.host import FakeHost

GIB = 1 << 30
_SUN_PATH_MAX = 100  # a Unix socket path must fit in sockaddr_un (108 bytes with the NUL)


def _pids_on(lib: NvmlLib, handles: tuple[Handle, ...]) -> dict[int, int]:
    """pid -> used memory (bytes) of the processes on ``handles`` (a GPU, or the compute
    instances of one GPU instance); the _v2 calls, which every driver since R450 has."""
    found: dict[int, int] = {}
    for handle in handles:
        for listing in (
            lib.nvmlDeviceGetComputeRunningProcesses_v2(handle),
            lib.nvmlDeviceGetGraphicsRunningProcesses_v2(handle),
        ):
            for p in listing:
                found[int(p.pid)] = max(found.get(int(p.pid), 0), int(p.usedGpuMemory or 0))
    return found


def rows(host: FakeHost, lib: NvmlLib, mode: str) -> list[ContainerDevices]:
    """What the kubelet of ``host`` would list, in ``mode`` (``nvidia`` or ``gpushare``)."""
    devices, _problems = enumerate_gpus(lib)
    out: list[ContainerDevices] = []
    for dev in devices:
        places: list[tuple[MigInstance | None, tuple[Handle, ...]]] = [(None, (dev.handle,))]
        if dev.mig:
            places = [(m, m.handles or (m.handle,)) for m in dev.mig]
        next_unit = 0
        for mig, handles in places:
            running = _pids_on(lib, handles)
            owners = [(host.pods[p], used) for p, used in sorted(running.items()) if p in host.pods]
            for n, (owner, used) in enumerate(owners):
                resource, ids = _allocation(
                    dev, mig, mode, replica=n, sharing=len(owners), used=used, unit=next_unit
                )
                if resource == "aliyun.com/gpu-mem":
                    next_unit += len(ids)
                out.append(
                    ContainerDevices(
                        namespace=owner[0],
                        pod=owner[1],
                        container=owner[2],
                        resource=resource,
                        device_ids=ids,
                    )
                )
    return out


def _allocation(
    dev: GpuDevice,
    mig: MigInstance | None,
    mode: str,
    *,
    replica: int,
    sharing: int,
    used: int,
    unit: int,
) -> tuple[str, tuple[str, ...]]:
    """The resource and device ids of the ``replica``-th of ``sharing`` pods on a GPU or
    MIG instance; gpushare memory units are numbered per GPU from ``unit``."""
    if mig is None and mode == "gpushare":
        units = max(1, math.ceil(used / GIB))
        return "aliyun.com/gpu-mem", tuple(f"{dev.uuid}-_-{u}" for u in range(unit, unit + units))
    resource, uuid = ("nvidia.com/gpu", dev.uuid)
    if mig is not None:
        resource, uuid = (f"nvidia.com/mig-{mig.profile}", mig.uuid)
    return resource, (f"{uuid}::{replica}" if sharing > 1 else uuid,)


def start(host: FakeHost, lib: NvmlLib, mode: str) -> tuple[Path, Callable[[], None]]:
    """Serve ``rows(host, lib, mode)``; returns the socket and a function that stops it."""
    from edge_agent.sim.pod_resources_server import PodResourcesServer  # imports grpc

    directory = host.root / "var" / "lib" / "kubelet" / "pod-resources"
    own_dir = len(str(directory / "kubelet.sock")) > _SUN_PATH_MAX
    if own_dir:  # a deep temporary directory: the socket goes somewhere shorter
        directory = Path(tempfile.mkdtemp(prefix="simkubelet-"))
    directory.mkdir(parents=True, exist_ok=True)
    server = PodResourcesServer(directory / "kubelet.sock", rows(host, lib, mode)).start()

    def stop() -> None:
        server.stop()
        if own_dir:
            shutil.rmtree(directory, ignore_errors=True)

    return server.socket, stop


def attach(
    cfg: AgentConfig, host: FakeHost, lib: NvmlLib
) -> tuple[AgentConfig, Callable[[], None] | None]:
    """Start the simulated kubelet when ``cfg.simulate.pod_resources`` asks for one, and
    point ``cfg`` at its socket; returns the config and the function that stops it."""
    mode = cfg.simulate.pod_resources
    if not mode:
        return cfg, None
    socket, stop = start(host, lib, mode)
    attribution = replace(cfg.attribution, pod_resources_socket=socket)
    return replace(cfg, attribution=attribution), stop
