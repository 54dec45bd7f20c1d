"""The unified ``/metrics`` body of all nodes, and the BIE ``/v1/collect`` document.

The text format wants every family in one group, so the body is family-major: for each
family (sorted by name, so the body does not depend on which node connected first) its
``# HELP``/``# TYPE`` header once, then the cached block of every node that has the
family (nodes sorted by name). Building a body is a join of cached bytes; only blocks a
batch touched are re-rendered (see :mod:`cloud_gateway.registry`). The lines inside those
blocks are made by :data:`TEXT_LINES`, this stage's :class:`~cloud_gateway.registry.LineFormat`:
the registry stores them, this module decides what they look like. Then come the
per-node families ``gpurelay_node_up``, ``gpurelay_node_state``,
``gpurelay_node_last_seen_timestamp_seconds`` and ``gpurelay_node_late_after_seconds``
(which outlive a node's expired device series; see :mod:`cloud_gateway.liveness`; the
node in the registry's ``node_label``, as on device series) and the gateway's own
families.

A body, its gzip and its OpenMetrics variant are each built at most once per generation
and returned as the same ``bytes`` object to every scraper until something changes.
OpenMetrics follows the shared rule (:func:`gpurelay.exposition.openmetrics_header`):
dcgm counters without ``_total`` keep their names and are typed ``unknown``.

Call :meth:`Exposition.body` on the thread that mutates the registry (the event loop).
Compressing a 1,000-node body takes a few hundred milliseconds, so an HTTP handler should
use :meth:`Exposition.body_async`: it compresses in a worker thread (zlib releases the
GIL) and concurrent scrapers of one generation share that single compression.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gzip as gzip_
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Final

from gpurelay.bie import node_summary
from gpurelay.exposition import (
    format_labels,
    format_value,
    openmetrics_header,
    text_header,
)
from gpurelay.model import MIB, Family, GpuInventory, Labels, Sample

if TYPE_CHECKING:  # the registry imports this module for TEXT_LINES
    from cloud_gateway.registry import Registry
    from cloud_gateway.registry_types import Liveness
    from cloud_gateway.self_metrics import SelfMetrics
NODE_UP = Family(
    name="gpurelay_node_up",
    type="gauge",
    help="1 while the node is online (connected and sending on time); 0 when stale or offline.",
)
NODE_STATE = Family(
    name="gpurelay_node_state",
    type="gauge",
    help="1 for the node's state (online, stale: connected but late, offline: gone), else 0.",
)
NODE_LAST_SEEN = Family(
    name="gpurelay_node_last_seen_timestamp_seconds",
    type="gauge",
    help="Unix time the gateway last heard from the node (connect or batch).",
)
NODE_LATE_AFTER = Family(
    name="gpurelay_node_late_after_seconds",
    type="gauge",
    help="Seconds without a batch after which the connected node counts as stale "
    "(intervals plus a margin for its link's measured lateness).",
)
STATES: Final = ("online", "stale", "offline")
NODE_FAMILIES: Final = (NODE_UP, NODE_STATE, NODE_LAST_SEEN, NODE_LATE_AFTER)
FamilySamples = tuple[Family, Sequence[Sample]]


def _value_end(value: float) -> bytes:
    """``format_value(value) + "\\n"`` as bytes; integral values (most GPU readings) take a
    shortcut that formats the same digits in half the time (the gateway's hot loop)."""
    if value.is_integer() and abs(value) < 1e15:
        return b"%d\n" % value
    return format_value(value).encode() + b"\n"


class TextLines:
    """Series lines of the text format (the same bytes in OpenMetrics): the prefix
    ``NAME{labels} `` made once per series, then the value and a newline."""

    def prefix(self, name: str, labels: Labels) -> bytes:
        return f"{name}{format_labels(labels)} ".encode()

    value = staticmethod(_value_end)


TEXT_LINES: Final = TextLines()


def header(family: Family, *, openmetrics: bool) -> bytes:
    render = openmetrics_header if openmetrics else text_header
    return render(family.name, family).encode()


def render_families(families: Iterable[FamilySamples], *, openmetrics: bool) -> bytes:
    """Plain rendering of a few families (the gateway's own; not for the node data)."""
    out = []
    for fam, samples in families:
        if samples:
            out.append(header(fam, openmetrics=openmetrics))
            out.extend(
                f"{s.name}{format_labels(s.labels)} {format_value(s.value)}\n".encode()
                for s in samples
            )
    return b"".join(out)


def _compress(plain: bytes, level: int) -> bytes:
    return gzip_.compress(plain, compresslevel=level, mtime=0)


class Exposition:
    """Shared, cached ``/metrics`` bodies over one :class:`Registry`."""

    def __init__(self, registry: Registry, *, gzip_level: int = 1) -> None:
        self.registry = registry
        self.gzip_level = gzip_level  # 1: a 100 MB body compresses in a fraction of 6's time
        self.bodies_built = 0
        self._extra: tuple[bytes, bytes] = (b"", b"")  # (text, openmetrics)
        self._extra_generation = 0
        self._generation: tuple[int, int] | None = None
        self._bodies: dict[tuple[bool, bool], bytes] = {}
        self._headers: dict[tuple[Family, bool], bytes] = {}
        self._node_lines: dict[str, tuple[Liveness, tuple[bytes, bytes, bytes, bytes]]] = {}
        self._compressing: dict[bool, tuple[tuple[int, int], asyncio.Future[bytes]]] = {}

    @property
    def generation(self) -> tuple[int, int]:
        return (self.registry.generation, self._extra_generation)

    def set_extra(
        self, families: Iterable[FamilySamples], *, histograms: SelfMetrics | None = None
    ) -> None:
        """The gateway's own families (``gpurelay_gateway_*``: agents may not declare that
        prefix) and its histograms, appended after the node data. Call it when they change;
        the bodies are rebuilt only if the rendering differs."""
        families = list(families)
        extra = (
            render_families(families, openmetrics=False),
            render_families(families, openmetrics=True),
        )
        if histograms is not None:
            extra = (
                extra[0] + histograms.render(openmetrics=False),
                extra[1] + histograms.render(openmetrics=True),
            )
        if extra != self._extra:
            self._extra = extra
            self._extra_generation += 1

    def body(self, *, openmetrics: bool, gzip: bool) -> bytes:
        generation = self.generation
        if generation != self._generation:
            self._bodies.clear()
            self._generation = generation
        key = (openmetrics, gzip)
        body = self._bodies.get(key)
        if body is None:
            if gzip:
                body = _compress(self.body(openmetrics=openmetrics, gzip=False), self.gzip_level)
            else:
                body = b"".join(self._parts(openmetrics))
            self._bodies[key] = body
            self.bodies_built += 1
        return body

    async def body_async(self, *, openmetrics: bool, gzip: bool) -> bytes:
        """:meth:`body`, with the compression in a worker thread, shared by the scrapers
        that ask while it runs. Call it on the event loop that mutates the registry."""
        plain = self.body(openmetrics=openmetrics, gzip=False)
        key = (openmetrics, True)
        if not gzip or key in self._bodies:
            return self._bodies[key] if gzip else plain
        generation = self.generation
        pending = self._compressing.get(openmetrics)
        if pending is None or pending[0] != generation:
            task = asyncio.ensure_future(asyncio.to_thread(_compress, plain, self.gzip_level))
            pending = self._compressing[openmetrics] = (generation, task)
            self.bodies_built += 1
        try:
            packed = await asyncio.shield(pending[1])
        finally:
            if pending[1].done() and self._compressing.get(openmetrics) is pending:
                del self._compressing[openmetrics]
        if self._generation == generation:
            self._bodies[key] = packed
        return packed

    def _parts(self, openmetrics: bool) -> list[bytes]:
        parts: list[bytes] = []
        for fam, blocks in self.registry.family_blocks():
            parts.append(self._header(fam, openmetrics))
            parts += blocks
        parts += self._node_families(openmetrics)
        parts.append(self._extra[openmetrics])
        if openmetrics:
            parts.append(b"# EOF\n")
        return parts

    def _header(self, family: Family, openmetrics: bool) -> bytes:
        key = (family, openmetrics)
        hit = self._headers.get(key)
        if hit is None:
            hit = self._headers[key] = header(family, openmetrics=openmetrics)
        return hit

    def _node_families(self, openmetrics: bool) -> list[bytes]:
        """``gpurelay_node_up``, ``_state``, ``_last_seen_...`` and ``_late_after_...``;
        a node's lines are re-rendered only when its values changed."""
        cache = self._node_lines
        columns: tuple[list[bytes], ...] = ([], [], [], [])
        for live in self.registry.liveness():
            hit = cache.get(live.name)
            if hit is None or hit[0] != live:
                hit = cache[live.name] = (live, _node_lines(live, self.registry.config.node_label))
            for column, line in zip(columns, hit[1], strict=True):
                if line:
                    column.append(line)
        parts: list[bytes] = []
        for fam, lines in zip(NODE_FAMILIES, columns, strict=True):
            if lines:
                parts += [self._header(fam, openmetrics), *lines]
        return parts


def _node_lines(live: Liveness, node_label: str) -> tuple[bytes, bytes, bytes, bytes]:
    """One node's lines, the node named by the registry's ``node_label`` as on its
    device series (``Hostname`` or ``hostname``)."""
    labels = format_labels(((node_label, live.name),))
    up = f"{NODE_UP.name}{labels} {int(live.up)}\n".encode()
    state = "".join(
        f"{NODE_STATE.name}{format_labels(((node_label, live.name), ('state', s)))} "
        f"{int(live.state == s)}\n"
        for s in STATES
    ).encode()
    seen = late = ""
    if live.last_seen is not None:
        seen = f"{NODE_LAST_SEEN.name}{labels} {format_value(float(live.last_seen))}\n"
    if live.late_after is not None:
        late = f"{NODE_LATE_AFTER.name}{labels} {format_value(round(live.late_after, 3))}\n"
    return up, state, seen.encode(), late.encode()


def bie_document(registry: Registry, now: float) -> dict[str, Any]:
    """``{node: summary}`` for every *online* node, as the agent's ``/v1/collect``.

    Devices are the GPUs of the node's hello (physical GPUs; MIG instances are not
    devices). Used memory is the node's latest ``DCGM_FI_DEV_FB_USED`` of the GPU (the
    series without a ``GPU_I_ID``, matched by ``UUID``), MiB turned into bytes; total is
    the hello's exact byte count, or ``FB_USED + FB_FREE + FB_RESERVED`` where the hello
    had none (a GPU that was lost at connect). Without FB values the hello's figures stand.
    """
    return {
        view.name: node_summary(current_gpus(registry, view.name, view.gpus))
        for view in registry.nodes(now, state="online")
    }


def current_gpus(registry: Registry, node: str, gpus: Sequence[GpuInventory]) -> list[GpuInventory]:
    fb = {fam: _by_uuid(registry, node, fam) for fam in ("USED", "FREE", "RESERVED")}
    out = []
    for gpu in gpus:
        used = fb["USED"].get(gpu.uuid)
        if used is None:
            out.append(gpu)
            continue
        total = gpu.memory_total_bytes
        if total <= 0:
            parts = [fb[fam].get(gpu.uuid) for fam in ("USED", "FREE", "RESERVED")]
            total = round(sum(p for p in parts if p is not None) * MIB)
        out.append(
            dataclasses.replace(gpu, memory_used_bytes=round(used * MIB), memory_total_bytes=total)
        )
    return out


def _by_uuid(registry: Registry, node: str, field: str) -> dict[str, float]:
    """Latest ``DCGM_FI_DEV_FB_<field>`` (MiB) of each physical GPU, by UUID."""
    out = {}
    for labels, value in registry.latest(node, f"DCGM_FI_DEV_FB_{field}"):
        d = dict(labels)
        if not d.get("GPU_I_ID") and "UUID" in d:
            out[d["UUID"]] = value
    return out
