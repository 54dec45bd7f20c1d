"""Joining a cluster under a gateway id another process may hold (issue 16 follow-up).

Operators copy a config file with ``gateway_id`` set, or run two pods with one hostname
(the default id). Two processes under one id would claim the same nodes under one name,
and a start releases every node naming its id (what an earlier run held): the second
start would take the first's nodes away. So at join, the id's row in the directory
(:mod:`cloud_gateway.cluster.members`) is judged (:func:`judge`):

- no row, a row of this process, or one without an instance (an older gateway, or a
  clean stop): taken;
- a row of another instance silent for ``ttl`` or more: an earlier run that died, taken
  (the others treat it as gone already);
- a row of another instance still heartbeating (its heartbeat moved while this one
  watched, or another instance took the row meanwhile): refused (:func:`refusal`), and
  nothing is written;
- a row of another instance fresh but not seen to move yet: watched until it moves or
  goes stale (at most ``ttl``): a gateway restarted right after a crash waits for its own
  old row instead of being refused.

A running gateway whose heartbeat finds another instance on its row fences itself
(:class:`cloud_gateway.cluster.membership.Cluster`, with :func:`conflict` as the reason)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Literal

from cloud_gateway.cluster.members import DuplicateGateway, Holder, PgMembers

log = logging.getLogger("cloud_gateway.cluster")

Verdict = Literal["take", "wait", "refuse"]


def judge(found: Holder | None, *, instance: str, ttl: float, first: Holder | None) -> Verdict:
    """What to do with the id's row ``found`` (``first``: as this start first found it,
    when it had to wait)."""
    if found is None or found.instance in ("", instance) or found.age >= ttl:
        return "take"
    if first is not None and (found.instance, found.heartbeat) != (first.instance, first.heartbeat):
        return "refuse"  # it heartbeats (or another start took the row): alive
    return "wait"


def refusal(gateway: str, holder: Holder) -> str:
    return (
        f"gateway id {gateway!r} is in use: a running gateway holds it (instance "
        f"{holder.instance}, peer address {holder.advertise}, heartbeat {holder.age:.1f}s ago). "
        "Two gateways must not share an id; its nodes were left alone. Give this gateway an "
        "id of its own: set [cluster] gateway_id in its config (unset, it is the hostname: "
        "two machines or pods with one hostname collide)"
    )


def conflict(gateway: str, *, instance: str, advertise: str, holder: Holder, nodes: int) -> str:
    return (
        f"gateway id {gateway!r} is now held by another gateway (instance {holder.instance} "
        f"at {holder.advertise}, heartbeat {holder.age:.1f}s ago); this one is instance "
        f"{instance} at {advertise}. Two gateways share this id: this one lets its {nodes} "
        "node(s) go and takes no claims while the other holds the id; give one of them its "
        "own [cluster] gateway_id (unset, it is the hostname)"
    )


async def join(
    directory: PgMembers,
    *,
    advertise: str,
    ttl: float,
    poll: float,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> Holder | None:
    """Take this id's row (:func:`judge`), or DuplicateGateway. The row's holder before
    when it was another instance's (an earlier run that died), else None."""
    first: Holder | None = None
    while True:
        decide = partial(judge, instance=directory.instance, ttl=ttl, first=first)
        verdict, found = await directory.try_join(advertise, decide)
        if verdict == "take":
            if found is None or found.instance in ("", directory.instance):
                return None
            log.warning(
                "cluster: gateway %s takes over from instance %s at %s, silent for %.1fs "
                "(an earlier run that died)",
                directory.gateway,
                found.instance,
                found.advertise,
                found.age,
            )
            return found
        assert found is not None  # "take" when there is no row
        if verdict == "refuse":
            raise DuplicateGateway(refusal(directory.gateway, found), found)
        if first is None:
            first = found
            log.warning(
                "cluster: gateway id %s is held by instance %s at %s (heartbeat %.1fs ago): "
                "waiting up to %.1fs to tell a live gateway with this id (refused) from an "
                "earlier run that died (taken over)",
                directory.gateway,
                found.instance,
                found.advertise,
                found.age,
                ttl - found.age,
            )
        await sleep(max(0.05, min(poll, ttl - found.age)))
