"""edge-gpu-relay edge agent: NVML telemetry, container/pod attribution, local exposition."""

from __future__ import annotations

__version__ = "0.1.0"
