"""ACK_RANGES (frame type 9) and HELLO's ``ack_delay_seconds``: the codec, strictly.

Properties: any set of seqs round-trips through coalesce -> encode -> decode; the form is
canonical (every byte string the decoder accepts is exactly what the encoder writes for
its ranges); anything else is a ``malformed`` WireError, never another exception."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpurelay.wire import (
    AckRanges,
    FrameDecoder,
    FrameEncoder,
    FrameType,
    Hello,
    WireError,
)
from gpurelay.wire.ackranges import (
    coalesce,
    covered,
    encode_ack_ranges,
    frames_for,
    parse_ack_ranges,
)
from gpurelay.wire.frames import HEADER, MAX_ACK_RANGES, MAX_SEQ, PROTOCOL_VERSION
from gpurelay.wire.payloads import dump_json, hello_json, parse_hello

seqs_strategy = st.sets(
    st.one_of(
        st.integers(0, 200),
        st.integers(MAX_SEQ - 200, MAX_SEQ),
        st.integers(1_790_000_000_000, 1_790_000_000_300),
    ),
    min_size=1,
    max_size=300,
)


def raw(ftype: FrameType, body: bytes) -> bytes:
    return HEADER.pack(len(body) + 2, PROTOCOL_VERSION, ftype) + body


def expect_malformed(body: bytes) -> WireError:
    with pytest.raises(WireError) as info:
        FrameDecoder().feed(raw(FrameType.ACK_RANGES, body))
    assert info.value.code == "malformed"
    return info.value


@given(seqs=seqs_strategy)
@settings(max_examples=300, deadline=None)
def test_any_set_of_seqs_round_trips_and_is_covered_exactly(seqs: set[int]) -> None:
    (frame,) = frames_for(seqs)
    assert sum(last - first + 1 for first, last in frame.ranges) == len(seqs) == frame.seqs()
    (decoded,) = FrameDecoder().feed(FrameEncoder().encode(frame))
    assert decoded == frame
    assert covered(frame.ranges, seqs) == seqs
    everything = set(range(0, 300)) | {MAX_SEQ - i for i in range(300)}
    assert covered(frame.ranges, everything) == seqs & everything


@given(body=st.binary(max_size=40))
@settings(max_examples=1000, deadline=None)
def test_the_form_is_canonical_and_garbage_is_only_ever_malformed(body: bytes) -> None:
    try:
        frame = parse_ack_ranges(body)
    except WireError as exc:
        assert exc.code == "malformed"
        return
    except IndexError:  # a varint cut short: the decoder's boundary makes it malformed
        expect_malformed(body)
        return
    assert encode_ack_ranges(frame) == body
    for (_, last), (first, _) in zip(frame.ranges, frame.ranges[1:], strict=False):
        assert first >= last + 2  # ascending, disjoint, not adjacent


def test_a_live_nodes_few_seconds_of_acks_are_a_few_bytes() -> None:
    first = 1_790_000_000_123
    frame = AckRanges(ranges=coalesce(range(first, first + 4)))
    assert frame.ranges == ((first, first + 3),)
    assert len(FrameEncoder().encode(frame)) == 6 + 1 + 6 + 1  # header, count, first, length


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (b"", "in the middle of a field"),
        (b"\x00", "claims 0 ranges"),
        (bytes([0x81, 0x08]) + b"\x00\x00" * 1025, "claims 1025 ranges"),
        (b"\x02\x05\x00", "claims 2 ranges"),  # not enough bytes for the claim
        (b"\x01\x05\x00\x00", "1 bytes left over"),
        (b"\x01\x85\x00\x00", "longer than needed"),  # 5 written in two bytes
        (b"\x01\x00\x80\x00", "longer than needed"),
        (b"\x01" + b"\xff" * 9 + b"\x01" + b"\x00", "ends past 2**63-1"),
        (b"\x01\x01" + b"\xff" * 8 + b"\x7f", "ends past 2**63-1"),
        (b"\x01\x00" + b"\xff" * 10, "longer than 10 bytes"),
    ],
)
def test_bad_ack_ranges_are_malformed(body: bytes, words: str) -> None:
    assert words in str(expect_malformed(body))


def test_the_encoder_refuses_what_the_decoder_would() -> None:
    bad = [
        (),
        ((5, 4),),
        ((-1, 3),),
        ((0, MAX_SEQ + 1),),
        ((1, 3), (4, 6)),  # adjacent: must be one range
        ((5, 9), (1, 2)),  # descending
        ((1, 3), (3, 6)),  # overlapping
        ((True, 3),),
        ((1, 2, 3),),
        tuple((i * 3, i * 3) for i in range(MAX_ACK_RANGES + 1)),
    ]
    for ranges in bad:
        with pytest.raises(WireError) as info:
            FrameEncoder().encode(AckRanges(ranges=ranges))  # type: ignore[arg-type]
        assert info.value.code == "malformed", ranges


def test_more_ranges_than_a_frame_holds_are_split() -> None:
    seqs = range(0, 2 * (MAX_ACK_RANGES + 5), 2)  # every other seq: one range each
    frames = frames_for(seqs)
    assert [len(f.ranges) for f in frames] == [MAX_ACK_RANGES, 5]
    decoded = [FrameDecoder().feed(FrameEncoder().encode(f))[0] for f in frames]
    assert {s for f in decoded for first, last in f.ranges for s in range(first, last + 1)} == set(
        seqs
    )
    assert frames_for([]) == []


def test_hello_carries_ack_delay_only_when_asked() -> None:
    old = Hello(agent_version="1", node="n", heartbeat_seconds=1.0)
    assert "ack_delay_seconds" not in hello_json(old)  # what an older gateway accepts
    new = Hello(agent_version="1", node="n", heartbeat_seconds=3.0, ack_delay_seconds=3.0)
    assert parse_hello(dump_json(hello_json(new))) == new
    (decoded,) = FrameDecoder().feed(FrameEncoder().encode(new))
    assert decoded == new
    for bad in (-1, 60.5, float("inf")):
        body = dump_json({**hello_json(old), "ack_delay_seconds": 1.0}).replace(
            b'"ack_delay_seconds":1.0', b'"ack_delay_seconds":' + str(bad).encode()
        )
        with pytest.raises(WireError) as info:
            parse_hello(body)
        assert info.value.code == "malformed"
        with pytest.raises(WireError):
            FrameEncoder().encode(Hello(agent_version="1", node="n", ack_delay_seconds=bad))
