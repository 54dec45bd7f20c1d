"""Which Docker Engine / Podman API sockets to ask about a container: the configured paths,
and the per-user sockets of rootless runtimes found by pattern.

An entry of ``[attribution] runtime_sockets`` with a glob character (``*``, ``?``, ``[``) is
a pattern. The defaults have two, for the sockets rootless runtimes open in a user's
``$XDG_RUNTIME_DIR``: ``/run/user/*/podman/podman.sock`` (``systemctl --user enable --now
podman.socket``) and ``/run/user/*/docker.sock`` (rootless Docker). Patterns are expanded
when the agent starts and again at most once per ``refresh`` seconds, when a container is
looked up (so a user who logs in later is found); at most ``limit`` sockets, in path order.

A socket found by pattern belongs to a user, and a user's runtime is trusted only about
that user's containers: it is asked only about a container whose cgroup sits under that
user's systemd manager (``user@<uid>.service``, :attr:`CgroupRef.owner_uid`), never about
another user's or a rootful one, so no user can rename anyone else's containers. Only a
real socket counts, never a symlink, and its owner is checked again before each request
(:class:`EngineClient` ``owner``). Root-owned sockets found by pattern and configured paths
are asked about every container, as before.

The agent can only find what it may enter: ``/run/user/<uid>`` is mode 0700, so this needs
the agent to run as root (the packaged systemd unit runs as its own user with
``ProtectHome=yes``, which hides ``/run/user``; see the README). A directory it may not
enter is logged once, not per lookup.
"""

from __future__ import annotations

import fnmatch
import logging
import math
import os
import stat
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from edge_agent.attribute.runtime_api import EngineClient

__all__ = ["MAX_FOUND_SOCKETS", "RuntimeSockets", "is_pattern"]

_log = logging.getLogger(__name__)

MAX_FOUND_SOCKETS = 64  # sockets kept from patterns; more are logged and left out
_MAX_DIRECTORIES = 4096  # directories one scan may list, whatever the patterns match
_GLOB_CHARS = frozenset("*?[")


def is_pattern(path: Path | str) -> bool:
    return any(c in _GLOB_CHARS for c in str(path))


class RuntimeSockets:
    """The engines to ask, per container owner; patterns rescanned at most every ``refresh``."""

    def __init__(
        self,
        configured: Sequence[Path],
        *,
        timeout: float,
        refresh: float,
        clock: Callable[[], float] = time.monotonic,
        limit: int = MAX_FOUND_SOCKETS,
    ) -> None:
        self._timeout = timeout
        self._refresh = refresh
        self._clock = clock
        self._limit = limit
        self._fixed = tuple(
            EngineClient(path, timeout=timeout) for path in configured if not is_pattern(path)
        )
        self._patterns = tuple(str(path) for path in configured if is_pattern(path))
        self._found: dict[Path, EngineClient] = {}  # by path; client.owner is its uid
        self._told: set[str] = set()  # what was logged once already
        self._scan_at = -math.inf
        self.rescan()

    def for_container(self, owner_uid: int | None) -> list[EngineClient]:
        """The engines that may name a container of ``owner_uid`` (``None``: not a user's),
        in the order to ask them: the owner's own sockets first."""
        if self._patterns and self._clock() >= self._scan_at:
            self.rescan()
        own = [c for c in self._found.values() if owner_uid is not None and c.owner == owner_uid]
        roots = [c for c in self._found.values() if c.owner == 0 and owner_uid != 0]
        return [*own, *self._fixed, *roots]

    def rescan(self) -> None:
        """Expand the patterns now; keep the clients of sockets still there."""
        self._scan_at = self._clock() + self._refresh
        if not self._patterns:
            return
        fixed = {client.socket for client in self._fixed}
        found: dict[Path, int] = {}
        skipped = 0
        budget = [_MAX_DIRECTORIES]
        for pattern in self._patterns:
            for path in _expand(Path(pattern), budget, self._tell_once):
                if path in fixed or path in found:
                    continue
                owner = _socket_owner(path, self._tell_once)
                if owner is None:
                    continue
                if len(found) >= self._limit:
                    skipped += 1
                    continue
                found[path] = owner
        if skipped:
            self._tell_once(
                f"runtime sockets: {skipped} more socket(s) matched than the {self._limit} "
                "kept; their containers get no container_name",
                logging.WARNING,
            )
        if budget[0] <= 0:
            self._tell_once(
                f"runtime sockets: the patterns reach more than {_MAX_DIRECTORIES} "
                "directories; the scan stopped there",
                logging.WARNING,
            )
        self._replace(found)

    def close(self) -> None:
        for client in (*self._fixed, *self._found.values()):
            client.close()
        self._found = {}

    # -- helpers ----------------------------------------------------------------------

    def _replace(self, found: dict[Path, int]) -> None:
        old = self._found
        self._found = {}
        for path, owner in sorted(found.items()):
            client = old.pop(path, None)
            if client is None or client.owner != owner:
                if client is not None:
                    client.close()
                client = EngineClient(path, timeout=self._timeout, owner=owner)
                _log.info("runtime socket found: %s (uid %d)", str(path), owner)
            self._found[path] = client
        for path, client in old.items():
            _log.info("runtime socket gone: %s", str(path))
            client.close()

    def _tell_once(self, message: str, level: int = logging.INFO) -> None:
        if message not in self._told:
            self._told.add(message)
            _log.log(level, "%s", message)


def _socket_owner(path: Path, tell: Callable[[str], None]) -> int | None:
    """The uid owning ``path`` if it is a socket itself (not a symlink to one), else None."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:  # typically /run/user/<uid> (0700) for an agent that is not root
        tell(f"runtime sockets: cannot look at {path} ({exc.strerror or exc})")
        return None
    return st.st_uid if stat.S_ISSOCK(st.st_mode) else None


def _expand(pattern: Path, budget: list[int], tell: Callable[[str], None]) -> Iterator[Path]:
    """Paths matching ``pattern``, segment by segment, in name order; a directory that
    cannot be listed is told (once) and skipped; at most ``budget[0]`` directories listed."""
    parts = pattern.parts
    bases = [Path(parts[0])]
    for part in parts[1:]:
        if not is_pattern(part):
            bases = [base / part for base in bases]
            continue
        matched: list[Path] = []
        for base in bases:
            if budget[0] <= 0:
                break
            budget[0] -= 1
            try:
                with os.scandir(base) as entries:
                    names = sorted(e.name for e in entries if fnmatch.fnmatchcase(e.name, part))
            except (FileNotFoundError, NotADirectoryError):
                continue
            except OSError as exc:
                tell(
                    f"runtime sockets: cannot list {base} ({exc.strerror or exc}); sockets "
                    f"matching {pattern} below it are not found"
                )
                continue
            matched.extend(base / name for name in names)
        bases = matched
    yield from bases
