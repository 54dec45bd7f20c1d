"""GPU enumeration: physical GPUs, their identity, and their MIG instances."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pynvml

from edge_agent.nvml.backend import Handle, NvmlLib, text

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class MigInstance:
    handle: Handle
    gpu_instance_id: int
    profile: str  # e.g. "1g.10gb"
    uuid: str


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuDevice:
    index: int
    handle: Handle
    uuid: str
    name: str
    pci_bus_id: str
    minor: int
    mig: tuple[MigInstance, ...] = ()

    @property
    def mig_enabled(self) -> bool:
        return bool(self.mig)


def mig_profile(mig_name: str) -> str:
    """``"NVIDIA A100-SXM4-40GB MIG 1g.5gb"`` -> ``"1g.5gb"`` (dcgm-exporter's GPU_I_PROFILE)."""
    _, sep, profile = mig_name.rpartition(" MIG ")
    return profile.strip() if sep else mig_name


def _mig_instances(lib: NvmlLib, handle: Handle) -> tuple[MigInstance, ...]:
    try:
        current, _pending = lib.nvmlDeviceGetMigMode(handle)
    except pynvml.NVMLError_NotSupported:
        return ()
    if current != pynvml.NVML_DEVICE_MIG_ENABLE:
        return ()
    out: list[MigInstance] = []
    for slot in range(lib.nvmlDeviceGetMaxMigDeviceCount(handle)):
        try:
            mig = lib.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
        except pynvml.NVMLError_NotFound:
            continue
        out.append(
            MigInstance(
                handle=mig,
                gpu_instance_id=lib.nvmlDeviceGetGpuInstanceId(mig),
                profile=mig_profile(text(lib.nvmlDeviceGetName(mig))),
                uuid=text(lib.nvmlDeviceGetUUID(mig)),
            )
        )
    return tuple(out)


def enumerate_gpus(lib: NvmlLib) -> tuple[list[GpuDevice], list[str]]:
    """All GPUs that answer identity queries, and one message per GPU that does not.

    A GPU that cannot even be identified (lost, reset required) is left out with a
    message rather than stopping the agent: the others are still worth reporting.
    """
    devices: list[GpuDevice] = []
    problems: list[str] = []
    for index in range(lib.nvmlDeviceGetCount()):
        try:
            handle = lib.nvmlDeviceGetHandleByIndex(index)
            pci = lib.nvmlDeviceGetPciInfo(handle)
            try:
                minor = lib.nvmlDeviceGetMinorNumber(handle)
            except pynvml.NVMLError_NotSupported:
                minor = index
            devices.append(
                GpuDevice(
                    index=index,
                    handle=handle,
                    uuid=text(lib.nvmlDeviceGetUUID(handle)),
                    name=text(lib.nvmlDeviceGetName(handle)),
                    pci_bus_id=text(pci.busId),
                    minor=minor,
                    mig=_mig_instances(lib, handle),
                )
            )
        except pynvml.NVMLError as exc:
            problems.append(f"GPU {index} cannot be identified and is skipped: {exc}")
    return devices, problems
