"""``[cluster]``: defaults for one gateway, what several need, one-line errors."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from cloud_gateway.config import load
from cloud_gateway.errors import GatewayConfigError


def test_one_gateway_by_default_with_its_inventory_under_systemds_state_directory() -> None:
    cfg = load(environ={})
    assert not cfg.cluster.clustered
    assert cfg.cluster.resolved_gateway_id() == socket.gethostname()
    assert cfg.cluster.sqlite_path({}) is None  # ad hoc: kept in memory, as before
    state = {"STATE_DIRECTORY": "/var/lib/cloud-gateway:/var/lib/other"}
    assert cfg.cluster.sqlite_path(state) == Path("/var/lib/cloud-gateway/nodes.db")
    cfg = load(environ={"CLOUD_GATEWAY_CLUSTER_DIRECTORY": "/srv/gw/nodes.db"})
    assert cfg.cluster.sqlite_path(state) == Path("/srv/gw/nodes.db")


def test_several_gateways_from_toml_and_the_dsn_from_the_environment(tmp_path: Path) -> None:
    token = tmp_path / "peer.token"
    token.write_text("0123456789abcdef0123\n")
    path = tmp_path / "gw.toml"
    path.write_text(
        "[cluster]\n"
        'gateway_id = "gw-a"\n'
        'peer_listen = "0.0.0.0:9411"\n'
        'advertise = "10.0.0.5:9411"\n'
        f'peer_token_file = "{token}"\n'
        "heartbeat_seconds = 1\n"
        "ttl_seconds = 5\n"
    )
    dsn = "postgresql://gw:secret@db.example:5432/relay"
    cfg = load(path, environ={"CLOUD_GATEWAY_CLUSTER_DATABASE": dsn})
    c = cfg.cluster
    assert c.clustered and c.database == dsn
    assert (c.resolved_gateway_id(), c.advertise, c.ttl_seconds) == ("gw-a", "10.0.0.5:9411", 5)
    assert c.peer_token() == "0123456789abcdef0123"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"CLUSTER_HEARTBEAT_SECONDS": "0"}, "cluster.heartbeat_seconds must be > 0"),
        ({"CLUSTER_TTL_SECONDS": "3"}, r"ttl_seconds must be at least twice .* \(3 < 2 x 2\)"),
        (
            {"CLUSTER_FORGET_GATEWAYS_AFTER_SECONDS": "10"},
            r"forget_gateways_after_seconds must be more than cluster.ttl_seconds \(10 <= 10\)",
        ),
        ({"CLUSTER_GATEWAY_ID": "gw a"}, "cluster.gateway_id must be"),
        ({"CLUSTER_PEER_LISTEN": "nowhere"}, "cluster.peer_listen 'nowhere' must look like"),
        ({"CLUSTER_DATABASE": "mysql://x"}, "cluster.database must be a PostgreSQL URL"),
        ({"CLUSTER_DATABASE": "postgresql://h/db"}, "cluster.peer_listen is required"),
        (
            {"CLUSTER_DATABASE": "postgresql://h/db", "CLUSTER_PEER_LISTEN": "0.0.0.0:9411"},
            r"cluster.advertise is required when cluster.peer_listen \(0.0.0.0:9411\)",
        ),
        (
            {"CLUSTER_DATABASE": "postgresql://h/db", "CLUSTER_PEER_LISTEN": "10.0.0.5:9411"},
            "cluster.peer_token_file is required",
        ),
        (
            {
                "CLUSTER_DATABASE": "postgresql://h/db",
                "CLUSTER_PEER_LISTEN": "10.0.0.5:9411",
                "CLUSTER_PEER_TOKEN_FILE": "/nonexistent/peer.token",
            },
            "cluster.peer_token_file /nonexistent/peer.token cannot be read",
        ),
        (
            {"CLUSTER_DATABASE": "postgresql://h/db", "CLUSTER_DIRECTORY": "/x.db"},
            "exclude each other",
        ),
    ],
)
def test_a_bad_cluster_setting_is_a_one_line_error(env: dict[str, str], message: str) -> None:
    with pytest.raises(GatewayConfigError, match=message) as info:
        load(environ={f"CLOUD_GATEWAY_{k}": v for k, v in env.items()})
    assert "\n" not in str(info.value)


def test_a_short_peer_token_is_refused(tmp_path: Path) -> None:
    token = tmp_path / "peer.token"
    token.write_text("short\n")
    env = {
        "CLOUD_GATEWAY_CLUSTER_DATABASE": "postgresql://h/db",
        "CLOUD_GATEWAY_CLUSTER_PEER_LISTEN": "127.0.0.1:9411",
        "CLOUD_GATEWAY_CLUSTER_PEER_TOKEN_FILE": str(token),
    }
    with pytest.raises(GatewayConfigError, match="shorter than 16 characters"):
        load(environ=env)
