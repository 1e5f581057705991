"""The commands about jobs and GPUs: show, explain, logs, wait, cancel (and signals), hold, release,
pause, resume, edit, requeue, clean, gpus, top. Each takes the keyword arguments colo/cli/options.py
declares for it, asks the daemon through colo.client, prints, and returns its exit code (or raises
out.Fail). No typer here: `colo show 7` runs without importing it (colo/cli/entry.py).
"""
from __future__ import annotations

import os
import sys
import time

from ..client import Client, ClientError
from ..textsafe import safe, safe_tree
from ..units import BadSize, format_duration, format_size, format_size_exact, parse_size
from . import refs as R
from . import when
from .out import Fail, echo, print_json, table, warn

ENDED = ("succeeded", "failed", "cancelled", "lost")


def _gpus(j: dict) -> str:
    """A job's GPUs by index, as `colo gpus` numbers them (a UUID only for a GPU no longer here)."""
    idx = j.get("gpu_index") or []
    return ",".join(str(i) if i is not None else u[:12] for i, u in zip(idx, j["gpus"])) if idx else (
        ",".join(u[:12] for u in j["gpus"]) or "-")


def _deps(spec: dict, states: dict) -> list[str]:
    """The dependencies `colo show` prints: each kind, its jobs and how far each is."""
    out = []
    for key, want in (("after", "once it succeeded"), ("after_any", "once it ended"),
                      ("after_fail", "once it failed")):
        ids = spec.get(key) or []
        if not ids:
            continue
        shown = [f"{i} ({states.get(str(i), '?')})" for i in ids[:8]]
        more = f" and {len(ids) - 8} more" if len(ids) > 8 else ""
        out.append(f"  {'--' + key.replace('_', '-') + ':':<11}{', '.join(shown)}{more}: starts {want}")
    return out


def show(job: str, sock: str | None = None, as_json: bool = False) -> int:
    c = Client(sock)
    j = c.show(R.job_ref(c, job))
    if as_json:
        print_json(j)
        return 0
    log_path = j.get("log")
    j = safe_tree(j)
    spec = j["spec"]
    state = j["state"] + (f", exit code {j['exit_code']}" if j["exit_code"] is not None else "")
    if j.get("paused_by"):
        state += f", paused by {j['paused_by']}"  # and the reason says who may resume it
    if j.get("suspended"):
        state += f", {j['suspended']}"
    lines = [f"job {j['id']}" + (f" ({j['name']})" if j["name"] else ""),
             f"  user:      {j['user']} (uid {j['uid']})",
             f"  state:     {state}",
             f"  reason:    {j['reason']}" + (f" (cancel asked by {j['cancel_by']}, under way)"
                                              if j.get("cancel_by") else ""),
             f"  runs:      {'image ' + spec['image'] if spec['image'] else 'host process'}: {' '.join(spec['argv'])}",
             (f"  budget:    {format_size_exact(j['budget'])} x {spec['gpus']} GPU(s)"
              + (f" (asked {format_size_exact(spec['asked_mem'])}, more given under --grow)"
                 if spec.get("asked_mem") else "")) if spec["gpus"] else "  budget:    no GPU",
             f"  gpus:      {_gpus(j)}   mode: {j['mode'] or '-'}"]
    if spec.get("gpu_ids") or spec.get("gpu_type"):
        lines.append("  may use:   " + ", ".join(x for x in (
            f"GPU {','.join(map(str, spec['gpu_ids']))}" if spec.get("gpu_ids") else "",
            f"GPUs named *{spec['gpu_type']}*" if spec.get("gpu_type") else "") if x))
    lines += _deps(spec, j.get("dep_states") or {})
    if spec.get("begin"):
        lines.append(f"  begin:     not before {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(spec['begin']))}")
    if j.get("array_job") is not None:
        lines.append(f"  array:     task {R.array_ref(j)} of array {j['array_job']} ({spec.get('array_size')} tasks"
                     + (f", at most {spec['array_limit']} at once)" if spec.get("array_limit") else ")"))
    for key, label in (("output", "output:"), ("error", "errors:"), ("on_end", "on end:")):
        if spec.get(key):
            lines.append(f"  {label:<11}{spec[key]}")
    if "used" in j:
        lines.append(f"  in use:    {format_size(j['used'])} (refused allocations: {j['refused']})")
    if j.get("off_gpu"):
        lines.append(f"  suspended: {format_duration(j['off_gpu'])} in all, not counted as GPU use (fair share, "
                     "colo report)")
    if j["decision"]:
        lines.append(f"  decision:  {j['decision']['reason']}")
    # the log file is root's (the state dir): name it only to someone who can open it
    readable = bool(log_path) and os.access(log_path, os.R_OK)
    lines.append(f"  log:       {j['log']}" if readable else f"  log:       colo logs {j['id']}")
    lines.append("  events:")
    for e in j["events"]:
        lines.append(f"    {time.strftime('%H:%M:%S', time.localtime(e['at']))}  {e['old'] or '-':>9} -> "
                     f"{e['new']:<9}  {e['reason']}")
    echo("\n".join(lines))
    return 0


