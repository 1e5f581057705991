"""Removing ended jobs: `colo clean` (as pueue's clean) and, with `history_keep_days`, the
daemon's own purge of jobs that ended that long ago (as Slurm's PurgeJobAfter).

What goes: a job's row, events, decision, usage samples and neighbours (colo/store/
remove_jobs), its log files in the root-only `logs/` and any run folder left in `jobs/`. What
stays: profiles (files per user) and what was learned (per user and profile, never per job);
a removed job's GPU use goes on counting for fair share while it would (cleaned_use).

Never removed, whatever was asked: an open job; a task of an array that has tasks not ended (so
that the array's id keeps naming all of them for wait, cancel, hold); an ended job a queued job of
the same user depends on (`--after` and the like), so a dependency is never judged on a job that
is no longer known. A queued job of another user never keeps it (it could keep her from removing
her own history for as long as he liked): that one then fails, its dependency no longer existing.
A submit naming a removed job with `--after` is refused as for an unknown job.

Work goes in batches with the loop free in between: a purge of months of history never holds
up a submit for long.

Owns nothing that lasts: it asks the job table (open jobs, their dependencies and arrays) and the
launcher (jobs it still follows, containers still to be removed) what must stay, and wakes the
scheduler when it removed a job another user's queued job depended on.
"""
from __future__ import annotations

import asyncio
import logging
import os
import shutil
import stat
import time
from pathlib import Path
from typing import Callable, Iterable

from ..config import Config
from ..jobs import TERMINAL, State
from ..store import NotFound
from .jobtable import JobTable
from .launcher import Launcher

log = logging.getLogger("colo")

PURGE_EVERY = 300.0  # seconds between the daemon's purges (history_keep_days)
BATCH = 100  # jobs removed in one transaction
SAMPLES_AT_ONCE = 1000  # usage samples removed in one transaction (a long job has many)
# What a job leaves in logs/: its output, when colo saw it grow (logtimes), the Docker follower's
# cursor (and its temporary file). Names made here from the job's id, never read from the folder.
LOG_SUFFIXES = (".log", ".times", ".cursor", ".cursor.tmp")


