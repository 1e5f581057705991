"""The `colo` command. Thin: parse, call the client, print (a table, or JSON with --json)."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import List, Optional

import typer

from . import lsview
from . import sessions as cli_sessions
from . import sim as cli_sim
from ..client import Client, ClientError
from ..jobs import TERMINAL
from .submitspec import SubmitError, build_spec
from ..textsafe import safe, safe_all, safe_tree
from ..units import BadSize, format_duration, format_size, format_size_exact, parse_size

app = typer.Typer(help="colo: share this node's GPUs: a queue, memory budgets, MPS or time-slicing.",
                  no_args_is_help=True, pretty_exceptions_enable=False)  # --install-completion: bash, zsh, fish
SocketOpt = typer.Option(None, "--socket", envvar="COLO_SOCKET", help="daemon socket")
JsonOpt = typer.Option(False, "--json", help="print JSON for scripts")


def _version(value: bool) -> None:
    if value:
        from .. import __version__

        typer.echo(f"colo {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="print colo's version and exit")):
    """colo: share this node's GPUs: a queue, memory budgets, MPS or time-slicing."""


def fail(msg: str, code: int = 1) -> None:
    typer.echo(f"colo: {safe(msg)}", err=True)  # daemon errors may quote what a user typed
    raise typer.Exit(code)


def client(sock: Optional[Path]) -> Client:
    return Client(sock)


def _call(fn, *a, **kw):
    try:
        return fn(*a, **kw)
    except ClientError as e:
        fail(str(e))


def print_json(obj) -> None:
    # indented for people; compact (and several times faster) for pipes and scripts
    typer.echo(json.dumps(obj, indent=2 if sys.stdout.isatty() else None, default=str))


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)] if rows else [len(h) for h in header]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(fmt.format(*map(str, r)).rstrip() for r in [header, *rows])


# jobs ----------------------------------------------------------------------------------------
@app.command(context_settings={"allow_interspersed_args": False})
def submit(
    command: List[str] = typer.Argument(None, help="the command, after --"),
    image: Optional[str] = typer.Option(None, "--image", help="container image (local)"),
    process: bool = typer.Option(False, "--process", help="run as a host process, no container"),
    gpu_mem: Optional[str] = typer.Option(None, "--gpu-mem", help="GPU memory budget per GPU, e.g. 4GiB"),
    gpus: int = typer.Option(1, "--gpus", help="number of GPUs (0: a CPU-only job)"),
    name: Optional[str] = typer.Option(None, "--name", help="a name to refer to the job by (letters, digits, . _ -)"),
    env: List[str] = typer.Option([], "--env", help="K=V, repeatable"),
    mount: List[str] = typer.Option([], "--mount", help="SRC:DST[:ro], repeatable"),
    workdir: Optional[str] = typer.Option(None, "--workdir", help="folder the job starts in (a process job: "
                                          "the current one by default)"),
    after: List[int] = typer.Option([], "--after", help="start only after this job succeeded (repeatable; "
                                    "if it fails, this job fails too)"),
    after_any: List[int] = typer.Option([], "--after-any", help="start only after this job ended, however it "
                                        "ended (repeatable)"),
    after_fail: List[int] = typer.Option([], "--after-fail", help="start only after this job ended without "
                                         "succeeding: failed, cancelled or lost (repeatable; if it succeeds, this "
                                         "job fails, as it will never run)"),
    priority: int = typer.Option(0, "--priority", help="higher starts first (users may set up to "
                                 "max_user_priority)"),
    profile: Optional[str] = typer.Option(None, "--profile", help="profile name this job runs under"),
    retries: int = typer.Option(0, "--retries", help="requeue after an MPS server fault, up to N times"),
    env_file: List[Path] = typer.Option([], "--env-file", help="K=V lines (# comments), repeatable"),
    wait_: bool = typer.Option(False, "--wait", help="block until the job ends; exit with its exit code"),
    follow: bool = typer.Option(False, "--follow", "-f", help="print its output until it ends (implies --wait)"),
    grow: bool = typer.Option(False, "--grow", help="may run with more than --gpu-mem: lent, learned from your runs, or requeued once when refused"),
    cpus: Optional[float] = typer.Option(None, "--cpus", help="CPU limit in cores, e.g. 2 or 0.5"),
    mem: Optional[str] = typer.Option(None, "--mem", help="host memory limit, e.g. 8GiB"),
    time_limit: Optional[str] = typer.Option(None, "--time", help="wall-time limit as Slurm reads it: "
                                             "minutes, MM:SS, HH:MM:SS, D-HH:MM:SS (or 90s, 2h)"),
    array: Optional[str] = typer.Option(None, "--array", help="a job array, as Slurm's: one task per index "
                                        "(0-9, 0-9:2, 1,3,5; %N at the end: at most N at once, 0-15%4), each "
                                        "with COLO_ARRAY_INDEX and COLO_ARRAY_JOB_ID set; prints the array's id, "
                                        "which ls, wait, cancel, hold and release take for all its tasks; at most "
                                        "1,000 tasks"),
    gpu_id: List[str] = typer.Option([], "--gpu-id", help="only these GPUs may take the job: indices as `colo "
                                     "gpus` shows them, e.g. 1 or 0,2 (repeatable)"),
    gpu_type: Optional[str] = typer.Option(None, "--gpu-type", help="only GPUs whose name holds this text "
                                           "(any case), e.g. A100 or 'RTX 4090'"),
    sock: Optional[Path] = SocketOpt, as_json: bool = JsonOpt,
):
    """Queue a job; prints its id (an array's: its first task's).

    Example: colo submit --image local/trainer:1 --gpu-mem 4GiB --name mnist -- python train.py
    ·   colo submit --process --gpus 0 --after-fail 7 -- ./notify.sh "job 7 failed"
    ·   colo submit --process --gpu-mem 2GiB --array 0-15%4 --gpu-type A100 --name sweep -- ./run.sh
    """
    envs = list(env)
    for f in env_file:
        try:
            with open(f, encoding="utf-8") as fh:  # the caller's own file, read as the caller
                envs += [ln.strip() for ln in fh if ln.strip() and not ln.lstrip().startswith("#")]
        except OSError as e:
            fail(f"--env-file {f}: {e.strerror}")
        except UnicodeDecodeError:
            fail(f"--env-file {f}: not UTF-8 text")
    try:
        spec = build_spec(command, image=image, process=process, gpu_mem=gpu_mem, gpus=gpus, name=name, env=envs,
                          mount=mount, workdir=workdir, after=after, priority=priority, profile=profile,
                          retries=retries, cpus=cpus, mem=mem, time=time_limit, after_any=after_any,
                          after_fail=after_fail, array=array, gpu_id=gpu_id, gpu_type=gpu_type)
    except SubmitError as e:
        fail(str(e))
    if follow and array:
        fail("--follow shows one job's output: with --array use --wait, then colo logs ARRAY_INDEX")
    if grow:  # sent only when asked for: a daemon of before --grow takes the spec unchanged
        spec["grow"] = True
    job = _call(client(sock).submit, spec)
    print_json(job) if as_json else typer.echo(job["id"])
    if follow:  # like `docker run`: the output, then the job's exit code
        logs(str(job["id"]), follow=True, tail=None, since=None, timestamps=False, sock=sock, as_json=False)
    if wait_ or follow:
        wait([str(i) for i in job.get("tasks") or [job["id"]]], sock=sock, as_json=False)


