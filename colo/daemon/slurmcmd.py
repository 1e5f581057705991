"""Slurm's commands as colo runs them, as root, for its plugin's helper (colo/cli/slurm.py) and its
daemon (external.py): argv only (no shell), a bounded time, and every read with `--local` (no
federation lookup first: one slurmctld RPC less per command, where slurmctld serves every node).
What is read is parsed in colo/slurmjob.py."""
from __future__ import annotations

import logging
import subprocess

from ..slurmjob import SlurmError, admin_comment, noted

log = logging.getLogger("colo")
READS = frozenset({"show", "listpids"})  # scontrol's subcommands that only read


def run(cmd: str, *args: str, timeout: float = 20) -> subprocess.CompletedProcess | None:
    """`cmd args`, reads local to this cluster; None when it could not run or ran past `timeout`."""
    local = cmd == "squeue" or (cmd == "scontrol" and args and args[0] in READS)
    try:
        return subprocess.run([cmd, *(["--local"] if local else []), *args], capture_output=True, text=True,
                              timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None


def output(cmd: str, *args: str, timeout: float = 30) -> str:
    """What `cmd args` prints; SlurmError with Slurm's words when it fails."""
    r = run(cmd, *args, timeout=timeout)
    if r is None:
        raise SlurmError(f"{cmd} {' '.join(args)}: did not run or answer within {timeout:g} s")
    if r.returncode != 0:
        raise SlurmError(f"{cmd} {' '.join(args)}: {r.stderr.strip() or r.returncode}")
    return r.stdout


def scontrol(*args: str) -> str:
    return output("scontrol", *args)


def admin_note(ref: str, text: str, old: str | None = None) -> bool:
    """`text` added to the Slurm job's admin comment, after what is there (`old`, as the caller
    read it from the job's record; read here when None): slurmctld shows it (`scontrol show job`)
    and slurmdbd stores it (`sacct -o AdminComment`). Only root and Slurm's operators may set it,
    so users cannot forge it. One `scontrol update` when the caller knows the comment."""
    if old is None:
        r = run("scontrol", "show", "job", ref)
        old = admin_comment(r.stdout) if r and r.returncode == 0 else ""
    r = run("scontrol", "update", f"job={ref}", f"admincomment={noted(old, text)}")
    if r is None or r.returncode != 0:
        log.warning("Slurm job %s: cannot write colo's note on it (%s): %s", ref,
                    (r.stderr.strip() if r else "scontrol did not answer"), text)
        return False
    return True
