"""What a collection needs, built at startup on the backend :mod:`edge_agent.backend`
opened, and closed at shutdown: GPU enumeration, XID watcher, attribution, the device,
process and allocation collectors, and the deadline guard they share (NVML's), or a
Jetson's device and process collectors.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass, field

from edge_agent.attribute import Attributor
from edge_agent.attribute.pod_metadata import PodMetadata, api_server_fetch
from edge_agent.attribute.pod_resources import PodDevices
from edge_agent.backend import Backend
from edge_agent.catalog import load_counters
from edge_agent.collect import Collector, DeviceSource, ProcessSource
from edge_agent.collect_alloc import AllocationCollector
from edge_agent.collect_device import DeviceCollector
from edge_agent.collect_process import ProcessCollector
from edge_agent.config import GPU_MEMORY_UNITS_MIB, AgentConfig, resolve_node_name
from edge_agent.degraded import Degraded
from edge_agent.errors import ConfigError, NvmlUnavailable
from edge_agent.jetson.collector import JetsonDeviceCollector
from edge_agent.jetson.files import JetsonRoots
from edge_agent.jetson.processes import JetsonProcessCollector
from edge_agent.nvml.backend import NvmlLib, text
from edge_agent.nvml.devices import GpuDevice, enumerate_gpus
from edge_agent.nvml.guard import GpuGuard
from edge_agent.xid import XidWatcher

log = logging.getLogger("edge_agent")


@dataclass
class Pipeline:
    """Everything a collection needs, opened at startup and closed at shutdown."""

    node: str
    opened: Backend  # closed last: the simulated kubelet, NVML, the temporary tree
    collection: Collector
    xid: XidWatcher | None  # None on a Jetson (NVML's XID events only)
    attributor: Attributor
    driver_version: str = ""
    on_close: list[Callable[[], None]] = field(default_factory=list)  # its own; last first

    @property
    def backend(self) -> str:
        return self.opened.name

    @property
    def lib(self) -> NvmlLib | None:  # None on a Jetson
        return self.opened.lib

    @property
    def scratch(self) -> tempfile.TemporaryDirectory[str] | None:
        return self.opened.scratch

    def close(self) -> None:
        if self.xid is not None:
            self.xid.stop()
        self.attributor.close()
        for close in reversed(self.on_close):
            with suppress(Exception):
                close()
        self.collection.close()  # GPM samples, before NVML shuts down
        self.opened.close()


def build_pipeline(
    backend_: Backend,
    *,
    clock: Callable[[], float] = time.time,
    timer: Callable[[], float] = time.perf_counter,
) -> Pipeline:
    """The collectors on ``backend_``; a failure gives the backend back (its temporary
    tree, simulated kubelet, NVML) before it is raised."""
    try:
        if backend_.jetson is not None:
            return _jetson_pipeline(backend_, backend_.jetson, clock=clock, timer=timer)
        return _nvml_pipeline(backend_, clock=clock, timer=timer)
    except BaseException:
        backend_.close()
        raise


def _nvml_pipeline(
    backend_: Backend, *, clock: Callable[[], float], timer: Callable[[], float]
) -> Pipeline:
    cfg, lib, backend = backend_.cfg, backend_.lib, backend_.name
    assert lib is not None
    node = resolve_node_name(cfg.node_name, os.environ)
    counters = load_counters(cfg.counters_file, cfg.dcgm_naming)  # type: ignore[arg-type]
    try:
        driver = text(lib.nvmlSystemGetDriverVersion())
        devices, problems = enumerate_gpus(lib)
    except Exception as exc:
        raise NvmlUnavailable(f"NVML answered but GPUs cannot be listed: {exc}") from exc
    degraded = Degraded()
    for problem in problems:  # logged once there, and shown as gpurelay_agent_degraded
        degraded.report(problem.gpu, problem.part, problem.reason)
    guard = GpuGuard()  # its worker thread: a hung NVML call stalls that GPU, not the cycle
    deadline = min(cfg.nvml_deadline_seconds, cfg.interval_seconds)
    xid = XidWatcher(lib, devices)
    attributor = _attributor(cfg)
    device = DeviceCollector(
        lib,
        devices,
        counters,
        node=node,
        driver_version=driver,
        xid=xid,
        node_label=cfg.node_label,
        naming=cfg.dcgm_naming,  # type: ignore[arg-type]
        degraded=degraded,
        guard=guard,
        deadline_seconds=deadline,
        xid_window_ms=cfg.xid_count_window_ms,
        clock_events_window_ms=cfg.clock_events_count_window_ms,
    )
    process = ProcessCollector(
        lib,
        devices,
        attributor,
        node=node,
        degraded=degraded,
        guard=guard,
        deadline_seconds=deadline,
    )
    pods, alloc = _pod_resources(cfg, lib, devices, node, lambda: process.pod_gpus)
    metadata = _pod_metadata(cfg, node)
    if pods is not None:
        of_pods = pods.device_labels
        device.pod_labels = (
            of_pods if metadata is None else lambda uuid, gi: metadata.with_pod(of_pods(uuid, gi))
        )
    if metadata is not None:
        process.pod_metadata = metadata.labels
    collection = _collection(
        cfg,
        node,
        backend=backend,
        device=device,
        process=process,
        attributor=attributor,
        clocks=(clock, timer),
        alloc=alloc,
    )
    log.info(
        "node %s: %d GPU(s) via %s, driver %s: %s",
        node,
        len(devices),
        backend,
        driver,
        ", ".join(f"{d.index}={d.name}{' (MIG)' if d.mig else ''}" for d in devices) or "none",
    )
    on_close = [
        *([pods.close] if pods is not None else []),
        *([metadata.stop] if metadata is not None else []),
    ]
    return Pipeline(node, backend_, collection, xid, attributor, driver, on_close)


def _collection(
    cfg: AgentConfig,
    node: str,
    *,
    backend: str,
    device: DeviceSource,
    process: ProcessSource,
    attributor: Attributor,
    clocks: tuple[Callable[[], float], Callable[[], float]],
    alloc: AllocationCollector | None = None,
) -> Collector:
    clock, timer = clocks
    return Collector(
        node=node,
        node_label=cfg.node_label,
        backend=backend,
        device=device,
        process=process,
        attribution_errors=lambda: dict(attributor.errors()),
        process_interval=cfg.process_interval_seconds,
        clock=clock,
        timer=timer,
        alloc=alloc,
    )


def _attributor(cfg: AgentConfig) -> Attributor:
    a = cfg.attribution
    return Attributor(
        proc_root=a.proc_root,
        container_log_dir=a.container_log_dir,
        pod_log_dir=a.pod_log_dir,
        runtime_sockets=a.runtime_sockets,
        cache_ttl=a.cache_ttl_seconds,
        api_timeout=a.api_timeout_seconds,
    )


def _jetson_pipeline(
    backend_: Backend,
    roots: JetsonRoots,
    *,
    clock: Callable[[], float],
    timer: Callable[[], float],
) -> Pipeline:
    """A Jetson's: its device and process collectors on the board's files (no NVML, no XID
    watcher, no pod-resources allocation: docs/jetson.md)."""
    cfg = backend_.cfg
    node = resolve_node_name(cfg.node_name, os.environ)
    if cfg.counters_file is not None:
        log.warning(
            "counters_file %s is not used on a Jetson: its series are fixed (docs/jetson.md)",
            cfg.counters_file,
        )
    device = JetsonDeviceCollector(
        sys_root=roots.sys_root,
        proc_root=roots.proc_root,
        etc_root=roots.etc_root,
        var_root=roots.var_root,
        node=node,
        node_label=cfg.node_label,
        naming=cfg.dcgm_naming,  # type: ignore[arg-type]
    )
    attributor = _attributor(cfg)
    process = JetsonProcessCollector(
        roots.sys_root, attributor, node=node, uuid=device.uuid, degraded=device.degraded
    )
    metadata = _pod_metadata(cfg, node)
    if metadata is not None:
        process.pod_metadata = metadata.labels
    collection = _collection(
        cfg,
        node,
        backend=backend_.name,
        device=device,
        process=process,
        attributor=attributor,
        clocks=(clock, timer),
    )
    b = device.board
    log.info(
        "node %s: %s (%s, L4T %s, JetPack %s) via %s, GPU %s",
        node,
        b.module_name or "an unknown board",
        b.soc or "unknown SoC",
        b.l4t or "unknown",
        b.jetpack or "unknown",
        backend_.name,
        device.gpu_path,
    )
    for missing in b.missing:
        log.warning("Jetson board: %s", missing)
    on_close = [metadata.stop] if metadata is not None else []
    return Pipeline(node, backend_, collection, None, attributor, b.l4t, on_close)


def _pod_metadata(cfg: AgentConfig, node: str) -> PodMetadata | None:
    """The pods' allow-listed labels and annotations, read in the background, if listed."""
    k = cfg.kubernetes
    if not k.enabled:
        return None
    try:
        fetch = api_server_fetch(
            node,
            server=k.api_server,
            token_file=k.token_file,
            ca_file=k.ca_file,
            timeout=k.timeout_seconds,
        )
    except (ValueError, OSError) as exc:  # no API server to ask, an unreadable CA
        raise ConfigError(f"kubernetes.pod_labels/pod_annotations: {exc}") from exc
    metadata = PodMetadata(
        k.pod_labels, k.pod_annotations, fetch, refresh_seconds=k.refresh_seconds
    )
    metadata.start()
    return metadata


def _pod_resources(
    cfg: AgentConfig,
    lib: NvmlLib,
    devices: list[GpuDevice],
    node: str,
    pod_gpus: Callable[[], Mapping[tuple[str, str, str], set[str]]],
) -> tuple[PodDevices | None, AllocationCollector | None]:
    """The kubelet's pod-resources (pod labels, ACK allocation metrics), unless turned off."""
    a = cfg.attribution
    if a.pod_resources_socket is None:
        return None, None
    pods = PodDevices(
        a.pod_resources_socket,
        devices,
        ttl=a.pod_resources_ttl_seconds,
        timeout=a.pod_resources_timeout_seconds,
        gpu_resources=a.gpu_resource_names,
        memory_resources=a.gpu_memory_resource_names,
        old_label_names=a.old_pod_label_names,
    )
    unit = GPU_MEMORY_UNITS_MIB[a.gpu_memory_unit]
    alloc = AllocationCollector(
        lib, devices, pods, node=node, memory_unit_mib=unit, pod_gpus=pod_gpus
    )
    return pods, alloc
