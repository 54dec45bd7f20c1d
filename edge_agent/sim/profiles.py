"""Named machines for the NVML simulator: what a real box answers, call by call.

A :class:`MachineProfile` says how one kind of machine differs from a current data-centre
GPU on a current driver: the GPU model, the driver, which symbols its ``libnvidia-ml``
lacks, which calls the board answers ``NOT_SUPPORTED``, which calls the agent's
privileges make fail, and how MIG is laid out. :class:`~edge_agent.sim.nvml.SimulatedNvml`
plays it; ``edge-agent --simulate-profile NAME`` and ``make demo`` name the one they use.

Each behaviour below cites where real NVML documents it:

- ``nvml.h`` (NVML API reference, driver R550): the "For ... fully supported devices"
  line and the ``@return`` list of every call;
- ``pynvml.py`` of ``nvidia-ml-py`` (as installed): which symbol each wrapper calls
  (``nvmlDeviceGetComputeRunningProcesses`` calls ``..._v3``, wrapped in
  ``throwOnVersionMismatch``, which turns FUNCTION_NOT_FOUND into
  ``NVMLLibraryMismatchError``; ``nvmlDeviceGetMemoryInfo(h, version)`` calls
  ``nvmlDeviceGetMemoryInfo_v2``), and the ``usedGpuMemory = None`` sentinel;
- DCGM's ``DcgmCacheManager.cpp`` and ``DcgmGpmManager``: what DCGM does about each failure.

To add a machine from a real driver's behaviour, see docs/simulator.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pynvml

# One GPU instance: (GPU-instance profile, GPU instance id, memory MiB, compute instances),
# each compute instance given by the profile in its MIG device's name: the GPU instance's
# own profile when it spans the instance, else "<n>c.<gi profile>" (as nvidia-smi shows).
GpuInstanceLayout = tuple[str, int, int, tuple[str, ...]]

H100_MIG_ONE_CI: tuple[GpuInstanceLayout, ...] = (
    ("3g.40gb", 1, 40_448, ("3g.40gb",)),
    ("2g.20gb", 5, 20_096, ("2g.20gb",)),
    ("1g.10gb", 13, 9_856, ("1g.10gb",)),
)
# A GPU instance holding two equal compute instances (nvidia-smi mig -cci 0,0 -gi 2):
# their MIG devices share the instance's memory and GPM counters, and their names match.
H100_MIG_TWO_CI: tuple[GpuInstanceLayout, ...] = (
    ("3g.40gb", 2, 40_448, ("1c.3g.40gb", "1c.3g.40gb")),
    ("2g.20gb", 3, 20_096, ("2g.20gb",)),
    ("1g.10gb", 9, 9_856, ("1g.10gb",)),
)
A100_MIG_TWO_CI: tuple[GpuInstanceLayout, ...] = (
    ("3g.20gb", 1, 19_968, ("1c.3g.20gb", "2c.3g.20gb")),
    ("2g.10gb", 5, 9_728, ("2g.10gb",)),
    ("1g.5gb", 13, 4_864, ("1g.5gb",)),
)

_NS = pynvml.NVML_ERROR_NOT_SUPPORTED
_NO_PERMISSION = pynvml.NVML_ERROR_NO_PERMISSION


@dataclass(frozen=True, kw_only=True)
class MachineProfile:
    name: str
    summary: str
    model: str
    gpus: int
    driver_version: str
    total_memory: int  # bytes, as nvmlDeviceGetMemoryInfo reports them
    reserved_memory: int
    # GPUs in MIG mode, and the layout each of them has.
    mig_gpus: tuple[int, ...] = ()
    mig_layout: tuple[GpuInstanceLayout, ...] = H100_MIG_ONE_CI
    # Symbols this driver's libnvidia-ml lacks: a pynvml wrapper calling one raises
    # NVMLError_FunctionNotFound (NVMLLibraryMismatchError where pynvml wraps it).
    missing: frozenset[str] = frozenset()
    # Calls that fail on every GPU of this machine with this NVML return code.
    errors: dict[str, int] = field(default_factory=dict)
    # nvmlDeviceGetFieldValues ids whose entries come back NOT_SUPPORTED.
    unsupported_field_ids: frozenset[int] = frozenset()
    # Process memory NVML cannot tell (WDDM, some vGPU): the NVML_VALUE_NOT_AVAILABLE
    # sentinel, which pynvml turns into None.
    process_memory_unavailable: bool = False


_H100 = MachineProfile(
    name="h100-sxm",
    summary="H100 SXM5 80GB, 8 by default, on driver R550 (NVML 12.550): every call answers",
    model="NVIDIA H100 80GB HBM3",
    gpus=8,
    driver_version="550.54.15",
    total_memory=85_520_809_984,  # bytes, as NVML reports an H100 80GB HBM3
    reserved_memory=595_591_168,
)
_A100 = MachineProfile(
    name="a100",
    summary="2x A100-SXM4-40GB on driver R535",
    model="NVIDIA A100-SXM4-40GB",
    gpus=2,
    driver_version="535.161.08",
    total_memory=42_949_672_960,
    reserved_memory=333_447_168,
)

PROFILES: dict[str, MachineProfile] = {
    p.name: p
    for p in (
        _H100,
        replace(
            _H100,
            name="h100-mig",
            summary="2x H100 80GB, GPU 0 in MIG mode with a GPU instance holding two "
            "compute instances (R550)",
            gpus=2,
            mig_gpus=(0,),
            mig_layout=H100_MIG_TWO_CI,
        ),
        replace(
            _A100,
            name="a100-mig",
            summary="2x A100-SXM4-40GB, GPU 0 in MIG mode (3g.20gb as 1c + 2c); no GPM "
            "(pre-Hopper), NVLink 3 (R535)",
            mig_gpus=(0,),
            mig_layout=A100_MIG_TWO_CI,
        ),
        MachineProfile(
            name="rtx-4090",
            summary="a GeForce RTX 4090 (R550): no MIG, no ECC, no GPM, no NVLink; the calls "
            "nvml.h restricts to fully supported devices answer NOT_SUPPORTED",
            model="NVIDIA GeForce RTX 4090",
            gpus=1,
            driver_version="550.54.15",
            total_memory=25_757_220_864,
            reserved_memory=346_030_080,
            errors={
                # nvml.h: "For Fermi or newer fully supported devices. Only applicable to
                # devices with ECC" and the like; GeForce boards are not fully supported.
                "nvmlDeviceGetTotalEccErrors": _NS,
                "nvmlDeviceGetRetiredPages": _NS,
                "nvmlDeviceGetRetiredPagesPendingStatus": _NS,
                "nvmlDeviceGetRemappedRows": _NS,
                "nvmlDeviceGetViolationStatus": _NS,
                "nvmlDeviceGetTotalEnergyConsumption": _NS,
                "nvmlDeviceGetMigMode": _NS,
                "nvmlDeviceGetMaxMigDeviceCount": _NS,
                "nvmlDeviceGetGridLicensableFeatures": _NS,
            },
            unsupported_field_ids=frozenset({pynvml.NVML_FI_DEV_MEMORY_TEMP}),
        ),
        replace(
            _A100,
            name="r470",
            summary="2x A100-SXM4-40GB on driver R470 (NVML 11.470): no _v3 process calls, "
            "memory info v1 only, throttle reasons instead of clock-event reasons, no GPM",
            driver_version="470.223.02",
            missing=frozenset(
                {
                    # added in NVML 11.6 (R510) / 12.535 / R520, per nvml.h's change log
                    "nvmlDeviceGetComputeRunningProcesses_v3",
                    "nvmlDeviceGetGraphicsRunningProcesses_v3",
                    "nvmlDeviceGetMemoryInfo_v2",
                    "nvmlDeviceGetCurrentClocksEventReasons",
                    "nvmlGpmQueryDeviceSupport",
                    "nvmlGpmSampleGet",
                    "nvmlGpmMigSampleGet",
                    "nvmlGpmSampleAlloc",
                    "nvmlGpmSampleFree",
                    "nvmlGpmMetricsGet",
                }
            ),
        ),
        replace(
            _H100,
            name="h100-nocaps",
            summary="2x H100 80GB seen from a container without capabilities, GPU 0 in MIG "
            "mode: GPM sampling and MIG device enumeration answer NO_PERMISSION",
            gpus=2,
            mig_gpus=(0,),
            errors={
                # Profiling counters need CAP_SYS_ADMIN (or the driver's
                # NVreg_RestrictProfilingToAdminUsers=0); MIG device handles need the
                # /proc/driver/nvidia/capabilities/mig access the container lacks.
                "nvmlGpmSampleGet": _NO_PERMISSION,
                "nvmlGpmMigSampleGet": _NO_PERMISSION,
                "nvmlDeviceGetMigDeviceHandleByIndex": _NO_PERMISSION,
            },
        ),
    )
}
DEFAULT_PROFILE = "h100-sxm"


def profile_named(name: str) -> MachineProfile:
    try:
        return PROFILES[name]
    except KeyError:
        known = ", ".join(sorted(PROFILES))
        raise ValueError(f"no simulated machine profile {name!r} (known: {known})") from None
