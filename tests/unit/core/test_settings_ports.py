"""A port in a HOST:PORT setting: ASCII digits, 0..65535 (0 for a listener: any free port),
or a clear configuration error naming the key; never a ValueError traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from cloud_gateway.config import load as load_gateway
from cloud_gateway.errors import GatewayConfigError
from edge_agent.config import ConfigError
from edge_agent.config import load as load_agent
from gpurelay.settings import SettingsError, split_host_port

HOSTILE = [
    "\u00b2",  # superscript two: str.isdigit says yes, int() says no
    "1\u00b2",
    "\u0663\u0663",  # Arabic-Indic digits: int() takes them, a port does not
    "\uff19\uff14\uff11\uff10",  # fullwidth 9410
    "1" * 5000,  # over int()'s 4,300 digits
    "65536",
    "99999",
    "+80",
    " 80",
    "-1",
    "",
    "0x50",
]


@pytest.mark.parametrize("port", HOSTILE, ids=lambda p: ascii(p)[:20])
def test_a_bad_port_is_a_settings_error_naming_the_key(port: str) -> None:
    with pytest.raises(SettingsError) as raised:
        split_host_port(f"127.0.0.1:{port}", "ssh.listen")
    message = str(raised.value)
    assert message.startswith("ssh.listen '127.0.0.1:"), message
    assert "must look like HOST:PORT, the port 1..65535 in ASCII digits" in message
    assert len(message) < 300, "the value is shortened, not printed whole"


@pytest.mark.parametrize(
    ("value", "pair"),
    [
        ("127.0.0.1:0", ("127.0.0.1", 0)),
        (":9410", ("0.0.0.0", 9410)),
        ("[::1]:65535", ("::1", 65535)),
        ("gw.example.com:00022", ("gw.example.com", 22)),
    ],
)
def test_a_good_port(value: str, pair: tuple[str, int]) -> None:
    assert split_host_port(value) == pair


@pytest.mark.parametrize(
    "port", ["\u00b2", "1" * 5000, "70000"], ids=["superscript", "long", "big"]
)
def test_gateway_and_agent_configs_say_which_key(tmp_path: Path, port: str) -> None:
    gateway = tmp_path / "gateway.toml"
    gateway.write_text(f'[http]\nlisten = "127.0.0.1:{port}"\n')
    with pytest.raises(GatewayConfigError, match=r"^http\.listen '127\.0\.0\.1:"):
        load_gateway(gateway, {})
    agent = tmp_path / "agent.toml"
    agent.write_text(f'listen = "127.0.0.1:{port}"\n')
    with pytest.raises(ConfigError, match=r"must look like HOST:PORT, the port 1\.\.65535"):
        load_agent(agent, {})
    with pytest.raises(ConfigError, match=r"gateway\.address"):
        load_agent(None, {"EDGE_AGENT_GATEWAY_ADDRESS": f"gw.example.com:{port}"})
