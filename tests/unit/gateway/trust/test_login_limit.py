"""The enrollment login limiter's token buckets, on a clock the test moves."""

from __future__ import annotations

import logging

import pytest

from cloud_gateway.trust.login_limit import LoginLimiter


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_each_address_has_its_burst_then_its_rate() -> None:
    clock = Clock()
    limiter = LoginLimiter(per_address_burst=3, per_address_rate=0.5, clock=clock)
    assert [limiter.allow("10.0.0.1") for _ in range(3)] == [None, None, None]
    assert limiter.allow("10.0.0.1") == "over 3 logins at once and 0.5/s from 10.0.0.1"
    assert limiter.allow("10.0.0.2") is None  # another address has its own bucket
    clock.now += 1.0  # half a login
    assert limiter.allow("10.0.0.1") is not None
    clock.now += 1.0
    assert limiter.allow("10.0.0.1") is None
    assert limiter.allow("10.0.0.1") is not None
    clock.now += 3600  # refilled to the burst, not beyond
    assert [limiter.allow("10.0.0.1") for _ in range(4)][-1] is not None


def test_the_whole_gateway_has_a_bound_too() -> None:
    clock = Clock()
    limiter = LoginLimiter(global_burst=5, global_rate=1.0, clock=clock)
    assert all(limiter.allow(f"10.0.0.{n}") is None for n in range(5))
    why = limiter.allow("10.0.0.9")
    assert why == "over 5 logins at once and 1/s for the whole gateway"
    clock.now += 1.0
    assert limiter.allow("10.0.0.9") is None


def test_a_refused_login_costs_no_token() -> None:
    clock = Clock()
    limiter = LoginLimiter(per_address_burst=1, per_address_rate=0, global_burst=2, clock=clock)
    assert limiter.allow("a") is None
    for _ in range(10):  # over its own bound: the gateway's bucket is not drained
        assert limiter.allow("a") is not None
    assert limiter.allow("b") is None


def test_the_addresses_kept_are_bounded() -> None:
    limiter = LoginLimiter(per_address_burst=1, per_address_rate=0, max_addresses=3)
    for n in range(10):
        assert limiter.allow(f"10.0.0.{n}") is None
    assert len(limiter._addresses) == 3
    assert limiter.allow("10.0.0.9") is not None  # the most recent ones are kept


def test_refusals_are_logged_throttled(caplog: pytest.LogCaptureFixture) -> None:
    limiter = LoginLimiter()
    limiter.log_every = 3600
    with caplog.at_level(logging.INFO):
        for _ in range(5):
            limiter.log_refusal("enroll:edge-1", "over it")
        limiter.log_every = 0
        limiter._log._next = 0.0  # the hour is over
        limiter.log_refusal("enroll:edge-1", "over it")
    assert [r.getMessage() for r in caplog.records] == [
        "refused the enrollment login 'enroll:edge-1': too many logins, over it",
        "refused the enrollment login 'enroll:edge-1': too many logins, over it "
        "(and 4 more like it since the last such line)",
    ]
    assert {r.levelno for r in caplog.records} == {logging.WARNING}
