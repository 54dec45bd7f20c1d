"""What the gateway sends on a telemetry session (ACKs, ranges of ACKs, HEARTBEATs,
GOODBYE, ERROR), read by the tunnel (:mod:`edge_agent.tunnel`) beside its send loop."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import asyncssh

from edge_agent.outbox import Dispatch
from edge_agent.tunnel_stats import TunnelStats
from edge_agent.tunnel_types import GatewayRefused, GatewaySilent, TunnelError
from gpurelay import compat
from gpurelay.compat import TIMEOUTS
from gpurelay.wire import (
    READ_CHUNK,
    Ack,
    AckRanges,
    ErrorFrame,
    FrameDecoder,
    Goodbye,
    Heartbeat,
    WireError,
)


class Inbound:
    """One session's reader. ``taken()``: the gateway acknowledged something (or sent a
    HEARTBEAT) on this session; ``dispatch()``: the send loop's dispatch, told of ACKs;
    ``wakeup``: set when ACKs make room for more replays."""

    def __init__(
        self,
        stats: TunnelStats,
        log: logging.LoggerAdapter[logging.Logger],
        wakeup: asyncio.Event,
        taken: Callable[[], None],
        dispatch: Callable[[], Dispatch | None],
    ) -> None:
        self.stats = stats
        self.log = log
        self._wakeup = wakeup
        self._taken = taken
        self._dispatch = dispatch

    async def run(self, reader: asyncssh.SSHReader[bytes], silence: float) -> None:
        """ACKs, HEARTBEATs, GOODBYE, ERROR. The gateway sends one of them at least about
        once an interval; nothing for ``silence`` seconds means the link (or the gateway)
        is dead, whatever TCP believes: drop the session and dial again."""
        decoder = FrameDecoder()
        while True:
            try:
                async with compat.timeout(silence):
                    data = await reader.read(READ_CHUNK)
            except TIMEOUTS:
                message = (
                    f"nothing from the gateway for {silence:g}s (gateway.silence_timeout_"
                    "seconds): the link or the gateway is dead; dropping the session"
                )
                self.stats.fail("silent", message)
                raise GatewaySilent(message) from None
            if not data:
                self.log.warning("gateway closed the telemetry channel")
                return
            try:
                incoming = decoder.feed(data)
            except WireError as exc:
                self.stats.fail("protocol", str(exc))
                raise TunnelError(f"gateway sent an invalid frame: {exc}") from exc
            if any(isinstance(frame, Heartbeat) for frame in incoming):
                self._taken()  # the gateway took this session
            acked = [frame.seq for frame in incoming if isinstance(frame, Ack)]
            ranged = [frame.ranges for frame in incoming if isinstance(frame, AckRanges)]
            if acked or ranged:
                self._taken()
                top = max(acked + [ranges[-1][1] for ranges in ranged])
                self.stats.acked_seq = max(self.stats.acked_seq, top)
                dispatch = self._dispatch()
                if dispatch is not None:
                    dispatch.acked(acked)
                    for ranges in ranged:  # each frame's ranges are ascending (canonical)
                        dispatch.acked_ranges(ranges)
                self._wakeup.set()  # room for more replays
            for frame in incoming:
                if isinstance(frame, Ack | AckRanges | Heartbeat):
                    continue
                if isinstance(frame, Goodbye):
                    self.log.info("gateway is going away: %s", frame.reason)
                    return
                elif isinstance(frame, ErrorFrame):
                    self.stats.fail(f"refused_{frame.code}", frame.message)
                    self.log.error("gateway refused our data (%s): %s", frame.code, frame.message)
                    raise GatewayRefused(f"{frame.code}: {frame.message}")
