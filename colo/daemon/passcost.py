"""What keeps the scheduler's passes short with a long queue (the scheduler's): how often a full
pass and a complete one run, a complete pass in slices with the loop free between them (Rest:
what it has left), candidates made without the frozen dataclass's cost (cand) and how many are
kept, what survives a pass settled out of the cyclic collector's way (settle), and the collector held
off while sliced work (a pass's rest, a listing's reply) runs (held). The scheduler
reads the figures under its own names (a test sets colo.daemon.scheduler.SLICE_S, not these)."""
from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import time
from collections.abc import Iterator

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
# Objects left young by sliced work (gc.get_count()[0] when the last ends) past which it is settled
# at once: rows a listing of thousands made and keeps, walked by one collection and frozen.
SETTLE_YOUNG = 20_000
HELD_MAX = 10.0  # seconds of works that overlap without end (listings in a loop) before one is settled


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


_held = 0  # sliced works under way (held)
_held_since = 0.0  # when the collector was turned off


@contextlib.contextmanager
def held() -> Iterator[None]:
    """The cyclic collector off while sliced work is under way (a complete pass's rest, a listing's
    reply), on again when the last such work ends (one may start while another runs: a listing during
    a pass). What that work holds for its length, a snapshot of 50,000 open jobs and their decisions
    and the rows it makes, was walked by every collection meanwhile (queue_bench's ls load at 50,000:
    generation-1 runs of 6-14 ms of the loop's CPU with the snapshot young, a generation-2 run of
    19 ms). Nothing is lost meanwhile: reference counting frees what is not in a cycle, the next
    collection the rest. Had the work left many objects (the rows it keeps), they are settled in the
    loop's next turn with the collector still off, one collection, before any allocation could set
    off a generation-0 run over them, then a generation-1 one, then a full one. Works that overlap without end are settled every HELD_MAX."""
    global _held, _held_since
    _held += 1
    if _held == 1:
        gc.disable()
        _held_since = time.monotonic()
    elif time.monotonic() - _held_since > HELD_MAX:  # (users' `ls` in loops, one always under way)
        settle()
        _held_since = time.monotonic()
    try:
        yield
    finally:
        if _held == 1 and gc.get_count()[0] > SETTLE_YOUNG:
            try:  # settled in a turn of its own: not on top of the work's last slice
                asyncio.get_running_loop().call_soon(_release, True)
            except RuntimeError:  # (no loop: at once)
                _release(True)
        else:
            _release(False)


def _release(settling: bool) -> None:
    global _held
    if settling:
        settle()
    _held -= 1
    if _held == 0:
        gc.enable()


class Rest:
    """What a complete pass has left to look at once its first part (the usual full pass) is done:
    the rest of the fair walk, in slices (Scheduler.finish_complete)."""

    __slots__ = ("walk", "seen", "loads", "holder", "due", "planned", "busy", "longest", "slices", "plan_ms",
                 "started", "settle")

    def __init__(self, walk, seen: set, loads: dict, holder, planned: int, busy: float, plan_ms: float,
                 started: int):
        self.walk, self.seen, self.loads = walk, seen, loads
        self.holder = holder  # the candidate GPUs are held for (hold_after): each slice plans it first
        self.due = math.inf  # the next time a job looked at passes hold_after
        self.planned, self.busy, self.longest, self.slices = planned, busy, busy, 1
        self.plan_ms, self.started = plan_ms, started
        self.settle = 0.0  # the collection at its end (passcost.settle), counted in `longest` too


def cand(job_id: int, budget: int, gpus: int, uid: int, priority: int, seq: int, profile, queued_at: float,
          held: tuple, gpu_ids: tuple = (), gpu_type: str | None = None, grow: bool = False,
          family: str = "") -> policy.Candidate:
    """Candidate without the frozen dataclass's per-field __setattr__ (10,000 a full pass)."""
    c = object.__new__(policy.Candidate)
    object.__setattr__(c, "__dict__", {"job_id": job_id, "budget": budget, "gpus": gpus, "uid": uid,
                                       "priority": priority, "seq": seq, "profile": profile,
                                       "queued_at": queued_at, "held": held, "gpu_ids": gpu_ids,
                                       "gpu_type": gpu_type, "grow": grow, "family": family})
    return c
