"""One collection cycle: run every collector, time it, add the agent's own metrics.

Like node_exporter's wrapper, a collector that raises does not fail the cycle: it shows
up as ``gpurelay_collector_success{collector} 0`` with its duration, and the previous
samples of a collector that runs less often (processes) are reused until it runs again.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Protocol

from edge_agent import __version__
from edge_agent.collect_alloc import AllocationCollector
from edge_agent.degraded import Degraded
from gpurelay.model import Family, GpuInventory, SampleSink, Snapshot

log = logging.getLogger(__name__)

SELF_FAMILIES = (
    Family(
        name="gpurelay_agent_info",
        type="gauge",
        help='Agent build and backend; backend="simulated" means the values are synthetic.',
    ),
    Family(
        name="gpurelay_collector_success",
        type="gauge",
        help="1 when the collector's last run succeeded for every GPU, else 0.",
    ),
    Family(
        name="gpurelay_collector_duration_seconds",
        type="gauge",
        help="Wall time of the collector's last run.",
    ),
    Family(
        name="gpurelay_agent_unsupported_field",
        type="gauge",
        help="A field of the counters file that this node cannot supply (skipped).",
    ),
    Family(
        name="gpurelay_agent_degraded",
        type="gauge",
        help="A part of a GPU that is not measured now, and why (its series are left out, "
        "never published as 0).",
    ),
    Family(
        name="gpurelay_agent_gpu_healthy",
        type="gauge",
        help="1 when the GPU answered NVML in the last cycle, 0 when it is lost.",
    ),
    Family(
        name="gpurelay_agent_nvml_errors_total",
        type="counter",
        help="NVML calls that failed, by field and error.",
    ),
    Family(
        name="gpurelay_agent_attribution_errors_total",
        type="counter",
        help="PIDs that could not be attributed to a container, by reason.",
    ),
    Family(
        name="gpurelay_agent_collections_total", type="counter", help="Collection cycles completed."
    ),
    Family(
        name="gpurelay_agent_last_collection_timestamp_seconds",
        type="gauge",
        help="Unix time of the last completed collection cycle.",
    ),
)


class ErrorSource(Protocol):
    def errors(self) -> dict[str, int]: ...


class DeviceSource(Protocol):
    """What the Collector needs of a backend's device collector: NVML's
    (:class:`~edge_agent.collect_device.DeviceCollector`, the simulator's too) or a
    Jetson's (:class:`~edge_agent.jetson.collector.JetsonDeviceCollector`). The catalogue,
    exposition, spool and tunnel see only the samples it adds."""

    degraded: Degraded
    errors: Counter[tuple[str, str]]  # (field, error) -> how often a read failed

    def collect(self, sink: SampleSink) -> list[GpuInventory]:
        """Declare the families and add the samples of one pass; the GPUs seen."""
        ...

    def report_unsupported(self) -> dict[str, str]:
        """Field -> why this node cannot give it."""
        ...

    def close(self) -> None: ...


class ProcessSource(Protocol):
    """What the Collector needs of a backend's process collector: NVML's
    (:class:`~edge_agent.collect_process.ProcessCollector`) or a Jetson's
    (:class:`~edge_agent.jetson.processes.JetsonProcessCollector`)."""

    errors: Counter[str]  # error -> how often a process list failed

    @property
    def families(self) -> Sequence[Family]: ...

    def collect(self, sink: SampleSink) -> None: ...


class Collector:
    """Owns the collectors and produces a :class:`Snapshot` per cycle."""

    def __init__(
        self,
        *,
        node: str,
        node_label: str = "Hostname",
        backend: str,
        device: DeviceSource,
        process: ProcessSource | None,
        attribution_errors: Callable[[], dict[str, int]] | None = None,
        process_interval: float = 0.0,
        clock: Callable[[], float] = time.time,
        timer: Callable[[], float] = time.perf_counter,
        alloc: AllocationCollector | None = None,
        degraded: Degraded | None = None,
    ) -> None:
        self._alloc = alloc
        self._degraded = degraded or device.degraded
        self._node = node
        self._node_label = node_label
        self._backend = backend
        self._device = device
        self._process = process
        self._attribution_errors = attribution_errors
        self._process_interval = process_interval
        self._clock = clock
        self._timer = timer
        self._last_process_run = float("-inf")
        self._process_sink = SampleSink()
        self._status: dict[str, tuple[bool, float]] = {}
        self._cycles = 0
        self.unsupported: dict[str, str] = {}
        # Other stages' own series (the tunnel's), added to every collection.
        self.extra: list[Callable[[SampleSink], None]] = []

    def collect(self) -> Snapshot:
        sink = SampleSink()
        gpus = self._run_device(sink)
        self._report_unsupported()
        self._run_process(sink)
        self._run_alloc(sink)
        self._cycles += 1
        now = self._clock()
        self._self_metrics(sink, gpus, now)
        return Snapshot(
            node=self._node,
            timestamp=now,
            families=sink.families,
            samples=sink.samples,
            gpus=tuple(gpus),
        )

    def set_process_interval(self, seconds: float) -> None:
        self._process_interval = seconds

    def close(self) -> None:
        """Free what the collectors hold in NVML (GPM samples); before nvmlShutdown."""
        self._device.close()

    def _report_unsupported(self) -> None:
        """After every device pass: the fields this node cannot supply, each logged once
        (a field can join them later: GPM sampling given up after a start)."""
        before = self.unsupported
        self.unsupported = self._device.report_unsupported()
        for field, reason in sorted(self.unsupported.items()):
            if before.get(field) != reason:
                log.warning("field %s is skipped: %s", field, reason)

    def _execute(
        self, name: str, run: Callable[[SampleSink], bool | None]
    ) -> tuple[SampleSink, bool]:
        """One collector, timed and caught (node_exporter's ``execute``): what it added and
        its success (False when ``run`` said so or raised: logged), both also recorded with
        its duration for ``gpurelay_collector_*``."""
        start = self._timer()
        part = SampleSink()
        try:
            ok = run(part) is not False
        except Exception:
            log.exception("%s collector failed", name)
            ok = False
        self._status[name] = (ok, self._timer() - start)
        return part, ok

    def _run_device(self, sink: SampleSink) -> list[GpuInventory]:
        gpus: list[GpuInventory] = []

        def run(part: SampleSink) -> bool:
            gpus.extend(self._device.collect(part))
            return all(g.healthy for g in gpus)

        sink.extend(self._execute("device", run)[0])
        return gpus

    def _run_process(self, sink: SampleSink) -> None:
        process = self._process
        if process is None:
            return
        now = self._clock()
        if now - self._last_process_run >= self._process_interval:
            self._last_process_run = now
            part, ok = self._execute("process", process.collect)
            if not ok:  # its families stay declared, empty
                for fam in process.families:
                    part.declare(fam)
            self._process_sink = part
        sink.extend(self._process_sink)

    def _run_alloc(self, sink: SampleSink) -> None:
        """ACK's allocation metrics, once the kubelet's pod-resources socket was seen."""
        alloc = self._alloc
        if alloc is None or not alloc.active:
            return
        sink.extend(self._execute("alloc", alloc.collect)[0])

    def _self_metrics(self, sink: SampleSink, gpus: list[GpuInventory], now: float) -> None:
        for fam in SELF_FAMILIES:
            sink.declare(fam)
        sink.add(
            "gpurelay_agent_info",
            (("version", __version__), ("backend", self._backend), (self._node_label, self._node)),
            1.0,
        )
        for name, (ok, seconds) in self._status.items():
            sink.add("gpurelay_collector_success", (("collector", name),), 1.0 if ok else 0.0)
            sink.add("gpurelay_collector_duration_seconds", (("collector", name),), seconds)
        for field, reason in sorted(self.unsupported.items()):
            sink.add("gpurelay_agent_unsupported_field", (("field", field), ("reason", reason)), 1)
        for (gpu, part), reason in sorted(self._degraded.current().items()):
            degraded = (("gpu", gpu), ("part", part), ("reason", reason))
            sink.add("gpurelay_agent_degraded", degraded, 1)
        for g in gpus:
            sink.add(
                "gpurelay_agent_gpu_healthy",
                (("gpu", str(g.index)), ("UUID", g.uuid)),
                1.0 if g.healthy else 0.0,
            )
        nvml_errors = dict(self._device.errors)
        for (field, error), n in sorted(nvml_errors.items()):
            sink.add("gpurelay_agent_nvml_errors_total", (("field", field), ("error", error)), n)
        if self._process is not None:
            for error, n in sorted(self._process.errors.items()):
                labels = (("field", "process"), ("error", error))
                sink.add("gpurelay_agent_nvml_errors_total", labels, n)
        if self._attribution_errors is not None:
            for reason, n in sorted(self._attribution_errors().items()):
                sink.add("gpurelay_agent_attribution_errors_total", (("reason", reason),), n)
        sink.add("gpurelay_agent_collections_total", (), float(self._cycles))
        sink.add("gpurelay_agent_last_collection_timestamp_seconds", (), now)
        for add in self.extra:
            add(sink)
