"""Pod labels and annotations as metric labels (edge_agent.attribute.pod_metadata): the
allow-list, dcgm-exporter's sanitising, the bounds, and the API server list over real HTTP
on loopback, through the agent's pipeline to the process, container and device series."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from edge_agent.attribute.pod_metadata import (
    MAX_VALUE_BYTES,
    PodMetadata,
    api_server_fetch,
    chosen_names,
    label_name,
)
from edge_agent.config import KubernetesConfig, load
from edge_agent.errors import ConfigError
from harness.pipeline import make_pipeline


def pod(namespace: str, name: str, labels: dict[str, str], **annotations: str) -> dict[str, Any]:
    return {
        "metadata": {
            "namespace": namespace,
            "name": name,
            "labels": labels,
            "annotations": annotations,
        }
    }


@pytest.mark.parametrize(
    ("key", "name"),
    [
        ("app", "app"),
        ("app.kubernetes.io/name", "app_kubernetes_io_name"),
        ("team-a", "team_a"),
        ("9lives", "_9lives"),
    ],
)
def test_keys_are_sanitised_as_dcgm_exporter_does(key: str, name: str) -> None:
    assert label_name(key) == name


def test_keys_that_would_clash_are_left_out() -> None:
    chosen = chosen_names(["app", "pod", "a.b", "a_b"], ["gpu", "owner"])
    assert chosen == [
        ("labels", "app", "app"),
        ("labels", "a.b", "a_b"),
        ("annotations", "owner", "owner"),
    ]


def test_listed_labels_and_annotations_of_a_pod() -> None:
    pods = [
        pod("ml", "train-0", {"app": "trainer", "team": "vision", "other": "x"}, owner="ana"),
        pod("ml", "idle", {"unrelated": "y"}),
    ]
    meta = PodMetadata(["app", "team"], ["owner"], lambda: pods)
    assert meta.labels("ml", "train-0") == ()  # nothing listed yet
    meta.refresh()
    assert meta.labels("ml", "train-0") == (
        ("app", "trainer"),
        ("team", "vision"),
        ("owner", "ana"),
    )
    assert meta.labels("ml", "idle") == ()
    assert meta.labels("other", "train-0") == ()
    labels = (("pod", "train-0"), ("namespace", "ml"), ("container", "c"))
    assert meta.with_pod(labels) == (
        *labels,
        ("app", "trainer"),
        ("team", "vision"),
        ("owner", "ana"),
    )
    old = (("pod_name", "train-0"), ("pod_namespace", "ml"))
    assert meta.with_pod(old)[2:] == (("app", "trainer"), ("team", "vision"), ("owner", "ana"))


def test_a_value_over_the_bound_is_left_out_not_cut() -> None:
    long = "v" * (MAX_VALUE_BYTES + 1)
    meta = PodMetadata(["app", "team"], [], lambda: [pod("ml", "p", {"app": long, "team": "t"})])
    meta.refresh()
    assert meta.labels("ml", "p") == (("team", "t"),)
    fits = "é" * (MAX_VALUE_BYTES // 2)  # 2 bytes each: exactly the bound
    meta = PodMetadata(["app"], [], lambda: [pod("ml", "p", {"app": fits})])
    meta.refresh()
    assert meta.labels("ml", "p") == (("app", fits),)


def test_a_failed_list_keeps_the_last_answer() -> None:
    answers: list[Any] = [[pod("ml", "p", {"app": "a"})]]

    def fetch() -> Any:
        answer = answers[-1]
        if isinstance(answer, Exception):
            raise answer
        return answer

    meta = PodMetadata(["app"], [], fetch)
    meta.refresh()
    answers.append(OSError("connection refused"))
    meta.refresh()
    assert meta.labels("ml", "p") == (("app", "a"),)
    assert (meta.lists, meta.failures) == (1, 1)
    answers.append([])  # the pod is gone
    meta.refresh()
    assert meta.labels("ml", "p") == ()


def test_the_allow_list_is_bounded_in_the_configuration() -> None:
    keys = ",".join(f"k{i}" for i in range(17))  # a list from the environment: comma-separated
    with pytest.raises(ConfigError, match="at most 16"):
        load(None, {"EDGE_AGENT_KUBERNETES_POD_LABELS": keys})
    cfg = load(None, {"EDGE_AGENT_KUBERNETES_POD_LABELS": "app,team"})
    assert cfg.kubernetes.pod_labels == ("app", "team") and cfg.kubernetes.enabled
    assert not KubernetesConfig().enabled


# --- the API server, over real HTTP ----------------------------------------------------------


class FakeApiServer:
    """Answers GET /api/v1/pods with ``pods``; remembers each request's path and token."""

    def __init__(self) -> None:
        self.pods: list[dict[str, Any]] = []
        self.requests: list[tuple[str, str]] = []
        self.status = 200
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.requests.append((self.path, self.headers.get("Authorization", "")))
                body = json.dumps({"kind": "PodList", "items": outer.pods}).encode()
                self.send_response(outer.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    server = FakeApiServer()
    yield server
    server.close()


def test_the_node_pods_are_listed_with_the_service_account_token(
    api: FakeApiServer, tmp_path: Path
) -> None:
    token = tmp_path / "token"
    token.write_text("secret-1\n")
    api.pods = [pod("ml", "p", {"app": "a"})]
    fetch = api_server_fetch(
        "edge-1", server=api.url, token_file=token, ca_file=tmp_path / "ca", timeout=2
    )
    assert fetch() == api.pods
    token.write_text("secret-2")  # rotated: read again at the next list
    fetch()
    assert api.requests == [
        ("/api/v1/pods?fieldSelector=spec.nodeName%3Dedge-1", "Bearer secret-1"),
        ("/api/v1/pods?fieldSelector=spec.nodeName%3Dedge-1", "Bearer secret-2"),
    ]
    api.status = 403
    with pytest.raises(OSError, match="403"):
        fetch()


def test_outside_a_pod_without_an_api_server_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="KUBERNETES_SERVICE_HOST"):
        api_server_fetch(
            "n", token_file=tmp_path / "t", ca_file=tmp_path / "c", timeout=1, environ={}
        )


