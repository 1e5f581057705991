"""What `colo ls` and `colo top` are sent: each job's summary and ls's compact rows, with the
caches that keep a listing of 10,000 jobs from re-encoding them, and the GPUs' rows.

Built from the parts it reads (the job table, the store, the scheduler's decisions, the GPUs, the
patrol's and the sampler's word on running jobs); it changes none of them. The shape of a summary
and of `top`'s reply is declared in colo/replies.py, which the client reads too.
"""
from __future__ import annotations

import heapq
import json
import logging
import os
import pwd
import time
from collections import Counter
from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from ..jobs import ACTIVE, TERMINAL, Job, State
from ..replies import GpusReply, JobSummary
from . import lsrows, validate
from .lsrows import Kept
from .slices import CHEAP, Clock, Pieces, chunks, taken

if TYPE_CHECKING:
    from ..config import Config
    from ..store import Store
    from .gpus import Gpus
    from .jobtable import JobTable
    from .patrol import Patrol
    from .sampler import Sampler
    from .scheduler import Scheduler
    from .suspend import Suspender

TOPENDED, TOPENDED_FOR = 5, 300.0  # `colo top` shows the newest 5 ended jobs, for 5 minutes after their end
TOP_QUEUED = 500  # and the front of the queue (a terminal shows less); the number queued apart
ROWS_CACHED = 20000  # job summaries (`ls --json`, top) kept encoded
# A row longer than this (a long command, uncut) is made afresh at each listing, never kept: kept,
# one user's 1,000-task array of a 60 KiB command held 70 MB of rows after one `ls --json`.
ROW_KEPT_MAX = 4096
log = logging.getLogger("colo")


