"""colo's side of its Slurm plugin (native/slurm/colo_spank.c), run by it as root:

    python3 -I -m colo.cli.slurm attach     --job J --step S --uid U --gid G [--profile NAME]
    python3 -I -m colo.cli.slurm batch-exit --job J --status WAITSTATUS
    python3 -I -m colo.cli.slurm end        --job J

It prints `env NAME=VALUE` lines (attach) for the plugin to put into the job's environment, or
`error TEXT` and exits 1. What it tells the daemon comes from Slurm itself: the plugin's ids and,
for the job's GPU memory, slurmctld's record of the `gpumem` GRES allocated on this node (asked
with scontrol; never the job's environment, which its user controls).
"""
from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys

from ..client import Client, ClientError

GRES = "gpumem"
_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}


class SlurmError(RuntimeError):
    pass


def slurm_count(text: str) -> int:
    """A GRES count as Slurm writes it: "4G" is 4 x 1024^3 (Slurm's suffixes are binary)."""
    m = re.fullmatch(r"(\d+)([KMGTP]?)", text.strip().upper())
    if not m:
        raise SlurmError(f"unreadable GRES count {text!r}")
    return int(m.group(1)) * _SUFFIX[m.group(2)]


def _scontrol(*args: str) -> str:
    try:
        r = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SlurmError(f"scontrol {' '.join(args)}: {e}") from None
    if r.returncode != 0:
        raise SlurmError(f"scontrol {' '.join(args)}: {r.stderr.strip() or r.returncode}")
    return r.stdout


def _indices(text: str) -> list[int]:
    """"0-1,3" -> [0, 1, 3]."""
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def allocation(show_job: str, node: str | None, expand=None) -> tuple[int, list[int]]:
    """(bytes of `gpumem`, indices of the `gpu` GRES bound, [] if none) that Slurm allocated to
    the job on `node`, from `scontrol show job -d` output.

    Each allocated node range has a line like `Nodes=vm[1-2] CPU_IDs=0-3 Mem=0
    GRES=gpu:1(IDX:0),gpumem(CNT:4294967296)`; `expand` turns a range into names (scontrol show
    hostnames), asked only when the job has several such lines."""
    rows = []
    for line in show_job.splitlines():
        m = re.search(r"\bNodes=(\S+)\s.*\bGRES=(\S*)", line)
        if m:
            gres = m.group(2)
            cnt = re.search(rf"(?:^|,){GRES}(?::[^(,]*)?\(CNT:(\d+)\)", gres)
            idx = re.search(r"(?:^|,)gpu(?::[^(,]*)*\(IDX:([\d,-]+)\)", gres)
            rows.append((m.group(1), int(cnt.group(1)) if cnt else 0, _indices(idx.group(1)) if idx else []))
    if not rows:  # no per-node detail: the request per node
        m = re.search(rf"\bTresPerNode=\S*?gres[:/]{GRES}:(\w+)", show_job)
        return (slurm_count(m.group(1)) if m else 0), []
    if len(rows) == 1:
        return rows[0][1], rows[0][2]
    for nodes, count, idx in rows:
        if node and node in (expand(nodes) if expand else [nodes]):
            return count, idx
    raise SlurmError(f"this node ({node}) is not among the job's nodes")


def profile_key(show_job: str) -> str | None:
    """The profile a job without --colo-profile runs under: its Slurm job name (the script's name
    unless -J says otherwise), so that runs of the same script learn one profile."""
    m = re.search(r"\bJobName=(.*)$", show_job, re.M)
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", m.group(1).strip()).strip("-.")[:57] if m else ""
    return f"slurm-{name}" if name else None


def _hostnames(nodes: str) -> list[str]:
    return _scontrol("show", "hostnames", nodes).split()


def job_exit(show_job: str) -> tuple[int, int]:
    """(exit code, signal) from `ExitCode=rc:sig`."""
    m = re.search(r"\bExitCode=(\d+):(\d+)", show_job)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _env_line(k: str, v: str) -> str:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k) or "\n" in v or "\0" in v:
        raise SlurmError(f"refusing a malformed variable {k!r}")
    return f"env {k}={v}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m colo.cli.slurm")
    ap.add_argument("action", choices=["attach", "batch-exit", "end"])
    ap.add_argument("--socket")
    ap.add_argument("--job", type=int, required=True)
    ap.add_argument("--step", type=int)
    ap.add_argument("--uid", type=int)
    ap.add_argument("--gid", type=int)
    ap.add_argument("--profile")
    ap.add_argument("--status", type=int, default=0)
    ap.add_argument("--node", default=os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0])
    a = ap.parse_args(argv)
    client = Client(a.socket, timeout=60)
    try:
        if a.action == "attach":
            if a.uid is None or a.gid is None:
                raise SlurmError("attach needs --uid and --gid")
            show = _scontrol("show", "job", "-d", str(a.job))
            mem, gpus = allocation(show, a.node, _hostnames)
            if mem == 0:  # no gpumem asked: no GPU (its memory would be nobody's budget), no daemon
                print(_env_line("CUDA_VISIBLE_DEVICES", ""))
                return 0
            res = client.slurm("attach", job=a.job, uid=a.uid, gid=a.gid, gpu_mem=mem, gpu_index=gpus,
                               profile=a.profile or profile_key(show))
            print("\n".join(_env_line(k, v) for k, v in sorted(res["env"].items())))
        elif a.action == "batch-exit":
            client.slurm("batch_exit", job=a.job, status=a.status)
        else:
            try:
                code, sig = job_exit(_scontrol("show", "job", str(a.job)))
            except SlurmError:
                code, sig = 0, 0  # Slurm forgot it already: the end is what matters
            client.slurm("end", job=a.job, exit_code=min(code, 255), signal=sig)
    except (ClientError, SlurmError) as e:
        print(f"error {' '.join(str(e).split())}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
