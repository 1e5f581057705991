"""Jobs that Slurm started on this node, registered by colo's SPANK plugin (native/slurm).

Slurm decides which node and which GPU: the job's `gres/shard` count (one shard is one MiB of GPU
memory, bound to one GPU's device file in gres.conf) is placed by slurmctld on one GPU of the
node, so Slurm never promises a GPU's memory twice. colo, on the node, holds the job to that
budget on exactly that GPU and decides MPS or time-sliced with the same plan() as for its own jobs
(policy.place_now: a job Slurm already started cannot wait in colo's queue), giving it the same
ledger, interposer and MPS pipe (launchspec.build_launch). Such a job is an ordinary row in colo's
store with `spec.slurm_job` set (its own job id: an array task's or a heterogeneous component's
own), so `colo ls`, `top`, `show` and profile learning treat it like any other; its "runtime"
below only follows it, because Slurm starts and kills its processes.

When the GPU Slurm chose cannot hold the job now (memory held outside any budget, jobs given to
colo directly, or a `gres/gpu` job that Slurm 22.05 put on the same GPU), the job is not failed:
attach answers `wait` with the reason and the plugin's helper requeues it in Slurm.

What colo decides is written on the Slurm job's admin comment (placement, refusals, kills), which
slurmctld keeps and slurmdbd stores (`scontrol show job`, `sacct -o AdminComment`).

Only root may use these ops (slurmstepd and slurmd run the plugin as root); every value comes
from Slurm (job id, uid, gid, the allocation from slurmctld), except the profile name, which is
the user's own choice as with `colo submit --profile`.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import pwd
import re
import signal
import stat
import threading
import time

from ..config import Config
from ..jobs import ACTIVE, Job, JobSpec, Mode, State
from ..node import interposer
from ..node.cgroup import places
from ..runtimes.base import Gone, StartError
from ..slurmjob import NOTE_MAX, SlurmError, job_exit, job_record, status_exit
from ..sched import policy
from ..units import format_size_exact as exact
from .jobtable import JobTable
from .slurmcmd import admin_note, run, scontrol
from .slurmgpu import WANT_KEEP, devices_constrained, for_whole, least_loaded, no_room
from .validate import NAME

log = logging.getLogger("colo")
STILL_THERE = 30.0  # seconds between asking Slurm which jobs still run on the node (one squeue for all)
_ALIVE = {"RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "STOPPED", "PENDING", "REQUEUED", "RESIZING"}
# How Slurm names one job to scancel, squeue and scontrol: "12", an array task "12_3", a
# heterogeneous job's component "12+1" (a bare "12" would name every task, or every component).
REF = re.compile(r"^\d{1,10}(?:_\d{1,10}|\+\d{1,5})?$")
NODE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
COMMENT = re.compile(rf"[^\n\0]{{0,{4 * NOTE_MAX}}}\Z")  # an admin comment as `scontrol show job` prints it
MIN_BUDGET = 64 << 20  # bytes: the least budget a Slurm job gets (a bare `--gres=shard` asks 1 MiB)
RUNNING_NOTE = "running under Slurm"  # the event of a start that got as far as the job's env (_cut_short)
SETTLE = 5.0  # seconds a start that finds its GPU full waits for it to free before the job is requeued


class Refused(Exception):
    """One line for the plugin, which shows it to the user and fails the step."""


def _handle(slurm_job: int, job_id: int, ref: str, node: str | None) -> str:
    return f"slurm:{slurm_job}:{job_id}:{ref}:{node or ''}"


def _parse(handle: str) -> tuple[int, int, str, str | None]:
    """(own Slurm job id, colo job id, Slurm's name for it, node); handles stored before the
    name and node were kept have three fields."""
    parts = handle.split(":")
    sj, jid = int(parts[1]), int(parts[2])
    return sj, jid, (parts[3] if len(parts) > 3 else str(sj)), (parts[4] or None) if len(parts) > 4 else None


def node_jobs(node: str | None, slurm_job: int) -> dict[int, str] | None:
    """Slurm's jobs on `node` as slurmctld tells them, by their own job id ({} when it knows
    none); None when Slurm cannot be asked (then nothing is concluded). Without a node (a job
    followed before colo kept it), the jobs of that job id: an array's or a heterogeneous job's
    every task, told apart by their own ids."""
    r = run("squeue", "-h", "-o", "%A %T", *(["-w", node] if node else ["-j", str(slurm_job)]))
    if r is None:
        return None
    if r.returncode != 0:
        return {} if not node and "invalid job id" in r.stderr.lower() else None
    out = {}
    for line in r.stdout.splitlines():
        own, _, st = line.strip().partition(" ")
        if own.isdigit():
            out[int(own)] = st.strip().upper()
    return out


def _wait_exited(pids: list[int], seconds: float) -> None:
    """Until every one of `pids` has exited (gone, or a zombie left to its reaper), at most `seconds`."""
    def alive(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                return f.read().rpartition(b")")[2].split()[0] != b"Z"
        except (OSError, IndexError):
            return False

    end = time.monotonic() + seconds
    while any(alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.05)


def _safe_ledger(path) -> interposer.Ledger | None:
    """The ledger in a folder the job's user can write: no symlink, no FIFO, a regular file only."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return interposer.read_ledger(f"/proc/self/fd/{fd}")  # the very file checked above
    except (OSError, interposer.LedgerError):
        return None
    finally:
        os.close(fd)


