"""What both ends know about one connection: live series, the id high-water, batch position.

Series ids are never reused on a connection. Rather than remember every removed id (a node
that churns through ids would grow that set forever), each DECLARE's ids must lie above
every id declared before on the connection: one integer bounds the memory.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpurelay.wire.frames import Limits, SeriesDecl, WireError
from gpurelay.wire.rules import Passed, check_series


class ConnectionState:
    """What both ends know about one connection: live series and the batch position."""

    __slots__ = ("greeted", "last", "limits", "next_id", "seq", "ts_ms")

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.greeted = False
        self.last: dict[int, float | None] = {}  # live series -> last value sent, if any
        self.next_id = 0  # every id declared before is below this; new ones start here
        self.seq: int | None = None
        self.ts_ms = 0

    def check_hello(self) -> None:
        if self.greeted:
            raise WireError("order", "HELLO may be sent only once, as the first frame")

    def greet(self) -> None:
        self.greeted = True

    def check_greeted(self, what: str) -> None:
        if not self.greeted:
            raise WireError("order", f"{what} before HELLO: HELLO must be the first frame")

    def check_declare(self, series: Sequence[SeriesDecl]) -> None:
        self.check_greeted("DECLARE")
        limit, total = self.limits.max_series, len(self.last) + len(series)
        if total > limit:
            raise WireError(
                "too_many_series",
                f"DECLARE of {len(series)} series would make {total} live series on this "
                f"connection, more than the limit of {limit}",
            )
        fresh: set[int] = set()
        passed = Passed()
        for decl in series:
            check_series(decl, self.limits, passed)
            if decl.id < self.next_id or decl.id in fresh:
                raise WireError(
                    "malformed",
                    f"series id {decl.id} ({decl.name}) is already declared on this "
                    f"connection; ids may not be reused (new ids start at {self.next_id})",
                )
            fresh.add(decl.id)

    def apply_declare(self, series: Sequence[SeriesDecl]) -> None:
        for decl in series:
            self.last[decl.id] = None
            self.next_id = max(self.next_id, decl.id + 1)

    def check_seq(self, seq: int) -> None:
        if self.seq is not None and seq <= self.seq:
            raise WireError(
                "order",
                f"BATCH seq {seq} does not follow seq {self.seq}: "
                "sequence numbers must increase on a connection",
            )

    def unknown(self, sid: int, seq: int) -> WireError:
        why = "was removed" if isinstance(sid, int) and sid < self.next_id else "was never declared"
        return WireError(
            "unknown_series",
            f"BATCH seq {seq} refers to series {sid}, which {why} on this connection",
        )

    def check_full(self, seq: int, listed: int, live: int) -> None:
        if listed != live:
            raise WireError(
                "malformed",
                f"BATCH seq {seq} is marked full but lists {listed} of the {live} live series",
            )

    def remove(self, sid: int) -> None:
        del self.last[sid]
