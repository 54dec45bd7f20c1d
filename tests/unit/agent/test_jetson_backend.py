"""The Jetson as a backend (issue 28): ``[gpu] backend`` and its detection, the nvpmodel
power mode, the nvmap process collector and its attribution, and the whole pipeline on a
fake board, simulated or read as a host's files (``host_root``).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from edge_agent import backend as backends
from edge_agent import cli, pipeline
from edge_agent.config import AgentConfig, GpuConfig, KubernetesConfig, SimulateConfig, load
from edge_agent.errors import ConfigError, NvmlUnavailable
from edge_agent.jetson.board import PowerMode, read_power_mode
from edge_agent.jetson.files import JetsonRoots, Missing
from edge_agent.sim import host as simhost
from edge_agent.sim.jetson import BOARDS, build, client_pids
from gpurelay.model import MIB, Snapshot

NODE = "orin-7"


def samples(snap: Snapshot, name: str) -> list[tuple[dict[str, str], float]]:
    return [(dict(s.labels), s.value) for s in snap.samples if s.name == name]


# -- nvpmodel ---------------------------------------------------------------------------


def test_power_mode_is_the_status_file_named_by_the_conf(tmp_path: Path) -> None:
    tree = build(tmp_path, "jetson-xavier")  # status pmode:0003
    assert read_power_mode(tree.etc_root, tree.var_root) == PowerMode("3", "MODE_30W_ALL", "status")


def test_power_mode_without_status_is_the_conf_default(tmp_path: Path) -> None:
    tree = build(tmp_path, "jetson-orin-nano")  # nvpmodel never run: no status file
    assert read_power_mode(tree.etc_root, tree.var_root) == PowerMode("0", "15W", "default")
    status = tree.var_root / "lib" / "nvpmodel" / "status"
    status.parent.mkdir(parents=True)
    status.write_text("garbage\n")  # not a pmode line: the default still holds
    assert read_power_mode(tree.etc_root, tree.var_root) == PowerMode("0", "15W", "default")


def test_power_mode_without_the_conf(tmp_path: Path) -> None:
    tree = build(tmp_path, "jetson-orin")  # pmode:0000
    (tree.etc_root / "nvpmodel.conf").unlink()
    assert read_power_mode(tree.etc_root, tree.var_root) == PowerMode("0", "", "status")
    shutil.rmtree(tree.var_root / "lib" / "nvpmodel")
    missing = read_power_mode(tree.etc_root, tree.var_root)
    assert isinstance(missing, Missing) and missing.reason == "absent"
    assert missing.path.name == "nvpmodel.conf"


# -- backend choice ---------------------------------------------------------------------


class FakeNvml:
    """NVML as a Jetson or an IGX with a discrete card answers it: the names only."""

    def __init__(self, names: list[str]) -> None:
        self.names, self.shut = names, False

    def nvmlDeviceGetCount(self) -> int:
        return len(self.names)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, handle: int) -> str:
        return self.names[handle]

    def nvmlShutdown(self) -> None:
        self.shut = True


def host_cfg(root: Path, backend: str = "auto") -> AgentConfig:
    return AgentConfig(node_name=NODE, gpu=GpuConfig(backend=backend, host_root=root))


@pytest.mark.parametrize(
    ("names", "chosen"),
    [
        (None, "jetson"),  # no NVML at all (JetPack 5: no libnvidia-ml)
        ([], "jetson"),
        (["Orin (nvgpu)"], "jetson"),  # JetPack 6's NVML: the iGPU, answering little
        (["Orin (nvgpu)", "NVIDIA RTX A6000"], "nvml"),  # IGX Orin with a discrete card
    ],
)
def test_auto_chooses_jetson_on_a_board_unless_nvml_has_a_discrete_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, names: list[str] | None, chosen: str
) -> None:
    build(tmp_path, "jetson-orin")
    fake = FakeNvml(names or [])

    def open_real() -> Any:
        if names is None:
            raise NvmlUnavailable("libnvidia-ml.so.1: cannot open shared object file")
        return fake

    monkeypatch.setattr(backends, "open_real", open_real)
    backend = backends.open_backend(host_cfg(tmp_path))
    assert backend.name == chosen
    assert (backend.lib is fake) == (chosen == "nvml")
    assert fake.shut == (chosen == "jetson" and names is not None)  # NVML let go
    if chosen == "jetson":
        assert backend.jetson == JetsonRoots.under(tmp_path)


def test_auto_off_a_jetson_is_nvml_and_its_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def open_real() -> Any:
        raise NvmlUnavailable("NVML Shared Library Not Found")

    monkeypatch.setattr(backends, "open_real", open_real)
    with pytest.raises(NvmlUnavailable, match="Not Found"):
        backends.open_backend(host_cfg(tmp_path))  # an empty root: no GPU devfreq node


def test_auto_on_a_jetson_whose_gpu_driver_is_not_loaded_yet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """nvgpu is a module on r36 and may load after the agent: the board is a Jetson by its
    L4T release, so auto does not fall back to NVML's error (the collector looks for the
    GPU's node every cycle)."""
    tree = build(tmp_path, "jetson-orin-nano")
    shutil.rmtree(tree.sys_root / "class" / "devfreq")

    def open_real() -> Any:
        raise NvmlUnavailable("libnvidia-ml.so.1: cannot open shared object file")

    monkeypatch.setattr(backends, "open_real", open_real)
    assert backends.open_backend(host_cfg(tmp_path)).name == "jetson"


