"""What the operator page reads of a node's GPUs: each GPU's and MIG GPU instance's
figures now (:func:`readings`), and recent values per GPU for the small charts.

A bounded ring per node: the times of its last ``capacity`` live batches (as seen on the
gateway's tick) and, per GPU, the whole GPU's utilisation and framebuffer memory in use
at each.
Fed by :meth:`RecentValues.sample` on the tick, read by :mod:`cloud_gateway.http.ui.pages`; the
registry stays as it is (it only has to track the families named in
:data:`UI_FAMILIES`, for :meth:`Registry.latest`).

Values are float32 in ``array`` rings, not Python floats in deques: a sample of one GPU
costs 8 bytes (two float32), plus 8 for its time per node: 1,000 nodes of 8 GPUs at 120
samples hold 8.2 MiB of values, 11 MiB with the dicts and arrays around them (measured
with tracemalloc; tests/unit/gateway/http/test_ui.py bounds it).
A node the registry forgets (now another gateway's) loses its ring on the next tick.

Which series is which device: a ``gpu`` label names the physical GPU, and on a MIG GPU
the whole GPU's series (no ``GPU_I_ID``, or an empty one) sit beside each GPU instance's
(``GPU_I_ID``, ``GPU_I_PROFILE``) under the same ``gpu``. Every figure the page shows is
one device's: :func:`per_device` keys series by (``gpu``, ``GPU_I_ID``), so the whole
GPU's memory is never an instance's used beside the GPU's free, whatever order the
registry hands the series out in (it keeps them in a set). :func:`readings` makes of
them, per device, what the page shows:

- utilisation: ``DCGM_FI_DEV_GPU_UTIL`` (%), else ``DCGM_FI_PROF_GR_ENGINE_ACTIVE`` (a
  ratio, shown as %) of the same device. NVML has no GPU_UTIL for a MIG GPU or its
  instances, so there the activity is what there is. Where only the instances have it,
  the whole GPU shows none: its share is the instances' weighted by their slices of the
  GPU's slice count, which no series carries, and a figure we did not measure is never
  shown; each instance shows its own.
- memory: ``DCGM_FI_DEV_FB_USED`` of ``DCGM_FI_DEV_FB_TOTAL`` where the node sends it,
  else of used + free + reserved (NVML's total; reserved 0 where not sent) (MiB).
- a node on dcgm-exporter 4.9's names (``DCGM_FI_DEV_GPU_UTIL_RATIO``,
  ``DCGM_FI_DEV_FB_USED_BYTES``, ...) is read the same, in these units
  (:mod:`cloud_gateway.http.schemes`).

A ``gpu`` label is a GPU index only as :func:`gpu_index` reads it (ASCII decimal, as
``str(int)`` writes it, below HELLO's 256 GPUs): ``str.isdigit()`` is also true of "²",
which ``int()`` refuses. Only such labels get a ring, so a node that sends 5,000 ``gpu``
labels still has at most 256 (the page charts the GPUs of the node's HELLO only).
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from cloud_gateway.http.schemes import Latest, latest
from gpurelay.model import Labels
from gpurelay.naming import with_49_names
from gpurelay.wire.frames import HELLO_GPUS

CAPACITY: Final = 120
UTIL: Final = "DCGM_FI_DEV_GPU_UTIL"
GR_ACTIVE: Final = "DCGM_FI_PROF_GR_ENGINE_ACTIVE"  # a ratio, 0-1
FB_USED: Final = "DCGM_FI_DEV_FB_USED"
FB_FREE: Final = "DCGM_FI_DEV_FB_FREE"
FB_RESERVED: Final = "DCGM_FI_DEV_FB_RESERVED"
FB_TOTAL: Final = "DCGM_FI_DEV_FB_TOTAL"
PROCESS_MEM: Final = "DCGM_CUSTOM_PROCESS_MEM_USED"
PROCESS_SM: Final = "DCGM_CUSTOM_PROCESS_SM_UTIL"
SPOOL_BATCHES: Final = "gpurelay_agent_spool_batches"
SPOOL_BYTES: Final = "gpurelay_agent_spool_bytes"
# The families the page reads through Registry.latest (the gateway tracks them).
UI_FAMILIES: Final = with_49_names(
    frozenset({UTIL, GR_ACTIVE, FB_USED, FB_FREE, FB_RESERVED, FB_TOTAL})
    | {PROCESS_MEM, PROCESS_SM, SPOOL_BATCHES, SPOOL_BYTES}
)
WHOLE: Final = ""  # the GPU_I_ID under which per_device keys a whole GPU's series
MAX_GPU_INDEX: Final = HELLO_GPUS - 1
_INDEX_DIGITS: Final = len(str(MAX_GPU_INDEX))


def gpu_index(label: str) -> int | None:
    """The GPU index a ``gpu`` label names, or None: ASCII decimal digits as ``str(int)``
    writes them (no sign, space or leading zero), at most :data:`MAX_GPU_INDEX`."""
    if not (0 < len(label) <= _INDEX_DIGITS and label.isascii() and label.isdigit()):
        return None
    if label[0] == "0" and label != "0":
        return None
    index = int(label)
    return index if index <= MAX_GPU_INDEX else None


def gpu_order(label: str) -> tuple[int, str]:
    """A sort key: GPU indices by number, then any other label by its text."""
    index = gpu_index(label)
    return (index, "") if index is not None else (1 << 30, label)


Device = tuple[str, str]  # (gpu label, GPU_I_ID or WHOLE)


def per_device(rows: Iterable[tuple[Labels, float]]) -> dict[Device, tuple[Labels, float]]:
    """(``gpu``, ``GPU_I_ID``) -> (labels, value): a whole GPU's series under
    :data:`WHOLE`, each MIG GPU instance's under its id. Of several series of one device
    (an agent sends one), the one whose labels sort first: the same whatever their order."""
    out: dict[Device, tuple[Labels, float]] = {}
    for labels, value in rows:
        d = dict(labels)
        gpu = d.get("gpu")
        if gpu is None:
            continue
        key = (gpu, d.get("GPU_I_ID", WHOLE))
        held = out.get(key)
        if held is None or labels < held[0]:
            out[key] = (labels, value)
    return out


def per_gpu(rows: Iterable[tuple[Labels, float]]) -> dict[str, float]:
    """``gpu`` label -> the whole GPU's value: never a MIG instance's."""
    return {gpu: v for (gpu, gi), (_, v) in per_device(rows).items() if gi == WHOLE}


def utilisation(registry: Latest, node: str) -> dict[Device, float]:
    """Per device, %: GPU_UTIL, else GR_ENGINE_ACTIVE as percent (see the module's notes)."""
    out = {k: 100.0 * v for k, (_, v) in per_device(latest(registry, node, GR_ACTIVE)).items()}
    out.update((k, v) for k, (_, v) in per_device(latest(registry, node, UTIL)).items())
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Reading:
    """What one GPU or MIG GPU instance shows now (None: not sent)."""

    util: float | None  # %
    used: float | None  # MiB
    total: float | None  # MiB
    profile: str = ""  # GPU_I_PROFILE of an instance


def readings(registry: Latest, node: str) -> dict[Device, Reading]:
    """Every device of ``node`` that sent utilisation or memory, each from its own series."""
    util = utilisation(registry, node)
    used, free, reserved, total = (
        per_device(latest(registry, node, f)) for f in (FB_USED, FB_FREE, FB_RESERVED, FB_TOTAL)
    )
    out = {}
    for key in sorted(util.keys() | used.keys() | free.keys() | total.keys()):
        size = _value(total, key)
        if size is None and key in used and key in free:
            size = used[key][1] + free[key][1] + (_value(reserved, key) or 0.0)
        labels = next((t[key][0] for t in (used, free, total) if key in t), ())
        out[key] = Reading(
            util=util.get(key),
            used=_value(used, key),
            total=size,
            profile=dict(labels).get("GPU_I_PROFILE", "") if key[1] != WHOLE else "",
        )
    return out


def _value(table: dict[Device, tuple[Labels, float]], key: Device) -> float | None:
    held = table.get(key)
    return None if held is None else held[1]


class _Ring:
    """One node's ring: ``times`` and, per GPU, utilisation and memory used (MiB)."""

    __slots__ = ("capacity", "count", "mem", "next", "times", "util")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.times = array("d")
        self.util: dict[str, array[float]] = {}
        self.mem: dict[str, array[float]] = {}
        self.next = 0  # where the next sample goes once the ring is full
        self.count = 0

    def add(self, when: float, util: dict[str, float], mem: dict[str, float]) -> None:
        full = len(self.times) == self.capacity
        pos = self.next if full else len(self.times)
        for gpu in util.keys() | mem.keys():  # a GPU seen first now: NaN before
            for table in (self.util, self.mem):
                if gpu not in table:
                    table[gpu] = array("f", [math.nan] * len(self.times))
        for table, values in ((self.util, util), (self.mem, mem)):
            for gpu, ring in table.items():
                value = values.get(gpu, math.nan)
                if full:
                    ring[pos] = value
                else:
                    ring.append(value)
        if full:
            self.times[pos] = when
        else:
            self.times.append(when)
        self.next = (pos + 1) % self.capacity
        self.count += 1

    def ordered(self, ring: array[float] | array[float]) -> list[float]:
        if len(ring) < self.capacity:
            return list(ring)
        return list(ring[self.next :]) + list(ring[: self.next])

    def nbytes(self) -> int:
        rings = [self.times, *self.util.values(), *self.mem.values()]
        return sum(r.buffer_info()[1] * r.itemsize for r in rings)


class RecentValues:
    """The rings of all nodes. ``sample`` once per tick: a node whose last batch is newer
    than the one its ring last took gets one more sample."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        if capacity < 2:
            raise ValueError("capacity must be at least 2")
        self.capacity = capacity
        self._rings: dict[str, _Ring] = {}
        self._taken: dict[str, float] = {}  # node -> last_batch_time sampled

    def sample(self, registry: Latest, batches: Iterable[tuple[str, float | None]]) -> int:
        """``batches``: (node, time of its last live batch) for every node the registry
        knows; nodes not listed are dropped. Returns how many samples were taken."""
        seen = set()
        taken = 0
        for node, last_batch in batches:
            seen.add(node)
            if last_batch is None or self._taken.get(node) == last_batch:
                continue
            self._taken[node] = last_batch
            ring = self._rings.get(node)
            if ring is None:
                ring = self._rings[node] = _Ring(self.capacity)
            util = {
                g: v
                for (g, gi), v in utilisation(registry, node).items()
                if gi == WHOLE and gpu_index(g) is not None
            }
            mem = {
                g: v
                for g, v in per_gpu(latest(registry, node, FB_USED)).items()
                if gpu_index(g) is not None
            }
            ring.add(last_batch, util, mem)
            taken += 1
        for node in self._rings.keys() - seen:
            del self._rings[node]
            self._taken.pop(node, None)
        return taken

    def of(self, node: str) -> tuple[list[float], dict[str, tuple[list[float], list[float]]]]:
        """(times, gpu -> (utilisation %, memory used MiB)), oldest first, NaN where a
        batch had no value; empty when the node has no samples."""
        ring = self._rings.get(node)
        if ring is None:
            return [], {}
        gpus = {
            gpu: (ring.ordered(ring.util[gpu]), ring.ordered(ring.mem[gpu]))
            for gpu in sorted(ring.util, key=gpu_order)
        }
        return ring.ordered(ring.times), gpus

    def nbytes(self) -> int:
        """The bytes the rings' values take (the arrays' buffers)."""
        return sum(r.nbytes() for r in self._rings.values())
