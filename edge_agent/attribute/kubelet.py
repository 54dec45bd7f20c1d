"""Container id → Kubernetes pod, read from the kubelet's log directories (no API server).

The kubelet links every container's log as
``/var/log/containers/<pod>_<namespace>_<container>-<64hex id>.log``. Pod names and
namespaces are DNS names (no underscores), container names are DNS labels, so the name
splits on the first two underscores and the id is the 64 hex after the last dash. Only the
names are read: a link that dangles (``/var/log/pods`` not mounted into the agent) still
counts.

Fallback, by pod uid: ``/var/log/pods/<namespace>_<pod>_<uid>/<container>/`` gives the
namespace and pod name, and the container name when the pod has exactly one container
directory. (The pre-1.14 layout ``/var/log/pods/<uid>/`` carries no names and is ignored.)
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "EARLY_RESCAN_S",
    "KubeletLogIndex",
    "PodRef",
    "parse_container_log_name",
    "parse_pod_log_dir_name",
]

_log = logging.getLogger(__name__)

EARLY_RESCAN_S = 5.0
"""Least time between two scans triggered by a container id the index does not know."""

_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True, slots=True, kw_only=True)
class PodRef:
    """The pod a container belongs to; ``k8s_container`` may be ``""`` when not known."""

    pod_name: str
    namespace: str
    k8s_container: str = ""


def parse_container_log_name(name: str) -> tuple[str, PodRef] | None:
    """``<pod>_<namespace>_<container>-<64hex>.log`` → (container id, pod); else ``None``."""
    if not name.endswith(".log"):
        return None
    fields = name[:-4].split("_", 2)
    if len(fields) != 3:
        return None
    pod, namespace, tail = fields
    container, dash, container_id = tail.rpartition("-")
    if not (pod and namespace and container and dash) or not _HEX64.fullmatch(container_id):
        return None
    return container_id, PodRef(pod_name=pod, namespace=namespace, k8s_container=container)


def parse_pod_log_dir_name(name: str) -> tuple[str, PodRef] | None:
    """``<namespace>_<pod>_<uid>`` → (pod uid, pod without container); else ``None``."""
    fields = name.split("_")
    if len(fields) != 3 or not all(fields):
        return None
    namespace, pod, uid = fields
    return uid, PodRef(pod_name=pod, namespace=namespace)


def _ignore(_reason: str) -> None:
    return None


class KubeletLogIndex:
    """An index of both log directories, rescanned at most once per ``ttl``.

    A container id the index does not know triggers an early rescan, at most once per
    ``early_rescan`` seconds, so a pod started a moment ago is found on the next cycle.
    A missing directory is an empty index (a host without Kubernetes); a directory that
    cannot be read keeps the previous index and reports ``"log_dir"`` to ``on_error``.
    """

    def __init__(
        self,
        *,
        container_log_dir: Path,
        pod_log_dir: Path,
        ttl: float,
        clock: Callable[[], float],
        early_rescan: float = EARLY_RESCAN_S,
        on_error: Callable[[str], None] = _ignore,
    ) -> None:
        self._container_log_dir = container_log_dir
        self._pod_log_dir = pod_log_dir
        self._ttl = ttl
        self._early_rescan = min(early_rescan, ttl)
        self._clock = clock
        self._on_error = on_error
        self._by_container: dict[str, PodRef] = {}
        self._by_pod_uid: dict[str, tuple[PodRef, str]] = {}  # uid → (pod, directory name)
        self._pod_containers: dict[str, str] = {}  # uid → only container name, or ""
        self._scanned_at = -math.inf

    def lookup(self, container_id: str, pod_uid: str) -> PodRef | None:
        """The pod of a container (by id, else by pod uid), or ``None``."""
        now = self._clock()
        if now - self._scanned_at >= self._ttl:
            self._scan(now)
        if self._unknown(container_id, pod_uid) and now - self._scanned_at >= self._early_rescan:
            self._scan(now)
        if container_id:
            ref = self._by_container.get(container_id)
            if ref is not None:
                return ref
        return self._from_pod_dir(pod_uid) if pod_uid else None

    def _unknown(self, container_id: str, pod_uid: str) -> bool:
        if container_id:
            return container_id not in self._by_container
        return bool(pod_uid) and pod_uid not in self._by_pod_uid

    def _scan(self, now: float) -> None:
        self._scanned_at = now
        by_container: dict[str, PodRef] = {}
        names = self._list(self._container_log_dir)
        if names is not None:
            for name in names:
                parsed = parse_container_log_name(name)
                if parsed is not None:
                    by_container[parsed[0]] = parsed[1]
            self._by_container = by_container
        names = self._list(self._pod_log_dir)
        if names is not None:
            by_pod_uid: dict[str, tuple[PodRef, str]] = {}
            for name in names:
                parsed_dir = parse_pod_log_dir_name(name)
                if parsed_dir is not None:
                    by_pod_uid[parsed_dir[0]] = (parsed_dir[1], name)
            self._by_pod_uid = by_pod_uid
            self._pod_containers = {}

    def _list(self, directory: Path) -> list[str] | None:
        """Entry names; ``[]`` when the directory is missing, ``None`` when unreadable."""
        try:
            with os.scandir(directory) as entries:
                return [entry.name for entry in entries]
        except FileNotFoundError:
            return []
        except OSError as exc:
            _log.warning("cannot list %s: %s", directory, str(exc))
            self._on_error("log_dir")
            return None

    def _from_pod_dir(self, pod_uid: str) -> PodRef | None:
        hit = self._by_pod_uid.get(pod_uid)
        if hit is None:
            return None
        pod, dir_name = hit
        container = self._pod_containers.get(pod_uid)
        if container is None:
            container = self._only_container(self._pod_log_dir / dir_name)
            self._pod_containers[pod_uid] = container
        if not container:
            return pod
        return PodRef(pod_name=pod.pod_name, namespace=pod.namespace, k8s_container=container)

    def _only_container(self, pod_dir: Path) -> str:
        try:
            with os.scandir(pod_dir) as entries:
                names = [entry.name for entry in entries if entry.is_dir()]
        except OSError:
            return ""
        return names[0] if len(names) == 1 else ""
