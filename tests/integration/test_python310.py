"""The edge agent on Python 3.10, as on a Jetson with JetPack 6 (Ubuntu 22.04's python3.10).

A venv of a real Python 3.10 gets a wheel of this repository and its dependencies, as
``pip`` resolves them for 3.10 (with the ``async-timeout`` and ``tomli`` backports that
:mod:`gpurelay.compat` takes there). Then, under 3.10:

- ``edge-agent once --simulate jetson-orin-nano`` prints a promtool-clean exposition and
  a BIE document;
- ``edge-agent run`` pushes through the SSH tunnel (real asyncssh) to a real gateway on
  3.11, which shows the node's series, and a timeout path (a gateway that never answers
  the TCP handshake's SSH banner) is caught, not a traceback;
- ``cloud-gateway`` refuses to start with one line (it needs 3.11);
- ``deploy/install-edge-agent.sh --python <3.10>`` makes the service's venv on it, the
  package and its 3.10 dependencies from the index, and checks its config with it.

Python 3.10 comes from ``EDGE_GPU_RELAY_PYTHON310``, ``python3.10`` on PATH, or pyenv's
versions. Without one the test skips, and fails instead when
``EDGE_GPU_RELAY_REQUIRE_PYTHON310=1`` (.ci/run sets it where the machine has one).
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from edge_agent.dial import first_index
from harness.fleet import make_pki
from harness.ports import free_ports
from harness.process import Process, clean_env
from harness.services import GatewayProc
from harness.waiting import wait_until
from harness.wheel import build_wheel, copy_source
from tests.promtool_support import unexpected_findings

REPO = Path(__file__).resolve().parents[2]
# a node name that dials the first of two addresses first: the silent one
NODE = next(n for n in (f"jetson-py310-{i}" for i in range(100)) if first_index(n, 2) == 0)

pytestmark = pytest.mark.timeout(900)


def _python310() -> str:
    candidates = [os.environ.get("EDGE_GPU_RELAY_PYTHON310", ""), shutil.which("python3.10")]
    candidates += sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.10*/bin/python3.10")))
    for candidate in candidates:
        if not candidate or not os.path.exists(candidate):
            continue
        probe = subprocess.run(
            [candidate, "-c", "import sys, venv; assert sys.version_info[:2] == (3, 10)"],
            capture_output=True,
            check=False,
        )
        if probe.returncode == 0:
            return candidate
    msg = "no Python 3.10 here (EDGE_GPU_RELAY_PYTHON310, python3.10, ~/.pyenv/versions/3.10*)"
    if os.environ.get("EDGE_GPU_RELAY_REQUIRE_PYTHON310") == "1":
        pytest.fail(msg + "; required in CI")
    pytest.skip(msg)


@pytest.fixture(scope="module")
def src310(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of what the wheel holds (the checkout stays untouched by the builds)."""
    return copy_source(tmp_path_factory.mktemp("src310"))


