"""GPU enumeration: physical GPUs, their identity, and their MIG instances."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pynvml

from edge_agent.nvml.backend import Handle, NvmlLib, text

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class MigInstance:
    """One MIG GPU instance, as dcgm-exporter reports it (``GPU_I_ID``, ``GPU_I_PROFILE``).

    NVML hands out a MIG device per *compute* instance; a GPU instance split into several
    compute instances has several, sharing its memory and GPM counters. ``handle`` and
    ``uuid`` are the first one's; ``handles``/``uuids`` are all of them.
    """

    handle: Handle
    gpu_instance_id: int
    profile: str  # the GPU instance's profile, e.g. "1g.10gb"
    uuid: str
    handles: tuple[Handle, ...] = ()
    uuids: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuDevice:
    index: int
    handle: Handle
    uuid: str
    name: str
    pci_bus_id: str
    minor: int
    mig: tuple[MigInstance, ...] = ()
    # MIG mode is on (even where its instances could not be listed: then ``mig`` is empty
    # and only whole-GPU fields are read)
    mig_enabled: bool = False


@dataclass(frozen=True, slots=True)
class Problem:
    """Something about a GPU that enumeration could not read: said once at start-up, and
    shown as ``gpurelay_agent_degraded{gpu, part, reason}`` for as long as the agent runs."""

    gpu: str
    part: str
    reason: str

    def __str__(self) -> str:
        return f"GPU {self.gpu}: {self.part.replace('_', ' ')}: {self.reason}"


def mig_profile(mig_name: str) -> str:
    """The GPU-instance profile in a MIG device's name, as dcgm-exporter's GPU_I_PROFILE:
    ``"NVIDIA A100-SXM4-40GB MIG 1g.5gb"`` -> ``"1g.5gb"``, and for a compute instance
    smaller than its GPU instance ``"... MIG 1c.3g.20gb"`` -> ``"3g.20gb"``."""
    _, sep, profile = mig_name.rpartition(" MIG ")
    profile = profile.strip() if sep else mig_name
    head, dot, rest = profile.partition(".")
    if dot and head.endswith("c") and head[:-1].isdigit() and "g." in rest:
        return rest
    return profile


def _mig_instances(
    lib: NvmlLib, index: int, handle: Handle, problems: list[Problem]
) -> tuple[bool, tuple[MigInstance, ...]]:
    """(MIG mode on, its GPU instances). What cannot be listed is said in ``problems`` and
    left out; the GPU itself stays (its whole-GPU fields are still worth reporting)."""
    try:
        current, _pending = lib.nvmlDeviceGetMigMode(handle)
    except pynvml.NVMLError_NotSupported:  # a GPU without MIG
        return False, ()
    except pynvml.NVMLError as exc:
        problems.append(Problem(str(index), "mig_mode", f"{exc}; taken as off"))
        return False, ()
    if current != pynvml.NVML_DEVICE_MIG_ENABLE:
        return False, ()
    try:
        slots = lib.nvmlDeviceGetMaxMigDeviceCount(handle)
    except pynvml.NVMLError as exc:
        problems.append(
            Problem(str(index), "mig_instances", f"{exc}; only whole-GPU fields are reported")
        )
        return True, ()
    groups: dict[int, list[tuple[Handle, str, str]]] = {}
    failed: list[tuple[int, pynvml.NVMLError]] = []
    for slot in range(slots):
        try:
            mig = lib.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            gi = lib.nvmlDeviceGetGpuInstanceId(mig)
            name = text(lib.nvmlDeviceGetName(mig))
            uuid = text(lib.nvmlDeviceGetUUID(mig))
        except pynvml.NVMLError_NotFound:  # an empty slot
            continue
        except pynvml.NVMLError as exc:
            failed.append((slot, exc))
            continue
        groups.setdefault(gi, []).append((mig, name, uuid))
    if failed:
        error = failed[0][1]
        hint = ""
        if error.value == pynvml.NVML_ERROR_NO_PERMISSION:
            hint = " (in a container: grant it the NVIDIA MIG capabilities)"
        slots_text = ", ".join(str(n) for n, _ in failed)
        problems.append(
            Problem(
                str(index),
                "mig_instances",
                f"MIG device(s) {slots_text} cannot be opened: {error}{hint}; whole-GPU fields "
                "and the instances that open are still reported",
            )
        )
    out = []
    for gi, members in groups.items():
        first, name, uuid = members[0]
        out.append(
            MigInstance(
                handle=first,
                gpu_instance_id=gi,
                profile=mig_profile(name),
                uuid=uuid,
                handles=tuple(m[0] for m in members),
                uuids=tuple(m[2] for m in members),
            )
        )
    return True, tuple(out)


def enumerate_gpus(lib: NvmlLib) -> tuple[list[GpuDevice], list[Problem]]:
    """All GPUs that answer identity queries, and one message per GPU that does not.

    A GPU that cannot even be identified (lost, reset required) is left out with a
    message rather than stopping the agent: the others are still worth reporting.
    """
    devices: list[GpuDevice] = []
    problems: list[Problem] = []
    for index in range(lib.nvmlDeviceGetCount()):
        try:
            handle = lib.nvmlDeviceGetHandleByIndex(index)
            pci = lib.nvmlDeviceGetPciInfo(handle)
            try:
                minor = lib.nvmlDeviceGetMinorNumber(handle)
            except pynvml.NVMLError_NotSupported:
                minor = index
            uuid = text(lib.nvmlDeviceGetUUID(handle))
            name = text(lib.nvmlDeviceGetName(handle))
        except pynvml.NVMLError as exc:
            problems.append(Problem(str(index), "identity", f"{exc}; the GPU is skipped"))
            continue
        mig_enabled, mig = _mig_instances(lib, index, handle, problems)
        devices.append(
            GpuDevice(
                index=index,
                handle=handle,
                uuid=uuid,
                name=name,
                pci_bus_id=text(pci.busId),
                minor=minor,
                mig=mig,
                mig_enabled=mig_enabled,
            )
        )
    return devices, problems
