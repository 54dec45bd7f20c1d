"""The agent's exception hierarchy.

Foreign exceptions (pynvml, OSError, httpx) are translated into these at the boundary
where they happen, so the CLI can print one clear line instead of a traceback.
"""

from __future__ import annotations


class AgentError(Exception):
    """Base class for every error the agent reports to a user."""


class ConfigError(AgentError):
    """The configuration file or an EDGE_AGENT_* variable is invalid."""


class CountersFileError(ConfigError):
    """The dcgm-exporter counters CSV cannot be read or parsed."""


class NvmlUnavailable(AgentError):
    """NVML cannot be used on this machine (no driver, no library, no permission)."""


class PodResourcesError(AgentError):
    """The kubelet's pod-resources API did not answer ``List``; ``reason`` is a short token
    for the error counter (``unavailable``, ``deadline_exceeded``, …)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
