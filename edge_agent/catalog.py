"""The metric catalogue: a dcgm-exporter counters CSV (``field, prom_type, help``).

The catalogue is data, not code: users bring their existing dcgm-exporter CSV and it
works unchanged. Parsing is pure; errors name the file and line.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Literal

from edge_agent.errors import CountersFileError
from gpurelay.families import known
from gpurelay.naming import DEFAULT_NAMING, Naming

log = logging.getLogger(__name__)

FieldKind = Literal["gauge", "counter", "label"]
_KINDS: frozenset[str] = frozenset({"gauge", "counter", "label"})
# The built-in counters, by naming scheme (gpurelay.naming): dcgm-exporter 4.8's names,
# or 4.9's (DCGM 4.7 names and units).
DEFAULT_COUNTERS: dict[str, str] = {
    "4.8": "default-counters.csv",
    "4.9": "default-counters-4.9.csv",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class CounterSpec:
    field: str
    kind: FieldKind
    help: str


def parse_counters(text: str, source: str = "<counters>") -> tuple[CounterSpec, ...]:
    """Parse counters CSV text; the first occurrence of a field wins, duplicates are errors."""
    specs: list[CounterSpec] = []
    seen: set[str] = set()
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = [p.strip() for p in line.split(",", 2)]
        if len(parts) < 2 or not parts[0]:
            raise CountersFileError(
                f"{source}:{lineno}: expected 'FIELD, TYPE, HELP', got {line!r}"
            )
        name, kind = parts[0], parts[1].lower()
        help_text = parts[2] if len(parts) == 3 else ""
        if not name.replace("_", "").isalnum() or not name[0].isalpha():
            raise CountersFileError(f"{source}:{lineno}: {name!r} is not a valid field name")
        if kind not in _KINDS:
            raise CountersFileError(
                f"{source}:{lineno}: type {parts[1]!r} of {name} is not one of "
                "gauge, counter, label"
            )
        if name in seen:
            raise CountersFileError(f"{source}:{lineno}: field {name} is listed twice")
        seen.add(name)
        specs.append(CounterSpec(field=name, kind=kind, help=help_text or name))  # type: ignore[arg-type]
    if not any(s.kind != "label" for s in specs):
        raise CountersFileError(f"{source}: no gauge or counter fields found")
    return tuple(specs)


def load_counters(path: Path | None, naming: Naming = DEFAULT_NAMING) -> tuple[CounterSpec, ...]:
    """Load the user's CSV (its names are used as they are, 4.8's or 4.9's), or the packaged
    default of ``naming`` when ``path`` is None; a field whose TYPE the fleet's catalogue
    fixes otherwise takes the catalogue's (said once)."""
    if path is None:
        name = DEFAULT_COUNTERS[naming]
        text = resources.files("edge_agent.data").joinpath(name).read_text("utf-8")
        source = f"(built-in) {name}"
    else:
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise CountersFileError(f"counters file {path} cannot be read: {exc.strerror}") from exc
        source = str(path)
    specs, changed = conform(parse_counters(text, source))
    for spec, was in changed:
        log.warning(
            "%s: %s is a %s in the fleet's catalogue (dcgm-exporter's type; the gateway "
            "refuses it as a %s): published as a %s",
            source,
            spec.field,
            spec.kind,
            was,
            spec.kind,
        )
    return specs


def conform(
    specs: tuple[CounterSpec, ...],
) -> tuple[tuple[CounterSpec, ...], list[tuple[CounterSpec, FieldKind]]]:
    """The specs with the catalogue's TYPE where it lists the field (:mod:`gpurelay.families`:
    one TYPE per family for the whole fleet), and the ones changed with their old kind."""
    out: list[CounterSpec] = []
    changed: list[tuple[CounterSpec, FieldKind]] = []
    for spec in specs:
        fixed = known(spec.field)
        if fixed is None or spec.kind in ("label", fixed.type):
            out.append(spec)
            continue
        kept = CounterSpec(field=spec.field, kind=fixed.type, help=spec.help)
        changed.append((kept, spec.kind))
        out.append(kept)
    return tuple(out), changed
