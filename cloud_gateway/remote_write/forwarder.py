"""Forwarding: one node's collections to remote write, acknowledged only once accepted.

``ssh_server → ingest → registry`` serves the unified /metrics; with remote write on,
ingest also hands every collection (a live batch as the node's full state, or a replayed
record) to the node's :class:`Forwarder`. Its task writes the queue in order, coalescing
consecutive collections into one :meth:`RemoteWriter.send` (one attempt per request), and
reports each seq as delivered (the session then marks it and sends the ACK) only after
the receiver took it:

- accepted (2xx): delivered.
- refused (:class:`RemoteWriteRejected`, e.g. a 4xx): can never be accepted, so logged,
  counted and reported delivered anyway; otherwise the agent's spool would be stuck on a
  poison collection. A coalesced group that is refused is re-sent one collection at a
  time, so only the collection the receiver objects to is dropped.
- unavailable (:class:`RemoteWriteUnavailable`: 5xx, 429, a transport error): kept, not
  acknowledged, and sent again after a backoff, for as long as the session lives. This is
  the only retry loop on the path: ``min_backoff_seconds`` doubling up to
  ``max_backoff_seconds`` (``[remote_write]``), each delay 50-100 % of its step (jitter),
  and never shorter than the receiver's ``Retry-After``. When the session ends the task is
  cancelled; the agent still holds what was not acknowledged and sends it again on its
  next connection.

Sending a group again can write samples twice: the requests of a send accepted before the
one that failed, or a collection accepted whose ACK was lost. They are identical samples
(same series, timestamp and value), which receivers accept.

Back-pressure: :meth:`Forwarder.room` waits while more than ``max_queued`` collections
wait; the SSH channel awaits it before reading on, so SSH flow control holds the agent.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from itertools import islice

from cloud_gateway.metrics import FamilySamples, one
from cloud_gateway.remote_write.client import (
    RemoteWriteRejected,
    RemoteWriteStats,
    RemoteWriteUnavailable,
    Writer,
)
from cloud_gateway.remote_write.config import MAX_QUEUED_BATCHES, RemoteWriteConfig
from cloud_gateway.remote_write.prompb import Series
from gpurelay.model import Labels

MAX_SAMPLES_PER_SEND = 10_000  # coalesce collections up to this many samples per send
_DEFAULTS = RemoteWriteConfig()
RETRY_BACKOFF = (_DEFAULTS.min_backoff_seconds, _DEFAULTS.max_backoff_seconds)  # seconds


@dataclass(frozen=True, slots=True)
class QueuedCollection:
    """One collection of one node, as remote write gets it."""

    seq: int
    timestamp_ms: int
    samples: Sequence[tuple[Labels, float]]  # labels include ("__name__", name)
    replayed: bool


@dataclass
class ForwardStats:
    """Across every node's forwarder."""

    queued: int = 0  # collections waiting now (gauge)
    delivered: int = 0  # accepted by the receiver and acknowledged
    dropped: int = 0  # refused by the receiver (4xx), acknowledged anyway
    unavailable: int = 0  # sends not taken (5xx, 429, transport error), sent again later


def as_series(group: Sequence[QueuedCollection]) -> list[Series]:
    """The samples of consecutive collections, grouped by series (one entry per label
    set, its points in collection order; the writer sorts them by time).

    Grouped by the identity of the labels tuple, not its value: the registry and the
    session hand out one tuple per series, so this is the same grouping without hashing
    every label set (an equal tuple that is another object only makes a second entry)."""
    if len(group) == 1:
        ts = group[0].timestamp_ms
        return [(labels, [(ts, value)]) for labels, value in group[0].samples]
    by_id: dict[int, Series] = {}
    for c in group:
        ts = c.timestamp_ms
        for labels, value in c.samples:
            entry = by_id.get(id(labels))
            if entry is None:
                by_id[id(labels)] = (labels, [(ts, value)])
            else:
                entry[1].append((ts, value))
    return list(by_id.values())


