"""Which stored profile a job runs under, and learning it from the job's samples.

Whose runs teach what (invariant 13): a user's finished jobs teach only that user's own copy of a
profile, under state_dir/profiles/users/UID. A job's profile is looked up in that user's own
folder first, then the ones an admin marked shared (state_dir/profiles/shared, and the flat
state_dir/profiles of colo versions before this; `shared_profiles` from the config in place of
state_dir/profiles on a cluster), then the configured `profile_dirs`, then the
shipped profiles. Nothing but an admin's `profile share` writes outside a user's own folder, so
one user's runs cannot change how another user's jobs are placed.

At a start the scheduler's decision holds the slowdown plan() predicted for the job
(details["predicted_slowdown"]) and start_neighbours() records which profiles share its GPU; a
later start beside it adds what that start predicted for it from then on (details["expect"],
policy.joined). At its end learn() compares: wall time against the stored profile's alone run
time, over the predicted slowdown (weighted by how long each prediction held). Into the owner's `self.learned[uid]` (policy.Learned, which plan() uses for that
user's jobs only, invariant 13): the alone-time error from
uncontended runs, the co-run slowdown the model missed per (profile, neighbour, mode) from shared
ones, the model's error (the margin), the largest memory per profile (the budget it suggests).
The observation is added to the job's stored decision, so `colo explain` shows predicted vs
observed. The stored profile (its series and alone run time) is learned from uncontended runs
only, or from a first run that has no profile yet: a shared run's wall time is not its alone time.

What was learned is stored (colo/store/, schemas 4, 5, 7 and 14) in the transaction that learns
it, and read back at start, so a restarted daemon, SIGKILLed or not, goes on from where it was and
decides as it did: every field of policy.Learned plan() reads, the levels of taking turns running
groups showed (explored, or slower there) and the count of observations that ages evidence
included. Each stored value is checked as it is read (stored_learning): one out of its range is
refused, said once per user in the log, and the rest used. What a restart still loses is said in
docs/reliability.md ("What a restart forgets"). So is who
shared a running job's GPU (its neighbours): a job that runs across a restart still knows it was
contended. Bounds: a job keeps at most NEIGHBOURS_MAX neighbour names (past that it is plainly
contended; which names matter little) and they are forgotten at its end, whatever the end; each
user keeps the LEARNED_MAX co-run pairings and profiles changed most recently.

Owns: `learned` (uid -> policy.Learned, what ends taught; plan() reads it), the profile folders
and a cache of lookups, the provisional profiles of running jobs that have none (made from their
first samples, never stored), what each active job's start predicted for it (its expectation,
for plan()'s Placed.done) and the running MPS groups it watches (Learned.observe_live). Calls:
the store (samples, decisions, learned rows), the job table (who runs beside whom), the GPUs
(names, sizes, NVML's device SM) and `on_forget` (the scheduler plans again with a profile that
changed).

A job's profile is looked up under its own key (image or program + the arguments' hash, or
--profile) and then its family's (the image or program and script: profiles.names_for), so a new
hyperparameter starts from what its family's runs showed; a run teaches both.

Per-process SM under MPS (docs/mps.md): on a real driver NVML may attribute MPS clients' activity
to the MPS server's process, so the clients' own pids show none. colo apportions: on each GPU,
the activity NVML gives colo's own MPS server processes is split equally among that GPU's running
MPS jobs (mps_server_shares(); under per-client attribution the server shows none and nothing
changes). It is exact when a job is the server's only client, which is the MPS run whose series
colo learns (uncontended runs, above). With several clients the split is an estimate: `colo top`
shows it, and it is learned only as a job's first run (which has no profile to keep), merged
with, and outweighed by, its later uncontended runs.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import shutil
import time
from pathlib import Path

from typing import Callable

from .. import profiles
from ..config import Config
from ..jobs import ACTIVE, Job, Mode
from ..units import format_size
from ..sched import budgets, learning, policy
from .gpus import Gpus
from .jobtable import JobTable

log = logging.getLogger("colo")
LIVE_EVERY = 30.0  # seconds of readings taught at once
NEIGHBOURS_MAX = 32  # names kept per running job (any one makes its run contended)
LEARNED_MAX = 2000  # per user: co-run pairings, and profiles, kept (the most recently changed)
OWN_PROFILES_MAX = 1000  # profiles a user may hand the daemon (each at most profiles.MAX_UPLOAD)


def mps_server_shares(per_gpu: dict[str, dict[int, tuple[int, int]]], servers: set[int],
                      mps_jobs: dict[int, tuple[str, ...]]) -> dict[int, tuple[float, float]]:
    """Per job id: the (SM %, bandwidth %) NVML attributed to colo's MPS server processes
    (`servers`) on each of its GPUs, split equally among the MPS jobs there. per_gpu: uuid ->
    pid -> (SM %, bandwidth %), NVML's per-process samples; mps_jobs: job id -> its GPUs."""
    out: dict[int, tuple[float, float]] = {}
    for uuid, util in per_gpu.items():
        sm = sum(util[p][0] for p in servers if p in util)
        bw = sum(util[p][1] for p in servers if p in util)
        clients = [j for j, gpus in mps_jobs.items() if uuid in gpus]
        if not clients or not (sm or bw):
            continue
        for j in clients:
            a, b = out.get(j, (0.0, 0.0))
            out[j] = (a + sm / len(clients), b + bw / len(clients))
    return out


