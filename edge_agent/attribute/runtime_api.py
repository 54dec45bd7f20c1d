"""Container id → name (and dockershim pod labels) from the Docker Engine API on a unix socket.

Podman serves the same API (``GET /containers/<id>/json``) on its socket, so one client
speaks to both. httpx errors are translated here into :class:`RuntimeApiError`; nothing
from httpx escapes this module.

=======================  ============================================================
socket missing           ``None``: this runtime is not installed, nothing to report
``404``                  ``None``: not a container of this runtime
``200``                  :class:`ContainerInfo`
connect error, timeout   :class:`RuntimeDownError` (the daemon is down or hung)
other status, bad JSON   :class:`RuntimeApiError`
=======================  ============================================================
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import httpx

from edge_agent.errors import AgentError

__all__ = [
    "ContainerInfo",
    "EngineClient",
    "RuntimeApiError",
    "RuntimeDownError",
    "parse_dockershim_name",
    "parse_inspect",
]

POD_NAME_LABEL = "io.kubernetes.pod.name"
POD_NAMESPACE_LABEL = "io.kubernetes.pod.namespace"
CONTAINER_NAME_LABEL = "io.kubernetes.container.name"


class RuntimeApiError(AgentError):
    """A runtime socket exists, but its API failed or answered something unusable."""


class RuntimeDownError(RuntimeApiError):
    """A runtime socket exists, but nothing answers on it (refused, reset or timed out)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ContainerInfo:
    """What the runtime says about a container; pod fields only for dockershim containers."""

    name: str = ""
    pod_name: str = ""
    namespace: str = ""
    k8s_container: str = ""


def parse_inspect(payload: object) -> ContainerInfo:
    """Read the answer of ``GET /containers/<id>/json``; :class:`RuntimeApiError` if no object.

    Pod fields come from the ``io.kubernetes.*`` labels dockershim sets, else from a
    dockershim container name ``k8s_<container>_<pod>_<namespace>_<uid>_<attempt>``.
    """
    if not isinstance(payload, dict):
        raise RuntimeApiError(f"container JSON is a {type(payload).__name__}, not an object")
    raw_name = payload.get("Name")
    name = raw_name.lstrip("/") if isinstance(raw_name, str) else ""
    config = payload.get("Config")
    labels = config.get("Labels") if isinstance(config, dict) else None
    if not isinstance(labels, dict):
        labels = {}
    pod_name = _str(labels.get(POD_NAME_LABEL))
    if not pod_name:
        from_name = parse_dockershim_name(name)
        if from_name is not None:
            return from_name
    return ContainerInfo(
        name=name,
        pod_name=pod_name,
        namespace=_str(labels.get(POD_NAMESPACE_LABEL)),
        k8s_container=_str(labels.get(CONTAINER_NAME_LABEL)),
    )


def parse_dockershim_name(name: str) -> ContainerInfo | None:
    """``k8s_<container>_<pod>_<namespace>_<uid>_<attempt>`` → info; else ``None``."""
    fields = name.split("_")
    if len(fields) != 6 or fields[0] != "k8s" or not fields[5].isdigit() or not all(fields):
        return None
    return ContainerInfo(
        name=name, pod_name=fields[2], namespace=fields[3], k8s_container=fields[1]
    )


def _str(value: object) -> str:
    return value if isinstance(value, str) else ""


class EngineClient:
    """One Docker Engine (or Podman) API socket; the HTTP client is made on first use.

    ``runtime`` is a guess from the path: ``"podman"`` if it says so, else ``"docker"``.
    """

    def __init__(self, socket: Path, *, timeout: float) -> None:
        self.socket = socket
        self.runtime = "podman" if "podman" in str(socket) else "docker"
        self._timeout = timeout
        self._client: httpx.Client | None = None

    def inspect(self, container_id: str) -> ContainerInfo | None:
        """The container's info; ``None`` if the socket is missing or the id unknown (404)."""
        if not os.path.exists(self.socket):
            return None
        if self._client is None:
            self._client = httpx.Client(
                transport=httpx.HTTPTransport(uds=str(self.socket)),
                base_url="http://localhost",
                timeout=self._timeout,
                trust_env=False,  # an HTTP_PROXY in the environment must not capture this
            )
        try:
            response = self._client.get(f"/containers/{container_id}/json")
        except (httpx.TransportError, OSError) as exc:
            raise RuntimeDownError(f"{self.socket}: {type(exc).__name__}: {exc}") from exc
        except httpx.HTTPError as exc:
            raise RuntimeApiError(f"{self.socket}: {type(exc).__name__}: {exc}") from exc
        if response.status_code == 404:
            return None
        if response.status_code != 200:
            raise RuntimeApiError(
                f"{self.socket}: GET /containers/{container_id[:12]}/json answered"
                f" {response.status_code}"
            )
        try:
            payload: object = response.json()
        except ValueError as exc:
            raise RuntimeApiError(f"{self.socket}: container JSON is not JSON: {exc}") from exc
        return parse_inspect(payload)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
