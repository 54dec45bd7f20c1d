"""The HTTP connection cap against the process's open-file limit (issue 24, item 10).

Every connection is a file descriptor. With the common shell limit of 1,024 and the
default ``http.max_connections`` of 4,096, 1,100 idle HTTP clients used every descriptor:
agents could no longer log in and the gateway could not open a file. At start the
gateway raises its soft limit toward the hard one as far as it needs; if that is still
short, HTTP gets at most half of what is left after a reserve (the other half is for
the agents' SSH connections, the peer hop and files), and a WARNING says what to raise.
"""

from __future__ import annotations

import resource
from collections.abc import Callable
from typing import Final

RESERVE: Final = 64  # descriptors for listeners, logs, the database, certificate files

GetLimit = Callable[[], tuple[int, int]]
SetLimit = Callable[[tuple[int, int]], None]


def _get() -> tuple[int, int]:
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def _set(limits: tuple[int, int]) -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, limits)


def http_cap(wanted: int, *, get: GetLimit = _get, set_: SetLimit = _set) -> tuple[int, str | None]:
    """The HTTP connection cap to use for ``wanted`` (``http.max_connections``) and, when
    it had to be lowered, the warning to log."""
    need = 2 * wanted + RESERVE
    soft, hard = get()
    if soft != resource.RLIM_INFINITY and soft < need:
        raised = need if hard == resource.RLIM_INFINITY else min(need, hard)
        if raised > soft:
            try:
                set_((raised, hard))
                soft = raised
            except (OSError, ValueError):
                pass
    if soft == resource.RLIM_INFINITY or soft >= need:
        return wanted, None
    cap = max(1, (soft - RESERVE) // 2)
    return cap, (
        f"open-file limit {soft} (ulimit -n, systemd LimitNOFILE; hard limit "
        f"{'unlimited' if hard == resource.RLIM_INFINITY else hard}) is too small for "
        f"http.max_connections {wanted}: taking at most {cap} HTTP connections (half of "
        f"what is left after {RESERVE} reserved; the rest is for agents' SSH connections "
        f"and files); raise the limit to at least {need} or lower http.max_connections"
    )