class SlurmRuntime:
    """How colo follows a Slurm job: it ends when the plugin's epilog says so (or when Slurm no
    longer runs it on the node); `colo cancel` asks Slurm to cancel it; its processes are those
    that hold a slot in its ledger (their pids come from the kernel's lock table, not from the job).

    Whether followed jobs still run is asked of Slurm once per node every STILL_THERE seconds
    for all of them (`squeue -w NODE`), never once per job: slurmctld serves every node."""

    cleanup_in_background = False  # a dict entry and a file: nothing to wait for
    stop_reaches_all = True  # scancel reaches every process (proctrack); a kill of ours first: sacct FAILED

    def __init__(self, config: Config, table: JobTable):
        self.config = config
        self.table = table
        self._lock = threading.Lock()
        self._ends: dict[int, tuple[threading.Event, list]] = {}  # slurm job -> (ended, [exit code])
        self._asking = threading.Lock()  # one squeue at a time; the others read its answer
        self._seen: dict[str | None, tuple[float, dict[int, str] | None]] = {}  # node -> (when, jobs)
        self._cgroups: dict[str, tuple[float, dict[str, str]]] = {}  # handle -> (when, Slurm's cgroup of the job)
        self._said: set[str] = set()  # handles whose cancel is written on the Slurm job (say_stop)
        self.exits: dict[int, int] = {}  # slurm job -> its batch script's wait status, until its end or cleanup

    def _slot(self, slurm_job: int) -> tuple[threading.Event, list]:
        with self._lock:
            return self._ends.setdefault(slurm_job, (threading.Event(), []))

    def ended(self, slurm_job: int, code: int) -> None:
        ev, box = self._slot(slurm_job)
        box[:] = [code]
        ev.set()

    def _state(self, sj: int, node: str | None, fresh: float) -> str | None:
        """Job `sj`'s state on `node` from an answer at most `fresh` seconds old: "" when Slurm
        does not run it there, None when Slurm could not be asked."""
        key = node if node else f"job {sj}"
        with self._asking:
            at, jobs = self._seen.get(key, (0.0, None))
            if time.monotonic() - at > fresh:
                jobs = node_jobs(node, sj)
                self._seen[key] = (time.monotonic(), jobs)
        return None if jobs is None else jobs.get(sj, "")

    def start(self, launch) -> str:
        raise StartError("Slurm jobs are started by Slurm, not by colo")

    def wait(self, handle: str) -> int:
        sj, _, _, node = _parse(handle)
        ev, box = self._slot(sj)
        while not ev.wait(STILL_THERE):
            if self._state(sj, node, STILL_THERE / 2) == "" and not ev.is_set():
                raise Gone(f"Slurm job {sj} ended without colo's epilog telling it")
        return box[0]

    def poll(self, handle: str) -> int | None:
        sj, _, _, node = _parse(handle)
        ev, box = self._slot(sj)
        if ev.is_set():
            return box[0]
        st = self._state(sj, node, 5.0)  # after a restart: one answer serves every job recovered
        if st == "" or (st and st not in _ALIVE):
            raise Gone(f"Slurm job {sj} ended while colo was down")
        return None

    def exit_note(self, handle: str) -> str:
        return ""

    def say_stop(self, handle: str) -> None:
        """Who cancels the job, on the Slurm job: before its MPS clients are terminated (then the
        batch script may end at once, and Slurm takes no note on a finished job)."""
        _, jid, ref, _ = _parse(handle)
        try:
            by = self.table.job(jid).cancel_by
        except KeyError:
            by = None
        with self._lock:
            if not by or handle in self._said:
                return
            self._said.add(handle)
        admin_note(ref, f"colo: cancelled by {by}")

    def stop(self, handle: str, grace: float) -> None:
        """`colo cancel` and the patrol's kills: said on the Slurm job (once), then scancel of that
        one job (an array task or a component by its own name, never the whole array)."""
        _, _, ref, _ = _parse(handle)
        self.say_stop(handle)
        r = run("scancel", ref, timeout=30)
        if r is None or r.returncode != 0:
            raise StartError(f"scancel {ref}: {(r.stderr.strip() or r.returncode) if r else 'did not answer'}")

    def adopt(self) -> dict[int, str]:
        return {}

    def pids(self, handle: str) -> list[int]:
        _, jid, _, _ = _parse(handle)
        try:
            uid = self.table.job(jid).uid
        except KeyError:
            return []
        led = _safe_ledger(self.config.run_dir(jid) / "ledger")
        out = []
        for p in (led.processes if led else []):
            pid = p.get("host_pid")
            try:
                if pid and os.stat(f"/proc/{pid}").st_uid == uid:  # the job's own user's process
                    out.append(pid)
            except OSError:
                pass
        return out

    def cgroup_paths(self, handle: str) -> dict[str, str]:
        """Slurm's own cgroup of the job on this node, made by slurmstepd where Slurm tracks jobs
        by cgroup (proctrack/cgroup): `…/uid_U/job_J` (cgroup v1) or `…slurmstepd.scope/job_J`
        (v2), found from the pids slurmstepd lists for the job (`scontrol listpids`), so that the
        patrol knows a job's process that left its budget (no interposer) as the job's. Asked once
        a job (not found: again after STILL_THERE seconds); {} without such cgroups."""
        sj, jid, _, node = _parse(handle)
        with self._lock:
            at, out = self._cgroups.get(handle, (0.0, {}))
            if out or time.monotonic() - at < STILL_THERE:
                return out
        try:
            uid = self.table.job(jid).uid
        except KeyError:
            return {}
        r = run("scontrol", "listpids", str(sj), *([node] if node else []))
        pids = [int(w[0]) for w in (line.split() for line in (r.stdout.splitlines()[1:] if r else [])) if w and w[0].isdigit()]
        job = re.compile(rf"^(.*/(?:uid_{uid}|[^/]*slurmstepd\.scope)/job_{sj})(?:/|$)")
        out = {}
        for pid in pids:
            for key, path in places(pid).items():
                m = job.match(path)
                if m:
                    out[key] = m.group(1)
            if out:
                break
        with self._lock:
            self._cgroups[handle] = (time.monotonic(), out)
        return out

    def cleanup(self, handle: str) -> None:
        sj, jid, _, _ = _parse(handle)
        with self._lock:
            self._ends.pop(sj, None)
            self.exits.pop(sj, None)
            self._cgroups.pop(handle, None)
            self._said.discard(handle)
        mark(self.config, sj, False)
        try:
            _env_path(self.config, jid).unlink()
        except OSError:
            pass


