"""What keeps the scheduler's passes short with a long queue (the scheduler's): how often a full
pass and a complete one run, a complete pass in slices with the loop free between them (Rest:
what it has left), candidates made without the frozen dataclass's cost (cand) and how many are
kept, and what survives a pass settled out of the cyclic collector's way (settle). The scheduler
reads the figures under its own names (a test sets colo.daemon.scheduler.SLICE_S, not these)."""
from __future__ import annotations

import gc
import math

from ..sched import policy


# A full pass (every queued job) runs only when something changed that could let a job that
# waited start: a job ended, a GPU's view changed, the engine came back, a hold fell due. A
# submit plans only the new jobs: the ones already waiting met the same GPUs last time, and
# GPUs only fill up between full passes. Full passes are spaced by a multiple of their own cost,
# so a stream of job ends cannot keep the daemon busy with them.
FULL_PASS_SPACING = 3.0  # x the last full pass's time
FULL_PASS_SPACING_MAX = 1.0  # seconds
# A full pass walks the queue in fair-share order and stops once no GPU could take the smallest
# job left; those not looked at keep their last decision. Every so often a pass looks at all of
# them (their reasons' figures are refreshed; a safety net, should anything change unannounced),
# if anything changed since the last one: an idle daemon with a long queue does not walk it again.
COMPLETE_PASS_EVERY = 60.0  # seconds
# The loop runs such a complete pass in slices of about this long, free for requests in between:
# at 50,000 queued the whole of it takes over a second, which no request should wait behind.
# Between two slices the loop is left alone SLICE_GAP: a request takes several turns of the loop
# (accepted, its line read, answered), and with only a turn between slices (sleep(0)) a `hello`
# waited behind 4 or 5 of them (~85 ms at 50,000 queued on a loaded 2-core machine).
SLICE_S = 0.005
SLICE_GAP = 0.005
CANDS_KEPT = 10_000  # candidates kept from pass to pass (Scheduler._take)
SETTLE_AFTER = 5_000  # jobs queued since the heap was settled: settled again after a pass (settle)


def settle() -> None:
    """What survived a complete pass (the queued jobs, their decisions, listings' caches) is long-lived:
    moved out of the cyclic collector's scans. At 50,000 queued a full collection walked a million
    objects (0.3 to 1 s with every request waiting); frozen, they are still freed by reference counting
    when dropped. Every generation is collected first, the oldest too: a cycle frozen is never
    collected (a closed connection's transport, protocol and streams, with what they buffered, were
    kept for good once a collection had moved them to the oldest generation before a freeze). That
    collection is short: what it walks is only what was made since the last freeze."""
    gc.collect()
    gc.freeze()


class Rest:
    """What a complete pass has left to look at once its first part (the usual full pass) is done:
    the rest of the fair walk, in slices (Scheduler.finish_complete)."""

    __slots__ = ("walk", "seen", "loads", "holder", "due", "planned", "busy", "longest", "slices", "plan_ms",
                 "started")

    def __init__(self, walk, seen: set, loads: dict, holder, planned: int, busy: float, plan_ms: float,
                 started: int):
        self.walk, self.seen, self.loads = walk, seen, loads
        self.holder = holder  # the candidate GPUs are held for (hold_after): each slice plans it first
        self.due = math.inf  # the next time a job looked at passes hold_after
        self.planned, self.busy, self.longest, self.slices = planned, busy, busy, 1
        self.plan_ms, self.started = plan_ms, started


def cand(job_id: int, budget: int, gpus: int, uid: int, priority: int, seq: int, profile, queued_at: float,
          held: tuple, gpu_ids: tuple = (), gpu_type: str | None = None, grow: bool = False) -> policy.Candidate:
    """Candidate without the frozen dataclass's per-field __setattr__ (10,000 a full pass)."""
    c = object.__new__(policy.Candidate)
    object.__setattr__(c, "__dict__", {"job_id": job_id, "budget": budget, "gpus": gpus, "uid": uid,
                                       "priority": priority, "seq": seq, "profile": profile,
                                       "queued_at": queued_at, "held": held, "gpu_ids": gpu_ids,
                                       "gpu_type": gpu_type, "grow": grow})
    return c
