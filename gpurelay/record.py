"""The record codec: one collection as a self-contained, compressed byte string.

A record is what the agent keeps in its spool and what a REPLAY frame carries: unlike a
BATCH it depends on nothing sent before (no series ids, no previous values), so it can be
sent on any later connection, in any order, after any agent restart. Both sides import this
module; it is pure (no I/O, no clocks).

Layout: ``b"GR1" | zlib(body)``, and ``body`` is (big endian)::

    i64 ts_ms | u32 J | J bytes of UTF-8 JSON | N x float64

with the JSON ``[[name, [k1, v1, k2, v2, ...]], ...]`` listing the N series; the i-th
float64 is the value of the i-th series (bit exact: NaN, inf, -0.0). Type and help are left
out: the receiver of replayed samples (remote write) needs neither. Label names and values
repeat from series to series, so zlib takes a 740-series collection from ~60 kB to ~8.5 kB.
The series list is the same from one collection to the next while nothing comes or goes,
so both ends keep the last few: the encoder reuses its JSON, the decoder its parsed and
checked series (``Record.series`` is then the very same tuple, which lets the gateway
reuse what it derived from it).

The encoder leaves out series the gateway would refuse (the same checks as a DECLARE),
so one bad series never makes a whole record unsendable; the decoder enforces those checks
and raises :class:`~gpurelay.wire.WireError` (code ``malformed`` and friends) for anything
else, so a damaged or hostile record closes only its connection.
"""

from __future__ import annotations

import json
import re
import struct
import sys
import zlib
from array import array
from dataclasses import dataclass
from typing import Final

from gpurelay.model import Labels, SeriesKey, Snapshot
from gpurelay.wire import DEFAULT_LIMITS, Limits, SeriesDecl, WireError, check_series

MAGIC: Final = b"GR1"
# Bounds that hold before any parsing (a record is data from a node; issue 12): the
# inflated body, and its series list. An 8-GPU node's list is ~60 kB; a node at the
# default label budget (4 MiB of names and labels) fits in the 8 MiB below.
MAX_RECORD_BYTES: Final = 16 * 1024 * 1024
MAX_SERIES_LIST_BYTES: Final = 8 * 1024 * 1024
_HEADER_CACHE_BYTES: Final = 4 * 1024 * 1024  # parsed series lists kept, by their size
# A JSON string, to blank out before counting the list's brackets.
_JSON_STRING: Final = re.compile(rb'"(?:[^"\\]|\\.)*"')
_HEAD: Final = struct.Struct(">qI")
_MAX_TIMESTAMP_MS: Final = 2**62
_MAX_REMEMBERED: Final = 200_000  # checked series keys kept by one encoder or decoder
_HEADERS_KEPT: Final = 8  # series lists a decoder keeps, parsed
_ZLIB_HEADER: Final = b"\x78\x9c"  # deflate, 32 KiB window, default level: what zlib writes
_U32: Final = struct.Struct(">I")
_LITTLE_ENDIAN: Final = sys.byteorder == "little"  # array("d") is native-endian
# A non-final stored deflate block of _HEAD.size bytes: LEN, NLEN (little endian).
_STORED_PREFIX: Final = b"\x00" + struct.pack("<HH", _HEAD.size, 0xFFFF ^ _HEAD.size)
_VALUES_DEFLATE: Final = zlib.compressobj(1, zlib.DEFLATED, -15)  # copied, never fed
_ADLER_MOD: Final = 65521


def _adler32_concat(a: int, b: int, b_len: int) -> int:
    """adler32(x + y) from a = adler32(x), b = adler32(y) and len(y) (zlib's combine)."""
    a1, a2 = a & 0xFFFF, a >> 16
    b1, b2 = b & 0xFFFF, b >> 16
    s1 = (a1 + b1 - 1) % _ADLER_MOD
    s2 = (a2 + b2 + b_len * (a1 - 1)) % _ADLER_MOD
    return (s2 << 16) | s1


@dataclass(frozen=True, slots=True)
class Record:
    timestamp_ms: int
    series: tuple[SeriesKey, ...]  # (name, labels) of each series
    values: tuple[float, ...]  # values[i] is the value of series[i]


