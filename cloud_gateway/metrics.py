"""The gateway's own metrics (``gpurelay_gateway_*``): the catalogue, and the helpers each
stage builds its samples with.

The names, types and HELP texts are data (``cloud_gateway/data/gateway_families.csv``),
read once; each stage reports its own families from its own counters, as
node_exporter's collectors and client_python's custom collectors do (the SSH server's in
:meth:`~cloud_gateway.ssh.server.SshServer.families`, ingest's in
:meth:`~cloud_gateway.ingest.session.IngestStats.families`, and so on), and ``app.py``
lists the stages once. Every label value comes from a fixed set, never from what a
client or node sent (DESIGN.md, "Trust boundaries"): route templates, reason and error
codes, HTTP statuses. A value outside its set is counted as ``other``; the free text
stays in logs and in the node's recent errors.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from functools import cache
from importlib import resources
from typing import Final

from gpurelay.families import parse_catalogue
from gpurelay.model import Family, Sample

CATALOGUE_FILE: Final = "gateway_families.csv"
OTHER: Final = "other"

FamilySamples = tuple[Family, Sequence[Sample]]  # a family and its samples, for /metrics


@cache
def catalogue() -> Mapping[str, Family]:
    """Every ``gpurelay_gateway_*`` family, by name (read once)."""
    text = resources.files("cloud_gateway.data").joinpath(CATALOGUE_FILE).read_text("utf-8")
    return parse_catalogue(text, CATALOGUE_FILE)


def family(name: str) -> Family:
    """The catalogue's family (KeyError for a name it does not list: a bug, not input)."""
    return catalogue()[name]


def one(name: str, value: float, labels: tuple[tuple[str, str], ...] = ()) -> FamilySamples:
    fam = family(name)
    return fam, [Sample(fam.name, labels, float(value))]


def by(name: str, label: str, counts: Mapping[str, int]) -> FamilySamples:
    fam = family(name)
    return fam, [Sample(fam.name, ((label, k),), float(v)) for k, v in sorted(counts.items())]


def fixed(
    name: str,
    label: str,
    counts: Mapping[str, int],
    values: Collection[str],
    *,
    zeros: bool = False,
) -> FamilySamples:
    """Like :func:`by`, with every key outside ``values`` counted as ``other``;
    ``zeros``: every value of the set is there from the start."""
    folded: dict[str, int] = dict.fromkeys(values, 0) if zeros else {}
    for key, count in counts.items():
        value = key if key in values else OTHER
        folded[value] = folded.get(value, 0) + count
    return by(name, label, folded)
