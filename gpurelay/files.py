"""Files both binaries replace whole: a node's key and certificate on the agent, the CA's
serial counter, certificates and known_hosts on the gateway's side."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: Path, data: bytes, mode: int) -> None:
    """Replace ``path`` by ``data`` with ``mode`` so that a reader sees the old file or the
    new one, never half of either, even across a crash: a temporary file in the same
    directory (``mode`` from its first byte), fsync, rename, fsync of the directory."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fchmod(handle.fileno(), mode)  # O_CREAT's mode passed through the umask
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    sync_dir(path.parent)


def sync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (best effort where a directory cannot be
    opened for that)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