# ---- the ops ---------------------------------------------------------------------------------

def _int(args: dict, key: str, lo: int = 0, hi: int = (1 << 63) - 1) -> int:
    v = args.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise Refused(f"malformed {key}: {v!r}")
    return v


def _text(args: dict, key: str, rule: re.Pattern, default: str | None = None) -> str | None:
    v = args.get(key, default)
    if v is not None and (not isinstance(v, str) or not rule.match(v)):
        raise Refused(f"malformed {key}: {v!r}")
    return v


def _indices(args: dict) -> list[int]:
    v = args.get("gpu_index") or []
    if not isinstance(v, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 1024 for i in v):
        raise Refused(f"malformed gpu_index: {v!r}")
    return sorted(set(v))


def _mark_path(config: Config, slurm_job: int):
    return config.socket.parent / "slurm-jobs" / str(slurm_job)


def mark(config: Config, slurm_job: int, on: bool, gpus: list[int] | None = None) -> None:
    """The plugin's sign that colo follows Slurm job `slurm_job` (native/slurm/colo_spank.c
    colo_knows): a root-only file beside the socket, so that its epilog reaches colo even when
    slurmd runs it with SLURM_JOB_GPUS empty (after a slurmctld restart). `gpus`: the GPUs a
    gres/gpu job holds here, written in it, so that its later steps get the same GPUs after a
    restart of colo (held_gpus)."""
    p = _mark_path(config, slurm_job)
    try:
        if on:
            p.parent.mkdir(mode=0o700, exist_ok=True)
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                if gpus is not None:
                    os.write(fd, json.dumps({"gpus": sorted(gpus)}).encode())
            finally:
                os.close(fd)
        else:
            p.unlink(missing_ok=True)
    except OSError as e:
        log.warning("Slurm job %d: colo's mark for its epilog: %s", slurm_job, e)