def explain(job: str, sock: str | None = None, as_json: bool = False) -> int:
    c = Client(sock)
    job_id = R.job_ref(c, job)
    r = c.explain(job_id)
    if as_json:
        print_json(r)
        return 0
    r = safe_tree(r)
    d = r["decision"]
    head = f"job {job_id} ({r['state']}): "
    if r["state"] in ENDED:  # how it ended first: the placement below is history by now
        echo(head + (r["reason"] or "no reason recorded"))
        head = "placed: "
    elif d is None:
        echo(f"{head}no placement decision yet. {r['reason']}")
    if d is not None:
        echo(head + d["reason"])
        det = d.get("details") or {}
        if "observed_slowdown" in det:  # what it really did, against what was predicted at its start
            shared = ", ".join(det.get("shared_with") or []) or "nobody"
            echo(f"predicted slowdown {det.get('predicted_slowdown', 1.0):.2f}x, observed "
                 f"{det['observed_slowdown']:.2f}x of its profile's {det['profile_runtime']:.0f} s alone "
                 f"(shared with {shared})")
        if det.get("learned_factor"):  # co-run slowdowns the model missed, learned from earlier ends
            echo("learned co-run slowdown beside its neighbours: " + ", ".join(
                f"{m} {f:.2f}x" for m, f in sorted(det["learned_factor"].items())))
        if det.get("suggested_budget"):
            echo(f"suggested budget for its profile: {format_size(det['suggested_budget'])} "
                 f"(the most any run used, + 10 %)")
    return 0


def _stamp(at: float) -> str:
    from datetime import datetime

    return datetime.fromtimestamp(at).astimezone().isoformat(timespec="milliseconds")


def logs(job: str, follow: bool = False, tail: int | None = None, since: str | None = None,
         timestamps: bool = False, sock: str | None = None, as_json: bool = False) -> int:
    cut = when.since(since) if since is not None else None
    c = Client(sock, timeout=None if follow else 30)
    ref = R.job_ref(c, job)
    try:
        if not (timestamps or as_json):
            for chunk in c.logs(ref, follow, tail, cut):
                sys.stdout.write(chunk)
                sys.stdout.flush()
            return 0
        for at, text in c.log_lines(ref, follow, tail, cut):
            if as_json:  # one object a line (a stream): {"at": epoch seconds or null, "line": text}
                import json

                sys.stdout.write(json.dumps({"at": at, "line": text}) + "\n")
            else:
                sys.stdout.write(f"{_stamp(at)} {text}" if at is not None else text)
            sys.stdout.flush()
    except KeyboardInterrupt:
        if follow:
            _still_runs([ref], "following")
        return 130
    return 0


