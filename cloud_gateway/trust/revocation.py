"""The revocation list: nodes, keys and certificates the gateway refuses before they expire.

The file is ours (OpenSSH's binary KRL cannot name a node). UTF-8 text, one rule a line::

    # revoked 2025-11-22T05:30:00Z by ops@bastion: node edge-7
    node edge-7
    key SHA256:yY/RJUJYvE9MjTghOd7AGweBmuwTNCAOHUn2BY1Yhec
    serial 42
    keyid node:edge-9

=============================  ===========================================================
``node <name>``                every certificate for this node (its login name/principal)
``key SHA256:<fingerprint>``   every certificate for the agent key with this fingerprint,
                               exactly as ``ssh-keygen -lf edge-7.pub`` (or ``-cert.pub``)
                               prints it; this is what revoking a key or certificate file adds
``serial <n>``                 the certificate with this serial (decimal; serials are per CA)
``keyid <id>``                 certificates with this key id: the rest of the line, spaces
                               included (``ssh-keygen -I``; ours are ``node:<name>``)
=============================  ===========================================================

Lines starting with ``#`` (after optional blanks) are comments, blank lines are ignored;
there are no trailing comments, since a key id may contain ``#``. Any other line makes the
whole file invalid, with its line number in the message. A missing file is an empty list.

:class:`RevocationWatcher` gives the gateway the current list without a restart: it looks
at the file's identity, size and mtime at most every ``interval`` seconds and re-reads it
when they change. A malformed new version is logged (with the line number) and the last
good list stays in force; so does a file that disappears after it was loaded, since a
vanished file more likely means an editor or config tool mid-write than "forgive all".

Inside an event loop the watcher never touches the file on the loop's thread: a ``stat``
on a hung NFS mount or a Secret volume being swapped would stall every tunnel. It looks in
a worker thread instead, every ``interval`` seconds (a timer on the loop, so a change takes
effect within ``interval`` even if nobody logs in meanwhile) and when :meth:`current`
finds the last look ``interval`` old; logins in between get the list in force. At most one
look is in flight: one that hangs is reported once, and the next starts only after it ends.
The worker is a daemon thread, not the loop's executor, so a hung look cannot hold up the
gateway's exit. Outside a loop (the CLI, tests) :meth:`current` looks itself, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cloud_gateway.errors import RevocationFileError
from cloud_gateway.names import node_name_problem
from gpurelay.files import in_daemon_thread

log = logging.getLogger("cloud_gateway.revocation")

RuleKind = Literal["node", "key", "serial", "keyid"]
KINDS: tuple[RuleKind, ...] = ("node", "key", "serial", "keyid")

_FINGERPRINT = re.compile(r"SHA256:[A-Za-z0-9+/]{43}")
_MAX_SERIAL = 2**64 - 1


@dataclass(frozen=True)
class Rule:
    """One line of the list, e.g. ``Rule("node", "edge-7")``; ``str()`` gives the line."""

    kind: RuleKind
    value: str

    def __str__(self) -> str:
        return f"{self.kind} {self.value}"


def parse_rule(line: str) -> Rule:
    """The rule on one (non-comment) line; ValueError with a clear message otherwise."""
    keyword, _, rest = line.strip().partition(" ")
    value = rest.strip()
    if keyword not in KINDS:
        raise ValueError(f"unknown rule {keyword!r}: expected one of {', '.join(KINDS)}")
    if not value:
        raise ValueError(f"rule {keyword!r} needs a value")
    if keyword == "keyid":
        return Rule("keyid", value)
    if len(value.split()) > 1:
        raise ValueError(f"rule {keyword!r} takes exactly one value, got {value!r}")
    if keyword == "node":
        problem = node_name_problem(value)
        if problem is not None:
            raise ValueError(f"node name {value!r} is not a DNS-1123 label: {problem}")
        return Rule("node", value)
    if keyword == "key":
        return Rule("key", normalize_fingerprint(value))
    if not value.isdigit() or not value.isascii() or int(value) > _MAX_SERIAL:
        raise ValueError(f"serial {value!r} is not a decimal number from 0 to 2^64-1")
    return Rule("serial", str(int(value)))


def normalize_fingerprint(value: str) -> str:
    """``SHA256:<base64>`` as ``ssh-keygen -lf`` prints it (base64 padding is dropped)."""
    fingerprint = value.rstrip("=")
    if not _FINGERPRINT.fullmatch(fingerprint):
        raise ValueError(
            f"key {value!r} is not a SHA256 fingerprint as `ssh-keygen -lf` prints it "
            "(SHA256: followed by 43 base64 characters)"
        )
    return fingerprint


@dataclass(frozen=True)
class RevocationList:
    """The rules in force. ``RevocationList()`` is the empty list."""

    nodes: frozenset[str] = frozenset()
    keys: frozenset[str] = frozenset()
    serials: frozenset[int] = frozenset()
    key_ids: frozenset[str] = frozenset()

    @classmethod
    def load(cls, path: Path) -> RevocationList:
        """Read ``path``; a missing file is the empty list, a malformed one an error."""
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return cls()
        except (OSError, UnicodeDecodeError) as exc:
            detail = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise RevocationFileError(f"revocation file {path} cannot be read: {detail}") from exc
        return cls.parse(text, source=str(path))

    @classmethod
    def parse(cls, text: str, *, source: str = "<revocations>") -> RevocationList:
        return cls.from_rules(_parse_lines(text, source))

    @classmethod
    def from_rules(cls, rules: Iterable[Rule]) -> RevocationList:
        by_kind: dict[str, set[str]] = {kind: set() for kind in KINDS}
        for rule in rules:
            by_kind[rule.kind].add(rule.value)
        return cls(
            nodes=frozenset(by_kind["node"]),
            keys=frozenset(by_kind["key"]),
            serials=frozenset(int(s) for s in by_kind["serial"]),
            key_ids=frozenset(by_kind["keyid"]),
        )

    def __len__(self) -> int:
        return len(self.nodes) + len(self.keys) + len(self.serials) + len(self.key_ids)

    def __contains__(self, rule: object) -> bool:
        if not isinstance(rule, Rule):
            return False
        if rule.kind == "serial":
            return int(rule.value) in self.serials
        members: dict[str, frozenset[str]] = {
            "node": self.nodes,
            "key": self.keys,
            "keyid": self.key_ids,
        }
        return rule.value in members[rule.kind]

    def is_revoked(
        self,
        *,
        node: str | None = None,
        key_fingerprint: str | None = None,
        serial: int | None = None,
        key_id: str | None = None,
    ) -> str | None:
        """The rule that matches (as its line, e.g. ``"serial 42"``), or None."""
        if node is not None and node in self.nodes:
            return f"node {node}"
        if key_fingerprint is not None and key_fingerprint in self.keys:
            return f"key {key_fingerprint}"
        if serial is not None and serial in self.serials:
            return f"serial {serial}"
        if key_id is not None and key_id in self.key_ids:
            return f"keyid {key_id}"
        return None


def _parse_lines(text: str, source: str) -> Iterator[Rule]:
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            yield parse_rule(line)
        except ValueError as exc:
            raise RevocationFileError(f"{source}:{lineno}: {exc}") from None


# st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns: the inode catches an editor's rename,
# ctime a chmod that makes an unreadable file readable again.
_Signature = tuple[int, int, int, int, int]


class RevocationWatcher:
    """The revocation list in ``path``, re-read when the file changes (no restart needed).

    ``clock`` is a monotonic clock (``time.monotonic``; tests pass a fake). The file is
    read at construction, and a malformed file *then* raises :class:`RevocationFileError`:
    a gateway should not start while ignoring revocations.
    """

    def __init__(
        self,
        path: Path,
        clock: Callable[[], float] = time.monotonic,
        *,
        interval: float = 5.0,
    ) -> None:
        self.path = path
        self._clock = clock
        self._interval = interval
        self._seen = _signature(path)
        self._list = RevocationList.load(path)
        self._checked_at = clock()
        self._error: str | None = None
        self._looking: asyncio.Future[_Look] | None = None  # in a worker, since _checked_at
        self._hung: str | None = None  # that look is late, reported (once)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_loop: asyncio.AbstractEventLoop | None = None
        with contextlib.suppress(RuntimeError):  # no loop: current() looks itself
            self._arm(asyncio.get_running_loop())

    @property
    def last_error(self) -> str | None:
        """Why the newest version of the file is not in force, or None when it is."""
        return self._hung or self._error

    def current(self) -> RevocationList:
        """The list in force now; looks at the file when ``interval`` has passed (in a
        worker thread inside an event loop: this call never waits for the disk there)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is not None:
            self._arm(loop)
        if self._clock() - self._checked_at >= self._interval:
            if loop is None:
                self._checked_at = self._clock()
                self._apply(_look(self.path, self._seen))
            else:
                self._look_in_background()
        return self._list

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        """Look every ``interval`` on ``loop`` (once per loop: tests run several)."""
        if self._timer_loop is loop and self._timer is not None:
            return
        self._timer_loop = loop
        self._timer = loop.call_later(self._interval, self._tick, loop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = loop.call_later(self._interval, self._tick, loop)
        self._look_in_background()

    def _look_in_background(self) -> None:
        now = self._clock()
        looking = self._looking
        if looking is not None and not looking.get_loop().is_closed():  # one at a time
            self._report_hang(now - self._checked_at)
            return
        self._checked_at = now
        path, seen = self.path, self._seen
        self._looking = in_daemon_thread(lambda: _look(path, seen), name="revocation-look")
        self._looking.add_done_callback(self._looked)

    def _report_hang(self, waited: float) -> None:
        if self._hung is not None or waited < self._interval:
            return
        self._hung = f"revocation file {self.path} has not answered for {waited:.1f} s"
        log.error(
            "%s (a hung file system?); the %d rules loaded before stay in force, and the "
            "file is looked at again once it answers",
            self._hung,
            len(self._list),
        )

    def _looked(self, looking: asyncio.Future[_Look]) -> None:
        if looking is self._looking:
            self._looking = None
        if self._hung is not None:
            self._hung = None
            waited = self._clock() - self._checked_at
            log.warning("revocation file %s answered again after %.1f s", self.path, waited)
        if looking.cancelled():
            return
        error = looking.exception()
        if error is not None:  # a bug, not the file: the next look starts over
            log.error("revocation file %s could not be looked at", self.path, exc_info=error)
            return
        self._apply(looking.result())

    def _apply(self, found: _Look) -> None:
        if found.signature == self._seen:
            return
        if found.signature is None:
            self._seen = None
            self._error = f"revocation file {self.path} disappeared"
            log.error(
                "%s; the %d rules loaded before stay in force (restart to drop them)",
                self._error,
                len(self._list),
            )
            return
        self._seen = found.signature
        if found.fresh is None:
            self._error = found.error
            log.error(
                "%s; the last good revocation list (%d rules) stays in force",
                found.error,
                len(self._list),
            )
            return
        self._list = found.fresh
        self._error = None
        log.info("revocation list %s reloaded: %d rules", self.path, len(found.fresh))


@dataclass(frozen=True)
class _Look:
    """What a look at the file found: its signature and, when that changed, its list or
    why it cannot be used."""

    signature: _Signature | None
    fresh: RevocationList | None = None
    error: str | None = None


def _look(path: Path, seen: _Signature | None) -> _Look:
    """Stat ``path`` and read it if it changed since ``seen`` (blocking: a worker's job)."""
    signature = _signature(path)
    if signature == seen or signature is None:
        return _Look(signature)
    try:
        return _Look(signature, fresh=RevocationList.load(path))
    except RevocationFileError as exc:
        return _Look(signature, error=str(exc))


def _signature(path: Path) -> _Signature | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError:
        return (-1, -1, -1, -1, -1)  # not even stat-able: retried once that changes
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
