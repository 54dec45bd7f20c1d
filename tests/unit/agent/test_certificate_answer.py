"""The gateway's answer to enrollment and renewal, read once for both
(:func:`edge_agent.credentials.certificate_answer`): a refusal says what the gateway said, and
nothing but an OpenSSH certificate for this node's key and this node alone is taken."""

from __future__ import annotations

import re

import asyncssh
import pytest

from edge_agent.credentials import certificate_answer
from edge_agent.enroll import EnrollRefused
from edge_agent.errors import AgentError
from edge_agent.renew import RenewalFailed

NODE = "edge-7"


def answer(exit_status: int, stdout: str = "", stderr: str = "") -> asyncssh.SSHCompletedProcess:
    """What ``conn.run(subsystem=..., check=False, encoding="utf-8")`` returns."""
    return asyncssh.SSHCompletedProcess(
        env={},
        command="",
        subsystem="gpurelay-renew",
        exit_status=exit_status,
        exit_signal=None,
        returncode=exit_status,
        stdout=stdout,
        stderr=stderr,
    )


@pytest.fixture
def ca() -> asyncssh.SSHKey:
    return asyncssh.generate_private_key("ssh-ed25519")


@pytest.fixture
def key() -> asyncssh.SSHKey:
    return asyncssh.generate_private_key("ssh-ed25519")


def signed(ca: asyncssh.SSHKey, key: asyncssh.SSHKey, principals: list[str]) -> str:
    cert = ca.generate_user_certificate(
        key, f"node:{NODE}", serial=42, principals=principals, valid_before=2_000_000_000
    )
    return cert.export_certificate().decode("ascii")


def test_the_certificate_for_this_key_and_node_is_taken_with_its_validity(
    ca: asyncssh.SSHKey, key: asyncssh.SSHKey
) -> None:
    cert, validity = certificate_answer(
        answer(0, signed(ca, key, [NODE]) + "\n"), key=key, node=NODE, error=RenewalFailed
    )
    assert cert.key.public_data == key.public_data and list(cert.principals) == [NODE]
    assert (validity.serial, validity.valid_before) == (42, 2_000_000_000)


@pytest.mark.parametrize(
    ("stderr", "said"),
    [
        ("notice\nerror: node revoked\n", "error: node revoked"),  # its last line
        ("", "exit status 3"),
    ],
)
def test_a_refusal_says_what_the_gateway_said(key: asyncssh.SSHKey, stderr: str, said: str) -> None:
    with pytest.raises(EnrollRefused) as err:
        certificate_answer(
            answer(3, stderr=stderr),
            key=key,
            node=NODE,
            error=EnrollRefused,
            gateway="the gateway gw:2222",
            refused=f"refused to enroll node {NODE}",
        )
    assert str(err.value) == f"the gateway gw:2222 refused to enroll node {NODE}: {said}"
    with pytest.raises(RenewalFailed, match=f"^the gateway refused: {said}$"):
        certificate_answer(answer(3, stderr=stderr), key=key, node=NODE, error=RenewalFailed)


@pytest.mark.parametrize("stdout", ["", "not a certificate", "ssh-ed25519 AAAAC3Nza"])
def test_an_answer_that_is_no_certificate_is_refused(key: asyncssh.SSHKey, stdout: str) -> None:
    with pytest.raises(RenewalFailed, match=r"^the gateway answered no certificate: "):
        certificate_answer(answer(0, stdout), key=key, node=NODE, error=RenewalFailed)


def test_a_plain_public_key_is_no_certificate(key: asyncssh.SSHKey) -> None:
    public = key.export_public_key("openssh").decode("ascii")
    with pytest.raises(AgentError, match="answered no certificate"):
        certificate_answer(answer(0, public), key=key, node=NODE, error=AgentError)


def test_a_certificate_for_another_key_is_refused(
    ca: asyncssh.SSHKey, key: asyncssh.SSHKey
) -> None:
    other = asyncssh.generate_private_key("ssh-ed25519")
    with pytest.raises(EnrollRefused, match="is for another key than this node's"):
        certificate_answer(
            answer(0, signed(ca, other, [NODE])), key=key, node=NODE, error=EnrollRefused
        )


@pytest.mark.parametrize("principals", [["edge-8"], [NODE, "edge-8"], []])
def test_a_certificate_for_another_node_or_more_is_refused(
    ca: asyncssh.SSHKey, key: asyncssh.SSHKey, principals: list[str]
) -> None:
    with pytest.raises(RenewalFailed, match=re.escape(f"names {principals!r}, not node {NODE}")):
        certificate_answer(
            answer(0, signed(ca, key, principals)), key=key, node=NODE, error=RenewalFailed
        )
