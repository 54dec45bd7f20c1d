"""gpurelay.files.write_atomic: a link planted where it writes its temporary file is never
followed (issue 24, item 10)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from gpurelay import files
from gpurelay.files import write_atomic


def test_a_planted_link_at_the_temporary_name_is_not_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The name was ``.NAME.PID.tmp``, opened without O_EXCL or O_NOFOLLOW: whoever could
    write the directory planted a link there and got the key written through it."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    target = tmp_path / "node.key"
    names = iter(["aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb"])
    monkeypatch.setattr(files.secrets, "token_hex", lambda n: next(names))
    for planted in (f".node.key.{os.getpid()}.tmp", ".node.key.aaaaaaaaaaaaaaaa.tmp"):
        (tmp_path / planted).symlink_to(victim)
    write_atomic(target, b"secret key", 0o600)
    assert victim.read_bytes() == b"precious"
    assert target.read_bytes() == b"secret key"
    assert stat.S_IMODE(target.lstat().st_mode) == 0o600 and not target.is_symlink()
    assert not (tmp_path / ".node.key.bbbbbbbbbbbbbbbb.tmp").exists()  # renamed into place


def test_the_temporary_name_is_not_guessable(tmp_path: Path) -> None:
    seen: set[str] = set()
    real_open = os.open

    def spy(path: object, flags: int, mode: int = 0o777) -> int:
        name = Path(str(path)).name
        if name.endswith(".tmp"):
            seen.add(name)
            assert flags & os.O_EXCL and flags & os.O_NOFOLLOW
        return real_open(path, flags, mode)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(files.os, "open", spy)
        write_atomic(tmp_path / "a", b"1", 0o644)
        write_atomic(tmp_path / "a", b"2", 0o644)
    temps = sorted(seen)
    assert len(temps) == 2 and temps[0] != temps[1]
    assert all(str(os.getpid()) not in n for n in temps)