class Listing:
    """Owns the listing caches: encoded summaries of queued and ended jobs, ls's rows per kind of
    listing, the queue's rows as of the last change of a queued job or decision."""

    def __init__(self, config: "Config", table: "JobTable", store: "Store", scheduler: "Scheduler", gpus: "Gpus",
                 patrol: "Patrol", sampler: "Sampler", suspender: "Suspender",
                 session_note: Callable[[int], str | None] = lambda _: None):
        self.config, self.table, self.store, self.scheduler = config, table, store, scheduler
        self.gpus, self.patrol, self.sampler, self.suspender = gpus, patrol, sampler, suspender
        self.session_note = session_note  # a detached session's "attached" or "detached" (detach.py)
        # each job's summary as JSON with the Job and reason it was made from: a queued or ended
        # job's row changes only with the job or its reason, so `ls` of 10,000 re-encodes none
        self._rows = Kept()
        # the same for ls's compact rows of queued jobs, per (fields, cut) asked for (_queued_rows);
        # an ended job's never changes (_ended_rows)
        self._ls_rows: dict[tuple, Kept] = {}
        self._ls_ended: dict[tuple, dict[int, bytes]] = {}
        # the queue's ls rows per kind of listing, as of (_queue_version, the scheduler's version):
        # (the ids, the rows), by id
        self._blocks: dict[tuple, tuple[tuple, tuple[list[int], list[bytes]]]] = {}
        self._queue_version = 0  # any queued job added, changed or gone (queue_changed)
        # The queued jobs as the collapsed `colo ls` lists them, kept as the queue changes
        # (queue_changed): the ids of those in no array, and each array's queued tasks (job id ->
        # array index). Its rows are made from these when the queue changed since they were last
        # made: 50 arrays of 1,000 tasks are 50 looks, not a walk over 50,000 jobs (~30 ms).
        self._singles: dict[int, None] = {}
        self._tasks: dict[int, dict[int, int]] = {}
        self._index()

    def summary(self, job: Job, reasons: dict[int, str] | None = None) -> JobSummary:
        out: JobSummary = {
            "id": job.id, "name": job.spec.name, "held_by": job.held_by if job.state == State.QUEUED else None, "user": job.user, "uid": job.uid, "state": str(job.state),
            "paused_by": job.paused_by if job.state == State.RUNNING else None,
            "suspended": self.suspender.note(job.id),  # colo suspend: what it holds in host memory
            "gpus": job.gpus, "gpu_index": self._indices(job.gpus), "mode": self.mode(job), "budget": job.spec.gpu_mem,
            "ngpus": job.spec.gpus, "image": job.spec.image, "argv": job.spec.argv,
            "submitted_at": job.submitted_at, "started_at": job.started_at, "ended_at": job.ended_at,
            "exit_code": job.exit_code, "priority": job.spec.priority, "reason": job.reason,
            "cancel_by": job.cancel_by if job.state in ACTIVE else None,
            "slurm_job": job.spec.slurm_job,
            "array_job": job.spec.array_job, "array_index": job.spec.array_index,
        }
        out["reason"] = self.reason(job, reasons.get(job.id) if reasons is not None else None)
        if job.state in ACTIVE:
            u = self.sampler.stats.get(job.id) or self.sampler.usage(job)  # the sampler's, or read now
            if u:
                out["used"] = u.get("used")
                out["refused"] = u.get("refused")
                out["sm_util"] = u.get("sm_util")
                out["nvml_used"] = u.get("nvml_used")  # its processes, as NVML sees them (the patrol)
                out["idle_since"] = u.get("idle_since")  # holding GPU memory with no GPU activity since (idle_after)
        return out

    def _indices(self, uuids: list[str]) -> list[int | None]:
        """GPUs by index, as `colo gpus` numbers them (None: one no longer here)."""
        if not uuids:
            return []
        index = {g.uuid: g.index for g in self.gpus.devices}
        return [index.get(u) for u in uuids]

    def gpus_text(self, uuids: list[str]) -> str:
        """ls's GPU column: indices (a UUID's start for a GPU no longer here)."""
        return ",".join(u[:12] if i is None else str(i) for i, u in zip(self._indices(uuids), uuids))

    def mode(self, job: Job) -> str | None:
        return self.table.mode_shown(job, {f["gpu"] for f in self.patrol.foreign})

    def reason(self, job: Job, decided: str | None = None) -> str:
        """The reason listings show: a queued job's latest decision (`decided`) unless it is held, a
        running job's with what the patrol says of it, or who paused it."""
        if job.state == State.QUEUED:
            if job.held_by:  # said at once, before a pass has looked at it
                return validate.stopped_text(job.user, job.held_by, "held", f"colo release {job.id}")
            return job.reason if decided is None else decided
        if job.state == State.RUNNING and job.paused_by:
            return validate.stopped_text(job.user, job.paused_by, "paused", f"colo resume {job.id}")
        if job.state == State.RUNNING and (note := self.suspender.note(job.id)):
            return note
        notes = [n for n in (self.session_note(job.id), self.patrol.note(job.id), self.sampler.idle_note(job.id)) if n] \
            if job.state in ACTIVE else []
        return "; ".join([job.reason, *notes])

    def reasons(self, jobs: list[Job]) -> dict[int, str]:
        """Why each queued job waits: the scheduler's latest word."""
        out = {}
        for j in jobs:
            if j.state == State.QUEUED:
                d = self.scheduler.decisions.get(j.id)
                if d is not None:
                    out[j.id] = d.reason
        return out

    def ls(self, args: dict) -> Pieces:
        """Jobs oldest first: those in `states` (default: every job with `all`, else the queued and
        running ones) of `users` named one of `names` that one of `refs` names (ids, names, arrays'
        ids, ARRAY_INDEX); only the newest `limit`. Open jobs are the daemon's own (with live
        reasons), ended ones are read with the filters in SQL.

        Without `fields`: each job's summary (`colo ls --json`). With `fields` (protocol.LS_FIELDS):
        {"fields", "rows": each job's fields in a list, "left": {state: jobs not sent}}, made to be cheap
        to send and read: times in whole seconds, gpus as one comma-separated text, argv as one line,
        texts cut to `cut` characters; with `head` (a terminal's bound; not with `limit`), at most that many jobs:
        every starting and running one, then queued ones from the front, then the newest ended.

        What it lists is taken here, in one step: the open jobs and the scheduler's decisions (both
        replaced as they change, never changed in place), the ended jobs the store holds, the active
        jobs' rows with their live figures. The queued jobs' rows, the rest of the work, are made from
        that in slices with the loop free between them (slices.py), and sent as they are made."""
        users = set(args["users"]) if args.get("users") is not None else None
        names = set(args["names"]) if args.get("names") is not None else None
        if args.get("states") is not None:
            want = set(args["states"])
        else:
            want = set(_ALL_STATES) if args.get("all", True) else {"queued", "starting", "running"}
        limit = args.get("limit") or None
        head = None if limit else args.get("head") or None
        ended = [State(s) for s in want & ENDED]
        refs = args.get("refs")
        # which open jobs refs name: asked of the store, which holds the one rule (Store._where)
        named = None if refs is None else {r[0] for r in self.store.listing(["id"], _OPEN, refs=refs)}
        fields, cut, collapse = args.get("fields"), args.get("cut") or None, args.get("tasks") is False
        clock = Clock()
        queued = "queued" in want
        common = fields is not None and users is None and names is None and named is None and queued
        stamp = (self._queue_version, self.scheduler.version)
        key = (tuple(fields or ()), cut, collapse)
        hit = self._blocks.get(key) if common else None
        block = hit[1] if hit is not None and hit[0] == stamp else None
        # the snapshot (no await before it is whole) --------------------------------------------
        # The queue and its decisions are copied only where they are walked: not for the queue's
        # rows kept as of now (`block`), nor where no queued job is asked for (copying 50,000 of
        # each was most of a `colo ls` that sends 600 rows: ~4 ms of the loop's time).
        walk = queued and block is None
        # the common collapsed listing made afresh: its few rows' jobs from the index, only their
        # decisions copied
        few = self._collapsed() if walk and common and collapse else None
        if few is not None:
            jobs, decided = few[0], self.scheduler.decisions
            decisions = {j.id: d for j in jobs if (d := decided.get(j.id)) is not None}
        else:
            jobs = list(self.table.open.values()) if walk else []
            decisions = dict(self.scheduler.decisions) if walk else {}
        act = [j for j in self.table.active(*ACTIVE) if j.state._value_ in want and (users is None or j.user in users)
               and (names is None or j.spec.name in names) and (named is None or j.id in named)]

        def picked(part) -> list[Job]:  # the queued jobs of `part` that the filters pass
            # State is a str enum whose hash is a Python call: its _value_ (the plain str) is compared
            return [j for j in part if j.state._value_ == "queued" and (users is None or j.user in users)
                    and (names is None or j.spec.name in names) and (named is None or j.id in named)]

        if fields is None:
            pre = {j.id: self._summary_row(j) for j in act}  # live figures: as of now
            past = self._ended_jobs(ended, users, names, limit, refs) if ended else []
            return Pieces(self._json_parts(jobs, picked, act, pre, past, decisions, limit, clock), clock)
        act_rows = self._live_rows(act, fields, cut)
        past, more, n_ended = [], [], {}
        if ended:
            past = self.store.listing(["id", "state"], ended, users, names, limit or head, refs)
            more = self._ended_rows(past, fields, cut)
            if head and len(past) == head:  # more may be stored: how many, for `left`
                n_ended = self.store.listing_counts(ended, users, names, refs)
        return Pieces(self._field_parts(jobs, picked, block, common and stamp, act_rows, more,
                                        decisions, fields, cut, collapse, limit, head, n_ended, clock,
                                        few and few[1]), clock)

    def _summary_row(self, j: Job, decisions: dict | None = None, cache: Kept | None = None) -> bytes:
        """One job's summary as `ls --json` and `top` send it (`cache`: the kept rows of jobs not
        running: a queued or ended job's changes only with the job or its reason)."""
        if j.state in ACTIVE:  # live figures: made afresh
            return json.dumps(self.summary(j), separators=(",", ":"), default=str).encode()
        cache = self._rows if cache is None else cache
        d = (self.scheduler.decisions if decisions is None else decisions).get(j.id) \
            if j.state == State.QUEUED else None
        reason = d.reason if d is not None else None
        row = cache.row.get(j.id)
        if row is None or cache.why[j.id] != reason or ((was := cache.job[j.id]) is not j
                                                         and (j.state not in TERMINAL or was.state != j.state)):
            row = json.dumps(self.summary(j, {j.id: reason} if reason is not None else None),
                             separators=(",", ":"), default=str).encode()
            if len(row) <= ROW_KEPT_MAX and (len(cache.row) < ROWS_CACHED or j.id in cache.row):  # bounded: `ls --json` of 50,000 is rare
                cache.put(j, reason, row)
        return row

    async def _queued(self, jobs: list[Job], picked, clock: Clock) -> list[Job]:
        """The queued jobs of the snapshot `jobs` that `picked` keeps, by id."""
        out: list[Job] = []
        last, ordered = 0, True
        async for part in chunks(jobs, clock, CHEAP):
            got = picked(part)
            if got and ordered:
                ids = [j.id for j in got]
                ordered = ids[0] > last and ids == sorted(ids)
                last = ids[-1]
            out += got
        if not ordered:  # (the table's order is the ids' but for a job re-filed: rare)
            out.sort(key=attrgetter("id"))
        return out

    async def _json_parts(self, jobs: list[Job], picked, act: list[Job], pre: dict[int, bytes], past: list[Job],
                          decisions: dict, limit: int | None, clock: Clock) -> AsyncIterator[bytes]:
        """`ls --json`'s array, a slice at a time: the queued jobs' summaries (kept ones as kept)
        between the active ones made at the snapshot (`pre`) and the ended ones read then (`past`)."""
        live = lsrows.merged(await self._queued(jobs, picked, clock), act, attrgetter("id"))
        if past:
            merged: list[Job] = []
            async for part in taken(heapq.merge(live, past, key=attrgetter("id")), clock, CHEAP):
                merged += part
            live = merged
        if limit:
            live = live[-limit:]
        cache, sep = self._rows, b"["
        async for part in chunks(live, clock):
            yield sep + b",".join([pre[j.id] if j.id in pre else self._summary_row(j, decisions, cache) for j in part])
            sep = b","
        yield b"[]" if sep == b"[" else b"]"
        if len(cache.row) > 2 * len(self.table.open) + 20000:  # rows of jobs gone from every listing
            self._rows = cache.only({j.id for j in live})

    async def _field_parts(self, jobs: list[Job], picked, block: tuple | None, stamp, act_rows: list, more: list,
                           decisions: dict, fields: list[str], cut: int | None, collapse: bool, limit: int | None,
                           head: int | None, n_ended: dict[str, int], clock: Clock,
                           spans: dict[int, list[int]] | None = None) -> AsyncIterator[bytes]:
        """ls's {"fields", "left", "rows"}, a slice at a time. `block`: the queue's rows as kept,
        still current at the snapshot; else they are made, and kept as of `stamp` (the common
        `colo ls`: no filter but states). `spans`: `jobs` are the collapsed queue already (_collapsed)."""
        if block is None:
            if spans is None:
                jobs, spans = await self._queued(jobs, picked, clock), None
                if collapse:
                    jobs, spans = await _collapse(jobs, clock)
            block, big = await self._rows_of(jobs, fields, cut, spans, decisions, clock)
            if stamp:
                self._keep_block((tuple(fields), cut, collapse), stamp, None if big else block)
        ids, queue = block
        sep = _encode({"fields": fields, "left": {}})[:-1] + b',"rows":['
        if not (more or limit or head):  # the common `colo ls`: the queue's rows as they are, the active ones put in
            async for part in chunks(lsrows.spliced(ids, queue, act_rows), clock, CHEAP):
                yield sep + b",".join(part)
                sep = b","
            yield sep + b"]}" if sep != b"," else b"]}"
            return
        # (id, state, row) a job, made for this reply only: let go when it ends (Kept's docstring)
        rows: list[tuple] = []
        async for part in chunks(range(len(ids)), clock, CHEAP):
            rows += [(ids[k], "queued", queue[k]) for k in part]
        rows = lsrows.merged(rows, act_rows)
        if more:
            if rows and more[0][0] < rows[-1][0]:
                merged: list[tuple] = []
                async for part in taken(heapq.merge(rows, more, key=itemgetter(0)), clock, CHEAP):
                    merged += part
                rows = merged
            else:
                rows = [*rows, *more]
        if limit:
            rows = rows[-limit:]
        left: dict[str, int] = {}
        if head and (len(rows) > head or n_ended):
            rows, left = await _bounded(rows, head, n_ended, clock)
        sep = _encode({"fields": fields, "left": left})[:-1] + b',"rows":['
        async for part in chunks(rows, clock, CHEAP):
            yield sep + b",".join([r[2] for r in part])
            sep = b","
        yield sep + b"]}" if sep != b"," else b"]}"

    def _keep_block(self, key: tuple, stamp: tuple, rows: tuple | None) -> None:
        """The queue's rows for a kind of listing, as of `stamp` (_queue_version, the scheduler's
        version when the snapshot they were made from was taken): `colo ls` of 50,000 then walks
        none while no queued job and no decision changed. Never changed once kept: a reply being
        sent may be reading it. None: rows too long to keep (ROW_KEPT_MAX)."""
        self._blocks.pop(key, None)
        if rows is None:
            return
        while len(self._blocks) >= 4:  # the kinds of listing asked for lately
            self._blocks.pop(next(iter(self._blocks)))
        self._blocks[key] = (stamp, rows)

    def queue_changed(self, prev: Job | None, job: Job) -> None:
        """The table's on_change and on_edit (wired in core.open())."""
        was, now = prev is not None and prev.state == State.QUEUED, job.state == State.QUEUED
        if was or now:
            self._queue_version += 1
        if was:
            self._unfile(prev)
        if now:
            self._file(job)

    def _file(self, job: Job) -> None:
        a = job.spec.array_job
        if a is None:
            self._singles[job.id] = None
        else:
            self._tasks.setdefault(a, {})[job.id] = job.spec.array_index

    def _unfile(self, job: Job) -> None:
        a = job.spec.array_job
        if a is None:
            self._singles.pop(job.id, None)
        elif (tasks := self._tasks.get(a)) is not None:
            tasks.pop(job.id, None)
            if not tasks:
                del self._tasks[a]

    def _collapsed(self) -> tuple[list[Job], dict[int, list[int]]] | None:
        """The queue as the collapsed listing shows it, from the index (no walk): the queued jobs in
        no array and each array's first queued task, by id; each such task's id -> its array's
        queued indices, sorted. None where the index and the table disagree (never expected: the
        listing then walks the queue, as every filtered one does)."""
        open_jobs = self.table.open
        out, spans = [], {}
        for i in self._singles:
            j = open_jobs.get(i)
            if j is None or j.state._value_ != "queued":
                return self._astray(i)
            out.append(j)
        for tasks in self._tasks.values():
            head = min(tasks)
            j = open_jobs.get(head)
            if j is None or j.state._value_ != "queued":
                return self._astray(head)
            out.append(j)
            spans[head] = sorted(tasks.values())
        out.sort(key=attrgetter("id"))
        return out, spans

    def _index(self) -> None:
        """The queue's index made from the table, whole."""
        self._singles, self._tasks = {}, {}
        for j in self.table.open.values():
            if j.state == State.QUEUED:
                self._file(j)

    def _astray(self, job_id: int) -> None:
        log.warning("listing: job %d is in the queue's index but not queued; the index is made again", job_id)
        self._index()
        return None

    async def _rows_of(self, queued: list[Job], fields: list[str], cut: int | None, spans: dict[int, list[int]] | None,
                       decisions: dict, clock: Clock) -> tuple[tuple[list[int], list[bytes]], bool]:
        """_queued_rows of queued jobs, in slices, as (their ids, their rows), and whether any row is
        longer than ROW_KEPT_MAX. spans: the queued tasks of an array as one row, its first's (job id
        -> the array's queued indices, sorted), whose id (and ARRAY_INDEX) says which, as squeue shows
        them: 12_[3-9,11]."""
        ids: list[int] = []
        out: list[bytes] = []
        big = False
        async for part in chunks(queued, clock):
            made = self._queued_rows(part, fields, cut, decisions)
            big = big or any(len(r) > ROW_KEPT_MAX for r in made)
            ids += [j.id for j in part]
            out += made
        if not spans:
            return (ids, out), big
        jobs = {j.id: j for j in queued if j.id in spans}
        for k, i in enumerate(ids):
            g = spans.get(i)
            if g is not None and len(g) > 1:
                j = jobs[i]
                text = f"{j.spec.array_job}_[{lsrows.ranges(g)}]"
                why = decisions.get(i)
                out[k] = _encode([text if f in ("id", "array") else v for f, v in
                                  zip(fields, self._row(j, fields, cut, why and why.reason))])
        return (ids, out), big

    def _live_rows(self, jobs: list[Job], fields: list[str], cut: int | None) -> list[tuple[int, str, bytes]]:
        """(id, state, the row ls sends, encoded) of active jobs: made afresh (live figures)."""
        return [(j.id, j.state._value_, _encode(self._row(j, fields, cut))) for j in jobs]

    def _queued_rows(self, jobs: list[Job], fields: list[str], cut: int | None, decisions: dict) -> list[bytes]:
        """The rows ls sends of queued jobs, encoded. A queued job's row changes only with the job (a
        new Job) or the reason it waits (in `decisions`): kept, so that `ls` of 10,000 encodes few."""
        if fields == ["id"]:  # `colo ls -q`: nothing to keep
            return [b"[%d]" % j.id for j in jobs]
        key = (tuple(fields), cut)
        cache = self._ls_rows.pop(key, None)
        if cache is None:
            cache = Kept()
            while len(self._ls_rows) >= 4:  # each kind of listing asked for lately (-q, the default, ...)
                self._ls_rows.pop(next(iter(self._ls_rows)))
        self._ls_rows[key] = cache  # the newest last
        out = []
        rows, made, whys = cache.row, cache.job, cache.why
        for j in jobs:
            dec = decisions.get(j.id)
            why = None if dec is None else dec.reason
            row = rows.get(j.id)
            if row is None or made[j.id] is not j or whys[j.id] != why:
                row = _encode(self._row(j, fields, cut, why))
                if len(row) <= ROW_KEPT_MAX:
                    cache.put(j, why, row)
            out.append(row)
        if len(rows) > len(self.table.open) + 1000:  # rows of jobs no longer queued
            self._ls_rows[key] = cache.only(self.table.open)
        return out

    def _ended_jobs(self, ended: list[State], users, names, limit: int | None, refs) -> list[Job]:
        """Stored ended jobs for ls's filters. An ended job never changes: those whose summary rows()
        holds are not read again."""
        ids = [r[0] for r in self.store.listing(["id"], ended, users, names, limit, refs)]
        kept = self._rows.job
        miss = [i for i in ids if (j := kept.get(i)) is None or j.state not in TERMINAL]
        got = {j.id: j for j in self.store.jobs_by_id(miss)} if miss else {}
        return [got[i] if i in got else kept[i] for i in ids]

    def _ended_rows(self, past: list[tuple[int, str]], fields: list[str], cut: int | None) -> list[tuple]:
        """(id, state, the row ls sends, encoded) of the stored ended jobs `past` (id, state); an ended
        job's row never changes: kept (up to 100,000 a kind of listing), only the others are read."""
        key = (tuple(fields), cut)
        cache = self._ls_ended.pop(key, None)
        if cache is None or len(cache) > 100_000:
            cache = {}
            while len(self._ls_ended) >= 4:
                self._ls_ended.pop(next(iter(self._ls_ended)))
        self._ls_ended[key] = cache
        miss = [i for i, _ in past if i not in cache]
        if miss:
            index = {g.uuid: g.index for g in self.gpus.devices}
            big = {}
            for r in self.store.listing_by_id(["id", *fields], miss):
                row = _encode(_as_sent(r[1:], fields, cut, index))
                (cache if len(row) <= ROW_KEPT_MAX else big)[r[0]] = row
            return [(i, st, cache[i] if i in cache else big[i]) for i, st in past]
        return [(i, st, cache[i]) for i, st in past]

    def _row(self, j: Job, fields: list[str], cut: int | None, why: str | None = None) -> list:
        """One open job's `fields` as ls sends them (see ls): its GPUs by index, a lone time-sliced
        job "exclusive", a paused one's state "paused"."""
        out = []
        for f in fields:
            if f == "reason":
                out.append(self.reason(j, why)[:cut])
            elif f == "argv":
                out.append(" ".join(j.spec.argv)[:cut])
            elif f == "gpus":
                out.append(self.gpus_text(j.gpus))
            elif f == "mode":
                out.append(self.mode(j))
            elif f == "state" and j.paused_by and j.state == State.RUNNING:
                out.append("paused")
            elif f == "state" and j.suspended and j.state == State.RUNNING:
                out.append("suspended")
            else:
                out.append(_LIVE[f](j))
        return out

    def gpu_rows(self) -> GpusReply:
        """Each GPU with what is placed on it (op `gpus`, and `top`'s)."""
        active = self.table.jobs_in(*ACTIVE)
        views = {v.uuid: v for v in self.gpus.views()}
        out = []
        for g in self.gpus.devices:
            placed = [j for j in active if g.uuid in j.gpus]
            out.append({**g.to_dict(), "usable": views[g.uuid].usable, "mps": views[g.uuid].mps,
                        "drained": views[g.uuid].drained,  # colo drain: "drained by root: driver update"
                        "budgeted": sum(j.spec.gpu_mem for j in placed), "jobs": [j.id for j in placed],
                        # held outside any budget (processes of no job, jobs past their budgets): not given out
                        "unbudgeted": self.gpus.unbudgeted.get(g.uuid, 0),
                        "over": [j.id for j in placed if j.id in self.patrol.over]})
        return {"gpus": out, "error": self.gpus.error, "fake": self.config.fakegpu_state is not None}

    def top(self, you: str) -> Pieces:
        """Everything `colo top` shows, in one snapshot (a replies.TopReply, encoded): taken in one
        step as `ls` is (the GPUs, the open jobs and decisions, the active jobs' rows, the newest
        ended jobs); the front of the queue is picked from it, and its rows made, in slices."""
        clock = Clock()
        gpus = self.gpu_rows()
        jobs = list(self.table.open.values())
        decisions = dict(self.scheduler.decisions)
        act = self.table.active(*ACTIVE)
        pre = {j.id: self._summary_row(j) for j in act}  # live figures: as of now
        # ended jobs only briefly, the last few: the panel is for what runs (history: colo history)
        recent = [j for j in self.store.jobs(TERMINAL, limit=TOPENDED, newest_first=True)
                  if (j.ended_at or 0) > time.time() - TOPENDED_FOR]
        # processes of no job, as the patrol mapped them at the last sample (colo's MPS servers excluded)
        foreign = [{"gpu": f["gpu"], "pid": f["pid"], "used": f["used"], "command": _cmd(f["pid"]),
                    "user": _user(f["pid"])} for f in self.patrol.foreign]
        head = json.dumps({"at": time.time(), "gpus": gpus["gpus"], "gpu_error": gpus["error"], "fake": gpus["fake"],
                           "foreign": foreign, "you": you, "queued": self.scheduler.queued_total()},
                          separators=(",", ":"), default=str).encode()
        return Pieces(self._top_parts(head, jobs, act, pre, recent, decisions, clock), clock)

    async def _top_parts(self, head: bytes, jobs: list[Job], act: list[Job], pre: dict[int, bytes], recent: list[Job],
                         decisions: dict, clock: Clock) -> AsyncIterator[bytes]:
        """`top`'s reply: the running jobs, and the front of the queue as `colo top` shows it (its
        total apart), by id; then the recent ended ones."""
        front: list[Job] = []
        async for part in chunks(jobs, clock, CHEAP):
            front = heapq.nsmallest(TOP_QUEUED, [*front, *(j for j in part if j.state._value_ == "queued")],
                                    key=_queue_order)
        live = sorted(act + front, key=attrgetter("id"))
        cache, rows = self._rows, []
        async for part in chunks(live + recent, clock):
            rows += [pre[j.id] if j.id in pre else self._summary_row(j, decisions, cache) for j in part]
        yield head[:-1] + b',"jobs":[' + b",".join(rows) + b"]}"


