"""The scheduler: the queue, its passes (dependencies, limits, fair share, plan(), starts), and
the decisions with their reasons.

Owns: the queue's index (per user, in order; budgets waiting; jobs every pass looks at), the
latest decision per open job (`decisions`, what `colo explain` says) and their writer, the jobs
GPUs are held for, the fair-share ledger and per-user limits, and the wake-up of the loop.
Calls: policy.plan() (pure), the job table (a dependency that can never be met fails its job),
`start` (the launcher takes a START decision from there), `start_wait` (the launcher's own
reasons a job may not start yet: an earlier attempt still ending, a start the engine refused),
the learner (profiles, what was learned) and the GPUs' and engines' state.
"""
from __future__ import annotations

import asyncio
import bisect
import dataclasses
import gc
import logging
import math
import time
from collections import Counter
from typing import Callable

from ..config import Config
from ..jobs import ACTIVE, TERMINAL, Job, State
from ..sched import fairshare, policy
from . import deps, grow
from .decisions import DecisionWriter, KeptWait
from .engines import Engines
from .gpus import Gpus
from .jobtable import JobTable
from .learner import Learner
from .passcost import (CANDS_KEPT, COMPLETE_PASS_EVERY, FULL_PASS_SPACING, FULL_PASS_SPACING_MAX, SETTLE_AFTER,
                       SLICE_GAP, SLICE_S, Rest, cand, held, settle)
from .validate import stopped_text
from .suspend import held_span, releases_budget

log = logging.getLogger("colo")


