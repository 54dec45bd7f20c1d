"""The encode stage: snapshots to wire frames (pure, no I/O).

Each series, keyed by (name, labels), gets a small integer id the first time it is seen;
the id is declared once per connection (name, type, help, labels) and from then on a
batch carries only ``id -> value`` for the values that changed. Ids are never reused:
a series that vanishes is listed in ``removed`` and gets a fresh id if it comes back.

After :meth:`SnapshotEncoder.reset` (a new connection) the next call re-declares every
live series under the ids it already has and sends a full batch, so the gateway can
replace whatever it knew about the node.
"""

from __future__ import annotations

import logging
import math

from gpurelay.model import Family, SeriesKey, Snapshot
from gpurelay.wire import (
    DEFAULT_LIMITS,
    Batch,
    Declare,
    Frame,
    Limits,
    SeriesDecl,
    WireError,
    check_series,
)

log = logging.getLogger(__name__)

_MAX_REMEMBERED_REJECTS = 1000


def _same(a: float, b: float) -> bool:
    """Bit-level sameness for change detection: NaN is NaN, -0.0 is not 0.0."""
    if a == b:
        return a != 0.0 or math.copysign(1.0, a) == math.copysign(1.0, b)
    return math.isnan(a) and math.isnan(b)


def _parts(series: tuple[SeriesDecl, ...], limits: Limits) -> list[tuple[SeriesDecl, ...]]:
    """Split declarations so that no DECLARE frame can exceed ``limits.max_frame_bytes``.

    A character takes at most 6 bytes in the frame's JSON (``\\u001f``), so parts of at
    most an eighth of the limit in characters always fit. One part in the common case.
    """
    budget = limits.max_frame_bytes // 8
    parts: list[tuple[SeriesDecl, ...]] = []
    start = size = 0
    for i, d in enumerate(series):
        cost = 64 + len(d.name) + len(d.help) + sum(len(k) + len(v) + 8 for k, v in d.labels)
        if size + cost > budget and i > start:
            parts.append(series[start:i])
            start, size = i, 0
        size += cost
    if start < len(series):
        parts.append(series[start:])
    return parts