def of(snap: Any, name: str) -> list[dict[str, str]]:
    return [dict(s.labels) for s in snap.samples if s.name == name]


def test_pod_labels_reach_process_container_and_device_series(
    api: FakeApiServer, tmp_path: Path
) -> None:
    base = load(None, {})
    cfg = dataclasses.replace(
        base,
        simulate=dataclasses.replace(base.simulate, pod_resources="nvidia"),
        kubernetes=KubernetesConfig(
            pod_labels=("app", "team"),
            pod_annotations=("example.com/owner",),
            api_server=api.url,
            token_file=tmp_path / "no-token",
            refresh_seconds=0.05,
        ),
    )
    pipeline, _sim, clock = make_pipeline(tmp_path, gpus=2, cfg=cfg)
    try:
        first = pipeline.collection.collect()
        owners = {
            (d["NamespaceName"], d["PodName"])
            for d in (dict(s.labels) for s in first.samples)
            if d.get("PodName")
        }
        assert owners, "the simulated host has pods"
        api.pods = [
            pod(ns, name, {"app": f"app-{name}", "team": "edge"}, **{"example.com/owner": "ops"})
            for ns, name in owners
        ]
        deadline = time.monotonic() + 10
        while True:
            clock.advance(10)  # the process pass runs again
            snap = pipeline.collection.collect()
            procs = of(snap, "DCGM_CUSTOM_PROCESS_MEM_USED")
            containers = of(snap, "DCGM_CUSTOM_CONTAINER_MEM_USED")
            devices = of(snap, "DCGM_FI_DEV_GPU_UTIL")
            # The metadata arrives from a thread: it may land in the middle of a collection
            # (between two GPUs, or the device and the process pass), so wait for one that
            # read it throughout.
            owned = [
                *(p for p in procs if p["PodName"]),
                *(c for c in containers if c["PodName"]),
                *(d for d in devices if d.get("pod")),
            ]
            if owned and all("app" in x for x in owned):
                break
            assert time.monotonic() < deadline, "pod labels never appeared"
            time.sleep(0.05)
    finally:
        pipeline.close()
    for p in procs:
        if p["PodName"]:
            assert (p["app"], p["team"], p["example_com_owner"]) == (
                f"app-{p['PodName']}",
                "edge",
                "ops",
            )
        else:
            assert "app" not in p  # a host process has no pod
    assert containers and all(c["app"] == f"app-{c['PodName']}" for c in containers if c["PodName"])
    held = [d for d in devices if d.get("pod")]
    assert held, "the simulated kubelet allocates GPUs to pods"
    assert all(d["app"] == f"app-{d['pod']}" and d["team"] == "edge" for d in held)
