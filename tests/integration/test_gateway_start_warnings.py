"""What the gateway says at start about settings that leave it weaker than the operator
thinks (issue 24, item 10): an open-file limit too small for http.max_connections, and
no revocation file (``certs revoke`` then changes nothing on it)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from harness.fleet import make_pki
from harness.services import GatewayProc
from harness.waiting import wait_until


def test_a_small_fd_limit_and_no_revocation_file_are_said_at_start(tmp_path: Path) -> None:
    prlimit = shutil.which("prlimit")
    if prlimit is None:
        pytest.fail("prlimit (util-linux) is needed: .ci/run installs it")
    pki = make_pki(tmp_path)
    gw = GatewayProc(pki, tmp_path)
    config = tmp_path / "gateway.toml"
    text = config.read_text()
    assert re.search(r"^revocation_file = ", text, re.M)
    config.write_text(re.sub(r"^revocation_file = .*\n", "", text, flags=re.M))
    gw.argv = [prlimit, "--nofile=1024:1024", "--", *gw.argv]
    gw.start()
    try:
        wait_until(gw.ready, 60, "gateway ready", alive=[gw])
        log = gw.log.read_text()
    finally:
        gw.stop()
    assert "WARNING cloud_gateway: open-file limit 1024" in log, log
    assert "taking at most 480 HTTP connections" in log, log
    assert "no [ssh] revocation_file: `cloud-gateway certs revoke` cannot take effect" in log