@pytest.fixture(scope="module")
def py310(src310: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3.10 venv with this repository installed (a wheel built from a copy) and what pip
    resolves for it on 3.10; its ``bin`` directory."""
    python = _python310()
    src = src310
    venv = tmp_path_factory.mktemp("venv310")
    subprocess.run([python, "-m", "venv", str(venv)], check=True, timeout=120)
    proc = subprocess.run(
        [str(venv / "bin" / "pip"), "install", "--quiet", "--disable-pip-version-check", str(src)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, "pip install on Python 3.10 failed:\n" + proc.stderr[-3000:]
    return venv / "bin"


def run310(bin_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(bin_dir / args[0]), *args[1:]],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=bin_dir,  # not the checkout: the installed package, as on the box
        env=clean_env("EDGE_AGENT_", "CLOUD_GATEWAY_"),
    )


def test_once_on_python310(py310: Path, promtool: Path) -> None:
    version = subprocess.run(
        [str(py310 / "python"), "-c", "import sys, edge_agent; print(sys.version_info[:2])"],
        capture_output=True,
        text=True,
        check=True,
        cwd=py310,
    )
    assert version.stdout.strip() == "(3, 10)"
    out = run310(py310, "edge-agent", "once", "--simulate", "jetson-orin-nano", "--node-name", NODE)
    assert out.returncode == 0, out.stderr
    assert "SIMULATED JETSON" in out.stderr and "Traceback" not in out.stderr
    assert unexpected_findings(promtool, out.stdout.encode()) == []
    assert (
        "DCGM_FI_DEV_GPU_UTIL{" in out.stdout and "gpurelay_jetson_rail_power_watts{" in out.stdout
    )
    bie = run310(
        py310, "edge-agent", "once", "--simulate", "2", "--format", "bie", "--node-name", NODE
    )
    assert bie.returncode == 0 and f'"{NODE}"' in bie.stdout, bie.stderr


def test_the_gateway_says_it_needs_311(py310: Path) -> None:
    out = run310(py310, "cloud-gateway", "--help")
    assert out.returncode != 0
    assert out.stderr.strip() == (
        "cloud-gateway: error: needs Python 3.11 or newer, this is 3.10 "
        "(the edge agent runs on 3.10)"
    )


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A TCP port that accepts and never says a word (an SSH banner that never comes)."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join(5)
        for s in held:
            s.close()
        server.close()


def test_run_on_python310_pushes_to_a_gateway(
    py310: Path, tmp_path: Path, silent_port: int
) -> None:
    pki = make_pki(tmp_path)
    gateway = GatewayProc(pki, tmp_path)
    creds = pki.node(NODE)
    (port,) = free_ports(1)
    config = tmp_path / "agent.toml"
    config.write_text(
        f"""node_name = "{NODE}"
listen = "127.0.0.1:{port}"
interval_seconds = 1.0
process_interval_seconds = 1.0

[simulate]
profile = "jetson-orin-nano"

[gateway]
addresses = ["127.0.0.1:{silent_port}", "127.0.0.1:{gateway.ssh_port}"]
known_hosts = "{pki.ca.known_hosts}"
key = "{creds.private_key}"
certificate = "{creds.certificate}"
backoff_initial_seconds = 0.2
backoff_max_seconds = 1.0
connect_timeout_seconds = 2.0

[spool]
directory = "{tmp_path / "spool"}"
"""
    )
    agent = Process(
        "agent on 3.10",
        [str(py310 / "edge-agent"), "run", "--config", str(config)],
        tmp_path / "agent.log",
        clean_env("EDGE_AGENT_"),
    )
    procs = [gateway, agent]
    try:
        gateway.start()
        wait_until(gateway.ready, 60, "gateway ready")
        agent.start()

        def shown() -> bool:
            text = gateway.metrics()
            return 'DCGM_FI_DEV_GPU_UTIL{gpu="0"' in text and f'Hostname="{NODE}"' in text

        wait_until(shown, 60, "the 3.10 agent's series on the gateway")
        series = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        assert 'backend="simulated-jetson"' in series
        log = (tmp_path / "agent.log").read_text()
        # the silent gateway's SSH handshake timed out (async-timeout on 3.10) and was
        # handled as any failed dial: the agent went on to the next address
        assert f"gateway 127.0.0.1:{silent_port} failed" in log, log
        assert "Traceback" not in log, log
    finally:
        for p in procs:
            p.stop()
    assert sys.version_info >= (3, 11)  # the gateway (this side) runs on 3.11


def test_the_installer_makes_the_services_venv_on_python310(src310: Path, tmp_path: Path) -> None:
    """JetPack 6's path: ``--python`` a 3.10 (here a copy of this machine's, where the
    service could see it: the installer refuses one under /root or /home, which the unit's
    ProtectHome hides)."""
    python = Path(_python310())
    prefix = Path(
        subprocess.run(
            [str(python), "-c", "import os, sys; print(os.path.realpath(sys.base_prefix))"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    if str(prefix).startswith(("/root/", "/home/")):
        copy = tmp_path / "python3.10"
        shutil.copytree(prefix, copy, symlinks=True)
        python = copy / python.resolve().relative_to(prefix)
    wheel = build_wheel(src310, tmp_path / "wheels")
    root = tmp_path / "root"
    proc = subprocess.run(
        [
            "bash",
            str(REPO / "deploy" / "install-edge-agent.sh"),
            "--root",
            str(root),
            "--node",
            "orin-nano-1",
            "--python",
            str(python),
            "--source",
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    venv = root / "opt" / "edge-gpu-relay" / "venv"
    assert "created    " in proc.stdout and "Python 3.10" in proc.stdout, proc.stdout
    version = subprocess.run(
        [str(venv / "bin" / "edge-agent"), "--version"], capture_output=True, text=True, check=True
    )
    assert version.stdout.strip().startswith("edge-agent ")
    assert list(venv.glob("lib/python3.10/site-packages/tomli*")), "the 3.10 backport"
