"""``[registry]``: node liveness and the node label, owned here, assembled by
:mod:`cloud_gateway.config`; the store's own :class:`~cloud_gateway.registry.types.StoreConfig`
is built from it in ``app.py``."""

from __future__ import annotations

from dataclasses import dataclass

from cloud_gateway.errors import GatewayConfigError


@dataclass(frozen=True, slots=True, kw_only=True)
class LivenessPolicy:
    stale_after_intervals: float = 3.0
    offline_after_intervals: float = 6.0
    margin_seconds: float = 2.0

    def __post_init__(self) -> None:
        if not self.stale_after_intervals > 0:
            raise ValueError("stale_after_intervals must be > 0")
        if not self.offline_after_intervals > self.stale_after_intervals:
            raise ValueError("offline_after_intervals must be more than stale_after_intervals")
        if not self.margin_seconds >= 0:
            raise ValueError("margin_seconds must be >= 0")


@dataclass(frozen=True, kw_only=True)
class RegistryConfig:
    """``[registry]``: node liveness. The store's own
    :class:`~cloud_gateway.registry.store.StoreConfig` is built from it in ``app.py``."""

    # A connected node is stale (late; gpurelay_node_up 0) after this many of its intervals
    # plus the margin without a batch; its connection is closed (offline) after
    # offline_after_intervals plus the margin with nothing received at all. The margin is
    # margin_seconds or twice the lateness the node's own link showed lately, the larger.
    stale_after_intervals: float = 3.0
    offline_after_intervals: float = 6.0
    margin_seconds: float = 2.0
    offline_grace_seconds: float = 300.0
    # The label naming the node on device series and on gpurelay_node_*: "Hostname"
    # (dcgm-exporter up to 4.8) or "hostname" (its next release, PR #655). Stamped from
    # the node's certificate whatever the agent sent; an agent's other spelling is
    # renamed (cloud_gateway.registry.node_labels). Prometheus relabelling: deploy/prometheus.
    node_label: str = "Hostname"

    def liveness(self) -> LivenessPolicy:
        try:
            return LivenessPolicy(
                stale_after_intervals=self.stale_after_intervals,
                offline_after_intervals=self.offline_after_intervals,
                margin_seconds=self.margin_seconds,
            )
        except ValueError as exc:
            raise GatewayConfigError(f"registry: {exc}") from exc
