"""The enrollment token and the renewal schedule (gpurelay/enrollment.py)."""

from __future__ import annotations

import base64
import json

import asyncssh
import pytest

from gpurelay import enrollment
from gpurelay.enrollment import TokenError, parse_token, renew_due, sign_token, verify_token

NONCE = "0123456789abcdef0123456789abcdef"


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def token_of(fields: object, signature: bytes = b"sig") -> str:
    return f"gpr1.{b64(json.dumps(fields).encode())}.{b64(signature)}"


@pytest.fixture(scope="module")
def ca() -> asyncssh.SSHKey:
    return asyncssh.generate_private_key("ssh-ed25519")


def test_constants_are_the_contract() -> None:
    assert enrollment.ENROLL_USER_PREFIX == "enroll:"
    assert enrollment.ENROLL_SUBSYSTEM == "gpurelay-enroll"
    assert enrollment.RENEW_SUBSYSTEM == "gpurelay-renew"
    assert enrollment.TOKEN_PREFIX == "gpr1."
    assert enrollment.node_from_username("enroll:edge-1") == "edge-1"
    assert enrollment.node_from_username("edge-1") is None
    assert enrollment.enroll_username("edge-1") == "enroll:edge-1"


@pytest.mark.parametrize("algorithm", ["ssh-ed25519", "ecdsa-sha2-nistp256", "ssh-rsa"])
def test_signed_token_round_trips_and_verifies(algorithm: str) -> None:
    ca = asyncssh.generate_private_key(
        algorithm, **({"key_size": 2048} if algorithm == "ssh-rsa" else {})
    )
    text = sign_token(ca, "edge-1", 1_900_000_000, NONCE)
    assert text.startswith("gpr1.") and "=" not in text
    token = parse_token(text)
    assert (token.node, token.exp, token.nonce) == ("edge-1", 1_900_000_000, NONCE)
    public = asyncssh.import_public_key(ca.export_public_key())
    assert verify_token(token, [public])
    assert json.loads(token.payload) == {"node": "edge-1", "exp": 1_900_000_000, "nonce": NONCE}


def test_signature_by_another_ca_or_over_other_bytes_fails(ca: asyncssh.SSHKey) -> None:
    other = asyncssh.generate_private_key("ssh-ed25519")
    token = parse_token(sign_token(ca, "edge-1", 1_900_000_000, NONCE))
    assert not verify_token(token, [other])
    assert verify_token(token, [other, ca])  # old + new CA trusted during a rotation
    assert not verify_token(token, [])
    # the same signature on a payload naming another node
    forged_payload = token.payload.replace(b"edge-1", b"edge-2")
    forged = parse_token(f"gpr1.{b64(forged_payload)}.{b64(token.signature)}")
    assert forged.node == "edge-2"
    assert not verify_token(forged, [ca])
    garbage = parse_token(f"gpr1.{b64(token.payload)}.{b64(b'not an ssh signature')}")
    assert not verify_token(garbage, [ca])


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "does not start with"),
        ("gpr2.abc.def", "does not start with"),
        ("gpr1.abc", "gpr1.<payload>.<signature>"),
        ("gpr1.a.b.c", "gpr1.<payload>.<signature>"),
        ("gpr1..c2ln", "payload is empty"),
        ("gpr1.e30.", "signature is empty"),
        ("gpr1.e30=.c2ln", "base64url"),
        ("gpr1.e+0.c2ln", "base64url"),
        ("gpr1.eAAAA.c2ln", "base64url"),
        ("gpr1." + "A" * 5000 + ".c2ln", "longer than 4096"),
        (f"gpr1.{b64(b'not json')}.c2ln", "not JSON"),
        (f"gpr1.{b64(bytes([0xFF, 0xFE]))}.c2ln", "not JSON"),
        (token_of([1, 2]), "not a JSON object"),
        (f"gpr1.{b64(b'[' * 3000)}.c2ln", "nested too deeply"),
        (token_of({"node": "a", "exp": 1}), "exactly node, exp and nonce"),
        (token_of({"node": "a", "exp": 1, "nonce": NONCE, "x": 1}), "exactly node, exp and nonce"),
        (token_of({"node": "", "exp": 1, "nonce": NONCE}), "node is not a node name"),
        (token_of({"node": "a b", "exp": 1, "nonce": NONCE}), "node is not a node name"),
        (token_of({"node": "enroll:a", "exp": 1, "nonce": NONCE}), "node is not a node name"),
        (token_of({"node": 7, "exp": 1, "nonce": NONCE}), "node is not a node name"),
        (token_of({"node": "a", "exp": "1", "nonce": NONCE}), "exp is not"),
        (token_of({"node": "a", "exp": True, "nonce": NONCE}), "exp is not"),
        (token_of({"node": "a", "exp": 1.5, "nonce": NONCE}), "exp is not"),
        (token_of({"node": "a", "exp": -1, "nonce": NONCE}), "exp is not"),
        (token_of({"node": "a", "exp": 2**70, "nonce": NONCE}), "exp is not"),
        (token_of({"node": "a", "exp": 1, "nonce": NONCE.upper()}), "nonce is not"),
        (token_of({"node": "a", "exp": 1, "nonce": NONCE[:-1]}), "nonce is not"),
    ],
)
def test_malformed_tokens_are_refused_with_a_clear_reason(text: str, says: str) -> None:
    with pytest.raises(
        TokenError, match=says.replace(".", r"\.").replace("<", ".").replace(">", ".")
    ):
        parse_token(text)


def test_surrounding_whitespace_of_a_token_file_is_ignored(ca: asyncssh.SSHKey) -> None:
    text = sign_token(ca, "edge-1", 1_900_000_000, NONCE)
    assert parse_token(f"  {text}\n").nonce == NONCE


def test_the_error_never_contains_the_token() -> None:
    secret = token_of({"node": "a", "exp": 1, "nonce": "zz" * 16})
    with pytest.raises(TokenError) as raised:
        parse_token(secret)
    assert secret.split(".")[1] not in str(raised.value)


def test_renew_due_from_two_thirds_of_the_lifetime() -> None:
    assert not renew_due(1000, 1300, 1000)
    assert not renew_due(1000, 1300, 1199)
    assert renew_due(1000, 1300, 1200)
    assert renew_due(1000, 1300, 1299)
    assert renew_due(1000, 1300, 5000)  # already expired: renewing is all that is left
    assert renew_due(1000, 1000, 0)  # an empty window
    week = 7 * 86400
    assert not renew_due(0, week, week * 0.66)
    assert renew_due(0, week, week * 0.67)


def test_error_line() -> None:
    assert enrollment.error_line(enrollment.REASON_USED) == "error: token already used\n"


def test_refusal_said_is_the_last_line_of_stderr_or_the_exit_status() -> None:
    said = "debug noise\n" + enrollment.error_line(enrollment.REASON_USED)
    assert enrollment.refusal_said(said, 1) == "error: token already used"
    assert enrollment.refusal_said("x" * 1000, 1) == "x" * 300  # bounded
    assert enrollment.refusal_said("", 1) == enrollment.refusal_said(None, 1) == "exit status 1"
