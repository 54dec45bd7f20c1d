"""Device collector: dcgm-exporter fields for every GPU and MIG instance.

Which fields are read is decided by the counters CSV; where each comes from is
:mod:`edge_agent.fields`. A field that fails degrades that one series; a GPU that is
lost degrades that GPU; neither stops the cycle. The profiling fields come from NVML GPM
(:mod:`edge_agent.nvml.gpm`) on GPUs that have it; where no GPU has it, they are reported
unsupported once, with the reason, and never asked for again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import pynvml

from edge_agent.catalog import CounterSpec
from edge_agent.degraded import Degraded
from edge_agent.fields import (
    DRIVER_LABELS,
    LABEL_SOURCES,
    NO_SOURCE_REASONS,
    SOURCES,
    XID_FIELDS,
    Carryover,
    FieldSource,
    NoValueYet,
    Probe,
)
from edge_agent.health import DEFAULT_WINDOW_MS, HealthHistory
from edge_agent.nvml.backend import NvmlLib
from edge_agent.nvml.devices import GpuDevice
from edge_agent.nvml.gpm import GpmStreams, entity_key
from edge_agent.nvml.guard import GpuGuard, Stalled
from edge_agent.xid import XidWatcher
from gpurelay.model import Family, GpuInventory, Labels, SampleSink
from gpurelay.naming import DEFAULT_NAMING, DRIVER_LABEL, Naming

log = logging.getLogger(__name__)

# Errors that mean "this GPU cannot be read at all right now".
_GPU_FATAL = (pynvml.NVMLError_GpuIsLost, pynvml.NVMLError_ResetRequired)


@dataclass(frozen=True, slots=True)
class _Active:
    spec: CounterSpec
    source: FieldSource


class DeviceCollector:
    name = "device"

    def __init__(
        self,
        lib: NvmlLib,
        devices: Sequence[GpuDevice],
        counters: Sequence[CounterSpec],
        *,
        node: str,
        driver_version: str,
        xid: XidWatcher | None = None,
        node_label: str = "Hostname",
        naming: Naming = DEFAULT_NAMING,
        degraded: Degraded | None = None,
        guard: GpuGuard | None = None,
        deadline_seconds: float = 5.0,
        xid_window_ms: int = DEFAULT_WINDOW_MS,
        clock_events_window_ms: int = DEFAULT_WINDOW_MS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._lib = lib
        self._clock = clock  # monotonic: the windows of the DCGM_EXP_* series
        self.degraded = degraded or Degraded()
        # The GPUs are read in the guard's worker thread, each for at most deadline_seconds:
        # a hung NVML call leaves that GPU out (stalled), the others are still published.
        self.guard = guard or GpuGuard()
        self.deadline_seconds = deadline_seconds
        self._lock = threading.Lock()  # the state below is updated from the GPUs' threads
        self._devices = list(devices)
        self._node = node
        self._node_label = node_label  # Hostname or hostname (AgentConfig.node_label)
        self._xid = xid
        # Pod labels of a GPU or MIG instance (uuid, GPU instance id): the app sets this to
        # PodDevices.device_labels on a Kubernetes node (edge_agent.attribute.pod_resources).
        self.pod_labels: Callable[[str, int | None], Labels] = lambda _uuid, _gi: ()
        self.unsupported: dict[str, str] = {}
        self.errors: Counter[tuple[str, str]] = Counter()
        self._skip: set[tuple[str, str]] = set()  # (gpu uuid, field) NOT_SUPPORTED there
        self._lost: dict[str, str] = {}
        self._active: list[_Active] = []
        label_fields: list[str] = []
        # The driver label on every device series: as the counters file names it, else as
        # the scheme does (dcgm-exporter 4.9: DCGM_FI_SYSTEM_DRIVER_VERSION).
        listed = [s.field for s in counters if s.kind == "label" and s.field in DRIVER_LABELS]
        self.driver_label = listed[0] if listed else DRIVER_LABEL[naming]
        for spec in counters:
            if spec.kind == "label":
                if spec.field in LABEL_SOURCES:
                    label_fields.append(spec.field)
                else:
                    self.unsupported[spec.field] = "no NVML source for this label field"
                continue
            source = SOURCES.get(spec.field)
            if source is None:
                self.unsupported[spec.field] = NO_SOURCE_REASONS.get(
                    spec.field, "no NVML source for this field"
                )
                continue
            watches_xids = spec.field in XID_FIELDS
            if watches_xids and (xid is None or xid.unsupported_reason):
                self.unsupported[spec.field] = xid.unsupported_reason if xid else "no event set"
                continue
            self._active.append(_Active(spec, source))
        self._gpm = self._open_gpm()
        self._carry = {  # per GPU and GPU instance, from one cycle to the next
            entity_key(d.uuid, gi): Carryover(
                gpm=self._gpm.get(entity_key(d.uuid, gi)),
                health=HealthHistory(xid_window_ms, clock_events_window_ms),
            )
            for d in devices
            for gi in (None, *(inst.gpu_instance_id for inst in d.mig))
        }
        self.families = tuple(
            Family(name=a.spec.field, type=a.spec.kind, help=a.spec.help)  # type: ignore[arg-type]
            for a in self._active
        )
        self._base = {d.uuid: self._labels(d, label_fields, driver_version) for d in devices}

    def _open_gpm(self) -> GpmStreams:
        """GPM streams for the active fields that read GPM. Where no GPU has GPM, the fields
        that have no other source are unsupported (with the reason); where some GPUs have
        it, the others skip those fields, said once per GPU."""
        wanted = [a for a in self._active if a.source.gpm]
        streams = GpmStreams(
            self._lib,
            self._devices if wanted else (),
            gpu_metrics=[a.source.gpm for a in wanted],
            mig_metrics=[a.source.gpm for a in wanted if a.source.mig],
        )
        only = [a for a in wanted if a.source.gpm_only]
        if not only or not streams.unsupported:
            return streams
        if len(streams.unsupported) == len(self._devices):
            reason = streams.describe(self._devices)
            self.unsupported.update((a.spec.field, reason) for a in only)
            self._active = [a for a in self._active if not a.source.gpm_only]
            return streams
        for dev in self._devices:
            if dev.uuid in streams.unsupported:
                log.warning(
                    "GPU %d (%s): profiling fields (%s) skipped, no NVML GPM: %s",
                    dev.index,
                    dev.uuid,
                    ", ".join(a.spec.field for a in only),
                    streams.unsupported[dev.uuid],
                )
                self._skip.update((dev.uuid, a.spec.field) for a in only)
        return streams

    def close(self) -> None:
        """Free what NVML allocated for the collector (GPM samples); before nvmlShutdown."""
        self._gpm.close()
        self.guard.close()

    def _labels(self, dev: GpuDevice, label_fields: list[str], driver: str) -> Labels:
        extra = {
            "DCGM_FI_DEV_NAME": dev.name,
            "DCGM_FI_DEV_UUID": dev.uuid,
            "DCGM_FI_DEV_PCI_BUSID": dev.pci_bus_id,
        }
        labels = [
            ("gpu", str(dev.index)),
            ("UUID", dev.uuid),
            ("device", f"nvidia{dev.minor}"),
            ("modelName", dev.name),
            ("pci_bus_id", dev.pci_bus_id),
            (self._node_label, self._node),
            ("NodeName", self._node),  # as ACK's exporter: its adapter rules group by it
            (self.driver_label, driver),
        ]
        labels += [(f, extra[f]) for f in label_fields if f not in DRIVER_LABELS]
        return tuple(labels)

    def collect(self, sink: SampleSink) -> list[GpuInventory]:
        """Read every active field of every GPU into ``sink``; return the inventory.

        The GPUs are read in the guard's worker thread; one not done within the deadline
        is left out of this cycle (and of the next ones while its call has not returned)."""
        for fam in self.families:
            sink.declare(fam)
        parts = [SampleSink() for _ in self._devices]
        results = self.guard.each(
            [
                (dev.uuid, partial(self._collect_gpu, dev, part))
                for dev, part in zip(self._devices, parts, strict=True)
            ],
            self.deadline_seconds,
        )
        inventory = []
        for dev, part, result in zip(self._devices, parts, results, strict=True):
            if isinstance(result, Stalled):
                inventory.append(self._stalled(dev, result))
                continue
            if isinstance(result, BaseException):
                raise result
            self.degraded.clear(str(dev.index), "nvml_calls")
            sink.extend(part)
            inventory.append(result)
        return inventory

    def _stalled(self, dev: GpuDevice, exc: Stalled) -> GpuInventory:
        self.degraded.report(
            str(dev.index), "nvml_calls", f"{exc}; the GPU's series are left out until it returns"
        )
        with self._lock:
            self.errors[("gpu", "Stalled")] += 1
        return self._inventory(dev, healthy=False, total=0, used=0)

    def _inventory(self, dev: GpuDevice, *, healthy: bool, total: int, used: int) -> GpuInventory:
        return GpuInventory(
            index=dev.index,
            uuid=dev.uuid,
            name=dev.name,
            pci_bus_id=dev.pci_bus_id,
            minor=dev.minor,
            memory_total_bytes=total,
            memory_used_bytes=used,
            mig_enabled=dev.mig_enabled,
            healthy=healthy,
        )

    def _collect_gpu(self, dev: GpuDevice, sink: SampleSink) -> GpuInventory:
        watcher = self._xid
        probe = Probe(
            self._lib,
            dev.handle,
            watcher.last(dev.uuid) if watcher else None,
            self._carry[entity_key(dev.uuid)],
            now=self._clock(),
            xid_events=watcher.events(dev.uuid) if watcher else None,
            xids_seen=watcher.seen(dev.uuid) if watcher else None,
        )
        base = self._base[dev.uuid]
        gpu_labels = (*base, *self.pod_labels(dev.uuid, None))
        healthy = True
        try:
            if not dev.mig_enabled:
                self._read_fields(dev, probe, gpu_labels, sink, mig=False)
            else:
                self._read_fields(dev, probe, gpu_labels, sink, mig=False)
                for inst in dev.mig:
                    labels = (
                        *base,
                        *self.pod_labels(dev.uuid, inst.gpu_instance_id),
                        ("GPU_I_PROFILE", inst.profile),
                        ("GPU_I_ID", str(inst.gpu_instance_id)),
                    )
                    carry = self._carry[entity_key(dev.uuid, inst.gpu_instance_id)]
                    inst_probe = Probe(self._lib, inst.handle, carry=carry)
                    self._read_fields(dev, inst_probe, labels, sink, mig=True)
            self._report_gpm(dev)
            total, _reserved, _free, used = probe.memory()
            with self._lock:
                answers_again = self._lost.pop(dev.uuid, None) is not None
            if answers_again:
                log.warning("GPU %d (%s) answers again", dev.index, dev.uuid)
        except _GPU_FATAL as exc:
            healthy = False
            total = used = 0
            with self._lock:
                first = dev.uuid not in self._lost
                self._lost[dev.uuid] = str(exc)
                self.errors[("gpu", type(exc).__name__)] += 1
            if first:
                log.error("GPU %d (%s) cannot be read: %s", dev.index, dev.uuid, exc)
        except pynvml.NVMLError as exc:  # memory info failed for another reason
            total = used = 0
            with self._lock:
                self.errors[("memory", type(exc).__name__)] += 1
        return self._inventory(dev, healthy=healthy, total=total, used=used)

    def _report_gpm(self, dev: GpuDevice) -> None:
        """Say (once) where GPM sampling was given up: its fields are left out there, and
        PCIe throughput comes from nvmlDeviceGetPcieThroughput instead."""
        for gi in (None, *(inst.gpu_instance_id for inst in dev.mig)):
            carry = self._carry[entity_key(dev.uuid, gi)]
            if carry.gpm_lost:
                part = "profiling_counters" + ("" if gi is None else f" of GPU instance {gi}")
                self.degraded.report(
                    str(dev.index),
                    part,
                    f"{carry.gpm_lost}; DCGM_FI_PROF_* fields left out, PCIe throughput from "
                    "nvmlDeviceGetPcieThroughput",
                )

    def _read_fields(
        self, dev: GpuDevice, probe: Probe, labels: Labels, sink: SampleSink, *, mig: bool
    ) -> None:
        skip = self._skip
        for active in self._active:
            name = active.spec.field
            if mig and not active.source.mig:
                continue
            key = (dev.uuid if not mig else f"{dev.uuid}/{labels[-1][1]}", name)
            if key in skip:
                continue
            try:
                if active.source.series is not None:
                    for extra, value in active.source.series(probe):
                        sink.add(name, (*labels, *extra), value)
                    continue
                value = active.source.read(probe)
            except _GPU_FATAL:
                raise
            except NoValueYet:  # a rate's first reading
                continue
            except pynvml.NVMLError_NotSupported:
                with self._lock:
                    skip.add(key)
                if not mig:
                    log.info("GPU %d (%s): %s not supported, skipped", dev.index, dev.uuid, name)
                continue
            except pynvml.NVMLError as exc:
                with self._lock:
                    self.errors[(name, type(exc).__name__)] += 1
                continue
            sink.add(name, labels, float(value))

    def report_unsupported(self) -> dict[str, str]:
        """Fields nobody can serve: no NVML source, or NOT_SUPPORTED on every GPU."""
        report = dict(self.unsupported)
        if self._devices:
            lost = {c.gpm_lost for c in self._carry.values() if c.gpm_lost}
            with self._lock:
                skip = set(self._skip)
            for active in self._active:
                name = active.spec.field
                if all((d.uuid, name) in skip for d in self._devices):
                    reason = "not supported by any GPU on this node"
                    if active.source.gpm_only and lost:
                        reason = "; ".join(sorted(lost))
                    report[name] = reason
        return report

    def lost_gpus(self) -> dict[str, str]:
        return dict(self._lost)
