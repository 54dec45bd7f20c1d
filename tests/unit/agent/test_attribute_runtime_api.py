"""The pure half of the runtime API client: reading ``GET /containers/<id>/json`` answers.

The socket half runs against a real HTTP server in ``test_attribute.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edge_agent.attribute.runtime_api import (
    ContainerInfo,
    EngineClient,
    RuntimeApiError,
    parse_dockershim_name,
    parse_inspect,
)

API = Path(__file__).parent.parent.parent / "fixtures" / "attribution" / "docker-api"
SHIM_UID = "4450292c-fec7-4b62-a790-b528cb8165f5"


def load(name: str) -> object:
    return json.loads((API / name).read_text())


def test_plain_docker_container() -> None:
    assert parse_inspect(load("plain-docker.json")) == ContainerInfo(name="ivws-channels")


def test_dockershim_labels() -> None:
    assert parse_inspect(load("dockershim.json")) == ContainerInfo(
        name=f"k8s_dx-tel-gpu01-418_aiges-tel-418.iat-tel-gpu01-bb7cf87b-szrdl_iat_{SHIM_UID}_0",
        pod_name="aiges-tel-418.iat-tel-gpu01-bb7cf87b-szrdl",
        namespace="iat",
        k8s_container="dx-tel-gpu01-418",
    )


def test_dockershim_name_without_labels() -> None:
    payload = load("dockershim.json")
    assert isinstance(payload, dict)
    payload["Config"]["Labels"] = None
    info = parse_inspect(payload)
    assert (info.pod_name, info.namespace, info.k8s_container) == (
        "aiges-tel-418.iat-tel-gpu01-bb7cf87b-szrdl",
        "iat",
        "dx-tel-gpu01-418",
    )


@pytest.mark.parametrize(
    "name",
    ["ivws-channels", "k8s_a_b_c_d", "k8s_a_b_c_d_x", "k8s__pod_ns_uid_0", "notk8s_a_b_c_d_0"],
)
def test_not_dockershim_names(name: str) -> None:
    assert parse_dockershim_name(name) is None


@pytest.mark.parametrize("payload", [[], "x", None, 3])
def test_not_an_object(payload: object) -> None:
    with pytest.raises(RuntimeApiError):
        parse_inspect(payload)


def test_odd_but_valid_objects() -> None:
    assert parse_inspect({}) == ContainerInfo()
    assert parse_inspect({"Name": 7, "Config": {"Labels": ["x"]}}) == ContainerInfo()


def test_runtime_is_guessed_from_the_socket_path() -> None:
    assert EngineClient(Path("/var/run/docker.sock"), timeout=1.0).runtime == "docker"
    assert EngineClient(Path("/run/podman/podman.sock"), timeout=1.0).runtime == "podman"
    assert EngineClient(Path("/run/user/1000/podman/podman.sock"), timeout=1.0).runtime == "podman"


def test_missing_socket_is_not_an_error(tmp_path: Path) -> None:
    client = EngineClient(tmp_path / "docker.sock", timeout=1.0)
    assert client.inspect("0" * 64) is None
    client.close()
