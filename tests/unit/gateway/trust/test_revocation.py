"""The revocation list format, and reloading it without a restart."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path

import asyncssh
import pytest

from cloud_gateway.errors import RevocationFileError
from cloud_gateway.trust.revocation import RevocationList, RevocationWatcher, Rule, parse_rule

SSH_KEYGEN = shutil.which("ssh-keygen")
FP = "SHA256:yY/RJUJYvE9MjTghOd7AGweBmuwTNCAOHUn2BY1Yhec"

SAMPLE = f"""\
# revoked 2025-11-22T05:30:00Z by ops@bastion: node edge-7
node edge-7

  # indented comment
key {FP}
serial 42
keyid node:edge-9 # not a comment: key ids may hold '#'
"""
HASH_TAIL = "# not a comment: key ids may hold '#'"


def test_parse_every_rule_kind() -> None:
    revoked = RevocationList.parse(SAMPLE)
    assert revoked.nodes == {"edge-7"}
    assert revoked.keys == {FP}
    assert revoked.serials == {42}
    assert revoked.key_ids == {f"node:edge-9 {HASH_TAIL}"}
    assert len(revoked) == 4


@pytest.mark.parametrize(
    ("query", "rule"),
    [
        ({"node": "edge-7"}, "node edge-7"),
        ({"key_fingerprint": FP}, f"key {FP}"),
        ({"serial": 42}, "serial 42"),
        ({"key_id": f"node:edge-9 {HASH_TAIL}"}, f"keyid node:edge-9 {HASH_TAIL}"),
        ({"node": "edge-8", "key_fingerprint": "SHA256:x", "serial": 41, "key_id": "x"}, None),
        ({"node": "edge-8", "serial": 42}, "serial 42"),
    ],
)
def test_is_revoked_says_which_rule(query: dict[str, object], rule: str | None) -> None:
    revoked = RevocationList.parse(SAMPLE)
    assert revoked.is_revoked(**query) == rule  # type: ignore[arg-type]


def test_keyid_takes_the_rest_of_the_line() -> None:
    revoked = RevocationList.parse("keyid  laptop of Jane Doe  \n")
    assert revoked.is_revoked(key_id="laptop of Jane Doe") == "keyid laptop of Jane Doe"


def test_empty_and_missing() -> None:
    assert len(RevocationList()) == 0
    assert RevocationList().is_revoked(node="edge-1", serial=1) is None
    assert len(RevocationList.parse("# nothing yet\n\n")) == 0


def test_missing_file_is_an_empty_list(tmp_path: Path) -> None:
    assert len(RevocationList.load(tmp_path / "revocations")) == 0


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("nodes edge-1", "unknown rule 'nodes': expected one of node, key, serial, keyid"),
        ("node", "rule 'node' needs a value"),
        ("node Edge-1", "node name 'Edge-1' is not a DNS-1123 label"),
        ("node edge-1 edge-2", "rule 'node' takes exactly one value"),
        ("key MD5:aa:bb", "is not a SHA256 fingerprint as `ssh-keygen -lf` prints it"),
        ("key SHA256:short", "is not a SHA256 fingerprint"),
        ("serial -1", "serial '-1' is not a decimal number from 0 to 2^64-1"),
        ("serial 18446744073709551616", "is not a decimal number from 0 to 2^64-1"),
        ("serial \uff14\uff12", "is not a decimal number"),  # fullwidth digits
    ],
)
def test_malformed_lines_are_errors_with_line_numbers(
    tmp_path: Path, line: str, message: str
) -> None:
    path = tmp_path / "revocations"
    path.write_text(f"# header\nnode edge-1\n{line}\n", encoding="utf-8")
    with pytest.raises(RevocationFileError) as raised:
        RevocationList.load(path)
    assert str(raised.value).startswith(f"{path}:3: ")
    assert message in str(raised.value)


def test_fingerprint_padding_is_tolerated() -> None:
    assert parse_rule(f"key {FP}=") == Rule("key", FP)
    assert str(parse_rule("serial 007")) == "serial 7"


def test_rules_are_members() -> None:
    revoked = RevocationList.parse(SAMPLE)
    assert Rule("node", "edge-7") in revoked
    assert Rule("serial", "42") in revoked
    assert Rule("node", "edge-8") not in revoked
    assert "node edge-7" not in revoked


@pytest.mark.skipif(SSH_KEYGEN is None, reason="ssh-keygen not found (openssh-client)")
def test_key_rule_uses_the_fingerprint_ssh_keygen_prints(tmp_path: Path) -> None:
    assert SSH_KEYGEN is not None
    key = tmp_path / "edge-1"
    subprocess.run([SSH_KEYGEN, "-q", "-t", "ed25519", "-N", "", "-f", key], check=True)
    subprocess.run(
        [SSH_KEYGEN, "-q", "-s", key, "-I", "x", "-n", "edge-1", f"{key}.pub"], check=True
    )
    for listed in (f"{key}.pub", f"{key}-cert.pub"):
        out = subprocess.run(
            [SSH_KEYGEN, "-lf", listed], check=True, capture_output=True, text=True
        )
        fingerprint = out.stdout.split()[1]
        revoked = RevocationList.parse(f"key {fingerprint}\n")
        ours = asyncssh.read_public_key(f"{key}.pub").get_fingerprint("sha256")
        assert revoked.is_revoked(key_fingerprint=ours) == f"key {fingerprint}"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def rewrite(path: Path, text: str) -> None:
    """Write ``text`` and move the mtime on, so the change shows even within one clock tick."""
    old = path.stat().st_mtime_ns if path.exists() else 0
    path.write_text(text, encoding="utf-8")
    os.utime(path, ns=(old + 1_000_000_000, old + 1_000_000_000))


def test_watcher_reloads_on_change_at_most_every_interval(tmp_path: Path) -> None:
    path = tmp_path / "revocations"
    rewrite(path, "node edge-1\n")
    clock = FakeClock()
    watcher = RevocationWatcher(path, clock, interval=5.0)
    assert watcher.current().nodes == {"edge-1"}

    rewrite(path, "node edge-1\nnode edge-2\n")
    clock.now += 4.9
    assert watcher.current().nodes == {"edge-1"}  # not looked at yet
    clock.now += 0.1
    assert watcher.current().nodes == {"edge-1", "edge-2"}
    assert watcher.last_error is None


def test_watcher_does_not_reparse_an_unchanged_file(tmp_path: Path) -> None:
    path = tmp_path / "revocations"
    rewrite(path, "node edge-1\n")
    clock = FakeClock()
    watcher = RevocationWatcher(path, clock, interval=1.0)
    first = watcher.current()
    clock.now += 10
    assert watcher.current() is first


def test_watcher_keeps_the_last_good_list_on_a_malformed_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "revocations"
    rewrite(path, "node edge-1\n")
    clock = FakeClock()
    watcher = RevocationWatcher(path, clock, interval=1.0)

    rewrite(path, "node edge-1\nnode edge-2\nserial forty-two\n")
    clock.now += 1
    with caplog.at_level(logging.ERROR, logger="cloud_gateway.revocation"):
        assert watcher.current().nodes == {"edge-1"}
    assert f"{path}:3: serial 'forty-two' is not a decimal number" in caplog.text
    assert "last good revocation list (1 rules) stays in force" in caplog.text
    assert watcher.last_error is not None and ":3:" in watcher.last_error

    caplog.clear()
    clock.now += 1
    assert watcher.current().nodes == {"edge-1"}
    assert caplog.text == ""  # the same broken file is reported once

    rewrite(path, "node edge-1\nnode edge-2\nserial 42\n")
    clock.now += 1
    assert watcher.current().serials == {42}
    assert watcher.last_error is None


def test_watcher_keeps_rules_when_the_file_disappears(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "revocations"
    rewrite(path, "node edge-1\n")
    clock = FakeClock()
    watcher = RevocationWatcher(path, clock, interval=1.0)
    path.unlink()
    clock.now += 1
    with caplog.at_level(logging.ERROR, logger="cloud_gateway.revocation"):
        assert watcher.current().nodes == {"edge-1"}
    assert "disappeared" in caplog.text

    rewrite(path, "node edge-3\n")
    clock.now += 1
    assert watcher.current().nodes == {"edge-3"}


def test_watcher_starts_empty_without_a_file_and_picks_it_up(tmp_path: Path) -> None:
    path = tmp_path / "revocations"
    clock = FakeClock()
    watcher = RevocationWatcher(path, clock, interval=1.0)
    assert len(watcher.current()) == 0
    rewrite(path, "node edge-1\n")
    clock.now += 1
    assert watcher.current().nodes == {"edge-1"}


def test_watcher_refuses_to_start_on_a_malformed_file(tmp_path: Path) -> None:
    path = tmp_path / "revocations"
    rewrite(path, "# fine\nrevoke edge-1\n")
    with pytest.raises(RevocationFileError, match=r"revocations:2: unknown rule 'revoke'"):
        RevocationWatcher(path, FakeClock())


def test_watcher_sees_an_editor_style_rename(tmp_path: Path) -> None:
    path = tmp_path / "revocations"
    rewrite(path, "node edge-1\n")
    clock = FakeClock()
    watcher = RevocationWatcher(path, clock, interval=1.0)
    new = tmp_path / "revocations.new"
    new.write_text("node edge-2\n", encoding="utf-8")  # same size, new inode
    os.utime(new, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns))
    new.replace(path)
    clock.now += 1
    assert watcher.current().nodes == {"edge-2"}
