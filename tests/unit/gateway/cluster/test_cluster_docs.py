"""docs/operator-guide.md, "Running several gateways": the [cluster] table is the code's.

Every key of :class:`cloud_gateway.cluster.config.ClusterConfig` is in the table with its
real default, and nothing else is; the example loads with the real config loader; the
peer listener port the guide and the examples use clashes with no documented listener.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import tomllib

from cloud_gateway import config as gateway_config
from cloud_gateway.cluster.config import ClusterConfig
from gpurelay.settings import split_host_port

ROOT = Path(__file__).resolve().parents[4]
GUIDE = ROOT / "docs" / "operator-guide.md"
SECTION = "## Running several gateways\n"
# Defaults that are not a literal value: what the table says instead.
DERIVED = {"gateway_id": "the hostname", "advertise": "`peer_listen`"}
ROW = re.compile(r"^\| `(\w+)` \| ([^|]+) \|", re.MULTILINE)


def section() -> str:
    text = GUIDE.read_text(encoding="utf-8")
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    return text[start : end if end >= 0 else None]


def table() -> dict[str, str]:
    return {key: default.strip() for key, default in ROW.findall(section())}


def test_every_cluster_key_is_documented_with_its_default() -> None:
    documented = table()
    fields = {f.name: f for f in dataclasses.fields(ClusterConfig)}
    assert set(documented) == set(fields)
    defaults = ClusterConfig()
    for key, shown in documented.items():
        if key in DERIVED:
            assert shown == DERIVED[key], key
            assert getattr(defaults, key) == "", f"{key}: empty means derived"
            continue
        value = getattr(defaults, key)
        literal = shown.strip("`")
        if isinstance(value, str):
            assert literal == '""' and value == "", key
        else:
            assert float(literal) == value, key


def test_the_example_loads_as_a_cluster(tmp_path: Path) -> None:
    (block,) = [b for b in re.findall(r"```toml\n(.*?)```", section(), re.DOTALL)]
    written = tomllib.loads(block)["cluster"]
    token = tmp_path / "peer.token"
    token.write_text("t" * 32)
    env = {
        "CLOUD_GATEWAY_CLUSTER_DATABASE": "postgresql://gpurelay@db.internal:5432/gpurelay",
        "CLOUD_GATEWAY_CLUSTER_PEER_TOKEN_FILE": str(token),
    }
    config = tmp_path / "gateway.toml"
    config.write_text(block)
    cluster = gateway_config.load(config, env).cluster
    assert cluster.clustered
    assert cluster.gateway_id == written["gateway_id"]
    assert split_host_port(cluster.advertise)[1] == split_host_port(cluster.peer_listen)[1]


@pytest.mark.parametrize("listen", ["ssh", "http"])
def test_the_peer_port_is_not_another_listeners(listen: str, tmp_path: Path) -> None:
    (block,) = re.findall(r"```toml\n(.*?)```", section(), re.DOTALL)
    peer = split_host_port(tomllib.loads(block)["cluster"]["peer_listen"])[1]
    cfg = gateway_config.GatewayConfig()
    assert split_host_port(getattr(cfg, listen).listen)[1] != peer
    assert peer not in (9400, 30060), "the agent's exporter and the BIE port"
