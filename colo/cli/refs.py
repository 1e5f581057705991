"""How a command line names jobs: an id (7), a task of an array as Slurm writes it (12_3), or a
job's name. Read strictly: `3_1` is task 1 of array 3, never job 31 (Python's int() reads "3_1" as
31, which once made `--after 3_1` wait for job 31), and anything else is refused in one line.
"""
from __future__ import annotations

from .out import Fail

OPEN = ("queued", "starting", "running")
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def kind(ref: str) -> str:
    """"id", "task" or "name" (as colo/daemon/validate.py's NAME: 1-64 of A-Za-z0-9._-, the first a
    letter or digit); Fail for anything else."""
    if ref.isascii() and ref.isdigit():
        return "id"
    a, sep, b = ref.partition("_")
    if sep and a.isascii() and a.isdigit() and b.isascii() and b.isdigit():
        return "task"
    if 0 < len(ref) <= 64 and ref[0] not in "._-" and all(c in _NAME_CHARS for c in ref):
        return "name"
    raise Fail(f"malformed job {ref!r}: give a job id (7), ARRAY_INDEX (12_3) or a job's name")


def _listed(c, ref: str) -> list[dict]:
    """The jobs `ref` may name, ended ones too, as `colo ls REF` finds them (the daemon's one rule)."""
    r = c.ls_fields(["id", "name", "state", "array"], all=True, refs=[ref])
    out = []
    for i, name, state, arr in r["rows"]:
        a, _, k = (arr or "").partition("_")
        out.append({"id": i, "name": name, "state": state, "array_job": int(a) if a else None,
                    "array_index": int(k) if k else None})
    return out


def _per_task(jobs: list[dict], newest: bool) -> list[dict]:
    """An array's tasks, one per index: a task `colo requeue` ran again is its newest copy, or (not
    `newest`) its first run, which `colo wait` follows to its newest copy itself."""
    by_index: dict = {}
    for j in jobs:  # oldest first: a later copy replaces an earlier run
        if newest or j["array_index"] not in by_index:
            by_index[j["array_index"]] = j
    return sorted(by_index.values(), key=lambda j: j["id"])


def job_refs(c, ref: str, many: bool = True, open_only: bool = False, newest: bool | None = None) -> list[int]:
    """The jobs a reference names: an id; with `many`, an array's id (its first task's) names every
    task, as scancel and squeue read it; a task as ARRAY_INDEX (12_3); a name that one job has, or
    (with `many`) the tasks of one array. open_only: only an array's queued and running tasks.
    newest: a task run again is its newest copy (default: with open_only), else its first run."""
    newest = open_only if newest is None else newest
    k = kind(ref)
    if k == "id" and not many:
        return [int(ref)]
    if k == "id":  # a job of no array (or none at all: the op says so), or an array's tasks
        return array_tasks(c, int(ref), open_only, newest) or [int(ref)]
    jobs = _listed(c, ref)
    if k == "task":
        a, _, idx = ref.partition("_")
        named = [j for j in jobs if j["array_job"] == int(a) and j["array_index"] == int(idx)]
        if not named:
            raise Fail(f"no task {ref!r}: array {a} has no index {idx}")
    else:
        named = [j for j in jobs if j["name"] == ref]
    open_ = [j for j in named if j["state"] in OPEN]
    pick = open_ if open_ else named
    if not pick:
        raise Fail(f"no job {ref!r}: give a job id, ARRAY_INDEX (12_3) or the name of a job")
    if k == "task":
        return [pick[-1]["id"]]  # the newest run of that task
    arrays = {j["array_job"] for j in pick}
    if many and len(arrays) == 1 and None not in arrays:  # a name: the tasks of one array
        tasks = _per_task([j for j in named if j["array_job"] in arrays], newest)
        if open_only:
            tasks = [j for j in tasks if j["state"] in OPEN] or tasks
        return [j["id"] for j in tasks]
    if len(pick) == 1:
        return [pick[0]["id"]]
    what = f"array {arrays.pop()}'s tasks" if len(arrays) == 1 and None not in arrays else "jobs"
    raise Fail(f"{len(pick)} {what} are named {ref!r} ({', '.join(str(j['id']) for j in pick[:5])}…): give the id"
               + (" or ARRAY_INDEX (12_3)" if what != "jobs" else ""))


def array_tasks(c, i: int, open_only: bool = False, newest: bool = True) -> list[int]:
    """The tasks of array `i` (one run of each, see _per_task; open_only: the queued and running
    ones, if any is), or [] when job `i` heads no array."""
    tasks = [j for j in _listed(c, str(i)) if j["array_job"] == i]
    tasks = _per_task(tasks, newest)
    if open_only:
        tasks = [j for j in tasks if j["state"] in OPEN] or tasks
    return [j["id"] for j in tasks]


def job_ref(c, ref: str) -> int:
    """One job: by id, as an array's task (12_3), or by its name where one job (the newest open one
    first) has it."""
    return job_refs(c, ref, many=False)[0]


def all_refs(c, refs: list[str], open_only: bool = False) -> list[int]:
    """job_refs of each, in order, each job once."""
    return list(dict.fromkeys(i for r in refs for i in job_refs(c, r, open_only=open_only)))


def array_ref(j: dict) -> str | None:
    """A task of a job array as Slurm writes it (ARRAY_INDEX: 12_3), else None."""
    return None if j.get("array_job") is None else f"{j['array_job']}_{j['array_index']}"
