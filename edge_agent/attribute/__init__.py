"""Attribution: GPU process id → container → Kubernetes pod, without the Kubernetes API.

``cgroup`` parses ``/proc/<pid>/cgroup`` (pure), ``kubelet`` indexes the kubelet's log
directories, ``runtime_api`` asks the Docker/Podman API for names (``runtime_sockets``
says which sockets, rootless users' included), and ``attributor`` ties them together
with caching and error counting.

The other direction, GPU → container → pod, comes from the kubelet itself: ``pod_resources``
asks its pod-resources API (``edge_agent.podresources``) which container holds which GPU,
and ``device_ids`` reads the device plugins' ids (UUIDs, MIG, replicas, indices).
"""

from __future__ import annotations

from edge_agent.attribute.attributor import HOST, Attribution, Attributor
from edge_agent.attribute.cgroup import CgroupRef, parse_cgroup

__all__ = ["HOST", "Attribution", "Attributor", "CgroupRef", "parse_cgroup"]
