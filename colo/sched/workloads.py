"""What `colo sim` replays: a workload (jobs, each with its stored profile, arrival, budget,
user, priority), read from a workload file (format in workloads/README.md), drawn as one of the
shipped mixes (the study's classes), or made from the jobs the daemon ran."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..profiles import Profile, ProfileStore, shipped_dir
from ..units import parse_size
from .budgets import STEP, step_up

GiB = 1024**3
MiB = 1024**2
WORKLOAD_FORMAT = "colo-workload"
WORKLOAD_VERSION = 1
DEFAULT_GPU_MEM = 12 * GiB  # the study's TITAN Xp


class SimError(ValueError):
    pass


@dataclass
class SimJob:
    id: int
    profile: Profile  # its stored profile: what policies see (the Truth realises what it really does)
    arrival: float = 0.0
    budget: int | None = None  # bytes; None: colo budgets the profile's peak
    uid: int = 0
    priority: int = 0
    known: bool = True  # colo's policy sees the profile (False: a first run, unprofiled)
    name: str = ""


@dataclass
class Workload:
    name: str
    jobs: list[SimJob]
    gpu_mem: int = DEFAULT_GPU_MEM
    seed: int | None = None


def budget_for(p: Profile) -> int:
    """Peak use plus 5 %, rounded up to 256 MiB: the budget a careful user would ask for."""
    return step_up(p.peak_mem * 1.05) or STEP


def dumps_workload(w: Workload) -> str:
    lines = [f"{WORKLOAD_FORMAT} {WORKLOAD_VERSION}", f"name {w.name}", f"gpu_mem {w.gpu_mem // MiB}MiB"]
    if w.seed is not None:
        lines.append(f"seed {w.seed}")
    lines.append("# job ARRIVAL_S PROFILE BUDGET [uid=N] [priority=N] [known=no]")
    for j in w.jobs:
        extra = "".join([f" uid={j.uid}" if j.uid else "", f" priority={j.priority}" if j.priority else "",
                         "" if j.known else " known=no"])
        b = "-" if j.budget is None else f"{j.budget // MiB}MiB"
        lines.append(f"job {j.arrival:g} {j.profile.name} {b}{extra}")
    return "\n".join(lines) + "\n"


def loads_workload(text: str, store: ProfileStore, origin: str = "<workload>") -> Workload:
    name, gpu_mem, seed, jobs, seen = Path(origin).stem, DEFAULT_GPU_MEM, None, [], False
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        where = f"{origin}:{n}"
        if not seen:
            if parts[:1] != [WORKLOAD_FORMAT] or len(parts) != 2 or not parts[1].isdigit():
                raise SimError(f"{where}: not a workload (first line must be '{WORKLOAD_FORMAT} {WORKLOAD_VERSION}')")
            if int(parts[1]) > WORKLOAD_VERSION:
                raise SimError(f"{where}: workload format {parts[1]} is newer than this colo reads")
            seen = True
            continue
        try:
            if parts[0] == "name":
                name = parts[1]
            elif parts[0] == "gpu_mem":
                gpu_mem = parse_size(parts[1])
            elif parts[0] == "seed":
                seed = int(parts[1])
            elif parts[0] == "job":
                if len(parts) < 4:
                    raise SimError(f"{where}: use 'job ARRIVAL PROFILE BUDGET [key=value ...]'")
                prof = store.get(parts[2])
                if prof is None:
                    raise SimError(f"{where}: no profile named {parts[2]!r}")
                opts = dict(kv.split("=", 1) for kv in parts[4:])
                jobs.append(SimJob(id=len(jobs) + 1, profile=prof, arrival=float(parts[1]),
                                   budget=None if parts[3] == "-" else parse_size(parts[3]),
                                   uid=int(opts.get("uid", 0)), priority=int(opts.get("priority", 0)),
                                   known=opts.get("known", "yes") != "no", name=parts[2]))
            else:
                raise SimError(f"{where}: unknown line {parts[0]!r}")
        except (ValueError, IndexError) as e:
            if isinstance(e, SimError):
                raise
            raise SimError(f"{where}: {e}") from None
    if not seen:
        raise SimError(f"{origin}: empty workload")
    return Workload(name, jobs, gpu_mem, seed)


def workloads_dir() -> Path:
    pkg = Path(__file__).resolve().parent.parent  # the colo package (this is colo/sched/)
    packaged = pkg / "data" / "workloads"  # a wheel's copy (setup.py)
    return packaged if packaged.is_dir() else pkg.parent / "workloads"


MIXES = ("heavy", "light", "memory-heavy", "memory-light", "random", "fits")


def load_workload(name_or_path: str, store: ProfileStore | None = None) -> Workload:
    """A path, or the name of a shipped mix (heavy, light, memory-heavy, memory-light, random, fits)."""
    store = store or ProfileStore([shipped_dir()])
    p = Path(name_or_path)
    if not p.is_file():
        shipped = workloads_dir() / f"{name_or_path}.workload"
        if re.fullmatch(r"[A-Za-z0-9_-]+", name_or_path) and shipped.is_file():
            p = shipped
        else:
            raise SimError(f"no workload file {name_or_path!r} (shipped mixes: {', '.join(MIXES)})")
    return loads_workload(p.read_text(), store, str(p))


# The classes of docs/invariants.md "Figures from the studies".
CLASSES = {
    "heavy": ["vgg11", "vgg16", "resnet50", "resnet101", "resnet152", "qmcpack", "hoomd", "lammps"],
    "light": ["alexnet", "gromacs"],
    "memory-heavy": ["vgg11", "vgg16", "resnet50", "resnet101", "resnet152"],
    "memory-light": ["alexnet", "googlenet", "qmcpack", "hoomd", "gromacs"],
    "random": ["vgg11", "vgg16", "resnet50", "resnet101", "resnet152", "alexnet", "googlenet",
               "lammps", "qmcpack", "hoomd", "gromacs"],
    # not the study's: a queue whose memory all fits (12 memory-light jobs on an 80 GiB GPU), where
    # plain sharing (naive) loses no job, as the H200's 6 light jobs (docs/gpu.md)
    "fits": ["alexnet", "googlenet", "qmcpack", "hoomd", "gromacs"],
}
SIZES = {"fits": (12, 80 * GiB)}  # (jobs, GPU memory) where a class is not 30 jobs on DEFAULT_GPU_MEM


def make_mix(kind: str, seed: int, store: ProfileStore | None = None, n: int | None = None) -> Workload:
    """n jobs drawn at random from a class, all arriving at once (as in the study)."""
    store = store or ProfileStore([shipped_dir()])
    if kind not in CLASSES:
        raise SimError(f"unknown mix {kind!r}: one of {', '.join(CLASSES)}")
    size, gpu_mem = SIZES.get(kind, (30, DEFAULT_GPU_MEM))
    n = n or size
    rng = np.random.default_rng(seed)
    names = [CLASSES[kind][i] for i in rng.integers(0, len(CLASSES[kind]), n)]
    jobs = []
    for i, nm in enumerate(names, 1):
        p = store.get(nm)
        if p is None:
            raise SimError(f"mix {kind}: profile {nm!r} missing")
        jobs.append(SimJob(i, p, 0.0, budget_for(p), name=nm))
    return Workload(kind, jobs, gpu_mem, seed)


def jobs_from_history(rows: list[dict], store: ProfileStore | None = None) -> list[SimJob]:
    """SimJobs from the daemon's job rows (colo.jobs.Job.to_dict()). A job's profile is the one it
    ran under when the store has it (its run time alone); else a flat profile made from its budget
    and measured run time (SM unknown: 0.5). Jobs that never started or need no GPU are skipped."""
    store = store or ProfileStore([shipped_dir()])
    ran = [r for r in rows if r.get("started_at") is not None and r.get("ended_at") is not None
           and (r.get("spec") or {}).get("gpus", 1) > 0]
    if not ran:
        return []
    t0 = min(float(r.get("submitted_at") or r["started_at"]) for r in ran)
    out = []
    for i, r in enumerate(sorted(ran, key=lambda r: (r.get("submitted_at") or 0, r.get("id", 0))), 1):
        spec = r.get("spec") or {}
        name = spec.get("profile")
        prof = store.get(name) if name else None
        budget = int(spec.get("gpu_mem") or 0) or None
        known = prof is not None
        if prof is None:
            runtime = max(1.0, float(r["ended_at"]) - float(r["started_at"]))
            step = max(1.0, runtime / 500)
            npts = max(1, math.ceil(runtime / step))
            mem = int(budget * 0.8) if budget else 1 * GiB
            prof = Profile(name=name or f"job{r.get('id', i)}", step=step, runtime=runtime, sm=np.full(npts, 0.5),
                           mem=np.full(npts, mem, dtype=np.int64), membw=np.full(npts, 0.3))
        out.append(SimJob(id=int(r.get("id", i)), profile=prof,
                          arrival=float(r.get("submitted_at") or r["started_at"]) - t0, budget=budget,
                          uid=int(r.get("uid", 0)), priority=int(spec.get("priority", 0)), known=known,
                          name=prof.name))
    return out
