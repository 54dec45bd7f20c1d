"""Fuzz target: :meth:`gpurelay.wire.FrameDecoder.feed`, the gateway's first look at a node.

Contract: any bytes, in any chunking, raise nothing but :class:`~gpurelay.wire.WireError`;
the decoder holds at most one partial frame; after an error it refuses more input. And
the chunking changes nothing: the stream fed whole and fed in pieces gives the same frames
(or the same error code). An ACK_RANGES frame that was accepted encodes back to itself.

Input: a control byte (see ``common.py``: plain form, small limits, chunking), then the
stream. Run: ``python fuzz/frames.py CORPUS_DIR [libFuzzer flags]`` (``fuzz/run.py`` does).
"""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports():
    from common import PLAIN, SMALL, SMALL_LIMITS, plain_to_wire, split

    from gpurelay.wire import DEFAULT_LIMITS, AckRanges, Frame, FrameDecoder, Limits, WireError
    from gpurelay.wire.ackranges import encode_ack_ranges, parse_ack_ranges


def decode(chunks: tuple[bytes, ...], limits: Limits) -> tuple[list[Frame], str | None]:
    """The frames the chunks give and the error code they end in (None: no error)."""
    decoder = FrameDecoder(limits=limits)
    frames: list[Frame] = []
    try:
        for chunk in chunks:
            frames += decoder.feed(chunk)
            assert decoder.pending < 4 + limits.max_frame_bytes, decoder.pending
    except WireError as exc:
        try:
            decoder.feed(b"\x00")
        except WireError:
            pass
        else:
            raise AssertionError("the decoder took input after it failed") from exc
        return frames, exc.code
    return frames, None


def test_one_input(data: bytes) -> None:
    if not data:
        return
    control, stream = data[0], data[1:]
    if control & PLAIN:
        stream = plain_to_wire(stream)
    limits = SMALL_LIMITS if control & SMALL else DEFAULT_LIMITS
    whole, whole_error = decode((stream,), limits)
    pieces, pieces_error = decode(split(stream, control), limits)
    assert whole_error == pieces_error, (whole_error, pieces_error)
    if whole_error is None:
        assert repr(whole) == repr(pieces), "the chunking changed the frames"
    for frame in whole:  # ACK_RANGES is canonical: what was accepted encodes back to it
        if isinstance(frame, AckRanges):
            assert parse_ack_ranges(encode_ack_ranges(frame)) == frame, frame


def main() -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
