"""Frame types, their dataclasses, limits and the constants of the byte layout.

See :mod:`gpurelay.wire` for the layout itself."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Final

from gpurelay.model import GpuInventory, Labels, MetricType

PROTOCOL_VERSION = 1


class FrameType(IntEnum):
    HELLO = 1  # agent -> gateway, first frame
    DECLARE = 2  # agent -> gateway: new series (id -> name, type, help, labels)
    BATCH = 3  # agent -> gateway: values by series id
    ACK = 4  # gateway -> agent: batches up to seq are applied
    ERROR = 5  # either way: a clear error; the sender closes the connection after it
    GOODBYE = 6  # gateway -> agent: shutting down, reconnect later
    REPLAY = 7  # agent -> gateway: one spooled collection, self-contained (gpurelay.record)
    HEARTBEAT = 8  # gateway -> agent: alive, to an agent that asked for it in HELLO
    ACK_RANGES = 9  # gateway -> agent: these seq ranges are taken (asked for in HELLO)


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    max_frame_bytes: int = 4 * 1024 * 1024
    max_series: int = 50_000  # per connection (node)
    max_labels: int = 32  # per series
    max_name_bytes: int = 200  # metric and label names
    max_label_value_bytes: int = 2048
    max_help_bytes: int = 1024


DEFAULT_LIMITS: Final = Limits()

# HELLO's own bounds: facts about a box are short (a version, a hostname, a GPU's name).
MAX_HEARTBEAT_SECONDS: Final = 3600.0  # what an agent may ask for in HELLO
MAX_ACK_DELAY_SECONDS: Final = 60.0  # same, for delayed range ACKs
MAX_ACK_RANGES: Final = 1024  # ranges in one ACK_RANGES frame (at most ~20 KiB)
HELLO_TEXT_BYTES: Final = 256  # each text field, in UTF-8
HELLO_GPUS: Final = 256  # physical GPUs listed (MIG instances are not listed)


@dataclass(frozen=True, slots=True, kw_only=True)
class Hello:
    agent_version: str
    node: str  # what the agent calls itself; the gateway uses the certificate principal
    domain: str = ""
    backend: str = ""  # "nvml" or "simulated"
    driver_version: str = ""
    hostname: str = ""
    interval_seconds: float = 10.0
    gpus: tuple[GpuInventory, ...] = ()
    # > 0: send me a HEARTBEAT whenever you have sent me nothing for this long, so that I
    # can tell a silent link from a gateway that is holding ACKs (0: an older agent).
    heartbeat_seconds: float = 0.0
    # > 0: acknowledge me with ACK_RANGES frames, an ACK at most about this late (0: one
    # ACK frame per seq at once, as an older agent expects).
    ack_delay_seconds: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class SeriesDecl:
    id: int  # >= 0, unique within a connection
    name: str
    type: MetricType
    help: str
    labels: Labels


@dataclass(frozen=True, slots=True, kw_only=True)
class Declare:
    series: tuple[SeriesDecl, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Batch:
    seq: int  # strictly increasing per agent (survives reconnects)
    timestamp: float  # unix seconds when the values were collected
    # Only values that changed since the previous batch on this connection; a series
    # not listed keeps its previous value. The first batch after DECLARE lists all.
    values: tuple[tuple[int, float], ...]
    removed: tuple[int, ...] = ()  # series that no longer exist (ids may not be reused)
    full: bool = False  # True when `values` lists every live series


@dataclass(frozen=True, slots=True, kw_only=True)
class Replay:
    """A collection from the agent's spool, sent again (after an outage or a lost ACK).

    Self-contained: ``record`` is an :mod:`gpurelay.record` byte string, decoded by the
    receiver with :func:`gpurelay.record.decode_record`. Not ordered with BATCH frames or
    with each other; ``seq`` is the one the collection got when it was taken."""

    seq: int
    record: bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class Ack:
    seq: int


@dataclass(frozen=True, slots=True, kw_only=True)
class AckRanges:
    """Every seq in these ranges is taken, exactly as if one ACK per seq had come.

    ``ranges``: (first, last) pairs, both inclusive, ascending, disjoint and not adjacent
    (a gap of at least one seq between two ranges): one canonical form per set of seqs.
    1..:data:`MAX_ACK_RANGES` of them."""

    ranges: tuple[tuple[int, int], ...]

    def seqs(self) -> int:
        """How many seqs the frame acknowledges."""
        return sum(last - first + 1 for first, last in self.ranges)


@dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat:
    """The gateway is alive and reading: ``received`` is the highest seq it has received
    on this connection (0: none yet), acknowledged or not (ACKs wait for remote write)."""

    received: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ErrorFrame:
    code: str
    message: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Goodbye:
    reason: str


Frame = Hello | Declare | Batch | Replay | Ack | AckRanges | Heartbeat | ErrorFrame | Goodbye


# Every code a WireError can carry: a fixed set, so it can be a metric label.
CODEC_ERROR_CODES: Final = (
    "version",
    "frame_type",
    "oversize",
    "malformed",
    "too_many_series",
    "too_many_labels",
    "bad_name",
    "bad_label",
    "unknown_series",
    "order",
)
CHANNEL_ERROR_CODES: Final = ("incomplete", "too_many_channels", "conflict")
WIRE_ERROR_CODES: Final = CODEC_ERROR_CODES + CHANNEL_ERROR_CODES


class WireError(Exception):
    """A frame that breaks the contract. ``code`` is stable and used as a metric label:
    ``version``, ``frame_type``, ``oversize``, ``malformed``, ``too_many_series``,
    ``too_many_labels``, ``bad_name``, ``bad_label``, ``unknown_series``, ``order``; and,
    from the gateway's channel rather than the codec, ``incomplete`` (a frame that stayed
    partial past its deadline), ``too_many_channels`` and ``conflict`` (refused by the
    gateway's duplicate-connection policy)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


SUBSYSTEM: Final = "gpurelay"  # the SSH subsystem the telemetry channel asks for
READ_CHUNK: Final = 65536  # bytes read from the channel at a time, on both ends
MAX_SERIES_ID: Final = 2**32 - 1
MAX_SEQ: Final = 2**63 - 1
MAX_TIMESTAMP_MS: Final = 2**63
HEADER: Final = struct.Struct(">IBB")
LENGTH: Final = struct.Struct(">I")
SYNC_TAIL: Final = b"\x00\x00\xff\xff"
WINDOW_BITS: Final = 15
COMPRESSED: Final = frozenset({FrameType.HELLO, FrameType.DECLARE, FrameType.BATCH})
KNOWN_TYPES: Final = {t.value: t for t in FrameType}
