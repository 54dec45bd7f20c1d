"""How much one gateway of a cluster takes (:mod:`cloud_gateway.cluster.membership`): the claims of
one node per window (:class:`ClaimBudget`), and its fair share of the fleet
(:func:`to_shed`). Pure: the caller passes the time and the counts."""

from __future__ import annotations

from collections import deque

SHED_PER_SECOND = 2.0  # agents a gateway above its fair share lets go, per second
SHED_SLACK = 2  # nodes above the fair share before shedding starts (at least)
# A node in a reconnect loop costs a directory claim (a transaction and a NOTIFY to every
# gateway) per connection: at most CLAIMS_PER_NODE of one node per CLAIM_WINDOW_SECONDS on
# one gateway, beyond that ERROR unavailable (the agent backs off, and may be balanced
# onto another gateway). An agent whose link flaps reconnects after a growing backoff
# (1 s, 2 s, 4 s, ... by default): far fewer than this.
CLAIMS_PER_NODE = 10
CLAIM_WINDOW_SECONDS = 60.0


class ClaimBudget:
    """The claims of each node in the last ``window`` seconds, at most ``limit`` (memory:
    only nodes claimed within the window, :meth:`prune` on the heartbeat). Pure: the
    caller passes the time."""

    def __init__(self, limit: int = CLAIMS_PER_NODE, window: float = CLAIM_WINDOW_SECONDS) -> None:
        self.limit, self.window = limit, window
        self._times: dict[str, deque[float]] = {}

    def take(self, node: str, now: float) -> float:
        """0: a claim of ``node`` may go (counted); else the seconds until one may."""
        times = self._times.get(node)
        if times is None:
            times = self._times[node] = deque(maxlen=self.limit)
        while times and now - times[0] >= self.window:
            times.popleft()
        if len(times) >= self.limit:
            return max(0.001, times[0] + self.window - now)
        times.append(now)
        return 0.0

    def prune(self, now: float) -> None:
        for node in [n for n, t in self._times.items() if not t or now - t[-1] >= self.window]:
            del self._times[node]

    def __len__(self) -> int:
        return len(self._times)


def to_shed(
    owned: int,
    total: int,
    live: int,
    *,
    per_tick: int,
    slack: int = SHED_SLACK,
    lightest: int | None = None,
) -> int:
    """How many of its ``owned`` nodes a gateway lets go this tick: what it holds above
    its fair share of the ``total`` owned by the ``live`` gateways (``ceil(total / live)``
    plus ``slack``, or 5 % of the share when more), at most ``per_tick``.

    While a live gateway holds fewer than the share less the slack (``lightest``: the
    fewest any other holds; one that just joined), down to the share itself: else the
    slack of every old gateway adds up, and a newcomer to a small fleet stays nearly
    empty (3 x 11 nodes, a fourth gateway joins: it took none; now 6)."""
    if live <= 1 or owned <= 0:
        return 0
    fair = -(-total // live)
    slack = max(slack, fair // 20)
    keep = fair if lightest is not None and lightest < fair - slack else fair + slack
    return max(0, min(per_tick, owned - keep))
