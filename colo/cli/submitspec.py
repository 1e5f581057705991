"""`colo submit`: the spec built from its options (colo/cli/options.py), sent, and with --wait or
--follow how the job ended.

`colo submit` is typed (and scripted, in loops) far more than any other command: it runs without
typer (colo/cli/entry.py), and this module imports the standard library's small modules and
colo.client only: no json, re, pathlib, typing or socket (bench/cli_bench.py checks).
"""
from __future__ import annotations

import os
import sys
import time

from ..units import BadSize, parse_size
from .out import Fail
from .refs import kind
from .textcheck import utf8_only


def build_spec(command: list[str] | None, *, image: str | None = None, process: bool = False,
               gpu_mem: str | None = None, gpus: int = 1, name: str | None = None, env: list[str] = (),
               mount: list[str] = (), workdir: str | None = None, after: list[str] = (), priority: int = 0,
               profile: str | None = None, retries: int = 0, cpus: float | None = None, mem: str | None = None,
               time: str | None = None, after_any: list[str] = (), after_fail: list[str] = (),
               array: str | None = None, gpu_id: list[str] = (), gpu_type: str | None = None, hold: bool = False,
               begin: float | None = None, output: str | None = None, error: str | None = None,
               on_end: str | None = None, mail_type: str | None = None, mail_user: str | None = None,
               tasks: int | None = None) -> dict:
    if not command:
        raise Fail("missing command: give it after `--`, e.g. colo submit --gpu-mem 1GiB -- python train.py")
    if image and process:
        raise Fail("--image and --process exclude each other")
    if not image and not process:
        raise Fail("say where the job runs: --image IMAGE (a container) or --process (a host process)")
    size = None
    if gpu_mem is not None:
        try:
            size = parse_size(gpu_mem)
        except BadSize as e:
            raise Fail(str(e)) from None
    envd = {}
    for kv in env:
        k, sep, v = kv.partition("=")
        if not sep or not k:
            raise Fail(f"malformed --env {kv!r}: use K=V")
        envd[k] = v
    utf8_only(("the command", list(command)), ("--env", list(env)), ("--mount", list(mount)), ("--name", name),
              ("--workdir", workdir), ("--image", image), ("--output", output), ("--error", error),
              ("--on-end", on_end))
    for key, refs in (("after", after), ("after_any", after_any), ("after_fail", after_fail)):
        for r in refs:
            try:
                kind(r)  # strictly: 3_1 is task 1 of array 3, not job 31
            except Fail as e:
                raise Fail(f"--{key.replace('_', '-')}: {e}") from None
    # dependencies are sent as written (the daemon resolves names and arrays), and only if given
    deps = {k: list(v) for k, v in (("after_any", after_any), ("after_fail", after_fail)) if v}
    where = workdir or os.getcwd()
    files = {k: os.path.join(where, v) for k, v in (("output", output), ("error", error)) if v}  # from the workdir
    spec = {**deps, "argv": list(command), "image": image, "name": name, "gpu_mem": size, "gpus": gpus,
            "env": envd,
            "mounts": list(mount), "workdir": workdir or (os.getcwd() if process else None), "after": list(after),
            "priority": priority, "profile": profile, "retries": retries}
    ids = []
    for part in ",".join(gpu_id).split(",") if gpu_id else ():
        if not part.strip().isdigit():
            raise Fail(f"malformed --gpu-id {','.join(gpu_id)!r}: GPU indices as `colo gpus` shows them, e.g. 0 or 0,2")
        ids.append(int(part))
    # sent only when given (a daemon of before them refuses what it does not know); checked by the daemon
    spec.update({k: v for k, v in (("cpus", cpus), ("mem", mem), ("time", time), ("array", array),
                                   ("gpu_ids", ids or None), ("gpu_type", gpu_type), ("hold", hold or None),
                                   ("begin", begin), ("on_end", on_end), ("mail_type", mail_type),
                                   ("mail_user", mail_user), ("tasks", tasks), *files.items()) if v is not None})
    return spec


def _env_files(paths: list[str]) -> list[str]:
    """K=V lines of --env-file files (# comments), read as the caller: their own files."""
    out = []
    for f in paths:
        try:
            with open(f, encoding="utf-8") as fh:
                out += [ln.strip() for ln in fh if ln.strip() and not ln.lstrip().startswith("#")]
        except OSError as e:
            raise Fail(f"--env-file {f}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise Fail(f"--env-file {f}: not UTF-8 text") from None
    return out


def submit(command: list[str], image: str | None = None, process: bool = False, gpu_mem: str | None = None,
           gpus: int = 1, name: str | None = None, env: list[str] = (), env_file: list[str] = (),
           mount: list[str] = (), workdir: str | None = None, after: list[str] = (), after_any: list[str] = (),
           after_fail: list[str] = (), priority: int = 0, profile: str | None = None, retries: int = 0,
           hold: bool = False, begin: str | None = None, delay: str | None = None, output: str | None = None,
           error: str | None = None, on_end: str | None = None, mail_type: str | None = None,
           mail_user: str | None = None, wait_: bool = False, follow: bool = False, grow: bool = False,
           no_suspend: bool = False,
           cpus: float | None = None, mem: str | None = None, time_limit: str | None = None, array: str | None = None,
           gpu_id: list[str] = (), gpu_type: str | None = None, sock: str | None = None, as_json: bool = False,
           tasks: int | None = None) -> int:
    """`colo submit`: the spec from the options (build_spec), the daemon's answer, and with --wait or
    --follow how the job ended."""
    from . import when

    if begin is not None and delay is not None:
        raise Fail("--begin and --delay both say when to start: give one")
    at = when.begin(begin) if begin is not None else (time.time() + when.delay(delay) if delay is not None else None)
    spec = build_spec(command, image=image, process=process, gpu_mem=gpu_mem, gpus=gpus, name=name,
                          env=[*env, *_env_files(env_file)], mount=mount, workdir=workdir, after=after,
                          priority=priority, profile=profile, retries=retries, cpus=cpus, mem=mem, time=time_limit,
                          after_any=after_any, after_fail=after_fail, array=array, gpu_id=gpu_id, gpu_type=gpu_type,
                          hold=hold, begin=at, output=output, error=error, on_end=on_end, mail_type=mail_type,
                          mail_user=mail_user, tasks=tasks)
    if follow and array:
        raise Fail("--follow shows one job's output: with --array use --wait, then colo logs ARRAY_INDEX")
    if grow:  # sent only when asked for: a daemon of before --grow takes the spec unchanged
        spec["grow"] = True
    if no_suspend:  # likewise
        spec["no_suspend"] = True
    from ..client import Client

    c = Client(sock)
    job = c.submit(spec)
    waits = wait_ or follow
    if as_json and not waits:
        from .out import print_json

        print_json(job)
    elif not as_json:
        sys.stdout.write(f"{job['id']}\n")
        sys.stdout.flush()
    if not waits:
        return 0
    from . import jobview

    if follow:  # like `docker run`: the output, then the job's exit code
        code = jobview.logs(str(job["id"]), follow=True, sock=sock)
        if code:
            return code
    ids = [str(i) for i in job.get("tasks") or [job["id"]]]
    if not as_json:
        return jobview.wait(ids, sock=sock)
    ended = Client(sock, timeout=None).wait([int(t) for t in ids])  # how it ended, for scripts
    from .out import print_json

    print_json(ended if job.get("tasks") else ended[0])
    return next((jobview.exit_code(j) for j in ended if jobview.exit_code(j)), 0)
