"""Regression tests for what fuzzing the decoders (fuzz/, make fuzz) found: each input once
raised something other than WireError."""

from __future__ import annotations

import struct
import zlib

import pytest

from gpurelay.record import MAGIC, RecordDecoder, decode_record
from gpurelay.wire import WireError


def _record(head: bytes, values: tuple[float, ...]) -> bytes:
    body = struct.pack(">qI", 1_790_000_000_000, len(head)) + head
    return MAGIC + zlib.compress(body + struct.pack(f">{len(values)}d", *values))


def test_record_with_an_integer_past_pythons_digit_limit_is_malformed() -> None:
    """json.loads raises a plain ValueError (not JSONDecodeError) for an integer of more
    than 4300 digits; the record decoder let it out, so a node's REPLAY ended its channel
    with a traceback instead of an ERROR frame."""
    record = _record(b"[[" + b"1" * 4301 + b",[]]]", (1.0,))
    with pytest.raises(WireError) as caught:
        decode_record(record)
    assert caught.value.code == "malformed"
    with pytest.raises(WireError):
        RecordDecoder().decode(record)
