"""Run the agent binary with NVML answers replayed, for ``bench/agent_binary.py --replay``.

``python bench/replayed_agent.py run --config FILE`` is ``python -m edge_agent run --config
FILE`` except that the simulator is wrapped in :class:`bench.agent_cycle.ReplayNvml`: each
NVML call with the same arguments is answered from a cache filled by its first answer, so
the process's CPU is the agent's own (tunnel, spool, encoders, event loop, threads) plus a
dict lookup per call, with the simulator's Python cost left out. Event waits and GPM
sample buffers stay real. The values then stop changing after the first cycle, which
makes each batch smaller than on a real box: bench/agent_binary.py prints this figure
beside the plain simulator's, where every value moves.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import edge_agent.sim.nvml as simnvml
from bench.agent_cycle import ReplayNvml


def main() -> None:
    simulated = simnvml.SimulatedNvml

    def replayed(*args: Any, **kwargs: Any) -> Any:
        return ReplayNvml(simulated(*args, **kwargs))

    simnvml.SimulatedNvml = replayed  # type: ignore[assignment,misc]
    sys.argv = ["edge_agent", *sys.argv[1:]]
    runpy.run_module("edge_agent", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
