"""What the placement pass reads and returns: the GPUs as it sees them (GpuView), the jobs that
hold budget (Placed) and those that wait (Candidate), its answer for each (Decision), and its
knobs (PolicyConfig, from the daemon's configuration by config_of). Pure data, no logic."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

START = "start"
WAIT = "wait"
GiB = 1024**3


@dataclass(frozen=True)
class GpuView:
    uuid: str
    index: int
    usable: int  # bytes: capacity minus the configured reserve
    compute_mode: str = "default"  # default | exclusive_process | prohibited
    mps: str = "off"  # off | active | fault
    name: str = ""
    error: str | None = None  # the driver stopped answering for it: nothing new is placed there
    drained: str | None = None  # `colo drain`: "drained by root: driver update"; nothing new is placed there

    @property
    def in_service(self) -> bool:
        """May new jobs be placed here (it answers and no admin drained it)?"""
        return self.error is None and self.drained is None


@dataclass(frozen=True)
class Placed:
    """A job that holds budget on GPUs now."""
    job_id: int
    gpus: tuple[str, ...]
    budget: int  # bytes per GPU
    uid: int = 0
    mode: str = "timesliced"
    profile: Any = None
    elapsed: float = 0.0  # seconds since it started
    # how far into its profile it is (alone-seconds of work: policy.progress of its decision's
    # expectation); None: taken to have run at its alone speed since it started (`elapsed`)
    done: float | None = None
    # it runs alone this once so that its alone time here is learned (its start's
    # details["check_alone"]): nothing starts beside it
    alone: bool = False
    family: str = ""  # what its runs are learned under (a name): see Candidate.family


@dataclass(frozen=True)
class Candidate:
    job_id: int
    budget: int  # bytes per GPU
    gpus: int = 1
    uid: int = 0
    priority: int = 0
    seq: int = 0  # submission order
    profile: Any = None
    queued_at: float = 0.0  # when it was submitted (the clock `plan(now=...)` reads)
    held: tuple[int, ...] = ()  # GPU indices held for it by the last pass (details["held"]): kept
    grow: bool = False  # submitted with --grow: its budget may be larger than asked (see `lend`)
    gpu_ids: tuple[int, ...] = ()  # --gpu-id: only these GPU indices (empty: any)
    gpu_type: str | None = None  # --gpu-type: only GPUs whose name holds this
    # the name its runs are learned under (a provisional profile made from one job of it serves its
    # owner's others); "": none known
    family: str = ""


@dataclass(frozen=True)
class Decision:
    job_id: int
    action: str  # START | WAIT
    gpus: tuple[str, ...] = ()
    mode: str | None = None  # "mps" | "timesliced" | "none"
    reason: str = ""
    details: dict = field(default_factory=dict)  # the numbers behind the reason
    thread_pct: int | None = None


@dataclass(frozen=True)
class PolicyConfig:
    reserve: int = 0  # bytes kept free on every GPU
    saturation: float = 0.85  # predicted combined SM activity below which MPS is chosen
    multi_user_mps: bool = False
    use_mps: bool = True
    bw_saturation: float = 0.85  # same, for combined memory bandwidth
    min_gain: float = 0.25  # sharing past saturation must beat waiting by this much throughput (alone-speed jobs)
    step: float = 2.0  # seconds per point when profiles are compared
    horizon: float = 3600.0  # seconds of overlap looked at
    max_mps_clients: int = 48  # per device (Volta and newer)
    thread_headroom: float = 1.25  # MPS active threads = peak SM of the job x this, in 5 % steps
    unknown_sm: float = 1.0  # a running job with no profile is assumed to use this much...
    unknown_membw: float = 0.5  # ...and this much bandwidth
    # Harm bounds (issue 13). Predicted co-run rates are divided by 1 + margin before the checks:
    # the margin is the model's observed prediction error (learned; this default until then).
    slowdown_bound: float = 1.5  # no job is knowingly placed where it is predicted to run slower than this
    margin: float = 0.10
    # the margin for a share whose pairings runs have all shown (learned from the errors of such
    # predictions only; None: `margin`)
    seen_margin: float | None = None
    well_known_runs: int = 3  # a profile learned from this many runs may take an unprofiled neighbour
    unprofiled_share: bool = False  # True: jobs with no profile share time-sliced like the rest (memory decides)
    # Backfill lets small jobs pass one that waits; to keep a stream of them from starving it for
    # ever, the first job in queue order that has waited this long gets GPUs held for it: nothing
    # new starts there until it does. Seconds; 0 turns it off.
    hold_after: float = 1800.0
    # A --grow job starts with up to this much times its budget when the memory it takes could
    # fit no queued job anyway (lent, not reserved from anyone): a profile a little off then
    # costs no refused allocation and no re-run. 1.0 turns it off.
    lend: float = 1.25
    # A profile no run has shown alone here runs alone once (details["check_alone"]) when it would
    # start on an empty GPU anyway. Only for a caller that then passes Placed.alone for that job
    # (colo sim does; the daemon not yet), else the job it meant to keep alone is joined.
    check_alone: bool = False


def config_of(c: Any) -> PolicyConfig:
    """The policy's knobs from the daemon's configuration (colo/config.py Config, or anything with
    its fields): what the daemon places with, and `colo sim`'s colo by default."""
    return PolicyConfig(reserve=c.reserve, saturation=c.saturation, bw_saturation=c.bw_saturation,
                        min_gain=c.min_gain, hold_after=c.hold_after, slowdown_bound=c.slowdown_bound,
                        unprofiled_share=c.unprofiled_share, multi_user_mps=c.multi_user_mps,
                        use_mps=c.use_mps, lend=c.lend, check_alone=getattr(c, "check_alone", False))
