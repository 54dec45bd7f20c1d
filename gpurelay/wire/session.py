"""What both ends know about one connection: live series, retired ids, batch position."""

from __future__ import annotations

from collections.abc import Sequence

from gpurelay.wire.frames import Limits, SeriesDecl, WireError
from gpurelay.wire.rules import check_series


class ConnectionState:
    """What both ends know about one connection: live series and the batch position."""

    __slots__ = ("greeted", "last", "limits", "retired", "seq", "ts_ms")

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.greeted = False
        self.last: dict[int, float | None] = {}  # live series -> last value sent, if any
        self.retired: set[int] = set()  # removed series: their ids may not come back
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
        for decl in series:
            check_series(decl, self.limits)
            if decl.id in self.last or decl.id in self.retired or decl.id in fresh:
                raise WireError(
                    "malformed",
                    f"series id {decl.id} ({decl.name}) is already declared on this "
                    "connection; ids may not be reused",
                )
            fresh.add(decl.id)

    def apply_declare(self, series: Sequence[SeriesDecl]) -> None:
        for decl in series:
            self.last[decl.id] = None

    def check_seq(self, seq: int) -> None:
        if self.seq is not None and seq <= self.seq:
            raise WireError(
                "order",
                f"BATCH seq {seq} does not follow seq {self.seq}: "
                "sequence numbers must increase on a connection",
            )

    def unknown(self, sid: int, seq: int) -> WireError:
        why = "was removed" if sid in self.retired else "was never declared"
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
        self.retired.add(sid)
