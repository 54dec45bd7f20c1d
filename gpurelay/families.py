"""The fleet's family catalogue: the TYPE and HELP of every family an agent publishes.

A family's TYPE and HELP are one for the whole ``/metrics``. For the names in the
catalogue (``gpurelay/data/families.csv``: the DCGM fields the agent reads, the ACK
names ``DCGM_CUSTOM_*``, the agent's own ``gpurelay_*``) they are the catalogue's, not
what the first node to declare one said: a node that declared ``DCGM_FI_PROF_SM_ACTIVE``
a counter made every other node's gauge refused (issue 24, attack W09). The gateway
refuses such a declaration for that node only; the agent declares its fields with the
catalogue's TYPE whatever its counters file says, and says so once.

Pure data, shared by both binaries (neither imports the other).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from importlib import resources
from types import MappingProxyType
from typing import Final

from gpurelay.model import Family

CATALOGUE_FILE: Final = "families.csv"
_TYPES: Final = frozenset({"gauge", "counter"})


class CatalogueError(ValueError):
    """The packaged catalogue does not parse (a build error, never a user's)."""


def parse_catalogue(text: str, source: str = CATALOGUE_FILE) -> Mapping[str, Family]:
    """``NAME, TYPE, HELP`` lines (``#`` comments, blank lines) as families by name."""
    out: dict[str, Family] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = [p.strip() for p in line.split(",", 2)]
        if len(parts) != 3 or parts[1] not in _TYPES or not parts[0] or not parts[2]:
            raise CatalogueError(f"{source}:{lineno}: expected 'NAME, gauge|counter, HELP'")
        if parts[0] in out:
            raise CatalogueError(f"{source}:{lineno}: {parts[0]} is listed twice")
        out[parts[0]] = Family(name=parts[0], type=parts[1], help=parts[2])  # type: ignore[arg-type]
    return MappingProxyType(out)


@cache
def catalogue() -> Mapping[str, Family]:
    """The packaged catalogue (read once)."""
    text = resources.files("gpurelay.data").joinpath(CATALOGUE_FILE).read_text("utf-8")
    return parse_catalogue(text)


def known(name: str) -> Family | None:
    """The catalogue's family of that name; ``None`` for a name it does not list."""
    return catalogue().get(name)