STATES = ("queued", "starting", "running", "succeeded", "failed", "cancelled", "lost")


def _open_jobs(c: Client, users: list[str], states: list[str], names: list[str]) -> list[dict]:
    """The open jobs of `users`, in `states`, of `names` (each where given), found by the daemon."""
    for st in states:
        if st not in STATES:
            fail(f"unknown state {st!r}: one of {', '.join(STATES)}")
    open_states = [s for s in states if s in OPEN]
    if states and not open_states:
        return []
    return _call(c.ls, False, None, users=users, states=open_states, names=names)


OPEN = ("queued", "starting", "running")


def array_ref(j: dict) -> str | None:
    """A task of a job array as Slurm writes it (ARRAY_INDEX: 12_3), else None."""
    return None if j.get("array_job") is None else f"{j['array_job']}_{j['array_index']}"


def _jobs_named(c: Client, ref: str, _cache: dict = {}) -> list[dict]:
    """The jobs `ref` may name (as `colo ls REF` reads it), found by the daemon."""
    if ref not in _cache:
        _cache[ref] = _call(c.ls, True, None, refs=[ref])
    return _cache[ref]


def job_ref(c: Client, ref: str) -> int:
    """One job: by id, as an array's task (12_3), or by its name where one job (the newest open
    one first) has it."""
    ids = job_refs(c, ref, many=False)
    return ids[0]


def job_refs(c: Client, ref: str, many: bool = True, open_only: bool = False) -> list[int]:
    """The jobs a reference names: an id; with `many`, an array's id (its first task's) names every
    task, as scancel and squeue read it; a task as ARRAY_INDEX (12_3); a name that one job has, or
    (with `many`) the tasks of one array. open_only: only the queued and running ones of an array."""
    if ref.isdigit():
        i = int(ref)
        if not many:
            return [i]
        try:  # is it an array's id? (a job the caller may not see is left to the op to refuse)
            head = c.show(i)
        except ClientError:
            return [i]
        if head.get("array_job") != i:
            return [i]
        if open_only:
            return [j["id"] for j in _call(c.ls, False, None, refs=[ref]) if j.get("array_job") == i] or [i]
        return list(range(i, i + (head["spec"].get("array_size") or 1)))  # one transaction: consecutive ids
    jobs = _jobs_named(c, ref)
    a, sep, idx = ref.partition("_")
    task = bool(sep) and a.isdigit() and idx.isdigit()
    if task:
        named = [j for j in jobs if j.get("array_job") == int(a) and j.get("array_index") == int(idx)]
        if not named:
            fail(f"no task {ref!r}: array {a} has no index {idx}")
    else:
        named = [j for j in jobs if j["name"] == ref]
    open_ = [j for j in named if j["state"] in OPEN]
    pick = open_ if open_ else named
    if not pick:
        fail(f"no job {ref!r}: give a job id, ARRAY_INDEX (12_3) or the name of a job")
    arrays = {j.get("array_job") for j in pick}
    if many and not task and len(arrays) == 1 and None not in arrays:  # a name: the tasks of one array
        tasks = [j for j in named if j.get("array_job") in arrays]
        if open_only:
            tasks = [j for j in tasks if j["state"] in OPEN] or tasks
        return [j["id"] for j in tasks]
    if len(pick) == 1:
        return [pick[-1]["id"]]
    what = f"array {arrays.pop()}'s tasks" if len(arrays) == 1 and None not in arrays else "jobs"
    fail(f"{len(pick)} {what} are named {ref!r} ({', '.join(str(j['id']) for j in pick[:5])}…): give the id"
         + (" or ARRAY_INDEX (12_3)" if what != "jobs" else ""))