def held_gpus(config: Config, slurm_job: int) -> list[int] | None:
    """The GPUs colo gave gres/gpu job `slurm_job` here, from its mark (None: none written)."""
    try:
        fd = os.open(_mark_path(config, slurm_job), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        v = json.loads(os.read(fd, 4096) or b"null")
    except ValueError:
        return None
    finally:
        os.close(fd)
    g = v.get("gpus") if isinstance(v, dict) else None
    if not isinstance(g, list) or not g or not all(isinstance(i, int) and 0 <= i < 1024 for i in g):
        return None
    return g


def _exit_from_slurm(slurm_job: int) -> tuple[int, int]:
    """(exit code, signal) of a job whose batch exit colo did not see (no batch script on this node,
    or colo restarted since), from Slurm's record; (0, 0) when Slurm forgot it: the end is what
    matters."""
    try:
        return job_exit(job_record(scontrol("show", "job", str(slurm_job)), slurm_job))
    except SlurmError:
        return 0, 0


def find(table: JobTable, slurm_job: int) -> Job | None:
    for j in table.open.values():
        if j.spec.slurm_job == slurm_job:
            return j
    return None


def _env_path(config: Config, job_id: int):
    return config.state_dir / "slurm" / f"{job_id}.json"


class External:
    """The `slurm` op's actions. One per daemon (api.Api keeps it). Calls the daemon's parts as
    a request handler does: the job table, the GPUs, the scheduler (placement now, its
    decisions), the learner (profiles) and the launcher (what to start it with, following it).

    Owns `_holds`: the GPUs `gres/gpu` jobs running here hold (slurm job -> GPU indices, the
    GPUs the job runs on), which no colo job may share, kept until their epilog (in memory; the
    mark keeps the GPUs for the job's later steps across a restart), and each one's env;
    `_wants`: the GPUs kept free for gres/gpu jobs colo requeued for want of a whole GPU (slurm
    job -> (until, GPU indices)).

    Which GPU (slurm_gpu_choice, docs/slurm.md): where colo chooses, a shard job goes to the least
    loaded GPU by colo's budgets among those no gpu job holds and none is kept free for (Slurm
    22.05 puts shards on the first GPU that has them), and a gpu job to GPUs none of colo's jobs
    is on (Slurm 22.05 hands out a GPU whole while its shards are in use). Where Slurm chooses
    (ConstrainDevices=yes: the job may open only Slurm's device), the job runs on Slurm's GPU or
    is requeued."""

    def __init__(self, daemon):
        self.d = daemon
        self._starting: dict[int, asyncio.Future] = {}  # slurm job -> its env, while it is placed
        self._holds: dict[int, set[int]] = {}
        self._hold_env: dict[int, dict] = {}
        self._wants: dict[int, tuple[float, set[int]]] = {}

    def colo_chooses(self) -> bool:
        """Whether colo picks the GPU of a Slurm job on this node (else it is Slurm's)."""
        return self.d.config.slurm_gpu_choice == "colo" and not devices_constrained()

    def _kept(self, but: int | None = None) -> dict[int, int]:
        """GPU index -> the gres/gpu job it is kept free for (wants past their time dropped)."""
        now = time.monotonic()
        for sj in [sj for sj, (until, _) in self._wants.items() if until < now]:
            del self._wants[sj]
        return {i: sj for sj, (_, idx) in self._wants.items() if sj != but for i in idx}

    @property
    def rt(self) -> SlurmRuntime:
        return self.d.engines.get("slurm")

    async def handle(self, args: dict) -> dict:
        action = args.get("action")
        if action == "attach":
            return await self.attach(args)
        if action == "hold":
            return await self.hold(args)
        if action == "batch_exit":
            return await self.batch_exit(args)
        if action == "end":
            return await self.end(args)
        raise Refused(f"unknown slurm action {action!r}")

    def _known(self, sj: int, uid: int) -> dict | None:
        job = find(self.d.table, sj)
        if job is None:
            return None
        if job.uid != uid:
            raise Refused(f"Slurm job {sj} is known to colo as {job.user}'s")
        return {"job": job.id, "env": self._load_env(job.id)}

    async def attach(self, args: dict) -> dict:
        """A step of Slurm job `job` starts here: place the job (once), return its tasks' env.
        `known_only`: only the env of a job placed (or a gres/gpu job checked) already: later
        steps ask Slurm nothing.
        {"wait": reason} when the GPU Slurm bound it to cannot hold it now (the caller requeues it)."""
        sj = _int(args, "job", 1, 1 << 32)
        uid, gid = _int(args, "uid", 0, 1 << 32), _int(args, "gid", 0, 1 << 32)
        settle = time.monotonic() + SETTLE
        chooses = await asyncio.to_thread(self.colo_chooses)  # reads Slurm's cgroup.conf
        while True:  # a GPU full for a moment (a neighbour's memory still being released): wait a little
            if sj in self._starting:
                return {"job": None, "env": await asyncio.shield(self._starting[sj])}
            cut = self._cut_short(sj, uid)
            if cut is not None:
                if cut.state == State.STARTING:  # recovery has not looked at it yet (Slurm may have ended it)
                    await asyncio.sleep(0.5)
                    continue
                return await self._finish_start(cut)
            known = self._known(sj, uid) or ({"job": None, "env": self._hold_env.get(sj, {})}
                                             if sj in self._holds else None)
            if known is not None or args.get("known_only"):
                return known or {"job": None, "env": None}
            res = await self._place(args, sj, uid, gid, time.monotonic() >= settle, chooses)
            if res is not None:
                return res
            await asyncio.sleep(0.5)

    def _cut_short(self, sj: int, uid: int) -> Job | None:
        """The job of Slurm job `sj` if colo placed it but was killed before it saved the job's env
        (so no task of the job has it yet: the helper asks again once colo is back)."""
        job = find(self.d.table, sj)
        if job is None or job.uid != uid or job.state not in ACTIVE or not job.handle \
                or _env_path(self.d.config, job.id).exists():
            return None
        if any(e["reason"].startswith(RUNNING_NOTE) for e in self.d.table.store.events(job.id)):
            return None  # it ran: its env was saved, and is gone since (refused in _known)
        return job

    async def _finish_start(self, job: Job) -> dict:
        """A start that colo's restart cut short, finished on the GPUs, mode and budget it was
        given (the same launch as _start builds; the job runs on in Slurm all along)."""
        d, sj = self.d, job.spec.slurm_job
        fut = self._starting[sj] = asyncio.get_running_loop().create_future()
        try:
            was = await asyncio.to_thread(d.table.store.decision, job.id) or {}
            dec = policy.Decision(job.id, policy.START, tuple(job.gpus), str(job.mode or Mode.TIMESLICED), "",
                                  thread_pct=(was.get("details") or {}).get("thread_pct"))
            launch = await asyncio.to_thread(d.launcher.build_launch, job, dec)
            env = dict(launch.env)
            await asyncio.to_thread(self._save_env, job.id, env)
            await asyncio.to_thread(mark, d.config, sj, True)
        except Exception as e:  # noqa: BLE001 - the step fails with this line
            fut.set_exception(Refused(f"failed to start: {e}"))
            fut.exception()
            raise Refused(f"failed to start: {e}") from None
        else:
            fut.set_result(env)
        finally:
            self._starting.pop(sj, None)
        log.info("job %d: its start under Slurm (job %s), cut short by colo's restart, finished", job.id,
                 job.spec.argv[1])
        return {"job": job.id, "env": env}

    async def _place(self, args: dict, sj: int, uid: int, gid: int, last: bool, chooses: bool) -> dict | None:
        """attach's placement of a job colo does not know yet; None when the GPU cannot hold it
        now and this is not the `last` try (then attach tries again). `chooses`: colo picks the GPU."""
        d = self.d
        ref = _text(args, "ref", REF, str(sj))
        node = _text(args, "node", NODE)
        gpu_mem = _int(args, "gpu_mem", 1)
        comment = _text(args, "comment", COMMENT)  # the job's admin comment, as the helper read it from Slurm
        profile = args.get("profile")
        if profile is not None and (not isinstance(profile, str) or not NAME.match(profile)):
            raise Refused(f"malformed profile name {profile!r}: letters, digits, . _ - (at most 64)")
        bound = _indices(args)
        if not bound:
            raise Refused("Slurm bound no GPU to it (gres.conf must bind each GPU's shards to its device file)")
        if d.gpus.error:
            raise Refused(d.gpus.error)
        views = [v for v in d.gpus.views(in_use=True) if v.index in bound]  # less memory held outside budgets
        if len(views) != len(bound):
            raise Refused(f"Slurm bound it to GPU {','.join(map(str, bound))}, colo sees GPUs "
                          f"{','.join(str(v.index) for v in d.gpus.views())}: gres.conf and colo disagree")
        per_gpu = gpu_mem // len(views)  # its shards on this node, spread over the GPUs Slurm bound
        if per_gpu < MIN_BUDGET:  # `--gres=shard` with no count is one shard: 1 MiB, no CUDA context fits
            raise Refused(f"its shards are {exact(per_gpu)} of GPU memory, less than colo's least budget of "
                          f"{exact(MIN_BUDGET)}: one shard is one MiB, ask e.g. --gres=shard:4096 for 4GiB")
        chooses = chooses and len(views) == 1
        held = sorted(j for j, idx in self._holds.items() if idx & set(bound))
        if held and not chooses:
            return self._wait(ref, f"GPU{bound[0]} is bound to Slurm job {held[0]} (gres/gpu), which shares it with nobody")
        try:
            user = pwd.getpwuid(uid).pw_name
        except KeyError:
            user = str(uid)
        spec = JobSpec(argv=["slurm", ref], name=f"slurm-{ref}", gpu_mem=per_gpu, gpus=len(views),
                       profile=profile, slurm_job=sj)
        now = time.time()
        placed = d.scheduler.placed(now)
        cand = policy.Candidate(0, per_gpu, len(views), uid, 0, 0, d.learner.profile_of(Job(0, spec, uid, gid, user)))
        if chooses:
            dec, why = least_loaded(cand, bound[0], d.gpus.views(in_use=True), placed,
                                    {i for idx in self._holds.values() for i in idx}, self._kept(), d.cfg_policy,
                                    d.gpus.unbudgeted)
            if dec is None:
                return self._wait(ref, why) if last else None
        else:
            dec = policy.place_now(cand, views, placed, d.cfg_policy)
            if dec.action != policy.START:
                return self._wait(ref, no_room(views, placed, per_gpu, dec.reason, d.gpus.unbudgeted)) if last else None
        fut = self._starting[sj] = asyncio.get_running_loop().create_future()
        try:
            env = await self._start(spec, uid, gid, user, dec, node, comment)
        except BaseException as e:
            fut.set_exception(Refused(str(e)))
            fut.exception()  # retrieved: no "never retrieved" warning when nobody else waits
            raise
        else:
            fut.set_result(env)
        finally:
            self._starting.pop(sj, None)
        return {"job": env.get("COLO_JOB_ID"), "env": env}

    def _wait(self, ref: str, reason: str) -> dict:
        log.info("Slurm job %s cannot run here now: %s", ref, reason)
        return {"job": None, "env": None, "wait": reason}

    async def hold(self, args: dict) -> dict:
        """A step of a `gres/gpu` job starts here: Slurm bound it `gpu_index` whole. It keeps
        them to itself (colo places none of its jobs there while it runs), and waits (the caller
        requeues it) while colo's jobs are on them, which Slurm 22.05 allows (it does not count a
        GPU's shards in use when it hands the GPU out whole)."""
        sj = _int(args, "job", 1, 1 << 32)
        _int(args, "uid", 0, 1 << 32)
        ref = _text(args, "ref", REF, str(sj))
        bound = _indices(args)
        # a later step after colo's restart: the GPUs its first step got; whether colo picks
        before, chooses = await asyncio.to_thread(lambda: (held_gpus(self.d.config, sj), self.colo_chooses()))
        if sj in self._holds:
            return {"env": self._hold_env.get(sj, {})}
        views = self.d.gpus.views()
        if before is not None and len(before) == len(bound) and {v.index for v in views} >= set(before):
            return await self._take(sj, before, bound, views)
        busy = {u: j.id for j in self.d.table.jobs_in(*ACTIVE) for u in j.gpus}
        others = {i for j, idx in self._holds.items() for i in idx}
        on = sorted((v.index, busy[v.uuid]) for v in views if v.index in bound and v.uuid in busy)
        mine = [i for i in bound if i in others]
        if not on and not mine:
            return await self._take(sj, bound, bound, views)
        why = (f"Slurm gave it GPU {','.join(map(str, bound))} whole, but "
               + (f"colo's jobs run there ({', '.join(f'{i} on GPU{g}' for g, i in on)})" if on else
                  f"colo gave GPU {','.join(map(str, mine))} to another gres/gpu job"))
        if not chooses:
            return self._wait(ref, f"{why}; it waits for them to end")
        load = {u: sum(j.spec.gpu_mem for j in self.d.table.jobs_in(*ACTIVE) if u in j.gpus) for u in busy}
        take, keep = for_whole(len(bound), bound, views, load, others, self._kept(but=sj),
                               self._wants.get(sj, (0.0, set()))[1])
        if take:
            return await self._take(sj, take, bound, views)
        if keep:  # none free: these are kept free of new jobs (its jobs end) until it comes back
            self._wants[sj] = (time.monotonic() + WANT_KEEP, keep)
            why += (f"; no GPU here is free of colo's jobs: colo places no new job on GPU "
                    f"{','.join(map(str, sorted(keep)))} until it comes back")
        return self._wait(ref, f"{why}; it waits for them to end")

    async def _take(self, sj: int, gpus: list[int], bound: list[int], views: list[policy.GpuView]) -> dict:
        """gres/gpu job `sj` holds `gpus` here (not Slurm's `bound`: its env names them by UUID)."""
        env = {}
        if sorted(gpus) != sorted(bound):
            uuid = {v.index: v.uuid for v in views}
            env = {"CUDA_VISIBLE_DEVICES": ",".join(uuid[i] for i in gpus)}
            log.info("Slurm job %d (gres/gpu): on GPU %s, not Slurm's GPU %s (colo's jobs or another gpu job there)",
                     sj, ",".join(map(str, gpus)), ",".join(map(str, bound)))
        self._holds[sj], self._hold_env[sj] = set(gpus), env
        self._wants.pop(sj, None)
        await asyncio.to_thread(mark, self.d.config, sj, True, list(gpus))
        return {"env": env}

    async def _start(self, spec: JobSpec, uid: int, gid: int, user: str, dec: policy.Decision, node: str | None,
                     comment: str | None) -> dict:
        d = self.d
        job = d.table.add(spec, uid, gid, user)  # then at once STARTING: the scheduler never sees it queued
        dec = policy.Decision(job.id, dec.action, dec.gpus, dec.mode, dec.reason, dec.details, dec.thread_pct)
        d.scheduler.record([dec])
        handle = _handle(spec.slurm_job, job.id, spec.argv[1], node)
        job = d.table.transition(job.id, State.STARTING, f"started by Slurm (job {spec.argv[1]}): {dec.reason}",
                                 gpus=list(dec.gpus), mode=Mode(dec.mode or "timesliced"), attempts=1, handle=handle)
        try:
            launch = await asyncio.to_thread(d.launcher.build_launch, job, dec)
            env = dict(launch.env)
            await asyncio.to_thread(self._save_env, job.id, env)
            await asyncio.to_thread(mark, d.config, spec.slurm_job, True)
        except Exception as e:  # noqa: BLE001 - the step fails with this line; the job is not left starting
            reason = f"failed to start: {e}"
            d.table.transition(job.id, State.FAILED, reason)
            d.launcher.finish(job.id)
            raise Refused(reason) from None
        d.table.transition(job.id, State.RUNNING, f"{RUNNING_NOTE} (job {spec.argv[1]})")
        d.launcher.adopt(job.id, handle)
        gpus = ", ".join(f"{d.gpus.name_of(u)} ({u})" for u in dec.gpus)
        note = f"colo: job {job.id} on {gpus}, {dec.mode or 'timesliced'}, budget {exact(spec.gpu_mem)}"
        # the job's one note (one `scontrol update`: the comment before it came with the request), not waited for
        asyncio.get_running_loop().run_in_executor(None, admin_note, spec.argv[1], note, comment)
        return env

    def _save_env(self, job_id: int, env: dict) -> None:
        """Kept where only root can write: later steps of the job get the very same environment."""
        p = _env_path(self.d.config, job_id)
        p.parent.mkdir(mode=0o700, exist_ok=True)
        tmp = p.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(env, f)
        os.replace(tmp, p)

    def _load_env(self, job_id: int) -> dict:
        try:
            return json.loads(_env_path(self.d.config, job_id).read_text())
        except (OSError, ValueError) as e:
            raise Refused(f"colo job {job_id}: its environment is gone ({e})") from None

    async def _terminate_clients(self, job: Job) -> bool:
        """terminate_client for every MPS client of the job still attached, then up to
        `stop_grace` seconds for them to exit by themselves: Slurm kills what remains as soon as
        the hook that asked for this returns."""
        if job.mode != Mode.MPS or not job.gpus or not job.handle:
            return True
        pids = await asyncio.to_thread(self.rt.pids, job.handle)
        if not pids:
            return True
        grace = self.d.config.stop_grace
        return await asyncio.to_thread(self.d.gpus.mps.terminate_then, job.gpus[0], pids,
                                       lambda: _wait_exited(pids, grace))

    async def batch_exit(self, args: dict) -> dict:
        """The batch script ended (by itself, scancel or a time limit): whatever the job still runs
        is killed by Slurm next, so its MPS clients are terminated first (invariant 6). Its wait
        status is the job's exit at its end (no need to ask Slurm then)."""
        sj = _int(args, "job", 1, 1 << 32)
        status = _int(args, "status", 0, (1 << 32) - 1) if args.get("status") is not None else None
        job = find(self.d.table, sj)
        if job is None:
            return {"job": None}
        if status is not None:
            self.rt.exits[sj] = status
        ok = await self._terminate_clients(job)
        return {"job": job.id, "terminated": ok}

    async def end(self, args: dict) -> dict:
        """Every process of the job is gone (Slurm's epilog): record its end, learn its profile;
        a gres/gpu job's GPUs are free for colo again."""
        sj = _int(args, "job", 1, 1 << 32)
        given = args.get("exit_code") is not None  # a helper of before the plugin sent it (it read Slurm)
        code, sig = (_int(args, "exit_code", 0, 255), _int(args, "signal", 0, 64)) if given else (0, 0)
        status = self.rt.exits.pop(sj, None)
        self._hold_env.pop(sj, None)  # not its want: a requeued gpu job's epilog runs too, and it comes back
        if self._holds.pop(sj, None) is not None:
            await asyncio.to_thread(mark, self.d.config, sj, False)
        job = find(self.d.table, sj)
        if job is None or job.state not in ACTIVE:
            mark(self.d.config, sj, False)
            return {"job": None}
        if not given:
            code, sig = status_exit(status) if status is not None else await asyncio.to_thread(_exit_from_slurm, sj)
        await self._terminate_clients(job)  # normally none is left; if one is, it goes cleanly
        if sig in (signal.SIGTERM, signal.SIGKILL) and not job.cancel_by:
            self.d.table.set_fields(job.id, cancel_by=f"Slurm (signal {sig}: scancel, time limit or preemption)")
        self.rt.ended(sj, 128 + sig if sig else code)  # follow() records it; cleanup() drops the env
        return {"job": job.id}
