"""Container id → name (and dockershim pod labels) from the Docker Engine API on a unix socket.

Podman serves the same API (``GET /containers/<id>/json``) on its socket, so one client
speaks to both. httpx errors are translated here into :class:`RuntimeApiError`; nothing
from httpx escapes this module.

=======================  ============================================================
socket missing           ``None``: this runtime is not installed, nothing to report
not its owner's socket   ``None`` (``owner`` given: a symlink now, or another uid's file)
``404``                  ``None``: not a container of this runtime
``200``                  :class:`ContainerInfo`
connect error, timeout   :class:`RuntimeDownError` (the daemon is down or hung)
answer too slow          :class:`RuntimeDownError` (over ``4 x timeout`` in all)
other status, bad JSON   :class:`RuntimeApiError`
answer over 1 MiB        :class:`RuntimeApiError` (``docker inspect`` is a few KiB)
=======================  ============================================================

A user's rootless runtime is that user's program: its answer is read within a size and
time bound, so a hostile one can cost the agent at most that.
"""

from __future__ import annotations

import json
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from edge_agent.errors import AgentError

if TYPE_CHECKING:  # imported on first use: most nodes have no Docker/Podman socket (1 MB RSS)
    import httpx

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
MAX_ANSWER_BYTES = 1 << 20


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
    With ``owner`` (a socket found in a user's directory) the path must still be a socket
    of that uid, not a symlink, when a request is made.
    """

    def __init__(self, socket: Path, *, timeout: float, owner: int | None = None) -> None:
        self.socket = socket
        self.owner = owner
        self.runtime = "podman" if "podman" in str(socket) else "docker"
        self._timeout = timeout
        self._client: httpx.Client | None = None

    def inspect(self, container_id: str) -> ContainerInfo | None:
        """The container's info; ``None`` if the socket is missing or the id unknown (404)."""
        if not self._present():
            return None
        import httpx

        if self._client is None:
            self._client = httpx.Client(
                transport=httpx.HTTPTransport(uds=str(self.socket)),
                base_url="http://localhost",
                timeout=self._timeout,
                trust_env=False,  # an HTTP_PROXY in the environment must not capture this
            )
        try:
            status, body = self._get(f"/containers/{container_id}/json")
        except (httpx.TransportError, OSError) as exc:
            raise RuntimeDownError(f"{self.socket}: {type(exc).__name__}: {exc}") from exc
        except httpx.HTTPError as exc:
            raise RuntimeApiError(f"{self.socket}: {type(exc).__name__}: {exc}") from exc
        if status == 404:
            return None
        if status != 200:
            raise RuntimeApiError(
                f"{self.socket}: GET /containers/{container_id[:12]}/json answered {status}"
            )
        try:
            payload: object = json.loads(body)
        except ValueError as exc:
            raise RuntimeApiError(f"{self.socket}: container JSON is not JSON: {exc}") from exc
        return parse_inspect(payload)

    def _present(self) -> bool:
        if self.owner is None:
            return os.path.exists(self.socket)
        try:
            st = os.lstat(self.socket)
        except OSError:
            return False
        return stat.S_ISSOCK(st.st_mode) and st.st_uid == self.owner

    def _get(self, path: str) -> tuple[int, bytes]:
        """Status and body, the body read within MAX_ANSWER_BYTES and 4 x timeout."""
        assert self._client is not None
        deadline = time.monotonic() + 4 * self._timeout
        body = bytearray()
        # Raw bytes, identity asked for: a compressed answer cannot expand past the bound.
        with self._client.stream("GET", path, headers={"Accept-Encoding": "identity"}) as response:
            for chunk in response.iter_raw():
                body += chunk
                if len(body) > MAX_ANSWER_BYTES:
                    raise RuntimeApiError(f"{self.socket}: answer over {MAX_ANSWER_BYTES} bytes")
                if time.monotonic() > deadline:
                    raise RuntimeDownError(
                        f"{self.socket}: answer still incomplete after {4 * self._timeout:g} s"
                    )
            return response.status_code, bytes(body)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
