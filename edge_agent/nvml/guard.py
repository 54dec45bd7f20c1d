"""A deadline around NVML work: a hung call costs its GPU, not the cycle.

An NVML call is a C call that Python cannot interrupt, and a driver that is wedged (a GPU
falling off the bus, a stuck RM lock, ``nvidia-smi`` hanging on the same box) can block one
for minutes. :class:`GpuGuard` runs a cycle's per-GPU work, in order, in one worker thread,
and waits for each GPU at most ``timeout`` seconds. A GPU whose work is late is *stalled*:
its thread is left inside the call, and the GPUs after it go on in a fresh thread. While
the stalled call has not returned, that GPU is skipped at once (it holds one thread, never
a growing pile); when it returns, the next cycle reads the GPU again.

One worker per cycle, not one per GPU: a hand-over between threads costs ~100 us of CPU on a
small VM (futex wake-up and GIL hand-off), which per GPU would add ~1 ms to every cycle of
an 8-GPU box (measured with bench/agent_cycle.py). The threads are daemons, so a call that
never returns cannot keep the agent from exiting.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")
_PENDING = object()


class Stalled(Exception):
    """The GPU's NVML work did not finish in time (or an earlier call is still running)."""

    def __init__(self, key: str, since: float) -> None:
        self.key = key
        self.since = since  # time.monotonic() when the late work started
        super().__init__(f"an NVML call has not returned for {time.monotonic() - since:.1f} s")


class _Batch(Generic[T]):
    """A cycle's work for one worker: done in order until finished or abandoned."""

    def __init__(self, items: Sequence[tuple[str, Callable[[], T]]]) -> None:
        self.items = items
        self.cond = threading.Condition()
        self.results: list[T | BaseException] = []  # in order, for the items done
        self.started = time.monotonic()  # of the item in progress
        self.finished = False
        self.abandoned = False
        self.returned = threading.Event()  # the item in progress when abandoned returned

    def run(self) -> None:
        for _key, fn in self.items:
            with self.cond:
                if self.abandoned:
                    return
                self.started = time.monotonic()
            try:
                result: T | BaseException = fn()
            except Exception as exc:
                result = exc
            with self.cond:
                if self.abandoned:
                    self.returned.set()
                    return
                self.results.append(result)
        with self.cond:
            self.finished = True
            self.cond.notify_all()


class _Worker:
    """A daemon thread running batches until it is retired (left inside a hung call)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_Batch[object] | None] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="nvml", daemon=True).start()

    def _run(self) -> None:
        while (batch := self._jobs.get()) is not None:
            batch.run()
            if batch.abandoned:
                return  # this thread was given up on; a fresh one took over

    def submit(self, batch: _Batch[object]) -> None:
        self._jobs.put(batch)

    def stop(self) -> None:
        self._jobs.put(None)


class GpuGuard:
    def __init__(self) -> None:
        self._worker: _Worker | None = None
        self._stuck: dict[str, tuple[threading.Event, float]] = {}  # key -> (returned, since)
        self._lock = threading.Lock()  # one cycle at a time (device, then process collector)

    def each(
        self, items: Sequence[tuple[str, Callable[[], T]]], timeout: float
    ) -> list[T | BaseException]:
        """Run each item's function (its key names its GPU) and return, in order, its result,
        the exception it raised, or :class:`Stalled` when it took longer than ``timeout``
        seconds or its GPU is still inside a call that did."""
        with self._lock:
            out: list[T | BaseException | object] = [_PENDING] * len(items)
            pending: list[int] = []
            for n, (key, _fn) in enumerate(items):
                stuck = self._stuck.get(key)
                if stuck is not None and not stuck[0].is_set():
                    out[n] = Stalled(key, stuck[1])
                else:
                    self._stuck.pop(key, None)
                    pending.append(n)
            while pending:
                pending = self._run(items, pending, out, timeout)
            assert _PENDING not in out
            return out  # type: ignore[return-value]

    def _run(
        self,
        items: Sequence[tuple[str, Callable[[], T]]],
        pending: list[int],
        out: list[T | BaseException | object],
        timeout: float,
    ) -> list[int]:
        """Run ``pending`` in one worker; the indices still to run if one stalled."""
        batch: _Batch[T] = _Batch([items[n] for n in pending])
        if self._worker is None:
            self._worker = _Worker()
        self._worker.submit(batch)  # type: ignore[arg-type]
        with batch.cond:
            while not batch.finished:
                late = batch.started + timeout - time.monotonic()
                if late <= 0:
                    break
                batch.cond.wait(late)
            for n, result in zip(pending, batch.results, strict=False):
                out[n] = result
            if batch.finished:
                return []
            batch.abandoned = True
            done = len(batch.results)
        key = items[pending[done]][0]
        out[pending[done]] = Stalled(key, batch.started)
        self._stuck[key] = (batch.returned, batch.started)
        self._worker = None  # left inside the call; it ends when the call returns
        rest = pending[done + 1 :]
        for n in rest:  # the same GPU's other work waits for that call too
            if items[n][0] == key:
                out[n] = Stalled(key, batch.started)
        return [n for n in rest if items[n][0] != key]

    def close(self) -> None:
        if self._worker is not None:
            self._worker.stop()
            self._worker = None