def _refs(c: Client, refs: list[str], open_only: bool = False) -> list[int]:
    """job_refs of each, in order, each job once."""
    return list(dict.fromkeys(i for r in refs for i in job_refs(c, r, open_only=open_only)))


@app.command("ls")
def ls(refs: List[str] = typer.Argument(None, help="only these jobs (ended ones too): ids, names, an array's "
                                        "id or name (all its tasks), ARRAY_INDEX"),
       all_: bool = typer.Option(False, "--all", "-a", help="ended jobs too (default: queued and running)"),
       user: List[str] = typer.Option([], "--user", "-u", help="only this user's jobs (repeatable)"),
       state: List[str] = typer.Option([], "--state", "-s", help="only jobs in this state (repeatable): "
                                        + ", ".join(STATES)),
       name: List[str] = typer.Option([], "--name", "-n", help="only jobs of this name (repeatable)"),
       quiet: bool = typer.Option(False, "-q", "--quiet", help="job ids only, one a line"),
       fmt: Optional[str] = typer.Option(None, "--format", "-o",
                                         help=f"columns, comma-separated, of: {', '.join(lsview.COLUMNS)}"),
       wide: bool = typer.Option(False, "--wide", "-w", help="reasons and commands in full"),
       limit: Optional[int] = typer.Option(None, "--limit", help="only the newest N; 0: every job (a terminal "
                                           f"shows at most {lsview.TTY_ROWS} otherwise: the running jobs first, "
                                           "then the front of the queue)"),
       sock: Optional[Path] = SocketOpt, as_json: bool = JsonOpt):
    """List jobs: the queued and running ones, or with --all every job colo remembers.

    Example: colo ls --all --state failed --user alice -o id,name,exit,reason   ·   colo ls 12 -o id,array,state
    """
    try:
        out = lsview.run(client(sock), all_, user, state, name, quiet, fmt, wide, limit, as_json, refs or [])
    except (lsview.Failed, ClientError) as e:
        fail(str(e))
    raise typer.Exit(lsview.write(out))


@app.command()
def show(job: str = typer.Argument(..., help="job id or name"), sock: Optional[Path] = SocketOpt,
         as_json: bool = JsonOpt):
    """Everything known about one job.

    Example: colo show 7
    """
    c = client(sock)
    j = _call(c.show, job_ref(c, job))
    if as_json:
        return print_json(j)
    log_path = j.get("log")
    j = safe_tree(j)
    spec = j["spec"]
    lines = [f"job {j['id']}" + (f" ({j['name']})" if j["name"] else ""),
             f"  user:      {j['user']} (uid {j['uid']})",
             f"  state:     {j['state']}" + (f", exit code {j['exit_code']}" if j["exit_code"] is not None else ""),
             f"  reason:    {j['reason']}" + (f" (cancel asked by {j['cancel_by']}, under way)"
                                                  if j.get("cancel_by") else ""),
             f"  runs:      {'image ' + spec['image'] if spec['image'] else 'host process'}: {' '.join(spec['argv'])}",
             (f"  budget:    {format_size_exact(j['budget'])} x {spec['gpus']} GPU(s)"
              + (f" (asked {format_size_exact(spec['asked_mem'])}, more given under --grow)"
                 if spec.get("asked_mem") else "")) if spec["gpus"] else "  budget:    no GPU",
             f"  gpus:      {', '.join(j['gpus']) or '-'}   mode: {j['mode'] or '-'}"]
    if spec.get("gpu_ids") or spec.get("gpu_type"):
        lines.append("  may use:   " + ", ".join(x for x in (
            f"GPU {','.join(map(str, spec['gpu_ids']))}" if spec.get("gpu_ids") else "",
            f"GPUs named *{spec['gpu_type']}*" if spec.get("gpu_type") else "") if x))
    if j.get("array_job") is not None:
        lines.append(f"  array:     task {array_ref(j)} of array {j['array_job']} ({spec.get('array_size')} tasks"
                     + (f", at most {spec['array_limit']} at once)" if spec.get("array_limit") else ")"))
    if "used" in j:
        lines.append(f"  in use:    {format_size(j['used'])} (refused allocations: {j['refused']})")
    if j["decision"]:
        lines.append(f"  decision:  {j['decision']['reason']}")
    # the log file is root's (the state dir): name it only to someone who can open it
    readable = bool(log_path) and os.access(log_path, os.R_OK)
    lines.append(f"  log:       {j['log']}" if readable else f"  log:       colo logs {j['id']}")
    lines.append("  events:")
    for e in j["events"]:
        lines.append(f"    {time.strftime('%H:%M:%S', time.localtime(e['at']))}  {e['old'] or '-':>9} -> "
                     f"{e['new']:<9}  {e['reason']}")
    typer.echo("\n".join(lines))


