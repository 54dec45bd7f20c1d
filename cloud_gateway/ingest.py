"""Ingest: turn one node's frames into registry updates and acknowledgements.

The SSH server decodes frames and hands them here; the registry stays pure. The node
name is the authenticated certificate principal given by the SSH layer, never what the
agent says about itself. Two connections for one node: the newer wins, the older is
closed and logged.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from cloud_gateway.registry import Registry, StaleConnection
from cloud_gateway.ssh_server import node_log
from edge_agent.wire import Ack, Batch, Declare, Frame, Hello, WireError


@dataclass
class IngestStats:
    batches: int = 0
    duplicates: int = 0
    bytes: int = 0
    replaced_connections: int = 0
    rejected_series: Counter[str] = field(default_factory=Counter)
    unknown_values: int = 0
    name_mismatches: int = 0
    batch_seconds: float = 0.0  # CPU-ish time spent applying batches (perf_counter)


class Ingest:
    """Implements the SSH server's ``SessionFactory`` over a :class:`Registry`."""

    def __init__(
        self,
        registry: Registry,
        *,
        clock: Callable[[], float] = time.time,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.registry = registry
        self.clock = clock
        self.on_change = on_change
        self.stats = IngestStats()
        self._closers: dict[int, Callable[[str], None]] = {}

    def open_session(self, node: str, remote: str, close: Callable[[str], None]) -> NodeSession:
        return NodeSession(self, node, remote, close)

    def close_connection(self, conn_id: int, reason: str) -> None:
        closer = self._closers.pop(conn_id, None)
        if closer is not None:
            closer(reason)


class NodeSession:
    def __init__(
        self, ingest: Ingest, node: str, remote: str, close: Callable[[str], None]
    ) -> None:
        self._ingest = ingest
        self.node = node
        self.remote = remote
        self._close = close
        self.conn_id: int | None = None
        self.log = node_log(node)
        self._pending_bytes = 0

    def received(self, nbytes: int) -> None:
        self._pending_bytes += nbytes
        self._ingest.stats.bytes += nbytes

    def handle(self, frame: Frame) -> Sequence[Frame]:
        if isinstance(frame, Batch):
            return self._batch(frame)
        if isinstance(frame, Declare):
            self._declare(frame)
            return ()
        if isinstance(frame, Hello):
            self._hello(frame)
            return ()
        raise WireError("frame_type", f"an agent may not send {type(frame).__name__} frames")

    def _hello(self, hello: Hello) -> None:
        ingest = self._ingest
        now = ingest.clock()
        if hello.node != self.node:
            ingest.stats.name_mismatches += 1
            message = (
                f"agent calls itself {hello.node!r} but its certificate is for {self.node!r}; "
                f"publishing as {self.node!r}"
            )
            self.log.warning(message)
            ingest.registry.record_error(self.node, message, now)
        connected = ingest.registry.connect(self.node, remote=self.remote, hello=hello, now=now)
        self.conn_id = connected.conn_id
        ingest._closers[connected.conn_id] = self._close
        if connected.replaced is not None:
            ingest.stats.replaced_connections += 1
            self.log.warning("a newer connection from %s replaces the older one", self.remote)
            ingest.close_connection(
                connected.replaced, f"replaced by a newer connection from {self.remote}"
            )
        self.log.info(
            "connected from %s: agent %s, %d GPU(s), backend %s, domain %s",
            self.remote,
            hello.agent_version,
            len(hello.gpus),
            hello.backend or "?",
            hello.domain or self.node,
        )
        ingest.on_change()

    def _current(self) -> int:
        if self.conn_id is None:
            raise WireError("order", "the first frame on a connection must be HELLO")
        return self.conn_id

    def _declare(self, decl: Declare) -> None:
        ingest = self._ingest
        try:
            declared = ingest.registry.declare(self.node, self._current(), decl)
        except StaleConnection as exc:
            self._close("replaced by a newer connection")
            raise WireError("order", "this connection was replaced by a newer one") from exc
        for rejected in declared.rejected:
            ingest.stats.rejected_series[rejected.reason] += 1
        if declared.rejected:
            first = declared.rejected[0]
            message = f"{len(declared.rejected)} series rejected, e.g. {first.name}: {first.reason}"
            self.log.warning(message)
            ingest.registry.record_error(self.node, message, ingest.clock())

    def _batch(self, batch: Batch) -> Sequence[Frame]:
        ingest = self._ingest
        started = time.perf_counter()
        try:
            applied = ingest.registry.apply(
                self.node,
                self._current(),
                batch,
                now=ingest.clock(),
                size_bytes=self._pending_bytes,
            )
            self._pending_bytes = 0
        except StaleConnection as exc:
            self._close("replaced by a newer connection")
            raise WireError("order", "this connection was replaced by a newer one") from exc
        stats = ingest.stats
        stats.batch_seconds += time.perf_counter() - started
        stats.batches += 1
        if applied.duplicate:
            stats.duplicates += 1
        if applied.unknown:
            stats.unknown_values += applied.unknown
        ingest.on_change()
        return (Ack(seq=applied.seq),)

    def closed(self, reason: str) -> None:
        ingest = self._ingest
        if self.conn_id is None:
            return
        ingest._closers.pop(self.conn_id, None)
        ingest.registry.disconnect(self.node, self.conn_id, now=ingest.clock(), reason=reason)
        self.log.info("disconnected: %s", reason)
        ingest.on_change()
