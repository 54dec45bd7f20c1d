from __future__ import annotations

from pathlib import Path

import pytest

from edge_agent.config import load, resolve_node_name
from edge_agent.errors import ConfigError


def test_defaults_match_the_design_contract() -> None:
    cfg = load(None, {})
    assert cfg.listen == "127.0.0.1:9400"
    assert (cfg.listen_host, cfg.listen_port) == ("127.0.0.1", 9400)
    assert cfg.attribution.proc_root == Path("/proc")
    assert cfg.simulate.gpus == 0


def test_liveness_settings_have_defaults_and_come_from_the_environment() -> None:
    gw = load(None, {}).gateway
    assert (gw.dial_timeout_seconds, gw.connect_timeout_seconds) == (3.0, 10.0)
    assert gw.silence_timeout_seconds == 0.0  # automatic: 3 x min(interval, 5 s) + 5 s
    assert (gw.keepalive_seconds, gw.keepalive_count_max) == (15.0, 3)
    env = {
        "EDGE_AGENT_GATEWAY_SILENCE_TIMEOUT_SECONDS": "45",
        "EDGE_AGENT_GATEWAY_KEEPALIVE_COUNT_MAX": "5",
    }
    gw = load(None, env).gateway
    assert (gw.silence_timeout_seconds, gw.keepalive_count_max) == (45.0, 5)


def test_toml_then_environment_overrides(tmp_path: Path) -> None:
    f = tmp_path / "agent.toml"
    f.write_text(
        'node_name = "edge-1"\ninterval_seconds = 5\n'
        '[attribution]\nproc_root = "/host/proc"\ncache_ttl_seconds = 30\n'
    )
    env = {
        "EDGE_AGENT_INTERVAL_SECONDS": "2.5",
        "EDGE_AGENT_ATTRIBUTION_RUNTIME_SOCKETS": "/a.sock, /b.sock",
        "EDGE_AGENT_SIMULATE_MIG": "true",
    }
    cfg = load(f, env)
    assert cfg.node_name == "edge-1"
    assert cfg.interval_seconds == 2.5
    assert cfg.attribution.proc_root == Path("/host/proc")
    assert cfg.attribution.cache_ttl_seconds == 30.0
    assert cfg.attribution.runtime_sockets == (Path("/a.sock"), Path("/b.sock"))
    assert cfg.simulate.mig is True


@pytest.mark.parametrize(
    ("toml", "env", "message"),
    [
        ("listn = 'x'\n", {}, "unknown key(s) in config: listn"),
        ("[attribution]\nproc_rot = '/x'\n", {}, "unknown key(s) in attribution: proc_rot"),
        ("interval_seconds = 'fast'\n", {}, "interval_seconds must be of type float"),
        ("listen = 'nohost'\n", {}, "must look like HOST:PORT"),
        ("interval_seconds = 0\n", {}, "must be > 0"),
        ("", {"EDGE_AGENT_LISTN": "1"}, "unknown environment variable EDGE_AGENT_LISTN"),
        ("", {"EDGE_AGENT_SIMULATE_MIG": "maybe"}, "must be a boolean"),
        ("node_name = [\n", {}, "is not valid TOML"),
        ("[gateway]\ndial_timeout_seconds = 0\n", {}, "gateway.dial_timeout_seconds must be > 0"),
        ("[gateway]\nsilence_timeout_seconds = -1\n", {}, "silence_timeout_seconds must be >= 0"),
        ("[gateway]\nkeepalive_count_max = 0\n", {}, "keepalive_count_max >= 1"),
        (
            "interval_seconds = 10\n[gateway]\nsilence_timeout_seconds = 5\n",
            {},
            "must be more than the heartbeat period "
            "(5s = max(min(interval_seconds, 5s), ack_delay_seconds))",
        ),
        ("[gateway]\nack_delay_seconds = 61\n", {}, "gateway.ack_delay_seconds must be in 0..60"),
        ("[gateway]\nack_delay_seconds = -1\n", {}, "gateway.ack_delay_seconds must be in 0..60"),
    ],
)
def test_bad_config_is_a_clear_error(
    tmp_path: Path, toml: str, env: dict[str, str], message: str
) -> None:
    f = tmp_path / "agent.toml"
    f.write_text(toml)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load(f, env)


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load(tmp_path / "nope.toml", {})


def test_node_name_precedence() -> None:
    assert resolve_node_name("cfg", {"KUBE_NODE_NAME": "k", "NODE_NAME": "n"}) == "cfg"
    assert resolve_node_name("", {"KUBE_NODE_NAME": "k", "NODE_NAME": "n"}) == "k"
    assert resolve_node_name("", {"NODE_NAME": "n"}) == "n"
    assert resolve_node_name("", {}) != ""


def test_interval_flag_leaves_the_process_interval_alone() -> None:
    """``--interval 1`` must not run the process list and attribution every second too."""
    from edge_agent.cli import _config, _parser

    args = _parser().parse_args(["run", "--interval", "1"])
    cfg = _config(args)
    assert (cfg.interval_seconds, cfg.process_interval_seconds) == (1.0, 10.0)
    args = _parser().parse_args(["run", "--interval", "1", "--process-interval", "5"])
    assert _config(args).process_interval_seconds == 5.0
