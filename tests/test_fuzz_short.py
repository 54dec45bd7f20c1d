"""A short coverage-guided fuzz of each target in fuzz/ (atheris): the frame decoder, the
record decoder, the proxy's HTTP handling, the ingest path and the agent's HTTP server.
``make fuzz`` runs them longer; see fuzz/run.py.

Skips without atheris (it has wheels for Linux x86-64 only), but fails instead when CI
sets EDGE_GPU_RELAY_REQUIRE_ATHERIS=1, as tests/conftest.py's ``required_tool`` does."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TARGETS = ("frames", "records", "proxy_http", "ingest", "agent_http")
SECONDS = 15  # per target; with start-up, about 90 s for all five on a 2-core box


@pytest.fixture(scope="module")
def atheris_present() -> None:
    if importlib.util.find_spec("atheris") is None:
        msg = "atheris is not installed (pip install atheris; Linux x86-64 wheels only)"
        if os.environ.get("EDGE_GPU_RELAY_REQUIRE_ATHERIS") == "1":
            pytest.fail(f"{msg}; EDGE_GPU_RELAY_REQUIRE_ATHERIS=1 makes this a failure")
        pytest.skip(msg)


@pytest.mark.parametrize("target", TARGETS)
def test_fuzz_target_finds_no_crash(atheris_present: None, target: str, tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "fuzz" / "run.py"),
            "--seconds",
            str(SECONDS),
            "--workdir",
            str(tmp_path),
            target,
        ],
        capture_output=True,
        text=True,
        timeout=SECONDS + 120,
        check=False,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = proc.stdout.splitlines()[-1]
    assert summary.startswith(target) and " crashes 0 " in summary, proc.stdout
    executions = int(summary.split()[1])
    assert executions > 100, summary  # it did fuzz, not only start
