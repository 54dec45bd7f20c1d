"""`promtool check metrics`, minus the findings that are the compatibility contract.

promtool's linter flags things that *are* the contract: the label names dcgm-exporter and
ACK use (modelName, NodeName, PodName, ...) are camelCase, dcgm-exporter's counters do not
end in _total, and one of its names is DCGM_FI_DEV_PCIE_REPLAY_COUNTER. Anything else,
and any finding at all about our own gpurelay_* metrics, is a real problem.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

INHERENT = re.compile(
    r"^(DCGM_\w+) (label names should be written in 'snake_case' not 'camelCase'"
    r'|counter metrics should have "_total" suffix)$'
    r"|^DCGM_FI_DEV_PCIE_REPLAY_COUNTER metric name should not include type 'counter'$"
)


def unexpected_findings(promtool: Path, body: bytes) -> list[str]:
    """What promtool reports beyond the inherent findings; [] when the body is clean."""
    proc = subprocess.run(
        [str(promtool), "check", "metrics"],
        input=body,
        capture_output=True,
        timeout=60,
        check=False,
    )
    out = (proc.stdout + proc.stderr).decode().strip().splitlines()
    if proc.returncode not in (0, 3):  # 1 is a parse error
        return [f"promtool exit {proc.returncode}", *out]
    return [line for line in out if not INHERENT.match(line)]
