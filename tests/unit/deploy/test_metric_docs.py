"""Every series the code names is in the docs (README.md or docs/*.md).

The names are the string literals ``"gpurelay_..."`` in the three packages; the docs' names
are read from their code spans, where ``gpurelay_gateway_{a,b{label},c}`` stands for
``gpurelay_gateway_a``, ``_b`` and ``_c`` (a brace right after ``_`` lists names; one after
a name lists its labels)."""

from __future__ import annotations

import re
from pathlib import Path

from cloud_gateway.metrics import catalogue

ROOT = Path(__file__).resolve().parents[3]
# gpurelay_ literals in the code that are no series
NOT_SERIES = {
    "gpurelay_claims": "the PostgreSQL NOTIFY channel of the node directory",
    "gpurelay_gateways": "a PostgreSQL table (documented anyway)",
    "gpurelay_nodes": "a PostgreSQL table",
    "gpurelay_enrollment_nonces": "a PostgreSQL table",
}


def named_in_code() -> set[str]:
    names: set[str] = set()
    for package in ("cloud_gateway", "edge_agent", "gpurelay"):
        for path in (ROOT / package).rglob("*.py"):
            names.update(re.findall(r'"(gpurelay_[a-z0-9_]*[a-z0-9])"', path.read_text()))
    names.update(catalogue())  # the gateway's own, whoever reports them
    return names - set(NOT_SERIES)


def expand(span: str) -> list[str]:
    at = span.find("{")
    if at < 0 or span[at - 1] != "_":
        return [span[:at] if at >= 0 else span]
    parts, depth, current = [], 0, ""
    for char in span[at + 1 :]:
        if char == "}" and depth == 0:
            break
        depth += {"{": 1, "}": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return [name for part in parts for name in expand(span[:at] + part)]


def named_in_docs() -> set[str]:
    names: set[str] = set()
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for span in re.findall(r"`(gpurelay_[^`]*)`", path.read_text(encoding="utf-8")):
            for name in expand(re.sub(r"\s+", "", span)):
                names.add(re.match(r"gpurelay_[a-z0-9_]*", name).group(0))  # type: ignore[union-attr]
    return names


def test_the_brace_lists_expand_as_the_docs_mean_them() -> None:
    assert expand("gpurelay_x_{a,b{reason},c_total{d,e}}") == [
        "gpurelay_x_a",
        "gpurelay_x_b",
        "gpurelay_x_c_total",
    ]
    assert expand("gpurelay_node_up{Hostname}") == ["gpurelay_node_up"]


def test_every_series_in_the_code_is_documented() -> None:
    missing = sorted(named_in_code() - named_in_docs())
    assert not missing, f"in no doc (README.md's metric lists, docs/metrics.md): {missing}"
