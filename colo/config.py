"""Where colo keeps things and the knobs of its daemon, from defaults, a TOML file and flags."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path

from .paths import default_socket, default_state_dir  # noqa: F401 - re-exported: colo.config is their old home
from .units import format_size_exact, parse_size


class ConfigError(ValueError):
    """keys: the config keys at fault (by default the word the message starts with), so that
    `colo config check` can go on past them and say on which line each is."""

    def __init__(self, msg: str, keys: tuple[str, ...] | None = None):
        super().__init__(msg)
        m = re.match(r"\w+", msg)
        self.keys = keys if keys is not None else ((m.group(0),) if m else ())


# What a value of each plain field type may be in the TOML file (a bool is no number here).
_TYPES = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,)}
_TYPE_WORDS = {"int": "a whole number", "float": "a number", "bool": "true or false", "str": "text"}
# keys checked below with a message of their own (what the number means)
_OWN_CHECK = {"history_keep_days", "idle_after", "idle_grace", "suspend_lock_timeout", "suspend_host_share"}
_SIZES = ("reserve", "max_gpu_mem_per_user", "log_cap", "log_reserve", "suspend_host_max", "detach_scrollback",
          "detach_read_rate")
# detached sessions (docs/sessions.md): the scrollback's and the read rate's bounds, in bytes
DETACH_SCROLLBACK = (1 << 10, 64 << 20)
DETACH_READ_RATE = (4 << 10, 1 << 30)


IDLE_SESSIONS = ("off", "notify", "end", "suspend")
SUSPEND_POLICIES = ("off", "suspend")  # idle_jobs, preempt
SLURM_GPU_CHOICE = ("colo", "slurm")  # slurm_gpu_choice


@dataclass
class Config:
    state_dir: Path = field(default_factory=default_state_dir)
    socket: Path = field(default_factory=default_socket)
    socket_mode: int = 0o666  # who may talk to colo at all; identity comes from SO_PEERCRED
    socket_group: str | None = None
    admin_group: str | None = "colo-admin"  # may cancel other users' jobs (root always may)
    reserve: int = 256 * 1024**2  # bytes kept unbudgeted on every GPU
    stop_grace: float = 10.0  # seconds between SIGTERM and SIGKILL on cancel
    saturation: float = 0.85  # predicted combined SM activity under which jobs share via MPS
    bw_saturation: float = 0.85  # the same for memory bandwidth
    min_gain: float = 0.25  # sharing past saturation must beat waiting by this much throughput
    slowdown_bound: float = 1.5  # no job is knowingly placed where it is predicted to run slower than this x alone
    unprofiled_share: bool = False  # jobs with no profile share time-sliced with anyone (else: alone or beside one well-known job)
    # True: a profile no run has shown alone on this node runs alone once, so that its alone time
    # here is learned (its untested alone time otherwise hides real slowdowns). Off by default: in
    # the world fitted to the H200 it serialises the first run of every family and is most of the
    # cold gap (docs/sim.md "Cold placement"); ALONE_DOUBT's margin covers an untested alone time
    check_alone: bool = False
    lend: float = 1.25  # a --grow job may start with up to this x its budget out of memory no queued job fits in (1: never)
    hold_after: float = 1800.0  # seconds a job may be passed by smaller ones before GPUs are held for it (0: never)
    max_user_priority: int = 0  # the highest --priority a user may set; admins and root may set up to 1000
    # Per-user limits (0: none): jobs queued at once (refused at submit past it; an array counts
    # its tasks; 10,000 by default, as Slurm's MaxJobCount, so that one user cannot fill the
    # daemon's memory and disk with queued jobs), jobs running at once, GPU memory budgeted at once
    # (over all GPUs). Fair share: users with the least recent GPU use (GiB of budget x hours,
    # decaying with this half-life in seconds) go first.
    max_queued_per_user: int = 10_000
    max_running_per_user: int = 0
    max_gpu_mem_per_user: int = 0
    # What one user's clients may hold open (root and admin_group members are not held to these):
    # connections to the daemon (past it a new one is told so and closed), and of them streams
    # (`wait`, `logs -f`, sessions), so that a user at the limit of streams can still ask and cancel.
    max_connections_per_user: int = 64
    max_streams_per_user: int = 48
    # Tasks (processes and threads) one job may have at once (its cgroup's pids.max): `--tasks`, this
    # when a job does not say, at most max_job_tasks unless an admin submits (0: no limit). A fork bomb
    # then fails inside its own job, not in the next job of someone else.
    job_tasks: int = 4096
    max_job_tasks: int = 65536
    fair_share_half_life: float = 86400.0
    # The patrol: a job whose processes hold more GPU memory (as NVML sees it) than its budget is
    # reported, and killed once it has been over it for patrol_grace seconds within the last
    # patrol_window seconds (0: twice patrol_grace; a dip under the budget does not restart the
    # count), unless patrol_kill is off. Memory on a GPU that is not the job's, or over its budget
    # where the GPU's other jobs can no longer get theirs, ends it at the next sample.
    patrol_grace: float = 30.0
    patrol_window: float = 0.0
    patrol_kill: bool = True
    # Kill processes of no job (any user's but root's) that hold GPU memory, by the same rules, and
    # log each once with its owner's uid. Off: they are reported, and their memory is given to no
    # job. Unset: on for a gated node (gpu_group set: such a process got past the gate, e.g. with a
    # device descriptor a job handed out), off elsewhere. Graphics sessions are never seen.
    patrol_kill_foreign: bool | None = None
    multi_user_mps: bool = False
    use_mps: bool = True
    set_default_compute_mode: bool = False
    mps_idle_stop: float = 300.0
    sample_interval: float = 1.0
    fakegpu_state: Path | None = None  # use the simulated driver (tests, `colo demo`)
    profile_dirs: list[Path] = field(default_factory=list)
    shared_profiles: Path | None = None  # learned profiles go here (e.g. NFS), so every node decides alike
    allowed_mount_roots: list[str] = field(default_factory=list)  # empty: any path the submitter can read
    log_cap: int = 256 * 1024**2  # bytes of output kept per job; then one marked line, the rest dropped (0: no cap)
    log_reserve: int = 512 * 1024**2  # free bytes on the state disk below which job output is dropped
    # Ended jobs (their rows, decisions, samples and logs) are removed this many days after they
    # ended, as Slurm's PurgeJobAfter; fractions allowed; 0: kept until `colo clean`. 90 days by
    # default: a node's disk is not filled by logs no one reads (a quarter covers a report).
    history_keep_days: float = 90.0
    # Prometheus metrics on this ADDRESS:PORT (e.g. "127.0.0.1:9824"; every address only when
    # written so: "0.0.0.0:9824" or "[::]:9824"). Unset: no endpoint (the figures name users and
    # their jobs' sizes: open it on purpose).
    metrics_listen: str | None = None
    # A gated node (docs/gating.md): the group that owns the GPUs' device files (NVreg_DeviceFileGID
    # or a udev rule, with mode 0660). The root shim adds it to every GPU job's groups, and container
    # jobs get it from the engine; its members can use the GPUs outside colo, so it has none.
    # Unset: colo grants no group (the files are then open to all, or only to their group's members).
    gpu_group: str | None = None
    # The gate on a gated node (docs/gating.md): a device program attached to these cgroup2 folders
    # (paths below the cgroup2 mount) refuses the GPUs' character devices to every process beneath
    # them but root's and those of colo's jobs (and of gpu_gate_allow: the container engine's own
    # cgroup parent). Unset: ["/"], the whole node; []: no gate (the group alone gates).
    gpu_gate_at: list[str] | None = None
    gpu_gate_allow: list[str] = field(default_factory=lambda: ["/docker"])
    # Idle holders: a running job that holds GPU memory with no GPU activity (SM 0 in every sample)
    # for this many seconds is marked idle in ls, top and report (0: never).
    idle_after: float = 1800.0
    # What colo does to an idle interactive session (a job whose spec says `interactive`): "off"
    # (marked only), "notify" (a line on its terminal), "end" (notified, then ended when it is still
    # idle idle_grace seconds later). Batch jobs are only marked.
    idle_sessions: str = "notify"
    idle_grace: float = 900.0
    # `colo suspend` (docs/suspend.md): a suspended job's GPU memory is held in host memory. A
    # suspend is refused when its bytes are more than this share of MemAvailable at that moment,
    # or would take the bytes all suspended jobs hold past suspend_host_max (0: no such cap).
    suspend_host_share: float = 0.5
    suspend_host_max: int = 0
    # How long a suspend waits for the job's running GPU work (the driver's lock timeout), seconds.
    suspend_lock_timeout: float = 10.0
    # idle_jobs = "suspend": a batch job marked idle is suspended when a queued job waits for its
    # memory (idle_sessions = "suspend" does so for sessions, after telling them), the longest
    # idle first. preempt = "suspend": a job that cannot fit may suspend time-sliced jobs of a lower
    # priority. Never a job submitted with --no-suspend, never an MPS client. Both off by default.
    idle_jobs: str = "off"
    preempt: str = "off"
    # Under Slurm (docs/slurm.md): who picks the physical GPU of a shard job on this node. "colo":
    # the least loaded GPU by colo's own budgets, never one a gres/gpu job holds (and gres/gpu jobs
    # a GPU none of colo's jobs is on), unless Slurm's cgroup.conf has ConstrainDevices=yes (a job
    # may open only the device Slurm bound: then Slurm's choice). "slurm": always Slurm's choice.
    slurm_gpu_choice: str = "colo"
    # Detached sessions (`colo shell --detach`, docs/sessions.md): the bytes of each one's last
    # output kept for the next `colo attach` (1KiB to 64MiB), the bytes a second read of one (4KiB to
    # 1GiB: a job that writes faster waits on its terminal), and how many one user may have, queued
    # or running (each holds descriptors, and a host session a holder process; 0: no limit).
    detach_scrollback: int = 128 << 10
    detach_read_rate: int = 4 << 20
    max_detached_per_user: int = 16

    @property
    def kill_foreign(self) -> bool:
        """patrol_kill_foreign as it applies: unset, on exactly when the node is gated."""
        return self.gpu_group is not None if self.patrol_kill_foreign is None else self.patrol_kill_foreign

    @property
    def db_path(self) -> Path:
        return self.state_dir / "colo.db"

    @property
    def jobs_dir(self) -> Path:
        return self.state_dir / "jobs"

    @property
    def lock_path(self) -> Path:
        return self.state_dir / "colo.lock"

    def run_dir(self, job_id: int) -> Path:
        """A job's root-owned folder (ledger, exit file): jobs/ID."""
        return self.jobs_dir / str(job_id)

    def log_path(self, job_id: int) -> Path:
        """A job's output, in the root-only logs/ folder."""
        return self.state_dir / "logs" / f"{job_id}.log"

    @staticmethod
    def read(path: Path) -> dict:
        """The TOML file's values, unchecked."""
        try:  # imported here: `colo submit` reads colo's default paths from this module, never TOML
            import tomllib
        except ModuleNotFoundError:  # Python 3.10
            import tomli as tomllib  # type: ignore[no-redef]
        try:
            return tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"cannot read config {path}: {e}", keys=()) from e

    @classmethod
    def load(cls, path: Path | None = None, **overrides) -> "Config":
        values: dict = {}
        path = path or (Path(os.environ["COLO_CONFIG"]) if os.environ.get("COLO_CONFIG") else None)
        if path is not None:
            values = cls.read(path)
        if os.environ.get("COLO_FAKEGPU_STATE") and "fakegpu_state" not in values:
            values["fakegpu_state"] = os.environ["COLO_FAKEGPU_STATE"]
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**cls.checked(values))

    @classmethod
    def checked(cls, values: dict) -> dict:
        """The daemon's one validator: `values` as Config takes them, or the first ConfigError."""
        values = dict(values)
        known = {f.name: f.type for f in fields(cls)}
        unknown = set(values) - set(known)
        if unknown:
            raise ConfigError(f"unknown config keys: {', '.join(sorted(unknown))}", keys=tuple(sorted(unknown)))
        for k, v in values.items():
            name = str(known[k]).removesuffix(" | None")
            kind = _TYPES.get(name)
            if k in _SIZES or k in _OWN_CHECK or kind is None or (v is None and name != str(known[k])):
                continue
            if not isinstance(v, kind) or (bool not in kind and isinstance(v, bool)):
                raise ConfigError(f"{k}: {v!r} is not {_TYPE_WORDS[name]}")
        for k in _SIZES:
            if k in values:
                r = values[k]
                try:
                    values[k] = 0 if r in (0, "0") else parse_size(r)
                except ValueError as e:
                    raise ConfigError(f"{k}: {e}") from None
        if "history_keep_days" in values:
            v = values["history_keep_days"]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1e6:  # NaN fails too
                raise ConfigError(f"history_keep_days: {v!r} is not a number of days from 0 (0: keep every "
                                  "ended job until `colo clean`)")
            values["history_keep_days"] = float(v)
        if values.get("metrics_listen") is not None:
            host, sep, port = str(values["metrics_listen"]).rpartition(":")
            if not sep or not port.isdigit() or not 0 < int(port) < 65536 or not host.strip("[]"):
                raise ConfigError(f"metrics_listen: {values['metrics_listen']!r} is not ADDRESS:PORT "
                                  "(e.g. 127.0.0.1:9824; every address only when written: 0.0.0.0:9824)")
        grace, window = values.get("patrol_grace", cls.patrol_grace), values.get("patrol_window", cls.patrol_window)
        if window and window < grace:
            raise ConfigError(f"patrol_window ({window:g} s) is shorter than patrol_grace ({grace:g} s): no job "
                              "could ever be over its budget that long within it")
        v = values.get("suspend_host_share")
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1):
            raise ConfigError(f"suspend_host_share: {v!r} is not a share from 0 to 1 (0: no suspends)")
        for k in ("idle_after", "idle_grace", "suspend_lock_timeout"):
            v = values.get(k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1e9):
                raise ConfigError(f"{k}: {v!r} is not a number of seconds from 0")
        for k in ("idle_jobs", "preempt"):
            if values.get(k, "off") not in SUSPEND_POLICIES:
                raise ConfigError(f"{k}: {values[k]!r} is not one of {', '.join(SUSPEND_POLICIES)}")
        if values.get("slurm_gpu_choice", "colo") not in SLURM_GPU_CHOICE:
            raise ConfigError(f"slurm_gpu_choice: {values['slurm_gpu_choice']!r} is not one of {', '.join(SLURM_GPU_CHOICE)}")
        if values.get("idle_sessions", "notify") not in IDLE_SESSIONS:
            raise ConfigError(f"idle_sessions: {values['idle_sessions']!r} is not one of {', '.join(IDLE_SESSIONS)}")
        for k, (low, high), what in (("detach_scrollback", DETACH_SCROLLBACK, "a size"),
                                     ("detach_read_rate", DETACH_READ_RATE, "bytes a second")):
            if k in values and not low <= values[k] <= high:
                raise ConfigError(f"{k}: {format_size_exact(values[k])} is not {what} from {format_size_exact(low)} "
                                  f"to {format_size_exact(high)}")
        for k in ("max_connections_per_user", "max_streams_per_user", "job_tasks", "max_job_tasks",
                  "max_detached_per_user"):
            v = values.get(k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 31):
                raise ConfigError(f"{k}: {v!r} is not a whole number from 0 (0: no limit)")
        gg = values.get("gpu_group")
        if gg is not None and (not isinstance(gg, str) or not gg or gg.strip() != gg):
            raise ConfigError(f"gpu_group: {gg!r} is not a group name")
        for k in ("gpu_gate_at", "gpu_gate_allow"):
            v = values.get(k)
            if v is not None and (not isinstance(v, list) or not all(
                    isinstance(p, str) and p.startswith("/") and ".." not in p.split("/") for p in v)):
                raise ConfigError(f"{k}: {v!r} is not a list of cgroup2 folders below its mount (e.g. [\"/\"])")
        for k in ("state_dir", "socket", "fakegpu_state", "shared_profiles"):
            if values.get(k) is not None:
                values[k] = Path(values[k])
        if "profile_dirs" in values:
            values["profile_dirs"] = [Path(p) for p in values["profile_dirs"]]
        return values


