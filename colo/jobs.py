"""What a job is: its spec, its state, and the one table of allowed state changes."""
from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field, replace
from sys import intern
from typing import Any


class State(str, enum.Enum):
    QUEUED = "queued"
    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    LOST = "lost"  # its process or container vanished while colo was not watching

    def __str__(self) -> str:
        return self.value


TERMINAL = frozenset({State.SUCCEEDED, State.FAILED, State.CANCELLED, State.LOST})
ACTIVE = frozenset({State.STARTING, State.RUNNING})
ARRAY_FIELDS = ("array_job", "array_index", "array_size", "array_limit")  # set by the daemon, never by a submitter

# The only place that says which state may follow which.
ALLOWED: dict[State, frozenset[State]] = {
    State.QUEUED: frozenset({State.STARTING, State.CANCELLED, State.FAILED}),
    # STARTING -> QUEUED: a start that failed for a passing reason (e.g. MPS server refusing) is retried.
    State.STARTING: frozenset({State.RUNNING, State.FAILED, State.CANCELLED, State.LOST, State.QUEUED}),
    State.RUNNING: frozenset({State.SUCCEEDED, State.FAILED, State.CANCELLED, State.LOST, State.QUEUED}),
    State.SUCCEEDED: frozenset(),
    State.FAILED: frozenset(),
    State.CANCELLED: frozenset(),
    State.LOST: frozenset(),
}


class InvalidTransition(ValueError):
    pass


def check_transition(old: State, new: State) -> None:
    if new not in ALLOWED[State(old)]:
        raise InvalidTransition(f"a job cannot go from {old} to {new}")


class Mode(str, enum.Enum):
    MPS = "mps"
    TIMESLICED = "timesliced"
    NONE = "none"  # a job that uses no GPU

    def __str__(self) -> str:
        return self.value


@dataclass
class Mount:
    source: str
    target: str
    read_only: bool = False

    @classmethod
    def parse(cls, text: str) -> "Mount":
        parts = text.split(":")
        if len(parts) not in (2, 3) or not parts[0] or not parts[1] or (len(parts) == 3 and parts[2] not in ("ro", "rw")):
            raise ValueError(f"malformed mount {text!r}: use SRC:DST or SRC:DST:ro")
        return cls(parts[0], parts[1], len(parts) == 3 and parts[2] == "ro")


@dataclass(slots=True)  # slots: a queue of 50,000 kept in memory (a __dict__ each was ~0.8 KiB more)
class JobSpec:
    """What the submitter asked for. Validated by the daemon, stored as JSON."""
    argv: list[str]
    image: str | None = None  # None: a host process
    name: str | None = None
    gpu_mem: int = 0  # bytes per GPU
    gpus: int = 1
    env: dict[str, str] = field(default_factory=dict)
    mounts: list[Mount] = field(default_factory=list)
    workdir: str | None = None
    after: list[int] = field(default_factory=list)  # start once these succeeded (Slurm's afterok)
    after_any: list[int] = field(default_factory=list)  # ... once these ended, however (afterany)
    after_fail: list[int] = field(default_factory=list)  # ... once these ended without success (afternotok)
    priority: int = 0
    profile: str | None = None
    retries: int = 0  # times a job may be requeued after a fault that was not its own (MPS server fault)
    grow: bool = False  # refused by its budget: requeued once with a larger one (then False again)
    # Set by the daemon, never by a submitter: a --grow job started with more than it asked for
    # (lent, or what its profile's runs used) has that budget in gpu_mem, which everything counts
    # (interposer, invariant 1, limits, a restarted daemon), and what it asked for here; back in the
    # queue it asks for that again.
    asked_mem: int | None = None
    slurm_job: int | None = None  # started by Slurm on this node (colo/daemon/external.py); never from a submitter
    cpus: float | None = None  # CPU limit in cores (cgroup / Docker nano_cpus)
    mem: int | None = None  # host memory limit in bytes (cgroup / Docker mem_limit)
    tasks: int | None = None  # --tasks: processes and threads at once (pids.max); None: the node's job_tasks
    time: int | None = None  # wall-time limit in seconds: stopped when it is reached
    gpu_ids: list[int] = field(default_factory=list)  # --gpu-id: only these GPU indices may take it (empty: any)
    gpu_type: str | None = None  # --gpu-type: only GPUs whose name holds this (case-insensitive)
    # A task of a job array (--array): the array's id (its first task's job id), this task's
    # index (COLO_ARRAY_INDEX), the number of tasks, and how many may run at once (%N; None: no bound).
    array_job: int | None = None
    array_index: int | None = None
    array_size: int | None = None
    array_limit: int | None = None
    copy_of: int | None = None  # `colo requeue`: the ended job this one runs again (colo wait follows it)
    # A person's session (colo shell, colo run, a notebook's kernel), not a batch job: what the idle
    # policy may end. A submitter may say so; `tty` only the daemon sets (op `session`): the job runs
    # on a terminal colo made for it, whose other end went to the submitter's client; `detached`
    # (the daemon's too): a session started with --detach, whose terminal colo keeps (daemon/detach.py),
    # made again at its start when a restart lost it while it was queued; `pipe` (the daemon's too):
    # one without a terminal (colo run fed from a pipe): pipes (a host job's) or a socket (a container's).
    interactive: bool = False
    no_suspend: bool = False  # --no-suspend: colo's policies never suspend it (colo suspend still may)
    tty: bool = False
    detached: bool = False
    pipe: bool = False
    begin: float | None = None  # --begin/--delay: not started before this (epoch seconds)
    # --output/--error: files the job's stdout (and stderr, or its stderr apart) also go to, opened
    # as its user (never by root: colo-shim's writer, native/shim); %j and the like expanded at start
    output: str | None = None
    error: str | None = None
    on_end: str | None = None  # --on-end: a shell command run as its user when it ends
    mail_type: str | None = None  # --mail-type END, FAIL or ALL (where the node has a mail transfer agent)
    mail_user: str | None = None

    @property
    def runtime(self) -> str:
        if self.slurm_job is not None:
            return "slurm"
        return "docker" if self.image else "process"

    @property
    def deps(self) -> bool:
        return bool(self.after or self.after_any or self.after_fail)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in _LISTS:  # the shared empty tuple from_dict puts in (below): a list, as sent and stored
            if type(d[k]) is tuple:
                d[k] = list(d[k])
        return d

    def as_asked(self) -> "JobSpec":
        """The spec as its submitter asked for it (the budget a start under --grow raised put back)."""
        if self.asked_mem is None:
            return self
        return replace(self, gpu_mem=self.asked_mem, asked_mem=None)

    @property
    def array_ref(self) -> str | None:
        """`ARRAY_INDEX` (as Slurm writes a task: 12_3), or None for a job of no array."""
        return None if self.array_job is None else f"{self.array_job}_{self.array_index}"

    def out_path(self, pattern: str, job_id: int, user: str) -> str:
        """--output/--error with Slurm's replacements: %j the job id, %A the array's id, %a the task's
        index, %x the job's name, %u the user, %% a %. (validate.py refuses any other %.)"""
        sub = {"j": str(job_id), "A": str(self.array_job if self.array_job is not None else job_id),
               "a": str(self.array_index if self.array_index is not None else 0), "x": self.name or "colo",
               "u": user, "%": "%"}
        out, i = [], 0
        while i < len(pattern):
            ch = pattern[i]
            if ch == "%" and i + 1 < len(pattern) and pattern[i + 1] in sub:
                out.append(sub[pattern[i + 1]])
                i += 2
                continue
            out.append(ch)
            i += 1
        return "".join(out)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "JobSpec":
        """A spec as stored (JSON). The daemon holds every open job's: an empty list of its is one
        shared empty tuple (immutable, so sharing it is safe) and short texts that repeat from job
        to job (the workdir, the image, the words of a command) one copy each, so that 50,000
        queued jobs cost half what they did."""
        d = dict(d)
        d["mounts"] = [m if isinstance(m, Mount) else Mount(**m) for m in d.get("mounts", [])]
        for k in _LISTS:
            if k in d and not d[k]:
                d[k] = ()
        for k in ("workdir", "image", "profile", "name"):
            if isinstance(d.get(k), str):
                d[k] = intern(d[k])
        if isinstance(d.get("argv"), list):
            d["argv"] = shared_argv(d["argv"])
        if "env" in d and not d["env"]:
            d["env"] = NO_ENV
        if type(d.get("gpu_mem")) is int:
            d["gpu_mem"] = shared_int(d["gpu_mem"])
        known = _FIELDS
        return cls(**{k: v for k, v in d.items() if k in known})


