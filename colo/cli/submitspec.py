"""What `colo submit` sends: the spec built from its options, and the short path that runs it.

Both the typer command (colo/cli/app.py) and the short path below build the spec with `build_spec`,
so they cannot disagree. The short path exists for speed only: `colo submit` is typed (and
scripted, in loops) far more than any other command, and importing typer/click costs more than
the whole submit round trip. It imports the standard library's small modules, colo.client and
this file: no typer, json, re, pathlib, typing or socket (bench/cli_bench.py checks). Anything
it does not know (an option another version added, --help, a malformed number) goes to the full
typer command instead, which says what is wrong the usual way.
"""
from __future__ import annotations

import os
import sys

from ..units import BadSize, parse_size


def safe(text: object) -> str:
    from ..textsafe import safe  # only where something is wrong (unicodedata)

    return safe(text)


class SubmitError(ValueError):
    """One line for the user."""


def utf8_only(*fields: tuple[str, object]) -> None:
    """Refuse bytes that are not UTF-8 (Python carries them as lone surrogates). colo passes a job's
    command as text (JSON to the daemon, and on to Docker's API, which is JSON too), so such bytes
    cannot reach a container unchanged; they used to be replaced by U+FFFD without a word."""
    for what, value in fields:
        for i, v in enumerate(value if isinstance(value, list) else [value]):
            if isinstance(v, str) and any("\udc80" <= ch <= "\udcff" for ch in v):
                raw = v.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
                where = f"word {i + 1} of {what}" if isinstance(value, list) else what
                raise SubmitError(f"{where} holds bytes that are not UTF-8 ({safe(raw)}): colo carries commands "
                                  "as UTF-8 text; pass such bytes through a file or an escape the program "
                                  "decodes (e.g. printf '\\xff')")


def build_spec(command: list[str] | None, *, image: str | None = None, process: bool = False,
               gpu_mem: str | None = None, gpus: int = 1, name: str | None = None, env: list[str] = (),
               mount: list[str] = (), workdir: str | None = None, after: list[int] = (), priority: int = 0,
               profile: str | None = None, retries: int = 0, cpus: float | None = None, mem: str | None = None,
               time: str | None = None, after_any: list[int] = (), after_fail: list[int] = (),
               array: str | None = None, gpu_id: list[str] = (), gpu_type: str | None = None) -> dict:
    if not command:
        raise SubmitError("missing command: give it after `--`, e.g. colo submit --gpu-mem 1GiB -- python train.py")
    if image and process:
        raise SubmitError("--image and --process exclude each other")
    if not image and not process:
        raise SubmitError("say where the job runs: --image IMAGE (a container) or --process (a host process)")
    size = None
    if gpu_mem is not None:
        try:
            size = parse_size(gpu_mem)
        except BadSize as e:
            raise SubmitError(str(e)) from None
    envd = {}
    for kv in env:
        k, sep, v = kv.partition("=")
        if not sep or not k:
            raise SubmitError(f"malformed --env {kv!r}: use K=V")
        envd[k] = v
    utf8_only(("the command", list(command)), ("--env", list(env)), ("--mount", list(mount)), ("--name", name),
              ("--workdir", workdir), ("--image", image))
    deps = {k: list(v) for k, v in (("after_any", after_any), ("after_fail", after_fail)) if v}  # sent if given
    spec = {**deps, "argv": list(command), "image": image, "name": name, "gpu_mem": size, "gpus": gpus,
            "env": envd,
            "mounts": list(mount), "workdir": workdir or (os.getcwd() if process else None), "after": list(after),
            "priority": priority, "profile": profile, "retries": retries}
    ids = []
    for part in ",".join(gpu_id).split(",") if gpu_id else ():
        if not part.strip().isdigit():
            raise SubmitError(f"malformed --gpu-id {','.join(gpu_id)!r}: GPU indices as `colo gpus` shows them, e.g. 0 or 0,2")
        ids.append(int(part))
    # sent only when given (a daemon of before them refuses what it does not know); checked by the daemon
    spec.update({k: v for k, v in (("cpus", cpus), ("mem", mem), ("time", time), ("array", array),
                                   ("gpu_ids", ids or None), ("gpu_type", gpu_type)) if v is not None})
    return spec


# the short path ------------------------------------------------------------------------------
_VALUE = {"--image": ("image", str), "--gpu-mem": ("gpu_mem", str), "--gpus": ("gpus", int),
          "--name": ("name", str), "--workdir": ("workdir", str), "--priority": ("priority", int),
          "--profile": ("profile", str), "--retries": ("retries", int), "--socket": ("socket", str),
          "--cpus": ("cpus", float), "--mem": ("mem", str), "--time": ("time", str), "--array": ("array", str),
          "--gpu-type": ("gpu_type", str)}
_MANY = {"--env": ("env", str), "--mount": ("mount", str), "--after": ("after", int),
         "--after-any": ("after_any", int), "--after-fail": ("after_fail", int), "--gpu-id": ("gpu_id", str)}
_FLAG = {"--process": "process", "--json": "json"}


def _parse(args: list[str]) -> dict | None:
    """submit's options as click would read them (options first; the command from the first word
    that is not one, or after --); None for anything this short parser does not know."""
    out: dict = {"env": [], "mount": [], "after": [], "after_any": [], "after_fail": [], "gpu_id": []}
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            i += 1
            break
        if not a.startswith("-") or a == "-":
            break
        opt, eq, val = a.partition("=")
        if opt in _FLAG and not eq:
            out[_FLAG[opt]] = True
            i += 1
            continue
        if opt not in _VALUE and opt not in _MANY:
            return None  # --help, an option of a newer colo, a typo: the full command answers
        if not eq:
            if i + 1 >= len(args):
                return None
            val = args[i + 1]
            i += 1
        i += 1
        key, typ = _VALUE.get(opt) or _MANY[opt]
        if typ in (int, float):
            try:
                val = typ(val)
            except ValueError:
                return None
        if opt in _MANY:
            out[key].append(val)
        else:
            out[key] = val
    out["command"] = args[i:]
    return out


def run_fast(args: list[str]) -> int | None:
    """`colo submit ARGS` without typer; None when the full command must handle it."""
    opts = _parse(args)
    if opts is None:
        return None
    sock = opts.pop("socket", None) or os.environ.get("COLO_SOCKET") or None
    as_json = opts.pop("json", False)
    command = opts.pop("command")
    from ..client import Client, ClientError

    try:
        spec = build_spec(command, **opts)
        job = Client(sock).submit(spec)
    except (SubmitError, ClientError) as e:
        sys.stderr.write(f"colo: {safe(str(e))}\n")
        return 1
    if as_json:
        import json

        sys.stdout.write(json.dumps(job, indent=2 if sys.stdout.isatty() else None, default=str) + "\n")
    else:
        sys.stdout.write(f"{job['id']}\n")
    return 0
