"""The wire contract between agent and gateway: frame types and their codec.

This package is the only place that knows the byte layout; both sides import it. It is
split by concern: :mod:`~gpurelay.wire.frames` (types, limits, constants),
:mod:`~gpurelay.wire.rules` (naming and size rules), :mod:`~gpurelay.wire.session`
(what both ends track per connection), :mod:`~gpurelay.wire.varint` and
:mod:`~gpurelay.wire.values` (integers and value kinds), :mod:`~gpurelay.wire.payloads`
(the JSON payloads), :mod:`~gpurelay.wire.ackranges` (ACK_RANGES and its helpers),
:mod:`~gpurelay.wire.encoder` and :mod:`~gpurelay.wire.decoder`.
It is pure:
no sockets, no clocks. One :class:`FrameEncoder` and one :class:`FrameDecoder` exist per
direction of one connection: they keep that connection's compression stream, the series
it declared and the last value sent for each, so both ends must see the same frames in
the same order (they do: one SSH channel).

Frame: ``u32 length (big endian) | u8 version | u8 type | payload``; ``length`` counts
version, type and payload and is at most ``Limits.max_frame_bytes``.

Payloads (``uvarint``: LEB128, at most 10 bytes; ``zz``: zig-zag, so small negatives
stay short):

- HELLO, DECLARE, BATCH travel *compressed*: one raw-deflate stream (window 2**15) per
  connection and direction, flushed with ``Z_SYNC_FLUSH`` after every frame and with the
  flush's constant ``00 00 ff ff`` tail left off (the decoder puts it back, as RFC 7692
  does). Structure repeated across frames (label sets, unchanged series ids) costs almost
  nothing. A payload may inflate to at most ``max_frame_bytes``.
- ACK, ACK_RANGES, HEARTBEAT, ERROR, GOODBYE travel uncompressed (tiny, and an ERROR
  must always be readable), and so does REPLAY (its record is compressed already).
- HELLO: compact UTF-8 JSON ``{"agent_version", "node", "domain", "backend",
  "driver_version", "hostname", "interval_seconds", "gpus": [GpuInventory fields],
  "heartbeat_seconds", "ack_delay_seconds"}``; the last two only when > 0:
  ``heartbeat_seconds`` from agents that want HEARTBEAT frames, ``ack_delay_seconds``
  (0..60) from agents that want ACK_RANGES instead of ACK (below). HELLO is parsed
  strictly, so an older gateway refuses a field it does not know: upgrade gateways first.
- DECLARE: JSON ``{"series": [{"id", "name", "type", "help", "labels": [[k, v], ...]}]}``.
- ERROR: JSON ``{"code", "message"}``. GOODBYE: JSON ``{"reason"}``. ACK: ``uvarint seq``
  (that one batch or replay is safely taken: applied, and accepted by remote write if on).
  HEARTBEAT: ``uvarint seq``, the highest seq received on the connection, acknowledged or
  not; the gateway sends one after HELLO and whenever it has sent the agent nothing for
  the HELLO's ``heartbeat_seconds``, so the agent can tell a dead link from ACKs held for
  remote write. Only to agents that asked: an older agent would refuse the frame type.
- ACK_RANGES (:mod:`~gpurelay.wire.ackranges`): ``uvarint count`` (1..1024), then per
  range ``uvarint first`` (the first range) or ``uvarint first - previous last - 2``
  (the others), and ``uvarint last - first``; ascending, disjoint, not adjacent, canonical.
  It means exactly what one ACK per seq in the ranges would. Only to agents that asked
  with ``ack_delay_seconds`` > 0; those get no ACK frames. The gateway gathers a
  connection's ACKs and sends them in one frame when the oldest waited that long (on its
  1 s tick, so up to a second more), when a REPLAY's ACK is due (at the end of the read
  that carried it, so replays are never held back by the agent's in-flight bound), when
  32 seqs wait, in place of a HEARTBEAT that is due, and before GOODBYE or a close.
- REPLAY: ``uvarint seq | record`` (:mod:`gpurelay.record`): a spooled collection, sent
  again after a reconnect, in any order relative to BATCH frames; its seq is not checked
  against the connection's BATCH order (the receiver dedupes seqs instead).
- BATCH::

      u8       flags                   bit 0: full; other bits 0
      uvarint  zz(seq - previous seq)  (0 before the first batch of the connection)
      uvarint  zz(ms - previous ms)    timestamp in unix milliseconds, same base rule
      uvarint  R, then R x uvarint     removed ids, ascending: id - previous id - 1
      uvarint  N, then N x uvarint     value heads, ids ascending: (id - prev - 1) << 3 | kind
      N values, in head order, each as its kind says:
        0 INT          uvarint zz(v)                     v integral
        1 INT_DELTA    uvarint zz(v - int(p))            p: this series' previous value
        2 MILLI        uvarint zz(v * 1000)              v * 1000 integral (watts from mW)
        3 MILLI_DELTA  uvarint zz(v*1000 - round(p*1000))
        4 KIBI         uvarint zz(v / 1024)              v a multiple of 1024 (bytes from KiB)
        5 KIBI_DELTA   uvarint zz(v/1024 - int(p) // 1024)
        6 FLOAT64      8 bytes IEEE 754 big endian       anything else (NaN, inf, -0.0)
        7 (reserved)

  "Previous value" is the last value sent for the series on this connection; the encoder
  picks the shortest exact kind, so every value round-trips bit for bit. Heads and values
  are separate columns so that the heads, which repeat from batch to batch, compress away.

Rules both ends enforce (the encoder refuses to send what the decoder would reject):
HELLO first and once; series ids in 0..2**32-1, never declared twice on a connection;
values and removals only for live series; ``seq`` increasing on a connection; a full
batch lists every live series. Errors are :class:`WireError` with a stable ``code``.
"""

from __future__ import annotations

from gpurelay.wire.decoder import FrameDecoder
from gpurelay.wire.encoder import FrameEncoder
from gpurelay.wire.frames import (
    DEFAULT_LIMITS,
    MAX_SERIES_ID,
    PROTOCOL_VERSION,
    READ_CHUNK,
    SUBSYSTEM,
    Ack,
    AckRanges,
    Batch,
    Declare,
    ErrorFrame,
    Frame,
    FrameType,
    Goodbye,
    Heartbeat,
    Hello,
    Limits,
    Replay,
    SeriesDecl,
    WireError,
)
from gpurelay.wire.rules import check_series

__all__ = [
    "DEFAULT_LIMITS",
    "MAX_SERIES_ID",
    "PROTOCOL_VERSION",
    "READ_CHUNK",
    "SUBSYSTEM",
    "Ack",
    "AckRanges",
    "Batch",
    "Declare",
    "ErrorFrame",
    "Frame",
    "FrameDecoder",
    "FrameEncoder",
    "FrameType",
    "Goodbye",
    "Heartbeat",
    "Hello",
    "Limits",
    "Replay",
    "SeriesDecl",
    "WireError",
    "check_series",
]
