"""``log_format = "json"`` on a real gateway process: while an agent connects, sends and the
gateway shuts down, every line of its log is one JSON object, and the node's lines name it."""

from __future__ import annotations

import json
import re
from pathlib import Path

from harness.fleet import make_pki
from harness.services import AgentProc, GatewayProc
from harness.waiting import wait_until

NODE = "edge-json"
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
