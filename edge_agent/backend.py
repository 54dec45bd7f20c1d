"""Which GPU backend a collection reads, opened at startup: real NVML, a Jetson's kernel
files, or a simulator of either, said loudly (``[gpu] backend``, ``--simulate``).

:func:`open_backend` chooses (``auto``: NVML, unless this is a Jetson whose NVML lists no
discrete GPU); :func:`edge_agent.pipeline.build_pipeline` builds the collectors on what
it opened.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import tempfile
from collections.abc import Callable
from contextlib import ExitStack, suppress
from dataclasses import dataclass, field
from pathlib import Path

from edge_agent.config import AgentConfig
from edge_agent.errors import NvmlUnavailable
from edge_agent.jetson.board import read_board
from edge_agent.jetson.files import JetsonRoots
from edge_agent.nvml.backend import NvmlLib, open_real, text
from edge_agent.sim.profiles import DEFAULT_PROFILE, profile_named

log = logging.getLogger("edge_agent")

JETSON_BANNER = (
    "*** SIMULATED JETSON: board {board} ({model}), a fake L4T tree at {root}. These values "
    "are synthetic, not read from a board; "
    'gpurelay_agent_info{{backend="simulated-jetson"}} says so. ***'
)
SIMULATION_BANNER = (
    "*** SIMULATED GPUs: machine profile {profile} ({summary}), {n} simulated GPU(s), "
    "seed {seed}{mig}. These values are synthetic, not read from hardware; "
    'gpurelay_agent_info{{backend="simulated"}} says so. ***'
)


@dataclass
class Backend:
    lib: NvmlLib | None  # None: a Jetson's files (``jetson``)
    name: str  # nvml, simulated, jetson, simulated-jetson
    cfg: AgentConfig  # with attribution paths pointed at the fake host when simulating
    scratch: tempfile.TemporaryDirectory[str] | None = None
    on_close: list[Callable[[], None]] = field(default_factory=list)  # the simulated kubelet
    jetson: JetsonRoots | None = None  # where the Jetson's files are read

    def close(self) -> None:
        """Give back what opening took: the simulated kubelet, NVML, the temporary tree
        (called by :meth:`~edge_agent.pipeline.Pipeline.close`, or by
        :func:`~edge_agent.pipeline.build_pipeline` when the pipeline cannot be built)."""
        for close in reversed(self.on_close):
            with suppress(Exception):
                close()
        if self.lib is not None:
            with suppress(Exception):
                self.lib.nvmlShutdown()
        if self.scratch is not None:
            self.scratch.cleanup()


def open_backend(cfg: AgentConfig) -> Backend:
    """The backend ``cfg`` asks for (``[gpu] backend``, ``--simulate``), opened."""
    if cfg.simulate.enabled and cfg.simulate.jetson:
        return _simulated_jetson(cfg)
    if cfg.simulate.enabled:
        return _simulated_nvml(cfg)
    roots = JetsonRoots.under(cfg.gpu.host_root)
    if cfg.gpu.backend == "jetson":
        board = jetson_board(roots)
        if not board:
            log.warning(
                "gpu.backend is jetson, but %s shows no L4T release and no Tegra SoC: "
                "this does not look like a Jetson",
                cfg.gpu.host_root,
            )
        return Backend(None, "jetson", cfg, jetson=roots)
    if cfg.gpu.backend == "nvml":
        return Backend(open_real(), "nvml", cfg)
    return _auto(cfg, roots)


def jetson_board(roots: JetsonRoots) -> str:
    """What makes this host a Jetson ("" if nothing does): an L4T release in
    ``/etc/nv_tegra_release`` or an NVIDIA Tegra SoC in the device tree. Not the GPU's
    devfreq node: ``gpu`` names Mali and Adreno GPUs' nodes too, and nvgpu (a module on
    r36) may load after the agent; the collector looks for the node every cycle."""
    board = read_board(roots.proc_root, roots.etc_root, roots.sys_root)
    if board.l4t:
        return f"L4T {board.l4t}"
    return board.soc if board.soc.startswith("tegra") else ""


def _auto(cfg: AgentConfig, roots: JetsonRoots) -> Backend:
    """NVML, unless this is a Jetson whose NVML lists no GPU but its integrated one (or
    none): then the Jetson's files, which tell far more (docs/jetson.md)."""
    board = jetson_board(roots)
    if not board:  # not a Jetson: NVML, or NVML's own error
        return Backend(open_real(), "nvml", cfg)
    try:
        lib = open_real()
    except NvmlUnavailable as exc:
        log.info("gpu.backend auto: the Jetson backend (%s; NVML: %s)", board, exc)
        return Backend(None, "jetson", cfg, jetson=roots)
    names = _nvml_names(lib)
    if names and not all(integrated(n) for n in names):
        log.info("gpu.backend auto: NVML, which lists %s on this Jetson", ", ".join(names))
        return Backend(lib, "nvml", cfg)
    with suppress(Exception):
        lib.nvmlShutdown()
    log.info(
        "gpu.backend auto: the Jetson backend (%s; NVML lists %s)",
        board,
        ", ".join(names) or "no GPU",
    )
    return Backend(None, "jetson", cfg, jetson=roots)