@app.command()
def explain(job: str = typer.Argument(..., help="job id or name"), sock: Optional[Path] = SocketOpt,
            as_json: bool = JsonOpt):
    """Why a job was placed where it was, or why it waits.

    Example: colo explain 7
    """
    c = client(sock)
    job_id = job_ref(c, job)
    r = _call(c.explain, job_id)
    if as_json:
        return print_json(r)
    r = safe_tree(r)
    d = r["decision"]
    head = f"job {job_id} ({r['state']}): "
    if r["state"] in TERMINAL:  # how it ended first: the placement below is history by now
        typer.echo(head + (r["reason"] or "no reason recorded"))
        head = "placed: "
    elif d is None:
        typer.echo(f"{head}no placement decision yet. {r['reason']}")
    if d is not None:
        typer.echo(head + d["reason"])
        det = d.get("details") or {}
        if "observed_slowdown" in det:  # what it really did, against what was predicted at its start
            shared = ", ".join(det.get("shared_with") or []) or "nobody"
            typer.echo(f"predicted slowdown {det.get('predicted_slowdown', 1.0):.2f}x, observed "
                       f"{det['observed_slowdown']:.2f}x of its profile's {det['profile_runtime']:.0f} s alone "
                       f"(shared with {shared})")
        if det.get("learned_factor"):  # co-run slowdowns the model missed, learned from earlier ends
            typer.echo("learned co-run slowdown beside its neighbours: " + ", ".join(
                f"{m} {f:.2f}x" for m, f in sorted(det["learned_factor"].items())))
        if det.get("suggested_budget"):
            typer.echo(f"suggested budget for its profile: {format_size(det['suggested_budget'])} "
                       f"(the most any run used, + 10 %)")


def parse_since(text: str, opt: str = "--since") -> float:
    """Epoch seconds from a duration back from now (90s, 10m, 2h, 1d) or a local ISO 8601 time."""
    from datetime import datetime

    from ..report import parse_period

    try:
        return time.time() - parse_period(text)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(text.strip()).timestamp()  # no zone given: local time
    except ValueError:
        fail(f"malformed {opt} {text!r}: a duration back from now (10m, 2h, 1d) or a time "
             "(2026-11-22T14:00, 2026-11-22 14:00:05+00:00)")


def _stamp(at: float) -> str:
    from datetime import datetime

    return datetime.fromtimestamp(at).astimezone().isoformat(timespec="milliseconds")


@app.command()
def logs(job: str = typer.Argument(..., help="job id or name"),
         follow: bool = typer.Option(False, "-f", "--follow", help="follow until the job ends"),
         tail: Optional[int] = typer.Option(None, "--tail", "-n", min=0, help="only the last N lines "
                                            "(after --since, when both are given)"),
         since: Optional[str] = typer.Option(None, "--since", help="only lines colo saw at or after this: "
                                             "a duration back from now (10m, 2h) or a time (2026-11-22T14:00)"),
         timestamps: bool = typer.Option(False, "-t", "--timestamps", help="put before each line the time "
                                         "colo first saw it in the job's output: the line was written then or "
                                         "at most one sample interval (1 s) before; lines of jobs that ended "
                                         "before colo noted such times show the job's end"),
         sock: Optional[Path] = SocketOpt, as_json: bool = JsonOpt):
    """A job's output, as it wrote it (stdout and stderr together). Jobs write no times into their
    output: colo notes when it sees each line arrive (see --timestamps).

    Example: colo logs -f --tail 20 7   ·   colo logs --since 10m --timestamps train
    """
    cut = parse_since(since) if since is not None else None
    try:
        c = Client(sock, timeout=None if follow else 30)
        ref = job_ref(c, job)
        if not (timestamps or as_json):
            for chunk in c.logs(ref, follow, tail, cut):
                sys.stdout.write(chunk)
                sys.stdout.flush()
            return
        for at, text in c.log_lines(ref, follow, tail, cut):
            if as_json:  # one object a line (a stream): {"at": epoch seconds or null, "line": text}
                sys.stdout.write(json.dumps({"at": at, "line": text}) + "\n")
            else:
                sys.stdout.write(f"{_stamp(at)} {text}" if at is not None else text)
            sys.stdout.flush()
    except ClientError as e:
        fail(str(e))


