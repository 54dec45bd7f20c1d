"""The unified ``/metrics`` body of all nodes, and the BIE ``/v1/collect`` document.

The text format wants every family in one group, so the body is family-major: for each
family (sorted by name, so the body does not depend on which node connected first) its
``# HELP``/``# TYPE`` header once, then the cached block of every node that has the
family (nodes sorted by name). Building a body is a join of cached bytes; only blocks a
batch touched are re-rendered (see :mod:`cloud_gateway.registry.store`). The lines inside those
blocks are made by :data:`TEXT_LINES`, this stage's
:class:`~cloud_gateway.registry.store.LineFormat`:
the registry stores them, this module decides what they look like. Then come the
per-node families ``gpurelay_node_up``, ``gpurelay_node_state``,
``gpurelay_node_last_seen_timestamp_seconds`` and ``gpurelay_node_late_after_seconds``
(which outlive a node's expired device series; see :mod:`cloud_gateway.registry.liveness`; the
node in the registry's ``node_label``, as on device series), the ``gpurelay_node_*``
families the gateway hands in with its own (:data:`NODE_PREFIX`: the certificate expiry),
kept by node like the liveness families so that a shard holds only its nodes' series,
and the gateway's own families.

A scrape costs a join, and gzip costs what changed. The fleet part (every device family)
is kept as *pieces* of up to :data:`PIECE_BLOCKS` consecutive (family, node) blocks,
joined once; a piece is rebuilt only when one of its blocks is a new object (the registry
re-renders a block only when a batch touched it). The liveness families and the
gateway's own (:meth:`Exposition.set_extra`, every 1 s tick) are a small tail rendered
per scrape, so they never invalidate the fleet part. A scrape is a :class:`Body`, a list
of shared chunks that the HTTP layer writes one after another. With gzip the body is one
gzip member whose deflate stream is the pieces' own deflate, each compressed once when a
gzip scrape first needs it (:mod:`cloud_gateway.exposition.gzip_members`), so a scrape
recompresses only the pieces that changed, in worker threads (zlib releases the GIL),
shared by concurrent scrapers. Pieces of 64 blocks cost about 4 % of size against
compressing the whole body at once.
OpenMetrics follows the shared rule (:func:`gpurelay.exposition.openmetrics_header`):
dcgm counters without ``_total`` keep their names and are typed ``unknown``; its
``# EOF`` ends the tail. The fleet pieces are the same bytes in both formats (only the
family headers differ).

Call :meth:`Exposition.scrape` (or :meth:`Exposition.body`, one joined ``bytes``) on the
thread that mutates the registry (the event loop); an HTTP handler uses
:meth:`Exposition.scrape_async`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Final

from cloud_gateway.exposition.gzip_members import GZIP_HEADER, Deflated, trailer
from cloud_gateway.exposition.pieces import Piece, pack, pack_parallel, versions_of
from cloud_gateway.exposition.shard_cache import ShardCache
from cloud_gateway.metrics import FamilySamples, one
from cloud_gateway.registry.lines import TEXT_LINES  # noqa: F401 (its users import it here)
from cloud_gateway.registry.types import NODE_STATES
from gpurelay.exposition import (
    format_labels,
    format_value,
    openmetrics_header,
    text_header,
)
from gpurelay.model import Family, Sample

if TYPE_CHECKING:  # the registry imports this module for TEXT_LINES
    from cloud_gateway.registry.records import FamilyState, Group
    from cloud_gateway.registry.store import Registry
    from cloud_gateway.registry.types import Liveness
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
NODE_FAMILIES: Final = (NODE_UP, NODE_STATE, NODE_LAST_SEEN, NODE_LATE_AFTER)
# A family of set_extra named so is about one node per series (labelled with the node label),
# not about the gateway: it goes with the node families, in its nodes' shards.
NODE_PREFIX: Final = "gpurelay_node_"
NodeLines = tuple[Family, tuple[tuple[str, bytes], ...]]  # (node, its sample lines) in order


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


PIECE_BLOCKS: Final = 64  # blocks per cached piece: chosen by bench/gateway_render.py, (g)


@dataclasses.dataclass(frozen=True, slots=True)
class Body:
    """What one scrape sends: ``chunks`` in order (``size`` bytes in all), one gzip
    member when ``gzip``. The chunks are shared, immutable bytes; :meth:`join` makes one."""

    chunks: tuple[bytes, ...]
    size: int
    gzip: bool

    def join(self) -> bytes:
        return b"".join(self.chunks)


class Exposition:
    """``/metrics`` bodies over one :class:`Registry`: the fleet part is kept as cached
    pieces (re-joined and recompressed only where a block changed); the node liveness
    families and the gateway's own families are rendered per scrape beside it."""

    def __init__(
        self, registry: Registry, *, gzip_level: int = 1, piece_blocks: int = PIECE_BLOCKS
    ) -> None:
        self.registry = registry
        self.gzip_level = gzip_level  # 1: a 100 MB body compresses in a fraction of 6's time
        self.piece_blocks = piece_blocks
        self.bodies_built = 0  # fleet parts rebuilt, and gzip passes over what changed
        self._extra: tuple[bytes, bytes] = (b"", b"")  # (text, openmetrics)
        self._extra_nodes: tuple[NodeLines, ...] = ()  # set_extra's gpurelay_node_* families
        self._extra_generation = 0
        self._fleet_key = -1  # the registry generation self._fleet was read at
        self._fleet: list[tuple[Family, list[Piece]]] = []
        self._fleet_generation = 0  # bumped when a piece changed
        self._pieces: dict[str, list[Piece]] = {}  # family name -> its pieces
        self._seen: dict[str, tuple[FamilyState, int]] = {}  # ... made at this version
        self._scrapes: deque[float] = deque(maxlen=9)  # monotonic times of recent scrapes
        self.prepared = 0  # ticks that rendered ahead of an expected scrape
        self._gzip_scrapes = False  # whether the last scrape took gzip
        self._tails: dict[bool, tuple[tuple[int, int], bytes, Deflated | None]] = {}
        self._bodies: dict[tuple[bool, bool], tuple[tuple[int, int, int], bytes]] = {}
        self._headers: dict[tuple[Family, bool], tuple[bytes, Deflated]] = {}
        self._node_lines: dict[str, tuple[Liveness, tuple[bytes, bytes, bytes, bytes]]] = {}
        self._packing: asyncio.Future[int] | None = None
        self._orphans: tuple[Liveness, ...] = ()  # nodes of dead gateways (the leader's)
        self._shards = ShardCache()
        # node families (NODE_PREFIX) by name: the samples last given and their lines
        self._node_families: dict[str, tuple[tuple[Sample, ...], NodeLines]] = {}

    @property
    def generation(self) -> tuple[int, int]:
        return (self.registry.generation, self._extra_generation)

    def families(self) -> list[FamilySamples]:
        """The exposition stage's own metric: how often the body was rebuilt."""
        return [one("gpurelay_gateway_metrics_bodies_built_total", self.bodies_built)]

    def set_extra(
        self, families: Iterable[FamilySamples], *, histograms: SelfMetrics | None = None
    ) -> None:
        """The gateway's own families (``gpurelay_gateway_*``: agents may not declare that
        prefix) and its histograms, appended after the node data on every scrape; they
        never invalidate the cached fleet part. Families named :data:`NODE_PREFIX` (the
        certificate expiry) are about nodes: they go with the node families instead."""
        families = list(families)
        own = [f for f in families if not f[0].name.startswith(NODE_PREFIX)]
        nodes = tuple(
            self._by_node(fam, tuple(samples))
            for fam, samples in families
            if fam.name.startswith(NODE_PREFIX)
        )
        extra = (
            render_families(own, openmetrics=False),
            render_families(own, openmetrics=True),
        )
        if histograms is not None:
            extra = (
                extra[0] + histograms.render(openmetrics=False),
                extra[1] + histograms.render(openmetrics=True),
            )
        if extra != self._extra or nodes != self._extra_nodes:
            self._extra, self._extra_nodes = extra, nodes
            self._extra_generation += 1

    def _by_node(self, family: Family, samples: tuple[Sample, ...]) -> NodeLines:
        """The family's lines by node; the same samples as on the last tick (the usual
        case: certificates change seldom) give the lines made then."""
        made = self._node_families.get(family.name)
        if made is not None and made[0] == samples and made[1][0] == family:
            return made[1]
        lines = self._node_family_lines(family, samples)
        self._node_families[family.name] = (samples, lines)
        return lines

    def _node_family_lines(self, family: Family, samples: Sequence[Sample]) -> NodeLines:
        label = self.registry.config.node_label
        return family, tuple(
            (
                dict(s.labels).get(label, ""),
                f"{s.name}{format_labels(s.labels)} {format_value(s.value)}\n".encode(),
            )
            for s in samples
        )

    def set_orphans(self, nodes: Iterable[Liveness]) -> None:
        """Offline nodes this gateway does not hold but answers for (the cluster's leader:
        nodes of dead gateways), in the node liveness families beside its own."""
        orphans = tuple(sorted(nodes, key=_name))
        if orphans != self._orphans:
            self._orphans = orphans
            self._extra_generation += 1

    async def scrape_shard_async(
        self, shard: int, shards: int, *, openmetrics: bool, gzip: bool
    ) -> Body:
        """One shard of the body (:mod:`cloud_gateway.exposition.shard_cache`)."""
        self.note_scrape(time.monotonic(), gzip=False)  # shards never use the pieces' gzip
        return await self._shards.body(self, (shard, shards, openmetrics), gzip=gzip)

    def fleet_generation(self) -> int:
        """Moves when a piece of the fleet part changed (brought up to the registry)."""
        self._read_fleet()
        return self._fleet_generation

    def current_fleet(self) -> list[tuple[Family, list[Piece]]]:
        return self._read_fleet()

    def family_header(self, family: Family, openmetrics: bool) -> bytes:
        return self._header(family, openmetrics)[0]

    def extra(self, openmetrics: bool) -> bytes:
        return self._extra[openmetrics]

    def scrape(self, *, openmetrics: bool, gzip: bool) -> Body:
        """The body, compressing in this thread what needs it (tests, benches)."""
        fleet = self._read_fleet()
        if gzip:
            pieces = [p for _, pieces in fleet for p in pieces]
            self._count_pack(pack(pieces, self.gzip_level))
        return self._assemble(fleet, openmetrics, gzip)

    async def scrape_async(self, *, openmetrics: bool, gzip: bool) -> Body:
        """:meth:`scrape` for the event loop that mutates the registry: only the pieces
        that changed are compressed, in a worker thread, once for all concurrent scrapers;
        reading the registry and listing the chunks stay on the loop (a few ms)."""
        self.note_scrape(time.monotonic(), gzip=gzip)
        fleet = self._read_fleet()
        if gzip:
            await self._pack_async(fleet)
        return self._assemble(fleet, openmetrics, gzip)

    async def _pack_async(self, fleet: list[tuple[Family, list[Piece]]]) -> None:
        """Compress the pieces no scrape compressed yet, in worker threads, shared."""
        pending = [p for _, pieces in fleet for p in pieces if p.packed is None]
        while pending:
            if self._packing is None:
                level = self.gzip_level
                self._packing = asyncio.ensure_future(pack_parallel(pending, level))
                self._packing.add_done_callback(self._packed)
            await asyncio.shield(self._packing)
            pending = [p for p in pending if p.packed is None]

    def body(self, *, openmetrics: bool, gzip: bool) -> bytes:
        """The whole body as one ``bytes``, the same object until something changes."""
        key = (openmetrics, gzip)
        self._read_fleet()
        generation = (self._fleet_generation, *self.generation)
        hit = self._bodies.get(key)
        if hit is None or hit[0] != generation:
            body = self.scrape(openmetrics=openmetrics, gzip=gzip).join()
            hit = self._bodies[key] = (generation, body)
        return hit[1]

    def _packed(self, task: asyncio.Future[int]) -> None:
        self._packing = None
        if not task.cancelled() and task.exception() is None:
            self._count_pack(task.result())

    def _count_pack(self, packed: int) -> None:
        if packed:
            self.bodies_built += 1

    def _read_fleet(self) -> list[tuple[Family, list[Piece]]]:
        """Bring the cached pieces up to the registry (see :meth:`_update`)."""
        if self._fleet_key == self.registry.generation:
            return self._fleet
        before = self._fleet_generation
        states = self.registry.family_states()
        fleet = [(fs.family, self._update(fs, groups)) for fs, groups in states]
        self._adopt(fleet)
        if self._fleet_generation != before:
            self.bodies_built += 1
        return fleet

    def _adopt(self, fleet: list[tuple[Family, list[Piece]]]) -> None:
        """``fleet`` (every family's pieces, just updated) is the registry's current state."""
        if [f.name for f, _ in fleet] != [f.name for f, _ in self._fleet]:
            self._fleet_generation += 1
            live = {f.name for f, _ in fleet}
            self._pieces = {k: v for k, v in self._pieces.items() if k in live}
            self._seen = {k: v for k, v in self._seen.items() if k in live}
            # a family gone from the fleet takes its header and shard entries with it (a
            # node churning family names on one connection grew them for good, issue 24)
            families = {f for f, _ in fleet}
            self._headers = {k: v for k, v in self._headers.items() if k[0] in families}
            self._shards.keep(live)
        self._fleet, self._fleet_key = fleet, self.registry.generation

    def _update(self, fs: FamilyState, groups: Sequence[Group]) -> list[Piece]:
        """One family's pieces: all kept when the family's state is the one seen last at
        the same version; else a piece whose blocks are the same groups at the same
        versions is kept, another is re-joined from the blocks that stayed (found in any
        old piece of the family) and the changed ones, rendered."""
        fam = fs.family
        seen = self._seen.get(fam.name)
        if seen is not None and seen[0] is fs and seen[1] == fs.version:
            return self._pieces[fam.name]
        self._seen[fam.name] = (fs, fs.version)
        before = self._pieces.get(fam.name, [])
        pieces = []
        step = self.piece_blocks
        kept: dict[int, tuple[Piece, int]] | None = None
        changed = False
        for k, start in enumerate(range(0, len(groups), step)):
            part = groups[start : start + step]
            versions = versions_of(part)
            if k < len(before) and before[k].same(part, versions):
                pieces.append(before[k])
                continue
            if kept is None:
                kept = {id(g): (p, i) for p in before for i, g in enumerate(p.groups)}
            blocks: list[bytes | memoryview] = []
            for g, version in zip(part, versions, strict=True):
                piece, at = kept.get(id(g), (None, 0))
                if piece is not None and piece.groups[at] is g and piece.versions[at] == version:
                    blocks.append(piece.block(at))
                else:
                    blocks.append(self.registry.render(g))
            pieces.append(Piece(part, versions, blocks))
            changed = True
        if changed or len(pieces) != len(before):
            self._fleet_generation += 1
        self._pieces[fam.name] = pieces
        return pieces

    def note_scrape(self, now: float, *, gzip: bool = False) -> None:
        """A scraper asked for the body at ``now`` (monotonic seconds): learn its period,
        and whether it takes gzip (Prometheus does)."""
        self._scrapes.append(now)
        self._gzip_scrapes = gzip

    def scrape_due(self, now: float, within: float) -> bool:
        """Whether a scrape is expected within ``within`` of ``now``: the last scrape plus
        the median gap between the recent ones (with several scrapers the median gap is
        shorter than each one's period: prepared more often, never later)."""
        times = self._scrapes
        if len(times) < 2:
            return False
        gaps = sorted(b - a for a, b in zip(times, list(times)[1:], strict=False))
        expected = times[-1] + gaps[len(gaps) // 2]
        return expected - within <= now <= expected + within  # a scraper gone: lazy again

    async def prepare(self, now: float, *, within: float = 1.1, slice_s: float = 0.02) -> bool:
        """On the gateway's tick: when a scrape is due before the next (1 s) tick, render
        the changed blocks and re-join their pieces now, family by family, yielding to
        the loop every ``slice_s`` seconds, and compress them in worker threads when the
        last scrape took gzip; the scrape then costs only what changed since.
        Blocks nobody is about to scrape stay unrendered (lazy between scrapes)."""
        if self._fleet_key == self.registry.generation or not self.scrape_due(now, within):
            return False
        deadline = time.perf_counter() + slice_s
        before, generation = self._fleet_generation, self.registry.generation
        fleet = []
        for fs, groups in self.registry.family_states():
            fleet.append((fs.family, self._update(fs, groups)))
            if time.perf_counter() > deadline:
                await asyncio.sleep(0)
                deadline = time.perf_counter() + slice_s
        if generation == self.registry.generation:  # nothing changed meanwhile: current
            self._adopt(fleet)
            if self._gzip_scrapes:  # compress ahead too, in worker threads
                await self._pack_async(fleet)
        self.prepared += 1
        if self._fleet_generation != before:
            self.bodies_built += 1
        return True

    def _assemble(
        self, fleet: list[tuple[Family, list[Piece]]], openmetrics: bool, gzip: bool
    ) -> Body:
        plain, tail = self._tail(openmetrics, gzip)
        if not gzip:
            chunks = [c for fam, pieces in fleet for c in self._plain(fam, pieces, openmetrics)]
            chunks.append(plain)
            return Body(tuple(chunks), sum(map(len, chunks)), False)
        parts: list[Deflated] = []
        for fam, pieces in fleet:
            parts.append(self._header(fam, openmetrics)[1])
            for p in pieces:
                assert p.packed is not None, "a gzip scrape packs its pieces first"
                parts.append(p.packed)
        assert tail is not None
        parts.append(tail)
        chunks = [GZIP_HEADER, *(p.data for p in parts), trailer(parts)]
        return Body(tuple(chunks), sum(map(len, chunks)), True)

    def _plain(self, fam: Family, pieces: list[Piece], openmetrics: bool) -> list[bytes]:
        return [self._header(fam, openmetrics)[0], *(p.plain for p in pieces)]

    def _tail(self, openmetrics: bool, gzip: bool) -> tuple[bytes, Deflated | None]:
        """Node liveness families, the gateway's own, and OpenMetrics' ``# EOF``: plain,
        and deflated as the gzip body's final part once a gzip scrape asked."""
        generation = self.generation
        hit = self._tails.get(openmetrics)
        if hit is None or hit[0] != generation:
            plain = b"".join(
                [*self.node_families(openmetrics), self._extra[openmetrics]]
                + ([b"# EOF\n"] if openmetrics else [])
            )
            hit = self._tails[openmetrics] = (generation, plain, None)
        if gzip and hit[2] is None:
            hit = self._tails[openmetrics] = (
                generation,
                hit[1],
                Deflated(hit[1], self.gzip_level, final=True),
            )
        return hit[1], hit[2]

    def _header(self, family: Family, openmetrics: bool) -> tuple[bytes, Deflated]:
        """The family's header lines, plain and deflated."""
        key = (family, openmetrics)
        hit = self._headers.get(key)
        if hit is None:
            plain = header(family, openmetrics=openmetrics)
            hit = self._headers[key] = (plain, Deflated(plain, self.gzip_level))
        return hit

    def node_families(
        self, openmetrics: bool, keep: Callable[[str], bool] | None = None
    ) -> list[bytes]:
        """``gpurelay_node_up``, ``_state``, ``_last_seen_...`` and ``_late_after_...``,
        then the per-node families of :meth:`set_extra` (of the nodes ``keep`` keeps, all
        by default); a node's liveness lines are re-rendered only when its values changed."""
        cache = self._node_lines
        columns: tuple[list[bytes], ...] = ([], [], [], [])
        nodes = self.registry.liveness()
        if self._orphans:
            nodes = sorted([*nodes, *self._orphans], key=_name)
        for live in nodes:
            if keep is not None and not keep(live.name):
                continue
            hit = cache.get(live.name)
            if hit is None or hit[0] != live:
                hit = cache[live.name] = (live, _node_lines(live, self.registry.config.node_label))
            for column, line in zip(columns, hit[1], strict=True):
                if line:
                    column.append(line)
        parts: list[bytes] = []
        for fam, lines in zip(NODE_FAMILIES, columns, strict=True):
            if lines:
                parts += [self._header(fam, openmetrics)[0], *lines]
        for fam, by_node in self._extra_nodes:
            kept = [line for node, line in by_node if keep is None or keep(node)]
            if kept:
                parts += [self._header(fam, openmetrics)[0], *kept]
        return parts


def _name(live: Liveness) -> str:
    return live.name


def _node_lines(live: Liveness, node_label: str) -> tuple[bytes, bytes, bytes, bytes]:
    """One node's lines, the node named by the registry's ``node_label`` as on its
    device series (``Hostname`` or ``hostname``)."""
    labels = format_labels(((node_label, live.name),))
    up = f"{NODE_UP.name}{labels} {int(live.up)}\n".encode()
    state = "".join(
        f"{NODE_STATE.name}{format_labels(((node_label, live.name), ('state', s)))} "
        f"{int(live.state == s)}\n"
        for s in NODE_STATES
    ).encode()
    seen = late = ""
    if live.last_seen is not None:
        seen = f"{NODE_LAST_SEEN.name}{labels} {format_value(float(live.last_seen))}\n"
    if live.late_after is not None:
        late = f"{NODE_LATE_AFTER.name}{labels} {format_value(round(live.late_after, 3))}\n"
    return up, state, seen.encode(), late.encode()