class Retention:
    def __init__(self, config: Config, table: JobTable, launcher: Launcher, wake: Callable[..., None]):
        self.config = config
        self.table = table
        self.store = table.store
        self.launcher = launcher
        self.wake = wake  # the scheduler's: another user's queued job may have just lost its dependency

    def kept_now(self) -> tuple[dict[int, dict[int, int]], set[int], set[int]]:
        """(ended job -> {uid: an open job of that user that depends on it}, arrays with a task not
        ended, ended jobs whose container is still to be removed)."""
        deps: dict[int, dict[int, int]] = {}
        arrays: set[int] = set()
        # an ended job whose container the engine has not let colo remove yet: its removal drains
        # the rest of its output into its log (Removals.retry_removals), which would come back
        containers = self.launcher.removals.removing()
        for j in self.table.open.values():
            s = j.spec
            if s.after or s.after_any or s.after_fail:
                for a in (*s.after, *s.after_any, *s.after_fail):
                    deps.setdefault(a, {}).setdefault(j.uid, j.id)
            if s.array_job:
                arrays.add(s.array_job)
        return deps, arrays, containers

    def why_kept(self, job_id: int, array_job: int | None,
                 kept: tuple[dict[int, dict[int, int]], set[int], set[int]]) -> str | None:
        deps, arrays, containers = kept
        if job_id in self.table.open or job_id in self.launcher.live:
            return f"job {job_id} has not ended"
        if array_job and array_job in arrays:
            return (f"job {job_id} is a task of array {array_job}, which has tasks not ended yet: "
                    "clean them once all have ended")
        if job_id in containers:
            return (f"job {job_id}'s container is not removed yet (the engine refused it; tried again on a backoff): "
                    "clean it once it is")
        if job_id in deps:
            try:
                by = deps[job_id].get(self.store.get(job_id).uid)  # its own user's job only
            except NotFound:
                by = None
            if by is not None:
                return f"queued job {by} depends on job {job_id}: clean it once job {by} has started or ended"
        return None

    async def remove_ended(self, jobs: Iterable[tuple[int, int | None]]) -> tuple[int, int]:
        """Remove the ended jobs (id, array id) that may go (why_kept, checked again just before
        each batch: the loop ran in between); (removed, kept)."""
        jobs = list(jobs)
        removed = kept = 0
        keep_use_since = time.time() - 20 * self.config.fair_share_half_life  # older use counts < 1e-6
        for k in range(0, len(jobs), BATCH):
            now = self.kept_now()
            part = [(i, a) for i, a in jobs[k:k + BATCH] if self.why_kept(i, a, now) is None]
            while self.store.remove_samples([i for i, _ in part], SAMPLES_AT_ONCE) >= SAMPLES_AT_ONCE:
                await asyncio.sleep(0)  # the loop serves others between pieces
            # Files first: a daemon killed in between leaves rows that the next clean removes, never
            # files that no row names any more (ids are not handed out again: they would stay for good).
            await asyncio.to_thread(remove_job_files, self.config.state_dir, [i for i, _ in part])
            now = self.kept_now()  # the loop ran meanwhile; no await from this check to the removal
            ids = [i for i, a in part if self.why_kept(i, a, now) is None]
            kept += len(jobs[k:k + BATCH]) - len(ids)
            removed += len(self.store.remove_jobs(ids, keep_use_since))
            if any(i in now[0] for i in ids):
                self.wake()  # its dependents fail now: their dependency no longer exists
            await asyncio.sleep(0)
        return removed, kept

    async def remove_where(self, states: Iterable[State], before: float | None = None,
                           users: Iterable[str] | None = None, uid: int | None = None) -> tuple[int, int]:
        """Remove every ended job that matches (Store.cleanable: each user's in turn, or with no
        users every user's that ended before `before`), a page at a time; (removed, kept)."""
        states = list(states)
        removed = kept = 0
        for user in (list(users) if users is not None else [None]):
            key: tuple[float, int] = (float("-inf"), 0)
            while True:
                page = self.store.cleanable(states, before, user, uid, after=key, limit=BATCH)
                if not page:
                    break
                key = (page[-1][2], page[-1][0])
                r, k = await self.remove_ended([(i, a) for i, a, _ in page])
                removed, kept = removed + r, kept + k
        return removed, kept

    async def purge(self) -> None:
        """history_keep_days: every PURGE_EVERY seconds, the jobs that ended longer ago go (until cancelled)."""
        while True:
            days = self.config.history_keep_days
            if days > 0:
                try:
                    removed, _ = await self.remove_where(TERMINAL, before=time.time() - days * 86400.0)
                    if removed:
                        log.info("removed %d job(s) that ended more than %g day(s) ago (history_keep_days)",
                                 removed, days)
                except Exception as e:  # noqa: BLE001 - e.g. a full disk: the next round tries again
                    log.warning("removing old jobs failed: %s", e)
            await asyncio.sleep(PURGE_EVERY)


def remove_job_files(state_dir: Path, ids: Iterable[int]) -> int:
    """Delete the removed jobs' files in `state_dir`/logs (and a run folder left in jobs/); how
    many. As root, in folders only root writes (0700 logs/, 0711 jobs/), reached through file
    descriptors opened with O_NOFOLLOW: a symlink is never followed, and unlink removes a link,
    never what it points to. Each name is made from an id, never taken from what is there."""
    n = 0
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    ids = [int(i) for i in ids]
    try:
        fd = os.open(Path(state_dir) / "logs", flags)
    except OSError as e:
        log.warning("job logs not removed: %s/logs: %s", state_dir, e.strerror)
        return 0
    try:
        if os.fstat(fd).st_uid != os.geteuid():
            log.warning("job logs not removed: %s/logs is not the daemon's", state_dir)
            return 0
        for i in ids:
            for suffix in LOG_SUFFIXES:
                try:
                    os.unlink(f"{i}{suffix}", dir_fd=fd)
                    n += 1
                except FileNotFoundError:
                    pass
                except OSError as e:  # a folder of that name, say: left alone
                    log.warning("log of job %d not removed: %s%s: %s", i, i, suffix, e.strerror)
    finally:
        os.close(fd)
    # Run folders normally go at each job's end (Launcher.finish); one left by a crash goes
    # here, only where rmtree works through descriptors without following links.
    if shutil.rmtree.avoids_symlink_attacks:
        try:
            jfd = os.open(Path(state_dir) / "jobs", flags)
        except OSError:
            return n
        try:
            for i in ids:
                try:
                    st = os.stat(str(i), dir_fd=jfd, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.S_ISDIR(st.st_mode):
                    shutil.rmtree(Path(state_dir) / "jobs" / str(i), ignore_errors=True)
                    n += 1
        finally:
            os.close(jfd)
    return n
