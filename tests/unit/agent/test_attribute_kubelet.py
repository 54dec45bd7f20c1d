"""Kubelet log names → pods: the pure parsers and the index's rescan schedule."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from edge_agent.attribute.kubelet import (
    KubeletLogIndex,
    PodRef,
    parse_container_log_name,
    parse_pod_log_dir_name,
)

CID = "a71533c375a854a5f211a52db2bb449bc2f9e1f54ec283ff80354cbdb42d5009"
UID = "3ec5219b-c8ec-4001-9b29-f4199838f2f6"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("name", "pod", "namespace", "container"),
    [
        ("triton-resnet50-7d9f8b6c5-x2x9k_inference_triton", "triton-resnet50-7d9f8b6c5-x2x9k",
         "inference", "triton"),
        ("llama.finetune-worker-0_ml-training_log-shipper", "llama.finetune-worker-0",
         "ml-training", "log-shipper"),
        ("kube-apiserver-master.k8s.local_kube-system_kube-apiserver",
         "kube-apiserver-master.k8s.local", "kube-system", "kube-apiserver"),
    ],
)  # fmt: skip
def test_container_log_names(name: str, pod: str, namespace: str, container: str) -> None:
    assert parse_container_log_name(f"{name}-{CID}.log") == (
        CID,
        PodRef(pod_name=pod, namespace=namespace, k8s_container=container),
    )


@pytest.mark.parametrize(
    "name",
    [
        f"pod_ns_container-{CID}",  # no .log
        f"pod_ns-container-{CID}.log",  # one underscore
        f"pod_ns_container-{CID[:60]}.log",  # short id
        f"pod_ns_{CID}.log",  # no container name
        f"_ns_container-{CID}.log",  # no pod
        "kube-proxy-8xk2p_kube-system_kube-proxy-rotated.log",
        ".hidden",
    ],
)
def test_not_container_log_names(name: str) -> None:
    assert parse_container_log_name(name) is None


def test_pod_log_dir_names() -> None:
    assert parse_pod_log_dir_name(f"inference_triton-0_{UID}") == (
        UID,
        PodRef(pod_name="triton-0", namespace="inference"),
    )
    assert parse_pod_log_dir_name(UID) is None  # the pre-1.14 layout carries no names
    assert parse_pod_log_dir_name(f"a_b_c_{UID}") is None
    assert parse_pod_log_dir_name(f"_pod_{UID}") is None


def make_index(root: Path, clock: FakeClock, ttl: float = 60.0) -> KubeletLogIndex:
    return KubeletLogIndex(
        container_log_dir=root / "containers",
        pod_log_dir=root / "pods",
        ttl=ttl,
        clock=clock,
    )


def test_missing_directories_are_an_empty_index(tmp_path: Path) -> None:
    errors: list[str] = []
    index = KubeletLogIndex(
        container_log_dir=tmp_path / "nope",
        pod_log_dir=tmp_path / "nope2",
        ttl=60.0,
        clock=FakeClock(),
        on_error=errors.append,
    )
    assert index.lookup(CID, UID) is None
    assert errors == []


def test_unreadable_directory_reports_log_dir(tmp_path: Path) -> None:
    (tmp_path / "containers").write_text("not a directory")
    errors: list[str] = []
    index = KubeletLogIndex(
        container_log_dir=tmp_path / "containers",
        pod_log_dir=tmp_path / "pods",
        ttl=60.0,
        clock=FakeClock(),
        on_error=errors.append,
    )
    assert index.lookup(CID, UID) is None
    assert errors == ["log_dir"]


def test_scans_once_per_ttl_for_known_containers(tmp_path: Path) -> None:
    (tmp_path / "containers").mkdir()
    link = tmp_path / "containers" / f"triton-0_inference_triton-{CID}.log"
    os.symlink("../pods/missing/0.log", link)  # dangling links count: only names are read
    clock = FakeClock()
    index = make_index(tmp_path, clock)
    expected = PodRef(pod_name="triton-0", namespace="inference", k8s_container="triton")
    assert index.lookup(CID, UID) == expected
    link.unlink()
    clock.now += 59.0
    assert index.lookup(CID, UID) == expected  # still the cached scan
    clock.now += 1.0
    assert index.lookup(CID, UID) is None  # rescanned at the TTL


def test_unknown_container_rescans_early_but_rate_limited(tmp_path: Path) -> None:
    (tmp_path / "containers").mkdir()
    clock = FakeClock()
    index = make_index(tmp_path, clock)
    assert index.lookup(CID, UID) is None
    (tmp_path / "containers" / f"triton-0_inference_triton-{CID}.log").touch()
    clock.now += 4.9
    assert index.lookup(CID, UID) is None  # rate-limited
    clock.now += 0.1
    assert index.lookup(CID, UID) == PodRef(
        pod_name="triton-0", namespace="inference", k8s_container="triton"
    )


def test_pod_dir_fallback_by_uid(tmp_path: Path) -> None:
    pod_dir = tmp_path / "pods" / f"research_notebook-0_{UID}"
    (pod_dir / "jupyter").mkdir(parents=True)
    clock = FakeClock()
    index = make_index(tmp_path, clock)
    assert index.lookup(CID, UID) == PodRef(
        pod_name="notebook-0", namespace="research", k8s_container="jupyter"
    )
    (pod_dir / "sidecar").mkdir()
    clock.now += 60.0
    assert index.lookup(CID, UID) == PodRef(pod_name="notebook-0", namespace="research")
    assert index.lookup(CID, "00000000-0000-0000-0000-000000000000") is None
