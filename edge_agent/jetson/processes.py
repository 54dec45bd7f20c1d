"""The Jetson's process collector: each process's GPU memory from nvmap, attributed to its
container and pod as on any node.

nvmap, the Tegra allocator that CUDA, TensorRT and the multimedia engines allocate
through, lists its clients in debugfs (:func:`~edge_agent.jetson.memory.read_nvmap_clients`);
the PIDs are the host's, so attribution reads the host's ``/proc`` like NVML's process
collector does. The series are that collector's: ``DCGM_CUSTOM_PROCESS_MEM_USED`` (MiB) per
process, with ``ProcessType="nvmap"`` (nvmap does not tell compute from graphics), and
``DCGM_CUSTOM_CONTAINER_MEM_USED`` / ``_PROCESSES`` per container.

What a Jetson cannot give is left out, never published as 0:

- per-process SM, copy, encoder and decoder utilisation: the kernel keeps no per-process
  GPU time (``DCGM_CUSTOM_PROCESS_SM_UTIL`` and ``DCGM_CUSTOM_CONTAINER_SM_UTIL`` are
  absent);
- everything, when debugfs is not readable (not mounted, or the agent is not root): then
  ``gpurelay_agent_degraded{part="process_list"}`` says why, and no process series is
  published.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

from edge_agent.collect_process import (
    PROCESS_FAMILIES,
    AttributorLike,
    ContainerSums,
    add_container_sums,
    owner_labels,
    process_labels,
)
from edge_agent.degraded import Degraded
from edge_agent.jetson.files import Missing
from edge_agent.jetson.memory import read_nvmap_clients
from gpurelay.model import MIB, Labels, SampleSink

_PUBLISHED = frozenset(
    {
        "DCGM_CUSTOM_PROCESS_MEM_USED",
        "DCGM_CUSTOM_CONTAINER_MEM_USED",
        "DCGM_CUSTOM_CONTAINER_PROCESSES",
    }
)
PART = "process_list"


class JetsonProcessCollector:
    name = "process"
    families = tuple(f for f in PROCESS_FAMILIES if f.name in _PUBLISHED)

    def __init__(
        self,
        sys_root: Path,
        attributor: AttributorLike,
        *,
        node: str,
        uuid: str,
        degraded: Degraded | None = None,
    ) -> None:
        self._sys = sys_root
        self._attr = attributor
        self._node = node
        self._uuid = uuid
        self.degraded = degraded or Degraded()
        self.errors: Counter[str] = Counter()
        self.pod_metadata: Callable[[str, str], Labels] = lambda _namespace, _pod: ()

    def collect(self, sink: SampleSink) -> None:
        for family in self.families:
            sink.declare(family)
        clients = read_nvmap_clients(self._sys)
        if isinstance(clients, Missing):
            self.degraded.report(
                "0", PART, f"no per-process GPU memory: nvmap's debugfs list {clients}"
            )
            return
        self.degraded.clear("0", PART)
        containers: dict[tuple[Labels, str], ContainerSums] = {}
        for pid, size in sorted(clients.items()):
            a = self._attr.attribute(pid)
            pod = self.pod_metadata(a.namespace, a.pod_name) if a.pod_name else ()
            owner = owner_labels(self._node, a, ("0", self._uuid, ""), pod)
            mib = size / MIB
            sink.add("DCGM_CUSTOM_PROCESS_MEM_USED", process_labels(owner, pid, a, "nvmap"), mib)
            if a.container_id:
                sums = containers.setdefault((owner, a.container_id), ContainerSums(0.0, None))
                sums.add(mib, None)
        add_container_sums(sink, containers)