def integrated(name: str) -> bool:
    """NVML's name of a Jetson's integrated GPU (JetPack 6 says ``Orin (nvgpu)``)."""
    return "nvgpu" in name.lower()


def _nvml_names(lib: NvmlLib) -> list[str]:
    try:
        return [
            text(lib.nvmlDeviceGetName(lib.nvmlDeviceGetHandleByIndex(i)))
            for i in range(lib.nvmlDeviceGetCount())
        ]
    except Exception as exc:  # an NVML that answers nothing useful: as good as none
        log.info("gpu.backend auto: NVML cannot list GPUs here (%s)", exc)
        return []


def _simulated_jetson(cfg: AgentConfig) -> Backend:
    """A fake board's tree (edge_agent.sim.jetson) and a fake host for its nvmap clients."""
    from edge_agent.sim import host as simhost
    from edge_agent.sim import jetson as simjetson

    board, seed = cfg.simulate.profile, cfg.simulate.seed
    with ExitStack() as undo:  # a failure on the way leaves no tree behind
        scratch = tempfile.TemporaryDirectory(prefix="edge-agent-simjetson-")
        undo.callback(scratch.cleanup)
        root = Path(scratch.name)
        tree = simjetson.build(root, board)
        if cfg.simulate.fake_host:  # the nvmap clients' /proc/<pid>, in the board's /proc
            pids = simjetson.client_pids(board)
            host = simhost.build(root, pids, seed)
            cfg = dataclasses.replace(
                cfg, attribution=simhost.attribution_config(host, cfg.attribution)
            )
        model = simjetson.BOARDS[board].model
        _say(cfg, JETSON_BANNER.format(board=board, model=model, root=root))
        undo.pop_all()
    return Backend(
        None,
        "simulated-jetson",
        cfg,
        scratch,
        jetson=JetsonRoots(tree.sys_root, tree.proc_root, tree.etc_root, tree.var_root),
    )


def _say(cfg: AgentConfig, banner: str) -> None:
    if cfg.log_format == "json":  # every line of stderr is then a JSON object
        log.warning("%s", banner)
    else:
        print(banner, file=sys.stderr, flush=True)


def _simulated_nvml(cfg: AgentConfig) -> Backend:
    from edge_agent.sim import host as simhost
    from edge_agent.sim.nvml import SimulatedNvml

    sim_cfg = cfg.simulate
    machine = profile_named(sim_cfg.profile or DEFAULT_PROFILE)
    gpus = sim_cfg.gpus or machine.gpus
    pids = None
    scratch = None
    with ExitStack() as undo:  # a failure on the way leaves no tree or kubelet behind
        if sim_cfg.fake_host:
            scratch = tempfile.TemporaryDirectory(prefix="edge-agent-simhost-")
            undo.callback(scratch.cleanup)
            pids = simhost.default_pids(gpus * sim_cfg.processes_per_gpu, sim_cfg.seed)
            host = simhost.build(Path(scratch.name), pids, sim_cfg.seed)
            attribution = simhost.attribution_config(host, cfg.attribution)
            cfg = dataclasses.replace(cfg, attribution=attribution)
        sim = SimulatedNvml(
            gpus,
            seed=sim_cfg.seed,
            mig=sim_cfg.mig,
            processes_per_gpu=sim_cfg.processes_per_gpu,
            profile=machine if sim_cfg.profile else None,
            pids=pids,
        )
        sim.nvmlInit()
        undo.callback(sim.nvmlShutdown)
        stop_kubelet = None
        if sim_cfg.fake_host:
            from edge_agent.sim import kubelet as simkubelet

            cfg, stop_kubelet = simkubelet.attach(cfg, host, sim)
            if stop_kubelet is not None:
                undo.callback(stop_kubelet)
        mig_gpus = sim.profile.mig_gpus
        mig = f", MIG on GPU {', '.join(map(str, mig_gpus))}" if mig_gpus else ""
        banner = SIMULATION_BANNER.format(
            profile=machine.name, summary=machine.summary, n=gpus, seed=sim_cfg.seed, mig=mig
        )
        _say(cfg, banner)
        if scratch is not None:
            log.info("simulated processes live in a fake host tree at %s", scratch.name)
        undo.pop_all()
    return Backend(sim, "simulated", cfg, scratch, [stop_kubelet] if stop_kubelet else [])
