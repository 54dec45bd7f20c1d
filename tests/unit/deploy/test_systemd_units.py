"""The systemd units in deploy/systemd: the contract lines, their ties to the code, and
`systemd-analyze verify` / `security` on both.

`systemd-analyze verify` refuses a unit whose ExecStart= binary does not exist, and the
venv in /opt is not there on a test machine, so each unit is verified as a copy whose
ExecStart= points at a stub executable (same arguments); every other line is verified as
shipped. A negative control proves that the harness does report a broken unit. Without
`systemd-analyze` these tests skip, unless EDGE_GPU_RELAY_REQUIRE_SYSTEMD=1 (CI).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import tomllib

from edge_agent.config import AgentConfig

REPO = Path(__file__).resolve().parents[3]
UNITS = REPO / "deploy" / "systemd"
AGENT = UNITS / "edge-agent.service"
GATEWAY = UNITS / "cloud-gateway.service"
SIGNER = UNITS / "cloud-gateway-signer.service"
JETSON = UNITS / "edge-agent-jetson.conf"  # the agent's drop-in on a Jetson
INSTALLER = REPO / "deploy" / "install-edge-agent.sh"
VENV_BIN = "/opt/edge-gpu-relay/venv/bin/"
REQUIRE_SYSTEMD = os.environ.get("EDGE_GPU_RELAY_REQUIRE_SYSTEMD") == "1"

Unit = dict[str, list[tuple[str, str]]]

# The sandbox every unit here has (systemd.exec(5)); each unit's test adds its own lines.
HARDENING = {
    "ProtectSystem": "strict",
    "ProtectHome": "yes",
    "NoNewPrivileges": "yes",
    "PrivateTmp": "yes",
    "ProtectKernelTunables": "yes",
    "ProtectKernelModules": "yes",
    "ProtectControlGroups": "yes",
    "RestrictNamespaces": "yes",
    "RestrictRealtime": "yes",
    "LockPersonality": "yes",
    "MemoryDenyWriteExecute": "yes",
    "SystemCallFilter": "@system-service",
    "CapabilityBoundingSet": "",
    "AmbientCapabilities": "",
}


def parse_unit(path: Path) -> Unit:
    """Sections -> (key, value) in order; comments and blank lines dropped."""
    sections: Unit = {}
    current = ""
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        assert not line.endswith("\\"), f"{path.name}: no line continuations, please: {raw}"
        if line.startswith("[") and line.endswith("]"):
            current = line[1:-1]
            sections.setdefault(current, [])
            continue
        key, sep, value = line.partition("=")
        assert sep and current, f"{path.name}: not KEY=VALUE inside a section: {raw}"
        sections[current].append((key.strip(), value.strip()))
    return sections


def values(unit: Unit, section: str, key: str) -> list[str]:
    return [v for k, v in unit.get(section, []) if k == key]


def one(unit: Unit, section: str, key: str) -> str:
    found = values(unit, section, key)
    assert len(found) == 1, f"[{section}] {key}= expected once, found {found}"
    return found[0]


def assert_settings(unit: Unit, section: str, want: dict[str, str]) -> None:
    """Each key of ``want`` set exactly once in ``section``, to its value."""
    for key, value in want.items():
        assert one(unit, section, key) == value, key


def seconds(value: str) -> float:
    """A systemd time span as used in these units: 60, 60s, 5min, 2min 30s."""
    units = {"": 1, "s": 1, "sec": 1, "min": 60, "m": 60, "h": 3600}
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value):
        total += float(number) * units[unit]
    return total


@pytest.fixture(scope="module")
def agent() -> Unit:
    return parse_unit(AGENT)


@pytest.fixture(scope="module")
def gateway() -> Unit:
    return parse_unit(GATEWAY)


# --- the contract lines -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "user", "command"),
    [(AGENT, "edge-gpu-relay", "edge-agent"), (GATEWAY, "cloud-gateway", "cloud-gateway")],
)
def test_common_contract(path: Path, user: str, command: str) -> None:
    unit = parse_unit(path)
    s = "Service"
    assert one(unit, s, "Type") == "notify"  # READY=1 after the listeners are bound
    assert one(unit, s, "NotifyAccess") == "main"
    assert one(unit, s, "User") == user
    assert one(unit, s, "Group") == user
    assert one(unit, s, "Restart") == "on-failure"
    assert seconds(one(unit, s, "RestartSec")) == 5
    # 2 is the configuration-error exit code of both CLIs: not worth restarting.
    assert one(unit, s, "RestartPreventExitStatus") == "2"
    assert one(unit, "Unit", "StartLimitIntervalSec")
    assert int(one(unit, "Unit", "StartLimitBurst")) >= 3
    assert_settings(unit, s, HARDENING | {"ConfigurationDirectory": "edge-gpu-relay"})
    families = set(one(unit, s, "RestrictAddressFamilies").split())
    assert {"AF_UNIX", "AF_INET", "AF_INET6"} <= families
    assert not families & {"AF_PACKET", "none"}
    assert one(unit, "Install", "WantedBy") == "multi-user.target"

    exec_start = one(unit, s, "ExecStart").split()
    assert exec_start[:2] == [VENV_BIN + command, "run"]
    assert exec_start[2] == "--config"
    # The console script really is called that.
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert command in scripts


def test_agent_contract(agent: Unit) -> None:
    s = "Service"
    assert one(agent, s, "ExecStart").endswith("--config /etc/edge-gpu-relay/agent.toml")
    # The installer writes the config the unit reads.
    assert "CONFIG=$ETC_DIR/agent.toml" in INSTALLER.read_text()
    assert "ETC_DIR=/etc/edge-gpu-relay" in INSTALLER.read_text()
    assert one(agent, s, "StateDirectory") == "edge-gpu-relay"
    assert one(agent, s, "StateDirectoryMode") == "0750"
    assert "video" in one(agent, s, "SupplementaryGroups").split()
    # NVML needs the real /dev/nvidia* nodes: no private /dev, a closed device cgroup that
    # lets exactly the NVIDIA nodes through.
    assert one(agent, s, "PrivateDevices") == "no"
    assert one(agent, s, "DevicePolicy") == "closed"
    allowed = dict(v.split() for v in values(agent, s, "DeviceAllow"))
    assert allowed["/dev/nvidiactl"] == "rw"
    assert allowed["char-nvidia-frontend"] == "rw"
    assert allowed["char-nvidia"] == "rw"
    assert "r" in allowed["char-nvidia-caps"]
    assert "char-nvidia-uvm" in allowed
    # Attribution reads other users' /proc/<pid>/cgroup; libnvidia-ml reads /proc/driver.
    assert values(agent, s, "ProtectProc") in ([], ["default"])
    assert values(agent, s, "ProcSubset") in ([], ["all"])
    assert "AF_NETLINK" in one(agent, s, "RestrictAddressFamilies").split()


def test_agent_spool_directory_is_the_writable_state_directory(agent: Unit) -> None:
    """The spool's default directory is the unit's StateDirectory: systemd creates it for
    the service user, and under ProtectSystem=strict it is the one writable place."""
    s = "Service"
    state = Path("/var/lib") / one(agent, s, "StateDirectory")
    spool = AgentConfig().spool
    assert spool.directory == state
    assert spool.path.parent == state
    assert one(agent, s, "ProtectSystem") == "strict"
    # StateDirectory= is exempt from ProtectSystem=strict; a ReadWritePaths= would be
    # redundant here, and one that does not cover the spool would be a mistake.
    for paths in values(agent, s, "ReadWritePaths"):
        assert str(state) in [path.lstrip("-") for path in paths.split()]
    # The database and its WAL are created private to the service user.
    assert one(agent, s, "UMask") == "0077"
    assert int(one(agent, s, "StateDirectoryMode"), 8) & 0o007 == 0, "not world-accessible"


def test_gateway_contract(gateway: Unit) -> None:
    s = "Service"
    assert one(gateway, s, "ExecStart").endswith("--config /etc/edge-gpu-relay/gateway.toml")
    assert one(gateway, s, "PrivateDevices") == "yes"
    assert one(gateway, s, "ProtectProc") == "invisible"
    # The gateway has no business reading the fleet CA's private keys.
    hidden = one(gateway, s, "InaccessiblePaths").split()
    assert "-/etc/edge-gpu-relay/ca/user_ca" in hidden
    assert "-/etc/edge-gpu-relay/ca/host_ca" in hidden


def test_signer_contract(gateway: Unit) -> None:
    """The signer's unit: its own user, the gateway's group on its socket and runtime
    directory, the CA directory its one writable place, every argument one the CLI takes,
    hardened like the others and off the network."""
    import argparse

    from cloud_gateway.trust.signer_socket import add_signer_parser

    signer = parse_unit(SIGNER)
    s = "Service"
    gateway_user = one(gateway, s, "User")
    assert one(signer, s, "User") == "gpurelay-signer" != gateway_user
    assert one(signer, s, "Group") == gateway_user  # so it can give the socket that group
    exec_start = one(signer, s, "ExecStart").split()
    assert exec_start[:2] == [VENV_BIN + "cloud-gateway", "signer"]
    parser = argparse.ArgumentParser()
    add_signer_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(exec_start[1:])  # every argument is one the signer takes
    assert args.group == gateway_user
    assert str(args.ca_dir) == "/etc/edge-gpu-relay/ca"
    assert args.lifetime == 604800
    runtime = Path("/run") / one(signer, s, "RuntimeDirectory")
    assert args.socket.parent == runtime
    assert int(one(signer, s, "RuntimeDirectoryMode"), 8) == 0o710  # group: through only
    assert one(signer, s, "ReadWritePaths").split() == [str(args.ca_dir)]
    assert one(signer, s, "UMask") == "0077"
    # the gateway's unit hides the key from the gateway; the signer's reads it
    assert f"-{args.ca_dir}/user_ca" in one(gateway, s, "InaccessiblePaths").split()
    assert not values(signer, s, "InaccessiblePaths")
    signer_only = {
        "PrivateDevices": "yes",
        "PrivateNetwork": "yes",
        "ProtectProc": "invisible",
        "RestrictAddressFamilies": "AF_UNIX",
        "Restart": "on-failure",
    }
    assert_settings(signer, s, HARDENING | signer_only)
    # 2: a bad argument, 1: a CA directory or socket it cannot use; neither fixes itself
    assert one(signer, s, "RestartPreventExitStatus").split() == ["1", "2"]
    assert one(signer, "Unit", "Before") == GATEWAY.name
    assert one(signer, "Install", "WantedBy") == "multi-user.target"
    guide = (REPO / "docs" / "operator-guide.md").read_text()
    assert f"deploy/systemd/{SIGNER.name}" in guide
    assert f'signer_socket = "{args.socket}"' in SIGNER.read_text()


def test_gateway_inventory_is_in_the_writable_state_directory(gateway: Unit) -> None:
    """A single gateway keeps its node inventory at $STATE_DIRECTORY/nodes.db: systemd
    sets that variable from StateDirectory= and makes the directory the service user's,
    the one writable place under ProtectSystem=strict."""
    from cloud_gateway.cluster.config import ClusterConfig

    s = "Service"
    state = Path("/var/lib") / one(gateway, s, "StateDirectory")
    assert one(gateway, s, "ProtectSystem") == "strict"
    section = ClusterConfig()  # the default: no database, no directory of its own
    assert section.sqlite_path({"STATE_DIRECTORY": str(state)}) == state / "nodes.db"
    assert section.sqlite_path({}) is None, "without the unit's variable: memory only"
    for paths in values(gateway, s, "ReadWritePaths"):
        assert str(state) in [path.lstrip("-") for path in paths.split()]
    assert one(gateway, s, "UMask") == "0077"
    assert int(one(gateway, s, "StateDirectoryMode"), 8) & 0o007 == 0, "not world-accessible"


def test_agent_watchdog_covers_six_collection_cycles(agent: Unit) -> None:
    # WATCHDOG=1 is sent after every collection cycle.
    interval = AgentConfig().interval_seconds
    assert seconds(one(agent, "Service", "WatchdogSec")) == 60
    assert seconds(one(agent, "Service", "WatchdogSec")) >= 6 * interval


def test_gateway_watchdog_and_stop_timeout(gateway: Unit) -> None:
    from cloud_gateway.app import TICK_SECONDS
    from cloud_gateway.config import GatewayConfig

    assert seconds(one(gateway, "Service", "WatchdogSec")) == 30
    assert seconds(one(gateway, "Service", "WatchdogSec")) >= 10 * TICK_SECONDS
    # Shutdown says GOODBYE and drains before exiting: systemd must not SIGKILL first.
    stop = seconds(one(gateway, "Service", "TimeoutStopSec"))
    assert stop >= 2 * GatewayConfig().drain_seconds


def _handles_sighup(package: str) -> bool:
    return any("SIGHUP" in f.read_text() for f in (REPO / package).rglob("*.py"))


@pytest.mark.parametrize(("path", "package"), [(AGENT, "edge_agent"), (GATEWAY, "cloud_gateway")])
def test_reload_only_if_the_program_handles_sighup(path: Path, package: str) -> None:
    """`kill -HUP` on a program without a SIGHUP handler ends it, and systemd counts SIGHUP
    as a clean exit that Restart=on-failure does not restart: `systemctl reload` would
    silently stop the service. ExecReload= may come back with a handler."""
    reload = values(parse_unit(path), "Service", "ExecReload")
    if reload:
        assert _handles_sighup(package), f"{path.name} has ExecReload= but {package} ignores SIGHUP"


def test_every_setting_is_explained() -> None:
    """Every hardening line the reader might question carries a comment right above it
    (or within the comment block of its group)."""
    for path in (AGENT, GATEWAY, SIGNER):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.startswith(
                (
                    "MemoryDenyWriteExecute=",
                    "PrivateDevices=",
                    "ProtectProc=",
                    "WatchdogSec=",
                    "SystemCallErrorNumber=",
                    "RestrictAddressFamilies=",
                )
            ):
                assert lines[i - 1].startswith("#") or lines[i - 2].startswith("#"), (
                    f"{path.name}:{i + 1} {line} needs a comment saying why"
                )


# --- systemd-analyze ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def systemd_analyze() -> str:
    path = shutil.which("systemd-analyze")
    if path is None:
        msg = "systemd-analyze not found (Debian package systemd)"
        if REQUIRE_SYSTEMD:
            pytest.fail(msg + "; EDGE_GPU_RELAY_REQUIRE_SYSTEMD=1 makes this a failure")
        pytest.skip(msg)
    return path


def verifiable_copy(src: Path, dest_dir: Path, edit: Callable[[str], str] = str) -> Path:
    """The unit with ExecStart= pointing at a stub beside it (arguments kept)."""
    text = src.read_text()
    command = re.search(r"^ExecStart=(\S+)", text, re.MULTILINE)
    assert command is not None
    stub = dest_dir / Path(command.group(1)).name
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    text = text.replace(f"ExecStart={command.group(1)}", f"ExecStart={stub}")
    unit = dest_dir / src.name
    unit.write_text(edit(text))
    return unit


def verify(systemd_analyze: str, unit: Path) -> list[str]:
    """Problems `systemd-analyze verify` reports about this unit ([] when clean)."""
    proc = subprocess.run(
        [systemd_analyze, "verify", "--man=no", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    lines = (proc.stdout + proc.stderr).splitlines()
    # Complaints about our unit name the file or the unit; anything else (another unit on
    # the machine, a container without a manager) is not ours to fix.
    ours = [line for line in lines if unit.name in line or str(unit) in line]
    if proc.returncode != 0 and not ours:
        ours = [f"systemd-analyze verify exited {proc.returncode}", *lines]
    return ours


@pytest.mark.parametrize("path", [AGENT, GATEWAY, SIGNER], ids=lambda p: p.name)
def test_systemd_analyze_verify(systemd_analyze: str, tmp_path: Path, path: Path) -> None:
    unit = verifiable_copy(path, tmp_path)
    assert verify(systemd_analyze, unit) == []


def with_jetson_dropin(text: str) -> str:
    """The agent's unit as systemd reads it with 20-jetson.conf (its [Service] lines last)."""
    dropin = JETSON.read_text().split("[Service]\n", 1)[1]
    return text.replace("\n[Install]", "\n" + dropin + "\n[Install]", 1)


