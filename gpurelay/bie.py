"""Baidu BIE ``/v1/collect``: a map from node name to the node's GPU memory summary.

Format (shared/seeds/bie-custom-accelerator-metrics.zh.txt): ``{node: {deviceNum,
devices: [{usedMemory, totalMemory, percent}], usedMemory, totalMemory, percent}}``,
memory in bytes, ``percent`` the used/total fraction (0..1), sums over all cards.

A GPU that was not read (lost, or its NVML call hung) is left out of ``devices``,
``deviceNum`` and the sums: its memory was not measured, and a 0 would read as an empty
card to a scheduler.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypedDict

from gpurelay.model import GpuInventory


class BieDevice(TypedDict):
    usedMemory: int  # bytes
    totalMemory: int
    percent: float  # used/total, 0..1


class BieNode(TypedDict):
    deviceNum: int
    devices: list[BieDevice]
    usedMemory: int
    totalMemory: int
    percent: float


def _fraction(used: float, total: float) -> float:
    return used / total if total > 0 else 0.0


def node_summary(gpus: Iterable[GpuInventory]) -> BieNode:
    # a GPU lost, or whose memory is not known (total 0: a Jetson without nvmap's figures)
    gpus = [g for g in gpus if g.healthy and g.memory_total_bytes > 0]
    devices: list[BieDevice] = [
        {
            "usedMemory": g.memory_used_bytes,
            "totalMemory": g.memory_total_bytes,
            "percent": _fraction(g.memory_used_bytes, g.memory_total_bytes),
        }
        for g in gpus
    ]
    used = sum(d["usedMemory"] for d in devices)
    total = sum(d["totalMemory"] for d in devices)
    return {
        "deviceNum": len(devices),
        "devices": devices,
        "usedMemory": used,
        "totalMemory": total,
        "percent": _fraction(used, total),
    }


def collect_document(node: str, gpus: Iterable[GpuInventory]) -> dict[str, BieNode]:
    return {node: node_summary(gpus)}
