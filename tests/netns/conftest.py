"""The ``uplink`` fixture: the edge in its own network namespace behind a middlebox
(:mod:`harness.netns`). Skips with the reason where namespaces cannot be made (not root, no
iproute2 or iptables); fails instead when CI sets EDGE_GPU_RELAY_REQUIRE_NETNS=1."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from harness.netns import Uplink, netns_unavailable

REQUIRE = "EDGE_GPU_RELAY_REQUIRE_NETNS"


@pytest.fixture
def netns_ok() -> None:
    """Skip (or fail, under CI) unless network namespaces can be made here."""
    reason = netns_unavailable()
    if reason is None:
        return
    msg = f"{reason}; the netns tests need root, iproute2 and iptables"
    if os.environ.get(REQUIRE) == "1":
        pytest.fail(f"{msg}; {REQUIRE}=1 makes this a failure")
    pytest.skip(msg)


@pytest.fixture
def uplink(netns_ok: None) -> Iterator[Uplink]:
    with Uplink() as link:
        yield link
