"""The version of an installed binary, read from the distribution's metadata.

Both console scripts ship in one distribution (``edge-gpu-relay``), but each package
asks for its own version here, so neither reports the other's, and a future split into
two distributions changes only the name passed in.
"""

from __future__ import annotations

from importlib import metadata

DISTRIBUTION = "edge-gpu-relay"
UNKNOWN = "0+unknown"


def installed_version(distribution: str = DISTRIBUTION) -> str:
    """The installed version of ``distribution``; ``0+unknown`` when run from a tree that
    was never installed (then nothing can say which version it is)."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return UNKNOWN