def check(path: Path) -> list[str]:
    """`colo config check`: every error the daemon would stop at in this file, one line each, with
    the line of the key at fault where the file's text shows it. The validator stops at the first
    error: the keys at fault are left out and it is asked again, until it passes."""
    try:
        values = Config.read(path)
        text = Path(path).read_text()
    except ConfigError as e:
        return [str(e)]
    errors: list[tuple[int, str]] = []
    while True:
        try:
            Config.checked(values)
            return [e for _, e in sorted(errors, key=lambda x: x[0])]  # in the file's order
        except ConfigError as e:
            at = [_line_of(text, k) for k in e.keys if k in values]
            lines = ",".join(str(n) for n in at if n)
            errors.append((min((n for n in at if n), default=0),
                           f"{path}:{lines}: {e}" if lines else f"{path}: {e}"))
            left = {k: v for k, v in values.items() if k not in e.keys}
            if len(left) == len(values):  # nothing to leave out: it would say the same again
                return [e for _, e in sorted(errors, key=lambda x: x[0])]
            values = left


def _line_of(text: str, key: str) -> int | None:
    """The line (from 1) where a top-level `key = ...` is set."""
    pat = re.compile(rf"""^\s*(?:{re.escape(key)}|"{re.escape(key)}"|'{re.escape(key)}')\s*=""")
    return next((i for i, line in enumerate(text.splitlines(), 1) if pat.match(line)), None)
