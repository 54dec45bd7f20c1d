"""A node's latest series under either of dcgm-exporter's naming schemes (gpurelay.naming).

What the gateway derives from the DCGM series (the operator page, the BIE document) is
written against 4.8's names and units. A node whose agent publishes 4.9's names (such as
``DCGM_FI_DEV_FB_USED_BYTES`` for ``DCGM_FI_DEV_FB_USED``) is read the same: its series are
found under the 4.9 name and turned back into 4.8's unit (bytes into MiB, a ratio into %).
"""

from __future__ import annotations

from typing import Protocol

from gpurelay.model import Labels
from gpurelay.naming import by_old


class Latest(Protocol):
    """What is read of the registry (:class:`cloud_gateway.registry.store.Registry`)."""

    def latest(self, node: str, family: str) -> list[tuple[Labels, float]]: ...


def latest(registry: Latest, node: str, family: str) -> list[tuple[Labels, float]]:
    """``node``'s latest series of ``family`` (a 4.8 name), under 4.8's or 4.9's name, in
    4.8's unit."""
    rows = registry.latest(node, family)
    rename = by_old().get(family)
    if rename is None:
        return rows
    return rows + [(labels, rename.to_old(v)) for labels, v in registry.latest(node, rename.new)]