def test_systemd_analyze_verify_on_a_jetson(systemd_analyze: str, tmp_path: Path) -> None:
    unit = verifiable_copy(AGENT, tmp_path, with_jetson_dropin)
    assert "AmbientCapabilities=CAP_DAC_READ_SEARCH" in unit.read_text()
    assert verify(systemd_analyze, unit) == []


def test_the_jetson_dropin_adds_one_read_capability_only() -> None:
    lines = [
        line
        for line in JETSON.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert lines == [
        "[Service]",
        "AmbientCapabilities=CAP_DAC_READ_SEARCH",
        "CapabilityBoundingSet=CAP_DAC_READ_SEARCH",
    ]


def test_verify_harness_reports_problems(systemd_analyze: str, tmp_path: Path) -> None:
    """Negative control: a misspelt key and a bad value in the same unit are reported."""

    def break_it(text: str) -> str:
        text = text.replace("ProtectHome=yes", "ProtectHome=sometimes")
        return text.replace("PrivateTmp=yes", "PrivateTmp=yes\nProtectSytem=strict")

    unit = verifiable_copy(AGENT, tmp_path, break_it)
    problems = "\n".join(verify(systemd_analyze, unit))
    assert "ProtectSytem" in problems
    assert "sometimes" in problems


@pytest.mark.parametrize(
    ("path", "ceiling", "jetson"),
    [(AGENT, 2.5, False), (AGENT, 3.0, True), (GATEWAY, 2.0, False), (SIGNER, 1.5, False)],
    ids=["agent", "agent-on-jetson", "gw", "signer"],
)
def test_systemd_analyze_security_exposure(
    systemd_analyze: str, tmp_path: Path, path: Path, ceiling: float, jetson: bool
) -> None:
    """A guard against hardening regressions: systemd's own exposure score (0 best,
    10 worst) of the units as shipped (the agent's with the Jetson drop-in too)."""
    unit = verifiable_copy(path, tmp_path, with_jetson_dropin if jetson else str)
    proc = subprocess.run(
        [systemd_analyze, "security", "--offline=true", "--no-pager", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    out = proc.stdout + proc.stderr
    if "--offline" in out and ("unrecognized" in out or "Unknown" in out):
        pytest.skip("this systemd-analyze has no `security --offline` (systemd < 250)")
    match = re.search(rf"Overall exposure level for {re.escape(unit.name)}: (\d+\.\d+)", out)
    assert match, out
    assert float(match.group(1)) <= ceiling, out
