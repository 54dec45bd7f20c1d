"""NVML behind a seam: the real ``pynvml`` module or a faithful simulator."""

from __future__ import annotations

from edge_agent.nvml.backend import Handle, NvmlLib, open_real, text

__all__ = ["Handle", "NvmlLib", "open_real", "text"]
