"""The `colo` command. Thin: parse, call the client, print (a table, or JSON with --json)."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import List, Optional

import typer

from . import cli_sim
from .client import Client, ClientError
from .textsafe import safe, safe_tree
from .units import BadSize, format_duration, format_size, parse_size

app = typer.Typer(help="colo: share this node's GPUs: a queue, memory budgets, MPS or time-slicing.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
SocketOpt = typer.Option(None, "--socket", envvar="COLO_SOCKET", help="daemon socket")
JsonOpt = typer.Option(False, "--json", help="print JSON for scripts")


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
    name: Optional[str] = typer.Option(None, "--name"),
    env: List[str] = typer.Option([], "--env", help="K=V, repeatable"),
    mount: List[str] = typer.Option([], "--mount", help="SRC:DST[:ro], repeatable"),
    workdir: Optional[str] = typer.Option(None, "--workdir"),
    after: List[int] = typer.Option([], "--after", help="start only after this job succeeded"),
    priority: int = typer.Option(0, "--priority"),
    profile: Optional[str] = typer.Option(None, "--profile", help="profile name this job runs under"),
    retries: int = typer.Option(0, "--retries", help="requeue after an MPS server fault, up to N times"),
    sock: Optional[Path] = SocketOpt, as_json: bool = JsonOpt,
):
    """Queue a job; prints its id."""
    if not command:
        fail("missing command: give it after `--`, e.g. colo submit --gpu-mem 1GiB -- python train.py")
    if image and process:
        fail("--image and --process exclude each other")
    if not image and not process:
        fail("say where the job runs: --image IMAGE (a container) or --process (a host process)")
    size = None
    if gpu_mem is not None:
        try:
            size = parse_size(gpu_mem)
        except BadSize as e:
            fail(str(e))
    envd = {}
    for kv in env:
        k, sep, v = kv.partition("=")
        if not sep or not k:
            fail(f"malformed --env {kv!r}: use K=V")
        envd[k] = v
    spec = {"argv": list(command), "image": image, "name": name, "gpu_mem": size, "gpus": gpus, "env": envd,
            "mounts": list(mount), "workdir": workdir or (os.getcwd() if process else None), "after": list(after),
            "priority": priority, "profile": profile, "retries": retries}
    job = _call(client(sock).submit, spec)
    print_json(job) if as_json else typer.echo(job["id"])


def job_row(j: dict, now: float) -> list[str]:
    gpu = ",".join(u[:12] for u in j["gpus"]) or "-"
    return [j["id"], j["name"] or "-", j["user"], j["state"], gpu, j["mode"] or "-",
            format_size(j["budget"]) if j["budget"] else "-", format_duration(now - j["submitted_at"]),
            (j["reason"] or "")[:60]]


@app.command("ls")
def ls(all_: bool = typer.Option(True, "--all/--active", help="include ended jobs"),
       limit: Optional[int] = typer.Option(None, "--limit", help="only the newest N"), sock: Optional[Path] = SocketOpt,
       as_json: bool = JsonOpt):
    """List jobs: id, name, user, state, gpu, mode, budget, age, reason."""
    jobs = _call(client(sock).ls, all_, limit)
    if as_json:
        return print_json(jobs)
    now = time.time()
    typer.echo(table([job_row(j, now) for j in safe_tree(jobs)],
                     ["ID", "NAME", "USER", "STATE", "GPU", "MODE", "BUDGET", "AGE", "REASON"]))


@app.command()
def show(job_id: int, sock: Optional[Path] = SocketOpt, as_json: bool = JsonOpt):
    """Everything known about one job."""
    j = _call(client(sock).show, job_id)
    if as_json:
        return print_json(j)
    j = safe_tree(j)
    spec = j["spec"]
    lines = [f"job {j['id']}" + (f" ({j['name']})" if j["name"] else ""),
             f"  user:      {j['user']} (uid {j['uid']})",
             f"  state:     {j['state']}" + (f", exit code {j['exit_code']}" if j["exit_code"] is not None else ""),
             f"  reason:    {j['reason']}" + (f" (cancel asked by {j['cancel_by']}, under way)"
                                                  if j.get("cancel_by") else ""),
             f"  runs:      {'image ' + spec['image'] if spec['image'] else 'host process'}: {' '.join(spec['argv'])}",
             f"  budget:    {format_size(j['budget'])} x {spec['gpus']} GPU(s)" if spec["gpus"] else "  budget:    no GPU",
             f"  gpus:      {', '.join(j['gpus']) or '-'}   mode: {j['mode'] or '-'}"]
    if "used" in j:
        lines.append(f"  in use:    {format_size(j['used'])} (refused allocations: {j['refused']})")
    if j["decision"]:
        lines.append(f"  decision:  {j['decision']['reason']}")
    lines.append(f"  log:       {j['log']}")
    lines.append("  events:")
    for e in j["events"]:
        lines.append(f"    {time.strftime('%H:%M:%S', time.localtime(e['at']))}  {e['old'] or '-':>9} -> "
                     f"{e['new']:<9}  {e['reason']}")
    typer.echo("\n".join(lines))


@app.command()
def explain(job_id: int, sock: Optional[Path] = SocketOpt, as_json: bool = JsonOpt):
    """Why a job was placed where it was, or why it waits."""
    r = _call(client(sock).explain, job_id)
    if as_json:
        return print_json(r)
    r = safe_tree(r)
    d = r["decision"]
    if d is None:
        typer.echo(f"job {job_id} ({r['state']}): no placement decision yet. {r['reason']}")
    else:
        typer.echo(f"job {job_id} ({r['state']}): {d['reason']}")


@app.command()
def logs(job_id: int, follow: bool = typer.Option(False, "-f", "--follow", help="follow until the job ends"),
         tail: Optional[int] = typer.Option(None, "--tail", help="only the last N lines"),
         sock: Optional[Path] = SocketOpt):
    """A job's output."""
    try:
        for chunk in Client(sock, timeout=None if follow else 30).logs(job_id, follow, tail):
            sys.stdout.write(chunk)
            sys.stdout.flush()
    except ClientError as e:
        fail(str(e))


