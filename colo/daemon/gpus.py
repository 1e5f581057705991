"""The GPUs as the daemon sees them, and colo's MPS control daemons on them.

Owns: the NVML handle, `devices` (as last read), `error` (why no GPU can be used: no driver),
`unbudgeted` (bytes per GPU held outside any budget, as the patrol last saw it: plan() gives none
of it out), `drained` (uuid -> "drained by USER: REASON", `colo drain`: nothing new is placed
there) and `mps` (one control daemon per GPU, colo/node/mps/). Only its own methods change
them: the sampler has it read the devices at each tick (`refresh` in a thread, `adopt` on the loop),
the patrol reports what is unbudgeted (`note_unbudgeted`), drain.py what admins drained
(`set_drained`); everyone else reads `views()`.
"""
from __future__ import annotations

import logging
from pathlib import Path

from ..config import Config
from ..node import mps, native
from ..node.gpu import GpuInfo, NoDriver, Nvml
from ..sched import policy

log = logging.getLogger("colo")


class Gpus:
    def __init__(self, config: Config, native_dir: Path):
        self.config = config
        self.native = native_dir
        self.nvml = Nvml(config.fakegpu_state)
        self.devices: list[GpuInfo] = []
        self.error: str | None = None
        self.unbudgeted: dict[str, int] = {}
        self.drained: dict[str, str] = {}
        control = (native_dir / native.FAKEGPU_DIR / "nvidia-cuda-mps-control"
                   if config.fakegpu_state else "nvidia-cuda-mps-control")
        self.mps = mps.MpsManager(config.state_dir / "mps", control, self.fake_env() if config.fakegpu_state else {},
                                  multi_user=config.multi_user_mps, idle_stop_s=config.mps_idle_stop)

    def open(self) -> bool:
        """Read the devices and check their compute modes; whether MPS can be used here."""
        try:
            self.devices = self.nvml.devices()
        except NoDriver as e:
            self.error = str(e)
            log.warning("%s", e)
        return self._check_compute_modes()

    def _check_compute_modes(self) -> bool:
        """Invariant 4: mixing MPS and time-sliced jobs needs DEFAULT mode; say so, or set it."""
        available = self.mps.available()
        changed = False
        for dev in self.devices:
            def set_default(i=dev.index) -> None:
                self.nvml.set_compute_mode(i, "default")

            _, msg = mps.ensure_default_mode(dev.compute_mode, self.config.set_default_compute_mode, set_default,
                                             available, f"GPU{dev.index}")
            if msg:
                log.warning("%s", msg)
                changed = True
        if changed:
            self.devices = self.nvml.devices()
        return available

    def refresh(self) -> list[GpuInfo]:
        """Read the devices again (blocking: NVML; run in a thread); the new list, or the old one
        when the driver stopped answering (then `error` says why)."""
        if self.error is None:
            try:
                return self.nvml.devices()
            except NoDriver as e:
                self.error = str(e)
        return self.devices

    def adopt(self, devices: list[GpuInfo]) -> list[GpuInfo]:
        """Keep `devices` (what refresh read, handed back to the loop) as the devices; those before."""
        before, self.devices = self.devices, devices
        return before

    def note_unbudgeted(self, per_gpu: dict[str, int]) -> bool:
        """Bytes per GPU held outside any budget, as the patrol just saw them; whether they changed."""
        changed, self.unbudgeted = per_gpu != self.unbudgeted, per_gpu
        return changed

    def set_drained(self, uuid: str, text: str | None) -> None:
        """Drain a GPU ("drained by root: driver update"), or with None put it back in service."""
        if text is None:
            self.drained.pop(uuid, None)
        else:
            self.drained[uuid] = text

    def views(self, in_use: bool = False) -> list[policy.GpuView]:
        """The GPUs as plan() sees them. in_use: less the memory the patrol saw held outside any
        budget (what plan() may give)."""
        states = self.mps.states()
        less = self.unbudgeted if in_use else {}
        reserve = self.config.reserve
        return [policy.GpuView(uuid=d.uuid, index=d.index, usable=max(0, d.total - reserve - less.get(d.uuid, 0)),
                               compute_mode=d.compute_mode, mps=states.get(d.uuid, "off"), name=d.name, error=d.error,
                               drained=self.drained.get(d.uuid))
                for d in self.devices]

    def name_of(self, uuid: str) -> str:
        """"GPU1" for a uuid colo sees, else the uuid."""
        return next((f"GPU{d.index}" for d in self.devices if d.uuid == uuid), uuid)

    def fake_env(self) -> dict[str, str]:
        """What a process needs to reach the simulated driver (tests, `colo demo`)."""
        lib = self.native / native.FAKEGPU_DIR
        return {"COLO_FAKEGPU_STATE": str(self.config.fakegpu_state), "LD_LIBRARY_PATH": str(lib)}

    def revoke_mps_access(self, users: dict[str, set[int]]) -> None:
        """After a job ended and was reaped: uids left without MPS jobs on a GPU lose access.
        users: GPU uuid -> uids of its MPS jobs (JobTable.mps_users)."""
        if not self.mps.available():
            return
        for dev in self.devices:
            try:
                self.mps.keep_only(dev.uuid, users.get(dev.uuid, set()))
            except mps.MpsError as e:
                log.error("%s", e)

    def close(self) -> None:
        self.mps.stop_unused()  # MPS servers of running jobs stay up and are adopted at restart