@app.command()
def wait(jobs: List[str] = typer.Argument(..., help="job ids or names"), sock: Optional[Path] = SocketOpt,
         as_json: bool = JsonOpt):
    """Block until the jobs end; say how each ended; exit with the first non-zero exit code among
    them, in the order given (1 for a job that ended without one: cancelled, lost, never started).
    An array's id or name waits for all its tasks. A job run again by `colo requeue` is followed to
    its newest copy: the wait ends with the copy's end.

    Example: colo wait 3 2 1 && echo all succeeded   ·   colo wait sweep
    """
    c = Client(sock, timeout=None)
    ended = _call(c.wait, _refs(c, jobs))
    if as_json:
        print_json(ended)
    first = 0
    for j in ended:  # every job is reported, failing or not, before the exit code is chosen
        code = j["exit_code"] if j["exit_code"] is not None else (0 if j["state"] == "succeeded" else 1)
        if not as_json:
            again = f"{j['waited_for']} (run again as job {j['id']})" if "waited_for" in j else j["id"]
            typer.echo(f"job {again}: {j['state']} ({safe(j['reason'])})", err=True)
        first = first or code
    raise typer.Exit(first)


@app.command()
def cancel(jobs: List[str] = typer.Argument(None, help="job ids or names; an array's id or name: its open tasks"),
           user: List[str] = typer.Option([], "--user", "-u", help="every open job of this user (repeatable)"),
           state: List[str] = typer.Option([], "--state", "-s", help="only open jobs in this state: queued, "
                                            "starting, running"),
           name: List[str] = typer.Option([], "--name", "-n", help="every open job of this name"),
           all_: bool = typer.Option(False, "--all", help="every open job of your own"),
           sock: Optional[Path] = SocketOpt, as_json: bool = JsonOpt):
    """Stop jobs: queued ones at once; running ones get SIGTERM, then SIGKILL after the grace
    period. Returns at once: the stops go on in the daemon, all at the same time.

    Example: colo cancel 7 8   ·   colo cancel --all --state queued   ·   colo cancel --name sweep   ·   colo cancel 12_3
    """
    c = client(sock)
    ids = _refs(c, jobs or [], open_only=True)
    if user or state or name or all_:
        me = _call(c.hello)["user"] if all_ else None
        picked = _open_jobs(c, user + ([me] if me else []), state, name)
        ids += [j["id"] for j in picked if j["id"] not in ids]
    elif not ids:
        fail("say which jobs: ids or names, or --user/--state/--name/--all")
    # the stop is under way; its end is recorded a moment later (or when the engine is back)
    _each(ids, c, as_json, lambda c, i: c.cancel(i), lambda j: f"job {j['id']}: " + (
        "stopping" if j["state"] in ("starting", "running") and j.get("cancel_by") else j["state"]))


def _each(jobs: list, sock_or_client, as_json: bool, fn, said, open_only: bool | None = True) -> None:
    """Do `fn` to each job (refs, or ids already resolved); one line each (or a JSON list); exit 1
    if any was refused. open_only: an array's ref means its open tasks; None: one job per ref."""
    c = sock_or_client if isinstance(sock_or_client, Client) else client(sock_or_client)
    ids = jobs if all(isinstance(i, int) for i in jobs) else (
        [job_ref(c, r) for r in jobs] if open_only is None else _refs(c, jobs, open_only=open_only))
    out, bad = [], 0
    for i in ids:
        try:
            j = fn(c, i)
        except ClientError as e:
            typer.echo(f"colo: {safe(str(e))}", err=True)
            bad += 1
            continue
        out.append(j)
        if not as_json:
            typer.echo(said(safe_tree(j)))
    if as_json:
        print_json(out)
    raise typer.Exit(1 if bad else 0)


@app.command()
def hold(jobs: List[str] = typer.Argument(..., help="ids or names of queued jobs"),
         sock: Optional[Path] = SocketOpt, as_json: bool = JsonOpt):
    """Keep queued jobs from starting until `colo release` (as Slurm's scontrol hold). ls, show
    and explain say who holds them. Your own jobs; any job for root and the admin group.

    Example: colo hold 7 8   ·   colo hold sweep-3   ·   colo hold 12 (an array's queued tasks)
    """
    _each(jobs, sock, as_json, lambda c, i: c.hold(i), lambda j: f"job {j['id']}: held by {j['held_by']}")


@app.command()
def release(jobs: List[str] = typer.Argument(..., help="ids or names of held jobs"),
            sock: Optional[Path] = SocketOpt, as_json: bool = JsonOpt):
    """Let held jobs start again: they keep their place in the queue.

    Example: colo release 7 8
    """
    _each(jobs, sock, as_json, lambda c, i: c.release(i), lambda j: f"job {j['id']}: released")


@app.command()
def edit(job: str = typer.Argument(..., help="id or name of a queued job"),
         gpu_mem: Optional[str] = typer.Option(None, "--gpu-mem", help="new GPU memory budget per GPU, e.g. 6GiB"),
         priority: Optional[int] = typer.Option(None, "--priority", help="new priority (higher starts first; "
                                                "users may set up to max_user_priority)"),
         name: Optional[str] = typer.Option(None, "--name", help="new name (letters, digits, . _ -)"),
         sock: Optional[Path] = SocketOpt, as_json: bool = JsonOpt):
    """Change a queued job's budget, priority or name, checked as `colo submit` checks them. A job
    that started keeps what it started with.

    Example: colo edit 7 --gpu-mem 6GiB --priority 5
    """
    changes: dict = {}
    if gpu_mem is not None:
        try:
            changes["gpu_mem"] = parse_size(gpu_mem)
        except BadSize as e:
            fail(str(e))
    if priority is not None:
        changes["priority"] = priority
    if name is not None:
        from .submitspec import utf8_only

        try:
            utf8_only(("--name", name))
        except SubmitError as e:
            fail(str(e))
        changes["name"] = name
    if not changes:
        fail("say what to change: --gpu-mem, --priority or --name")
    c = client(sock)
    j = _call(c.edit, job_ref(c, job), **changes)
    if as_json:
        return print_json(j)
    j = safe_tree(j)
    typer.echo(f"job {j['id']}: " + (f"name {j['name']}, " if j["name"] else "")
               + (f"budget {format_size_exact(j['budget'])}, " if j["ngpus"] else "") + f"priority {j['priority']}")


