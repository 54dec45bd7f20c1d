"""The gateway's own instruments that need a library: histograms, via ``prometheus-client``.

Two kinds of self-metrics, two tools, each where it serves:

- **Snapshots of counters and gauges** (batches, bytes, nodes by state, remote write
  stats, ...) are built fresh from the stages' stats on each refresh by
  :mod:`cloud_gateway.metrics` — the custom-collector pattern of
  ``prometheus_client`` — in our own :class:`~gpurelay.model.Family` type, so they share
  the one renderer (and its OpenMetrics rule for counters) with the fleet's series.
- **Distributions** (how long a batch takes to apply, how long a proxied scrape takes)
  need bucket arithmetic that the library does well; they live here, in a private
  :class:`prometheus_client.CollectorRegistry` (never the process-global one), and
  :meth:`SelfMetrics.render` puts them after the cached fleet blocks in ``/metrics``.

``_created`` series are not written (:func:`prometheus_client.disable_created_metrics`):
neither the gateway's other counters nor dcgm-exporter's have them, and a scrape that
suddenly grew one family per histogram would only confuse dashboards.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Final

import prometheus_client
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]

# Applying a batch is sub-millisecond for a typical node; a replayed record of a large node
# or a busy event loop takes longer.
APPLY_BUCKETS: Final = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 1.0)
# A scrape through a tunnel crosses an edge uplink: tens of ms to the scrape timeout.
PROXY_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_EOF: Final = b"# EOF\n"
_STANDARD_STATUSES: Final = frozenset(int(s) for s in HTTPStatus)


class SelfMetrics:
    """The gateway's histograms, in a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.apply_seconds = Histogram(
            "gpurelay_gateway_frame_apply_seconds",
            "Time to take one BATCH or REPLAY frame: decode, registry update, delivery.",
            ["frame"],
            buckets=APPLY_BUCKETS,
            registry=self.registry,
        )
        self.proxy_seconds = Histogram(
            "gpurelay_gateway_proxy_request_seconds",
            "Time to answer a scrape relayed through a tunnel by node name, by HTTP status.",
            ["code"],
            buckets=PROXY_BUCKETS,
            registry=self.registry,
        )

    def observe_apply(self, frame: str, seconds: float) -> None:
        self.apply_seconds.labels(frame).observe(seconds)

    def observe_proxy(self, code: int, seconds: float) -> None:
        """``code`` is what a node's endpoint answered: a status outside the standard set
        counts as ``other``, so no endpoint can add series (issue 12)."""
        label = str(code) if code in _STANDARD_STATUSES else "other"
        self.proxy_seconds.labels(label).observe(seconds)

    def render(self, *, openmetrics: bool) -> bytes:
        """The histograms in the text format or in OpenMetrics (without its ``# EOF``:
        the exposition ends the whole body)."""
        if not openmetrics:
            return prometheus_client.generate_latest(self.registry)
        body: bytes = generate_openmetrics(self.registry)  # type: ignore[no-untyped-call]
        return body[: -len(_EOF)] if body.endswith(_EOF) else body
