"""The simulator's machine profiles and injected failures answer as real NVML and pynvml do.

What each check stands for is cited in edge_agent/sim/profiles.py (nvml.h, pynvml.py,
DCGM); docs/simulator.md says how to add a machine.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Iterator

import pynvml
import pytest

from edge_agent import cli
from edge_agent.backend import open_backend
from edge_agent.config import SimulateConfig, load
from edge_agent.errors import ConfigError
from edge_agent.nvml.devices import enumerate_gpus
from edge_agent.sim.nvml import SimulatedNvml
from edge_agent.sim.profiles import PROFILES
from harness.pipeline import FakeClock


def machine(profile: str, **kwargs: object) -> SimulatedNvml:
    sim = SimulatedNvml(profile=profile, clock=FakeClock(), **kwargs)  # type: ignore[arg-type]
    sim.nvmlInit()
    return sim


@pytest.fixture
def r470() -> Iterator[SimulatedNvml]:
    sim = machine("r470")
    yield sim
    sim.nvmlShutdown()


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_every_profile_starts_and_names_its_gpus(name: str) -> None:
    sim = machine(name)
    profile = PROFILES[name]
    assert sim.nvmlDeviceGetCount() == profile.gpus
    assert sim.nvmlSystemGetDriverVersion() == profile.driver_version
    devices, problems = enumerate_gpus(sim)
    assert [d.name for d in devices] == [profile.model] * profile.gpus
    refused = "nvmlDeviceGetMigDeviceHandleByIndex" in profile.errors
    assert [d.mig_enabled for d in devices] == [i in profile.mig_gpus for i in range(profile.gpus)]
    assert bool(problems) == (refused and bool(profile.mig_gpus))


def test_r470_has_no_v3_process_calls(r470: SimulatedNvml) -> None:
    handle = r470.nvmlDeviceGetHandleByIndex(0)
    for call in (
        r470.nvmlDeviceGetComputeRunningProcesses,
        r470.nvmlDeviceGetGraphicsRunningProcesses,
    ):
        with pytest.raises(pynvml.NVMLLibraryMismatchError) as caught:
            call(handle)
        assert not isinstance(caught.value, pynvml.NVMLError)  # as pynvml: not an NVMLError
    assert r470.nvmlDeviceGetComputeRunningProcesses_v2(handle)


def test_r470_has_memory_info_v1_only(r470: SimulatedNvml) -> None:
    handle = r470.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        r470.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
    v1 = r470.nvmlDeviceGetMemoryInfo(handle)
    assert v1.used + v1.free == v1.total  # v1's used includes the reserved memory
    assert v1.used >= PROFILES["r470"].reserved_memory


def test_r470_has_throttle_reasons_and_no_gpm(r470: SimulatedNvml) -> None:
    handle = r470.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        r470.nvmlDeviceGetCurrentClocksEventReasons(handle)
    assert isinstance(r470.nvmlDeviceGetCurrentClocksThrottleReasons(handle), int)
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        r470.nvmlGpmQueryDeviceSupport(handle)


def test_a_consumer_card_refuses_what_nvml_h_reserves_for_fully_supported_boards() -> None:
    sim = machine("rtx-4090")
    handle = sim.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        sim.nvmlDeviceGetMigMode(handle)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        sim.nvmlDeviceGetTotalEccErrors(
            handle, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC
        )
    (entry,) = sim.nvmlDeviceGetFieldValues(handle, [pynvml.NVML_FI_DEV_MEMORY_TEMP])
    assert entry.nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert sim.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice == 0
    assert sim.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU) > 0


def test_a_gpu_instance_with_two_compute_instances() -> None:
    sim = machine("h100-mig")
    parent = sim.nvmlDeviceGetHandleByIndex(0)
    handles = [sim.nvmlDeviceGetMigDeviceHandleByIndex(parent, i) for i in range(4)]
    with pytest.raises(pynvml.NVMLError_NotFound):
        sim.nvmlDeviceGetMigDeviceHandleByIndex(parent, 4)
    in_gi2 = [h for h in handles if sim.nvmlDeviceGetGpuInstanceId(h) == 2]
    assert [sim.nvmlDeviceGetComputeInstanceId(h) for h in in_gi2] == [0, 1]
    names = {sim.nvmlDeviceGetName(h) for h in in_gi2}
    assert names == {"NVIDIA H100 80GB HBM3 MIG 1c.3g.40gb"}  # equal-sized: one name
    assert len({sim.nvmlDeviceGetUUID(h) for h in in_gi2}) == 2
    first, second = (sim.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2) for h in in_gi2)
    assert (first.total, first.used) == (second.total, second.used)  # the instance's
    (devices, _) = enumerate_gpus(sim)
    assert [(m.gpu_instance_id, m.profile, len(m.handles)) for m in devices[0].mig] == [
        (2, "3g.40gb", 2),
        (3, "2g.20gb", 1),
        (9, "1g.10gb", 1),
    ]


def test_a_container_without_capabilities() -> None:
    sim = machine("h100-nocaps")
    parent = sim.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NoPermission):
        sim.nvmlDeviceGetMigDeviceHandleByIndex(parent, 0)
    sample = sim.nvmlGpmSampleAlloc()
    with pytest.raises(pynvml.NVMLError_NoPermission):
        sim.nvmlGpmSampleGet(sim.nvmlDeviceGetHandleByIndex(1), sample)
    sim.clear_faults()  # the machine's own refusals are not injected faults: they stay
    with pytest.raises(pynvml.NVMLError_NoPermission):
        sim.nvmlGpmSampleGet(sim.nvmlDeviceGetHandleByIndex(1), sample)
    sim.nvmlGpmSampleFree(sample)


def test_a_fault_for_a_number_of_calls() -> None:
    sim = machine("h100-sxm")
    handle = sim.nvmlDeviceGetHandleByIndex(0)
    sim.inject_fault(
        pynvml.NVML_ERROR_INSUFFICIENT_SIZE, function="nvmlDeviceGetProcessUtilization", times=2
    )
    for _ in range(2):
        with pytest.raises(pynvml.NVMLError_InsufficientSize):
            sim.nvmlDeviceGetProcessUtilization(handle, 0)
    assert sim.nvmlDeviceGetProcessUtilization(handle, 0)
    with pytest.raises(ValueError, match="at least 1"):
        sim.inject_fault(pynvml.NVML_ERROR_UNKNOWN, times=0)


def test_not_available_process_memory_is_none_as_pynvml_gives_it() -> None:
    sim = machine("h100-sxm")
    sim.inject_memory_unavailable(1)
    memory = {
        gpu: [p.usedGpuMemory for p in sim.nvmlDeviceGetComputeRunningProcesses(h)]
        for gpu, h in ((g, sim.nvmlDeviceGetHandleByIndex(g)) for g in (0, 1))
    }
    assert memory[1] and set(memory[1]) == {None}
    assert memory[0] and None not in memory[0]


def test_a_slow_call_and_a_hung_one() -> None:
    sim = machine("h100-sxm")
    handle = sim.nvmlDeviceGetHandleByIndex(0)
    sim.inject_delay(0.2, function="nvmlDeviceGetPowerUsage", times=1)
    start = time.monotonic()
    sim.nvmlDeviceGetPowerUsage(handle)
    assert time.monotonic() - start >= 0.2
    sim.inject_delay(math.inf, gpu=0, function="nvmlDeviceGetTemperature")
    returned = threading.Event()

    def call() -> None:
        sim.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)
        returned.set()

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    assert not returned.wait(0.3), "a hung call returned"
    other = sim.nvmlDeviceGetHandleByIndex(1)  # other GPUs and calls still answer
    sim.nvmlDeviceGetTemperature(other, pynvml.NVML_TEMPERATURE_GPU)
    sim.clear_faults()
    assert returned.wait(5), "clear_faults did not release the hung call"
    caller.join(5)


@pytest.mark.parametrize(
    ("value", "gpus", "profile"),
    [("3", 3, ""), ("r470", 0, "r470"), ("h100-mig:4", 4, "h100-mig")],
)
def test_simulate_takes_a_count_a_profile_or_both(value: str, gpus: int, profile: str) -> None:
    args = cli._parser().parse_args(["once", "--simulate", value])
    sim = cli._config(args).simulate
    assert (sim.gpus, sim.profile, sim.enabled) == (gpus, profile, True)


@pytest.mark.parametrize("value", ["h200-nvl", "r470:0", "0"])
def test_simulate_refuses_what_is_not_a_machine(value: str) -> None:
    args = cli._parser().parse_args(["once", "--simulate", value])
    with pytest.raises(ConfigError, match=r"machine profile|at least 1 GPU"):
        cli._config(args)


def test_the_banner_names_the_profile(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = dataclasses.replace(
        load(None, {}),
        simulate=SimulateConfig(profile="a100-mig", fake_host=False),
        attribution=dataclasses.replace(load(None, {}).attribution, pod_resources_socket=None),
    )
    backend = open_backend(cfg)
    try:
        assert backend.lib.nvmlDeviceGetCount() == PROFILES["a100-mig"].gpus
    finally:
        backend.lib.nvmlShutdown()
    banner = capsys.readouterr().err
    assert "machine profile a100-mig" in banner and "MIG on GPU 0" in banner
    assert "SIMULATED" in banner


def test_the_help_names_every_profile() -> None:
    """--simulate's help lists the profiles by hand (cli.py must not import pynvml: the
    installer runs edge-agent --version in a venv it is checking)."""
    (action,) = [a for a in cli._parser()._actions if a.dest == "command"]
    run = action.choices["run"]  # type: ignore[index]
    (simulate,) = [a for a in run._actions if a.dest == "simulate"]
    assert all(name in str(simulate.help) for name in PROFILES)