def _still_runs(ids: list[int], doing: str) -> None:
    """What Ctrl-C on a follow or a wait leaves: the jobs, which run on."""
    which = " ".join(map(str, ids[:10])) + (" ..." if len(ids) > 10 else "")
    echo("", err=True)
    echo(f"colo: stopped {doing}; job{'s' if len(ids) > 1 else ''} {which} still "
         f"run{'' if len(ids) > 1 else 's'} (colo cancel {which} stops {'them' if len(ids) > 1 else 'it'}; "
         f"colo logs -f {ids[0]} follows it again)", err=True)


def exit_code(j: dict) -> int:
    return j["exit_code"] if j["exit_code"] is not None else (0 if j["state"] == "succeeded" else 1)


def wait(jobs: list[str], sock: str | None = None, as_json: bool = False, quiet: bool = False) -> int:
    """quiet: no line per job (submit --wait --json prints how it ended instead)."""
    c = Client(sock, timeout=None)
    ids = R.all_refs(c, jobs)
    try:
        ended = c.wait(ids)
    except KeyboardInterrupt:
        _still_runs(ids, "waiting")
        return 130
    if as_json:
        print_json(ended)
    first = 0
    for j in ended:  # every job is reported, failing or not, before the exit code is chosen
        if not (as_json or quiet):
            again = f"{j['waited_for']} (run again as job {j['id']})" if "waited_for" in j else j["id"]
            echo(f"job {again}: {j['state']} ({safe(j['reason'])})", err=True)
        first = first or exit_code(j)
    return first


def _each(c: Client, ids: list[int], as_json: bool, fn, said, refs: list[str] = ()) -> int:
    """Do `fn` to each job, `ids` and the open jobs `refs` name; one line each (or a JSON list); 1 if
    any was refused. A job id among `refs` is acted on at once (one round trip: the common case);
    only when it turns out to be an array's id are its other open tasks looked up."""
    out, errors, done = [], [], set()

    def act(i: int) -> tuple[dict | None, ClientError | None]:
        done.add(i)
        try:
            j = fn(i)
        except ClientError as e:
            return None, e
        out.append(j)
        if not as_json:
            echo(said(safe_tree(j)))
        return j, None

    for ref in refs:
        if R.kind(ref) != "id":
            todo = R.job_refs(c, ref, open_only=True)
        else:
            i = int(ref)
            j, e = act(i)
            head = j is not None and j.get("array_job") == i  # an array's id: its other open tasks too
            # (or, when its first task is not open, the others)
            todo = R.array_tasks(c, i, open_only=True) if head or (e is not None and e.code == "invalid") else []
            if e is not None and not [k for k in todo if k != i]:
                errors.append(e)
        for k in todo:
            if k not in done and (e := act(k)[1]) is not None:
                errors.append(e)
    for i in ids:
        if i not in done and (e := act(i)[1]) is not None:
            errors.append(e)
    for e in errors:
        warn(str(e))
    if as_json:
        print_json(out)
    return 1 if errors else 0


OPEN_STATES = ("queued", "starting", "running")
_STATE_NOT_SIGNAL = ("colo cancel -s names a signal now, as scancel -s does (SIGINT, USR1...); "
                     "for jobs in a state use -t/--state {}")


def _open_jobs(c: Client, users: list[str], states: list[str], names: list[str]) -> list[dict]:
    """The open jobs of `users`, in `states`, of `names` (each where given), found by the daemon."""
    for st in states:
        if st not in R.OPEN + ENDED:
            raise Fail(f"unknown state {st!r}: one of {', '.join(R.OPEN + ENDED)}")
    open_states = [s for s in states if s in OPEN_STATES]
    if states and not open_states:
        return []
    return c.ls(False, None, users=users, states=open_states, names=names)


