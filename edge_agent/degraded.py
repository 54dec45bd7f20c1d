"""What the collectors cannot measure right now, and why: said once, shown as a series.

A collector that meets an NVML failure it will not retry this cycle (a call the driver
lacks, a permission the container lacks, a hung call, a sentinel) leaves the affected
series out rather than publishing a value it did not measure, and reports it here under a
key (a GPU, and the part of it that failed). The first report of a key, and any change of
its reason, is logged once as a warning; the condition shows as
``gpurelay_agent_degraded{gpu, part, reason} 1`` for as long as it lasts; :meth:`clear`
logs that the part answers again.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (gpu: index or "" for the node, part: e.g. "process_list")


class Degraded:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # collectors may report from worker threads
        self._now: dict[Key, str] = {}

    def report(self, gpu: str, part: str, reason: str) -> None:
        key = (gpu, part)
        with self._lock:
            before = self._now.get(key)
            self._now[key] = reason
        if before != reason:
            where = f"GPU {gpu}" if gpu else "node"
            log.warning("%s: %s not measured: %s", where, part.replace("_", " "), reason)

    def clear(self, gpu: str, part: str) -> None:
        with self._lock:
            before = self._now.pop((gpu, part), None)
        if before is not None:
            where = f"GPU {gpu}" if gpu else "node"
            log.warning("%s: %s answers again", where, part.replace("_", " "))

    def current(self) -> dict[Key, str]:
        with self._lock:
            return dict(self._now)
