"""Gateway config: the [remote_write] section, from TOML and CLOUD_GATEWAY_REMOTE_WRITE_*."""

from __future__ import annotations

from pathlib import Path

import pytest

from cloud_gateway.config import load
from cloud_gateway.errors import GatewayConfigError
from cloud_gateway.remote_write.config import check_remote_write


def test_remote_write_is_off_by_default() -> None:
    cfg = load(None, {})
    assert cfg.remote_write.url == ""
    assert cfg.remote_write.max_queued_batches_per_node == 256
    assert check_remote_write(cfg.remote_write) is None


def test_remote_write_from_toml_and_environment(tmp_path: Path) -> None:
    f = tmp_path / "gateway.toml"
    f.write_text(
        "[remote_write]\n"
        'url = "https://mimir.example/api/v1/push"\n'
        'headers = ["X-Scope-OrgID: edge"]\n'
        "max_samples_per_send = 500\n"
    )
    env = {
        "CLOUD_GATEWAY_REMOTE_WRITE_BEARER_TOKEN_FILE": "/run/secrets/rw-token",
        "CLOUD_GATEWAY_REMOTE_WRITE_MAX_QUEUED_BATCHES_PER_NODE": "32",
        "CLOUD_GATEWAY_REMOTE_WRITE_TLS_INSECURE_SKIP_VERIFY": "false",
    }
    cfg = load(f, env)
    client = check_remote_write(cfg.remote_write)
    assert client is not None
    assert client.url == "https://mimir.example/api/v1/push"
    assert client.headers == ("X-Scope-OrgID: edge",)
    assert client.bearer_token_file == Path("/run/secrets/rw-token")
    assert client.max_samples_per_send == 500
    assert cfg.remote_write.max_queued_batches_per_node == 32


def test_max_retries_is_still_accepted_but_deprecated(tmp_path: Path) -> None:
    """Retries are the forwarder's, until the receiver takes or refuses a batch: an old
    config that sets max_retries still loads; startup logs the deprecated() line."""
    f = tmp_path / "gateway.toml"
    f.write_text('[remote_write]\nurl = "http://x"\nmax_retries = 10\n')
    for env in ({}, {"CLOUD_GATEWAY_REMOTE_WRITE_MAX_RETRIES": "3"}):
        cfg = load(f, env)
        assert check_remote_write(cfg.remote_write) is cfg.remote_write
        (line,) = cfg.remote_write.deprecated()
        assert "remote_write.max_retries is deprecated and ignored" in line
    assert load(None, {}).remote_write.deprecated() == []


@pytest.mark.parametrize(
    ("toml", "env", "message"),
    [
        ('url = "ftp://x"\n', {}, "remote_write: remote write url must be http(s)://"),
        ('url = "http://x"\nmin_backoff_seconds = 9\n', {}, "remote_write: need 0 <= min_backoff"),
        (
            'url = "http://x"\nbearer_token = "a"\nbasic_user = "b"\n',
            {},
            "remote_write: set bearer or basic auth, not both",
        ),
        ('url = "http://x"\nheaders = ["nocolon"]\n', {}, "header must be 'Name: value'"),
        ("max_queued_batches_per_node = 0\n", {}, "max_queued_batches_per_node must be >= 1"),
        ("headers = ['Host: x']\n", {}, "remote_write: header 'Host' is set by the remote"),
        ("timeout_seconds = 'soon'\n", {}, "remote_write.timeout_seconds must be of type float"),
        ("urll = 'x'\n", {}, "unknown key(s) in remote_write: urll"),
        ("", {"CLOUD_GATEWAY_REMOTE_WRITE_MAX_RETRIES": "many"}, "must be of type int"),
    ],
)
def test_a_bad_remote_write_value_is_a_one_line_error(
    tmp_path: Path, toml: str, env: dict[str, str], message: str
) -> None:
    f = tmp_path / "gateway.toml"
    f.write_text("[remote_write]\n" + toml)
    with pytest.raises(GatewayConfigError) as err:
        load(f, env)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_http_listener_limits_have_defaults_and_come_from_toml_and_environment(
    tmp_path: Path,
) -> None:
    http = load(None, {}).http
    assert (http.max_connections, http.header_timeout_seconds, http.idle_timeout_seconds) == (
        4096,
        10.0,
        75.0,
    )
    f = tmp_path / "gateway.toml"
    f.write_text("[http]\nmax_connections = 200\nheader_timeout_seconds = 5\n")
    http = load(f, {"CLOUD_GATEWAY_HTTP_IDLE_TIMEOUT_SECONDS": "30"}).http
    assert (http.max_connections, http.header_timeout_seconds, http.idle_timeout_seconds) == (
        200,
        5.0,
        30.0,
    )


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("max_connections = 0\n", "http.max_connections must be at least 1, not 0"),
        ("header_timeout_seconds = 0\n", "http.header_timeout_seconds must be > 0, not 0"),
        ("idle_timeout_seconds = -1\n", "http.idle_timeout_seconds must be > 0, not -1"),
    ],
)
def test_a_bad_http_listener_limit_is_a_one_line_error(
    tmp_path: Path, toml: str, message: str
) -> None:
    f = tmp_path / "gateway.toml"
    f.write_text("[http]\n" + toml)
    with pytest.raises(GatewayConfigError) as err:
        load(f, {})
    assert message in str(err.value) and "\n" not in str(err.value)


