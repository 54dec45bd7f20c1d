"""A faithful NVML simulator: the :class:`~edge_agent.nvml.backend.NvmlLib` seam without a GPU.

:class:`SimulatedNvml` returns the structs real ``pynvml`` returns and raises the same
``pynvml.NVMLError`` subclasses. Every value is a pure function of ``(seed, gpu, clock())``
and of the clock reading at construction, which plays the part of driver load: cumulative
counters (energy, ECC, PCIe replays, violation time) count from there. Smooth sine waves
with per-GPU phases give the load; small noise is hashed from ``(seed, gpu, int(t))``.

Processes come and go: each GPU has ``processes_per_gpu`` slots, and each slot runs a new
process in most of its generations (a generation lasts 60-300 s). GPU 0 can be in MIG mode
with three GPU instances. The ``model`` decides GPM and NVLink (an H100 has both, an A100
NVLink only, a T4 neither; see :mod:`edge_agent.sim.nvml_gpm`). Faults and XID events
are injected with :meth:`SimulatedNvml.inject_fault` and :meth:`SimulatedNvml.inject_xid`.
Thread-safe.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import pynvml

from edge_agent.nvml.backend import Handle, NvmlLib
from edge_agent.sim.nvml_gpm import GpmSimulation, nvlink_field, profile_for
from edge_agent.sim.profiles import (
    DEFAULT_PROFILE,
    PROFILES,
    GpuInstanceLayout,
    MachineProfile,
    profile_named,
)
from gpurelay.model import MIB

_TOTAL_MEMORY = 85_520_809_984  # an H100 80GB HBM3, as NVML reports it
_RESERVED_MEMORY = 595_591_168
_MAX_PROCESS_MEMORY = 20 << 30
_SAMPLING_PERIOD_US = 167_000
_NOT_APPLICABLE = 0xFFFFFFFF  # gpuInstanceId and computeInstanceId outside MIG
_PID_RANGE = (1000, 4_000_000)
_IDLE_SLOT_FRACTION = 0.2
_IDLE_UTIL = 5
_POWER_CAP_W = 580.0
_SM_CLOCK_MHZ = {"idle": 345, "capped": 1755, "boost": 1980}
_MEM_CLOCK_MHZ = 2619
_MAX_MIG_DEVICES = 7
_PCI_BUSES = (0x1B, 0x43, 0x52, 0x61, 0x9D, 0xC3, 0xD1, 0xDF)  # a DGX H100's
_SUPPORTED_EVENTS = (
    pynvml.nvmlEventTypeSingleBitEccError
    | pynvml.nvmlEventTypeDoubleBitEccError
    | pynvml.nvmlEventTypePState
    | pynvml.nvmlEventTypeXidCriticalError
    | pynvml.nvmlEventTypeClock
)
# What real NVML answers for a MIG device handle; everything else is NOT_SUPPORTED there.
_MIG_DEVICE_CALLS = frozenset(
    {
        "nvmlDeviceGetName",
        "nvmlDeviceGetUUID",
        "nvmlDeviceGetMemoryInfo",
        "nvmlDeviceGetComputeRunningProcesses",
        "nvmlDeviceGetGraphicsRunningProcesses",
        "nvmlDeviceGetComputeRunningProcesses_v2",
        "nvmlDeviceGetGraphicsRunningProcesses_v2",
        "nvmlDeviceGetGpuInstanceId",
        "nvmlDeviceGetComputeInstanceId",
        "nvmlGpmSampleGet",  # a compute instance's counters (DCGM samples them so)
    }
)
_API = frozenset(name for name in dir(NvmlLib) if name.startswith("nvml"))
_HANG = math.inf  # a delay that lasts until the fault is cleared


def _fail(code: int) -> NoReturn:
    raise pynvml.NVMLError(code)


# Pure; process slots ask the same keys every cycle. Bounded small and LRU: the noise keys
# carry the second, so a large bound only filled up with past seconds (65536 entries held
# ~20 MB after ten minutes of a 1 s interval, read as agent memory growth).
@functools.lru_cache(maxsize=4096)
def _unit(*key: object) -> float:
    """A pseudo-random number in [0, 1) determined by ``key`` (the same in every run)."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def _uuid(prefix: str, *key: object) -> str:
    h = hashlib.blake2b(repr(key).encode(), digest_size=16).hexdigest()
    return f"{prefix}-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _clamp(value: float, low: int = 0, high: int = 100) -> int:
    return max(low, min(high, round(value)))


@dataclass(frozen=True)
class _Process:
    pid: int
    used_memory: int
    gpu_instance_id: int
    compute: bool
    graphics: bool
    weight: float  # its share of the device's utilisation
    compute_instance_id: int = _NOT_APPLICABLE


@dataclass(frozen=True)
class _Slot:
    """Where processes run one after another; with ``pid`` set, one process runs forever."""

    number: int
    lifetime: float
    offset: float
    memory_cap: int
    gpu_instance_id: int
    pid: int | None
    compute_instance_id: int = _NOT_APPLICABLE

    def process_at(self, seed: int, gpu: int, t: float) -> _Process | None:
        generation = 0 if self.pid is not None else math.floor((t + self.offset) / self.lifetime)
        key = (seed, gpu, self.number, generation)
        pid = self.pid
        if pid is None:
            if _unit(*key, "idle") < _IDLE_SLOT_FRACTION:
                return None
            pid = _PID_RANGE[0] + int(_unit(*key, "pid") * (_PID_RANGE[1] - _PID_RANGE[0]))
        cap_mib = self.memory_cap // MIB
        low_mib = min(256, cap_mib)
        memory = (low_mib + int(_unit(*key, "mem") * (cap_mib - low_mib + 1))) * MIB
        kind = _unit(*key, "kind")  # 10% graphics only, 10% both, 80% compute only
        weight = 0.2 + _unit(*key, "weight")
        return _Process(
            pid,
            memory,
            self.gpu_instance_id,
            kind >= 0.1,
            kind < 0.2,
            weight,
            self.compute_instance_id,
        )