def _errors_delta(before: list[float], after: list[float]) -> tuple[list[float] | None, list[float]]:
    """(the whole list to store, None when appending does) and what was appended: the error list
    grows at its end and drops its oldest (policy.Learned keeps the most recent)."""
    if after == before:
        return None, []
    for k in range(len(before)):  # k oldest dropped, the rest still at the front
        if after[:len(before) - k] == before[k:] and len(after) > len(before) - k:
            return None, after[len(before) - k:]
    return after, []


def stored_learning(got: dict) -> tuple[dict, list[str]]:
    """One user's learning as the store read it (Store.learned) as policy.Learned's fields, and
    what was refused: each value out of the range Learned ever gives it (a damaged or hand-edited
    row) is left out, the rest kept. A clock refused is the newest any entry was taught at."""
    refused: list[str] = []

    def count(x, top: float = 1 << 62) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= top

    def real(x, low: float = 0.0, high: float = 1e9) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and low < x <= high

    def keep(table: str, items, ok) -> dict:
        out = {}
        for k, v in items:
            why = ok(k, v)
            if why:
                refused.append(f"{table} {k!r}: {v!r} ({why})")
            else:
                out[k] = v
        return out

    def mean(k, v) -> str:
        return "" if isinstance(v, tuple) and len(v) == 2 and count(v[0]) and v[0] >= 1 and real(v[1]) else \
            "not (runs >= 1, factor > 0)"

    modes = ("mps", "timesliced")

    def pairing(k, v) -> str:
        if not (isinstance(k, tuple) and len(k) == 3 and all(isinstance(x, str) for x in k) and k[2] in modes):
            return "not (profile, neighbour, mode)"
        return mean(k, v)

    def step(k, v) -> str:  # a bandwidth step's, or an early warning's key
        return "" if isinstance(k, tuple) and len(k) == 2 and k[0] in modes and count(k[1], 30) else "not (mode, bin 0..30)"

    corun = keep("learned_corun", got["corun"].items(), pairing)
    bw = keep("learned_bw", got["bw"].items(), lambda k, v: step(k, v) or mean(k, v))
    alone = keep("learned_profile", got["alone"].items(), lambda k, v: mean(k, v) if isinstance(k, str) else "no name")
    max_mem = keep("learned_profile", got["max_mem"].items(),
                   lambda k, v: "" if isinstance(k, str) and count(v) else "not bytes")
    errors: dict[str, list] = {"errors": [], "errors_seen": []}
    for name, kept in errors.items():
        for e in got[name]:
            if real(e):
                kept.append(e)
            else:
                refused.append(f"learned_error {e!r} (not > 0)")
    levels = {name: keep("learned_ts", got[name].items(),
                         lambda k, v: "" if count(k, 40) and count(v) else "not (bin 0..40, clock >= 0)")
              for name in ("ts", "ts_slow")}
    live = keep("learned_live", got["live"].items(), lambda k, v: step(k, v) or (
        "" if isinstance(v, tuple) and len(v) == 2 and real(v[0], 1.0 - 1e-9) and count(v[1])
        else "not (level >= 1, clock >= 0)"))
    at = keep("learned clock of", got["at"].items(), lambda k, v: "" if count(v) else "not a clock >= 0")
    clocks = [*at.values(), *levels["ts"].values(), *levels["ts_slow"].values(), *(c for _, c in live.values())]
    clock = got["clock"]
    if not count(clock):
        refused.append(f"learned_clock {clock!r} (not a count >= 0)")
        clock = max(clocks, default=0)
    elif clocks and max(clocks) > clock:  # taught after the count's last step: not this count
        late = [c for c in clocks if c > clock]
        refused.append(f"{len(late)} entr{'y' if len(late) == 1 else 'ies'} taught at clock {max(late)} > "
                       f"learned_clock {clock}")
        at = {k: c for k, c in at.items() if c <= clock}
        levels = {n: {k: c for k, c in d.items() if c <= clock} for n, d in levels.items()}
        live = {k: v for k, v in live.items() if v[1] <= clock}
    return dict(corun=corun, alone=alone, max_mem=max_mem, bw=bw, clock=clock, at=at, live=live, **errors,
                **levels), refused


