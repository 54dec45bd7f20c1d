"""What a collection needs, opened at startup and closed at shutdown: the backend (real
NVML, or the simulator playing a machine profile, said loudly) and the pipeline built on
it (GPU enumeration, XID watcher, attribution, the device, process and allocation
collectors, and the deadline guard they share).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from edge_agent.attribute import Attributor
from edge_agent.attribute.pod_metadata import PodMetadata, api_server_fetch
from edge_agent.attribute.pod_resources import PodDevices
from edge_agent.catalog import load_counters
from edge_agent.collect import Collector
from edge_agent.collect_alloc import AllocationCollector
from edge_agent.collect_device import DeviceCollector
from edge_agent.collect_process import ProcessCollector
from edge_agent.config import GPU_MEMORY_UNITS_MIB, AgentConfig, resolve_node_name
from edge_agent.degraded import Degraded
from edge_agent.errors import ConfigError, NvmlUnavailable
from edge_agent.nvml.backend import NvmlLib, open_real, text
from edge_agent.nvml.devices import GpuDevice, enumerate_gpus
from edge_agent.nvml.guard import GpuGuard
from edge_agent.sim.profiles import DEFAULT_PROFILE, profile_named
from edge_agent.xid import XidWatcher

log = logging.getLogger("edge_agent")

SIMULATION_BANNER = (
    "*** SIMULATED GPUs: machine profile {profile} ({summary}), {n} simulated GPU(s), "
    "seed {seed}{mig}. These values are synthetic, not read from hardware; "
    'gpurelay_agent_info{{backend="simulated"}} says so. ***'
)


@dataclass
class Pipeline:
    """Everything a collection needs, opened at startup and closed at shutdown."""

    node: str
    backend: str
    lib: NvmlLib
    collection: Collector
    xid: XidWatcher
    attributor: Attributor
    driver_version: str = ""
    scratch: tempfile.TemporaryDirectory[str] | None = None
    on_close: list[Callable[[], None]] = field(default_factory=list)  # last first

    def close(self) -> None:
        self.xid.stop()
        self.attributor.close()
        for close in reversed(self.on_close):
            with suppress(Exception):
                close()
        self.collection.close()
        with suppress(Exception):
            self.lib.nvmlShutdown()
        if self.scratch is not None:
            self.scratch.cleanup()


@dataclass
class Backend:
    lib: NvmlLib
    name: str
    cfg: AgentConfig  # with attribution paths pointed at the fake host when simulating
    scratch: tempfile.TemporaryDirectory[str] | None = None
    on_close: list[Callable[[], None]] = field(default_factory=list)  # the simulated kubelet


def open_backend(cfg: AgentConfig) -> Backend:
    if not cfg.simulate.enabled:
        return Backend(open_real(), "nvml", cfg)
    from edge_agent.sim import host as simhost
    from edge_agent.sim.nvml import SimulatedNvml

    sim_cfg = cfg.simulate
    machine = profile_named(sim_cfg.profile or DEFAULT_PROFILE)
    gpus = sim_cfg.gpus or machine.gpus
    pids = None
    scratch = None
    if sim_cfg.fake_host:
        scratch = tempfile.TemporaryDirectory(prefix="edge-agent-simhost-")
        pids = simhost.default_pids(gpus * sim_cfg.processes_per_gpu, sim_cfg.seed)
        host = simhost.build(Path(scratch.name), pids, sim_cfg.seed)
        attribution = simhost.attribution_config(host, cfg.attribution)
        cfg = dataclasses.replace(cfg, attribution=attribution)
    sim = SimulatedNvml(
        gpus,
        seed=sim_cfg.seed,
        mig=sim_cfg.mig,
        processes_per_gpu=sim_cfg.processes_per_gpu,
        profile=machine if sim_cfg.profile else None,
        pids=pids,
    )
    sim.nvmlInit()
    stop_kubelet = None
    if sim_cfg.fake_host:
        from edge_agent.sim import kubelet as simkubelet

        cfg, stop_kubelet = simkubelet.attach(cfg, host, sim)
    mig_gpus = sim.profile.mig_gpus
    mig = f", MIG on GPU {', '.join(map(str, mig_gpus))}" if mig_gpus else ""
    banner = SIMULATION_BANNER.format(
        profile=machine.name, summary=machine.summary, n=gpus, seed=sim_cfg.seed, mig=mig
    )
    if cfg.log_format == "json":  # every line of stderr is then a JSON object
        log.warning("%s", banner)
    else:
        print(banner, file=sys.stderr, flush=True)
    if scratch is not None:
        log.info("simulated processes live in a fake host tree at %s", scratch.name)
    return Backend(sim, "simulated", cfg, scratch, [stop_kubelet] if stop_kubelet else [])


def build_pipeline(
    backend_: Backend,
    *,
    clock: Callable[[], float] = time.time,
    timer: Callable[[], float] = time.perf_counter,
) -> Pipeline:
    cfg, lib, backend = backend_.cfg, backend_.lib, backend_.name
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
    a = cfg.attribution
    attributor = Attributor(
        proc_root=a.proc_root,
        container_log_dir=a.container_log_dir,
        pod_log_dir=a.pod_log_dir,
        runtime_sockets=a.runtime_sockets,
        cache_ttl=a.cache_ttl_seconds,
        api_timeout=a.api_timeout_seconds,
    )
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
    collection = Collector(
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
    log.info(
        "node %s: %d GPU(s) via %s, driver %s: %s",
        node,
        len(devices),
        backend,
        driver,
        ", ".join(f"{d.index}={d.name}{' (MIG)' if d.mig else ''}" for d in devices) or "none",
    )
    on_close = [
        *backend_.on_close,
        *([pods.close] if pods is not None else []),
        *([metadata.stop] if metadata is not None else []),
    ]
    return Pipeline(
        node, backend, lib, collection, xid, attributor, driver, backend_.scratch, on_close
    )


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