class Scheduler:
    def __init__(self, config: Config, cfg: policy.PolicyConfig, table: JobTable, gpus: Gpus, engines: Engines,
                 learner: Learner, start: Callable[[policy.Decision], None],
                 start_wait: Callable[[int], str | None]):
        self.config = config
        self.cfg = cfg
        self.table = table
        self.gpus = gpus
        self.engines = engines
        self.learner = learner
        self.start = start
        self.start_wait = start_wait
        self.wake_event = asyncio.Event()
        self.decisions: dict[int, policy.Decision] = {}  # the latest decision per open job
        self.version = 0  # counts changes to `decisions` (listings keep what they made while it stands)
        self._cands: dict[int, policy.Candidate] = {}
        self._full = True  # a full pass is owed
        self._fresh: dict[int, None] = {}  # queued jobs no pass has seen yet, in order
        self._holders: set[int] = set()  # jobs GPUs are held for (policy's hold_after)
        self._sig = None  # the inputs the last full pass saw
        self._hold_due = math.inf  # when the next waiting job passes hold_after
        self._last_complete = -math.inf  # time.monotonic() of the last pass over every queued job
        self._since_complete = True  # anything changed since that pass began (a job, an edit, a GPU, a wake)
        self._rest: Rest | None = None  # a complete pass whose slices are still to run (serve)
        self._details: dict[tuple, dict] = {}  # WAIT decisions' figures, one dict per distinct set (record)
        self._reasons: dict[str, str] = {}  # WAIT decisions' reasons, one copy of each text (record)
        self._next_full = -math.inf  # no full pass before this (spacing)
        self._queued_n: Counter = Counter()  # uid -> jobs queued
        # Queued jobs by user, each list in the user's own order (priority, then id); entries of
        # jobs that left the queue are skipped when walked and dropped when a list is rebuilt.
        self._uq: dict[int, list[tuple[int, int]]] = {}
        self._uq_stale: Counter = Counter()
        self._budgets: Counter = Counter()  # budget -> queued GPU jobs with it (the smallest ends a walk)
        self._always: set[int] = set()  # queued jobs every full pass looks at: CPU-only, with --after
        self._begins: dict[int, float] = {}  # queued jobs not to start before a time (--begin): when
        self._unsettled = 0  # jobs queued since the heap was last settled (passcost.settle)
        self.fair_ledger = fairshare.Ledger(config.fair_share_half_life)
        self.set_limits(config.max_queued_per_user, config.max_running_per_user, config.max_gpu_mem_per_user)
        self.last_pass: dict = {}
        self._views: list[policy.GpuView] = []  # the GPUs as the pass that runs sees them
        self._grow_planned = False
        self._array_load: Counter | None = None
        self._array_running: Counter = Counter()
        self._writer = DecisionWriter(config.db_path)
        for j in sorted(table.open.values(), key=lambda j: j.id):
            if j.state == State.QUEUED:
                self._enter_queue(j)
        since = time.time() - 20 * config.fair_share_half_life  # older use counts < 1e-6
        for uid, budget, gpus_n, start_at, end, off in table.store.gpu_use(since):
            self.fair_ledger.add(uid, fairshare.weight(budget, gpus_n), *fairshare.held_span(start_at, end, off))
        gc.collect()  # the open jobs, loaded: long-lived (see passcost.settle); before any request is served
        gc.freeze()

    def close(self) -> None:
        self._writer.close()

    def set_limits(self, queued: int, running: int, gpu_mem: int) -> None:
        """The per-user limits (at start, and when a config reload changes them)."""
        self.limits = fairshare.Limits(queued, running, gpu_mem)

    def wake(self, full: bool = True) -> None:
        """Run the scheduler soon; full=False: only new jobs need planning."""
        if full:
            self._full = True
            self._since_complete = True
        self.wake_event.set()

    async def serve(self, stopping: Callable[[], bool]) -> None:
        """The loop: a pass, then wait until woken or a pass is due. A complete pass runs its first
        part at once (what may start) and the rest in slices, the loop free in between."""
        while not stopping():
            self.schedule_pass(sliced=True)
            if self._rest is not None:
                await self.finish_complete(stopping)
            try:
                due = self.pass_due_in()
                await asyncio.wait_for(self.wake_event.wait(), timeout=None if due == math.inf else due)
            except asyncio.TimeoutError:
                pass
            self.wake_event.clear()
            await asyncio.sleep(0.005)  # a burst of submits lands in one pass

    # what changed -----------------------------------------------------------------------------
    def queue_changed(self, prev: Job | None, job: Job) -> None:
        """Called for every new job and state change (JobTable.add, JobTable.transition)."""
        was_q = prev is not None and prev.state == State.QUEUED
        is_q = job.state == State.QUEUED
        self._since_complete = True
        if was_q and not is_q:
            self._leave_queue(prev)
        elif is_q and not was_q:
            self._enter_queue(job)
        self._cands.pop(job.id, None)
        if job.state in TERMINAL:
            self.decisions.pop(job.id, None)
        if is_q:
            self._fresh[job.id] = None
        else:
            self._fresh.pop(job.id, None)
            self._holders.discard(job.id)
        if prev is not None and prev.state in ACTIVE and job.state not in ACTIVE:
            if prev.started_at and prev.gpus:  # its use counts for fair share, its suspended time not
                self.fair_ledger.add(prev.uid, fairshare.weight(prev.spec.gpu_mem, len(prev.gpus)),
                                     *held_span(prev, job.ended_at or time.time()))
            self._full = True  # its GPUs (and its user's limits) are free again
        elif job.state in TERMINAL:
            self._full = True  # jobs after it may now fail their dependency
        if prev is None:
            self.wake(full=False)  # a new job: only new jobs need planning

    def _enter_queue(self, job: Job) -> None:
        self._queued_n[job.uid] += 1
        self._unsettled += 1
        if job.spec.begin and job.spec.begin > time.time():
            self._begins[job.id] = job.spec.begin
        if not job.spec.gpus or job.spec.deps:
            self._always.add(job.id)
        if job.spec.gpus:
            self._budgets[job.spec.gpu_mem] += 1
        lst = self._uq.setdefault(job.uid, [])
        key = (-job.spec.priority, job.id)
        if not lst or key > lst[-1]:
            lst.append(key)
        else:
            bisect.insort(lst, key)

    def _leave_queue(self, job: Job) -> None:
        self._queued_n[job.uid] -= 1
        self._begins.pop(job.id, None)
        self._always.discard(job.id)
        if job.spec.gpus:
            self._budgets[job.spec.gpu_mem] -= 1
            if self._budgets[job.spec.gpu_mem] <= 0:
                del self._budgets[job.spec.gpu_mem]
        self._uq_stale[job.uid] += 1
        lst = self._uq.get(job.uid, [])
        if self._uq_stale[job.uid] > 64 + len(lst) // 2:
            open_jobs = self.table.open
            self._uq[job.uid] = [k for k in dict.fromkeys(lst) if (j := open_jobs.get(k[1])) is not None
                                 and j.state == State.QUEUED and j.id != job.id]
            self._uq_stale[job.uid] = 0

    def queue_edited(self, prev: Job, job: Job) -> None:
        """A queued job's budget, priority or hold changed: filed again under its new key."""
        self._leave_queue(prev)
        if lst := self._uq.get(prev.uid):
            self._uq[prev.uid] = [k for k in lst if k[1] != prev.id]
        self._enter_queue(job)
        self._cands.pop(job.id, None)
        self._holders.discard(job.id)
        self.wake()  # (and so a complete pass is owed again)

    def profiles_forgotten(self) -> None:
        """The learner's on_forget: every candidate is made again, with the profiles as they are now."""
        self._cands.clear()
        self._since_complete = True

    def _user_queue(self, uid: int):
        """A user's queued jobs in their own order (skipping entries of jobs that left)."""
        open_jobs = self.table.open
        for _, job_id in self._uq.get(uid, ()):
            j = open_jobs.get(job_id)
            if j is not None and j.state == State.QUEUED:
                yield j

    def queued_count(self, uid: int) -> int:
        return self._queued_n[uid]

    def queued_total(self) -> int:
        return sum(self._queued_n.values())

    def pass_due_in(self) -> float:
        """Seconds until the loop must look again without being woken (math.inf: not until then)."""
        mono = time.monotonic()
        due = self._last_complete + COMPLETE_PASS_EVERY - mono if self._since_complete else math.inf
        if self._full:
            due = min(due, self._next_full - mono)
        if self._hold_due < math.inf:
            due = min(due, self._hold_due - time.time())
        if self._begins:  # a --begin falls due: a full pass may start it
            due = min(due, min(self._begins.values()) - time.time())
        return max(0.0, due)

    # the pass ---------------------------------------------------------------------------------
    def schedule_pass(self, complete: bool = False, sliced: bool = False) -> list[policy.Decision]:
        """Check dependencies and limits, order by fair share, plan, start. Exits are reaped by
        the monitors, not here. complete: look at every queued job (else a full pass stops once
        no GPU could take the smallest job left). sliced: a complete pass stops there all the same
        and leaves the rest to finish_complete (nothing of the rest can start: no GPU takes it)."""
        now, mono = time.time(), time.monotonic()
        if self._begins and min(self._begins.values()) <= now:
            self._begins = {i: t for i, t in self._begins.items() if t > now}
            self._full = True
        views = self.gpus.views(in_use=True)
        sig = (tuple(views), self.gpus.error, self.engines.docker_away() is None)
        if self._rest is None and (now >= self._hold_due or (
                self._since_complete and mono - self._last_complete >= COMPLETE_PASS_EVERY)):
            complete = True
        if sig != self._sig:
            self._since_complete = True
        if sig != self._sig or complete:
            self._full = True
        if self._full:
            if mono < self._next_full and not complete:
                return []  # spaced: the loop comes back (a fresh job must not take what a waiting one is owed)
            fresh = list(self._fresh)
            self._fresh.clear()
            self._full = False
            self._sig = sig
            full = True
            if complete:  # what changes from here on owes the next one
                self._since_complete = False
        elif self._fresh:
            ids = [*self._holders, *self._fresh]
            fresh = []
            self._fresh.clear()
            full = False
        else:
            return []
        active = self.table.active(*ACTIVE)
        usage = self.fair_usage(now, active)
        loads: dict[int, fairshare.UserLoad] = {}
        for j in active:
            ld = loads.setdefault(j.uid, fairshare.UserLoad())
            ld.running += 1
            ld.gpu_mem += j.spec.gpu_mem * len(j.gpus)
        placed = self.placed(now, active)
        self._views = views  # what a --grow job's learned budget is capped by (grow.budget_of)
        self._grow_planned = False  # whether a --grow job is among this pass's candidates (_take)
        seen: set[int] = set()
        self._array_load: Counter | None = None  # array id -> tasks running or taken this pass (when asked)
        waits: list[policy.Decision] = []
        cands: list[policy.Candidate] = []
        # first, in every pass: held-for jobs, CPU-only jobs and jobs with --after (few)
        first = [*self._holders, *self._always] if full else ids
        self._take(first, seen, cands, waits, loads)
        n_first = len(cands)
        walk = iter(())
        if full:
            cap = self.limits.running
            # a user at the running limit has nothing that could start: not walked but in a complete pass
            users = [u for u, lst in self._uq.items() if lst and (
                complete or not cap or (loads.get(u) or fairshare.UserLoad()).running < cap)]
            walk = fairshare.fair_walk({u: self._user_queue(u) for u in users}, usage)
        want = math.inf if complete and not sliced else 256
        while True:
            for j in walk:
                self._take((j.id,), seen, cands, waits, loads, job=j)
                if len(cands) - n_first >= want:
                    break
            else:
                walk = None  # every queued job was looked at
            decisions = policy.plan(cands, views, placed, self.cfg, now=now,
                                    learned=self.learner.learned)  # per uid: invariant 13
            if walk is None or self._none_fits(views, placed, decisions):
                break
            want *= 4  # more could start: look further (plan is pure; the longer prefix is planned afresh)
        left = len(cands)
        self._take(fresh, seen, cands, waits, loads)  # new jobs the walk did not reach: nothing fits them,
        if len(cands) > left:  # but they get a decision with its reason
            decisions = policy.plan(cands, views, placed, self.cfg, now=now,
                                    learned=self.learner.learned)  # per uid: invariant 13
        grown = grow.grown(decisions, self.table.open, self._cands) if self._grow_planned else []  # else nothing to look at (10,000 decisions)
        if grown:
            grow.lent_fairly(decisions, grown, views, placed, self.table.open, self._budgets)
        decisions = self._within_limits(decisions, loads)
        decisions = self._provisional_noted(decisions)
        if grown:
            grow.said(decisions, grown)
        self.record(waits)
        self.record(decisions)
        planned_in = time.monotonic() - mono
        for d in decisions:
            if d.action == policy.START:
                self.start(d)
            elif "held" in d.details:
                self._holders.add(d.job_id)
            else:
                self._holders.discard(d.job_id)
        took = time.monotonic() - mono  # the starts too: the loop does nothing else meanwhile
        ha = self.cfg.hold_after
        if ha > 0:
            due = min((c.queued_at + ha for c in cands if c.gpus and c.queued_at + ha > now), default=math.inf)
            keep = self._hold_due if self._hold_due > now and not (full and walk is None) else math.inf
            self._hold_due = min(due, keep)
        if full:
            self._next_full = mono + min(FULL_PASS_SPACING * took, FULL_PASS_SPACING_MAX)
            if walk is None:
                self._last_complete = mono
                self._since_complete = False
        started = sum(d.action == policy.START for d in decisions)
        if self._unsettled >= SETTLE_AFTER:  # a queue filling up: its jobs settled a few thousand at a time
            self._unsettled = 0
            settle()
        if full and complete and sliced and walk is not None:  # the rest in slices: finish_complete
            held = {d.job_id for d in decisions if "held" in d.details}
            holder = next((c for c in cands if c.job_id in held), None)
            self._rest = Rest(walk, seen, loads, holder, len(cands), took, planned_in * 1000, started)
            return decisions
        kind = "full" if full else "new jobs"
        self.last_pass = {"kind": kind, "queued": sum(self._queued_n.values()) + started, "planned": len(cands),
                          "started": started, "ms": took * 1000, "plan_ms": planned_in * 1000}
        (log.info if full else log.debug)("scheduler pass (%s): %d queued, %d planned, %d started, %.1f ms "
                                          "(%.1f ms before the starts)", kind, self.last_pass["queued"], len(cands),
                                          started, took * 1000, planned_in * 1000)
        return decisions

    async def finish_complete(self, stopping: Callable[[], bool]) -> None:
        """The rest of a complete pass, a slice at a time with the loop free in between: each slice
        takes the next jobs of the fair walk (SLICE_S of work) and plans them after the GPUs' state
        now; the job GPUs are held for (hold_after) is planned first in every slice, so that later
        jobs see its GPUs held as one pass would. Nothing starts here (none of these jobs fit when the
        pass began; should GPUs free up meanwhile, the full pass that follows starts what fits). A
        pass for new jobs, or a full one, runs between slices when one is owed."""
        rest, n = self._rest, 200
        with held():  # what the slices keep (a decision per job) would set off full collections: settle
            try:
                while not stopping():
                    t0 = time.monotonic()
                    now = time.time()
                    active = self.table.active(*ACTIVE)
                    views, placed = self.gpus.views(in_use=True), self.placed(now, active)
                    self._views = views
                    cands: list[policy.Candidate] = []
                    if rest.holder is not None:
                        cands.append(dataclasses.replace(rest.holder, seq=0))
                    first, waits = len(cands), []
                    # at most n jobs, and no longer than most of a slice: a job whose candidate is kept
                    # costs ~2 µs, one made afresh 40-60 µs, so n learned on the one overshot on the
                    # other (slices of 13-20 ms at 50,000 queued on a quiet machine, SLICE_S 5 ms)
                    enough = t0 + SLICE_S * 0.7
                    for k, j in enumerate(rest.walk, 1):
                        self._take((j.id,), rest.seen, cands, waits, rest.loads, job=j, keep=False)
                        if len(cands) - first >= n or (not k % 16 and time.monotonic() > enough):
                            break
                    else:
                        rest.walk = None
                    decisions = policy.plan(cands, views, placed, self.cfg, now=now,
                                            learned=self.learner.learned)[first:]
                    decisions = [d for d in decisions if d.action != policy.START]
                    self.record(waits)
                    self.record(decisions)
                    for d in decisions:
                        if "held" in d.details:
                            self._holders.add(d.job_id)
                            rest.holder = next(c for c in cands if c.job_id == d.job_id)
                        else:
                            self._holders.discard(d.job_id)
                    ha = self.cfg.hold_after
                    if ha > 0:
                        rest.due = min(rest.due, min((c.queued_at + ha for c in cands[first:]
                                                      if c.gpus and c.queued_at + ha > now), default=math.inf))
                    took = time.monotonic() - t0
                    rest.busy += took
                    rest.longest = max(rest.longest, took)
                    rest.slices += 1
                    rest.planned += len(cands) - first
                    if rest.walk is None:
                        break
                    n = max(20, min(5000, 2 * n, int(n * SLICE_S / max(took, 1e-4))))  # about SLICE_S a slice
                    await asyncio.sleep(SLICE_GAP)  # requests, exits, samples
                    if self._fresh or self._full:
                        self.schedule_pass(sliced=True)
            finally:
                self._rest = None
                t = time.monotonic()
                settle()
                rest.settle = time.monotonic() - t
                rest.longest = max(rest.longest, rest.settle)
        self._unsettled = 0
        if rest.walk is not None:
            return  # the daemon stops
        self._last_complete = time.monotonic()
        if self.cfg.hold_after > 0:
            self._hold_due = min(rest.due, self._hold_due if self._hold_due > time.time() else math.inf)
        self.last_pass = {"kind": "full", "queued": sum(self._queued_n.values()) + rest.started,
                          "planned": rest.planned, "started": rest.started, "ms": rest.busy * 1000,
                          "plan_ms": rest.plan_ms, "slices": rest.slices, "longest_ms": rest.longest * 1000}
        log.info("scheduler pass (full): %d queued, %d planned, %d started, %.1f ms (%.1f ms before the starts); "
                 "complete in %d slices, the longest %.1f ms (its settle %.1f ms)", self.last_pass["queued"], rest.planned,
                 rest.started, rest.busy * 1000, rest.plan_ms, rest.slices, rest.longest * 1000, rest.settle * 1000)

    def placed(self, now: float, active: list[Job] | None = None) -> list[policy.Placed]:
        """The active jobs on GPUs as plan() sees them (colo's own and Slurm's alike)."""
        if active is None:
            active = self.table.active(*ACTIVE)
        out = []
        for j in active:
            if not j.gpus or releases_budget(j):  # suspended: its GPU memory is in host memory
                continue
            e, alone = self.learner.expect_of(j)  # where its predictions put it in its profile
            prof = self.learner.profile_of(j)
            out.append(policy.Placed(j.id, tuple(j.gpus), j.spec.gpu_mem, j.uid, str(j.mode or "timesliced"),
                                     prof, now - (j.started_at or now),
                                     done=policy.progress(e, now) if e is not None else None, alone=alone,
                                     family=self.learner.family_of(j) if prof is None else ""))
        return out

    def _take(self, ids, seen: set[int], cands: list, waits: list, loads: dict, job: Job | None = None,
              keep: bool = True) -> None:
        """Candidates for plan() from queued jobs, in the order taken (Candidate.seq); a job that
        waits for something plan() does not know (a dependency, the engine, a limit) gets its
        WAIT decision here."""
        limits = self.limits
        for job_id in ids:
            if job_id in seen:
                continue
            seen.add(job_id)
            j = job or self.table.open.get(job_id)
            if j is None or j.state != State.QUEUED:
                continue
            if why := self.start_wait(job_id):  # an earlier attempt still ending, a start the engine refused
                waits.append(policy.Decision(j.id, policy.WAIT, reason=why))
                continue
            if j.held_by:
                waits.append(policy.Decision(j.id, policy.WAIT, reason=stopped_text(j.user, j.held_by, "held",
                                                                                  f"colo release {j.id}")))
                continue
            if j.spec.begin and j.spec.begin > time.time():
                at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(j.spec.begin))
                waits.append(policy.Decision(j.id, policy.WAIT, reason=f"waiting for its start time, {at} (--begin)"))
                continue
            if j.spec.deps:
                why, never = deps.unmet(j, self.table.state_of)
                if never:
                    self.table.transition(j.id, State.FAILED, why)
                    continue
                if why:
                    waits.append(policy.Decision(j.id, policy.WAIT, reason=why))
                    continue
            if j.spec.gpus and self.gpus.error:
                waits.append(policy.Decision(j.id, policy.WAIT, reason=self.gpus.error))
                continue
            if j.spec.runtime == "docker" and (why := self.engines.docker_away()):
                waits.append(policy.Decision(j.id, policy.WAIT, reason=f"waiting for the Docker engine: {why}"))
                continue
            if (limits.running or limits.gpu_mem) and (why := fairshare.start_refusal(
                    limits, j.user, loads.get(j.uid) or fairshare.UserLoad(), j.spec.gpu_mem, j.spec.gpus)):
                waits.append(policy.Decision(j.id, policy.WAIT, reason=why))
                continue
            if j.spec.array_limit:  # --array ...%N: at most N of its tasks running (or planned this pass)
                if self._array_load is None:
                    self._array_running = Counter(a.spec.array_job for a in self.table.active(*ACTIVE))
                    self._array_load = Counter(self._array_running)
                a, most = j.spec.array_job, j.spec.array_limit
                if self._array_load[a] >= most:
                    run = self._array_running[a]  # the running tasks only: those planned first may wait too
                    ahead = self._array_load[a] - run
                    waits.append(policy.Decision(j.id, policy.WAIT, reason=(
                        f"waiting for its array: {run} task(s) of array {a} run"
                        + (f" and {ahead} before it may start now" if ahead else "")
                        + f"; at most {most} at once (--array ...%{most})")))
                    continue
                self._array_load[a] += 1
            seq = len(cands)
            last = self.decisions.get(job_id)
            held = tuple(last.details.get("held", ())) if last is not None else ()
            c = self._cands.get(job_id)
            budget = j.spec.gpu_mem
            if j.spec.grow:
                budget = grow.budget_of(j, self.learner, self._views, self.limits)
                self._grow_planned = True
            if c is None or c.seq != seq or c.held != held or c.budget != budget:
                if c is not None:  # what it is placed with, and its family, stand until forgotten (on_forget)
                    prof, family = c.profile, c.family
                else:
                    prof = self.learner.profile_of(j) if j.spec.gpus else None
                    family = self.learner.family_of(j) if prof is None and j.spec.gpus else ""
                c = cand(job_id, budget, j.spec.gpus, j.uid, 0, seq, prof, j.submitted_at, held, tuple(j.spec.gpu_ids),
                         j.spec.gpu_type, j.spec.grow and j.spec.gpus == 1, family)
                # kept for the next passes (not the slices of a complete pass, nor past CANDS_KEPT:
                # 50,000 candidates kept were ~25 MiB; a full pass looks at a queue's front)
                if keep and (len(self._cands) < CANDS_KEPT or job_id in self._cands):
                    self._cands[job_id] = c
            cands.append(c)

    def _provisional_noted(self, decisions: list[policy.Decision]) -> list[policy.Decision]:
        """A start planned with a provisional profile (a running job's first samples) says so."""
        cands = self._cands
        return [dataclasses.replace(d, reason=f"{d.reason}; its profile is {c.profile.note}")
                if d.action == policy.START and (c := cands.get(d.job_id)) is not None
                and getattr(c.profile, "provisional", False) else d for d in decisions]

    def _none_fits(self, views: list[policy.GpuView], placed: list[policy.Placed],
                   decisions: list[policy.Decision]) -> bool:
        """After these decisions, could any GPU take the smallest queued GPU job? (If not, the
        jobs not looked at would all wait: the walk can stop.)"""
        if not self._budgets:
            return True
        free = policy.free_budget([v for v in views if v.in_service and v.compute_mode != "prohibited"], placed)
        for d in decisions:
            if d.action == policy.START:
                for u in d.gpus:
                    if u in free:
                        free[u] -= d.details.get("budget", self.table.open[d.job_id].spec.gpu_mem)  # lent too
        return max(free.values(), default=0) < min(self._budgets)

    def _within_limits(self, decisions: list[policy.Decision],
                       loads: dict[int, fairshare.UserLoad]) -> list[policy.Decision]:
        """plan() knows no per-user limits: a start that would pass one waits instead, and a full
        pass follows (what it was given is free for the others)."""
        limits = self.limits
        if not (limits.running or limits.gpu_mem):
            return decisions
        out = []
        for d in decisions:
            if d.action == policy.START:
                j = self.table.open[d.job_id]
                ld = loads.setdefault(j.uid, fairshare.UserLoad())
                budget = d.details.get("budget", j.spec.gpu_mem)
                why = fairshare.start_refusal(limits, j.user, ld, budget, j.spec.gpus)
                if why and d.details.get("lent") and not fairshare.start_refusal(
                        limits, j.user, ld, budget - d.details["lent"], j.spec.gpus):
                    budget -= d.details["lent"]  # what was lent would pass the limit: not lent
                    d = dataclasses.replace(d, reason=f"{d.reason}; not lent after all: {why}",
                                            details={**d.details, "budget": budget, "lent": 0})
                    why = None
                if why:
                    d = policy.Decision(d.job_id, policy.WAIT, reason=why)
                    self._full = True
                else:
                    ld.running += 1
                    ld.gpu_mem += budget * j.spec.gpus
            out.append(d)
        return out

    def fair_usage(self, now: float, active: list[Job]) -> dict[int, float]:
        """uid -> recent GPU use (GiB-hours): ended jobs and the running ones, whose suspended
        time (colo suspend) is no use."""
        return self.fair_ledger.usage(now, [(j.uid, fairshare.weight(j.spec.gpu_mem, len(j.gpus)), *held_span(j, now))
                                            for j in active if j.gpus and j.started_at])

    def fair_note(self, job: Job) -> str | None:
        """Why a queued job waits for fairness: jobs of other users submitted after it go first
        (walks the fair order up to it: for `colo explain`, not for every pass)."""
        if job.state != State.QUEUED or not job.spec.gpus:
            return None
        now = time.time()
        active = [j for j in self.table.active(*ACTIVE) if j.gpus and j.started_at]
        usage = self.fair_usage(now, active)
        ahead = 0
        for j in fairshare.fair_walk({u: self._user_queue(u) for u, lst in self._uq.items() if lst}, usage):
            if j.id == job.id:
                break
            if j.uid != job.uid and j.id > job.id and j.spec.gpus:
                ahead += 1
        if not ahead:
            return None
        return (f"waiting for fair share: {ahead} job(s) of other users, submitted after it, go first "
                f"(their users used less GPU lately; {job.user}: {usage.get(job.uid, 0.0):.2f} GiB-h, "
                f"half-life {self.config.fair_share_half_life / 3600:g} h)")


    def explain(self, job_id: int) -> dict | None:
        """The latest decision about a job, with its reason (`colo explain`)."""
        d = self.decisions.get(job_id)
        if d is None:
            return self.table.store.decision(job_id)
        reason = d.reason
        job = self.table.open.get(job_id)
        if d.action == policy.WAIT and job is not None and (note := self.fair_note(job)):
            reason = f"{reason}; {note}"
        return {"action": d.action, "mode": d.mode, "gpus": list(d.gpus), "reason": reason, "details": d.details}

    def record(self, decisions: list[policy.Decision]) -> None:
        """Keep the latest decision per job; START decisions are stored at once, the (many, often
        re-worded) WAIT ones by a writer thread, so a pass over 10,000 queued jobs stays short."""
        now = time.time()
        starts, waits = [], []
        shared, texts = self._details, self._reasons
        for d in decisions:
            old = self.decisions.get(d.job_id)
            if old is not None and old.reason == d.reason and old.action == d.action:
                continue
            row = (d.job_id, d.action, d.mode, list(d.gpus), d.reason, d.details)
            if d.action == policy.START:
                self.decisions[d.job_id] = d
                starts.append(row)
                continue
            try:
                key = tuple(d.details.items())
                details = shared.setdefault(key, d.details)
            except TypeError:  # a list among the figures (held GPUs): its own
                details = d.details
            # jobs told the same keep one copy of the text (each pass words it afresh for each job)
            self.decisions[d.job_id] = KeptWait(d.job_id, texts.setdefault(d.reason, d.reason), details)
            waits.append(row)
        if len(shared) > 4096:  # figures of passes long gone
            shared.clear()
        if len(texts) > 4096:  # reasons of passes long gone
            texts.clear()
        if starts or waits:
            self.version += 1
        if starts:
            self.table.store.record_decisions(starts, now)
        if waits:
            self._writer.put(waits, now)
