"""The shapes of the listing replies: what `ls --json`, `show`, `wait`, `gpus` and `top` send of a
job and a GPU. The daemon builds them (colo/daemon/listing.py); the client, the TUI and the CLI
read them (colo/client.py names them in its signatures). A key added on one side is added here.

The client imports this module only for type checking: `colo submit`'s short path loads no typing.
"""
from __future__ import annotations

from typing import TypedDict


class _JobSummaryBase(TypedDict):
    id: int
    name: str | None
    held_by: str | None  # who holds a queued job (colo hold); None for others
    user: str
    uid: int
    state: str  # jobs.State's value
    paused_by: str | None  # who paused a running job
    suspended: str | None  # colo suspend: what a running job holds in host memory
    gpus: list[str]  # UUIDs
    gpu_index: list[int | None]  # as `colo gpus` numbers them; None: a GPU no longer here
    mode: str | None  # "exclusive", "mps", "timesliced" (a lone time-sliced job shows exclusive)
    budget: int | None  # bytes of GPU memory
    ngpus: int
    image: str | None
    argv: list[str]
    submitted_at: float
    started_at: float | None
    ended_at: float | None
    exit_code: int | None
    priority: int
    reason: str  # the live reason: the scheduler's latest word, the patrol's, who paused or holds it
    cancel_by: str | None  # who cancelled a job still stopping
    slurm_job: int | None
    array_job: int | None
    array_index: int | None


class JobSummary(_JobSummaryBase, total=False):
    """One job as listings send it; the usage keys only for a starting or running job."""
    used: int | None  # bytes, as the interposer's ledgers say
    refused: int | None  # allocations refused over the budget
    sm_util: int | None  # percent
    nvml_used: int | None  # its processes' bytes, as NVML sees them
    idle_since: float | None  # holding GPU memory with no GPU activity since (idle_after)


class GpuRow(TypedDict):
    """One GPU (node/gpu.py GpuInfo's fields) with what colo placed on it."""
    index: int
    uuid: str
    name: str
    total: int  # bytes
    used: int  # bytes
    sm_util: int | None
    mem_util: int | None
    compute_mode: str
    processes: list[dict]  # {"pid", "used", "mps"}
    error: str | None
    fault: str | None  # what says it is failing (Xid, uncorrectable ECC): colo drained it for that
    usable: int  # bytes colo may give out on it
    mps: bool  # its MPS control daemon runs
    drained: str | None  # colo drain: "drained by root: driver update" (no new job is placed on it)
    budgeted: int  # bytes: the budgets of the jobs on it
    jobs: list[int]
    unbudgeted: int  # bytes held outside any budget (processes of no job, jobs past their budgets)
    over: list[int]  # its jobs past their budgets


class GpusReply(TypedDict):
    gpus: list[GpuRow]
    error: str | None  # the driver's
    fake: bool  # simulated GPUs


class ForeignProcess(TypedDict):
    """A process of no job on a GPU, as the patrol saw it at the last sample."""
    gpu: str
    pid: int
    used: int | None
    command: str
    user: str


class TopReply(TypedDict):
    at: float
    gpus: list[GpuRow]
    gpu_error: str | None
    fake: bool
    foreign: list[ForeignProcess]
    you: str
    queued: int  # every queued job (jobs holds only the front of the queue)
    jobs: list[JobSummary]  # active jobs, the front of the queue, the newest few ended


class AdminAction(TypedDict):
    """One row of the admin log (`colo history --admin`)."""
    at: float
    by: str  # the user, or "colo" for what it did by itself (a fault drain)
    action: str  # drain, undrain, cancel, hold, release, pause, resume, suspend, edit, signal, reload
    target: str  # "GPU 0 (GPU-...)", "job 12 of alice", "config"
    why: str  # the reason given or found ("" where none was)


class AdminLogReply(TypedDict):
    actions: list[AdminAction]  # newest first
    left: int  # how many more matched beyond the limit


def keys(shape: type) -> frozenset[str]:
    """Every key a reply of `shape` may have."""
    return shape.__required_keys__ | shape.__optional_keys__
