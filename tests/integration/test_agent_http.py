"""The agent's local endpoints over real HTTP, and the agent binary as a process."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from edge_agent import http_server
from gpurelay.exposition import OPENMETRICS_CONTENT_TYPE, TEXT_CONTENT_TYPE
from harness.pipeline import make_pipeline
from harness.ports import free_ports
from tests.promtool_support import unexpected_findings


@pytest.fixture
async def served(tmp_path: Path):  # type: ignore[no-untyped-def]
    pipeline, _sim, clock = make_pipeline(tmp_path, gpus=2, mig=True)
    published = http_server.LatestSnapshot(clock=clock)
    runner, port = await http_server.start(published, "127.0.0.1", 0)
    try:
        yield published, pipeline, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
        pipeline.close()


async def test_endpoints_before_and_after_first_collection(served) -> None:  # type: ignore[no-untyped-def]
    published, pipeline, base = served
    async with httpx.AsyncClient(base_url=base) as client:
        assert (await client.get("/metrics")).status_code == 503
        assert (await client.get("/healthz")).status_code == 503
        published.publish(pipeline.collection.collect())
        text = await client.get("/metrics")
        assert text.status_code == 200
        assert text.headers["content-type"] == TEXT_CONTENT_TYPE
        assert "DCGM_FI_DEV_FB_USED{" in text.text
        om = await client.get(
            "/metrics",
            headers={"Accept": "application/openmetrics-text;version=1.0.0,text/plain;q=0.5"},
        )
        assert om.headers["content-type"] == OPENMETRICS_CONTENT_TYPE
        assert om.text.endswith("# EOF\n")
        raw = await client.get("/metrics", headers={"Accept-Encoding": "gzip"})
        assert raw.headers["content-encoding"] == "gzip"
        assert raw.text == text.text  # httpx decoded it; same body
        health = await client.get("/healthz")
        assert health.status_code == 200 and "edge-node-1" in health.text
        bie = (await client.get("/v1/collect")).json()
        assert list(bie) == ["edge-node-1"]
        node = bie["edge-node-1"]
        assert node["deviceNum"] == 2 and len(node["devices"]) == 2
        assert node["usedMemory"] == sum(d["usedMemory"] for d in node["devices"])
        assert node["totalMemory"] == 2 * 85520809984
        assert node["percent"] == pytest.approx(node["usedMemory"] / node["totalMemory"])


async def test_healthz_goes_unhealthy_when_collection_stalls(served) -> None:  # type: ignore[no-untyped-def]
    published, pipeline, base = served
    published.publish(pipeline.collection.collect())
    published.clock.advance(published.max_age + 1)  # type: ignore[attr-defined]
    async with httpx.AsyncClient(base_url=base) as client:
        r = await client.get("/healthz")
    assert r.status_code == 503 and "ago" in r.text


def test_promtool_finds_nothing_but_the_compatible_names(tmp_path: Path, promtool: Path) -> None:
    pipeline, _sim, _ = make_pipeline(tmp_path, gpus=2, mig=True)
    published = http_server.LatestSnapshot()
    published.publish(pipeline.collection.collect())
    pipeline.close()
    for body in (published.body(False, False), gzip.decompress(published.body(False, True))):
        assert unexpected_findings(promtool, body) == []


def run_module(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m <args>``: one of our CLIs, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_agent_process_serves_and_stops_on_sigterm(tmp_path: Path) -> None:
    port = free_ports(1)[0]
    env = {**os.environ, "KUBE_NODE_NAME": "bie-node-7"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "edge_agent",
            "run",
            "--simulate",
            "2",
            "--listen",
            f"127.0.0.1:{port}",
            "--interval",
            "0.2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2)
                if r.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert (
            'gpurelay_agent_info{version="0.1.0",backend="simulated",Hostname="bie-node-7"} 1'
            in r.text
        )
        deadline = time.monotonic() + 10
        while True:  # the loop keeps collecting (every 0.2 s)
            again = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
            cycles = [
                float(line.split()[-1])
                for line in again.splitlines()
                if line.startswith("gpurelay_agent_collections_total ")
            ]
            if cycles and cycles[0] >= 2:
                break
            assert proc.poll() is None and time.monotonic() < deadline, cycles
            time.sleep(0.1)
        bie = httpx.get(f"http://127.0.0.1:{port}/v1/collect", timeout=2).json()
        assert list(bie) == ["bie-node-7"]
    finally:
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert "SIMULATED GPUs" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("fmt", ["prometheus", "json", "bie"])
def test_once_formats(fmt: str) -> None:
    proc = run_module("edge_agent", "once", "--simulate", "1", "--format", fmt, "--node-name", "n1")
    assert proc.returncode == 0, proc.stderr
    if fmt == "prometheus":
        assert "# TYPE DCGM_FI_DEV_GPU_UTIL gauge" in proc.stdout
    elif fmt == "json":
        doc = json.loads(proc.stdout)
        assert doc["node"] == "n1" and doc["gpus"][0]["uuid"].startswith("GPU-")
        assert any(s["name"] == "DCGM_CUSTOM_PROCESS_SM_UTIL" for s in doc["samples"])
    else:
        assert json.loads(proc.stdout)["n1"]["deviceNum"] == 1


@pytest.mark.parametrize("board", ["jetson-orin", "jetson-orin-nano", "jetson-xavier"])
def test_once_on_a_simulated_jetson(board: str, promtool: Path) -> None:
    """Issue 28's "done when": the Jetson's series, promtool-clean, and BIE's memory as
    docs/jetson.md defines it (nvmap's use of the board's RAM, in bytes)."""
    from edge_agent.sim.jetson import BOARDS

    spec = BOARDS[board]
    text = run_module("edge_agent", "once", "--simulate", board, "--node-name", "j1")
    assert text.returncode == 0, text.stderr
    assert f"SIMULATED JETSON: board {board}" in text.stderr
    assert unexpected_findings(promtool, text.stdout.encode()) == []
    for name in (
        "DCGM_FI_DEV_GPU_UTIL",
        "DCGM_FI_DEV_SM_CLOCK",
        "DCGM_FI_DEV_GPU_TEMP",
        "DCGM_FI_DEV_FB_USED",
        "gpurelay_jetson_board_info",
        "gpurelay_jetson_power_mode_info",
        "gpurelay_jetson_emc_clock_hertz",
        "gpurelay_jetson_temperature_celsius",
        "gpurelay_jetson_rail_power_watts",
        "DCGM_CUSTOM_PROCESS_MEM_USED",
    ):
        assert f"\n{name}{{" in text.stdout, name
    bie = run_module(
        "edge_agent", "once", "--simulate", board, "--format", "bie", "--node-name", "j1"
    )
    assert bie.returncode == 0, bie.stderr
    node = json.loads(bie.stdout)["j1"]
    used_kb = spec.nvmap_used_kb or sum(kb for *_, kb in spec.nvmap_clients)
    assert node["devices"] == [
        {
            "usedMemory": used_kb * 1024,
            "totalMemory": spec.mem_total_kb * 1024,
            "percent": used_kb / spec.mem_total_kb,
        }
    ]


def test_bad_config_exits_2_with_one_line(tmp_path: Path) -> None:
    cfg = tmp_path / "a.toml"
    cfg.write_text("listen = 5\n")
    proc = run_module("edge_agent", "once", "--config", str(cfg))
    assert proc.returncode == 2
    assert proc.stderr.strip() == "edge-agent: error: listen must be of type str, got 5"


def test_gateway_cli_errors_are_one_line(tmp_path: Path) -> None:
    cfg = tmp_path / "gw.toml"
    cfg.write_text("[ssh]\nlisten = 'nope'\n")
    proc = run_module("cloud_gateway", "run", "--config", str(cfg))
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "cloud-gateway: error: ssh.listen 'nope' must look like HOST:PORT"
    )
    missing_ca = tmp_path / "gw2.toml"
    missing_ca.write_text(f"[ssh]\nuser_ca = '{tmp_path / 'nope.pub'}'\n")
    proc = run_module("cloud_gateway", "run", "--config", str(missing_ca))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "ssh.user_ca" in proc.stderr


def test_sighup_reloads_what_is_safe_and_names_the_rest(tmp_path: Path) -> None:
    port = free_ports(1)[0]
    cfg = tmp_path / "agent.toml"
    cfg.write_text(f'listen = "127.0.0.1:{port}"\ninterval_seconds = 30\n')
    proc = subprocess.Popen(
        [sys.executable, "-m", "edge_agent", "run", "--simulate", "1", "--config", str(cfg)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )

    def cycles() -> float:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
        return next(
            float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith("gpurelay_agent_collections_total ")
        )

    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                first = cycles()
                break
            except (httpx.TransportError, StopIteration):
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.1)
        cfg.write_text(
            f'listen = "127.0.0.1:{port + 1}"\ninterval_seconds = 0.2\nlog_level = "debug"\n'
        )
        proc.send_signal(signal.SIGHUP)
        # the new interval is in force, on the old port: 3 more cycles within 10 s, where
        # the old interval (30 s) gives none (polled: the process may be slow to reload)
        deadline = time.monotonic() + 10
        while cycles() < first + 3:
            assert proc.poll() is None and time.monotonic() < deadline, (first, cycles())
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=20)
    assert "configuration reloaded: log level debug, interval 0.2s" in err
    assert "restart to apply: listen" in err