class SnapshotEncoder:
    """Turns each snapshot into ``[Declare]`` (when there are new series) + ``[Batch]``.

    (Several DECLARE frames, in the rare case that one would exceed the frame limit.)

    Series the gateway would refuse are left out rather than sent, so one bad series cannot
    stop the stream: a bad name or label for good (logged once, kept in :attr:`rejected`),
    series beyond ``Limits.max_series`` until there is room (counted in :attr:`over_limit`).
    """

    def __init__(self, *, first_seq: int = 1, limits: Limits = DEFAULT_LIMITS) -> None:
        self._limits = limits
        self._seq = first_seq
        self._next_id = 0
        self._ids: dict[SeriesKey, int] = {}
        self._decls: dict[int, SeriesDecl] = {}  # live series by id
        self._last: dict[int, float] = {}  # the value last put in a batch, by id
        self._fresh = True  # nothing declared on the current connection yet
        self.rejected: dict[SeriesKey, str] = {}  # series left out for good, and why
        self.over_limit = 0  # series left out of the last snapshot for Limits.max_series
        self._last_raw: list[SeriesKey] | None = None  # the last snapshot's series, as given
        self._order: list[tuple[int, int]] = []  # their ids, by index of first sample

    @property
    def next_seq(self) -> int:
        return self._seq

    def reset(self) -> None:
        """A new connection: re-declare every live series and send a full batch next."""
        self._fresh = True

    def frames(self, snapshot: Snapshot, *, seq: int | None = None) -> list[Frame]:
        """Frames for one collection; ``seq`` (increasing) replaces the encoder's own count."""
        if seq is not None:
            self._seq = seq
        samples = snapshot.samples
        raw = [(sample.name, sample.labels) for sample in samples]
        new: list[SeriesDecl] = []
        if raw == self._last_raw and not self.over_limit:
            # The same series in the same order as last time: the same ids, nothing new,
            # nothing gone; only the values are read.
            if not self._fresh:  # the steady state: compare as they are read
                return [self._steady_batch(snapshot)]
            current = {sid: samples[i].value for sid, i in self._order}
            removed: list[int] = []
        else:
            current, removed = self._assign_all(snapshot, raw, new)
        out: list[Frame] = []
        if self._fresh:
            declared = tuple(sorted(self._decls.values(), key=lambda d: d.id))
            changed = sorted(current.items())
            removed = []  # never declared on this connection: the full batch says enough
        else:
            declared = tuple(new)
            changed = self._changed(current)
        out.extend(Declare(series=part) for part in _parts(declared, self._limits))
        out.append(
            Batch(
                seq=self._seq,
                timestamp=snapshot.timestamp,
                values=tuple(changed),
                removed=tuple(sorted(removed)),
                full=self._fresh,
            )
        )
        self._last.update(changed)
        self._seq += 1
        self._fresh = False
        return out

    def _assign_all(
        self, snapshot: Snapshot, raw: list[SeriesKey], new: list[SeriesDecl]
    ) -> tuple[dict[int, float], list[int]]:
        """Ids for every series (declaring the new ones), and the ids of those gone."""
        families = {f.name: f for f in snapshot.families}
        self.over_limit = 0
        current: dict[int, float] = {}
        order: list[tuple[int, int]] = []  # (id, index of its first sample)
        for i, (key, sample) in enumerate(zip(raw, snapshot.samples, strict=True)):
            sid = self._ids.get(key)
            if sid is None:
                sid = self._assign(key, families.get(sample.name), snapshot.node, new)
                if sid is None:
                    continue
            if sid not in current:  # a repeated series: the first one wins
                current[sid] = sample.value
                order.append((sid, i))
        removed = [sid for sid in self._decls if sid not in current]
        for sid in removed:
            decl = self._decls.pop(sid)
            del self._ids[(decl.name, decl.labels)]
            self._last.pop(sid, None)
        self._last_raw, self._order = raw, order
        return current, removed

    def _steady_batch(self, snapshot: Snapshot) -> Batch:
        """The batch of a snapshot with last time's series in last time's order: one pass
        over the values, equal non-zero values skipped without a call (``_same`` decides
        zeros and NaNs)."""
        samples = snapshot.samples
        last = self._last
        changed = []
        for sid, i in self._order:
            value = samples[i].value
            prev = last.get(sid)
            if prev == value and value:
                continue
            if prev is None or not _same(prev, value):
                changed.append((sid, value))
        changed.sort()
        last.update(changed)
        batch = Batch(
            seq=self._seq,
            timestamp=snapshot.timestamp,
            values=tuple(changed),
            removed=(),
            full=False,
        )
        self._seq += 1
        return batch

    def _changed(self, current: dict[int, float]) -> list[tuple[int, float]]:
        last = self._last
        changed = []
        for sid, value in current.items():
            prev = last.get(sid)
            if prev is None or not _same(prev, value):
                changed.append((sid, value))
        changed.sort()
        return changed

    def _assign(
        self, key: SeriesKey, family: Family | None, node: str, new: list[SeriesDecl]
    ) -> int | None:
        """Give a first-seen series an id and a declaration; None if it must be left out."""
        if key in self.rejected:
            return None
        name, labels = key
        decl = SeriesDecl(
            id=self._next_id,
            name=name,
            type=family.type if family else "gauge",
            help=family.help if family else "",
            labels=labels,
        )
        if len(self._decls) >= self._limits.max_series:
            if not self.over_limit:
                log.warning(
                    "node %s has more than %d series; the rest are left out of the stream",
                    node,
                    self._limits.max_series,
                )
            self.over_limit += 1
            return None
        try:
            check_series(decl, self._limits)
        except WireError as exc:
            if len(self.rejected) < _MAX_REMEMBERED_REJECTS:
                self.rejected[key] = str(exc)
            log.warning("node %s: series %s left out of the stream: %s", node, name, exc)
            return None
        self._next_id += 1
        self._ids[key] = decl.id
        self._decls[decl.id] = decl
        new.append(decl)
        return decl.id