def cancel(jobs: list[str], signal: str | None = None, users: list[str] = (), states: list[str] = (),
           names: list[str] = (), all_: bool = False, all_users: bool = False, sock: str | None = None,
           as_json: bool = False) -> int:
    if signal is not None and signal.lower() in OPEN_STATES + ENDED:
        raise Fail(_STATE_NOT_SIGNAL.format(signal))
    sig = None
    if signal is not None:
        from ..protocol import SIGNAL_NAMES, signal_number

        try:
            sig = signal_number(signal)
        except ValueError as e:
            raise Fail(str(e)) from None
        said = "SIG" + next((k for k, v in SIGNAL_NAMES.items() if v == sig), str(sig))
    c = Client(sock)
    ids: list[int] = []
    if all_users:
        if users or all_ or jobs:
            raise Fail("--all-users is every user's open jobs: name no jobs, --user or --all with it")
        if not c.hello()["admin"]:  # the daemon refuses each job too: this says it once
            raise Fail("--all-users is for root and members of the admin group (admin_group)")
        ids = [j["id"] for j in _open_jobs(c, [], list(states), list(names))]
        if not ids and not as_json:
            echo("no open jobs")
    elif users or states or names or all_:
        me = c.hello()["user"] if all_ else None
        ids = [j["id"] for j in _open_jobs(c, list(users) + ([me] if me else []), list(states), list(names))]
    elif not jobs:
        raise Fail("say which jobs: ids or names, or --user/--state/--name/--all")
    if sig is not None:
        return _each(c, ids, as_json, lambda i: c.signal(i, sig), lambda j: f"job {j['id']}: sent {said}", jobs)
    # the stop is under way; its end is recorded a moment later (or when the engine is back)
    return _each(c, ids, as_json, c.cancel, lambda j: f"job {j['id']}: " + (
        "stopping" if j["state"] in ("starting", "running") and j.get("cancel_by") else j["state"]), jobs)


def hold(jobs: list[str], sock: str | None = None, as_json: bool = False) -> int:
    c = Client(sock)
    return _each(c, [], as_json, c.hold, lambda j: f"job {j['id']}: held by {j['held_by']}", jobs)


def release(jobs: list[str], sock: str | None = None, as_json: bool = False) -> int:
    c = Client(sock)
    return _each(c, [], as_json, c.release, lambda j: f"job {j['id']}: released", jobs)


def pause(jobs: list[str], sock: str | None = None, as_json: bool = False) -> int:
    c = Client(sock)
    return _each(c, [], as_json, c.pause, lambda j: f"job {j['id']}: paused (colo resume {j['id']})", jobs)


def suspend(jobs: list[str], sock: str | None = None, as_json: bool = False) -> int:
    c = Client(sock)
    return _each(c, [], as_json, c.suspend, lambda j: f"job {j['id']}: {j.get('suspended') or 'suspended'}", jobs)


def resume(jobs: list[str], sock: str | None = None, as_json: bool = False) -> int:
    c = Client(sock)
    return _each(c, [], as_json, c.resume,
                 lambda j: f"job {j['id']}: {j['suspended'] if j.get('suspended') else 'resumed'}", jobs)


def edit(job: str, gpu_mem: str | None = None, priority: int | None = None, name: str | None = None,
         sock: str | None = None, as_json: bool = False) -> int:
    changes: dict = {}
    if gpu_mem is not None:
        try:
            changes["gpu_mem"] = parse_size(gpu_mem)
        except BadSize as e:
            raise Fail(str(e)) from None
    if priority is not None:
        changes["priority"] = priority
    if name is not None:
        from .textcheck import utf8_only

        utf8_only(("--name", name))
        changes["name"] = name
    if not changes:
        raise Fail("say what to change: --gpu-mem, --priority or --name")
    c = Client(sock)
    j = c.edit(R.job_ref(c, job), **changes)
    if as_json:
        print_json(j)
        return 0
    j = safe_tree(j)
    echo(f"job {j['id']}: " + (f"name {j['name']}, " if j["name"] else "")
         + (f"budget {format_size_exact(j['budget'])}, " if j["ngpus"] else "") + f"priority {j['priority']}")
    return 0


