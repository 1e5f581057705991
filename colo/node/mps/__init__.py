"""NVIDIA MPS: one `nvidia-cuda-mps-control -d` per GPU, with a private pipe directory.

Why one control daemon per GPU: each daemon is pinned to its GPU (CUDA_VISIBLE_DEVICES=<uuid>),
so a fault, a per-uid server switch or a stop on one GPU never touches the others, and a job's
pipe directory names exactly the GPU it was placed on. Time-sliced jobs get a pipe directory with
no daemon behind it, so they can never attach to MPS by accident (invariant 4, docs/invariants.md).

The control daemon outlives colo on purpose (it daemonizes): a colo restart finds it again by the
pid file in its pipe directory and its running clients keep their server (invariant 7).
"""
from __future__ import annotations

from .access import CLIENT_PERM, NULL_PIPE_DIR, acl_problem, acl_users, null_pipe_dir, set_pipe_access, timesliced_env
from .daemon import FAKE_MULTIUSER_ENV, PID_FILE, MpsDaemon, MpsError, gpu_dir_name, mps_size, pinned_limit
from .manager import FAULT_REASON, CheckReport, MpsManager
from .modes import compute_mode_ok, ensure_default_mode, mode_plan

__all__ = ["CLIENT_PERM", "NULL_PIPE_DIR", "acl_problem", "acl_users", "null_pipe_dir", "set_pipe_access",
           "timesliced_env", "FAKE_MULTIUSER_ENV", "PID_FILE", "MpsDaemon", "MpsError", "gpu_dir_name",
           "mps_size", "pinned_limit", "FAULT_REASON", "CheckReport", "MpsManager", "compute_mode_ok",
           "ensure_default_mode", "mode_plan"]
