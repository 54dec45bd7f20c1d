"""deploy/haproxy/haproxy.cfg: the bare-metal balancer in front of several gateways.

The real ``haproxy -c`` accepts the file as shipped (and, as a negative control, refuses a
copy with one misspelt keyword), and the settings the operator guide relies on are there:
TCP mode, least connections, three checked servers on the gateway's SSH port, health from
the gateway's /readyz on its HTTP port, and idle timeouts far above the agents' keepalive
and silence timeout (haproxy must never be the one that cuts a live tunnel).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from cloud_gateway.config import GatewayConfig
from cloud_gateway.http.api import ENDPOINTS
from edge_agent.config import AgentConfig, silence_timeout
from gpurelay.settings import split_host_port

CFG = Path(__file__).resolve().parents[3] / "deploy" / "haproxy" / "haproxy.cfg"

Sections = dict[str, list[list[str]]]  # "backend cloud_gateways" -> its lines, split


def sections(text: str) -> Sections:
    out: Sections = {}
    current: list[list[str]] | None = None
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].rstrip()
        if not line.strip():
            continue
        words = line.split()
        if not raw[0].isspace():
            current = out.setdefault(" ".join(words), [])
        else:
            assert current is not None, f"a setting outside any section: {raw}"
            current.append(words)
    return out


def setting(lines: list[list[str]], *key: str) -> list[str]:
    found = [w[len(key) :] for w in lines if tuple(w[: len(key)]) == key]
    assert len(found) == 1, f"{' '.join(key)}: expected once, found {found}"
    return found[0]


def haproxy_seconds(value: str) -> float:
    """haproxy's time format: a number with us, ms, s, m, h or d (milliseconds alone)."""
    match = re.fullmatch(r"(\d+)(us|ms|s|m|h|d)?", value)
    assert match, value
    scale = {"us": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600, "d": 86400, None: 1e-3}
    return int(match[1]) * scale[match[2]]


def check(haproxy: Path, cfg: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(haproxy), "-c", "-f", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture(scope="module")
def parsed() -> Sections:
    return sections(CFG.read_text(encoding="utf-8"))


def test_haproxy_accepts_the_example(haproxy_bin: Path) -> None:
    proc = check(haproxy_bin, CFG)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_haproxy_check_reports_a_broken_copy(haproxy_bin: Path, tmp_path: Path) -> None:
    """Negative control: the same file with one misspelt keyword is refused."""
    text = CFG.read_text(encoding="utf-8")
    assert "balance leastconn" in text
    broken = tmp_path / "haproxy.cfg"
    broken.write_text(text.replace("balance leastconn", "balance fewest"))
    proc = check(haproxy_bin, broken)
    assert proc.returncode != 0
    assert "balance only supports" in proc.stdout + proc.stderr


def test_tcp_least_connections_to_three_checked_gateways(parsed: Sections) -> None:
    ssh_port = split_host_port(GatewayConfig().ssh.listen)[1]
    http_port = split_host_port(GatewayConfig().http.listen)[1]
    assert setting(parsed["defaults"], "mode") == ["tcp"]
    (frontend,) = [v for k, v in parsed.items() if k.startswith("frontend ")]
    assert setting(frontend, "bind") == [f":{ssh_port}"]
    backend = parsed["backend " + setting(frontend, "default_backend")[0]]
    assert setting(backend, "balance") == ["leastconn"]
    servers = [w for w in backend if w[0] == "server"]
    assert len(servers) == 3
    assert {split_host_port(w[2])[1] for w in servers} == {ssh_port}
    defaults = setting(backend, "default-server")
    assert "check" in defaults
    assert defaults[defaults.index("port") + 1] == str(http_port)
    assert setting(backend, "option") == ["httpchk"]
    send = setting(backend, "http-check", "send")
    uri = send[send.index("uri") + 1]
    assert uri == "/readyz" and uri in ENDPOINTS
    assert setting(backend, "http-check", "expect") == ["status", "200"]


def test_timeouts_far_above_the_agents_liveness(parsed: Sections) -> None:
    gateway = AgentConfig().gateway
    keepalive = gateway.keepalive_seconds  # 15 s
    # The agent's silence timeout at its longest (any interval: heartbeats are asked at
    # least every 5 s, or every ack_delay_seconds): 20 s by default.
    silence = silence_timeout(gateway, 3600.0)
    defaults = parsed["defaults"]
    for side in ("client", "server"):
        idle = haproxy_seconds(setting(defaults, "timeout", side)[0])
        assert idle >= 10 * max(keepalive, silence), f"timeout {side} {idle:g}s"
    assert haproxy_seconds(setting(defaults, "timeout", "connect")[0]) <= 10
