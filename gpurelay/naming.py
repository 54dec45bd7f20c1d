"""dcgm-exporter's two naming schemes: 4.8 (DCGM's historical field names) and 4.9.

dcgm-exporter 4.9.0 (DCGM 4.7) publishes its default fields under their DCGM 4.7 names,
some in another unit (Hz for MHz, J for mJ, a 0-1 ratio for %, bytes for MiB, B/s for
MB/s), and the driver label as ``DCGM_FI_SYSTEM_DRIVER_VERSION``. The map is data
(``gpurelay/data/dcgm-names.csv``, each row with the source it was read from); this
module reads it. Both binaries use it: the agent to publish a field under either name,
the gateway to read the series it derives (page, BIE, OTLP) under either.

Pure data, shared by both binaries (neither imports the other).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from importlib import resources
from types import MappingProxyType
from typing import Final, Literal

NAMES_FILE: Final = "dcgm-names.csv"
Naming = Literal["4.8", "4.9"]
NAMINGS: Final[tuple[Naming, ...]] = ("4.8", "4.9")
DEFAULT_NAMING: Final[Naming] = "4.8"  # until the inferred 4.9 names are read (migration.md)

# The driver-version label on every device series, by scheme.
DRIVER_LABEL: Final[Mapping[str, str]] = MappingProxyType(
    {"4.8": "DCGM_FI_DRIVER_VERSION", "4.9": "DCGM_FI_SYSTEM_DRIVER_VERSION"}
)


class NamingError(ValueError):
    """The packaged map does not parse (a build error, never a user's)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Rename:
    """One field under both schemes: ``value_49 = value_48 * multiply / divide``."""

    old: str
    new: str
    old_unit: str
    new_unit: str
    multiply: int
    divide: int
    default: bool  # in dcgm-exporter 4.8's shipped default-counters.csv
    source: str

    @property
    def rescales(self) -> bool:
        return self.multiply != 1 or self.divide != 1

    def to_new(self, value: float) -> float:
        """The 4.8 value in the 4.9 unit (multiplied, then divided: 70 / 100 is 0.7)."""
        return value * self.multiply / self.divide

    def to_old(self, value: float) -> float:
        """The 4.9 value in the 4.8 unit (0.7 * 100 / 1 is 70.0)."""
        return value * self.divide / self.multiply


def parse_names(text: str, source: str = NAMES_FILE) -> tuple[Rename, ...]:
    out: list[Rename] = []
    seen: set[str] = set()
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = [p.strip() for p in line.split(",", 7)]
        if len(parts) != 8 or parts[6] not in ("yes", "no"):
            raise NamingError(f"{source}:{lineno}: expected 8 columns, got {line!r}")
        old, new = parts[0], parts[1]
        if old in seen or new in seen or old == new:
            raise NamingError(f"{source}:{lineno}: {old} or {new} is listed twice")
        seen.update((old, new))
        try:
            multiply, divide = int(parts[4]), int(parts[5])
        except ValueError as exc:
            raise NamingError(f"{source}:{lineno}: multiply and divide must be integers") from exc
        if multiply < 1 or divide < 1:
            raise NamingError(f"{source}:{lineno}: multiply and divide must be positive")
        out.append(
            Rename(
                old=old,
                new=new,
                old_unit=parts[2],
                new_unit=parts[3],
                multiply=multiply,
                divide=divide,
                default=parts[6] == "yes",
                source=parts[7],
            )
        )
    return tuple(out)


@cache
def renames() -> tuple[Rename, ...]:
    """The packaged map (read once)."""
    text = resources.files("gpurelay.data").joinpath(NAMES_FILE).read_text("utf-8")
    return parse_names(text)


@cache
def by_old() -> Mapping[str, Rename]:
    return MappingProxyType({r.old: r for r in renames()})


@cache
def by_new() -> Mapping[str, Rename]:
    return MappingProxyType({r.new: r for r in renames()})


def name_in(field: str, naming: Naming) -> str:
    """``field`` (under either scheme) as ``naming`` names it; a field the map does not list
    keeps its name under both."""
    if naming == "4.9":
        hit = by_old().get(field)
        return hit.new if hit is not None else field
    back = by_new().get(field)
    return back.old if back is not None else field


def scheme_of(field: str) -> Naming | None:
    """Which scheme's name ``field`` is (None: the same under both)."""
    if field in by_old():
        return "4.8"
    if field in by_new():
        return "4.9"
    return None


def with_49_names(families: frozenset[str]) -> frozenset[str]:
    """``families`` (4.8 names) and their 4.9 names: what a reader of either tracks."""
    renames = by_old()
    return families | {renames[f].new for f in families if f in renames}
