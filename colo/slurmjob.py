"""What colo reads from Slurm's records of a job (`scontrol show job [-d]`), and how a job's end
is told from its exit: pure functions, shared by the plugin's helper (colo/cli/slurm.py) and the
daemon (colo/daemon/external.py), which runs the commands (colo/daemon/slurmcmd.py)."""
from __future__ import annotations

import re

GRES = "shard"  # per GPU, bound to its device file; one shard = one MiB of GPU memory
MiB = 1 << 20
NOTE_MAX = 1000  # characters of colo's notes kept on a job's admin comment (the newest)


class SlurmError(RuntimeError):
    pass


def _indices(text: str) -> list[int]:
    """"0-1,3" -> [0, 1, 3]."""
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def job_record(show_job: str, job: int) -> str:
    """The record of job `job` itself in `scontrol show job` output, which holds every task of an
    array (and every component of a heterogeneous job) whose id is asked for."""
    for rec in re.split(r"\n\s*\n", show_job):
        if re.match(rf"\s*JobId={job}\b", rec):
            return rec
    raise SlurmError(f"Slurm has no record of job {job}")


def reference(rec: str) -> str:
    """How Slurm's commands name this one job: "12_3" (array task), "12+1" (heterogeneous
    component), else its id. The array's or the heterogeneous job's bare id names all of them."""
    arr = re.search(r"\bArrayJobId=(\d+) ArrayTaskId=(\d+)\b", rec)
    if arr:
        return f"{arr.group(1)}_{arr.group(2)}"
    het = re.search(r"\bHetJobId=(\d+) HetJobOffset=(\d+)\b", rec)
    if het:
        return f"{het.group(1)}+{het.group(2)}"
    return re.match(r"\s*JobId=(\d+)", rec).group(1)


def allocation(rec: str, node: str | None, expand=None) -> tuple[int, list[int], list[int]]:
    """(bytes of GPU memory from the `shard` GRES, the GPU indices those shards are on, the GPU
    indices of a `gpu` GRES) that Slurm allocated to the job on `node`, from its record in
    `scontrol show job -d`.

    Each allocated node range has a line like `Nodes=n[1-2] CPU_IDs=0-3 Mem=0
    GRES=gpu:1(IDX:0),shard:4096(IDX:1)` (a type may follow the name: `shard:a100:4096`);
    `expand` turns a range into names (scontrol show hostnames), asked only when the job has
    several such lines."""
    rows = []
    for line in rec.splitlines():
        m = re.search(r"\bNodes=(\S+)\s.*\bGRES=(\S*)", line)
        if m:
            gres = m.group(2)
            sh = re.search(rf"(?:^|,){GRES}(?::[^:(,]+)?:(\d+)\(IDX:([\d,-]+)\)", gres)
            gpu = re.search(r"(?:^|,)gpu(?::[^:(,]+)?:\d+\(IDX:([\d,-]+)\)", gres)
            rows.append((m.group(1), int(sh.group(1)) * MiB if sh else 0, _indices(sh.group(2)) if sh else [],
                         _indices(gpu.group(1)) if gpu else []))
    if not rows:
        return 0, [], []
    if len(rows) == 1:
        return rows[0][1:]
    for nodes, mem, on, gpus in rows:
        if node and node in (expand(nodes) if expand else [nodes]):
            return mem, on, gpus
    raise SlurmError(f"this node ({node}) is not among the job's nodes")


def profile_key(rec: str) -> str | None:
    """The profile a job without --colo-profile runs under: its Slurm job name (the script's name
    unless -J says otherwise), so that runs of the same script learn one profile."""
    m = re.search(r"\bJobName=(.*)$", rec, re.M)
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", m.group(1).strip()).strip("-.")[:57] if m else ""
    return f"slurm-{name}" if name else None


def admin_comment(rec: str) -> str:
    """The job's admin comment as its record shows it ("" for none)."""
    m = re.search(r"^\s*AdminComment=(.*?)\s*$", rec, re.M)
    return m.group(1) if m and m.group(1) != "(null)" else ""


def noted(old: str, text: str) -> str:
    """An admin comment with colo's `text` after what is there (an admin's own words are kept), the
    newest NOTE_MAX characters."""
    return (f"{old}; {text}" if old else text)[-NOTE_MAX:]


def _cancelled(code: int, sig: int) -> tuple[int, int]:
    """A batch shell whose child died of Slurm's SIGTERM or SIGKILL (scancel, a time limit) exits
    143 or 137: that is the signal, so the job is cancelled in colo as it is in Slurm, not failed."""
    if not sig and code in (128 + 15, 128 + 9):
        return 0, code - 128
    return code, sig


def job_exit(rec: str) -> tuple[int, int]:
    """(exit code, signal) from the record's `ExitCode=rc:sig`."""
    m = re.search(r"\bExitCode=(\d+):(\d+)", rec)
    return _cancelled(*((int(m.group(1)), int(m.group(2))) if m else (0, 0)))


def status_exit(status: int) -> tuple[int, int]:
    """(exit code, signal) from the batch script's wait status, as SPANK's task_exit has it (the
    same figures Slurm's ExitCode= shows for the job)."""
    if status & 0x7F:  # killed by a signal
        return _cancelled(0, status & 0x7F)
    return _cancelled((status >> 8) & 0xFF, 0)
