"""Parse ``/proc/<pid>/cgroup`` into a container id, a runtime and a Kubernetes pod uid.

Pure functions over text; no I/O. Both cgroup versions are handled:

* v1 has one ``N:controller[,controller]:/path`` line per hierarchy (``1:name=systemd:...``);
* v2 has a single ``0::/path`` line; hybrid systems have both.

On v1 not every hierarchy necessarily shows the container (``cpuset`` or ``name=systemd``
may still say ``/``, a hybrid system adds ``0::/``), so every line is parsed and the container
id that appears on the most lines wins (the first seen on a tie) — never just the first or
the last line.

Path segments that name a container, innermost first:

============================================  ==============
``<64hex>``                                   runtime from the parent: ``/docker/<id>`` is
                                              docker; under ``kubepods`` it is containerd
                                              *or* dockershim, so ``""`` (unknown)
``docker-<64hex>.scope``                      docker (systemd cgroup driver)
``cri-containerd-<64hex>.scope``              containerd
``crio-<64hex>.scope`` / ``crio-<64hex>``     crio (``crio-conmon-<id>.scope`` is the monitor,
                                              not the container, and is ignored)
``libpod-<64hex>.scope`` / ``libpod-<64hex>``  podman (``libpod-conmon-…`` ignored; a nested
                                              ``libpod-<id>.scope/container`` works too)
``nerdctl-<64hex>.scope``                     containerd (nerdctl, systemd driver)
============================================  ==============

A segment ``pod<uid>`` (cgroupfs) or ``…-pod<uid>.slice`` (systemd, dashes written as
underscores) above the container gives the pod uid; static pods have a 32-hex uid.
Relative paths (``0::/../../kubepods.slice/…``, seen from inside a cgroup namespace) work.

A segment ``user@<uid>.service`` above the container (a user's systemd manager) marks a
rootless runtime and gives its owner: rootless Podman puts a container in
``/user.slice/user-<uid>.slice/user@<uid>.service/user.slice/libpod-<id>.scope`` (a pod's
in ``…/user.slice/user-libpod_pod_<pod>.slice/libpod-<id>.scope``, crun may add
``/container``), rootless Docker in ``…/user@<uid>.service/user.slice/docker-<id>.scope``.
Only that user's runtime socket can name such a container (see ``runtime_sockets``).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

__all__ = ["HOST_CGROUP", "CgroupRef", "parse_cgroup", "parse_cgroup_path"]


@dataclass(frozen=True, slots=True, kw_only=True)
class CgroupRef:
    """Where a process sits: full container id (64 hex, ``""`` on the host), runtime, pod
    uid, and for a rootless runtime's container the uid of the user who runs it."""

    container_id: str = ""
    runtime: str = ""
    pod_uid: str = ""
    owner_uid: int | None = None  # from ``user@<uid>.service``; None: not a user's container


HOST_CGROUP = CgroupRef()

_CONTAINER_SEGMENT = re.compile(
    r"(?:(?P<prefix>docker|cri-containerd|crio|libpod|nerdctl)-)?"
    r"(?P<id>[0-9a-f]{64})(?:\.scope)?"
)
_POD_SEGMENT = re.compile(
    r"(?:.*-)?pod(?P<uid>"
    r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}"
    r"|[0-9a-f]{32})(?:\.slice)?"
)
_RUNTIME_BY_PREFIX = {
    "docker": "docker",
    "cri-containerd": "containerd",
    "crio": "crio",
    "libpod": "podman",
    "nerdctl": "containerd",
}
_USER_MANAGER_SEGMENT = re.compile(r"user@(?P<uid>[0-9]{1,10})\.service")
# Parent directory of a bare ``<64hex>`` segment that names its runtime (cgroupfs driver).
_RUNTIME_BY_PARENT = {"docker": "docker", "libpod_parent": "podman"}


def parse_cgroup(text: str) -> CgroupRef | None:
    """Parse a whole ``/proc/<pid>/cgroup`` file.

    Returns ``None`` when no line has the ``N:controllers:/path`` shape (garbage),
    :data:`HOST_CGROUP` when the lines are valid but name no container and no pod.
    """
    found: list[CgroupRef] = []
    valid = False
    for line in text.splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3 or not fields[0].isdigit() or not fields[2].startswith("/"):
            continue
        valid = True
        ref = parse_cgroup_path(fields[2])
        if ref is not HOST_CGROUP:
            found.append(ref)
    if not valid:
        return None
    if not found:
        return HOST_CGROUP
    return _best(found)


@lru_cache(maxsize=4096)
def parse_cgroup_path(path: str) -> CgroupRef:
    """Parse one cgroup path (the part after the second colon); cached, paths repeat a lot."""
    segments = path.split("/")
    for index in range(len(segments) - 1, -1, -1):
        match = _CONTAINER_SEGMENT.fullmatch(segments[index])
        if match is None:
            continue
        prefix = match.group("prefix")
        if prefix is not None:
            runtime = _RUNTIME_BY_PREFIX[prefix]
        else:
            parent = segments[index - 1] if index > 0 else ""
            runtime = _RUNTIME_BY_PARENT.get(parent, "")
        return CgroupRef(
            container_id=match.group("id"),
            runtime=runtime,
            pod_uid=_pod_uid(segments[:index]),
            owner_uid=_owner_uid(segments[:index]),
        )
    pod_uid = _pod_uid(segments)
    return CgroupRef(pod_uid=pod_uid) if pod_uid else HOST_CGROUP


def _pod_uid(segments: list[str]) -> str:
    for segment in reversed(segments):
        match = _POD_SEGMENT.fullmatch(segment)
        if match is not None:
            return match.group("uid").replace("_", "-")
    return ""


def _owner_uid(segments: list[str]) -> int | None:
    for segment in reversed(segments):
        match = _USER_MANAGER_SEGMENT.fullmatch(segment)
        if match is not None:
            return int(match.group("uid"))
    return None


def _best(found: list[CgroupRef]) -> CgroupRef:
    """The container id seen on most lines; runtime and pod uid from any line that has them."""
    counts = Counter(ref.container_id for ref in found if ref.container_id)
    if not counts:
        return found[0]  # only pod-level cgroups (e.g. a conmon process): keep the pod uid
    winner = max(counts, key=lambda cid: counts[cid])  # first seen wins a tie
    same = [ref for ref in found if ref.container_id == winner]
    return CgroupRef(
        container_id=winner,
        runtime=next((ref.runtime for ref in same if ref.runtime), ""),
        pod_uid=next((ref.pod_uid for ref in same if ref.pod_uid), ""),
        owner_uid=next((ref.owner_uid for ref in same if ref.owner_uid is not None), None),
    )
