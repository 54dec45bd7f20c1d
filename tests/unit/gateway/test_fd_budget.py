"""The HTTP connection cap against the open-file limit (issue 24, item 10): with 1,024
descriptors and the default cap of 4,096, 1,100 idle HTTP clients used every descriptor
and agents could no longer log in."""

from __future__ import annotations

import resource

from cloud_gateway.fd_budget import RESERVE, http_cap

INF = resource.RLIM_INFINITY


class Limits:
    def __init__(self, soft: int, hard: int, *, settable: bool = True) -> None:
        self.soft, self.hard, self.settable = soft, hard, settable

    def get(self) -> tuple[int, int]:
        return self.soft, self.hard

    def set(self, limits: tuple[int, int]) -> None:
        if not self.settable:
            raise OSError("not permitted")
        self.soft, self.hard = limits


def test_a_small_soft_limit_is_raised_toward_the_hard_one() -> None:
    fds = Limits(1024, 1_048_576)
    assert http_cap(4096, get=fds.get, set_=fds.set) == (4096, None)
    assert fds.soft == 2 * 4096 + RESERVE


def test_an_unlimited_or_large_limit_changes_nothing() -> None:
    for soft, hard in ((INF, INF), (65_536, 65_536)):
        fds = Limits(soft, hard)
        assert http_cap(4096, get=fds.get, set_=fds.set) == (4096, None)
        assert fds.soft == soft


def test_too_few_descriptors_lowers_the_cap_and_says_what_to_raise() -> None:
    fds = Limits(1024, 1024)
    cap, warning = http_cap(4096, get=fds.get, set_=fds.set)
    assert cap == (1024 - RESERVE) // 2 == 480
    assert warning is not None
    assert "open-file limit 1024" in warning and "at most 480 HTTP connections" in warning
    assert f"raise the limit to at least {2 * 4096 + RESERVE}" in warning


def test_a_refused_raise_keeps_the_limit_and_lowers_the_cap() -> None:
    fds = Limits(1024, 1_048_576, settable=False)
    cap, warning = http_cap(4096, get=fds.get, set_=fds.set)
    assert cap == 480 and warning is not None and fds.soft == 1024
