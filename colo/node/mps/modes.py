"""GPU compute modes: which of them let MPS clients and time-sliced jobs share a GPU, and what colo
does with a GPU in each."""
from __future__ import annotations

import logging
from typing import Callable

from .daemon import _one_line

log = logging.getLogger("colo.node.mps")


_NVML_MODES = {0: "default", 1: "exclusive_thread", 2: "prohibited", 3: "exclusive_process"}


def _mode_name(mode: str | int) -> str:
    if isinstance(mode, int):
        return _NVML_MODES.get(mode, f"unknown({mode})")
    return str(mode).strip().lower().replace("-", "_").replace(" ", "_")


def compute_mode_ok(mode: str | int) -> tuple[bool, str]:
    """Whether a GPU in this compute mode can mix MPS clients and time-sliced jobs (invariant 4)."""
    m = _mode_name(mode)
    if m == "default":
        return True, "DEFAULT compute mode: MPS clients and time-sliced jobs can share it"
    if m in ("exclusive_process", "exclusive_thread"):
        return False, (f"{m.upper()} compute mode: one CUDA context at a time, so MPS clients "
                       "(which share the MPS server's context) or a single time-sliced job, "
                       "never both")
    if m == "prohibited":
        return False, "PROHIBITED compute mode: no CUDA context may be created on it"
    return False, f"unknown compute mode {mode!r}"


def mode_plan(mode: str | int, set_default_mode: bool, mps_available: bool = True,
              name: str = "GPU") -> tuple[str, str]:
    """What to do with a GPU in this compute mode: ("mixed" | "mps_only" | "timesliced_only" |
    "unusable", message). "mixed" for a non-DEFAULT GPU means: set it to DEFAULT first (see
    ensure_default_mode). Pure."""
    ok, why = compute_mode_ok(mode)
    m = _mode_name(mode)
    if ok:
        return "mixed", ""
    if m == "prohibited":
        return "unusable", f"{name}: {why}; colo places no jobs on it"
    if set_default_mode and m in ("exclusive_process", "exclusive_thread"):
        return "mixed", (f"{name} is in {m.upper()} compute mode; setting it to DEFAULT "
                         "(set_default_compute_mode)")
    if m in ("exclusive_process", "exclusive_thread") and mps_available:
        return "mps_only", (f"{name} is in {m.upper()} compute mode: MPS jobs only (set "
                            "set_default_compute_mode = true, or run `nvidia-smi -c DEFAULT`, "
                            "to mix)")
    return "timesliced_only", f"{name}: {why}; one job at a time"


def ensure_default_mode(mode: str | int, set_default_mode: bool,
                        set_mode: Callable[[], None] | None = None, mps_available: bool = True,
                        name: str = "GPU") -> tuple[str, str]:
    """mode_plan, carried out: when it says to set DEFAULT, call `set_mode` (the NVML call, which
    needs root); if that fails, fall back to what the GPU can do in its current mode."""
    use, msg = mode_plan(mode, set_default_mode, mps_available, name)
    if use == "mixed" and _mode_name(mode) != "default":
        try:
            if set_mode is None:
                raise RuntimeError("no way to set the compute mode was given")
            set_mode()
        except Exception as e:  # noqa: BLE001 - any failure leaves the GPU in its mode
            use, msg = mode_plan(mode, False, mps_available, name)
            msg = f"{msg} (setting DEFAULT failed: {_one_line(str(e))})"
    if msg:
        log.warning("%s", msg)
    return use, msg
