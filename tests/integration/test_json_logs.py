"""``log_format = "json"`` on the real binaries: while an agent connects, sends and the
gateway shuts down, every line of the gateway's log is one JSON object, and the node's
lines name it; every line the agent writes to stderr is one too."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from harness.fleet import make_pki
from harness.process import clean_env
from harness.services import AgentProc, GatewayProc
from harness.waiting import wait_until

NODE = "edge-json"
ROOT = Path(__file__).resolve().parents[2]
RFC3339_MS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def test_a_json_gateway_writes_only_json_lines(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    gateway = GatewayProc(pki, tmp_path, log_level="debug", log_format="json")
    agent = AgentProc(pki, tmp_path, NODE, gateway, spool_dir=tmp_path / "spool")
    try:
        gateway.start()
        wait_until(gateway.ready, 60, "gateway ready")
        agent.start()
        wait_until(lambda: agent.metric("gpurelay_agent_gateway_acked_seq") > 2, 60, "ACKs")
    finally:
        agent.stop()
        gateway.stop()
    text = gateway.log.read_text(encoding="utf-8")
    entries = []
    for number, line in enumerate(text.splitlines(), 1):
        entry = json.loads(line)  # a line that is not JSON fails here, with its number
        assert isinstance(entry, dict), (number, line)
        assert RFC3339_MS.match(entry["time"]), (number, line)
        assert entry["level"] in {"debug", "info", "warning", "error", "critical"}, line
        assert entry["logger"] and isinstance(entry["message"], str), line
        assert entry["gateway"], line  # the process's own field, on every line
        entries.append(entry)
    assert len(entries) > 5
    about_node = [e for e in entries if e.get("node") == NODE]
    assert about_node, "no line carries the node as a field"
    assert any(e["logger"].endswith(f".node.{NODE}") for e in about_node)


def test_a_json_agent_writes_only_json_lines(tmp_path: Path) -> None:
    """The agent binary too, simulation banner included: every stderr line is an object
    naming the node."""
    env = {**clean_env("EDGE_AGENT_"), "EDGE_AGENT_LOG_FORMAT": "json"}
    env.pop("JOURNAL_STREAM", None)
    done = subprocess.run(
        [sys.executable, "-m", "edge_agent", "once", "--simulate", "1", "--node-name", NODE],
        cwd=tmp_path,
        env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    entries = [json.loads(line) for line in done.stderr.splitlines()]
    assert entries and all(e["node"] == NODE for e in entries)
    assert any("SIMULATED GPUs" in e["message"] and e["level"] == "warning" for e in entries)
    assert "DCGM_FI_DEV_GPU_UTIL" in done.stdout  # the collection, untouched, on stdout
