"""The [attribution] pod-resources settings and [simulate] pod_resources."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge_agent.config import load
from edge_agent.errors import ConfigError


def test_defaults_read_the_kubelets_socket() -> None:
    a = load(None, {}).attribution
    assert a.pod_resources_socket == Path("/var/lib/kubelet/pod-resources/kubelet.sock")
    assert (a.pod_resources_ttl_seconds, a.pod_resources_timeout_seconds) == (10.0, 1.0)
    assert a.gpu_resource_names == ()
    assert (a.gpu_memory_resource_names, a.gpu_memory_unit) == (("aliyun.com/gpu-mem",), "GiB")
    assert a.old_pod_label_names is False
    assert load(None, {}).simulate.pod_resources == ""


def test_toml_and_environment(tmp_path: Path) -> None:
    f = tmp_path / "agent.toml"
    f.write_text(
        "[attribution]\n"
        'pod_resources_socket = "/host/kubelet/pod-resources/kubelet.sock"\n'
        'gpu_resource_names = ["nvidia.com/a100"]\n'
        'gpu_memory_unit = "MiB"\n'
        "old_pod_label_names = true\n"
        '[simulate]\npod_resources = "gpushare"\n'
    )
    a = load(f, {}).attribution
    assert a.pod_resources_socket == Path("/host/kubelet/pod-resources/kubelet.sock")
    assert (a.gpu_resource_names, a.gpu_memory_unit, a.old_pod_label_names) == (
        ("nvidia.com/a100",),
        "MiB",
        True,
    )
    env = {
        "EDGE_AGENT_ATTRIBUTION_POD_RESOURCES_SOCKET": "",  # off
        "EDGE_AGENT_ATTRIBUTION_POD_RESOURCES_TTL_SECONDS": "30",
        "EDGE_AGENT_SIMULATE_POD_RESOURCES": "nvidia",
    }
    cfg = load(f, env)
    assert cfg.attribution.pod_resources_socket is None
    assert cfg.attribution.pod_resources_ttl_seconds == 30.0
    assert cfg.simulate.pod_resources == "nvidia"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"EDGE_AGENT_ATTRIBUTION_GPU_MEMORY_UNIT": "GB"}, "gpu_memory_unit must be GiB or MiB"),
        ({"EDGE_AGENT_ATTRIBUTION_POD_RESOURCES_TTL_SECONDS": "0"}, "must be > 0"),
        ({"EDGE_AGENT_ATTRIBUTION_POD_RESOURCES_TIMEOUT_SECONDS": "-1"}, "must be > 0"),
        ({"EDGE_AGENT_SIMULATE_POD_RESOURCES": "hami"}, "nvidia or gpushare"),
    ],
)
def test_bad_values_are_errors(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load(None, env)
