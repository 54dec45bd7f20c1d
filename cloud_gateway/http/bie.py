"""The gateway's BIE ``/v1/collect``: each online node's GPU memory, as the agent's own.

Devices are the GPUs of the node's hello; the figures are the node's latest FB series.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from cloud_gateway.http.schemes import latest
from gpurelay.bie import BieNode, node_summary
from gpurelay.model import MIB, GpuInventory

if TYPE_CHECKING:
    from cloud_gateway.registry.store import Registry


def bie_document(registry: Registry, now: float) -> dict[str, BieNode]:
    """``{node: summary}`` for every *online* node, as the agent's ``/v1/collect``.

    Devices are the GPUs of the node's hello (physical GPUs; MIG instances are not
    devices). Used memory is the node's latest ``DCGM_FI_DEV_FB_USED`` of the GPU (the
    series without a ``GPU_I_ID``, matched by ``UUID``), MiB turned into bytes; total is
    the hello's exact byte count, or ``FB_USED + FB_FREE + FB_RESERVED`` where the hello
    had none (a GPU that was lost at connect). Without FB values the hello's figures stand.
    """
    return {
        view.name: node_summary(current_gpus(registry, view.name, view.gpus))
        for view in registry.nodes(now, state="online")
    }


def current_gpus(registry: Registry, node: str, gpus: Sequence[GpuInventory]) -> list[GpuInventory]:
    fb = {fam: _by_uuid(registry, node, fam) for fam in ("USED", "FREE", "RESERVED")}
    out = []
    for gpu in gpus:
        used = fb["USED"].get(gpu.uuid)
        if used is None:
            out.append(gpu)
            continue
        total = gpu.memory_total_bytes
        if total <= 0:
            parts = [fb[fam].get(gpu.uuid) for fam in ("USED", "FREE", "RESERVED")]
            total = round(sum(p for p in parts if p is not None) * MIB)
        out.append(
            dataclasses.replace(gpu, memory_used_bytes=round(used * MIB), memory_total_bytes=total)
        )
    return out


def _by_uuid(registry: Registry, node: str, field: str) -> dict[str, float]:
    """Latest ``DCGM_FI_DEV_FB_<field>`` (MiB) of each physical GPU, by UUID (4.9's
    ``DCGM_FI_DEV_FB_<field>_BYTES`` turned into MiB where the node publishes that)."""
    out = {}
    for labels, value in latest(registry, node, f"DCGM_FI_DEV_FB_{field}"):
        d = dict(labels)
        if not d.get("GPU_I_ID") and "UUID" in d:
            out[d["UUID"]] = value
    return out
