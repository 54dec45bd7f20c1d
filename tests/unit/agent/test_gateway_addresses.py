"""A list of gateway addresses for bare metal without a balancer (issue 16): the order an
agent dials them in, the config that names them, and the tunnel going round the list
(without a network: its session is replaced by a function, by test_tunnel_backoff's
run_until_slept)."""

from __future__ import annotations

import hashlib
import random
import re
from collections import Counter
from pathlib import Path

import pytest

from edge_agent.config import load
from edge_agent.dial import Rotation, first_index, show
from edge_agent.errors import ConfigError
from edge_agent.tunnel import Tunnel
from edge_agent.tunnel_types import GatewayRefused, SessionEnded, TunnelError, Unanswered
from tests.unit.agent.test_tunnel_backoff import run_until_slept
from tests.unit.agent.test_tunnel_backoff import tunnel as backoff_tunnel

GATEWAYS = [("gw-a", 2222), ("gw-b", 2222), ("gw-c", 2200)]


# -- the order ---------------------------------------------------------------------------


def test_first_index_is_a_stable_function_of_the_node_name() -> None:
    assert first_index("edge-a", 3) == first_index("edge-a", 3)
    assert first_index("edge-a", 1) == 0
    # SHA-256, not Python's salted hash(): the same on every start and machine
    digest = hashlib.sha256(b"edge-a").digest()
    assert first_index("edge-a", 1000) == int.from_bytes(digest[:8], "big") % 1000 == 151
    with pytest.raises(ValueError):
        first_index("edge-a", 0)


def test_a_fleet_spreads_over_the_list_instead_of_all_dialling_the_first() -> None:
    starts = Counter(first_index(f"node-{i:04d}", 3) for i in range(3000))
    assert set(starts) == {0, 1, 2}
    assert all(800 <= n <= 1200 for n in starts.values()), starts  # about 1000 each


def test_rotation_goes_round_the_list_from_the_nodes_start() -> None:
    r = Rotation(GATEWAYS, "edge-a")
    start = first_index("edge-a", 3)
    assert r.current == GATEWAYS[start]
    assert r.round() == GATEWAYS[start:] + GATEWAYS[:start]
    seen = [r.advance() for _ in range(6)]
    assert seen == [GATEWAYS[(start + i) % 3] for i in range(1, 7)]
    assert r.current == GATEWAYS[start]  # twice round: back where it began
    one = Rotation([("gw", 2222)], "edge-a")
    assert (one.current, one.advance(), one.round()) == (("gw", 2222), ("gw", 2222), [("gw", 2222)])


def test_show_brackets_ipv6_hosts() -> None:
    assert show(("gw-a", 2222)) == "gw-a:2222"
    assert show(("::1", 2222)) == "[::1]:2222"


# -- the config --------------------------------------------------------------------------


def gateway_toml(tmp_path: Path, body: str) -> Path:
    f = tmp_path / "agent.toml"
    f.write_text(f'[gateway]\nknown_hosts = "/k"\nkey = "/n.key"\n{body}')
    return f


def test_addresses_take_a_default_port_and_keep_their_order(tmp_path: Path) -> None:
    cfg = load(gateway_toml(tmp_path, 'addresses = ["gw-b", "10.0.0.7:2200", "[::1]:22"]\n'), {})
    assert cfg.gateway.gateways == (("gw-b", 2222), ("10.0.0.7", 2200), ("::1", 22))
    assert cfg.gateway.address == ""


def test_addresses_from_the_environment_are_comma_separated(tmp_path: Path) -> None:
    env = {"EDGE_AGENT_GATEWAY_ADDRESSES": "gw-a:2222, gw-b ,"}
    cfg = load(gateway_toml(tmp_path, ""), env)
    assert cfg.gateway.addresses == ("gw-a:2222", "gw-b")
    assert cfg.gateway.gateways == (("gw-a", 2222), ("gw-b", 2222))


def test_one_address_is_a_list_of_one_and_none_is_an_empty_list(tmp_path: Path) -> None:
    assert load(gateway_toml(tmp_path, 'address = "lb"\n'), {}).gateway.gateways == (("lb", 2222),)
    # an empty list is the same as no address: serve locally only (the agent logs it)
    assert load(gateway_toml(tmp_path, "addresses = []\n"), {}).gateway.gateways == ()
    assert load(None, {}).gateway.gateways == ()


