"""The whole /metrics body for a fixed simulator seed and clock, diffed against a file.

Regenerate after an intended change with: UPDATE_GOLDEN=1 make test (then review the diff).
"""

from __future__ import annotations

import os
from pathlib import Path

from gpurelay.exposition import render_text
from harness.pipeline import make_pipeline

GOLDEN = Path(__file__).parent.parent.parent / "golden" / "metrics-seed7-2gpu-mig.prom"


def test_metrics_match_golden_file(tmp_path: Path) -> None:
    pipeline, _sim, clock = make_pipeline(tmp_path, gpus=2, mig=True, seed=7)
    try:
        pipeline.collection.collect()
        clock.advance(10)
        body = render_text(pipeline.collection.collect()).decode()
    finally:
        pipeline.close()
    if os.environ.get("UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(body)
    expected = GOLDEN.read_text()
    assert body == expected, "metrics differ from the golden file (UPDATE_GOLDEN=1 to accept)"
