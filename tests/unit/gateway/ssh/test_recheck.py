"""The tick's recheck of held connections (issue 26): the same verdict as the full check,
without the check while nothing that could change it has changed."""

from __future__ import annotations

from pathlib import Path

import asyncssh
import pytest
from asyncssh.public_key import SSHOpenSSHCertificate

from cloud_gateway.ssh import logins
from cloud_gateway.ssh.logins import CertificatePolicy, Held
from cloud_gateway.trust import certs
from cloud_gateway.trust.auth_policy import load_trusted_cas
from cloud_gateway.trust.revocation import RevocationList

NOW = 1_700_000_000


class Revocations:
    """What :class:`RevocationWatcher` gives the policy: the list in force now."""

    def __init__(self) -> None:
        self.list = RevocationList()

    def current(self) -> RevocationList:
        return self.list


@pytest.fixture
def setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[object, ...]:
    paths = certs.init_ca(tmp_path / "ca")
    issued = certs.issue_node(paths.dir, "edge-1", now=NOW, days=1)
    cert = asyncssh.read_certificate(issued.certificate)
    assert isinstance(cert, SSHOpenSSHCertificate)
    clock = [float(NOW + 10)]
    revocations = Revocations()
    policy = CertificatePolicy(
        trusted_cas=load_trusted_cas(paths.user_ca_pub),
        revocations=revocations,  # type: ignore[arg-type]
        clock=lambda: clock[0],
    )
    calls: list[str] = []
    real = logins.check_user_certificate

    def counted(*args: object, **kwargs: object) -> str | None:
        calls.append("check")
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(logins, "check_user_certificate", counted)
    return policy, cert, issued, revocations, clock, calls


def test_a_held_certificate_is_checked_once_while_nothing_changes(setup: tuple) -> None:
    policy, cert, _issued, _revocations, clock, calls = setup
    held = Held()
    for _ in range(5):
        assert policy.recheck("edge-1", cert, held) is None
        clock[0] += 1.0
    assert calls == ["check"]


def test_a_new_revocation_list_is_checked_and_refuses(setup: tuple) -> None:
    policy, cert, issued, revocations, _clock, calls = setup
    held = Held()
    assert policy.recheck("edge-1", cert, held) is None
    revocations.list = RevocationList.parse("node edge-2")  # another node: still passes
    assert policy.recheck("edge-1", cert, held) is None
    revocations.list = RevocationList.parse(f"serial {issued.serial}")
    assert policy.recheck("edge-1", cert, held) == "revoked"
    assert len(calls) == 3


def test_expiry_is_seen_at_valid_before(setup: tuple) -> None:
    policy, cert, _issued, _revocations, clock, calls = setup
    held = Held()
    assert policy.recheck("edge-1", cert, held) is None
    clock[0] = held.until - 1
    assert policy.recheck("edge-1", cert, held) is None
    assert len(calls) == 1
    clock[0] = held.until
    assert policy.recheck("edge-1", cert, held) == "expired"


def test_a_changed_ca_list_is_checked(setup: tuple, tmp_path: Path) -> None:
    policy, cert, _issued, _revocations, _clock, calls = setup
    held = Held()
    assert policy.recheck("edge-1", cert, held) is None
    other = certs.init_ca(tmp_path / "other")
    policy.trusted_cas = load_trusted_cas(other.user_ca_pub)
    assert policy.recheck("edge-1", cert, held) == "unknown_ca"
    assert len(calls) == 2
