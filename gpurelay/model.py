"""The data model shared by every stage: metric families, samples and a snapshot.

A collection produces one immutable :class:`Snapshot`; the agent's local exporter renders
it, the encoder and the record codec ship it, and the gateway uses the same families,
samples and GPU inventory. Nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

MIB = 1024 * 1024  # dcgm-exporter reports framebuffer memory in MiB
MetricType = Literal["gauge", "counter"]
Labels = tuple[tuple[str, str], ...]
SeriesKey = tuple[str, Labels]  # (metric name, labels): one series of one node
# The label that names the node on device series: dcgm-exporter's `Hostname`, and
# `hostname` from its PR #655 on (both binaries' `node_label` setting takes one of these).
NODE_LABEL_NAMES = ("Hostname", "hostname")


@dataclass(frozen=True, slots=True, kw_only=True)
class Family:
    """A metric family: name, Prometheus type and help text."""

    name: str
    type: MetricType
    help: str


@dataclass(frozen=True, slots=True)
class Sample:
    """One value of one series; labels are ordered (name, value) pairs."""

    name: str
    labels: Labels
    value: float


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuInventory:
    """What the agent knows about one physical GPU (for BIE, hello frames and logs)."""

    index: int
    uuid: str
    name: str
    pci_bus_id: str
    minor: int
    memory_total_bytes: int
    memory_used_bytes: int
    mig_enabled: bool = False
    healthy: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class Snapshot:
    """The result of one collection: families (in render order), samples, inventory."""

    node: str
    timestamp: float
    families: tuple[Family, ...]
    samples: tuple[Sample, ...]
    gpus: tuple[GpuInventory, ...] = field(default=())


class SampleSink:
    """Collects families and samples in first-declared order while a collector runs."""

    __slots__ = ("_families", "_samples")

    def __init__(self) -> None:
        self._families: dict[str, Family] = {}
        self._samples: list[Sample] = []

    def declare(self, family: Family) -> None:
        self._families.setdefault(family.name, family)

    def add(self, name: str, labels: Labels, value: float) -> None:
        self._samples.append(Sample(name, labels, float(value)))

    def extend(self, other: SampleSink) -> None:
        for fam in other._families.values():
            self.declare(fam)
        self._samples.extend(other._samples)

    @property
    def families(self) -> tuple[Family, ...]:
        return tuple(self._families.values())

    @property
    def samples(self) -> tuple[Sample, ...]:
        return tuple(self._samples)