def test_auto_on_another_arm_board_with_a_gpu_node_is_nvml(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Mali GPU's devfreq node is named ``gpu`` too: without an L4T release or a Tegra
    SoC the board is not a Jetson, and auto gives NVML's own error."""
    device = tmp_path / "sys" / "devices" / "platform" / "fb000000.gpu"
    (device / "of_node").mkdir(parents=True)
    (device / "of_node" / "name").write_text("gpu\x00")
    (device / "load").write_text("120\n")
    node = tmp_path / "sys" / "class" / "devfreq" / "fb000000.gpu"
    node.mkdir(parents=True)
    (node / "device").symlink_to(device)
    dt = tmp_path / "sys" / "firmware" / "devicetree" / "base"
    dt.mkdir(parents=True)
    (dt / "compatible").write_bytes(b"radxa,rock-5b\x00rockchip,rk3588\x00")

    def open_real() -> Any:
        raise NvmlUnavailable("NVML Shared Library Not Found")

    monkeypatch.setattr(backends, "open_real", open_real)
    with pytest.raises(NvmlUnavailable):
        backends.open_backend(host_cfg(tmp_path))


def test_backend_is_validated(tmp_path: Path) -> None:
    (tmp_path / "a.toml").write_text('[gpu]\nbackend = "tegra"\n')
    with pytest.raises(ConfigError, match=r"gpu\.backend must be one of auto, nvml, jetson"):
        load(tmp_path / "a.toml", {})
    cfg = load(None, {"EDGE_AGENT_GPU_BACKEND": "jetson", "EDGE_AGENT_GPU_HOST_ROOT": "/host"})
    assert cfg.gpu == GpuConfig(backend="jetson", host_root=Path("/host"))


def test_simulate_names_a_board_with_one_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [k for k in os.environ if k.startswith("EDGE_AGENT_")]:
        monkeypatch.delenv(name)  # the command line alone decides here
    parse = cli._parser().parse_args
    cfg = cli._config(parse(["once", "--simulate", "jetson-orin"]))
    assert cfg.simulate.jetson and cfg.simulate.profile == "jetson-orin"
    assert cli._config(parse(["once", "--simulate", "jetson-xavier:1"])).simulate.jetson
    with pytest.raises(ConfigError, match="one integrated GPU"):
        cli._config(parse(["once", "--simulate", "jetson-orin:2"]))
    with pytest.raises(ConfigError, match="jetson-orin-nano"):  # the known list
        cli._config(parse(["once", "--simulate", "jetson-tx2"]))
    for nvml_only in (["--simulate-mig"], ["--simulate-pod-resources", "nvidia"]):
        args = parse(["once", "--simulate", "jetson-orin", *nvml_only])
        with pytest.raises(ConfigError, match="no MIG and no device-plugin allocation"):
            cli._config(args)


# -- the whole pipeline -------------------------------------------------------------------


def test_a_hosts_jetson_files_through_the_pipeline(tmp_path: Path) -> None:
    """``backend = "jetson"`` with ``host_root``: the board's files and its processes,
    attributed through the host's /proc like NVML's."""
    tree = build(tmp_path, "jetson-orin")
    pids = client_pids("jetson-orin")
    host = simhost.build(tmp_path, pids)
    cfg = host_cfg(tmp_path, "jetson")
    cfg = dataclasses.replace(cfg, attribution=simhost.attribution_config(host, cfg.attribution))
    p = pipeline.build_pipeline(backends.open_backend(cfg))
    try:
        snap = p.collection.collect()
    finally:
        p.close()
    assert p.backend == "jetson" and p.lib is None and p.xid is None
    assert p.driver_version == "35.4.1"
    procs = samples(snap, "DCGM_CUSTOM_PROCESS_MEM_USED")
    sizes = {pid: kb for _, _, pid, kb in BOARDS["jetson-orin"].nvmap_clients if pid}
    assert {int(labels["ProcessId"]): v for labels, v in procs} == {
        pid: kb * 1024 / MIB for pid, kb in sizes.items()
    }
    for labels, _ in procs:
        namespace, pod, container = host.pods[int(labels["ProcessId"])]
        assert (labels["NamespaceName"], labels["PodName"]) == (namespace, pod)
        assert labels["ContainerName"] == container and labels["ProcessType"] == "nvmap"
        assert labels["UUID"] == snap.gpus[0].uuid and labels["gpu"] == "0"
    containers = samples(snap, "DCGM_CUSTOM_CONTAINER_MEM_USED")
    assert sorted(v for _, v in containers) == sorted(v for _, v in procs)  # one each
    assert not samples(snap, "DCGM_CUSTOM_PROCESS_SM_UTIL")  # not measured: absent, not 0
    info = samples(snap, "gpurelay_agent_info")
    assert info[0][0]["backend"] == "jetson"
    assert tree.sys_root.is_dir()


def test_without_debugfs_processes_are_degraded_not_guessed(tmp_path: Path) -> None:
    tree = build(tmp_path, "jetson-orin")
    shutil.rmtree(tree.sys_root / "kernel" / "debug")  # not mounted, or the agent not root
    p = pipeline.build_pipeline(backends.open_backend(host_cfg(tmp_path, "jetson")))
    try:
        snap = p.collection.collect()
    finally:
        p.close()
    assert not samples(snap, "DCGM_CUSTOM_PROCESS_MEM_USED")
    (degraded,) = [labels for labels, _ in samples(snap, "gpurelay_agent_degraded")]
    assert degraded["part"] == "process_list" and "absent" in degraded["reason"]
    assert samples(snap, "DCGM_FI_DEV_FB_USED")  # the board's total still read


def test_simulated_jetson_is_labelled_and_cleans_up(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = AgentConfig(node_name=NODE, simulate=SimulateConfig(profile="jetson-orin-nano"))
    p = pipeline.build_pipeline(backends.open_backend(cfg))
    scratch = Path(p.scratch.name) if p.scratch else None
    try:
        snap = p.collection.collect()
    finally:
        p.close()
    assert "SIMULATED JETSON: board jetson-orin-nano" in capsys.readouterr().err
    assert samples(snap, "gpurelay_agent_info")[0][0]["backend"] == "simulated-jetson"
    (proc,) = samples(snap, "DCGM_CUSTOM_PROCESS_MEM_USED")
    assert proc[0]["PodName"] and proc[1] == 1_024_000 * 1024 / MIB
    assert scratch is not None and not scratch.exists()


def test_dcgm_49_names_on_a_jetson_are_exact(tmp_path: Path) -> None:
    """``dcgm_naming = "4.9"``: 4.9's names, each from the files' integers (not 4.8's
    rounded MiB or % times a factor), and 4.9's driver label."""
    spec = BOARDS["jetson-orin"]
    build(tmp_path, "jetson-orin")
    cfg = dataclasses.replace(host_cfg(tmp_path, "jetson"), dcgm_naming="4.9")
    p = pipeline.build_pipeline(backends.open_backend(cfg))
    try:
        snap = p.collection.collect()
    finally:
        p.close()
    one = {s.name: (dict(s.labels), s.value) for s in snap.samples}
    assert one["DCGM_FI_DEV_GPU_UTIL_RATIO"][1] == spec.gpu_load_per_mille / 1000
    assert one["DCGM_FI_DEV_SM_CLOCK_HERTZ"][1] == spec.gpu_hz[0]
    assert one["DCGM_FI_DEV_FB_USED_BYTES"][1] == spec.nvmap_used_kb * 1024  # type: ignore[operator]
    assert one["DCGM_FI_DEV_FB_CAPACITY_BYTES"][1] == spec.mem_total_kb * 1024
    assert one["DCGM_FI_DEV_GPU_UTIL_RATIO"][0]["DCGM_FI_SYSTEM_DRIVER_VERSION"] == "35.4.1"
    assert not {"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED"} & one.keys()
    declared = {f.name for f in snap.families}
    assert "DCGM_FI_DEV_FB_RESERVED_BYTES" in declared and "DCGM_FI_DEV_FB_USED" not in declared


def test_a_pipeline_that_cannot_be_built_gives_its_backend_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure after the backend was opened (here: the kubelet API's CA cannot be read)
    leaves no simulated board tree behind."""
    cfg = AgentConfig(
        node_name=NODE,
        simulate=SimulateConfig(profile="jetson-orin"),
        kubernetes=KubernetesConfig(
            pod_labels=("app",),
            api_server="https://127.0.0.1:6443",
            token_file=tmp_path / "token",
            ca_file=tmp_path / "no-such-ca.crt",
        ),
    )
    opened = backends.open_backend(cfg)
    assert opened.scratch is not None
    scratch = Path(opened.scratch.name)
    assert scratch.is_dir()
    with pytest.raises(ConfigError, match="kubernetes"):
        pipeline.build_pipeline(opened)
    assert not scratch.exists()
