"""Reading one sysfs, procfs or debugfs file, as the Jetson readers need it.

A value file of the kernel is one line (device-tree strings end in NUL). A read that
fails is not an exception for the caller: :func:`read_text` returns a :class:`Missing`
with the reason (absent, permission, I/O error, not a number), which the reader keeps
beside what it could read.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class JetsonRoots:
    """Where a Jetson's files are read: the host's, or a fixture's (tests, --simulate)."""

    sys_root: Path
    proc_root: Path
    etc_root: Path
    var_root: Path

    @classmethod
    def under(cls, host_root: Path) -> JetsonRoots:
        """``host_root``'s sys/, proc/, etc/ and var/ (``/`` on the host)."""
        return cls(host_root / "sys", host_root / "proc", host_root / "etc", host_root / "var")


@dataclass(frozen=True, slots=True)
class Missing:
    """A file the reader wanted and could not use, and why."""

    path: Path
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


def read_bytes(path: Path) -> bytes | Missing:
    """The file's bytes, or why not."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return Missing(path, "absent")
    except PermissionError:
        return Missing(path, "permission denied")
    except IsADirectoryError:
        return Missing(path, "a directory, not a file")
    except OSError as exc:
        # sysfs answers EIO, ENODEV or EAGAIN for a powered-down or rail-gated block
        name = errno.errorcode.get(exc.errno or 0, "error")
        return Missing(path, f"unreadable ({name})")


def read_text(path: Path, *, first_line: bool = True) -> str | Missing:
    """The file's text (its first line, NULs and whitespace stripped), or why not."""
    raw = read_bytes(path)
    if isinstance(raw, Missing):
        return raw
    text = raw.decode("utf-8", "replace")
    if first_line:
        text = text.split("\n", 1)[0]
    return text.replace("\x00", "").strip()


def read_int(path: Path) -> int | Missing:
    """An integer file (sysfs writes base 10; a trailing unit word is ignored, as some
    drivers print ``32760 ma``)."""
    text = read_text(path)
    if isinstance(text, Missing):
        return text
    tokens = text.split()
    try:
        return int(tokens[0] if tokens else "")
    except ValueError:
        return Missing(path, f"not an integer: {text[:40]!r}")


def read_value(path: Path, missing: list[Missing]) -> int | None:
    """:func:`read_int`, with why not appended to ``missing`` (None then)."""
    value = read_int(path)
    if isinstance(value, Missing):
        missing.append(value)
        return None
    return value


def read_count(path: Path, missing: list[Missing]) -> int | None:
    """:func:`read_value` of a quantity that cannot be negative (a clock, a count): a
    negative one is garbled, and left out like an unreadable one."""
    value = read_value(path, missing)
    if value is not None and value < 0:
        missing.append(Missing(path, f"negative: {value}"))
        return None
    return value


def rooted(root: Path, path: Path, *, hops: int = 16) -> Path:
    """``path`` under ``root`` (a host's ``/`` seen from a pod, or a fixture's tree), its
    symlinks followed as the host follows them: an absolute target is the host's, so it is
    taken under ``root`` too (``/proc/device-tree`` -> ``/sys/firmware/devicetree/base``,
    L4T's ``/etc/nvpmodel.conf`` -> ``/etc/nvpmodel/...``). The same path where ``root``
    is ``/``; where the chain is too long or leaves ``root``, the path as given."""
    try:
        parts = path.relative_to(root).parts
    except ValueError:
        return path
    current = root
    for part in parts:
        current = current / part
        for _ in range(hops):
            if not current.is_symlink():
                break
            try:
                target = Path(os.readlink(current))
            except OSError:
                return path
            current = (
                root / target.relative_to("/")
                if target.is_absolute()
                else (current.parent / target)
            )
        else:
            return path
    return current
