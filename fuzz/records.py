"""Fuzz target: :class:`gpurelay.record.RecordDecoder` and :func:`decode_record`, what the
gateway does with the record a REPLAY frame carries.

Contract: any bytes raise nothing but :class:`~gpurelay.wire.WireError`; a decoded record
has one value per series, every series passes the DECLARE checks; and a decoder's memory
of series lists changes nothing (a second decode of the same record, now from the cache,
gives the same record).

Input: a control byte (``common.py``: plain form, small limits), then the record; in plain
form the payload is the inflated body, and ``GR1`` plus its zlib form is what is decoded.
"""

from __future__ import annotations

import sys
import zlib

import atheris

with atheris.instrument_imports(include=["gpurelay", "common"]):
    from common import PLAIN, SMALL, SMALL_LIMITS

    from gpurelay.record import MAGIC, Record, RecordDecoder, decode_record
    from gpurelay.wire import DEFAULT_LIMITS, SeriesDecl, WireError, check_series


def decoded(decode: object, data: bytes) -> Record | str:
    """The record, or the code of the WireError (anything else propagates: a crash)."""
    assert callable(decode)
    try:
        record = decode(data)
    except WireError as exc:
        return exc.code
    assert isinstance(record, Record)
    return record


def test_one_input(data: bytes) -> None:
    if not data:
        return
    control, record = data[0], data[1:]
    if control & PLAIN:
        record = MAGIC + zlib.compress(record, 1)
    limits = SMALL_LIMITS if control & SMALL else DEFAULT_LIMITS
    once = decoded(lambda d: decode_record(d, limits=limits), record)
    decoder = RecordDecoder(limits=limits)
    first = decoded(decoder.decode, record)
    again = decoded(decoder.decode, record)
    assert repr(once) == repr(first) == repr(again), (once, first, again)
    if isinstance(once, Record):
        assert len(once.series) == len(once.values) <= limits.max_series
        for name, labels in once.series:
            check_series(SeriesDecl(id=0, name=name, type="gauge", help="", labels=labels), limits)


def main() -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
