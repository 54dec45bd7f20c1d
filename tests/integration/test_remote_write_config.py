"""What the docs and deploy files say about the spool and remote write, against the code
and a real Prometheus receiver.

- The ``[spool]`` and ``[remote_write]`` sections written in README.md,
  docs/operator-guide.md, deploy/prometheus/README.md, the installer and the Kubernetes
  ConfigMaps use the real key names and defaults (``edge_agent.config.SpoolConfig``,
  ``cloud_gateway.remote_write.config.RemoteWriteConfig``; deprecated keys are not written down)
  and load with the real config loaders; no doc or deploy file sets a deprecated key.
- deploy/prometheus/remote-write-receiver.yml, run by a real ``prometheus`` binary with
  ``--web.enable-remote-write-receiver``, stores a sample as old as the oldest one a
  default spool can hold, with its exact timestamp, and refuses one older than its
  out-of-order window with the status the docs name for that Prometheus version.
- The alerting rules in docs/operator-guide.md pass ``promtool check rules``.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import tomllib
import yaml

from cloud_gateway import config as gateway_config
from cloud_gateway.metrics import catalogue
from cloud_gateway.remote_write.config import (
    PROTOCOL_HEADERS,
    RemoteWriteConfig,
    check_remote_write,
)
from cloud_gateway.remote_write.prompb import Series, encode_write_request, snappy_compress
from edge_agent import outbox, tunnel
from edge_agent.config import SpoolConfig
from gpurelay.model import Family
from harness.prometheus import running_receiver

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
GUIDE = ROOT / "docs" / "operator-guide.md"
PROMETHEUS_README = ROOT / "deploy" / "prometheus" / "README.md"
RECEIVER = ROOT / "deploy" / "prometheus" / "remote-write-receiver.yml"
UNIFIED = ROOT / "deploy" / "prometheus" / "unified.yml"
INSTALLER = ROOT / "deploy" / "install-edge-agent.sh"
GATEWAY_MANIFEST = ROOT / "deploy" / "kubernetes" / "cloud-gateway.yaml"

# Prometheus answers "too old sample" with 400 from this version on, with 500 before
# (prometheus/prometheus#13335); deploy/prometheus/README.md says so.
TOO_OLD_IS_400_SINCE = (2, 49)


# --- helpers -------------------------------------------------------------------------------


def fenced_blocks(path: Path, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", path.read_text(), re.MULTILINE | re.DOTALL)


def toml_table(path: Path, table: str) -> dict[str, Any]:
    """The ``[table]`` of the one ```toml block of ``path`` that has it."""
    found = [b for b in fenced_blocks(path, "toml") if re.search(rf"^\[{table}\]", b, re.M)]
    assert len(found) == 1, f"{path.name}: expected one toml block with [{table}]"
    parsed: dict[str, Any] = tomllib.loads(found[0])[table]
    return parsed


def commented_table(text: str, table: str) -> dict[str, Any]:
    """A ``#[table]`` section written as comments (``#key = value``, no space after the
    ``#``; ``# prose`` lines end it), uncommented and parsed."""
    lines = text.splitlines()
    (start,) = [i for i, line in enumerate(lines) if line.strip() == f"#[{table}]"]
    body = []
    for line in lines[start:]:
        stripped = line.strip()
        if not stripped.startswith("#") or stripped.startswith("# "):
            break
        body.append(stripped[1:])
    parsed: dict[str, Any] = tomllib.loads("\n".join(body))[table]
    return parsed


def as_config_value(value: Any, default: Any = "") -> Any:
    """A TOML value as the config loaders store it: "" for an optional setting (default
    None) is unset, lists are tuples."""
    if value == "" and default is None:
        return None
    if isinstance(value, list):
        return tuple(value)
    return value


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return repr(value)


def duration_seconds(text: str) -> float:
    """A Prometheus duration such as 25h, 1d12h or 90m."""
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
    parts = re.findall(r"(\d+)(ms|s|m|h|d|w|y)", text)
    assert "".join(n + u for n, u in parts) == text, f"not a duration: {text!r}"
    return sum(int(n) * units[u] for n, u in parts)


def receiver_config() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(RECEIVER.read_text())
    return loaded


def out_of_order_window() -> str:
    window: str = receiver_config()["storage"]["tsdb"]["out_of_order_time_window"]
    return window


# --- the agent's [spool], wherever it is written down --------------------------------------


def test_spool_sections_in_the_docs_are_the_defaults() -> None:
    defaults = SpoolConfig()
    fields = {f.name for f in dataclasses.fields(SpoolConfig)}
    for path in (README, GUIDE):
        table = toml_table(path, "spool")
        assert set(table) == fields, path.name
        for key, value in table.items():
            want = getattr(defaults, key)
            assert (Path(value) if isinstance(want, Path) else value) == want, (path.name, key)


def test_installer_spool_comment_is_the_defaults() -> None:
    text = INSTALLER.read_text()
    (state_dir,) = re.findall(r"^STATE_DIR=(\S+)$", text, re.MULTILINE)
    table = commented_table(text.replace("$STATE_DIR", state_dir), "spool")
    defaults = SpoolConfig()
    assert set(table) == {f.name for f in dataclasses.fields(SpoolConfig)}
    assert Path(table.pop("directory")) == defaults.directory
    for key, value in table.items():
        assert value == getattr(defaults, key), key


def test_spool_age_bound_fits_in_the_receivers_window() -> None:
    """Nothing a default spool still holds may be too old for the shipped receiver, with a
    margin for an edge clock that runs behind."""
    window = duration_seconds(out_of_order_window())
    assert window > SpoolConfig().max_age_seconds
    # The README and the receivers' README quote the shipped window.
    assert f"`{out_of_order_window()}`" in README.read_text()
    assert f"`{out_of_order_window()}`" in PROMETHEUS_README.read_text()


# --- the gateway's [remote_write] ----------------------------------------------------------


def test_operator_guide_lists_every_remote_write_key_with_its_default() -> None:
    table = toml_table(GUIDE, "remote_write")
    fields = dataclasses.fields(RemoteWriteConfig)
    assert set(table) == {f.name for f in fields if "deprecated" not in f.metadata}
    assert table["url"] == "", "off unless a url is set"
    defaults = RemoteWriteConfig()
    for key, value in table.items():
        want = getattr(defaults, key)
        assert as_config_value(value, want) == want, key


def remote_write_examples() -> dict[str, str]:
    """Every gateway.toml example with a [remote_write] section, as loadable TOML."""
    manifest = yaml.safe_load_all(GATEWAY_MANIFEST.read_text())
    (config_map,) = [d for d in manifest if d and d["metadata"]["name"] == "cloud-gateway-config"]
    in_cluster = config_map["data"]["gateway.toml"]
    uncommented = commented_table(in_cluster, "remote_write")
    examples = {
        "cloud-gateway.yaml": in_cluster
        + "\n[remote_write]\n"
        + "".join(f"{k} = {toml_value(v)}\n" for k, v in uncommented.items())
    }
    for path in (README, PROMETHEUS_README, GUIDE):
        (block,) = [b for b in fenced_blocks(path, "toml") if "[remote_write]" in b]
        examples[str(path.relative_to(ROOT))] = block
    return examples


@pytest.mark.parametrize(
    "where",
    ["cloud-gateway.yaml", "README.md", "deploy/prometheus/README.md", "docs/operator-guide.md"],
)
def test_remote_write_examples_load_with_the_gateway_config(where: str, tmp_path: Path) -> None:
    examples = remote_write_examples()
    assert set(examples) == {
        "cloud-gateway.yaml",
        "README.md",
        "deploy/prometheus/README.md",
        "docs/operator-guide.md",
    }
    text = examples[where]
    path = tmp_path / "gateway.toml"
    path.write_text(text)
    cfg = gateway_config.load(path, {})
    written = tomllib.loads(text)["remote_write"]
    assert cfg.remote_write.url == written["url"]
    assert cfg.remote_write.deprecated() == [], "examples set no deprecated key"
    client = check_remote_write(cfg.remote_write)
    assert (client is None) == (written["url"] == "")


def defined_metric_names() -> set[str]:
    """Every metric family the agent's tunnel and outbox (spool) and the gateway define."""
    names: set[str] = set()
    names.update(catalogue())  # the gateway's own, cloud_gateway/data/gateway_families.csv
    for module in (tunnel, outbox):
        for value in vars(module).values():
            for item in value if isinstance(value, tuple) else (value,):
                if isinstance(item, Family):
                    names.add(item.name)
    return names


def test_documented_spool_and_remote_write_metrics_exist() -> None:
    pattern = re.compile(
        r"gpurelay_(?:agent_spool|agent_replayed|gateway_remote_write|gateway_replayed)_[a-z_]+"
    )
    defined = defined_metric_names()
    for path in (README, GUIDE, PROMETHEUS_README):
        for name in set(pattern.findall(path.read_text())):
            if name.endswith("_"):  # a prefix such as gpurelay_gateway_remote_write_*
                assert any(d.startswith(name) for d in defined), (path.name, name)
            else:
                assert name in defined, f"{path.name} names {name}, which nothing exports"


# --- the shipped receiver config -----------------------------------------------------------


def test_receiver_scrapes_only_the_gateways_own_metrics() -> None:
    (job,) = receiver_config()["scrape_configs"]
    (unified,) = yaml.safe_load(UNIFIED.read_text())["scrape_configs"]
    assert job["job_name"] == unified["job_name"], "alerts on gpurelay_node_up keep their job"
    assert job["honor_labels"] is True
    keep, *rest = job["metric_relabel_configs"]
    assert keep == {
        "source_labels": ["__name__"],
        "regex": "gpurelay_gateway_.*|gpurelay_node_.*",
        "action": "keep",
    }
    assert rest == unified["metric_relabel_configs"], "instance as in unified.yml"
    assert "--web.enable-remote-write-receiver" in RECEIVER.read_text()


def prometheus_version(binary: Path) -> tuple[int, int]:
    out = subprocess.run(
        [str(binary), "--version"], capture_output=True, text=True, timeout=30, check=True
    )
    match = re.search(r"version (\d+)\.(\d+)", out.stdout + out.stderr)
    assert match, out.stdout + out.stderr
    return int(match[1]), int(match[2])


@pytest.fixture
def receiver(prometheus_bin: Path, tmp_path: Path) -> Iterator[str]:
    """The shipped remote-write-receiver.yml, verbatim, in a real Prometheus."""
    with running_receiver(prometheus_bin, tmp_path, RECEIVER) as running:
        yield running.url


def write(base: str, series: list[Series]) -> httpx.Response:
    return httpx.post(
        f"{base}/api/v1/write",
        content=snappy_compress(encode_write_request(series)),
        headers=PROTOCOL_HEADERS,
        timeout=10,
    )


def test_receiver_takes_the_oldest_spooled_sample_and_refuses_older(
    receiver: str, prometheus_bin: Path
) -> None:
    now_ms = int(time.time() * 1000)
    max_age_ms = int(SpoolConfig().max_age_seconds * 1000)
    window_ms = int(duration_seconds(out_of_order_window()) * 1000)

    def series(gpu: str, t_ms: int, value: float) -> Series:
        labels = (("__name__", "DCGM_FI_DEV_GPU_UTIL"), ("Hostname", "edge-1"), ("gpu", gpu))
        return (labels, [(t_ms, value)])

    # Live data first, as after a reconnect ...
    assert write(receiver, [series("0", now_ms, 10.0)]).is_success
    # ... then the backlog: the oldest batch a default spool still holds.
    oldest_ms = now_ms - max_age_ms + 60_000
    response = write(receiver, [series("0", oldest_ms, 20.0), series("1", oldest_ms, 30.0)])
    assert response.is_success, response.text
    query = httpx.get(
        f"{receiver}/api/v1/query",
        params={"query": "DCGM_FI_DEV_GPU_UTIL[2m]", "time": f"{(oldest_ms + 60_000) / 1000}"},
        timeout=10,
    ).json()
    stored = {
        r["metric"]["gpu"]: [(round(float(t) * 1000), float(v)) for t, v in r["values"]]
        for r in query["data"]["result"]
    }
    assert stored == {"0": [(oldest_ms, 20.0)], "1": [(oldest_ms, 30.0)]}

    # Older than the window: refused. 400 (dropped by the gateway) on a current
    # Prometheus, 500 (retried) before 2.49.
    too_old = write(receiver, [series("0", now_ms - window_ms - 3_600_000, 40.0)])
    assert "too old sample" in too_old.text
    want = 400 if prometheus_version(prometheus_bin) >= TOO_OLD_IS_400_SINCE else 500
    assert too_old.status_code == want, too_old.text


# --- alerting rules ------------------------------------------------------------------------


def test_operator_guide_alerts_pass_promtool(promtool: Path, tmp_path: Path) -> None:
    rule_files = []
    for i, block in enumerate(fenced_blocks(GUIDE, "yaml")):
        if "alert:" in block:
            path = tmp_path / f"rules-{i}.yml"
            path.write_text(block)
            rule_files.append(str(path))
    assert len(rule_files) >= 2, "the spool and remote write alerts"
    proc = subprocess.run(
        [str(promtool), "check", "rules", *rule_files],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
