"""Two live connections with one node's certificate: a reconnect, or a stolen certificate.

An agent that reconnects before the gateway noticed its old connection died replaces it
once; that is ordinary. Two clients holding the same certificate replace each other again
and again: a security event. :class:`ConflictPolicy` decides what a new connection of a
node that is already connected gets, by ``ssh.duplicate_connection``:

- ``newest`` (the default): the new connection wins, the old one is closed. A flapping
  pair keeps evicting each other, so an operator must be told (below).
- ``oldest``: the connection already there wins; the newcomer is refused. An agent whose
  old connection died silently waits until the gateway's liveness check closes it.
- ``refuse_both``: at a fight (below) both are closed and the node is refused for
  ``hold_seconds``, so neither side can use the certificate until an operator looks
  (revoke the stolen one); a single replacement is handled as ``newest``.

Every replacement is counted. A *fight* is a replacement within ``fight_window_seconds``
of the previous one for the same node: counted as a conflict, logged once per episode
with both addresses, and kept on the node (API ``connection_conflicts``). An episode ends
after ``fight_window_seconds`` without one. Pure: the caller passes the time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from cloud_gateway.ssh.config import POLICIES

Policy = Literal["newest", "oldest", "refuse_both"]


@dataclass(frozen=True, slots=True)
class Verdict:
    admit: bool  # the new connection may go on
    close_old: bool  # the node's current connection must be closed
    fight: bool  # this is a conflict (count it)
    announce: bool  # the first conflict of an episode: log it, with both addresses
    reason: str  # for the refused side and the log


@dataclass(slots=True)
class _Episode:
    last_replacement: float
    in_fight: bool = False
    held_until: float = 0.0


class ConflictPolicy:
    def __init__(
        self, policy: Policy = "newest", *, fight_window: float = 60.0, hold: float = 300.0
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"duplicate_connection must be one of {', '.join(POLICIES)}")
        self.policy = policy
        self.fight_window = fight_window
        self.hold = hold
        self._episodes: dict[str, _Episode] = {}

    def held(self, node: str, now: float) -> bool:
        """Refused for now (``refuse_both`` after a conflict)."""
        episode = self._episodes.get(node)
        return episode is not None and now < episode.held_until

    def arrive(self, node: str, *, current: str | None, new: str, now: float) -> Verdict:
        """A connection of ``node`` from ``new``; ``current`` is the address of its live
        connection, ``None`` when it has none."""
        episode = self._episodes.get(node)
        if episode is not None and now < episode.held_until:
            return Verdict(False, False, False, False, self._held_reason(node, episode, now))
        if current is None:
            return Verdict(True, False, False, False, "")
        fight = episode is not None and now - episode.last_replacement <= self.fight_window
        announce = fight and not (episode is not None and episode.in_fight)
        if episode is None:
            episode = self._episodes[node] = _Episode(now)
        episode.last_replacement, episode.in_fight = now, fight
        if self.policy == "newest" or (self.policy == "refuse_both" and not fight):
            why = f"replaced by a newer connection from {new}"
            return Verdict(True, True, fight, announce, why)
        if self.policy == "oldest":
            why = (
                f"node {node} already has a live connection from {current} "
                "(ssh.duplicate_connection = oldest)"
            )
            return Verdict(False, False, fight, announce, why)
        episode.held_until = now + self.hold
        why = (
            f"two connections use node {node}'s certificate ({current} and {new}); both "
            f"refused for {self.hold:g}s (ssh.duplicate_connection = refuse_both)"
        )
        return Verdict(False, True, True, True, why)

    def _held_reason(self, node: str, episode: _Episode, now: float) -> str:
        return (
            f"node {node} is refused for {episode.held_until - now:.0f}s more after two "
            "connections used its certificate (ssh.duplicate_connection = refuse_both)"
        )
