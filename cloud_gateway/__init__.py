"""edge-gpu-relay cloud gateway: SSH ingest, node registry, unified /metrics, proxy, API."""

from __future__ import annotations

import sys

from gpurelay.version import installed_version

# The package installs on 3.10 for the edge agent (JetPack 6); the gateway uses 3.11's
# standard library throughout: one clear line instead of an ImportError deep inside.
if sys.version_info < (3, 11):  # pragma: no cover - run by tests/integration/test_python310.py
    raise SystemExit(
        "cloud-gateway: error: needs Python 3.11 or newer, this is "
        f"{sys.version_info[0]}.{sys.version_info[1]} (the edge agent runs on 3.10)"
    )

__version__ = installed_version()
