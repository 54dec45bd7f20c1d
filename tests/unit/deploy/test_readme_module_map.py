"""The README's module map is the gateway's tree: every sub-package in stage order, every
module of each named under its stage, every top-level module named (issue 25)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.test_layering import GATEWAY_STAGES

ROOT = Path(__file__).resolve().parents[3]
GATEWAY = ROOT / "cloud_gateway"


def gateway_map() -> str:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    start = readme.index("\ncloud_gateway/ ")
    return readme[start : readme.index("\nharness/", start)]


def sections(text: str) -> dict[str, str]:
    """Each ``  name/`` line of the map with the lines that continue it."""
    out: dict[str, str] = {}
    current = ""
    for line in text.splitlines():
        m = re.match(r"  ([a-z_]+)/\s", line)
        if m:
            current = m.group(1)
            out[current] = ""
        elif not line.startswith("                 "):
            current = ""
        if current:
            out[current] += line + "\n"
    return out


def stages() -> list[str]:
    return sorted(p.parent.name for p in GATEWAY.glob("*/__init__.py") if p.parent.name != "data")


def test_every_stage_is_in_the_map_in_stage_order() -> None:
    listed = list(sections(gateway_map()))
    assert sorted(listed) == stages()
    order = [name for names in GATEWAY_STAGES for name in names if name in listed]
    assert listed == order, "the map lists the stages lowest first, as GATEWAY_STAGES"


def test_every_module_is_named_under_its_stage() -> None:
    found = sections(gateway_map())
    missing = [
        f"{stage}/{path.relative_to(GATEWAY / stage).with_suffix('').as_posix()}"
        for stage in stages()
        for path in sorted((GATEWAY / stage).rglob("*.py"))
        if path.stem != "__init__" and not re.search(rf"\b{path.stem}\b", found[stage])
    ]
    assert not missing, f"in the tree, not in the README's module map: {missing}"


def test_every_top_level_module_is_named() -> None:
    text = gateway_map()
    missing = [
        p.name
        for p in sorted(GATEWAY.glob("*.py"))
        if p.stem not in ("__init__", "__main__") and not re.search(rf"\b{p.stem}\b", text)
    ]
    assert not missing, f"in the tree, not in the README's module map: {missing}"