class Forwarder:
    """One node's queue of collections and the task that writes them, in order."""

    def __init__(
        self,
        writer: Writer,
        *,
        log: logging.Logger,
        delivered: Callable[[int], None],
        failed: Callable[[str], None],
        stats: ForwardStats,
        max_queued: int = MAX_QUEUED_BATCHES,
        max_samples_per_send: int = MAX_SAMPLES_PER_SEND,
        backoff: tuple[float, float] = RETRY_BACKOFF,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        """``backoff``: (first, longest) delay in seconds before sending again what was
        not taken; ``sleep`` and ``jitter`` (0 to 1) are there for tests."""
        self._writer = writer
        self._log = log
        self._delivered = delivered  # seq: mark it and acknowledge it
        self._failed = failed  # reason: close the connection (a bug, not the receiver)
        self.stats = stats
        self._max_queued = max_queued
        self._max_samples = max_samples_per_send
        self._min_backoff, self._max_backoff = backoff
        self._sleep = sleep
        self._jitter = jitter
        self._queue: deque[QueuedCollection] = deque()
        self._wake = asyncio.Event()
        self._room = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    def __len__(self) -> int:
        return len(self._queue)

    def put(self, collection: QueuedCollection) -> None:
        if self._closed:
            return
        self._queue.append(collection)
        self.stats.queued += 1
        self._wake.set()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    @property
    def full(self) -> bool:
        """More than ``max_queued`` collections wait: :meth:`room` would wait."""
        return len(self._queue) > self._max_queued and not self._closed

    async def room(self) -> None:
        """Return once at most ``max_queued`` collections wait (or the forwarder closed)."""
        while len(self._queue) > self._max_queued and not self._closed:
            self._room.clear()
            await self._room.wait()

    def close(self) -> asyncio.Task[None] | None:
        """Stop: cancel the task, forget the queue (the agent still holds it)."""
        if not self._closed:
            self._closed = True
            self.stats.queued -= len(self._queue)
            self._queue.clear()
            self._room.set()
            if self._task is not None:
                self._task.cancel()
        return self._task

    # ---- the task

    async def _run(self) -> None:
        try:
            await self._write_forever()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug: say so and let the agent send it all again
            self._log.exception("remote write forwarding failed")
            self._failed(f"remote write forwarding failed: {exc}")

    async def _write_forever(self) -> None:
        failures = 0  # sends not taken in a row: the backoff's exponent
        solo = 0  # after a refused group: send this many collections one at a time
        while True:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            group = self._take(0 if solo else self._max_samples)
            try:
                await self._writer.send(as_series(group))
            except RemoteWriteRejected as exc:
                if len(group) > 1:
                    solo = len(group)  # find the one the receiver objects to
                    continue
                self._drop(group[0], f"HTTP {exc.status}: {exc.body}")
                self._finish(1, accepted=False)
                solo = max(0, solo - 1)
                continue
            except ValueError as exc:  # the writer cannot encode it: never sendable either
                if len(group) > 1:
                    solo = len(group)
                    continue
                self._drop(group[0], str(exc))
                self._finish(1, accepted=False)
                solo = max(0, solo - 1)
                continue
            except RemoteWriteUnavailable as exc:
                delay = self._delay(failures, exc.retry_after)
                failures += 1
                self.stats.unavailable += 1
                self._log.warning(
                    "%s; keeping %d collection(s) unacknowledged, retry in %.2fs",
                    exc,
                    len(self._queue),
                    delay,
                )
                await self._sleep(delay)
                continue
            failures = 0
            solo = max(0, solo - len(group))
            self._finish(len(group), accepted=True)

    def _delay(self, failures: int, retry_after: float | None) -> float:
        """Seconds to wait after ``failures`` + 1 sends in a row were not taken: the
        step doubles from the first to the longest delay, the wait is 50-100 % of it
        (jitter, so nodes do not retry in step), and never shorter than ``retry_after``."""
        step = min(self._max_backoff, self._min_backoff * 2.0 ** min(failures, 64))
        delay = step * (0.5 + 0.5 * self._jitter())
        return delay if retry_after is None else max(delay, retry_after)

    def _take(self, max_samples: int) -> list[QueuedCollection]:
        """The collections at the head of the queue: at least one, then as many as fit."""
        group = [self._queue[0]]
        total = len(group[0].samples)
        for c in islice(self._queue, 1, None):
            total += len(c.samples)
            if total > max_samples:
                break
            group.append(c)
        return group

    def _drop(self, c: QueuedCollection, why: str) -> None:
        self.stats.dropped += 1
        self._log.error(
            "remote write refused %s collection seq %d (%d samples at %d ms), dropped and "
            "acknowledged: %s",
            "replayed" if c.replayed else "live",
            c.seq,
            len(c.samples),
            c.timestamp_ms,
            why,
        )

    def _finish(self, n: int, *, accepted: bool) -> None:
        """The first ``n`` collections are done with: delivered (or dropped)."""
        for _ in range(n):
            c = self._queue.popleft()
            self.stats.queued -= 1
            self.stats.delivered += accepted
            self._delivered(c.seq)
        if len(self._queue) <= self._max_queued:
            self._room.set()


def delivery_families(fwd: ForwardStats) -> list[FamilySamples]:
    """The queue remote write and OTLP share (only while one of them is configured)."""
    return [
        one("gpurelay_gateway_remote_write_queued_batches", fwd.queued),
        one("gpurelay_gateway_remote_write_dropped_batches_total", fwd.dropped),
    ]


def otlp_families(otlp: RemoteWriteStats) -> list[FamilySamples]:
    """The OTLP writer's own metrics (only while ``[otlp]`` is configured)."""
    return [
        one("gpurelay_gateway_otlp_pending_samples", otlp.pending_samples),
        one("gpurelay_gateway_otlp_sent_samples_total", otlp.sent_samples),
        one("gpurelay_gateway_otlp_failed_samples_total", otlp.failed_samples),
        one("gpurelay_gateway_otlp_sent_requests_total", otlp.sent_requests),
        one("gpurelay_gateway_otlp_retried_requests_total", otlp.retried_requests),
        one("gpurelay_gateway_otlp_rejected_requests_total", otlp.rejected_requests),
    ]


def remote_write_families(rw: RemoteWriteStats) -> list[FamilySamples]:
    """Remote write's own metrics (only while it is configured)."""
    return [
        one("gpurelay_gateway_remote_write_pending_samples", rw.pending_samples),
        one("gpurelay_gateway_remote_write_sent_samples_total", rw.sent_samples),
        one("gpurelay_gateway_remote_write_failed_samples_total", rw.failed_samples),
        one("gpurelay_gateway_remote_write_sent_requests_total", rw.sent_requests),
        one("gpurelay_gateway_remote_write_retried_requests_total", rw.retried_requests),
        one("gpurelay_gateway_remote_write_rejected_requests_total", rw.rejected_requests),
        one("gpurelay_gateway_remote_write_request_duration_seconds_total", rw.latency_seconds_sum),
        one("gpurelay_gateway_remote_write_responses_total", rw.latency_seconds_count),
        one("gpurelay_gateway_remote_write_last_request_duration_seconds", rw.last_latency_seconds),
    ]