def _queue_order(j: Job) -> tuple:
    """The queue's order as `colo top` shows it: priority, then age."""
    return (-j.spec.priority, j.submitted_at, j.id)


def _as_sent(r: tuple, fields: list[str], cut: int | None, index: dict[str, int]) -> list:
    """A stored job's fields (Store.listing) as ls sends them (see ls); GPUs by `index`."""
    out = list(r)
    for k, f in enumerate(fields):
        v = out[k]
        if f == "argv":
            out[k] = " ".join(v)[:cut]
        elif f == "gpus":
            out[k] = ",".join(str(index[u]) if u in index else u[:12] for u in v)
        elif f == "reason":
            out[k] = v[:cut]
        elif f.endswith("_at") and v is not None:
            out[k] = int(v)
    return out


async def _collapse(queued: list[Job], clock: Clock) -> tuple[list[Job], dict[int, list[int]]]:
    """Queued jobs (by id) as the collapsed listing shows them, walked: those in no array and each
    array's first task; that task's id -> its array's indices, sorted (Listing._collapsed, from
    the index, is the same without the walk)."""
    groups: dict[int, list[int]] = {}
    heads: dict[int, int] = {}
    kept: list[Job] = []
    async for part in chunks(queued, clock, CHEAP):
        for j in part:
            a = j.spec.array_job
            if a is not None:
                g = groups.get(a)
                if g is not None:
                    g.append(j.spec.array_index)
                    continue
                groups[a] = [j.spec.array_index]
                heads[j.id] = a
            kept.append(j)
    return kept, {i: sorted(groups[a]) for i, a in heads.items()}