@app.command()
def requeue(jobs: List[str] = typer.Argument(..., help="ids or names of ended jobs"),
            sock: Optional[Path] = SocketOpt, as_json: bool = JsonOpt):
    """Run ended jobs (succeeded, failed, cancelled, lost) again: each is submitted anew as a copy
    with a new id, as pueue's restart does by default; the ended run stays in `colo history`.
    Prints the new ids.

    Example: colo requeue 7   ·   colo ls -q --all --state failed | xargs colo requeue
    """
    _each(jobs, sock, as_json, lambda c, i: c.requeue(i), lambda j: str(j["id"]), open_only=None)


@app.command()
def clean(jobs: List[str] = typer.Argument(None, help="only these ended jobs: ids, names, an array's id or "
                                           "name (all its tasks), ARRAY_INDEX (12_3)"),
          before: Optional[str] = typer.Option(None, "--before", help="only jobs that ended before this: a "
                                               "duration back from now (30d, 12h) or a local date or time "
                                               "(2026-11-01, 2026-11-01T08:00)"),
          failed_only: bool = typer.Option(False, "--failed-only", help="only jobs that did not succeed "
                                           "(failed, cancelled, lost)"),
          succeeded_only: bool = typer.Option(False, "--succeeded-only", help="only jobs that succeeded"),
          user: List[str] = typer.Option([], "--user", "-u", help="this user's jobs instead of your own "
                                         "(repeatable; others': root and the admin group)"),
          sock: Optional[Path] = SocketOpt, as_json: bool = JsonOpt):
    """Remove ended jobs for good, as pueue's clean: their rows in ls --all, history and report,
    their decisions, samples and logs. Your own jobs (anyone's for root and the admin group);
    never a queued, held or running one. What was learned (profiles, co-run factors) and fair-share
    use stay. Named jobs must all have ended, else nothing is removed. Kept for now: jobs a queued
    job depends on (--after), tasks of an array not all ended, and jobs whose container the engine
    has not let colo remove yet. The daemon can do it by itself: history_keep_days in its config.

    Example: colo clean   ·   colo clean --before 30d --succeeded-only   ·   colo clean 12 sweep   ·   colo clean -u bob
    """
    if failed_only and succeeded_only:
        fail("--failed-only and --succeeded-only exclude each other: give one, or neither for every ended job")
    states = ["succeeded"] if succeeded_only else ["failed", "cancelled", "lost"] if failed_only else None
    cut = max(0.0, parse_since(before, "--before")) if before is not None else None
    r = _call(client(sock).clean, jobs or None, cut, user or None, states)
    if as_json:
        return print_json(r)
    kept = (f" ({r['kept']} kept for now: queued jobs depend on them, their arrays have tasks not ended, "
            "or their containers are still to be removed)" if r["kept"] else "")
    typer.echo(f"removed {r['removed']} ended job{'' if r['removed'] == 1 else 's'}{kept}")


app.command("restart", help="The same as `colo requeue` (pueue's name for it).\n\nExample: colo restart 7")(requeue)


@app.command()
def gpus(sock: Optional[Path] = SocketOpt, as_json: bool = JsonOpt):
    """The GPUs as the daemon sees them, with the budgets placed on each (exact: what is usable is
    what a --gpu-mem may ask for).

    Example: colo gpus --json
    """
    r = _call(client(sock).gpus)
    if as_json:
        return print_json(r)
    if r["error"]:
        fail(r["error"])
    r = safe_tree(r)
    rows = [[g["index"], g["name"], g["uuid"], format_size(g["total"]), format_size(g["used"]),
             f"{format_size_exact(g['budgeted']) if g['budgeted'] else '0'} / {format_size_exact(g['usable'])}",
             g["compute_mode"], g["mps"],
             ",".join(map(str, g["jobs"])) or "-"] for g in r["gpus"]]
    typer.echo(table(rows, ["#", "NAME", "UUID", "MEMORY", "USED", "BUDGETED/USABLE", "MODE", "MPS", "JOBS"]))
    for g in r["gpus"]:
        if g.get("unbudgeted"):
            over = f" (jobs over their budgets: {', '.join(map(str, g['over']))})" if g.get("over") else ""
            typer.echo(f"GPU{g['index']}: {format_size(g['unbudgeted'])} in use outside any budget{over}; "
                       "not given to new jobs")
        if g.get("error"):
            typer.echo(f"GPU{g['index']} is out of service: {g['error']} (no new job is placed on it; "
                       "its running jobs are left alone)")
    if r["fake"]:
        typer.echo("(simulated GPUs)")


