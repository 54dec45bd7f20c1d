"""XID errors: a background thread waits on an NVML event set and records each XID.

The collection loop reads what was recorded without ever blocking on NVML events: the
last XID (dcgm-exporter's ``DCGM_FI_DEV_XID_ERRORS`` semantics: 0 for none), and for
the health series (:mod:`edge_agent.health`) each XID with its time, the last
:data:`KEPT_EVENTS` per GPU, and every XID seen since the agent started.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import suppress
from typing import Any

import pynvml

from edge_agent.nvml.backend import Handle, NvmlLib
from edge_agent.nvml.devices import GpuDevice

log = logging.getLogger(__name__)

WAIT_MS = 500
# XID events kept per GPU for the XID count window (a GPU in an XID storm reports a few
# per second at most: 4,096 covers the default 5-minute window; beyond it the oldest go).
KEPT_EVENTS = 4096


def _address(handle: Handle) -> int | None:
    value: int | None = ctypes.cast(handle, ctypes.c_void_p).value
    return value


class XidWatcher:
    """Owns one NVML event set; ``last(uuid)`` is None when XIDs cannot be watched."""

    def __init__(
        self,
        lib: NvmlLib,
        devices: Sequence[GpuDevice],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._lib = lib
        self._clock = clock
        self._by_address: dict[int | None, str] = {}
        self._last: dict[str, int] = {}
        self._events: dict[str, deque[tuple[float, int]]] = {}  # (clock time, XID)
        self._seen: dict[str, frozenset[int]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._event_set: Any = None
        self.unsupported_reason = ""
        self._register(devices)

    def _register(self, devices: Sequence[GpuDevice]) -> None:
        try:
            self._event_set = self._lib.nvmlEventSetCreate()
        except pynvml.NVMLError as exc:
            self.unsupported_reason = f"NVML event sets unavailable: {exc}"
            return
        for dev in devices:
            try:
                supported = self._lib.nvmlDeviceGetSupportedEventTypes(dev.handle)
                if not supported & pynvml.nvmlEventTypeXidCriticalError:
                    continue
                self._lib.nvmlDeviceRegisterEvents(
                    dev.handle, pynvml.nvmlEventTypeXidCriticalError, self._event_set
                )
            except pynvml.NVMLError as exc:
                log.warning("GPU %d (%s): XID events not available: %s", dev.index, dev.uuid, exc)
                continue
            self._by_address[_address(dev.handle)] = dev.uuid
            self._last[dev.uuid] = 0
            self._events[dev.uuid] = deque(maxlen=KEPT_EVENTS)
            self._seen[dev.uuid] = frozenset()
        if not self._by_address:
            self.unsupported_reason = "no GPU accepts XID event registration"

    def start(self) -> None:
        if self._by_address and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="xid-events", daemon=True)
            self._thread.start()

    def last(self, uuid: str) -> int | None:
        with self._lock:
            return self._last.get(uuid)

    def events(self, uuid: str) -> tuple[tuple[float, int], ...] | None:
        """The GPU's recorded XIDs with their times, oldest first (None: not watched)."""
        with self._lock:
            kept = self._events.get(uuid)
            return None if kept is None else tuple(kept)

    def seen(self, uuid: str) -> frozenset[int] | None:
        """Every XID the GPU reported since the watcher started (None: not watched)."""
        with self._lock:
            return self._seen.get(uuid)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self._lib.nvmlEventSetWait_v2(self._event_set, WAIT_MS)
            except pynvml.NVMLError_Timeout:
                continue
            except pynvml.NVMLError as exc:
                if self._stop.is_set():
                    return
                log.warning("waiting for XID events failed: %s; retrying in 5 s", exc)
                self._stop.wait(5.0)
                continue
            if data.eventType != pynvml.nvmlEventTypeXidCriticalError:
                continue
            uuid = self._by_address.get(_address(data.device))
            if uuid is None:
                continue
            xid = int(data.eventData)
            log.warning("GPU %s reported XID %d", uuid, xid)
            with self._lock:
                self._last[uuid] = xid
                self._events[uuid].append((self._clock(), xid))
                if xid not in self._seen[uuid]:
                    self._seen[uuid] = self._seen[uuid] | {xid}

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=WAIT_MS / 1000 * 4)
            self._thread = None
        if self._event_set is not None:
            with suppress(pynvml.NVMLError):
                self._lib.nvmlEventSetFree(self._event_set)
            self._event_set = None