class Learner:
    def __init__(self, config: Config, table: JobTable, gpus: Gpus, cfg: policy.PolicyConfig):
        self.config = config
        self.table = table
        self.store = table.store
        self.gpus = gpus
        self.cfg = cfg
        self.learned: dict[int, policy.Learned] = {}  # per user: one user's runs never place another's jobs
        self.on_forget: list[Callable[[], None]] = []  # a profile changed: what was planned with it is stale
        # learned profiles live in the state dir, or in a folder every node of a cluster shares
        root = config.shared_profiles or config.state_dir / "profiles"
        self._profiles_root = root
        self._profile_layers: list[tuple[str, Path]] = [
            ("shared", root / "shared"), ("shared", root),  # the flat folder: learned before per-user profiles
            *(("configured", Path(d)) for d in self.config.profile_dirs), ("shipped", profiles.shipped_dir())]
        self._profile_stores: dict[int, profiles.ProfileStore] = {}
        self._profile_cache: dict[tuple[int, tuple[str, ...]], tuple[float, profiles.Profile | None]] = {}
        # What a running job with no stored profile is taken to do, made from its first samples
        # (profiles.provisional): (uid, name) -> (job id, profile), under its own key and its
        # family's, so queued jobs of its family are placed beside it within its first minute.
        # Never stored: its run replaces it at its end.
        self._provisional: dict[tuple[int, str], tuple[int, profiles.Profile]] = {}
        self._provisioned: dict[int, float] = {}  # job -> elapsed seconds at its last provisional (or last look for one)
        # What each active job's start predicted for it (policy.expectation, then joined/left),
        # and whether it runs alone to be checked: mirrored from its stored decision
        self._expect: dict[int, tuple[dict, bool]] = {}
        # per GPU, a running group watched (Learned.observe_live): [its job ids, since, expected SM
        # area, observed SM area, summed peak bandwidth, last look, its mode ("mps": every job an
        # MPS client; else "timesliced"), its level of taking turns (policy.turns_level) area]
        self._live: dict[str, list] = {}

    def own_profile_dir(self, uid: int) -> Path:
        return self._profiles_root / "users" / str(int(uid))

    def profile_store(self, uid: int) -> profiles.ProfileStore:
        """The folders a job of `uid` finds its profile in, its own first; new profiles go to its own."""
        st = self._profile_stores.get(uid)
        if st is None:
            st = self._profile_stores[uid] = profiles.ProfileStore(
                [self.own_profile_dir(uid), *(d for _, d in self._profile_layers)])
        return st

    def profile_source(self, uid: int, name: str) -> tuple[str, Path] | None:
        """Which layer a name resolves to for `uid`: ("own" | "shared" | "configured" | "shipped", file)."""
        for kind, d in (("own", self.own_profile_dir(uid)), *self._profile_layers):
            p = d / f"{name}.profile"
            if profiles.valid_name(name) and p.is_file():
                return kind, p
        return None

    def profile_names(self, job: Job) -> list[str]:
        """What a job's profile is looked up under: --profile, else its own key then its family's."""
        return profiles.names_for(job.spec.image, job.spec.argv, job.spec.profile)

    def profile_name(self, job: Job) -> str:
        """The name a job's runs are learned under (its own key, or --profile)."""
        return self.profile_names(job)[0]

    def family_of(self, job: Job) -> str:
        """The name a running job's provisional profile serves its owner's others under (its
        family's, or --profile): plan() gives a GPU to a family with none running first."""
        return self.profile_names(job)[-1]

    def stored_profile(self, job: Job) -> "profiles.Profile | None":
        """The stored profile a job runs under (its own key's, else its family's); files are read
        again at most every 60 s."""
        names = tuple(self.profile_names(job))
        key = (job.uid, names)
        hit = self._profile_cache.get(key)
        now = time.monotonic()
        if hit is None or now - hit[0] > 60:
            try:
                prof = self.profile_store(job.uid).first(names)
            except profiles.ProfileError as e:
                log.warning("profile %s unreadable: %s", names[0], e)
                prof = None
            hit = self._profile_cache[key] = (now, prof)
        return hit[1]

    def profile_of(self, job: Job) -> "profiles.Profile | None":
        """What a job is placed with: its stored profile, else a provisional one that a running job
        of its name or family made from its first samples (tick), else None."""
        prof = self.stored_profile(job)
        if prof is None:
            for name in self.profile_names(job):
                got = self._provisional.get((job.uid, name))
                if got is not None:
                    return got[1]
        return prof

    def forget_profile(self, name: str, uid: int | None = None) -> None:
        """Drop cached lookups of `name` (one user's, or everyone's after a change to a shared one)."""
        for key in [k for k in self._profile_cache if name in k[1] and (uid is None or k[0] == uid)]:
            del self._profile_cache[key]
        self._changed()

    def _changed(self) -> None:
        for fn in self.on_forget:  # queued jobs of that profile plan with what is known now
            fn()

    def share_profile(self, name: str, uid: int) -> Path:
        """An admin's choice: user `uid`'s own copy of `name` becomes the shared one."""
        src = self.own_profile_dir(uid) / f"{name}.profile"
        if not profiles.valid_name(name) or not src.is_file():
            raise profiles.ProfileError(f"user {uid} has no profile of their own named {name!r}")
        profiles.load(src)  # only a readable profile is shared
        dst_dir = self._profiles_root / "shared"
        dst_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = dst_dir / f".{name}.profile.tmp"
        shutil.copyfile(src, tmp)
        tmp.replace(dst_dir / f"{name}.profile")
        self.forget_profile(name)
        return dst_dir / f"{name}.profile"

    def put_profile(self, uid: int, text: object) -> tuple[profiles.Profile, bool]:
        """A profile user `uid` recorded (`colo profile record`) becomes their own copy: checked as
        hostile input (profiles.check_upload), written by colo into `uid`'s own folder only (the
        caller's uid comes from the socket, never from the request), replacing an own copy of that
        name. At most OWN_PROFILES_MAX own profiles a user. Returns it, and whether it replaced one."""
        prof = profiles.check_upload(text)
        own = self.own_profile_dir(uid)
        own.mkdir(mode=0o700, parents=True, exist_ok=True)
        dst = own / f"{prof.name}.profile"
        replaced = dst.is_file()
        if not replaced and sum(1 for _ in own.glob("*.profile")) >= OWN_PROFILES_MAX:
            raise profiles.ProfileError(f"you have {OWN_PROFILES_MAX} profiles of your own already")
        profiles.save(prof, dst)
        return prof, replaced  # the caller, on the loop, forgets cached lookups (forget_profile)

    def learn(self, job: Job) -> None:
        """A job that ran to its end teaches its owner's own copy of the profile it ran under
        (started from the shared or shipped one when the owner has none yet)."""
        rows = self.store.samples(job.id)
        neighbours = sorted(self._take_neighbours(job.id))
        if not job.gpus or neighbours == ["?"]:
            return
        self._observe(job, rows, neighbours)
        if len(rows) < 2:
            return
        if neighbours and self.stored_profile(job) is not None:  # its wall time is not its alone time
            log.info("job %d shared its GPU with %s: its profile's series are not learned from this run",
                     job.id, ", ".join(neighbours))
            return
        t0 = rows[0][0]
        samples = {"times": [r[0] - t0 for r in rows], "sm": [r[1] or 0.0 for r in rows],
                   "mem": [r[2] or 0 for r in rows], "membw": [r[3] or 0.0 for r in rows]}
        gpu = next((d.name for d in self.gpus.devices if d.uuid == job.gpus[0]), "")
        runtime = (job.ended_at or time.time()) - (job.started_at or t0)
        names = self.profile_names(job)
        name, family = names[0], (names[1] if len(names) > 1 else None)
        try:
            own = self.own_profile_dir(job.uid)
            own.mkdir(mode=0o700, parents=True, exist_ok=True)
            store = self.profile_store(job.uid)
            old = store.get(name)
            # ProfileStore.learn reads the first folder that has `name` and writes to the first
            # writable folder: the owner's own, which comes first; and into its family's
            new = store.learn(name, samples, runtime=runtime, gpu=gpu, family=family)
            for n in names:
                self.forget_profile(n, job.uid)
        except (profiles.ProfileError, OSError) as e:
            log.warning("could not learn profile for job %d: %s", job.id, e)
            return
        if old is not None or not neighbours:  # (learning.profile_learned: the simulator's rule too)
            self._learning(job.uid, lambda mine: learning.profile_learned(
                mine, name, None if old is None else old.runtime, new.runtime, bool(neighbours)))

    def grown_budget(self, job: Job) -> int | None:
        """--grow: the budget a job refused by its budget is requeued with (once): 1.25x its budget,
        or the most its profile's runs used + 10 % when more, at most the largest usable GPU memory.
        None when that is no more than it had."""
        name = self.profile_name(job)
        # what its samples showed, and at least the budget that refused it (how much more it
        # asked for no reading shows): the next of its name starts with that + 10 % (grow.budget_of)
        peak = max(max((r[2] or 0 for r in self.store.samples(job.id)), default=0), job.spec.gpu_mem)

        def note(mine: policy.Learned) -> None:
            mine.max_mem[name] = max(mine.max_mem.get(name, 0), int(peak))
        self._learning(job.uid, note)
        want = max(job.spec.gpu_mem * budgets.GROW, self.learned_for(job.uid).suggest_budget(name) or 0)
        want = min(budgets.step_up(want), max((v.usable for v in self.gpus.views()), default=0))
        return want if want > job.spec.gpu_mem else None

    def learned_for(self, uid: int) -> policy.Learned:
        return self.learned.setdefault(uid, policy.Learned())

    def start_neighbours(self, job_id: int, gpus: tuple[str, ...]) -> tuple[list[tuple[int, str]], int]:
        """Who shares a GPU with whom (profile names), both ways, for learning at each end: stored
        with the start, in its transaction (Launcher.start), so a job running across a restart still knows."""
        me = self.table.job(job_id)
        mine = self.profile_name(me)
        pairs, residents = [], []
        for other in self.table.jobs_in(*ACTIVE):
            if other.id != job_id and set(other.gpus) & set(gpus):
                pairs += [(job_id, self.profile_name(other)), (other.id, mine)]
                residents.append(other)
        if residents:
            self._joined(job_id, residents)
        return pairs, NEIGHBOURS_MAX

    def _joined(self, job_id: int, residents: list[Job]) -> None:
        """What this start predicted for each job already on its GPUs goes into that job's stored
        decision (details["expect"], policy.joined): its end is compared with it from now on."""
        try:
            dec = self.store.decision(job_id)
            if dec is None or dec.get("action") != "start":
                return
            now, rows = time.time(), []
            for other in residents:
                od = self.store.decision(other.id)
                if od is None or od.get("action") != "start":
                    continue
                det = dict(od.get("details") or {})  # (started in this pass: not running yet, so from now)
                e = det.get("expect") or policy.expectation(det, od.get("mode") or "", other.started_at or now)
                det["expect"] = policy.joined(e, now, dec.get("details") or {}, dec.get("mode") or "", other.id)
                self._expect[other.id] = (det["expect"], bool(det.get("check_alone")))
                rows.append((other.id, od["action"], od.get("mode"), od.get("gpus") or [], od.get("reason") or "", det))
            if rows:
                self.store.record_decisions(rows)
        except Exception as e:  # noqa: BLE001 - a prediction is worth less than the start
            log.warning("could not record what job %d's start predicted for its neighbours: %s", job_id, e)

    def left_alone(self, job_id: int) -> None:
        """A job has ended: each job it leaves with no neighbour on its GPUs runs alone from now
        on, and its end is compared with that (policy.left) for the rest of its run, as colo sim."""
        try:
            me = self.table.job(job_id)
            if not me.gpus:
                return
            active = [j for j in self.table.jobs_in(*ACTIVE) if j.id != job_id and j.gpus]
            now, rows = time.time(), []
            for other in active:
                if not set(other.gpus) & set(me.gpus) or any(
                        o.id != other.id and set(o.gpus) & set(other.gpus) for o in active):
                    continue
                od = self.store.decision(other.id)
                if od is None or od.get("action") != "start":
                    continue
                det = dict(od.get("details") or {})
                e = det.get("expect") or policy.expectation(det, od.get("mode") or "", other.started_at or now)
                det["expect"] = policy.left(e, now)
                self._expect[other.id] = (det["expect"], bool(det.get("check_alone")))
                rows.append((other.id, od["action"], od.get("mode"), od.get("gpus") or [], od.get("reason") or "", det))
            if rows:
                self.store.record_decisions(rows)
        except Exception as e:  # noqa: BLE001 - a prediction is worth less than the job's end
            log.warning("could not record that job %d's end left its neighbours alone: %s", job_id, e)

    def finished(self, job_id: int) -> None:
        """A job is over (its end recorded, learned from): the jobs it leaves alone are compared
        with that from now on, and what was kept for it while it ran goes."""
        self.left_alone(job_id)
        self._expect.pop(job_id, None)
        self._provisioned.pop(job_id, None)
        gone = [k for k, (j, _) in self._provisional.items() if j == job_id]
        for k in gone:
            del self._provisional[k]
        if gone:
            self._changed()

    def expect_of(self, job: Job) -> tuple[dict | None, bool]:
        """(what an active job's start, and the starts and ends beside it since, predicted for it,
        whether it runs alone to be checked): for plan()'s Placed.done and Placed.alone."""
        got = self._expect.get(job.id)
        if got is None:
            try:
                dec = self.store.decision(job.id)
            except Exception:  # noqa: BLE001 - as if it had none: placed as running at its alone speed
                dec = None
            if dec is None or dec.get("action") != "start":
                return None, False
            det = dec.get("details") or {}
            e = det.get("expect") or policy.expectation(det, dec.get("mode") or "", job.started_at or time.time())
            got = self._expect[job.id] = (e, bool(det.get("check_alone")))
        return got

    def tick(self, running: list[Job], now: float) -> bool:
        """Each sample's learning while jobs run (invariant 15): provisional profiles of running
        jobs that have none, and what running groups of MPS clients show (Learned.observe_live).
        True when what plan() knows changed (a provisional profile made or remade)."""
        changed = False
        for job in running:
            if job.gpus and job.started_at and self.stored_profile(job) is None:
                changed |= self._provision(job, now - job.started_at)
        self._watch_groups(running, now)
        if changed:
            self._changed()
        return changed

    def _provision(self, job: Job, elapsed: float) -> bool:
        """A provisional profile from a running job's samples so far, remade every half minute
        until it has run PROVISIONAL_HOLD (then what it showed stands until its end)."""
        last = self._provisioned.get(job.id, 0.0)
        if elapsed < max(profiles.PROVISIONAL_AFTER, last + profiles.PROVISIONAL_AFTER) \
                or last >= profiles.PROVISIONAL_HOLD:
            return False
        rows = self.store.samples(job.id)
        if len(rows) < 2:
            return False
        t0 = rows[0][0]
        names = self.profile_names(job)
        gpu = next((d.name for d in self.gpus.devices if job.gpus and d.uuid == job.gpus[0]), "")
        made = profiles.provisional(names[0], {"times": [r[0] - t0 for r in rows], "sm": [r[1] or 0.0 for r in rows],
                                               "mem": [r[2] or 0 for r in rows], "membw": [r[3] or 0.0 for r in rows]},
                                    elapsed=elapsed, gpu=gpu)
        self._provisioned[job.id] = elapsed
        if made is None:  # it has computed nothing yet: looked at again in half a minute, not every tick
            return False
        note = f"provisional, from the first {elapsed:.0f} s of job {job.id}"
        changed = False
        for name in names:
            held = self._provisional.get((job.uid, name))
            if held is not None and held[0] == job.id and profiles.same_figures(held[1], made):
                held[1].note = note  # a steady run: nothing plan() reads changed, no pass is owed (issue 41)
            elif held is None or held[0] == job.id:  # the first running job of a name or family speaks for it
                self._provisional[(job.uid, name)] = (job.id, dataclasses.replace(made, note=note))
                changed = True
        if changed:
            log.info("job %d: a provisional profile from its first %.0f s (peak SM %.0f %%, %s): jobs of its "
                     "family may be placed beside it", job.id, elapsed, made.sm.max() * 100,
                     format_size(int(made.mem.max())))
        return changed

    def _watch_groups(self, running: list[Job], now: float) -> None:
        """Per GPU whose running jobs (two or more) all have a profile (stored, or the provisional
        one they were placed with: a crowd of a family on its first minute is seen within
        LIVE_MIN, not only at an end minutes later, and a level that runs as predicted opens the
        next step at once; docs/sim.md, issue 39, eighth round): the GPU's SM
        activity NVML gives (under MPS no client's own exists) against what their profiles say
        they should show where their predictions put them; taught every LIVE_EVERY seconds once
        LIVE_MIN of it was seen, afresh whenever a job starts or ends there. A group of MPS
        clients teaches its summed bandwidth, one with time-sliced jobs its level of taking
        turns (as `colo sim`'s watch)."""
        devices = {d.uuid: d for d in self.gpus.devices if not d.error}
        groups: dict[str, list[Job]] = {}
        for j in running:
            for u in j.gpus:
                groups.setdefault(u, []).append(j)
        for uuid in list(self._live):
            if uuid not in groups:
                del self._live[uuid]
        for uuid, jobs in groups.items():
            dev = devices.get(uuid)
            ids = tuple(sorted(j.id for j in jobs))
            acc = self._live.get(uuid)
            if acc is not None and acc[0] != ids:  # a start or an end: a new group from now on
                self._teach_live(jobs, acc, now)
                acc = None
            if dev is None or dev.sm_util is None or len(jobs) < 2 or any(j.mode not in (Mode.MPS, Mode.TIMESLICED) for j in jobs):
                self._live.pop(uuid, None)
                continue
            expected, group_bw, now_sm = 0.0, 0.0, []
            for j in jobs:
                prof, (e, _) = self.profile_of(j), self.expect_of(j)
                if prof is None or e is None:
                    self._live.pop(uuid, None)
                    break
                at = min(len(prof.sm) - 1, int(policy.progress(e, now) / prof.step))
                expected += float(prof.sm[at]) / max(float(e["slowdown"]), 1e-9)
                group_bw = max(group_bw, float(e.get("group_bw") or 0.0))
                now_sm.append(float(prof.sm[at]))
            else:
                if acc is None:
                    mode = "mps" if all(j.mode == Mode.MPS for j in jobs) else "timesliced"
                    self._live[uuid] = [ids, now, 0.0, 0.0, group_bw, now, mode, 0.0]
                    continue
                dt = now - acc[5]
                acc[2] += min(1.0, expected) * dt
                acc[3] += min(1.0, dev.sm_util / 100.0) * dt
                # the level of taking turns their profiles put them at, summed over the stretch
                acc[7] += policy.turns_level(now_sm, [j.mode == Mode.MPS for j in jobs]) * dt
                acc[4], acc[5] = max(acc[4], group_bw), now
                if now - acc[1] >= LIVE_EVERY:
                    self._teach_live(jobs, acc, now)
                    del self._live[uuid]

    def _teach_live(self, jobs: list[Job], acc: list, now: float) -> None:
        seconds = acc[5] - acc[1]
        if seconds < learning.LIVE_MIN:
            return
        for uid in {j.uid for j in jobs}:  # each user's own learning: their jobs were in the group
            self._learning(uid, lambda mine: mine.observe_live(acc[6], acc[4], acc[2] / seconds, acc[3] / seconds,
                                                               seconds, acc[7] / seconds))

    def _take_neighbours(self, job_id: int) -> set[str]:
        try:
            return self.store.take_neighbours(job_id)
        except Exception as e:  # noqa: BLE001
            log.warning("could not read who shared a GPU with job %d: %s", job_id, e)
            return {"?"}  # unknown: never read as an uncontended run

    def load(self) -> None:
        """What earlier runs of the daemon learned (at start, once the store is open), each stored
        value checked (stored_learning): one a damaged or hand-edited row holds out of its range is
        refused, said in one line per user, and the rest is used."""
        self.learned = {}
        for uid, got in self.store.learned().items():
            if not isinstance(uid, int) or uid < 0:
                log.warning("learned state of uid %r refused: not a uid", uid)
                continue
            got, refused = stored_learning(got)
            if refused:
                log.warning("learned state of uid %d: %d stored value(s) refused, corrupt or out of range "
                            "(%s%s); the rest is used", uid, len(refused), "; ".join(refused[:3]),
                            "; ..." if len(refused) > 3 else "")
            self.learned[uid] = policy.Learned(**got)
        if self.learned:
            log.info("learned from earlier runs: %d user(s), %d co-run pairing(s), %d profile(s), %d level(s) of "
                     "taking turns", len(self.learned), sum(len(x.corun) for x in self.learned.values()),
                     sum(len(set(x.alone) | set(x.max_mem)) for x in self.learned.values()),
                     sum(len(x.ts) + len(x.ts_slow) for x in self.learned.values()))

    def _learning(self, uid: int, change):
        """Run change(Learned) on `uid`'s learning and store what it changed (most recently changed
        entries last; past LEARNED_MAX the oldest are forgotten, in memory and in the store)."""
        mine = self.learned_for(uid)
        before = (dict(mine.corun), dict(mine.alone), dict(mine.max_mem), list(mine.errors), list(mine.errors_seen))
        bw_before, at_before, clock_before = dict(mine.bw), dict(mine.at), mine.clock
        ts_before, slow_before, live_before = dict(mine.ts), dict(mine.ts_slow), dict(mine.live)
        out = change(mine)
        # an entry whose value or age (Learned.at) moved is stored again, so a restart fades it as now
        moved = {k for k, c in mine.at.items() if at_before.get(k) != c}
        bw = {k: v for k, v in mine.bw.items() if bw_before.get(k) != v or k in moved}  # a few dozen steps at most
        # what running groups showed of taking turns (a few dozen levels at most, kept whole) and the
        # early warnings: stored as they change (a verdict at most every LIVE_EVERY per GPU), not per tick
        ts = (dict(mine.ts), dict(mine.ts_slow)) if (mine.ts, mine.ts_slow) != (ts_before, slow_before) else (None, None)
        live = {k: v for k, v in mine.live.items() if live_before.get(k) != v}
        delta = []
        for now_d, was in zip((mine.corun, mine.alone, mine.max_mem), before[:3]):
            changed = {k: v for k, v in now_d.items() if was.get(k) != v or (now_d is mine.corun and k in moved)}
            for k in changed:  # to the end: dicts keep insertion order, so the oldest come first
                now_d[k] = now_d.pop(k)
            gone = [k for k in was if k not in now_d] + list(now_d)[:max(0, len(now_d) - LEARNED_MAX)]
            for k in gone:
                now_d.pop(k, None)
            delta.append((changed, gone))
        (corun, gone_c), (alone, gone_a), (mem, gone_m) = delta
        errors, added = _errors_delta(before[3], list(mine.errors))
        seen, seen_added = _errors_delta(before[4], list(mine.errors_seen))
        clock = mine.clock if mine.clock != clock_before else None
        if corun or alone or mem or bw or errors is not None or added or seen is not None or seen_added \
                or gone_c or gone_a or gone_m or clock is not None or ts[0] is not None or live:
            try:
                self.store.save_learned(uid, corun=corun, alone=alone, max_mem=mem, errors=errors,
                                        errors_add=added, errors_keep=len(mine.errors), errors_seen=seen,
                                        errors_seen_add=seen_added, errors_seen_keep=len(mine.errors_seen),
                                        forget_corun=gone_c, forget_alone=gone_a, forget_mem=gone_m, bw=bw,
                                        clock=clock, at={k: mine.at[k] for k in (*corun, *bw) if k in mine.at},
                                        ts=ts[0], ts_slow=ts[1], live=live)
            except Exception as e:  # noqa: BLE001 - kept in memory; a later save carries it again
                log.warning("could not store what was learned for uid %d: %s", uid, e)
        return out

    def learned_summary(self, uid: int, name: str) -> dict:
        """What `uid`'s runs taught about profile `name` (for `colo profile show`)."""
        mine = self.learned.get(uid)
        if mine is None:
            return {}
        out: dict = {}
        if name in mine.max_mem:
            out.update(max_mem=mine.max_mem[name], suggested_budget=mine.suggest_budget(name))
        if name in mine.alone:
            out["alone"] = {"runs": mine.alone[name][0], "ratio": mine.alone[name][1]}
        corun = [{"with": nb, "mode": m, "runs": r, "factor": f}
                 for (p, nb, m), (r, f) in mine.corun.items() if p == name]
        if corun:
            out["corun"] = sorted(corun, key=lambda c: (c["with"], c["mode"]))
        if out or mine.errors:
            out.update(errors=len(mine.errors), margin=mine.margin(self.cfg.margin),
                       seen_errors=len(mine.errors_seen), seen_margin=mine.seen_margin(self.cfg.margin))
        return out

    def _observe(self, job: Job, rows: list, neighbours: list[str]) -> None:
        """Predicted vs observed, into self.learned and the job's stored decision."""
        prof = self.profile_of(job)
        dec = self.store.decision(job.id)
        if prof is None or prof.provisional or dec is None or dec.get("action") != "start" or not job.started_at or not job.ended_at:
            return
        details = dict(dec.get("details") or {})
        wall = job.ended_at - job.started_at
        peak = max((r[2] or 0 for r in rows), default=0)
        # what its start predicted, and the starts beside it later (policy.joined): the one rule
        # colo sim applies too (learning.end_of_job)
        residual = self._learning(job.uid, lambda mine: learning.end_of_job(
            mine, self.profile_name(job), neighbours, job.mode, dec, job.started_at, job.ended_at, prof.runtime, peak))
        mine = self.learned_for(job.uid)
        details.update(observed_slowdown=wall / prof.runtime, profile_runtime=prof.runtime, shared_with=neighbours,
                       observed_vs_predicted=residual, suggested_budget=mine.suggest_budget(self.profile_name(job)))
        try:
            self.store.record_decisions([(job.id, dec["action"], dec.get("mode"), dec.get("gpus") or [],
                                          dec.get("reason") or "", details)])
        except Exception as e:  # noqa: BLE001 - an observation is worth less than the job's end
            log.warning("could not store what job %d did against its prediction: %s", job.id, e)
