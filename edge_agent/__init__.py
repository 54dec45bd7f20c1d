"""edge-gpu-relay edge agent: NVML telemetry, container/pod attribution, spool and tunnel."""

from __future__ import annotations

from gpurelay.version import installed_version

__version__ = installed_version()
