"""The node's GPUs as NVML reports them. The only module that imports pynvml.

Every call goes through one wrapper so that a missing function or a failing device becomes
"not available" instead of an exception in the daemon.
"""
from __future__ import annotations

import ctypes
import dataclasses
import os
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pynvml

from . import native


class NoDriver(RuntimeError):
    pass


NO_DRIVER = ("no NVIDIA driver found (libnvidia-ml.so.1 could not be loaded): GPU jobs cannot run here; "
             "CPU-only jobs (--gpus 0) still can, and `colo demo` shows colo on simulated GPUs")

COMPUTE_MODES = {0: "default", 1: "exclusive_thread", 2: "prohibited", 3: "exclusive_process"}

# Xids that a program causes (illegal address, its own MMU fault, a kill...), not the GPU: as the
# NVIDIA device plugin, colo does not take a GPU out of service for them. Every other Xid drains it.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})


@dataclass
class GpuProcess:
    pid: int
    used: int | None  # bytes; None when NVML cannot say (e.g. some MPS setups)
    mps: bool = False


@dataclass
class GpuInfo:
    index: int
    uuid: str
    name: str
    total: int  # bytes
    used: int  # bytes
    sm_util: int | None = None  # percent over NVML's last sample period
    mem_util: int | None = None  # percent (memory bandwidth)
    compute_mode: str = "default"
    processes: list[GpuProcess] = field(default_factory=list)
    error: str | None = None  # NVML stopped answering for it (e.g. "GPU is lost"): nothing is placed there
    fault: str | None = None  # it answers but says it is failing (Xid errors, uncorrectable ECC): drained

    def to_dict(self) -> dict:
        return asdict(self)


