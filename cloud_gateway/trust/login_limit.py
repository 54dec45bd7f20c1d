"""How many password (enrollment) logins the gateway checks: token buckets per source
address and for the whole gateway.

Each ``enroll:NODE`` login costs a signature check and a read of the node directory, and
asyncssh lets a client try password after password. :class:`LoginLimiter` bounds that
before any of it runs: a login over either bucket is refused as ``enroll_throttled``
(``gpurelay_gateway_auth_failures_total``), and the refusals are logged at most once per
``log_every`` seconds, with the count of those left out. The address is the client's as
the SSH server sees it: with ``ssh.proxy_protocol`` the one in the balancer's header.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from gpurelay.logs import Throttled

log = logging.getLogger("cloud_gateway.enrollment")

# An enrollment is one login per node, ever (plus a retry or two): these let a site behind
# one NAT address enroll a node a second, and a whole fleet about 20 a second.
PER_ADDRESS_BURST: Final = 10
PER_ADDRESS_RATE: Final = 1.0  # logins per second, refilled
GLOBAL_BURST: Final = 100
GLOBAL_RATE: Final = 20.0
MAX_ADDRESSES: Final = 10_000  # buckets kept; the least recently seen go first
LOG_EVERY_SECONDS: Final = 10.0


@dataclass
class Bucket:
    rate: float  # tokens per second
    burst: float  # at most this many, and full at first
    tokens: float
    stamp: float

    def refill(self, now: float) -> None:
        self.tokens = min(self.burst, self.tokens + max(0.0, now - self.stamp) * self.rate)
        self.stamp = now


class LoginLimiter:
    def __init__(
        self,
        *,
        per_address_burst: float = PER_ADDRESS_BURST,
        per_address_rate: float = PER_ADDRESS_RATE,
        global_burst: float = GLOBAL_BURST,
        global_rate: float = GLOBAL_RATE,
        max_addresses: int = MAX_ADDRESSES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.per_address = (per_address_rate, per_address_burst)
        self.max_addresses = max_addresses
        self.clock = clock
        self._log = Throttled(log, logging.WARNING, LOG_EVERY_SECONDS)
        now = clock()
        self._global = Bucket(global_rate, global_burst, global_burst, now)
        self._addresses: OrderedDict[str, Bucket] = OrderedDict()

    def allow(self, address: str) -> str | None:
        """Take one login for ``address``: None if allowed, else which limit it is over."""
        now = self.clock()
        bucket = self._addresses.get(address)
        if bucket is None:
            rate, burst = self.per_address
            bucket = self._addresses[address] = Bucket(rate, burst, burst, now)
            while len(self._addresses) > self.max_addresses:
                self._addresses.popitem(last=False)
        else:
            self._addresses.move_to_end(address)
            bucket.refill(now)
        self._global.refill(now)
        if bucket.tokens < 1:
            rate, burst = self.per_address
            return f"over {burst:g} logins at once and {rate:g}/s from {address}"
        if self._global.tokens < 1:
            return (
                f"over {self._global.burst:g} logins at once and {self._global.rate:g}/s "
                "for the whole gateway"
            )
        bucket.tokens -= 1
        self._global.tokens -= 1
        return None

    @property
    def log_every(self) -> float:
        """Seconds between two lines about refused logins (the rest are counted)."""
        return self._log.every

    @log_every.setter
    def log_every(self, seconds: float) -> None:
        self._log.every = seconds

    def log_refusal(self, username: str, why: str) -> None:
        """One WARNING per ``log_every`` seconds at most, counting the ones left out."""
        self._log("refused the enrollment login %r: too many logins, %s", username, why)
