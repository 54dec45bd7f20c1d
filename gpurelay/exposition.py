"""Render a snapshot in the Prometheus text format (0.0.4) or OpenMetrics 1.0.

Pure functions. The body is family-major: every family's samples are grouped under its
``# HELP``/``# TYPE`` header, as the text format requires.

Names are kept exactly as dcgm-exporter and ACK publish them. dcgm-exporter's counters do
not end in ``_total``; OpenMetrics would force a ``_total`` suffix onto counter samples
and so rename them in the TSDB, which breaks every existing dashboard and HPA rule. In
OpenMetrics such counters are therefore typed ``unknown`` (same sample name, same
values); our own ``gpurelay_*_total`` counters are proper OpenMetrics counters.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from gpurelay.model import Family, Labels, Sample, Snapshot

TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS_CONTENT_TYPE = "application/openmetrics-text; version=1.0.0; charset=utf-8"


def wants_openmetrics(accept: str) -> bool:
    """Content negotiation as Prometheus does it: OpenMetrics only when asked for."""
    for part in accept.split(","):
        if part.split(";", 1)[0].strip() == "application/openmetrics-text":
            return True
    return False


def wants_gzip(accept_encoding: str) -> bool:
    """Whether an ``Accept-Encoding`` value takes gzip: the token ``gzip`` (or ``*``) with a
    quality above 0, as RFC 9110 §12.5.3 reads it. A substring test took ``x-gzip`` and
    ``gzip;q=0`` (gzip refused) for gzip; both binaries used one."""
    for part in accept_encoding.split(","):
        token, _, params = part.partition(";")
        if token.strip().lower() not in ("gzip", "*"):
            continue
        quality = 1.0
        for param in params.split(";"):
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    quality = float(value.strip())
                except ValueError:
                    quality = 0.0
        if quality > 0:
            return True
    return False


def format_value(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


def escape_label_value(value: str) -> str:
    if "\\" not in value and "\n" not in value and '"' not in value:
        return value  # most values: nothing to escape
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def format_labels(labels: Labels) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{escape_label_value(v)}"' for k, v in labels)
    return "{" + inner + "}"


def _grouped(families: Iterable[Family], samples: Iterable[Sample]) -> dict[str, list[Sample]]:
    groups: dict[str, list[Sample]] = {f.name: [] for f in families}
    for s in samples:
        groups.setdefault(s.name, []).append(s)
    return groups


def text_header(name: str, fam: Family | None) -> str:
    if fam is None:
        return ""
    return f"# HELP {name} {escape_help(fam.help)}\n# TYPE {name} {fam.type}\n"


def openmetrics_header(name: str, fam: Family | None) -> str:
    """OpenMetrics names the family without ``_total``; see the module docstring."""
    family_name, kind = name, fam.type if fam else "unknown"
    if kind == "counter":
        if name.endswith("_total"):
            family_name = name[: -len("_total")]
        else:
            kind = "unknown"
    help_line = f"# HELP {family_name} {escape_help(fam.help)}\n" if fam else ""
    return f"{help_line}# TYPE {family_name} {kind}\n"


def _render(snapshot: Snapshot, header: Callable[[str, Family | None], str]) -> list[str]:
    out: list[str] = []
    types = {f.name: f for f in snapshot.families}
    for name, samples in _grouped(snapshot.families, snapshot.samples).items():
        if samples:
            out.append(header(name, types.get(name)))
            out.extend(
                f"{name}{format_labels(s.labels)} {format_value(s.value)}\n" for s in samples
            )
    return out


def render_text(snapshot: Snapshot) -> bytes:
    return "".join(_render(snapshot, text_header)).encode()


def render_openmetrics(snapshot: Snapshot) -> bytes:
    return ("".join(_render(snapshot, openmetrics_header)) + "# EOF\n").encode()
