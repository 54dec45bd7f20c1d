"""PID → container → pod: the attribution stage between collect and encode.

Per call, ``<proc_root>/<pid>/cgroup`` and ``comm`` are read afresh (PIDs are reused);
what is expensive is cached: the kubelet log index is rescanned at most once per TTL (early,
rate-limited, for a container id it does not know), and runtime API answers are cached per
container id for the TTL, negative answers included. A runtime socket whose daemon does
not answer is skipped for the TTL. Rootless runtimes' per-user sockets are found by the
patterns among ``runtime_sockets`` and asked only about their own user's containers
(:mod:`edge_agent.attribute.runtime_sockets`).

Per-PID problems never raise; they are counted by reason in :meth:`Attributor.errors`:

==============  ====================================================================
``vanished``    the process exited before its cgroup file was read (empty labels)
``unreadable``  the cgroup file exists but cannot be read (permission, not a file, …)
``unparsed``    the cgroup file has no ``N:controllers:/path`` line
``runtime_api`` a runtime socket exists but its API failed, timed out or answered 5xx
``log_dir``     a kubelet log directory exists but cannot be listed
==============  ====================================================================

The runtime of a bare ``/kubepods/…/pod<uid>/<id>`` path (cgroupfs driver) is ambiguous —
containerd or dockershim — so it is ``""`` unless a Docker or Podman socket knows the id.

An :class:`Attributor` is meant for one caller at a time (the collection loop). A cache miss
for a Docker or Podman container may block for up to ``api_timeout`` per runtime socket.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from edge_agent.attribute.cgroup import HOST_CGROUP, CgroupRef, parse_cgroup
from edge_agent.attribute.kubelet import KubeletLogIndex, PodRef
from edge_agent.attribute.runtime_api import ContainerInfo, RuntimeApiError, RuntimeDownError
from edge_agent.attribute.runtime_sockets import RuntimeSockets

__all__ = ["HOST", "Attribution", "Attributor"]

_log = logging.getLogger(__name__)

DEFAULT_RUNTIME_SOCKETS = (
    Path("/var/run/docker.sock"),
    Path("/run/podman/podman.sock"),
    Path("/run/user/*/podman/podman.sock"),  # rootless Podman (podman.socket of each user)
    Path("/run/user/*/docker.sock"),  # rootless Docker
)
_ENGINE_RUNTIMES = frozenset({"docker", "podman", ""})  # runtimes a Docker-API socket may know


@dataclass(frozen=True, slots=True, kw_only=True)
class Attribution:
    """The labels of one GPU process; every field ``""`` for a host process."""

    container_id: str = ""  # 12-hex short id
    runtime: str = ""  # "docker" | "containerd" | "crio" | "podman" | ""
    container_name: str = ""  # the runtime's name (Docker/Podman API)
    pod_uid: str = ""
    pod_name: str = ""
    namespace: str = ""
    k8s_container: str = ""
    process_name: str = ""  # /proc/<pid>/comm


HOST = Attribution()


@dataclass(frozen=True, slots=True)
class _EngineAnswer:
    info: ContainerInfo | None
    runtime: str  # the runtime of the socket that answered, "" if none did


_NO_ANSWER = _EngineAnswer(None, "")


class Attributor:
    """Attribute GPU process ids to containers and pods; every OS path is a parameter."""

    def __init__(
        self,
        *,
        proc_root: Path = Path("/proc"),
        container_log_dir: Path = Path("/var/log/containers"),
        pod_log_dir: Path = Path("/var/log/pods"),
        runtime_sockets: Sequence[Path] = DEFAULT_RUNTIME_SOCKETS,
        cache_ttl: float = 60.0,
        api_timeout: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._proc = os.fspath(proc_root)
        self._ttl = cache_ttl
        self._clock = clock
        self._errors: dict[str, int] = {}
        self._kubelet = KubeletLogIndex(
            container_log_dir=container_log_dir,
            pod_log_dir=pod_log_dir,
            ttl=cache_ttl,
            clock=clock,
            on_error=self._count,
        )
        self._engines = RuntimeSockets(
            runtime_sockets, timeout=api_timeout, refresh=cache_ttl, clock=clock
        )
        self._engine_down_until: dict[Path, float] = {}  # socket → skipped until
        self._answers: dict[str, tuple[float, _EngineAnswer]] = {}  # id → (expiry, answer)
        self._sweep_at = -math.inf

    def attribute(self, pid: int) -> Attribution:
        """The labels of ``pid``; host labels (and a counted reason) when it cannot tell."""
        try:
            text = _read(f"{self._proc}/{pid}/cgroup")
        except (FileNotFoundError, ProcessLookupError):
            self._count("vanished")
            return HOST
        except OSError as exc:
            _log.debug("pid %d: cannot read cgroup: %s", pid, str(exc))
            self._count("unreadable")
            return Attribution(process_name=self._comm(pid))
        comm = self._comm(pid)
        ref = parse_cgroup(text)
        if ref is None:
            _log.debug("pid %d: unrecognised cgroup file %r", pid, text[:200])
            self._count("unparsed")
            return Attribution(process_name=comm)
        if ref is HOST_CGROUP:
            return Attribution(process_name=comm)
        return self._resolve(ref, comm)

    def errors(self) -> Mapping[str, int]:
        """Cumulative counts of per-PID problems by reason (a copy)."""
        return dict(self._errors)

    def close(self) -> None:
        """Close the runtime API clients; the attributor must not be used afterwards."""
        self._engines.close()

    # -- resolution -------------------------------------------------------------------

    def _resolve(self, ref: CgroupRef, comm: str) -> Attribution:
        pod = self._kubelet.lookup(ref.container_id, ref.pod_uid) if ref.pod_uid else None
        answer = _NO_ANSWER
        if ref.container_id and ref.runtime in _ENGINE_RUNTIMES:
            answer = self._engine_answer(ref.container_id, ref.owner_uid)
        info = answer.info or ContainerInfo()
        if pod is None:
            pod = PodRef(pod_name=info.pod_name, namespace=info.namespace)
        return Attribution(
            container_id=ref.container_id[:12],
            runtime=ref.runtime or answer.runtime,
            container_name=info.name,
            pod_uid=ref.pod_uid,
            pod_name=pod.pod_name,
            namespace=pod.namespace,
            k8s_container=pod.k8s_container or info.k8s_container,
            process_name=comm,
        )

    def _engine_answer(self, container_id: str, owner_uid: int | None) -> _EngineAnswer:
        now = self._clock()
        cached = self._answers.get(container_id)
        if cached is not None and now < cached[0]:
            return cached[1]
        answer = self._ask_engines(container_id, owner_uid, now)
        self._sweep(now)
        self._answers[container_id] = (now + self._ttl, answer)
        return answer

    def _ask_engines(self, container_id: str, owner_uid: int | None, now: float) -> _EngineAnswer:
        for engine in self._engines.for_container(owner_uid):
            if now < self._engine_down_until.get(engine.socket, -math.inf):
                continue
            try:
                info = engine.inspect(container_id)
            except RuntimeDownError as exc:
                self._engine_down_until[engine.socket] = now + self._ttl
                # str(): a log record must not keep the exception (and its socket) alive
                _log.warning("%s; not asked again for %.0f s", str(exc), self._ttl)
                self._count("runtime_api")
                continue
            except RuntimeApiError as exc:
                _log.warning("%s", str(exc))
                self._count("runtime_api")
                continue
            if info is not None:
                return _EngineAnswer(info, engine.runtime)
        return _NO_ANSWER

    def _sweep(self, now: float) -> None:
        """Drop expired answers, at most once per TTL, so container churn cannot grow memory."""
        if now < self._sweep_at:
            return
        self._sweep_at = now + self._ttl
        self._answers = {cid: hit for cid, hit in self._answers.items() if now < hit[0]}

    # -- small helpers ----------------------------------------------------------------

    def _comm(self, pid: int) -> str:
        try:
            return _read(f"{self._proc}/{pid}/comm").strip()
        except OSError:
            return ""

    def _count(self, reason: str) -> None:
        self._errors[reason] = self._errors.get(reason, 0) + 1


_READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC


def _read(path: str) -> str:
    """A small /proc file, read with plain system calls: ``open()``'s buffered file object
    cost about as much as the read itself, twice per process every attribution pass."""
    fd = os.open(path, _READ_FLAGS)
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks).decode("utf-8", "replace")
