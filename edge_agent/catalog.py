"""The metric catalogue: a dcgm-exporter counters CSV (``field, prom_type, help``).

The catalogue is data, not code: users bring their existing dcgm-exporter CSV and it
works unchanged. Parsing is pure; errors name the file and line.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Literal

from edge_agent.errors import CountersFileError

FieldKind = Literal["gauge", "counter", "label"]
_KINDS: frozenset[str] = frozenset({"gauge", "counter", "label"})
DEFAULT_COUNTERS = "default-counters.csv"


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


def load_counters(path: Path | None) -> tuple[CounterSpec, ...]:
    """Load the user's CSV, or the packaged default when ``path`` is None."""
    if path is None:
        text = resources.files("edge_agent.data").joinpath(DEFAULT_COUNTERS).read_text("utf-8")
        return parse_counters(text, f"(built-in) {DEFAULT_COUNTERS}")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CountersFileError(f"counters file {path} cannot be read: {exc.strerror}") from exc
    return parse_counters(text, str(path))