@pytest.mark.parametrize(
    ("body", "env", "message"),
    [
        (
            'address = "lb:2222"\naddresses = ["gw-a"]\n',
            {},
            "gateway.address and gateway.addresses are both set",
        ),
        (
            'address = "lb:2222"\n',
            {"EDGE_AGENT_GATEWAY_ADDRESSES": "gw-a,gw-b"},
            "gateway.address and gateway.addresses are both set",
        ),
        ('addresses = ["gw-a", ""]\n', {}, "gateway.addresses[1] '' must look like HOST[:PORT]"),
        ('addresses = ["gw-a:ssh"]\n', {}, "gateway.addresses[0] 'gw-a:ssh' must look like"),
        ('addresses = ["gw-a:70000"]\n', {}, "gateway.addresses[0] 'gw-a:70000' must look like"),
        ('addresses = ["gw-a:0"]\n', {}, "gateway.addresses[0] 'gw-a:0': the port must be"),
        ('addresses = [":2222"]\n', {}, "gateway.addresses[0] ':2222' must look like"),
        ('addresses = ["gw-a", "gw-a:2222"]\n', {}, "gw-a:2222 is listed twice"),
        ("addresses = [2222]\n", {}, "gateway.addresses must be of type str"),
        ('addresses = "gw-a,gw-b"\n', {}, "gateway.addresses must be a list"),
    ],
)
def test_bad_addresses_are_clear_errors(
    tmp_path: Path, body: str, env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load(gateway_toml(tmp_path, body), env)
    assert message in str(info.value)


def test_the_operator_guide_example_loads(tmp_path: Path) -> None:
    guide = Path(__file__).resolve().parents[3] / "docs" / "operator-guide.md"
    text = guide.read_text(encoding="utf-8")
    section = text[text.index("### Bare metal without a balancer\n") :]
    block = re.search(r"```\n(\[gateway\]\n.*?)```", section, re.DOTALL)
    assert block is not None
    (tmp_path / "agent.toml").write_text(block.group(1))
    gw = load(tmp_path / "agent.toml", {}).gateway
    assert [port for _, port in gw.gateways] == [2222, 2222, 2222]


def test_addresses_need_a_key_and_known_hosts(tmp_path: Path) -> None:
    f = tmp_path / "agent.toml"
    f.write_text('[gateway]\naddresses = ["gw-a", "gw-b"]\nkey = "/n.key"\n')
    with pytest.raises(ConfigError, match=r"gateway.addresses is set, so gateway.known_hosts"):
        load(f, {})


# -- the tunnel going round --------------------------------------------------------------


def tunnel(tmp_path: Path, node: str = "edge-a") -> Tunnel:
    return backoff_tunnel(tmp_path, node, addresses=tuple(f"{h}:{p}" for h, p in GATEWAYS))


def ring(node: str) -> list[tuple[str, int]]:
    start = first_index(node, len(GATEWAYS))
    return [GATEWAYS[(start + i) % len(GATEWAYS)] for i in range(12)]


async def test_a_failed_dial_moves_on_at_once_and_backoff_follows_a_whole_round(
    tmp_path: Path,
) -> None:
    """Refused, unanswered, refused by the gateway (ERROR unavailable: fenced, or without
    its directory): the next address at once; a sleep only after all three failed."""
    random.seed(16)
    t = tunnel(tmp_path)
    dialled: list[tuple[str, int]] = []
    events: list[str] = []
    failures = [
        TunnelError("cannot reach gateway: connection refused"),
        Unanswered("cannot reach gateway: no answer"),
        GatewayRefused("unavailable: the node directory is unavailable"),
    ]

    async def session(host: str, port: int) -> None:
        dialled.append((host, port))
        events.append("dial")
        raise failures[(len(dialled) - 1) % 3]

    await run_until_slept(t, session, 3, on_sleep=lambda seconds: events.append("sleep"))
    assert dialled == ring("edge-a")[:9]
    assert events == (["dial"] * 3 + ["sleep"]) * 3, events


async def test_a_round_nobody_answered_waits_only_the_short_pause(tmp_path: Path) -> None:
    random.seed(16)
    t = tunnel(tmp_path)

    async def session(host: str, port: int) -> None:
        raise Unanswered(f"no answer from {host}:{port}")

    sleeps = await run_until_slept(t, session, 8)
    assert all(0 <= s <= 2.0 for s in sleeps), sleeps  # 2 x backoff_initial, not growing


async def test_a_session_that_ended_dials_the_next_address_first(tmp_path: Path) -> None:
    random.seed(16)
    t = tunnel(tmp_path, node="edge-b")
    dialled: list[tuple[str, int]] = []

    async def session(host: str, port: int) -> None:
        dialled.append((host, port))
        if len(dialled) in (1, 2):  # up, acknowledged, then dropped (reset; clean end)
            if len(dialled) == 1:
                t._acked_this_session = True
                raise ConnectionResetError("Connection reset by peer")
            return
        raise TunnelError("cannot reach gateway")

    sleeps = await run_until_slept(t, session, 3)
    expected = ring("edge-b")
    # dropped on the first: the next; ended cleanly there: the one after; then a round
    assert dialled == expected[:5], dialled
    assert 0 <= sleeps[0] <= 10.0 and 0 <= sleeps[1] <= 10.0  # the herd-spreading pause


async def test_one_address_behaves_as_before(tmp_path: Path) -> None:
    """A list of one is what ``address`` was: each failure is one backoff step."""
    t = backoff_tunnel(tmp_path)  # address = "127.0.0.1:9"
    events: list[str] = []

    async def session(host: str, port: int) -> None:
        events.append(f"dial {host}:{port}")
        raise TunnelError("cannot reach gateway")

    await run_until_slept(t, session, 3, on_sleep=lambda seconds: events.append("sleep"))
    assert events == ["dial 127.0.0.1:9", "sleep"] * 3


def test_session_ended_is_not_a_retried_failure() -> None:
    # run() relies on it: a SessionEnded leaves the round and tenacity alike
    from edge_agent.tunnel_types import RETRIED

    assert not issubclass(SessionEnded, RETRIED)