_LISTS = ("mounts", "after", "after_any", "after_fail", "gpu_ids")
_FIELDS = frozenset(JobSpec.__dataclass_fields__)

# What open jobs (50,000 queued, held in memory) share rather than hold a copy each. Shared objects
# are never changed in place (nothing in colo does: a spec is replaced, never edited): an empty env
# is one dict; a command given to many jobs is one list (and its words one copy each); the same
# number (a user's uid and gid, a budget) is one int object (Python shares only -5..256 itself).
NO_ENV: dict[str, str] = {}
_ARGVS: dict[tuple, list[str]] = {}
_INTS: dict[int, int] = {}
_SHARED_MAX = 4096  # distinct commands and numbers kept: past it, started afresh (never stale: equal is equal)


def shared_argv(argv: list[str]) -> list[str]:
    """One list for every spec whose command is this one (a long command: a list of its own)."""
    if len(argv) > 16 or sum(map(len, argv)) > 1024:
        return [intern(a) if len(a) <= 64 else a for a in argv]
    key = tuple(argv)
    hit = _ARGVS.get(key)
    if hit is None:
        if len(_ARGVS) >= _SHARED_MAX:
            _ARGVS.clear()
        hit = _ARGVS[key] = [intern(a) if len(a) <= 64 else a for a in argv]
    return hit


def shared_int(v: int) -> int:
    hit = _INTS.get(v)
    if hit is None:
        if len(_INTS) >= _SHARED_MAX:
            _INTS.clear()
        hit = _INTS[v] = v
    return hit


@dataclass(slots=True)
class Job:
    id: int
    spec: JobSpec
    uid: int
    gid: int
    user: str
    state: State = State.QUEUED
    reason: str = ""
    submitted_at: float = 0.0
    started_at: float | None = None
    ended_at: float | None = None
    exit_code: int | None = None
    gpus: list[str] = field(default_factory=list)  # UUIDs
    mode: Mode | None = None
    handle: str | None = None  # runtime's id: container id, or "pid:starttime"
    attempts: int = 0
    cancel_by: str | None = None  # a cancel was asked for (by this user) and is under way
    held_by: str | None = None  # `colo hold`: a queued job that is not started until released
    paused_by: str | None = None  # `colo pause`: a running job frozen (cgroup freezer, docker pause)
    # `colo suspend`: a running job's GPU memory held in host memory by the driver's checkpoint
    # (JSON: colo.daemon.suspend.Record); None: not suspended
    suspended: str | None = None
    off_gpu: float = 0.0  # seconds it was suspended, ended suspends only: not GPU use (fair share, report)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["state"] = str(self.state)
        d["mode"] = str(self.mode) if self.mode else None
        return d