class RecordEncoder:
    """Snapshots to records. Remembers which series passed the checks (they are the same
    from one collection to the next), so a steady collection is checked once."""

    def __init__(self, *, limits: Limits = DEFAULT_LIMITS, level: int = 6) -> None:
        self._limits = limits
        self._level = level
        self._ok: set[SeriesKey] = set()
        self._bad: set[SeriesKey] = set()
        self._last_keys: list[SeriesKey] = []
        self._last_json = b"[]"
        self._head_deflated: bytes | None = None
        self._head_adler = 1
        self._last_raw: list[SeriesKey] | None = None  # the last snapshot's series, as given
        self._pick: list[int] | None = None  # which of them went in (None: all)

    def encode(self, snapshot: Snapshot) -> bytes:
        samples = snapshot.samples
        raw = [(sample.name, sample.labels) for sample in samples]
        same = raw == self._last_raw  # then the keys are last time's too
        if not same:  # new series, or gone: pick again which ones go in
            self._last_raw = raw
            self._pick = self._select(raw)
        pick = self._pick
        if pick is None:
            keys = raw
            values = array("d", [sample.value for sample in samples])
        else:
            keys = [raw[i] for i in pick]
            values = array("d", [samples[i].value for i in pick])
        if not same and keys != self._last_keys:
            meta = [[name, [part for pair in labels for part in pair]] for name, labels in keys]
            self._last_keys = keys
            self._last_json = json.dumps(meta, ensure_ascii=False, separators=(",", ":")).encode()
            self._head_deflated = None
        head = self._last_json
        ts_ms = round(snapshot.timestamp * 1000)
        prefix = _HEAD.pack(ts_ms, len(head))
        if _LITTLE_ENDIAN:
            values.byteswap()
        packed = values.tobytes()  # big-endian doubles, as struct.pack(">…d") makes
        if self._head_deflated is None:
            # The series list is compressed once per list, not once per record.
            c = zlib.compressobj(self._level, zlib.DEFLATED, -15)
            self._head_deflated = c.compress(head) + c.flush(zlib.Z_FULL_FLUSH)
            self._head_adler = zlib.adler32(head)
        # The zlib stream of the same body as zlib.compress(body) would make, built from
        # independent byte-aligned raw deflate parts: the 12-byte prefix as a stored block,
        # the cached series list, then the values (level 1: floats gain little from more).
        lead = _STORED_PREFIX + prefix
        tail = _VALUES_DEFLATE.copy()
        rest = tail.compress(packed) + tail.flush(zlib.Z_FINISH)
        check = _adler32_concat(zlib.adler32(prefix), self._head_adler, len(head))
        check = zlib.adler32(packed, check)
        parts = (MAGIC, _ZLIB_HEADER, lead, self._head_deflated, rest, _U32.pack(check))
        return b"".join(parts)

    def _select(self, raw: list[SeriesKey]) -> list[int] | None:
        """Indexes of the series that go in (first of a repeat, acceptable, within the
        limit); None when that is all of them."""
        seen: set[SeriesKey] = set()
        pick: list[int] = []
        limit = self._limits.max_series
        for i, key in enumerate(raw):
            if key in seen or not self._acceptable(key):
                continue
            if len(pick) >= limit:
                break
            seen.add(key)
            pick.append(i)
        return None if len(pick) == len(raw) else pick

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

    Keeps the last few series lists it parsed and checked, by their exact bytes: a backlog
    of collections of the same series is parsed once, then each record costs an inflate
    and an unpack of its values."""

    def __init__(self, *, limits: Limits = DEFAULT_LIMITS) -> None:
        self._limits = limits
        self._headers: dict[bytes, tuple[SeriesKey, ...]] = {}
        self._known: dict[tuple[str, tuple[str, ...]], Labels] = {}

    def decode(self, data: bytes) -> Record:
        body, ts_ms, head = _open(data)
        start = _HEAD.size + len(head)
        n, odd = divmod(len(body) - start, 8)
        if odd:
            raise WireError("malformed", "REPLAY record values are not whole float64s")
        series = self._headers.get(head)
        if series is None:
            self._check_shape(head, n)  # before parsing: its cost is bounded by n
            series = self._parse(head)
            self._remember(head, series)
        if len(series) != n:
            raise WireError(
                "malformed", f"REPLAY record lists {len(series)} series but has {8 * n} value bytes"
            )
        return Record(ts_ms, series, struct.unpack_from(f">{n}d", body, start))

    def _check_shape(self, head: bytes, n: int) -> None:
        """Refuse a series list that cannot belong to ``n`` values, without parsing it:
        too many series, more bytes than ``n`` series can take under the limits, or other
        brackets than ``[[name, [labels]], ...]`` has (2n + 1, outside strings)."""
        limits = self._limits
        if n > limits.max_series:
            raise WireError(
                "too_many_series",
                f"REPLAY record has {n} values, more than the limit of {limits.max_series} series",
            )
        if len(head) > MAX_SERIES_LIST_BYTES:
            raise WireError(
                "oversize",
                f"REPLAY record series list is {len(head)} bytes, more than the limit of "
                f"{MAX_SERIES_LIST_BYTES}",
            )
        structure = _JSON_STRING.sub(b"", head)
        if b"{" in structure:
            raise WireError("malformed", "REPLAY record series is not a list of [name, labels]")
        brackets = structure.count(b"[")
        if brackets != 2 * n + 1:
            listed = max(0, (brackets - 1) // 2)
            raise WireError(
                "malformed", f"REPLAY record lists {listed} series but has {8 * n} value bytes"
            )
        # a JSON string is at most 6x its text (\\u escapes); 8 bytes of brackets and commas
        per_label = 6 * (limits.max_name_bytes + limits.max_label_value_bytes) + 6
        per_series = 8 + 6 * limits.max_name_bytes + limits.max_labels * per_label
        if len(head) > 2 + n * per_series:
            raise WireError(
                "oversize",
                f"REPLAY record series list is {len(head)} bytes, more than {n} series can take",
            )

    def _remember(self, head: bytes, series: tuple[SeriesKey, ...]) -> None:
        if len(head) > _HEADER_CACHE_BYTES // _HEADERS_KEPT:
            return  # an outsized list is parsed each time rather than held
        if len(self._headers) >= _HEADERS_KEPT:
            self._headers.pop(next(iter(self._headers)))
        self._headers[head] = series

    def _parse(self, head: bytes) -> tuple[SeriesKey, ...]:
        try:
            meta = json.loads(head.decode("utf-8"))
        # ValueError: JSONDecodeError, UnicodeDecodeError, and int()'s 4300-digit limit
        except (ValueError, RecursionError) as exc:
            raise WireError(
                "malformed", f"REPLAY record series are not valid JSON ({exc})"
            ) from exc
        if not isinstance(meta, list):
            raise WireError("malformed", "REPLAY record series is not a list")
        if len(meta) > self._limits.max_series:
            raise WireError(
                "too_many_series",
                f"REPLAY record has {len(meta)} series, more than the limit of "
                f"{self._limits.max_series}",
            )
        known = self._known
        series: list[SeriesKey] = []
        seen: set[SeriesKey] = set()
        for i, entry in enumerate(meta):
            name, labels = _series_meta(entry, i)
            flat = tuple(part for pair in labels for part in pair)
            cached = known.get((name, flat))
            if cached is None:
                decl = SeriesDecl(id=i, name=name, type="gauge", help="", labels=labels)
                check_series(decl, self._limits)
                if len(known) >= _MAX_REMEMBERED:
                    known.clear()
                known[(name, flat)] = cached = labels
            key = (name, cached)
            if key in seen:
                raise WireError("malformed", f"REPLAY record lists series {name}{labels} twice")
            seen.add(key)
            series.append(key)
        return tuple(series)


def decode_record(data: bytes, *, limits: Limits = DEFAULT_LIMITS) -> Record:
    """One record, without a memory of earlier ones (see :class:`RecordDecoder`)."""
    return RecordDecoder(limits=limits).decode(data)


def _open(data: bytes) -> tuple[bytes, int, bytes]:
    """Inflate a record and check its frame: (body, ts_ms, series JSON bytes)."""
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
    if len(body) < _HEAD.size:
        raise WireError("malformed", "REPLAY record is shorter than its header")
    ts_ms, head_len = _HEAD.unpack_from(body, 0)
    if abs(ts_ms) >= _MAX_TIMESTAMP_MS:
        raise WireError("malformed", f"REPLAY record timestamp {ts_ms} ms is not usable")
    end = _HEAD.size + head_len
    if end > len(body):
        raise WireError("malformed", "REPLAY record series list is longer than the record")
    return body, ts_ms, bytes(body[_HEAD.size : end])


def _series_meta(entry: object, i: int) -> tuple[str, Labels]:
    if not (isinstance(entry, list) and len(entry) == 2):
        raise WireError("malformed", f"REPLAY record series[{i}] is not [name, labels]")
    name, flat = entry
    if not isinstance(name, str) or not isinstance(flat, list) or len(flat) % 2:
        raise WireError("malformed", f"REPLAY record series[{i}] has a bad name or label list")
    if not all(isinstance(part, str) for part in flat):
        raise WireError("malformed", f"REPLAY record series[{i}] has a label that is not text")
    return name, tuple(zip(flat[0::2], flat[1::2], strict=True))