def test_ssh_defences_have_defaults_and_come_from_toml_and_environment(tmp_path: Path) -> None:
    cfg = load(None, {})
    assert (cfg.ssh.keepalive_seconds, cfg.ssh.keepalive_count_max) == (30.0, 3)
    assert cfg.ssh.frame_timeout_seconds == 60.0 and cfg.ssh.max_channels_per_connection == 1
    assert cfg.ssh.duplicate_connection == "newest" and cfg.ssh.siblings == ()
    path = tmp_path / "gateway.toml"
    path.write_text(
        '[ssh]\nkeepalive_seconds = 5\nduplicate_connection = "oldest"\n'
        'siblings = ["edge-gw-1=cam-*"]\n'
    )
    cfg = load(path, {"CLOUD_GATEWAY_SSH_KEEPALIVE_COUNT_MAX": "2"})
    assert (cfg.ssh.keepalive_seconds, cfg.ssh.keepalive_count_max) == (5.0, 2)
    assert cfg.ssh.duplicate_connection == "oldest" and cfg.ssh.siblings == ("edge-gw-1=cam-*",)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"CLOUD_GATEWAY_SSH_KEEPALIVE_SECONDS": "0"}, "ssh.keepalive_seconds"),
        ({"CLOUD_GATEWAY_SSH_FRAME_TIMEOUT_SECONDS": "0"}, "ssh.frame_timeout_seconds"),
        ({"CLOUD_GATEWAY_SSH_MAX_CHANNELS_PER_CONNECTION": "0"}, "max_channels_per_connection"),
        ({"CLOUD_GATEWAY_SSH_DUPLICATE_CONNECTION": "random"}, "newest, oldest, refuse_both"),
        ({"CLOUD_GATEWAY_SSH_SIBLINGS": "edge-gw-1"}, "ssh.siblings"),
    ],
)
def test_a_bad_ssh_defence_is_a_one_line_error(env: dict[str, str], message: str) -> None:
    with pytest.raises(GatewayConfigError, match=message):
        load(None, env)


def test_liveness_thresholds_have_defaults_and_come_from_toml_and_environment(
    tmp_path: Path,
) -> None:
    policy = load(None, {}).registry.liveness()
    assert (policy.stale_after_intervals, policy.offline_after_intervals) == (3.0, 6.0)
    assert policy.margin_seconds == 2.0
    path = tmp_path / "gateway.toml"
    path.write_text("[registry]\nstale_after_intervals = 4\noffline_after_intervals = 10\n")
    cfg = load(path, {"CLOUD_GATEWAY_REGISTRY_MARGIN_SECONDS": "5"})
    policy = cfg.registry.liveness()
    assert (policy.stale_after_intervals, policy.offline_after_intervals) == (4.0, 10.0)
    assert policy.margin_seconds == 5.0


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"CLOUD_GATEWAY_REGISTRY_STALE_AFTER_INTERVALS": "0"}, "stale_after_intervals"),
        ({"CLOUD_GATEWAY_REGISTRY_OFFLINE_AFTER_INTERVALS": "2"}, "offline_after_intervals"),
        ({"CLOUD_GATEWAY_REGISTRY_MARGIN_SECONDS": "-1"}, "margin_seconds"),
        ({"CLOUD_GATEWAY_REGISTRY_OFFLINE_GRACE_SECONDS": "-1"}, "offline_grace_seconds"),
    ],
)
def test_a_bad_liveness_threshold_is_a_one_line_error(env: dict[str, str], message: str) -> None:
    with pytest.raises(GatewayConfigError, match=f"registry.*{message}"):
        load(None, env)