def _encode(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


async def _bounded(rows: list[tuple[int, str, bytes]], head: int, n_ended: dict[str, int],
                   clock: Clock) -> tuple[list, dict[str, int]]:
    """At most `head` of ls's (id, state, row) rows: the starting and running ones, then queued
    ones from the front, then the newest ended ones; and how many of each state were left out
    (`n_ended`: how many ended jobs matched, where more did than were read). In slices."""
    active: list[tuple] = []
    front: list[tuple] = []
    last: list[tuple] = []
    left: Counter = Counter()
    async for part in chunks(rows, clock, CHEAP):
        left.update(map(itemgetter(1), part))
        active += [r for r in part if r[1] == "starting" or r[1] == "running"]
        if len(front) < head:
            front += [r for r in part if r[1] == "queued"][:head - len(front)]
        last = [*last, *[r for r in part if r[1] in ENDED]][-head:]
    keep = active[:head]
    keep += front[:head - len(keep)]
    room = head - len(keep)
    keep += last[-room:] if room else []
    for st, n in n_ended.items():
        left[st] = n
    left.subtract(r[1] for r in keep)
    keep.sort(key=itemgetter(0))
    return keep, {k: v for k, v in left.items() if v > 0}


# What ls sends of an open job, by field (reason, argv, gpus, mode and a paused job's state: Api._row)
_LIVE = {
    "id": lambda j: j.id, "name": lambda j: j.spec.name, "user": lambda j: j.user, "state": lambda j: j.state._value_,
    "budget": lambda j: j.spec.gpu_mem, "submitted_at": lambda j: int(j.submitted_at),
    "started_at": lambda j: j.started_at and int(j.started_at), "ended_at": lambda j: j.ended_at and int(j.ended_at),
    "exit_code": lambda j: j.exit_code, "priority": lambda j: j.spec.priority, "array": lambda j: j.spec.array_ref,
}
_ALL_STATES = frozenset(s.value for s in State)
_OPEN = (State.QUEUED, *ACTIVE)
ENDED = frozenset(s.value for s in TERMINAL)


def _cmd(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:80]
    except OSError:
        return "?"


def _user(pid: int) -> str:
    try:
        return pwd.getpwuid(os.stat(f"/proc/{pid}").st_uid).pw_name
    except (OSError, KeyError):
        return "?"

