"""deploy/prometheus/alerts.yml: valid for Prometheus (``promtool check rules``), every
alert unit-tested (``promtool test rules`` on deploy/prometheus/tests/alerts_test.yml), on
metric names the product really exports, and written for the person who gets paged: a
severity, a summary and description naming the node (or the gateway), a runbook hint,
and a line in the operator guide."""

from __future__ import annotations

import re
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from cloud_gateway.exposition import body as exposition
from cloud_gateway.metrics import catalogue
from cloud_gateway.trust import cert_expiry
from edge_agent import outbox
from gpurelay import naming
from gpurelay.model import Family

ROOT = Path(__file__).resolve().parents[3]
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
ALERT_TESTS = ROOT / "deploy" / "prometheus" / "tests" / "alerts_test.yml"
GUIDE = ROOT / "docs" / "operator-guide.md"
SEVERITIES = {"critical", "warning"}
# Series the gateway publishes about the gateway itself have no node; they name its instance.
GATEWAY_LEVEL = re.compile(r"^gpurelay_gateway_")
METRIC = re.compile(r"\b(gpurelay_[a-z_]+|DCGM_(?:FI|EXP)_[A-Z0-9_]+)\b")


@cache
def rules() -> tuple[dict[str, Any], ...]:
    with ALERTS.open(encoding="utf-8") as f:
        groups = yaml.safe_load(f)["groups"]
    return tuple(rule for group in groups for rule in group["rules"])


def alert_names() -> list[str]:
    return [r["alert"] for r in rules()]


def run(promtool: Path, *args: str | Path) -> str:
    done = subprocess.run(
        [str(promtool), *map(str, args)], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_promtool_check_rules(promtool: Path) -> None:
    out = run(promtool, "check", "rules", ALERTS)
    assert f"SUCCESS: {len(rules())} rules found" in out


def test_promtool_test_rules(promtool: Path) -> None:
    """Run from the tests' own directory: their rule_files path is relative to it."""
    done = subprocess.run(
        [str(promtool), "test", "rules", ALERT_TESTS.name],
        cwd=ALERT_TESTS.parent,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "SUCCESS" in out, out


def test_every_alert_has_a_firing_test_case() -> None:
    with ALERT_TESTS.open(encoding="utf-8") as f:
        cases = yaml.safe_load(f)["tests"]
    fired = {
        check["alertname"]
        for case in cases
        for check in case["alert_rule_test"]
        if check.get("exp_alerts")
    }
    assert set(alert_names()) <= fired, sorted(set(alert_names()) - fired)
    for case in cases:
        for check in case["alert_rule_test"]:
            assert check["alertname"] in alert_names(), check["alertname"]


@pytest.mark.parametrize("name", alert_names())
def test_alert_is_written_for_whoever_is_paged(name: str) -> None:
    (rule,) = [r for r in rules() if r["alert"] == name]
    assert rule["labels"]["severity"] in SEVERITIES
    summary, description = rule["annotations"]["summary"], rule["annotations"]["description"]
    gateway_level = all(GATEWAY_LEVEL.match(m) for m in METRIC.findall(rule["expr"]))
    who = "{{ $labels.instance }}" if gateway_level else "{{ $labels.Hostname }}"
    assert who in summary and who in description, (name, who)
    assert "Runbook:" in description
    assert name.startswith("EdgeGpu")


def exported_names() -> set[str]:
    """The families the gateway and the agent define (their Family objects), and the DCGM
    fields of the agent's built-in counters under either naming scheme."""
    names: set[str] = set()
    names.update(catalogue())  # the gateway's own, cloud_gateway/data/gateway_families.csv
    for module in (exposition, cert_expiry, outbox):
        for value in vars(module).values():
            for item in value if isinstance(value, tuple) else (value,):
                if isinstance(item, Family):
                    names.add(item.name)
    for name in ("default-counters.csv", "default-counters-4.9.csv"):
        csv = ROOT / "edge_agent" / "data" / name
        for line in csv.read_text(encoding="utf-8").splitlines():
            if line.startswith("DCGM_"):
                names.add(line.split(",")[0].strip())
    return names


def test_alerts_use_only_metric_names_the_product_exports() -> None:
    used = {m for rule in rules() for m in METRIC.findall(rule["expr"])}
    assert used, "no metric names found in the expressions"
    missing = sorted(used - exported_names())
    assert not missing, f"not exported by the gateway or the agent: {missing}"


def test_gpu_alerts_fire_under_either_naming_scheme() -> None:
    """A rule on a field dcgm-exporter 4.9 renamed names it under both schemes (the promtool
    tests in deploy/prometheus/tests/alerts_test.yml fire each under each)."""
    for rule in rules():
        used = set(METRIC.findall(rule["expr"]))
        for name in used:
            other = naming.name_in(name, "4.9" if naming.scheme_of(name) == "4.8" else "4.8")
            assert other in used, (rule["alert"], name, other)


def test_the_operator_guide_lists_every_alert() -> None:
    guide = GUIDE.read_text(encoding="utf-8")
    missing = [name for name in alert_names() if f"`{name}`" not in guide]
    assert not missing, f"docs/operator-guide.md, Alerts: {missing}"
