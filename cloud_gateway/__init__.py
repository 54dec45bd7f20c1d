"""edge-gpu-relay cloud gateway: SSH ingest, node registry, unified /metrics, proxy, API."""

from __future__ import annotations

from gpurelay.version import installed_version

__version__ = installed_version()