class _GpuInstance:
    """A GPU instance of a GPU in MIG mode: a share of its memory and GPM counters."""

    def __init__(self, owner: _Gpu, layout: GpuInstanceLayout) -> None:
        profile, gpu_instance_id, memory_mib, compute = layout
        self.owner, self.profile, self.gpu_instance_id = owner, profile, gpu_instance_id
        self.total_memory, self.reserved_memory = memory_mib * MIB, 0
        self.compute = [_MigDevice(self, n, profile) for n, profile in enumerate(compute)]

    def processes(self, t: float) -> list[_Process]:
        return [p for p in self.owner.processes(t) if p.gpu_instance_id == self.gpu_instance_id]


class _MigDevice:
    """A MIG device: one compute instance of a GPU instance, with a handle and UUID of its
    own. Memory and GPM counters are its GPU instance's; processes are its own."""

    def __init__(self, instance: _GpuInstance, compute_instance_id: int, profile: str) -> None:
        owner = instance.owner
        self.owner, self.instance, self.profile = owner, instance, profile
        self.gpu_instance_id = instance.gpu_instance_id
        self.compute_instance_id = compute_instance_id
        key: tuple[object, ...] = (owner.seed, owner.index, instance.gpu_instance_id)
        n = compute_instance_id
        self.uuid = _uuid("MIG", *key) if n == 0 else _uuid("MIG", *key, n)
        self.target = pynvml.struct_c_nvmlDevice_t()

    @property
    def total_memory(self) -> int:
        return self.instance.total_memory

    @property
    def reserved_memory(self) -> int:
        return self.instance.reserved_memory

    def memory_processes(self, t: float) -> list[_Process]:
        """What its memory holds: every process of its GPU instance."""
        return self.instance.processes(t)

    def processes(self, t: float) -> list[_Process]:
        return [
            p
            for p in self.instance.processes(t)
            if p.compute_instance_id == self.compute_instance_id
        ]


