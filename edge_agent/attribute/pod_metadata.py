"""Allow-listed labels and annotations of this node's pods, read from the API server, as
metric labels (dcgm-exporter's ``--kubernetes-enable-pod-labels``, with an allow-list).

``[kubernetes] pod_labels = ["app", "team"]`` (and ``pod_annotations`` likewise) adds, to
the process and container series of a pod's GPU processes and to the device series of the
GPUs the pod holds, one label per listed key the pod has. The name is the key sanitised as
dcgm-exporter does (every character outside ``[a-zA-Z0-9_]`` becomes ``_``), with ``_``
in front of a leading digit (Prometheus wants a letter or ``_`` there).

Bounds (:data:`MAX_KEYS`, :data:`MAX_VALUE_BYTES`): at most 16 keys listed in all (a
longer list is a configuration error), and a value over 256 bytes of UTF-8 is left out
for that pod (logged once per key) rather than cut. A key whose label name would repeat a
label the series already has (``gpu``, ``pod``...) or another listed key's is left out,
said once at start.

The pods are listed by a background thread (``GET /api/v1/pods?fieldSelector=
spec.nodeName=<node>`` every ``refresh_seconds``), with the service account's token (read
again at each list: tokens rotate) and CA; the collectors only read what the last list
gave, so a slow or absent API server never delays a collection. A failed list keeps the
previous answer and is logged once until a list succeeds again; the DaemonSet's
ClusterRole grants ``list`` on pods.
"""

from __future__ import annotations

import json
import logging
import os
import re
import ssl
import threading
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from gpurelay.model import Labels

log = logging.getLogger(__name__)

MAX_KEYS: Final = 16  # labels and annotations listed, in all
MAX_VALUE_BYTES: Final = 256  # a longer value is left out for that pod
_INVALID: Final = re.compile(r"[^a-zA-Z0-9_]")
# Labels every series these are added to may already carry (device, process, container).
RESERVED: Final = frozenset(
    {
        "gpu",
        "UUID",
        "device",
        "modelName",
        "pci_bus_id",
        "Hostname",
        "hostname",
        "NodeName",
        "DCGM_FI_DRIVER_VERSION",
        "DCGM_FI_SYSTEM_DRIVER_VERSION",
        "GPU_I_PROFILE",
        "GPU_I_ID",
        "pod",
        "namespace",
        "container",
        "pod_name",
        "pod_namespace",
        "container_name",
        "container_id",
        "NamespaceName",
        "PodName",
        "ContainerName",
        "ProcessId",
        "ProcessName",
        "ProcessType",
        "window_size_in_ms",
        "xid",
        "clock_event",
        "health_watch",
        "health_error_code",
    }
)

Fetch = Callable[[], Sequence[Mapping[str, Any]]]  # the node's pods, as the API gives them


def label_name(key: str) -> str:
    """dcgm-exporter's sanitising of a pod label key, made a valid Prometheus name."""
    name = _INVALID.sub("_", key)
    return f"_{name}" if name[:1].isdigit() else name


def chosen_names(labels: Iterable[str], annotations: Iterable[str]) -> list[tuple[str, str, str]]:
    """(``labels`` or ``annotations``, key, label name) for each listed key that can be a
    label: not clashing with the series' own labels or an earlier key (logged)."""
    out: list[tuple[str, str, str]] = []
    taken = set(RESERVED)
    for kind, keys in (("labels", labels), ("annotations", annotations)):
        for key in keys:
            name = label_name(key)
            if name in taken:
                log.warning(
                    "pod %s %r is left out: its label name %s is already used on the series",
                    kind[:-1],
                    key,
                    name,
                )
                continue
            taken.add(name)
            out.append((kind, key, name))
    return out


