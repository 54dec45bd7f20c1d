"""What the agent needs from Python 3.11's standard library, on 3.10 too.

The edge agent runs on Python 3.10 (JetPack 6's Ubuntu 22.04 has it; docs/jetson.md), the
gateway on 3.11 or newer. The few 3.11 names the agent and the shared core use come from
here: on 3.10, from their backports on PyPI (``async-timeout``, from which
``asyncio.timeout`` was taken, and ``tomli``, from which ``tomllib`` was), which
pyproject.toml requires only there.

On 3.10 a timeout raises ``asyncio.TimeoutError``, a class of its own; on 3.11 that name
is the built-in ``TimeoutError``. Code that catches a timeout catches :data:`TIMEOUTS`.
"""

from __future__ import annotations

import asyncio
import sys
from datetime import timezone
from typing import Final

if sys.version_info >= (3, 11):
    from asyncio import timeout, timeout_at

    import tomllib
else:  # pragma: no cover - run by tests/integration/test_python310.py
    import tomli as tomllib
    from async_timeout import timeout, timeout_at

UTC = timezone.utc
TIMEOUTS: Final = (TimeoutError, asyncio.TimeoutError)

__all__ = ["TIMEOUTS", "UTC", "timeout", "timeout_at", "tomllib"]