class _Gpu:
    """One physical GPU: identity fixed at construction, metrics a function of time."""

    def __init__(
        self,
        index: int,
        *,
        seed: int,
        t0: float,
        layout: Sequence[GpuInstanceLayout],
        pids: Sequence[int] | None,
        slots: int,
        memory: tuple[int, int] = (_TOTAL_MEMORY, _RESERVED_MEMORY),
    ) -> None:
        rng = random.Random(f"{seed}:{index}")
        self.index, self.seed, self.t0, self.owner = index, seed, t0, self
        self.total_memory, self.reserved_memory = memory
        self.memory_unavailable = False  # usedGpuMemory is NVML's "not available" sentinel
        self.uuid = _uuid("GPU", seed, index)
        self.domain, self.bus = index // len(_PCI_BUSES), _PCI_BUSES[index % len(_PCI_BUSES)]
        self.target = pynvml.struct_c_nvmlDevice_t()
        # load(t) = level + sum of amplitude * sin(2 pi t / period + phase), within [-0.2, 1.05]
        self.level = rng.uniform(0.3, 0.55)
        self.waves = [
            (rng.uniform(0.25, 0.4), rng.uniform(120.0, 600.0), rng.uniform(0, 2 * math.pi)),
            (rng.uniform(0.05, 0.1), rng.uniform(20.0, 60.0), rng.uniform(0, 2 * math.pi)),
        ]
        self.ecc_interval = rng.uniform(1800.0, 14400.0)
        self.ecc_before_load = rng.randint(0, 40)
        self.replay_interval = rng.uniform(600.0, 7200.0)
        self.power_violation = rng.uniform(0.0, 0.03)  # fraction of time
        self.thermal_violation = rng.uniform(0.0, 0.002)
        self.mig_devices = [_GpuInstance(self, instance) for instance in layout]
        self.mig_handles = [ci for gi in self.mig_devices for ci in gi.compute]
        self.slots = self._make_slots(rng, pids, slots)
        self._processes_memo: tuple[float, list[_Process]] | None = None

    def _make_slots(self, rng: random.Random, pids: Sequence[int] | None, n: int) -> list[_Slot]:
        """Spread the slots over the MIG instances (if any), capping their memory to fit."""
        n = n if pids is None else len(pids)
        places = [(_NOT_APPLICABLE, _NOT_APPLICABLE, self.total_memory - self.reserved_memory)]
        if self.mig_devices:
            places = [
                (ci.gpu_instance_id, ci.compute_instance_id, ci.total_memory)
                for ci in self.mig_handles
            ]
        slots = []
        for number in range(n):
            gpu_instance_id, compute_instance_id, memory = places[number % len(places)]
            # the slots of every compute instance of this GPU instance share its memory
            sharing = sum(1 for k in range(n) if places[k % len(places)][0] == gpu_instance_id)
            cap = min(_MAX_PROCESS_MEMORY, memory // sharing) // MIB * MIB
            lifetime = rng.uniform(60.0, 300.0)
            pid = None if pids is None else pids[number]
            offset = rng.uniform(0, lifetime)
            slots.append(
                _Slot(number, lifetime, offset, cap, gpu_instance_id, pid, compute_instance_id)
            )
        return slots

    def noise(self, name: str, t: float) -> float:
        return 2 * _unit(self.seed, self.index, name, math.floor(t)) - 1

    def processes(self, t: float) -> list[_Process]:
        # Many calls in one cycle ask for the same instant: remember the last answer
        # (a pure function of t, so this changes no value, only the simulator's cost).
        memo = self._processes_memo
        if memo is not None and memo[0] == t:
            return memo[1]
        running = (slot.process_at(self.seed, self.index, t) for slot in self.slots)
        result = [p for p in running if p is not None]
        self._processes_memo = (t, result)
        return result

    def load(self, t: float) -> float:
        waves = (a * math.sin(2 * math.pi * t / period + phase) for a, period, phase in self.waves)
        return self.level + sum(waves)

    def power_w(self, t: float) -> float:
        return 75.0 + 600.0 * (self.load(t) + 0.2) / 1.25

    def energy_mj(self, t: float) -> int:
        """The integral of :meth:`power_w` since driver load, in millijoules."""
        scale = 600.0 / 1.25
        joules = (75.0 + scale * (self.level + 0.2)) * (t - self.t0)
        for amplitude, period, phase in self.waves:
            theta0, theta = (2 * math.pi * x / period + phase for x in (self.t0, t))
            joules -= (
                scale * amplitude * period / (2 * math.pi) * (math.cos(theta) - math.cos(theta0))
            )
        return max(0, math.floor(joules * 1000))

    def utilization(self, t: float, processes: list[_Process]) -> tuple[int, int]:
        """GPU and memory-copy utilisation in percent: zero with no process running."""
        if not processes:
            return 0, 0
        load = self.load(t)
        gpu = _clamp(100 * load + 4 * self.noise("gpu", t))
        return gpu, _clamp(55 * load + 3 * self.noise("memory", t))

    def pcie_kbps(self, counter: int, t: float) -> int:
        """PCIe KB/s: mostly host-to-device (RX) traffic, following the load."""
        peak = 6e6 if counter == pynvml.NVML_PCIE_UTIL_TX_BYTES else 14e6
        noise = 1 + 0.1 * self.noise(f"pcie{counter}", t)
        return round((20_000 + peak * max(0.0, self.load(t))) * noise)

    def codec_utilization(self, t: float, processes: list[_Process], mean: float) -> int:
        """Encoder or decoder utilisation: low, and only while a graphics process runs."""
        if not any(p.graphics for p in processes):
            return 0
        swing = math.sin(2 * math.pi * t / 47.0 + self.waves[0][2])
        return _clamp(mean * (1 + swing) + 2 * self.noise(f"codec{mean}", t))

    def temperature(self, t: float) -> int:
        """Follows the power of half a minute ago (thermal inertia)."""
        return _clamp(28 + 0.085 * self.power_w(t - 30.0) + self.noise("temp", t), 30, 85)

    def clock_reasons(self, t: float) -> int:
        if self.utilization(t, self.processes(t))[0] < _IDLE_UTIL:
            return int(pynvml.nvmlClocksEventReasonGpuIdle)
        if self.power_w(t) > _POWER_CAP_W:
            return int(pynvml.nvmlClocksEventReasonSwPowerCap)
        return 0

    def since_load(self, t: float, interval: float) -> int:
        """How many events, one per ``interval`` seconds, happened since driver load."""
        return max(0, math.floor((t - self.t0) / interval))


_Device = _Gpu | _MigDevice


@dataclass
class _Fault:
    code: int  # an NVML return code; 0 with a delay: only slow
    gpu: int | None
    function: str | None
    remaining: int | None = None  # calls it still fails (None: every call from now on)
    delay: float = 0.0  # seconds the call takes first (math.inf: until cleared)

    def matches(self, gpu: int | None, function: str) -> bool:
        return (
            self.gpu in (None, gpu)
            and self.function in (None, function)
            and (self.remaining is None or self.remaining > 0)
        )


@dataclass
class _EventSet:
    target: Any = field(default_factory=pynvml.struct_c_nvmlEventSet_t)
    registered: dict[int, int] = field(default_factory=dict)  # GPU index -> event types
    pending: deque[tuple[_Gpu, int]] = field(default_factory=deque)  # (GPU, XID)
    freed: bool = False


class SimulatedNvml:
    """Simulated GPUs behind the functions, structs and errors of ``pynvml``.

    ``profile`` names the machine (:mod:`edge_agent.sim.profiles`): model, driver, the
    symbols its library lacks, the calls its board or privileges refuse, the MIG layout.
    Without one, the machine is ``h100-sxm`` with ``model``, ``driver_version`` and, with
    ``mig``, GPU 0 in MIG mode (one compute instance per GPU instance).
    """

    backend_name = "simulated"

    def __init__(
        self,
        gpu_count: int | None = None,
        *,
        seed: int = 0,
        mig: bool = False,
        clock: Callable[[], float] = time.time,
        processes_per_gpu: int = 4,
        pids: Sequence[int] | None = None,
        driver_loaded: bool = True,
        driver_version: str = "550.54.15",
        model: str = "NVIDIA H100 80GB HBM3",
        profile: str | MachineProfile | None = None,
    ) -> None:
        if profile is None:
            machine = dataclasses.replace(
                PROFILES[DEFAULT_PROFILE],
                model=model,
                driver_version=driver_version,
                mig_gpus=(0,) if mig else (),
            )
        else:
            machine = profile_named(profile) if isinstance(profile, str) else profile
            if mig and not machine.mig_gpus:
                machine = dataclasses.replace(machine, mig_gpus=(0,))
        gpu_count = machine.gpus if gpu_count is None else gpu_count
        if gpu_count < 0 or processes_per_gpu < 0:
            raise ValueError("gpu_count and processes_per_gpu must not be negative")
        if pids and gpu_count == 0:
            raise ValueError("pids need at least one GPU")
        self.profile = machine
        self._clock = clock
        self._driver_loaded = driver_loaded
        self._driver_version = machine.driver_version
        self._model = machine.model
        self._missing = machine.missing
        self._gpm = GpmSimulation(profile_for(machine.model))  # and NVLink: what it has
        t0 = clock()
        pids_of = [None if pids is None else pids[i::gpu_count] for i in range(gpu_count)]
        self._gpus = [
            _Gpu(
                i,
                seed=seed,
                t0=t0,
                layout=machine.mig_layout if i in machine.mig_gpus else (),
                pids=pids_of[i],
                slots=processes_per_gpu,
                memory=(machine.total_memory, machine.reserved_memory),
            )
            for i in range(gpu_count)
        ]
        for gpu in self._gpus:
            gpu.memory_unavailable = machine.process_memory_unavailable
        mig_devices = [m for gpu in self._gpus for m in gpu.mig_handles]
        devices: list[_Device] = [*self._gpus, *mig_devices]
        self._devices = {ctypes.addressof(d.target): d for d in devices}
        self._cond = threading.Condition()  # guards the state below
        self._init_count = 0
        self._faults: list[_Fault] = [
            _Fault(code, None, function) for function, code in machine.errors.items()
        ]
        self._permanent = len(self._faults)  # the machine's own, kept by clear_faults
        self._event_sets: dict[int, _EventSet] = {}

    # --- fault injection (not part of NvmlLib) -----------------------------------------------

    def inject_fault(
        self,
        code: int,
        *,
        gpu: int | None = None,
        function: str | None = None,
        times: int | None = None,
    ) -> None:
        """Calls for ``gpu`` (None: any) to ``function`` (None: any) raise ``code``: the next
        ``times`` calls, or every call from now on (None).

        ``nvmlDeviceGetFieldValues`` reports the fault in each entry's ``nvmlReturn`` instead,
        as NVML does, unless ``code`` is ``NVML_ERROR_GPU_IS_LOST``. ``times=1`` with
        ``NVML_ERROR_INSUFFICIENT_SIZE`` on a list call plays the race pynvml loses when a
        process starts between its sizing call and its fetch.
        """
        pynvml.nvmlExceptionClass(code)  # ValueError for an unknown code
        self._add_fault(_Fault(code, gpu, function, times))

    def inject_delay(
        self,
        seconds: float,
        *,
        gpu: int | None = None,
        function: str | None = None,
        times: int | None = None,
    ) -> None:
        """Calls for ``gpu`` to ``function`` take ``seconds`` of wall time first (a busy or
        wedged driver); ``math.inf`` hangs them until :meth:`clear_faults`."""
        if seconds < 0:
            raise ValueError("a delay cannot be negative")
        self._add_fault(_Fault(pynvml.NVML_SUCCESS, gpu, function, times, delay=seconds))

    def inject_memory_unavailable(self, gpu: int) -> None:
        """Processes on ``gpu`` report NVML_VALUE_NOT_AVAILABLE as their memory (pynvml
        gives None), as under WDDM or for some vGPU guests."""
        self._gpu_at(gpu).memory_unavailable = True

    def _add_fault(self, fault: _Fault) -> None:
        if fault.gpu is not None:
            self._gpu_at(fault.gpu)
        if fault.function is not None and fault.function not in _API:
            raise ValueError(f"{fault.function} is not an NvmlLib function")
        if fault.remaining is not None and fault.remaining < 1:
            raise ValueError("times must be at least 1")
        with self._cond:
            self._faults.append(fault)

    def clear_faults(self) -> None:
        """Forget injected faults (the machine profile's own stay); wake hung calls."""
        with self._cond:
            del self._faults[self._permanent :]
            self._cond.notify_all()

    def inject_xid(self, gpu: int, xid: int) -> None:
        """Queue an XID event for every event set that has registered ``gpu`` for XIDs."""
        target = self._gpu_at(gpu)
        with self._cond:
            for event_set in self._event_sets.values():
                if (
                    not event_set.freed
                    and event_set.registered.get(gpu, 0) & pynvml.nvmlEventTypeXidCriticalError
                ):
                    event_set.pending.append((target, xid))
            self._cond.notify_all()

    def _gpu_at(self, index: int) -> _Gpu:
        if not 0 <= index < len(self._gpus):
            raise ValueError(f"there is no GPU {index} (the simulator has {len(self._gpus)})")
        return self._gpus[index]

    # --- plumbing: initialisation, handles, faults -------------------------------------------

    def _fault(self, function: str, gpu: int | None) -> int | None:
        """The first fault matching this call (a symbol the driver lacks, the machine's own,
        then injected ones); raises if NVML is not initialised; sleeps an injected delay."""
        if function in self._missing:
            return int(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        if self._init_count and not self._faults:  # the common case, without the lock
            return None
        delay = 0.0
        with self._cond:
            if self._init_count == 0:
                _fail(pynvml.NVML_ERROR_UNINITIALIZED)
            code = None
            for fault in self._faults:
                if not fault.matches(gpu, function):
                    continue
                if fault.remaining is not None:
                    fault.remaining -= 1
                if fault.delay:
                    delay = max(delay, fault.delay)
                    continue
                code = fault.code
                break
            if delay:
                self._sleep(delay)
        return code

    def _sleep(self, seconds: float) -> None:
        """Wait ``seconds`` of wall time (for ever with math.inf) or until faults are cleared;
        called with the condition held, which the wait releases."""
        deadline = time.monotonic() + seconds if seconds != _HANG else math.inf
        faults = len(self._faults)
        while len(self._faults) >= faults:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._cond.wait(None if remaining == math.inf else remaining)

    def _check(self, function: str, gpu: int | None = None) -> None:
        code = self._fault(function, gpu)
        if code is not None:
            _fail(code)

    def _resolve(self, handle: Handle, function: str) -> tuple[_Device, int | None]:
        """The device behind ``handle``, and the injected fault (if any) for this call."""
        try:
            device = self._devices[ctypes.addressof(handle.contents)]
        except (AttributeError, TypeError, ValueError, KeyError):
            self._fault(function, None)  # NVML says UNINITIALIZED before INVALID_ARGUMENT
            _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return device, self._fault(function, device.owner.index)

    def _device(self, handle: Handle, function: str) -> _Device:
        device, fault = self._resolve(handle, function)
        if fault is not None:
            _fail(fault)
        if isinstance(device, _MigDevice) and function not in _MIG_DEVICE_CALLS:
            _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return device

    def _gpu(self, handle: Handle, function: str) -> _Gpu:
        device = self._device(handle, function)
        assert isinstance(device, _Gpu)  # _device refuses MIG handles for other calls
        return device

    def _event_set(self, event_set: Any, function: str) -> _EventSet:
        self._check(function)
        try:
            found = self._event_sets[ctypes.addressof(event_set.contents)]
        except (AttributeError, TypeError, ValueError, KeyError):
            _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if found.freed:
            _fail(pynvml.NVML_ERROR_UNINITIALIZED)
        return found

    # --- lifecycle and system ----------------------------------------------------------------

    def nvmlInit(self) -> None:
        if not self._driver_loaded:
            _fail(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
        with self._cond:
            fault = next((f.code for f in self._faults if f.matches(None, "nvmlInit")), None)
            if fault is None:
                self._init_count += 1  # NVML counts nested nvmlInit/nvmlShutdown pairs
        if fault is not None:
            _fail(fault)

    def nvmlShutdown(self) -> None:
        with self._cond:  # reentrant: _check takes it too
            self._check("nvmlShutdown")
            self._init_count -= 1
            self._cond.notify_all()  # event waiters give up once NVML is shut down

    def nvmlSystemGetDriverVersion(self) -> str:
        self._check("nvmlSystemGetDriverVersion")
        return self._driver_version

    def nvmlDeviceGetCount(self) -> int:
        self._check("nvmlDeviceGetCount")
        return len(self._gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Handle:
        self._check("nvmlDeviceGetHandleByIndex", index)
        if not 0 <= index < len(self._gpus):
            _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return pynvml.c_nvmlDevice_t(self._gpus[index].target)  # a new pointer, as pynvml's

    # --- identity ----------------------------------------------------------------------------

    def nvmlDeviceGetName(self, handle: Handle) -> str:
        device = self._device(handle, "nvmlDeviceGetName")
        return self._model if isinstance(device, _Gpu) else f"{self._model} MIG {device.profile}"

    def nvmlDeviceGetUUID(self, handle: Handle) -> str:
        return self._device(handle, "nvmlDeviceGetUUID").uuid

    def nvmlDeviceGetPciInfo(self, handle: Handle) -> Any:
        gpu = self._gpu(handle, "nvmlDeviceGetPciInfo")
        return pynvml.nvmlPciInfo_t(
            busIdLegacy=f"{gpu.domain:04X}:{gpu.bus:02X}:00.0",
            domain=gpu.domain,
            bus=gpu.bus,
            device=0,
            pciDeviceId=0x233010DE,  # H100 SXM5
            pciSubSystemId=0x16C110DE,
            busId=f"{gpu.domain:08X}:{gpu.bus:02X}:00.0",
        )

    def nvmlDeviceGetMinorNumber(self, handle: Handle) -> int:
        return self._gpu(handle, "nvmlDeviceGetMinorNumber").index

    # --- device metrics ----------------------------------------------------------------------

    def nvmlDeviceGetUtilizationRates(self, handle: Handle) -> Any:
        gpu = self._gpu(handle, "nvmlDeviceGetUtilizationRates")
        if gpu.mig_devices:
            _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        t = self._clock()
        util, memory = gpu.utilization(t, gpu.processes(t))
        return pynvml.c_nvmlUtilization_t(gpu=util, memory=memory)

    def nvmlDeviceGetEncoderUtilization(self, handle: Handle) -> list[int]:
        gpu, t = self._gpu(handle, "nvmlDeviceGetEncoderUtilization"), self._clock()
        return [gpu.codec_utilization(t, gpu.processes(t), 8.0), _SAMPLING_PERIOD_US]

    def nvmlDeviceGetDecoderUtilization(self, handle: Handle) -> list[int]:
        gpu, t = self._gpu(handle, "nvmlDeviceGetDecoderUtilization"), self._clock()
        return [gpu.codec_utilization(t, gpu.processes(t), 4.0), _SAMPLING_PERIOD_US]

    def nvmlDeviceGetMemoryInfo(self, handle: Handle, version: int | None = None) -> Any:
        if version and "nvmlDeviceGetMemoryInfo_v2" in self._missing:  # before R510
            _fail(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        device = self._device(handle, "nvmlDeviceGetMemoryInfo")
        if version and version != pynvml.nvmlMemory_v2:
            _fail(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        total, reserved = device.total_memory, device.reserved_memory
        t = self._clock()
        held = device.memory_processes(t) if isinstance(device, _MigDevice) else device.processes(t)
        used = sum(p.used_memory for p in held)
        free = total - reserved - used
        if not version:  # version 1 counts reserved memory as used
            return pynvml.c_nvmlMemory_t(total=total, free=free, used=reserved + used)
        return pynvml.c_nvmlMemory_v2_t(
            version=version, total=total, reserved=reserved, free=free, used=used
        )

    def nvmlDeviceGetTemperature(self, handle: Handle, sensor: int) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetTemperature")
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpu.temperature(self._clock())

    def nvmlDeviceGetFieldValues(self, handle: Handle, fieldIds: list[int]) -> Any:
        """Memory temperature and NVLink throughput (KiB, all links or one); failures go
        into each entry's ``nvmlReturn``."""
        device, fault = self._resolve(handle, "nvmlDeviceGetFieldValues")
        if fault == pynvml.NVML_ERROR_GPU_IS_LOST:
            _fail(pynvml.NVML_ERROR_GPU_IS_LOST)
        t, links = self._clock(), self._gpm.profile.nvlinks
        values = (pynvml.c_nvmlFieldValue_t * len(fieldIds))()
        for entry, field_id in zip(values, fieldIds, strict=True):
            entry.fieldId, entry.scopeId = (
                field_id if isinstance(field_id, tuple) else (field_id, 0)
            )
            entry.timestamp, entry.latencyUsec = int(t * 1e6), 0
            if fault is not None:
                entry.nvmlReturn = fault
            elif (
                not isinstance(device, _Gpu) or entry.fieldId in self.profile.unsupported_field_ids
            ):
                entry.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
            elif entry.fieldId == pynvml.NVML_FI_DEV_MEMORY_TEMP:
                entry.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
                entry.value.uiVal = min(95, device.temperature(t) + 4)
            elif (kib := nvlink_field(device, links, entry.fieldId, entry.scopeId, t)) is not None:
                entry.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
                entry.value.ullVal = kib
            else:
                entry.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return values

    def nvmlDeviceGetPowerUsage(self, handle: Handle) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetPowerUsage")
        return round(gpu.power_w(self._clock()) * 1000)

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: Handle) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetTotalEnergyConsumption")
        return gpu.energy_mj(self._clock())

    def nvmlDeviceGetClockInfo(self, handle: Handle, type: int) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetClockInfo")
        if type == pynvml.NVML_CLOCK_MEM:
            return _MEM_CLOCK_MHZ
        if type not in (pynvml.NVML_CLOCK_GRAPHICS, pynvml.NVML_CLOCK_SM, pynvml.NVML_CLOCK_VIDEO):
            _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        reasons = gpu.clock_reasons(self._clock())
        state = "boost"
        if reasons & pynvml.nvmlClocksEventReasonGpuIdle:
            state = "idle"
        elif reasons & pynvml.nvmlClocksEventReasonSwPowerCap:
            state = "capped"
        mhz = _SM_CLOCK_MHZ[state]
        return mhz * 1755 // 1980 if type == pynvml.NVML_CLOCK_VIDEO else mhz

    def nvmlDeviceGetPcieReplayCounter(self, handle: Handle) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetPcieReplayCounter")
        return gpu.since_load(self._clock(), gpu.replay_interval)

    def nvmlDeviceGetPcieThroughput(self, device: Handle, counter: int) -> int:
        """KB/s over the last 20 ms: mostly host-to-device (RX) traffic, following the load."""
        gpu = self._gpu(device, "nvmlDeviceGetPcieThroughput")
        if counter not in (pynvml.NVML_PCIE_UTIL_TX_BYTES, pynvml.NVML_PCIE_UTIL_RX_BYTES):
            _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpu.pcie_kbps(counter, self._clock())

    def nvmlDeviceGetRemappedRows(self, device: Handle) -> tuple[int, int, int, int]:
        self._gpu(device, "nvmlDeviceGetRemappedRows")
        return (0, 0, 0, 0)

    def nvmlDeviceGetTotalEccErrors(self, handle: Handle, errorType: int, counterType: int) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetTotalEccErrors")
        if errorType not in (0, 1) or counterType not in (0, 1):
            _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if errorType == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED:
            return 0
        volatile = gpu.since_load(self._clock(), gpu.ecc_interval)
        aggregate = counterType == pynvml.NVML_AGGREGATE_ECC
        return volatile + gpu.ecc_before_load if aggregate else volatile

    def nvmlDeviceGetRetiredPages(self, device: Handle, sourceFilter: int) -> list[int]:
        self._gpu(device, "nvmlDeviceGetRetiredPages")
        if sourceFilter not in (0, 1):
            _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return []

    def nvmlDeviceGetRetiredPagesPendingStatus(self, device: Handle) -> int:
        self._gpu(device, "nvmlDeviceGetRetiredPagesPendingStatus")
        return 0

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Handle) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetCurrentClocksEventReasons")
        return gpu.clock_reasons(self._clock())

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: Handle) -> int:
        """The same bits under their pre-R535 name (deprecated, still exported since)."""
        gpu = self._gpu(handle, "nvmlDeviceGetCurrentClocksThrottleReasons")
        return gpu.clock_reasons(self._clock())

    def nvmlDeviceGetViolationStatus(self, device: Handle, perfPolicyType: int) -> Any:
        gpu = self._gpu(device, "nvmlDeviceGetViolationStatus")
        if not 0 <= perfPolicyType < pynvml.NVML_PERF_POLICY_COUNT:
            _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        fraction = {
            pynvml.NVML_PERF_POLICY_POWER: gpu.power_violation,
            pynvml.NVML_PERF_POLICY_THERMAL: gpu.thermal_violation,
        }.get(perfPolicyType, 0.0)
        t = self._clock()
        violation_ns = int(max(0.0, t - gpu.t0) * fraction * 1e9)
        return pynvml.c_nvmlViolationTime_t(referenceTime=int(t * 1e6), violationTime=violation_ns)

    def nvmlDeviceGetGridLicensableFeatures(self, handle: Handle) -> Any:
        """A bare-metal GPU: vGPU licensing does not apply."""
        self._gpu(handle, "nvmlDeviceGetGridLicensableFeatures")
        return pynvml.c_nvmlGridLicensableFeatures_v4_t(
            isGridLicenseSupported=0, licensableFeaturesCount=0
        )

    # --- MIG ---------------------------------------------------------------------------------

    def nvmlDeviceGetMigMode(self, device: Handle) -> list[int]:
        mode = int(bool(self._gpu(device, "nvmlDeviceGetMigMode").mig_devices))
        return [mode, mode]  # current, pending

    def nvmlDeviceGetMaxMigDeviceCount(self, device: Handle) -> int:
        gpu = self._gpu(device, "nvmlDeviceGetMaxMigDeviceCount")
        return _MAX_MIG_DEVICES if gpu.mig_devices else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: Handle, index: int) -> Handle:
        """The index-th MIG device (compute instance) of the GPU."""
        gpu = self._gpu(device, "nvmlDeviceGetMigDeviceHandleByIndex")
        if not 0 <= index < (_MAX_MIG_DEVICES if gpu.mig_devices else 0):
            _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if index >= len(gpu.mig_handles):
            _fail(pynvml.NVML_ERROR_NOT_FOUND)
        return pynvml.c_nvmlDevice_t(gpu.mig_handles[index].target)

    def nvmlDeviceGetGpuInstanceId(self, device: Handle) -> int:
        mig_device = self._device(device, "nvmlDeviceGetGpuInstanceId")
        if not isinstance(mig_device, _MigDevice):
            _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return mig_device.gpu_instance_id

    def nvmlDeviceGetComputeInstanceId(self, device: Handle) -> int:
        mig_device = self._device(device, "nvmlDeviceGetComputeInstanceId")
        if not isinstance(mig_device, _MigDevice):
            _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return mig_device.compute_instance_id

    # --- processes ---------------------------------------------------------------------------

    def _running(self, handle: Handle, function: str, *, graphics: bool) -> list[Any]:
        """As pynvml's wrappers: friendly objects, usedGpuMemory None for NVML's sentinel."""
        device = self._device(handle, function)
        out = []
        for p in device.processes(self._clock()):
            if not (p.graphics if graphics else p.compute):
                continue
            info = pynvml.nvmlStructToFriendlyObject(
                pynvml.c_nvmlProcessInfo_t(
                    pid=p.pid,
                    usedGpuMemory=p.used_memory,
                    gpuInstanceId=p.gpu_instance_id,
                    computeInstanceId=p.compute_instance_id,
                )
            )
            if device.owner.memory_unavailable:
                info.usedGpuMemory = None  # pynvml's answer to NVML_VALUE_NOT_AVAILABLE
            out.append(info)
        return out

    def _unversioned(self, function: str) -> None:
        """pynvml's unversioned process calls use the _v3 symbol inside
        throwOnVersionMismatch: a driver without it raises NVMLLibraryMismatchError, which
        is not an NVMLError."""
        if f"{function}_v3" in self._missing:
            raise pynvml.NVMLLibraryMismatchError(
                "Unversioned function called and the pyNVML version does not match the NVML "
                f"lib version. Either use matching pyNVML and NVML lib versions or use a "
                f"versioned function such as {function}_v2"
            )

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Handle) -> list[Any]:
        self._unversioned("nvmlDeviceGetComputeRunningProcesses")
        return self._running(handle, "nvmlDeviceGetComputeRunningProcesses", graphics=False)

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: Handle) -> list[Any]:
        self._unversioned("nvmlDeviceGetGraphicsRunningProcesses")
        return self._running(handle, "nvmlDeviceGetGraphicsRunningProcesses", graphics=True)

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: Handle) -> list[Any]:
        return self._running(handle, "nvmlDeviceGetComputeRunningProcesses_v2", graphics=False)

    def nvmlDeviceGetGraphicsRunningProcesses_v2(self, handle: Handle) -> list[Any]:
        return self._running(handle, "nvmlDeviceGetGraphicsRunningProcesses_v2", graphics=True)

    def nvmlDeviceGetProcessUtilization(self, handle: Handle, timeStamp: int) -> list[Any]:
        """One sample per running process, taken at the latest 167 ms sampling instant.

        The device's utilisation is shared out by weight, so the samples add up to it.
        """
        gpu = self._gpu(handle, "nvmlDeviceGetProcessUtilization")
        if gpu.mig_devices:
            _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        t = self._clock()
        sampled_us = int(t * 1e6) // _SAMPLING_PERIOD_US * _SAMPLING_PERIOD_US
        processes = gpu.processes(t)
        if not processes or sampled_us <= timeStamp:
            _fail(pynvml.NVML_ERROR_NOT_FOUND)  # no sample newer than timeStamp
        util, memory = gpu.utilization(t, processes)
        weights = sum(p.weight for p in processes)
        coders = [p for p in processes if p.graphics]
        enc = gpu.codec_utilization(t, processes, 8.0) // max(1, len(coders))
        dec = gpu.codec_utilization(t, processes, 4.0) // max(1, len(coders))
        return [
            pynvml.c_nvmlProcessUtilizationSample_t(
                pid=p.pid,
                timeStamp=sampled_us,
                smUtil=int(util * p.weight / weights),
                memUtil=int(memory * p.weight / weights),
                encUtil=enc if p.graphics else 0,
                decUtil=dec if p.graphics else 0,
            )
            for p in processes
        ]

    # --- events (XID) ------------------------------------------------------------------------

    def nvmlEventSetCreate(self) -> Any:
        self._check("nvmlEventSetCreate")
        event_set = _EventSet()
        with self._cond:
            self._event_sets[ctypes.addressof(event_set.target)] = event_set
        return pynvml.c_nvmlEventSet_t(event_set.target)

    def nvmlDeviceGetSupportedEventTypes(self, handle: Handle) -> int:
        self._gpu(handle, "nvmlDeviceGetSupportedEventTypes")
        return int(_SUPPORTED_EVENTS)

    def nvmlDeviceRegisterEvents(self, handle: Handle, eventTypes: int, eventSet: Any) -> None:
        gpu = self._gpu(handle, "nvmlDeviceRegisterEvents")
        event_set = self._event_set(eventSet, "nvmlDeviceRegisterEvents")
        if eventTypes & ~_SUPPORTED_EVENTS:
            _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        with self._cond:
            event_set.registered[gpu.index] = event_set.registered.get(gpu.index, 0) | eventTypes

    def nvmlEventSetWait_v2(self, eventSet: Any, timeoutms: int) -> Any:
        """Wait (in wall-clock time, not ``clock``) until an event is pending or time is up.

        Freeing the set or shutting NVML down wakes the waiter with UNINITIALIZED.
        """
        event_set = self._event_set(eventSet, "nvmlEventSetWait_v2")
        deadline = time.monotonic() + timeoutms / 1000
        with self._cond:
            while not event_set.pending:
                if event_set.freed or self._init_count == 0:
                    _fail(pynvml.NVML_ERROR_UNINITIALIZED)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    _fail(pynvml.NVML_ERROR_TIMEOUT)
                self._cond.wait(remaining)  # releases the lock while it waits
            gpu, xid = event_set.pending.popleft()
        return pynvml.c_nvmlEventData_t(
            device=pynvml.c_nvmlDevice_t(gpu.target),
            eventType=pynvml.nvmlEventTypeXidCriticalError,
            eventData=xid,
            gpuInstanceId=_NOT_APPLICABLE,
            computeInstanceId=_NOT_APPLICABLE,
        )

    def nvmlEventSetFree(self, eventSet: Any) -> None:
        event_set = self._event_set(eventSet, "nvmlEventSetFree")
        with self._cond:
            event_set.freed = True  # kept, so that later use fails with UNINITIALIZED too
            event_set.pending.clear()
            self._cond.notify_all()

    # --- GPM (Hopper and newer; see simulator_gpm) -------------------------------------------

    @property
    def gpm_samples_allocated(self) -> int:
        """GPM sample buffers allocated and not freed (not part of NvmlLib: for leak tests)."""
        return self._gpm.allocated

    def nvmlGpmQueryDeviceSupport(self, device: Handle) -> Any:
        self._gpu(device, "nvmlGpmQueryDeviceSupport")
        return self._gpm.support()

    def nvmlGpmSampleAlloc(self) -> Any:
        self._check("nvmlGpmSampleAlloc")
        return self._gpm.alloc()

    def nvmlGpmSampleFree(self, gpmSample: Any) -> None:
        self._check("nvmlGpmSampleFree")
        self._gpm.free(gpmSample)

    def nvmlGpmSampleGet(self, device: Handle, gpmSample: Any) -> Any:
        sampled = self._device(device, "nvmlGpmSampleGet")
        if isinstance(sampled, _MigDevice):  # a compute instance counts its GPU instance's
            return self._gpm.take(sampled.instance, gpmSample, self._clock())
        return self._gpm.take(sampled, gpmSample, self._clock())

    def nvmlGpmMigSampleGet(self, device: Handle, gpuInstanceId: int, gpmSample: Any) -> Any:
        gpu = self._gpu(device, "nvmlGpmMigSampleGet")
        return self._gpm.take_mig(gpu, gpuInstanceId, gpmSample, self._clock())

    def nvmlGpmMetricsGet(self, metricsGet: Any) -> Any:
        self._check("nvmlGpmMetricsGet")
        return self._gpm.metrics(metricsGet)