def requeue(jobs: list[str], sock: str | None = None, as_json: bool = False) -> int:
    """Each ref's ended jobs as copies; an array's id or name: every task of it that ended, the newest
    run of each (a task still open is named, and left as it is)."""
    c = Client(sock)
    ids: list[int] = []
    for ref in jobs:
        many = R.job_refs(c, ref, newest=True)
        if len(many) > 1:  # an array: only its ended tasks
            states = {r[0]: r[1] for r in c.ls_fields(["id", "state"], all=True, refs=[ref])["rows"]}
            still = [i for i in many if states.get(i) not in ENDED]
            if still:
                echo(f"array {ref}: {len(still)} task(s) not ended, left as they are: "
                     + " ".join(map(str, still[:10])) + (" ..." if len(still) > 10 else ""), err=True)
            many = [i for i in many if states.get(i) in ENDED]
        ids += [i for i in many if i not in ids]
    return _each(c, ids, as_json, c.requeue, lambda j: str(j["id"]))


def clean(jobs: list[str], before: str | None = None, failed_only: bool = False, succeeded_only: bool = False,
          users: list[str] = (), sock: str | None = None, as_json: bool = False) -> int:
    if failed_only and succeeded_only:
        raise Fail("--failed-only and --succeeded-only exclude each other: give one, or neither for every ended job")
    states = ["succeeded"] if succeeded_only else ["failed", "cancelled", "lost"] if failed_only else None
    cut = max(0.0, when.since(before, "--before")) if before is not None else None
    for ref in jobs or ():
        R.kind(ref)
    r = Client(sock).clean(list(jobs) or None, cut, list(users) or None, states)
    if as_json:
        print_json(r)
        return 0
    kept = (f" ({r['kept']} kept for now: queued jobs depend on them, their arrays have tasks not ended, "
            "or their containers are still to be removed)" if r["kept"] else "")
    echo(f"removed {r['removed']} ended job{'' if r['removed'] == 1 else 's'}{kept}")
    return 0


def gpus(sock: str | None = None, as_json: bool = False) -> int:
    r = Client(sock).gpus()
    if as_json:
        print_json(r)
        return 0
    if r["error"]:
        raise Fail(r["error"])
    r = safe_tree(r)
    rows = [[g["index"], g["name"], g["uuid"], format_size(g["total"]), format_size(g["used"]),
             f"{format_size_exact(g['budgeted']) if g['budgeted'] else '0'} / {format_size_exact(g['usable'])}",
             g["compute_mode"], g["mps"],
             ",".join(map(str, g["jobs"])) or "-"] for g in r["gpus"]]
    echo(table(rows, ["#", "NAME", "UUID", "MEMORY", "USED", "BUDGETED/USABLE", "MODE", "MPS", "JOBS"]))
    for g in r["gpus"]:
        if g.get("unbudgeted"):
            over = f" (jobs over their budgets: {', '.join(map(str, g['over']))})" if g.get("over") else ""
            echo(f"GPU{g['index']}: {format_size(g['unbudgeted'])} in use outside any budget{over}; "
                 "not given to new jobs")
        if g.get("error"):
            echo(f"GPU{g['index']} is out of service: {g['error']} (no new job is placed on it; "
                 "its running jobs are left alone)")
        if g.get("drained"):
            echo(f"GPU{g['index']} is {g['drained']} (no new job is placed on it; colo undrain {g['index']})")
    if r["fake"]:
        echo("(simulated GPUs)")
    return 0


def top(once: bool = False, lines: int | None = None, sock: str | None = None) -> int:
    c = Client(sock, timeout=10)
    if once:  # one frame: no Textual
        from ..tui.render import once as frame

        return frame(c, lines)
    from ..tui.app import run_top

    return run_top(c)
