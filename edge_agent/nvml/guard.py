"""A deadline around NVML work: a hung call costs its GPU, not the cycle.

An NVML call is a C call that Python cannot interrupt, and a driver that is wedged (a GPU
falling off the bus, a stuck RM lock, ``nvidia-smi`` hanging on the same box) can block one
for minutes. :class:`GpuGuard` runs each GPU's work in that GPU's own daemon thread and
waits for it at most until the cycle's deadline. A GPU whose work is late is *stalled*:
the cycle goes on without it, and while its thread is still inside the call no new work is
queued for it (a stuck GPU holds one thread, never a growing pile). When the call returns,
the next cycle reads the GPU again.

The threads are daemons, so a call that never returns cannot keep the agent from exiting.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Stalled(Exception):
    """The GPU's NVML work did not finish before the deadline (or is still running)."""

    def __init__(self, key: str, since: float) -> None:
        self.key = key
        self.since = since  # time.monotonic() when the late work started
        super().__init__(f"an NVML call has not returned for {time.monotonic() - since:.1f} s")


class _Worker:
    def __init__(self, key: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        self.busy: tuple[Future[Any], float] | None = None  # late work and when it started
        thread = threading.Thread(target=self._run, name=f"nvml-{key}", daemon=True)
        thread.start()

    def _run(self) -> None:
        while True:
            fn, future = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        self._jobs.put((fn, future))
        return future


class Job(Generic[T]):
    """Work queued on one GPU's thread."""

    def __init__(self, key: str, future: Future[T]) -> None:
        self.key, self.future, self.started = key, future, time.monotonic()


class GpuGuard:
    """One worker thread per GPU; :meth:`submit` then :meth:`result` against a deadline."""

    def __init__(self) -> None:
        self._workers: dict[str, _Worker] = {}
        self._lock = threading.Lock()

    def submit(self, key: str, fn: Callable[[], T]) -> Job[T]:
        """Queue ``fn`` on ``key``'s thread; raises :class:`Stalled` if that thread is still
        inside late work from an earlier cycle."""
        with self._lock:
            worker = self._workers.get(key)
            if worker is None:
                worker = self._workers[key] = _Worker(key)
        if worker.busy is not None:
            late, since = worker.busy
            if not late.done():
                raise Stalled(key, since)
            worker.busy = None
        return Job(key, worker.submit(fn))

    def result(self, job: Job[T], deadline: float) -> T:
        """The job's result, or :class:`Stalled` once ``deadline`` (monotonic) has passed."""
        try:
            return job.future.result(timeout=max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            self._workers[job.key].busy = (job.future, job.started)
            raise Stalled(job.key, job.started) from None

    def run(self, key: str, fn: Callable[[], T], deadline: float) -> T:
        return self.result(self.submit(key, fn), deadline)
