"""Recent GPU values per node and GPU, for the operator page's small charts.

A bounded ring per node: the times of its last ``capacity`` live batches (as seen on the
gateway's tick) and, per GPU, the utilisation and the framebuffer memory in use at each.
Fed by :meth:`RecentValues.sample` on the tick, read by :mod:`cloud_gateway.ui`; the
registry stays as it is (it only has to track the families named in
:data:`UI_FAMILIES`, for :meth:`Registry.latest`).

Values are float32 in ``array`` rings, not Python floats in deques: a sample of one GPU
costs 8 bytes (two float32), plus 8 for its time per node: 1,000 nodes of 8 GPUs at 120
samples hold 8.2 MiB of values, 11 MiB with the dicts and arrays around them (measured
with tracemalloc; tests/unit/test_ui.py bounds it).
A node the registry forgets (now another gateway's) loses its ring on the next tick.

A ``gpu`` label is a GPU index only as :func:`gpu_index` reads it (ASCII decimal, as
``str(int)`` writes it, below HELLO's 256 GPUs): ``str.isdigit()`` is also true of "²",
which ``int()`` refuses. Only such labels get a ring, so a node that sends 5,000 ``gpu``
labels still has at most 256 (the page charts the GPUs of the node's HELLO only).
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable
from typing import Final, Protocol

from gpurelay.model import Labels
from gpurelay.wire.frames import HELLO_GPUS

CAPACITY: Final = 120
UTIL: Final = "DCGM_FI_DEV_GPU_UTIL"
FB_USED: Final = "DCGM_FI_DEV_FB_USED"
FB_FREE: Final = "DCGM_FI_DEV_FB_FREE"
FB_RESERVED: Final = "DCGM_FI_DEV_FB_RESERVED"
PROCESS_MEM: Final = "DCGM_CUSTOM_PROCESS_MEM_USED"
PROCESS_SM: Final = "DCGM_CUSTOM_PROCESS_SM_UTIL"
SPOOL_BATCHES: Final = "gpurelay_agent_spool_batches"
SPOOL_BYTES: Final = "gpurelay_agent_spool_bytes"
# The families the page reads through Registry.latest (the gateway tracks them).
UI_FAMILIES: Final = frozenset(
    {UTIL, FB_USED, FB_FREE, FB_RESERVED, PROCESS_MEM, PROCESS_SM, SPOOL_BATCHES, SPOOL_BYTES}
)
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


class Latest(Protocol):
    """What the ring reads of the registry (:class:`cloud_gateway.registry.Registry`)."""

    def latest(self, node: str, family: str) -> list[tuple[Labels, float]]: ...


def per_gpu(rows: Iterable[tuple[Labels, float]]) -> dict[str, float]:
    """``gpu`` label -> value (the first series of each GPU; MIG instances share it)."""
    out: dict[str, float] = {}
    for labels, value in rows:
        gpu = dict(labels).get("gpu")
        if gpu is not None and gpu not in out:
            out[gpu] = value
    return out


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
            util, mem = (
                {
                    g: v
                    for g, v in per_gpu(registry.latest(node, f)).items()
                    if gpu_index(g) is not None
                }
                for f in (UTIL, FB_USED)
            )
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
