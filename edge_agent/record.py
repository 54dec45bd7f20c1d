"""The record codec: one collection as a self-contained, compressed byte string.

A record is what the agent keeps in its spool and what a REPLAY frame carries: unlike a
BATCH it depends on nothing sent before (no series ids, no previous values), so it can be
sent on any later connection, in any order, after any agent restart. Both sides import this
module; it is pure (no I/O, no clocks).

Layout: ``b"GR1" | zlib(body)``, and ``body`` is::

    u32 (big endian) J | J bytes of UTF-8 JSON | N x float64 (big endian)

with the JSON ``{"ts_ms": int, "series": [[name, [k1, v1, k2, v2, ...]], ...]}`` listing
N series; the i-th float64 is the value of the i-th series (bit exact: NaN, inf, -0.0).
Type and help are left out: the receiver of replayed samples (remote write) needs neither.
Label names and values repeat from series to series, so zlib takes a 500-series collection
from ~60 kB to a few kB.

The encoder leaves out series the gateway would refuse (the same checks as a DECLARE),
so one bad series never makes a whole record unsendable; the decoder enforces those checks
and raises :class:`~edge_agent.wire.WireError` (code ``malformed`` and friends) for anything
else, so a damaged or hostile record closes only its connection.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass
from typing import Final

from edge_agent.model import Labels, Snapshot
from edge_agent.wire import Limits, SeriesDecl, WireError, check_series

MAGIC: Final = b"GR1"
MAX_RECORD_BYTES: Final = 64 * 1024 * 1024  # inflated body, whatever the frame limit
_U32: Final = struct.Struct(">I")
_MAX_TIMESTAMP_MS: Final = 2**62
_MAX_REMEMBERED: Final = 200_000  # checked series keys kept by one encoder or decoder
_DEFAULT_LIMITS: Final = Limits()


@dataclass(frozen=True, slots=True)
class RecordSeries:
    name: str
    labels: Labels
    value: float


@dataclass(frozen=True, slots=True)
class Record:
    timestamp_ms: int
    series: tuple[RecordSeries, ...]


class RecordEncoder:
    """Snapshots to records. Remembers which series passed the checks (they are the same
    from one collection to the next), so a steady collection is checked once."""

    def __init__(self, *, limits: Limits = _DEFAULT_LIMITS, level: int = 6) -> None:
        self._limits = limits
        self._level = level
        self._ok: set[tuple[str, Labels]] = set()
        self._bad: set[tuple[str, Labels]] = set()

    def encode(self, snapshot: Snapshot) -> bytes:
        seen: set[tuple[str, Labels]] = set()
        meta: list[object] = []
        values: list[float] = []
        limit = self._limits.max_series
        for sample in snapshot.samples:
            key = (sample.name, sample.labels)
            if key in seen or not self._acceptable(key):
                continue
            if len(values) >= limit:
                break
            seen.add(key)
            flat = [part for pair in sample.labels for part in pair]
            meta.append([sample.name, flat])
            values.append(float(sample.value))
        head = json.dumps(
            {"ts_ms": round(snapshot.timestamp * 1000), "series": meta},
            ensure_ascii=False,
            separators=(",", ":"),
        ).encode()
        body = _U32.pack(len(head)) + head + struct.pack(f">{len(values)}d", *values)
        return MAGIC + zlib.compress(body, self._level)

    def _acceptable(self, key: tuple[str, Labels]) -> bool:
        if key in self._ok:
            return True
        if key in self._bad:
            return False
        name, labels = key
        try:
            check_series(
                SeriesDecl(id=0, name=name, type="gauge", help="", labels=labels), self._limits
            )
        except WireError:
            if len(self._bad) < _MAX_REMEMBERED:
                self._bad.add(key)
            return False
        if len(self._ok) >= _MAX_REMEMBERED:
            self._ok.clear()
        self._ok.add(key)
        return True


class RecordDecoder:
    """Records to :class:`Record`; :class:`WireError` for anything malformed.

    Remembers the series that passed the checks (bounded), so replaying a backlog of
    collections of the same series checks each series once."""

    def __init__(self, *, limits: Limits = _DEFAULT_LIMITS) -> None:
        self._limits = limits
        self._known: dict[tuple[str, tuple[str, ...]], Labels] = {}

    def decode(self, data: bytes) -> Record:
        body, head_end, ts_ms, meta = _open(data, self._limits)
        n = len(meta)
        values = struct.unpack_from(f">{n}d", body, head_end)
        known = self._known
        series: list[RecordSeries] = []
        seen: set[tuple[str, Labels]] = set()
        for i, (entry, value) in enumerate(zip(meta, values, strict=True)):
            labels = None
            if type(entry) is list and len(entry) == 2 and type(entry[1]) is list:
                name, flat = entry
                try:
                    labels = known.get((name, tuple(flat)))
                except TypeError:  # something unhashable: the full check says what
                    labels = None
            if labels is None:
                name, labels = _series_meta(entry, i)
                decl = SeriesDecl(id=i, name=name, type="gauge", help="", labels=labels)
                check_series(decl, self._limits)
                if len(known) >= _MAX_REMEMBERED:
                    known.clear()
                known[(name, tuple(part for pair in labels for part in pair))] = labels
            key = (name, labels)
            if key in seen:
                raise WireError("malformed", f"REPLAY record lists series {name}{labels} twice")
            seen.add(key)
            series.append(RecordSeries(name, labels, value))
        return Record(timestamp_ms=ts_ms, series=tuple(series))


def decode_record(data: bytes, *, limits: Limits = _DEFAULT_LIMITS) -> Record:
    """One record, without a memory of earlier ones (see :class:`RecordDecoder`)."""
    return RecordDecoder(limits=limits).decode(data)


def _open(data: bytes, limits: Limits) -> tuple[bytes, int, int, list[object]]:
    """Inflate and check the frame of a record: (body, end of header, ts_ms, series meta)."""
    if not data.startswith(MAGIC):
        raise WireError("malformed", "REPLAY record does not start with the record magic GR1")
    inflater = zlib.decompressobj()
    try:
        body = inflater.decompress(data[len(MAGIC) :], MAX_RECORD_BYTES + 1)
    except zlib.error as exc:
        raise WireError("malformed", f"REPLAY record is not valid zlib data ({exc})") from exc
    if len(body) > MAX_RECORD_BYTES or inflater.unconsumed_tail:
        raise WireError("oversize", f"REPLAY record inflates to more than {MAX_RECORD_BYTES} bytes")
    if not inflater.eof or inflater.unused_data:
        raise WireError("malformed", "REPLAY record is truncated or has trailing bytes")
    if len(body) < 4:
        raise WireError("malformed", "REPLAY record is shorter than its header")
    (head_len,) = _U32.unpack_from(body, 0)
    head_end = 4 + head_len
    if head_end > len(body):
        raise WireError("malformed", "REPLAY record header is longer than the record")
    try:
        head = json.loads(body[4:head_end].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise WireError("malformed", f"REPLAY record header is not valid JSON ({exc})") from exc
    if not isinstance(head, dict) or set(head) != {"ts_ms", "series"}:
        raise WireError("malformed", "REPLAY record header must be {ts_ms, series}")
    ts_ms, meta = head["ts_ms"], head["series"]
    if type(ts_ms) is not int or abs(ts_ms) >= _MAX_TIMESTAMP_MS:
        raise WireError("malformed", f"REPLAY record timestamp {ts_ms!r} is not usable")
    if not isinstance(meta, list):
        raise WireError("malformed", "REPLAY record series is not a list")
    n = len(meta)
    if n > limits.max_series:
        raise WireError(
            "too_many_series",
            f"REPLAY record has {n} series, more than the limit of {limits.max_series}",
        )
    if len(body) - head_end != 8 * n:
        raise WireError(
            "malformed",
            f"REPLAY record lists {n} series but has {len(body) - head_end} value bytes",
        )
    return body, head_end, ts_ms, meta


def _series_meta(entry: object, i: int) -> tuple[str, Labels]:
    if not (isinstance(entry, list) and len(entry) == 2):
        raise WireError("malformed", f"REPLAY record series[{i}] is not [name, labels]")
    name, flat = entry
    if not isinstance(name, str) or not isinstance(flat, list) or len(flat) % 2:
        raise WireError("malformed", f"REPLAY record series[{i}] has a bad name or label list")
    if not all(isinstance(part, str) for part in flat):
        raise WireError("malformed", f"REPLAY record series[{i}] has a label that is not text")
    return name, tuple(zip(flat[0::2], flat[1::2], strict=True))
