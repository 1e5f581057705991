"""Admin chores: `colo drain`, `colo undrain` (GPUs out of service and back) and `colo config check`."""
from __future__ import annotations

import os
from pathlib import Path

from ..client import Client
from ..textsafe import safe
from .out import Fail, echo, print_json, warn

DEFAULT_CONFIG = "/etc/colo/colo.toml"  # packaging/colo.service's --config


def drain(gpus: list[str], reason: str | None = None, now: bool = False, sock: str | None = None,
          as_json: bool = False) -> int:
    if not gpus:
        raise Fail("name the GPUs to drain, by index or UUID (colo gpus shows both)")
    if not reason or not reason.strip():
        raise Fail("drain needs --reason: why the GPU is out of service (waiting jobs are told it)")
    r = Client(sock).drain(gpus, reason, now)
    if as_json:
        print_json(r)
        return 0
    for g in r["gpus"]:
        echo(f"GPU {g['index']}: {safe(g['drained'])}")
    for m in r.get("moved", []):  # --now: per job, suspended where it can be, else requeued
        echo(f"job {m['id']}: {m['did']}" + (f" ({safe(m['why'])})" if m["why"] else ""))
    for j in r.get("left", []):
        echo(f"job {j['id']} left running: {safe(j['why'])}")
    return 0


def undrain(gpus: list[str], sock: str | None = None, as_json: bool = False) -> int:
    if not gpus:
        raise Fail("name the GPUs to undrain, by index or UUID")
    r = Client(sock).undrain(gpus)
    if as_json:
        print_json(r)
        return 0
    for g in r["gpus"]:
        echo(f"GPU {g['index']}: " + ("back in service" if g["was_drained"] else "was not drained"))
    return 0


def config(action: str, file: str | None = None) -> int:
    """`colo config check [FILE]`: the daemon's own validator (colo/config.py), every error."""
    if action != "check":
        raise Fail(f"colo config takes `check [FILE]`, not {action!r}")
    from ..config import check

    path = Path(file or os.environ.get("COLO_CONFIG") or DEFAULT_CONFIG)
    errors = check(path)
    for e in errors:
        warn(e)
    if errors:
        return 1
    echo("ok")
    return 0
