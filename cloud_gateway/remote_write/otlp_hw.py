"""The OpenTelemetry hardware semantic conventions for GPUs, from the DCGM series.

Sent on OTLP beside the DCGM names (``[otlp] semantic_conventions``, on by default), as the
conventions define them (open-telemetry/semantic-conventions, ``model/hardware/
gpu-metrics.yaml`` and ``common-metrics.yaml``, development status):

- ``hw.gpu.utilization`` (Gauge, ``1``): ``DCGM_FI_DEV_GPU_UTIL`` / 100 with
  ``hw.gpu.task`` ``general``, ``DCGM_FI_DEV_ENC_UTIL`` / 100 (``encoder``),
  ``DCGM_FI_DEV_DEC_UTIL`` / 100 (``decoder``);
- ``hw.gpu.memory.usage`` (UpDownCounter, ``By``): ``DCGM_FI_DEV_FB_USED`` x 2^20;
- under dcgm-exporter 4.9's names (gpurelay.naming), the same from
  ``DCGM_FI_DEV_GPU_UTIL_RATIO``, ``DCGM_FI_DEV_ENC_UTIL_RATIO``, ``DCGM_FI_DEV_DEC_UTIL_RATIO``
  (already ratios) and ``DCGM_FI_DEV_FB_USED_BYTES`` (bytes), and ``hw.gpu.memory.limit``
  (UpDownCounter, ``By``) from ``DCGM_FI_DEV_FB_CAPACITY_BYTES``: exact bytes, where 4.8's
  whole MiB are not;
- ``hw.errors`` (Counter, ``{error}``, ``hw.type`` ``gpu``): ``DCGM_FI_DEV_ECC_SBE_VOL_TOTAL``
  with ``error.type`` ``corrected``, ``DCGM_FI_DEV_ECC_DBE_VOL_TOTAL`` (``uncorrected``);
- ``hw.status`` (UpDownCounter, ``1``, ``hw.type`` ``gpu``): from every watch of
  ``DCGM_EXP_GPU_HEALTH_STATUS`` of the GPU at that instant, ``failed`` if one fails (20),
  ``degraded`` if one warns (10), else ``ok``: 1 for that ``hw.state``, 0 for each other
  of ``ok``, ``degraded``, ``failed``, ``predicted_failure``.

Every point carries ``hw.id`` (the GPU's UUID, required), ``hw.model`` (``modelName``),
``hw.driver_version`` (``DCGM_FI_DRIVER_VERSION``, 4.9: ``DCGM_FI_SYSTEM_DRIVER_VERSION``)
and ``hw.vendor`` ``NVIDIA``; the node is the resource's ``host.name``. Only whole GPUs: a
MIG instance's series (``GPU_I_ID``) has no ``hw.id`` of its own in the conventions and
would count its GPU twice.

Left out, and why: ``hw.gpu.memory.limit`` under 4.8's names and
``hw.gpu.memory.utilization`` (4.8 gives the framebuffer in whole MiB, each part rounded
down, so a total made of them would be off by up to 3 MiB; a ratio would need used and
capacity of one instant joined here); ``hw.gpu.io`` (a counter
of bytes, where DCGM gives PCIe rates: integrating them here would invent a counter).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from cloud_gateway.remote_write.prompb import Series
from gpurelay.model import MIB

# metric -> (instrument, unit): "gauge", "counter" (monotonic Sum), "updown" (Sum, not)
SHAPES: Final[dict[str, tuple[str, str]]] = {
    "hw.gpu.utilization": ("gauge", "1"),
    "hw.gpu.memory.usage": ("updown", "By"),
    "hw.gpu.memory.limit": ("updown", "By"),
    "hw.errors": ("counter", "{error}"),
    "hw.status": ("updown", "1"),
}
STATES: Final = ("ok", "degraded", "failed", "predicted_failure")
# DCGM field -> (metric, its own attributes, multiplier, divisor): value * mul / div, so
# that 42 % is 0.42 exactly (42 * 0.01 would be 0.42000000000000004)
_SIMPLE: Final[dict[str, tuple[str, tuple[tuple[str, str], ...], float, float]]] = {
    "DCGM_FI_DEV_GPU_UTIL": ("hw.gpu.utilization", (("hw.gpu.task", "general"),), 1, 100),
    "DCGM_FI_DEV_ENC_UTIL": ("hw.gpu.utilization", (("hw.gpu.task", "encoder"),), 1, 100),
    "DCGM_FI_DEV_DEC_UTIL": ("hw.gpu.utilization", (("hw.gpu.task", "decoder"),), 1, 100),
    "DCGM_FI_DEV_FB_USED": ("hw.gpu.memory.usage", (), MIB, 1),
    # dcgm-exporter 4.9's names and units
    "DCGM_FI_DEV_GPU_UTIL_RATIO": ("hw.gpu.utilization", (("hw.gpu.task", "general"),), 1, 1),
    "DCGM_FI_DEV_ENC_UTIL_RATIO": ("hw.gpu.utilization", (("hw.gpu.task", "encoder"),), 1, 1),
    "DCGM_FI_DEV_DEC_UTIL_RATIO": ("hw.gpu.utilization", (("hw.gpu.task", "decoder"),), 1, 1),
    "DCGM_FI_DEV_FB_USED_BYTES": ("hw.gpu.memory.usage", (), 1, 1),
    "DCGM_FI_DEV_FB_CAPACITY_BYTES": ("hw.gpu.memory.limit", (), 1, 1),
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": (
        "hw.errors",
        (("hw.type", "gpu"), ("error.type", "corrected")),
        1,
        1,
    ),
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": (
        "hw.errors",
        (("hw.type", "gpu"), ("error.type", "uncorrected")),
        1,
        1,
    ),
}
HEALTH: Final = "DCGM_EXP_GPU_HEALTH_STATUS"


def hardware_series(series: Sequence[Series], node_label: str) -> list[Series]:
    """The ``hw.*`` series the DCGM series of ``series`` give (see the module table)."""
    out: list[Series] = []
    worst: dict[tuple[tuple[tuple[str, str], ...], int], float] = {}  # (labels, ts) -> result
    for labels, samples in series:
        d = dict(labels)
        name = d.get("__name__", "")
        if (name not in _SIMPLE and name != HEALTH) or d.get("GPU_I_ID") or not d.get("UUID"):
            continue
        gpu: tuple[tuple[str, str], ...] = (
            (node_label, d.get(node_label, "")),
            ("hw.id", d["UUID"]),
            ("hw.model", d.get("modelName", "")),
            (
                "hw.driver_version",
                d.get("DCGM_FI_DRIVER_VERSION") or d.get("DCGM_FI_SYSTEM_DRIVER_VERSION", ""),
            ),
            ("hw.vendor", "NVIDIA"),
        )
        if name == HEALTH:
            for ts, value in samples:
                key = (gpu, ts)
                worst[key] = max(worst.get(key, 0.0), value)
            continue
        metric, own, mul, div = _SIMPLE[name]
        points = [(ts, value * mul / div) for ts, value in samples]
        out.append(((("__name__", metric), *gpu, *own), points))
    by_gpu: dict[tuple[tuple[str, str], ...], list[tuple[int, float]]] = {}
    for (gpu, ts), result in sorted(worst.items(), key=lambda item: item[0][1]):
        by_gpu.setdefault(gpu, []).append((ts, result))
    for gpu, points in by_gpu.items():
        for state in STATES:
            labels = (("__name__", "hw.status"), *gpu, ("hw.type", "gpu"), ("hw.state", state))
            out.append((labels, [(ts, 1.0 if state == _state(r) else 0.0) for ts, r in points]))
    return out


def _state(result: float) -> str:
    """DCGM's result (0 pass, 10 warn, 20 fail) as a ``hw.state``."""
    if result >= 20:
        return "failed"
    if result >= 10:
        return "degraded"
    return "ok"
