"""Node liveness: when a connected node counts as late (stale) and when as gone.

Pure: no clocks (every call takes ``now``), no sockets. The thresholds follow the
collection interval ``I`` that the agent announced in HELLO, plus a margin for the link:

- **late after** ``stale_after_intervals x I + margin``: no live batch for that long and
  the node is *stale* (connected, late; ``gpurelay_node_up`` 0).
- **silent after** ``offline_after_intervals x I + margin``: nothing at all received on
  the connection for that long (while the gateway was reading) and the gateway closes it:
  the node is *offline* (gone), and the agent's next connection starts clean.
- ``margin = max(margin_seconds, 2 x recent worst lateness)``. Lateness is how much later
  than ``I`` a batch arrived after the one before it; the recent worst decays by half
  every ~35 batches. A lossy link, where TCP retransmits after 0.2, 0.4, 0.8 ... s, makes
  some batches seconds late; a node on such a link earns a wider margin from its own
  measured arrivals instead of flapping to stale (issue 13: a 3.5 s gap on a 1 s interval).

Defaults (``[registry]``): 3 and 6 intervals, ``margin_seconds`` 2: a node at 10 s is late
after 32 s and closed after 62 s of silence; at 1 s, after 5 s and 8 s.
"""

from __future__ import annotations

import math
from typing import Final

from cloud_gateway.registry.config import LivenessPolicy

DECAY: Final = 0.98  # per batch: the recent worst lateness halves in ~35 batches
DEFAULT_INTERVAL: Final = 10.0  # when a HELLO's interval cannot be used


def usable_interval(interval: float) -> float:
    return interval if math.isfinite(interval) and interval > 0 else DEFAULT_INTERVAL


class Arrivals:
    """One node's batch arrivals: the last one and the recent worst lateness."""

    __slots__ = ("interval", "last", "worst")

    def __init__(self, interval: float, now: float) -> None:
        self.interval = usable_interval(interval)
        self.last = now  # the connection counts as the first arrival
        self.worst = 0.0

    def arrived(self, now: float) -> None:
        late = now - self.last - self.interval
        self.worst = max(late, self.worst * DECAY, 0.0)
        self.last = now

    def margin(self, policy: LivenessPolicy) -> float:
        return max(policy.margin_seconds, 2.0 * self.worst)

    def late_after(self, policy: LivenessPolicy) -> float:
        """Seconds without a live batch after which the node is stale."""
        return policy.stale_after_intervals * self.interval + self.margin(policy)

    def silent_after(self, policy: LivenessPolicy) -> float:
        """Seconds without any data after which the gateway closes the connection."""
        return policy.offline_after_intervals * self.interval + self.margin(policy)

    def is_late(self, policy: LivenessPolicy, now: float) -> bool:
        return now - self.last > self.late_after(policy)