# accounting -----------------------------------------------------------------------------------
SinceOpt = typer.Option("7d", "--since", "-S", help="jobs that ended within this period (90m, 12h, 7d, 2w) or "
                        "since this local date or time (2026-11-01, 2026-11-01T08:00)")
UserOpt = typer.Option([], "--user", "-u", help="only this user's jobs (repeatable)")
HISTORY_TTY_ROWS = 200  # a terminal's bound on `colo history` without --limit; piped, every job


@app.command()
def history(since: Optional[str] = SinceOpt, user: List[str] = UserOpt,
            limit: Optional[int] = typer.Option(None, "--limit", "-n", help="only the newest N; 0: every job "
                                                f"(a terminal shows the newest {HISTORY_TTY_ROWS} otherwise)"),
            sock: Optional[Path] = SocketOpt, as_json: bool = JsonOpt):
    """Ended jobs, as sacct shows them: waited, ran, GPUs, GPU-hours, budget, exit, and SLOWDOWN: its
    run time over its profile's run time alone (— where it had no profile or did not succeed).
    The daemon filters and picks the newest in its database: months of history cost no more.

    Example: colo history --since 1d --user alice   ·   colo history --since 2026-11-01 | grep failed
    """
    from .. import report as rp

    if limit is not None and limit < 0:
        fail(f"--limit {limit}: a number of jobs, 0 or more (0: every job)")
    after = max(0.0, parse_since(since)) if since else None
    bound = limit or (HISTORY_TTY_ROWS if limit is None and not as_json and sys.stdout.isatty() else None)
    got = _call(client(sock).history, after, user, bound)
    figs = [rp.job_figures(r) for r in got["jobs"]]
    if as_json:
        return print_json(figs)
    # Only the texts users chose are escaped, a column at a time (safe_tree over whole replies
    # was most of a long history's time); the other cells are colo's own numbers and words.
    names = safe_all([f["name"] or "-" for f in figs])
    users = safe_all([str(f["user"]) for f in figs])
    states = safe_all([str(f["state"]) for f in figs])
    rows = [[f["id"], nm, us, st, "-" if f["exit_code"] is None else f["exit_code"],
             format_duration(f["waited"]), format_duration(f["ran"]), f["gpus"], f"{f['gpu_hours']:.2f}",
             format_size(f["budget"]) if f["budget"] else "-", rp.times(f["slowdown"])]
            for f, nm, us, st in zip(figs, names, users, states)]
    typer.echo(table(rows, ["ID", "NAME", "USER", "STATE", "EXIT", "WAITED", "RAN", "GPUS", "GPU-H", "BUDGET",
                            "SLOWDOWN"]))
    if got["left"]:  # under the table on a terminal; piped, apart from the rows
        typer.echo(f"({got['left']} older jobs in the period not shown: --limit N for more, --limit 0 for all)",
                   err=not sys.stdout.isatty())


@app.command()
def report(since: Optional[str] = SinceOpt, user: List[str] = UserOpt,
           svg: Optional[Path] = typer.Option(None, "--svg", help="also write the report as an SVG image to "
                                              "this file: GPU-hours and GiB-hours budgeted per user, and per day "
                                              "GPU-hours one job per GPU would take, busy and saved"),
           sock: Optional[Path] = SocketOpt, as_json: bool = JsonOpt):
    """Per user: jobs, GPU-hours, waiting, slowdown against alone (run time over the profile's run
    time alone, over the succeeded jobs that had a profile: "—" where none had); for the node:
    what sharing GPUs saved against one job per GPU (the GPU-hours the same jobs take each alone
    on its GPUs, less the GPU-hours the GPUs were busy).

    Example: colo report --since 30d   ·   colo report --since 30d --svg report.svg
    """
    from .. import report as rp

    r = _call(client(sock).report, max(0.0, parse_since(since)) if since else None, user)
    if svg is not None:
        try:  # the caller's own file, written as the caller
            span = "" if not since else f", last {since}" if since[-1:].isalpha() else f", since {since}"  # 7d, a date
            svg.write_text(rp.svg(r, f"colo report{span}"), encoding="utf-8")
        except OSError as e:
            fail(f"--svg {svg}: {e.strerror}")
    if as_json:
        return print_json(r)
    r = safe_tree(r)
    rows = [[u["user"], u["jobs"], u["succeeded"], u["failed"], f"{u['gpu_hours']:.2f}",
             f"{u.get('gpu_hours_idle', 0.0):.2f}",
             f"{u['gib_hours_budgeted']:.1f}", format_duration(u["wait_median"]), format_duration(u["wait_max"]),
             rp.times(u["slowdown_median"]), rp.times(u["slowdown_max"]), u["slowdown_jobs"]]
            for u in r["users"]]
    typer.echo(table(rows, ["USER", "JOBS", "OK", "FAILED", "GPU-H", "IDLE GPU-H", "GIB-H BUDGETED", "WAIT P50",
                            "WAIT MAX", "SLOWDOWN P50", "MAX", "OF JOBS"]))
    typer.echo("(slowdown: run time / the profile's run time alone, over the succeeded jobs that had a profile;")
    typer.echo(" idle: GPU-hours of jobs holding GPU memory with no GPU activity for idle_after or longer)")
    typer.echo("")
    typer.echo(f"{r['jobs']} jobs ended in the period. One job per GPU they would have taken "
               f"{r['gpu_hours_one_per_gpu']:.2f} GPU-hours; the GPUs were busy {r['gpu_hours_busy']:.2f}: "
               f"sharing saved {r['gpu_hours_saved']:.2f} GPU-hours ({r['saved_fraction'] * 100:.1f} %).")
    if r["users"]:
        typer.echo("")
        typer.echo("\n".join(rp.bars([(u["user"], u["gpu_hours"]) for u in r["users"]], unit=" GPU-h")))
    if len(r["days"]) > 1:
        typer.echo("\nGPU-hours saved per day:")
        typer.echo("\n".join(rp.bars([(d["day"], d["gpu_hours_saved"]) for d in r["days"]], unit=" GPU-h")))
    if svg is not None:
        typer.echo(f"\nwrote {svg}")


