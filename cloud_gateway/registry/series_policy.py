"""The gateway's own rules for a node's series, on top of the wire's naming rules.

:mod:`gpurelay.wire.rules` decides what a valid series is (names, label syntax, sizes); it
ran in the decoder before a series reaches the registry. This module decides what a node
may *publish* through this gateway (DESIGN.md, "Trust boundaries"): never the gateway's
own families, never a name Prometheus itself writes for a target, never the labels that
identify a target, never two series that differ only in the order of their labels, and
never more label bytes than its budget. Pure: no I/O.

Every refusal has a stable ``code`` (a metric label value, so a fixed set) and a message
for the node's log and the API.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from hashlib import blake2b
from itertools import chain
from typing import Final

from gpurelay.model import Labels

# Families Prometheus writes itself for every target: a node's series of the same name
# would be mixed with (or hide) the scrape's own.
PROMETHEUS_NAMES: Final = frozenset(
    {
        "up",
        "scrape_duration_seconds",
        "scrape_samples_scraped",
        "scrape_samples_post_metric_relabeling",
        "scrape_series_added",
        "scrape_timeout_seconds",
        "scrape_sample_limit",
        "scrape_body_size_bytes",
    }
)
# Target labels: with honor_labels a node could move its series to another job or
# instance; without it Prometheus renames them exported_*. Neither is what a node means.
TARGET_LABELS: Final = frozenset({"job", "instance"})

# Refusal codes (the values of gpurelay_gateway_rejected_series_total{reason}).
RESERVED_NAME = "reserved_name"
RESERVED_LABEL = "reserved_label"
TYPE_CONFLICT = "type_conflict"
FAMILY_CLASH = "family_clash"
DUPLICATE_ID = "duplicate_id"
SAME_SERIES = "same_series"
TOO_MANY_SERIES = "too_many_series"
LABEL_BYTES = "label_bytes"
REFUSAL_CODES: Final = (
    RESERVED_NAME,
    RESERVED_LABEL,
    TYPE_CONFLICT,
    FAMILY_CLASH,
    DUPLICATE_ID,
    SAME_SERIES,
    TOO_MANY_SERIES,
    LABEL_BYTES,
)


@dataclass(frozen=True, slots=True)
class Refusal:
    code: str  # one of REFUSAL_CODES
    message: str


def identity(name: str, labels: Labels) -> bytes:
    """What makes two series the same series: the name and the *set* of labels (their
    order on the wire means nothing to Prometheus, so it means nothing here), as a 16-byte
    digest of an unambiguous (length-prefixed) text of both: a key of 49 bytes rather
    than a tuple of the sorted labels per held series."""
    text = "".join(f"{len(k)}:{k}{len(v)}:{v}" for k, v in sorted(labels))
    key = f"{len(name)}:{name}{text}".encode(errors="surrogatepass")
    return blake2b(key, digest_size=16).digest()


def label_bytes(name: str, labels: Labels) -> int:
    """What a series costs against a node's label budget: its name and label text."""
    return len(name) + sum(map(len, chain.from_iterable(labels)))


def refuse_name(name: str, reserved_prefixes: tuple[str, ...]) -> Refusal | None:
    if name.startswith(reserved_prefixes):
        return Refusal(RESERVED_NAME, f"metric name {name!r} is reserved for the gateway")
    if name in PROMETHEUS_NAMES:
        return Refusal(RESERVED_NAME, f"metric name {name!r} is written by Prometheus itself")
    return None


def refuse_labels(name: str, labels: Labels) -> Refusal | None:
    for label, _ in labels:
        if label in TARGET_LABELS:
            return Refusal(
                RESERVED_LABEL,
                f"series {name!r}: label {label!r} is reserved for the Prometheus target",
            )
    return None


def clashing_family(
    name: str, is_counter: bool, type_of: Callable[[str], str | None]
) -> str | None:
    """The existing family that ``name`` would collide with in OpenMetrics, where a counter
    ``X_total`` is the family ``X`` (``type_of``: an existing family's type, or None)."""
    if is_counter and name.endswith("_total") and type_of(name[: -len("_total")]) is not None:
        return name[: -len("_total")]
    if type_of(name + "_total") == "counter":
        return name + "_total"
    return None


def refuse_room(
    *,
    name: str,
    counter: bool,
    series: int,
    max_series: int,
    used_bytes: int,
    budget: int,
    new_family: bool,
    family_type: Callable[[str], str | None],
    cost: int,
) -> Refusal | None:
    """Why a node may not add one more series record: its series count, its label-byte
    budget, or (for a family new to the fleet) a name that clashes in OpenMetrics.
    ``cost``: the series' :func:`label_bytes`."""
    if series >= max_series:
        return Refusal(TOO_MANY_SERIES, f"node has {series} series, the limit")
    if used_bytes + cost > budget:
        return Refusal(
            LABEL_BYTES,
            f"series {name!r} ({cost} bytes of name and labels) would take the node "
            f"past its label budget of {budget} bytes ({used_bytes} used)",
        )
    if new_family:
        clash = clashing_family(name, counter, family_type)
        if clash is not None:
            return Refusal(
                FAMILY_CLASH, f"family {name!r} would collide with family {clash!r} in OpenMetrics"
            )
    return None