@app.command()
def wait(job_ids: List[int], sock: Optional[Path] = SocketOpt, as_json: bool = JsonOpt):
    """Block until the jobs end; exit with the first non-zero exit code among them."""
    jobs = _call(Client(sock, timeout=None).wait, list(job_ids))
    if as_json:
        print_json(jobs)
    for j in jobs:
        code = j["exit_code"] if j["exit_code"] is not None else (0 if j["state"] == "succeeded" else 1)
        if not as_json:
            typer.echo(f"job {j['id']}: {j['state']} ({safe(j['reason'])})", err=True)
        if code:
            raise typer.Exit(code)


@app.command()
def cancel(job_ids: List[int], sock: Optional[Path] = SocketOpt):
    """Stop jobs: queued ones at once, running ones gracefully, then forced after a grace period."""
    c = client(sock)
    for i in job_ids:
        j = _call(c.cancel, i)
        # the stop is under way; its end is recorded a moment later (or when the engine is back)
        state = "stopping" if j["state"] in ("starting", "running") and j.get("cancel_by") else j["state"]
        typer.echo(f"job {j['id']}: {state}")


@app.command()
def gpus(sock: Optional[Path] = SocketOpt, as_json: bool = JsonOpt):
    """The GPUs as the daemon sees them, with the budgets placed on each."""
    r = _call(client(sock).gpus)
    if as_json:
        return print_json(r)
    if r["error"]:
        fail(r["error"])
    r = safe_tree(r)
    rows = [[g["index"], g["name"], g["uuid"], format_size(g["total"]), format_size(g["used"]),
             f"{format_size(g['budgeted'])} / {format_size(g['usable'])}", g["compute_mode"], g["mps"],
             ",".join(map(str, g["jobs"])) or "-"] for g in r["gpus"]]
    typer.echo(table(rows, ["#", "NAME", "UUID", "MEMORY", "USED", "BUDGETED/USABLE", "MODE", "MPS", "JOBS"]))
    for g in r["gpus"]:
        if g.get("error"):
            typer.echo(f"GPU{g['index']} is out of service: {g['error']} (no new job is placed on it; "
                       "its running jobs are left alone)")
    if r["fake"]:
        typer.echo("(simulated GPUs)")


# the daemon ----------------------------------------------------------------------------------
@app.command()
def daemon(
    socket: Optional[Path] = typer.Option(None, "--socket", envvar="COLO_SOCKET"),
    state_dir: Optional[Path] = typer.Option(None, "--state-dir", envvar="COLO_STATE_DIR"),
    config: Optional[Path] = typer.Option(None, "--config", envvar="COLO_CONFIG", help="TOML file"),
    fake_gpus: Optional[Path] = typer.Option(None, "--fake-gpus", help="use this simulated-driver state file"),
    verbose: bool = typer.Option(False, "-v", "--verbose"),
):
    """Run the colo daemon in the foreground."""
    import asyncio
    import logging

    from .config import Config, ConfigError
    from .daemon.core import AlreadyRunning
    from .daemon.server import serve
    from .store import StoreError

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
    """Run one command under the memory-budget interposer, without the daemon."""
    from . import interposer

    try:
        budget = parse_size(gpu_mem)
    except BadSize as e:
        fail(str(e))
    raise typer.Exit(interposer.run_budgeted(list(command), budget))


@app.command()
def doctor(sock: Optional[Path] = SocketOpt):
    """Check the pieces colo needs: interposer, NVML, MPS, Docker, daemon."""
    from .doctor import run_checks

    ok = run_checks(sock)
    raise typer.Exit(0 if ok else 1)


@app.command()
def top(once: bool = typer.Option(False, "--once", help="print one plain-text frame and exit"),
        sock: Optional[Path] = SocketOpt):
    """Live view of GPUs, jobs, budgets and the queue."""
    from .tui.app import run_top

    raise typer.Exit(run_top(Client(sock, timeout=10), once=once))


@app.command()
def demo(keep: bool = typer.Option(False, "--keep", help="keep the demo's state dir afterwards")):
    """Try colo on simulated GPUs: a private daemon, a handful of jobs, a summary."""
    from .demo import run_demo

    raise typer.Exit(run_demo(keep=keep))


def _history() -> list[dict]:
    return _call(Client(None).history)


cli_sim.load_history_rows = _history  # `colo sim --from-history` replays what the daemon ran
cli_sim.register(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