# the daemon ----------------------------------------------------------------------------------
@app.command()
def daemon(
    socket: Optional[Path] = typer.Option(None, "--socket", envvar="COLO_SOCKET", help="where to listen"),
    state_dir: Optional[Path] = typer.Option(None, "--state-dir", envvar="COLO_STATE_DIR",
                                             help="where the database, logs and profiles are kept"),
    config: Optional[Path] = typer.Option(None, "--config", envvar="COLO_CONFIG", help="TOML file"),
    fake_gpus: Optional[Path] = typer.Option(None, "--fake-gpus", help="use this simulated-driver state file"),
    verbose: bool = typer.Option(False, "-v", "--verbose", help="log each decision and start"),
):
    """Run the colo daemon in the foreground.

    Example: sudo colo daemon --config /etc/colo.toml -v
    """
    import asyncio
    import logging

    from ..config import Config, ConfigError
    from ..daemon.core import AlreadyRunning
    from ..daemon.server import serve
    from ..store import StoreError

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s colo %(levelname)s %(message)s")
    try:
        cfg = Config.load(config, socket=socket, state_dir=state_dir, fakegpu_state=fake_gpus)
        asyncio.run(serve(cfg))
    except (ConfigError, AlreadyRunning, StoreError, RuntimeError, PermissionError) as e:
        fail(str(e))


@app.command("run-budgeted", context_settings={"allow_interspersed_args": False})
def run_budgeted(command: List[str] = typer.Argument(..., help="the command, after --"),
                 gpu_mem: str = typer.Option(..., "--gpu-mem", help="budget per GPU, e.g. 2GiB")):
    """Run one command under the memory-budget interposer, without the daemon.

    Example: colo run-budgeted --gpu-mem 2GiB -- python infer.py
    """
    from ..node import interposer

    try:
        budget = parse_size(gpu_mem)
    except BadSize as e:
        fail(str(e))
    raise typer.Exit(interposer.run_budgeted(list(command), budget))


@app.command()
def doctor(sock: Optional[Path] = SocketOpt):
    """Check the pieces colo needs: interposer, NVML, MPS, Docker (as the daemon reaches it), daemon.

    Example: colo doctor
    """
    from .doctor import run_checks

    ok = run_checks(sock)
    raise typer.Exit(0 if ok else 1)


@app.command()
def top(once: bool = typer.Option(False, "--once", help="print one plain-text frame and exit"),
        lines: Optional[int] = typer.Option(None, "--lines", help="with --once: at most N lines (default: the "
                                            "terminal's height when printing to one; 0: no bound)"),
        sock: Optional[Path] = SocketOpt):
    """Live view of GPUs, jobs, budgets and the queue.

    Example: colo top   ·   colo top --once --lines 40 > snapshot.txt
    """
    from ..tui.app import run_top

    raise typer.Exit(run_top(Client(sock, timeout=10), once=once, lines=lines))


@app.command()
def demo(keep: bool = typer.Option(False, "--keep", help="keep the demo's state dir afterwards"),
         screenshot: Optional[Path] = typer.Option(None, "--screenshot", metavar="SVG",
                                                   help="save `colo top` as it stood while heavy-2 was kept off")):
    """Try colo on simulated GPUs: a private daemon, a handful of jobs, a summary.

    Example: colo demo --keep   ·   colo demo --screenshot docs/top.svg  (the README's picture)
    """
    from .demo import run_demo

    if screenshot is not None and not screenshot.parent.is_dir():
        fail(f"demo: no folder {screenshot.parent} for the screenshot", 2)
    raise typer.Exit(run_demo(keep=keep, screenshot=screenshot))


def _history_rows() -> list[dict]:
    return _call(Client(None).history, full=True)["jobs"]


cli_sim.load_history_rows = _history_rows  # `colo sim --from-history` replays what the daemon ran
cli_sim.register(app)
cli_sessions.register(app)  # colo shell, colo run, colo kernelspec


def main() -> None:
    app()


if __name__ == "__main__":
    main()
