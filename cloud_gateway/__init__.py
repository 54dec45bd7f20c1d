"""edge-gpu-relay cloud gateway (not built yet: see cloud_gateway.cli)."""

from __future__ import annotations

__version__ = "0.1.0"
