"""The fleet's family catalogue (gpurelay/data/families.csv) and what the agent publishes
(issue 24, W09): the gateway serves the catalogue's TYPE and HELP for these names and
refuses another TYPE, so every family the agent can publish must be in it, with the TYPE
the agent declares, or the agent's own series would be refused by its gateway."""

from __future__ import annotations

import dataclasses
import importlib
import logging
import pkgutil
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

import edge_agent
from edge_agent.backend import Backend
from edge_agent.catalog import load_counters, parse_counters
from edge_agent.config import load
from edge_agent.fields import LABEL_SOURCES, SOURCES
from edge_agent.pipeline import build_pipeline
from edge_agent.sim.nvml import SimulatedNvml
from edge_agent.sim.profiles import PROFILES
from gpurelay.families import CatalogueError, catalogue, known, parse_catalogue
from gpurelay.model import Family


def _families_in(obj: object, depth: int = 0) -> Iterator[Family]:
    if isinstance(obj, Family):
        yield obj
    elif depth < 3 and isinstance(obj, (tuple, list, set, frozenset)):
        for item in obj:
            yield from _families_in(item, depth + 1)
    elif depth < 3 and isinstance(obj, dict):
        for item in obj.values():
            yield from _families_in(item, depth + 1)


def test_every_family_the_agent_defines_is_catalogued_with_its_type() -> None:
    """The agent's own families (DCGM_CUSTOM_*, gpurelay_*), wherever they are defined."""
    seen: dict[str, Family] = {}
    for module in pkgutil.walk_packages(edge_agent.__path__, "edge_agent."):
        if module.name.endswith("__main__"):
            continue
        for value in vars(importlib.import_module(module.name)).values():
            for family in _families_in(value):
                seen.setdefault(family.name, family)
    assert len(seen) > 40  # the scan found them
    wrong = {
        name: (f.type, getattr(known(name), "type", "missing"))
        for name, f in seen.items()
        if known(name) is None or known(name) != f
    }
    assert wrong == {}, "add or fix these lines of gpurelay/data/families.csv"


def test_every_field_the_agent_can_read_is_catalogued_with_the_default_type() -> None:
    defaults = {s.field: s.kind for s in load_counters(None)}
    for name in SOURCES:
        if name in LABEL_SOURCES:
            continue
        family = known(name)
        assert family is not None, f"{name} is missing from gpurelay/data/families.csv"
        assert defaults.get(name, family.type) == family.type, name


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_a_full_collection_publishes_only_catalogued_families(profile: str, tmp_path: Path) -> None:
    """Every field the agent can read, on every simulated machine, collected twice (rates
    need two readings): each family published is the catalogue's TYPE."""
    counters = tmp_path / "all.csv"
    counters.write_text(
        "".join(
            f"{name}, {'label' if name in LABEL_SOURCES else known(name).type}, h\n"  # type: ignore[union-attr]
            for name in SOURCES
        )
    )
    base = load(None, {})
    cfg = dataclasses.replace(base, counters_file=counters)
    sim = SimulatedNvml(profile=profile)
    sim.nvmlInit()
    pipeline = build_pipeline(Backend(sim, "simulated", cfg))
    try:
        pipeline.collection.collect()
        snapshot = pipeline.collection.collect()
    finally:
        pipeline.close()
    published = {f.name: f.type for f in snapshot.families}
    assert published
    wrong = {n: t for n, t in published.items() if getattr(known(n), "type", None) != t}
    assert wrong == {}


def test_a_counters_file_with_another_type_publishes_the_catalogues(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A user's dcgm-exporter CSV (older ones call DCGM_FI_PROF_PCIE_RX_BYTES a counter):
    the agent declares the catalogue's TYPE, so the gateway keeps its data, and says so."""
    path = tmp_path / "old.csv"
    path.write_text(
        "DCGM_FI_PROF_PCIE_RX_BYTES, counter, bytes\nDCGM_FI_DEV_GPU_UTIL, gauge, util\n"
    )
    caplog.set_level(logging.WARNING, logger="edge_agent.catalog")
    specs = {s.field: s.kind for s in load_counters(path)}
    assert specs == {"DCGM_FI_PROF_PCIE_RX_BYTES": "gauge", "DCGM_FI_DEV_GPU_UTIL": "gauge"}
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}: DCGM_FI_PROF_PCIE_RX_BYTES is a gauge in the fleet's catalogue "
        "(dcgm-exporter's type; the gateway refuses it as a counter): published as a gauge"
    ]
    assert parse_counters(path.read_text())[0].kind == "counter"  # parsing stays as written


def test_the_catalogue_parses_and_refuses_what_is_not_a_catalogue() -> None:
    assert len(catalogue()) > 90
    assert all(f.help for f in catalogue().values())
    with pytest.raises(CatalogueError, match=re.escape("expected 'NAME, gauge|counter, HELP'")):
        parse_catalogue("m, histogram, h\n")
    with pytest.raises(CatalogueError, match="listed twice"):
        parse_catalogue("m, gauge, h\nm, gauge, h\n")