def _s(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class Nvml:
    """One NVML session. `fake_state` makes it read the simulated driver instead (tests, demo)."""

    def __init__(self, fake_state: Path | None = None):
        self.fake_state = fake_state
        self._lock = threading.Lock()
        self._ok = False
        self._missing: set[str] = set()
        self._last: dict[int, GpuInfo] = {}  # index -> last good reading
        self._events = None  # NVML's event set for Xid errors, made at the first devices()
        self._handles: dict[int, int] = {}  # a registered handle's address -> its index
        self._xids: dict[int, tuple[int, int]] = {}  # index -> (latest critical Xid, how many seen)

    def init(self) -> None:
        with self._lock:
            if self._ok:
                return
            if self.fake_state is not None:
                os.environ["COLO_FAKEGPU_STATE"] = str(self.fake_state)
                lib = native.native_dir() / native.FAKEGPU_DIR / "libnvidia-ml.so.1"
                # Loaded first under its SONAME, so pynvml's dlopen("libnvidia-ml.so.1") gets the fake.
                ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
            try:
                pynvml.nvmlInit()
            except pynvml.NVMLError_LibraryNotFound as e:
                raise NoDriver(NO_DRIVER) from e
            except pynvml.NVMLError as e:
                raise NoDriver(f"NVIDIA driver present but NVML failed to start: {e}") from e
            self._ok = True

    def _get(self, fn, *args, default=None):
        try:
            return fn(*args)
        except pynvml.NVMLError_FunctionNotFound:
            self._missing.add(fn.__name__)
            return default
        except pynvml.NVMLError:
            return default

    def driver_version(self) -> str | None:
        self.init()
        v = self._get(pynvml.nvmlSystemGetDriverVersion)
        return _s(v) if v is not None else None

    def cuda_version(self) -> int | None:
        self.init()
        return self._get(pynvml.nvmlSystemGetCudaDriverVersion)

    def devices(self) -> list[GpuInfo]:
        """Every device; one NVML stops answering for keeps its last known identity and size,
        with `error` saying why, so that the jobs placed on it keep their budgets."""
        self.init()
        try:
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as e:
            return [_out_of_service(d, e) for d in self._last.values()]
        out = []
        for i in range(count):
            try:
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            except pynvml.NVMLError as e:
                out.append(_out_of_service(self._last.get(i) or GpuInfo(i, f"GPU-unknown-{i}", "?", 0, 0), e))
                continue
            util = self._get(pynvml.nvmlDeviceGetUtilizationRates, h)
            mode = self._get(pynvml.nvmlDeviceGetComputeMode, h, default=0)
            procs: dict[int, GpuProcess] = {}
            for p in self._get(pynvml.nvmlDeviceGetComputeRunningProcesses, h, default=[]) or []:
                procs[p.pid] = GpuProcess(p.pid, _used(p), False)
            for p in self._get(pynvml.nvmlDeviceGetMPSComputeRunningProcesses, h, default=[]) or []:
                procs[p.pid] = GpuProcess(p.pid, _used(p), True)
            info = GpuInfo(
                index=i, uuid=_s(self._get(pynvml.nvmlDeviceGetUUID, h, default=f"GPU-unknown-{i}")),
                name=_s(self._get(pynvml.nvmlDeviceGetName, h, default="?")),
                total=mem.total, used=mem.used,
                sm_util=util.gpu if util else None, mem_util=util.memory if util else None,
                compute_mode=COMPUTE_MODES.get(mode, str(mode)), processes=list(procs.values()))
            info.fault = self._fault(i, h)
            self._last[i] = info
            out.append(info)
        return out

    def _fault(self, index: int, h) -> str | None:
        """What says the device is failing: critical Xid events since this session began (NVML's
        event set, read without waiting), uncorrectable ECC errors since the driver loaded."""
        self._read_events(index, h)
        why = []
        if index in self._xids:
            code, n = self._xids[index]
            why.append(f"Xid {code}" + (f" ({n} critical Xid events)" if n > 1 else ""))
        dbe = self._get(pynvml.nvmlDeviceGetTotalEccErrors, h, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                        pynvml.NVML_VOLATILE_ECC)
        if dbe:
            pending = self._get(pynvml.nvmlDeviceGetRetiredPagesPendingStatus, h)
            why.append(f"{dbe} uncorrectable ECC error{'s' if dbe > 1 else ''}"
                       + (", page retirement pending (reset the GPU)" if pending else ""))
        return "; ".join(why) or None

    def _read_events(self, index: int, h) -> None:
        """Register the device for Xid errors once; take every event waiting in the set."""
        if self._events is None:
            self._events = self._get(pynvml.nvmlEventSetCreate) or False
        if not self._events:
            return
        key = ctypes.cast(h, ctypes.c_void_p).value
        if key not in self._handles:
            if self._get(pynvml.nvmlDeviceRegisterEvents, h, pynvml.nvmlEventTypeXidCriticalError, self._events,
                         default=False) is False:
                return  # not supported on this device (or this driver): its ECC counts still count
            self._handles[key] = index
        while True:
            try:
                ev = pynvml.nvmlEventSetWait(self._events, 0)
            except pynvml.NVMLError:  # NVML_ERROR_TIMEOUT: nothing waiting
                return
            at = self._handles.get(ctypes.cast(ev.device, ctypes.c_void_p).value)
            if at is not None and ev.eventData not in APPLICATION_XIDS:
                self._xids[at] = (int(ev.eventData), self._xids.get(at, (0, 0))[1] + 1)

    def set_compute_mode(self, index: int, mode: str) -> None:
        """Needs root on a real driver; raises pynvml's error when refused."""
        self.init()
        code = {v: k for k, v in COMPUTE_MODES.items()}[mode]
        pynvml.nvmlDeviceSetComputeMode(pynvml.nvmlDeviceGetHandleByIndex(index), code)

    def process_utilization(self, index: int) -> dict[int, tuple[int, int]]:
        """pid -> (SM %, memory bandwidth %) over NVML's recent samples."""
        self.init()
        h = self._get(pynvml.nvmlDeviceGetHandleByIndex, index)
        samples = self._get(pynvml.nvmlDeviceGetProcessUtilization, h, 0, default=[]) if h else []
        out: dict[int, tuple[int, int]] = {}
        for s in samples or []:
            out[s.pid] = (s.smUtil, s.memUtil)
        return out


def _out_of_service(last: GpuInfo, e: Exception) -> GpuInfo:
    """The last good reading of a device NVML no longer answers for, marked with why."""
    return dataclasses.replace(last, error=f"NVML error: {e}", processes=[], sm_util=None, mem_util=None)


def _used(p) -> int | None:
    v = getattr(p, "usedGpuMemory", None)
    # NVML_VALUE_NOT_AVAILABLE comes back as a huge unsigned number
    return None if v is None or v >= (1 << 63) else int(v)