class PodMetadata:
    """``labels(namespace, pod)``: the allow-listed metadata of a pod of this node."""

    def __init__(
        self,
        labels: Sequence[str],
        annotations: Sequence[str],
        fetch: Fetch,
        *,
        refresh_seconds: float = 30.0,
    ) -> None:
        self._chosen = chosen_names(labels, annotations)
        self._fetch = fetch
        self._refresh = refresh_seconds
        self._pods: dict[tuple[str, str], Labels] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False
        self._too_long: set[str] = set()
        self.lists = 0  # successful lists
        self.failures = 0  # failed ones

    def labels(self, namespace: str, pod: str) -> Labels:
        with self._lock:
            return self._pods.get((namespace, pod), ())

    def with_pod(self, labels: Labels) -> Labels:
        """``labels`` (a series' pod labels, either naming) and the pod's metadata."""
        d = dict(labels)
        pod = d.get("pod") or d.get("pod_name")
        namespace = d.get("namespace") or d.get("pod_namespace")
        if not pod or namespace is None:
            return labels
        extra = self.labels(namespace, pod)
        return (*labels, *extra) if extra else labels

    def start(self) -> None:
        if self._chosen and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pod-metadata", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            self.refresh()
            self._stop.wait(self._refresh)

    def refresh(self) -> None:
        """List the node's pods once; on failure keep the last answer."""
        try:
            pods = self._fetch()
        except Exception as exc:  # an unreachable or refusing API server, a bad answer
            self.failures += 1
            if not self._failing:
                self._failing = True
                log.warning("pod metadata: listing this node's pods failed: %s", exc)
            return
        if self._failing:
            self._failing = False
            log.info("pod metadata: listing this node's pods works again")
        table = {key: extra for key, extra in (self._of(pod) for pod in pods) if extra}
        with self._lock:
            self._pods = table
        self.lists += 1

    def _of(self, pod: Mapping[str, Any]) -> tuple[tuple[str, str], Labels]:
        meta = pod.get("metadata") or {}
        key = (str(meta.get("namespace", "")), str(meta.get("name", "")))
        extra: list[tuple[str, str]] = []
        for kind, name_in_pod, label in self._chosen:
            value = (meta.get(kind) or {}).get(name_in_pod)
            if not isinstance(value, str):
                continue
            if len(value.encode()) > MAX_VALUE_BYTES:
                if name_in_pod not in self._too_long:
                    self._too_long.add(name_in_pod)
                    log.warning(
                        "pod %s/%s: %s %r is over %d bytes, left out (said once per key)",
                        key[0],
                        key[1],
                        kind[:-1],
                        name_in_pod,
                        MAX_VALUE_BYTES,
                    )
                continue
            extra.append((label, value))
        return key, tuple(extra)


def api_server_fetch(
    node: str,
    *,
    server: str = "",
    token_file: Path,
    ca_file: Path,
    timeout: float,
    environ: Mapping[str, str] = os.environ,
) -> Fetch:
    """A :data:`Fetch` listing ``node``'s pods from the API server (in-cluster by default:
    ``KUBERNETES_SERVICE_HOST``/``_PORT``, the service account's token and CA)."""
    if not server:
        host = environ.get("KUBERNETES_SERVICE_HOST", "")
        port = environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise ValueError(
                "kubernetes.api_server is not set and KUBERNETES_SERVICE_HOST is not in "
                "the environment (not in a pod?)"
            )
        server = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
    selector = urllib.parse.quote(f"spec.nodeName={node}")
    url = f"{server.rstrip('/')}/api/v1/pods?fieldSelector={selector}"
    context = ssl.create_default_context(cafile=str(ca_file)) if url.startswith("https") else None

    def fetch() -> Sequence[Mapping[str, Any]]:
        headers = {"Accept": "application/json"}
        if token_file.exists():
            headers["Authorization"] = f"Bearer {token_file.read_text().strip()}"
        request = urllib.request.Request(url, headers=headers)
        with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
            body = json.loads(response.read(64 * 1024 * 1024))
        items = body.get("items") if isinstance(body, dict) else None
        if not isinstance(items, list):
            raise ValueError("the API server's answer has no list of items")
        return [item for item in items if isinstance(item, dict)]

    return fetch
