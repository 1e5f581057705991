"""colo's side of its Slurm plugin (native/slurm/colo_spank.c), run by it as root:

    python3 -I -m colo.cli.slurm attach     --job J --step S --uid U --gid G --node N [--profile NAME]
    python3 -I -m colo.cli.slurm batch-exit --job J --status WAITSTATUS
    python3 -I -m colo.cli.slurm end        --job J --node N

and by an admin:

    python3 -m colo.cli.slurm gres-conf --node N [--devices /dev/nvidia%d]

and by slurmd, as slurm.conf's HealthCheckProgram (through a two-line script, docs/slurm.md):

    python3 -I -m colo.cli.slurm healthcheck [--socket S] [--timeout 10]   (node: SLURMD_NODENAME)

attach prints `env NAME=VALUE` lines for the plugin to put into the job's environment, or `error
TEXT` and exits 1: the step's tasks then do not run, and TEXT is what the job's output says. What
it tells the daemon comes from Slurm itself: the plugin's ids (J is the job's own id: an array
task's or a heterogeneous component's own), the node's name as slurmd knows it (SLURMD_NODENAME,
passed explicitly: the plugin runs this with an empty environment), and slurmctld's record of the
job's allocation on that node (`scontrol show job -d`; never the job's environment, which its
user controls): its `gres/shard` count (one shard is one MiB of GPU memory) and the GPU Slurm
bound them to, or the GPUs of a plain `gres/gpu` job.

When colo cannot place the job on that GPU now, or its daemon does not answer, the job is not
failed: it is requeued in Slurm (its admin comment says why), and a node whose daemon does not
answer is drained with the reason, so Slurm sends no more jobs there. A daemon that went away
while answering (killed, restarting) is asked again once it is back (_ask) before that.
"""
from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import time

from ..client import Client, ClientError, ConnectionLost, DaemonUnavailable

GRES = "shard"  # per GPU, bound to its device file; one shard = one MiB of GPU memory
MiB = 1 << 20
NOTE_MAX = 1000  # characters of colo's notes kept on a job's admin comment (as external.py)
# The share of its --timeout (the plugin's timeout less 10 s) a helper whose daemon went away while
# answering may spend waiting for it to be back; the rest is for draining the node and requeueing.
RESTART_SHARE = 0.8


class SlurmError(RuntimeError):
    pass


def _run(cmd: str, *args: str) -> str:
    try:
        r = subprocess.run([cmd, *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SlurmError(f"{cmd} {' '.join(args)}: {e}") from None
    if r.returncode != 0:
        raise SlurmError(f"{cmd} {' '.join(args)}: {r.stderr.strip() or r.returncode}")
    return r.stdout


def _scontrol(*args: str) -> str:
    return _run("scontrol", *args)


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


def _hostnames(nodes: str) -> list[str]:
    return _scontrol("show", "hostnames", nodes).split()


def job_exit(rec: str) -> tuple[int, int]:
    """(exit code, signal) from `ExitCode=rc:sig`. A batch shell whose child died of Slurm's
    SIGTERM or SIGKILL (scancel, a time limit) exits 143 or 137: that is the signal, so the job is
    cancelled in colo as it is in Slurm, not failed."""
    m = re.search(r"\bExitCode=(\d+):(\d+)", rec)
    code, sig = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
    if not sig and code in (128 + 15, 128 + 9):
        return 0, code - 128
    return code, sig


def _env_line(k: str, v: str) -> str:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k) or "\n" in v or "\0" in v:
        raise SlurmError(f"refusing a malformed variable {k!r}")
    return f"env {k}={v}"


def _note(ref: str, rec: str, text: str) -> None:
    """`text` added to the job's admin comment (as external.admin_note; a failure is not the job's)."""
    m = re.search(r"^\s*AdminComment=(.*?)\s*$", rec, re.M)
    old = m.group(1) if m and m.group(1) != "(null)" else ""
    try:
        _scontrol("update", f"job={ref}", f"admincomment={(f'{old}; {text}' if old else text)[-NOTE_MAX:]}")
    except SlurmError:
        pass


def _requeue(ref: str, rec: str, why: str) -> str:
    """The job back in Slurm's queue (it runs again later, here or elsewhere), with the reason on it."""
    _note(ref, rec, f"colo: requeued: {why}")
    try:
        _scontrol("requeue", ref)
    except SlurmError as e:  # an interactive job (salloc, srun) or one submitted with --no-requeue
        return f"cannot run here now, and it could not be requeued ({e}): {why}"
    return f"requeued, it runs again later: {why}"


def _drain(node: str, why: str) -> None:
    """No more jobs for a node whose colo does not answer (scontrol update ... state=resume, once it does)."""
    try:
        _scontrol("update", f"nodename={node}", "state=drain", f"reason=colo: {why}"[:200])
    except SlurmError:
        pass


def _ask(client: Client, deadline: float, action: str, **args) -> dict:
    """client.slurm(action, ...), asked again once the daemon is back if it went away while
    answering (killed, and restarted by systemd: a job's step must not fail for that), until
    `deadline` (time.monotonic()). Every action may be asked twice (the daemon finds the job it
    placed, or finishes a placement its restart cut short). A daemon that was not there to begin
    with is not waited for: the caller drains the node at once."""
    try:
        return client.slurm(action, **args)
    except ConnectionLost:
        pass
    while True:
        time.sleep(0.5)
        try:
            return Client(client.path, timeout=max(1.0, deadline - time.monotonic())).slurm(action, **args)
        except DaemonUnavailable:
            if time.monotonic() + 0.5 >= deadline:
                raise


def attach(client: Client, a, deadline: float) -> list[str]:
    """The env lines of a step of job `a.job` on `a.node`, asking the daemon first (a later step
    of a placed job asks Slurm nothing)."""
    rec = ""
    try:
        known = _ask(client, deadline, "attach", job=a.job, uid=a.uid, gid=a.gid, known_only=True)
        if known.get("env") is not None:
            return [_env_line(k, v) for k, v in sorted(known["env"].items())]
        rec = job_record(_scontrol("show", "job", "-d", str(a.job)), a.job)
        ref = reference(rec)
        mem, on, gpus = allocation(rec, a.node, _hostnames)
        if mem:
            res = _ask(client, deadline, "attach", job=a.job, ref=ref, node=a.node, uid=a.uid, gid=a.gid, gpu_mem=mem,
                               gpu_index=on, profile=a.profile or profile_key(rec))
        elif gpus:
            res = _ask(client, deadline, "hold", job=a.job, ref=ref, node=a.node, uid=a.uid, gpu_index=gpus)
        else:  # no GPU asked: nothing to do (the plugin normally decides so without running this)
            return []
    except DaemonUnavailable as e:
        why = f"its daemon on {a.node} does not answer: {' '.join(str(e).split())}"
        _drain(a.node, why)
        rec = rec or job_record(_scontrol("show", "job", "-d", str(a.job)), a.job)
        if not allocation(rec, a.node, _hostnames)[0]:
            return []  # a gres/gpu job needs nothing of colo: it runs
        raise SlurmError(_requeue(reference(rec), rec, why)) from None
    if res.get("wait"):
        raise SlurmError(_requeue(ref, rec, res["wait"]))
    return [_env_line(k, v) for k, v in sorted(res["env"].items())]


def healthcheck(client: Client, node: str) -> tuple[bool, str]:
    """slurm.conf's HealthCheckProgram: a node whose colo daemon does not answer (not running,
    or hung past the timeout) is drained with the reason; once it answers, a node drained for
    colo's reason (one that starts with "colo:") is resumed. An admin's own drain is left alone.
    (whether colo answers, what was done)"""
    try:
        client.gpus()
    except DaemonUnavailable as e:
        why = f"its daemon on {node} does not answer: {' '.join(str(e).split())}"
        st, reason = node_state(node)
        if "DRAIN" in st:
            return False, f"{why}; {node} is drained already ({reason or 'no reason'})"
        _drain(node, why)
        return False, f"{why}; {node} drained"
    st, reason = node_state(node)
    if "DRAIN" in st and reason.startswith("colo:"):
        _scontrol("update", f"nodename={node}", "state=resume")
        return True, f"colo answers on {node}: resumed (it was drained for: {reason})"
    return True, f"colo answers on {node}"


def node_state(node: str) -> tuple[str, str]:
    """(State=, Reason= without Slurm's "[user@time]" tail) of `node` in `scontrol show node`."""
    rec = _scontrol("show", "node", node)
    st = re.search(r"\bState=(\S+)", rec)
    why = re.search(r"\bReason=(.*?)(?:\s+\[[^\]]*\])?\s*$", rec, re.M)
    return (st.group(1) if st else ""), (why.group(1) if why else "")


def gres_conf(client: Client, node: str, devices: str) -> list[str]:
    """gres.conf lines (and the slurm.conf Gres= of the node) for the GPUs this node's colo sees:
    each GPU's usable memory (capacity less colo's reserve) in whole MiB, bound to its device."""
    gpus = client.gpus()["gpus"]
    lines = [f"NodeName={node} Name=gpu File={devices % g['index']}" for g in gpus]
    lines += [f"NodeName={node} Name={GRES} File={devices % g['index']} Count={g['usable'] // MiB}" for g in gpus]
    total = sum(g["usable"] // MiB for g in gpus)
    return [f"# slurm.conf: NodeName={node} ... Gres=gpu:{len(gpus)},{GRES}:{total}", *lines]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m colo.cli.slurm")
    ap.add_argument("action", choices=["attach", "batch-exit", "end", "gres-conf", "healthcheck"])
    ap.add_argument("--socket")
    ap.add_argument("--job", type=int)
    ap.add_argument("--step", type=int)
    ap.add_argument("--uid", type=int)
    ap.add_argument("--gid", type=int)
    ap.add_argument("--profile")
    ap.add_argument("--status", type=int, default=0)
    ap.add_argument("--node", default=os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0])
    ap.add_argument("--timeout", type=float, default=40, help="seconds to wait for the daemon")
    ap.add_argument("--devices", default="/dev/nvidia%d", help="gres-conf: the device file of GPU %%d")
    a = ap.parse_args(argv)
    client = Client(a.socket.replace("%n", a.node) if a.socket else None, timeout=a.timeout)
    deadline = time.monotonic() + a.timeout * RESTART_SHARE
    try:
        if a.action == "gres-conf":
            print("\n".join(gres_conf(client, a.node, a.devices)))
            return 0
        if a.action == "healthcheck":
            ok, said = healthcheck(client, a.node)
            print(said)
            return 0 if ok else 1
        if a.job is None:
            raise SlurmError(f"{a.action} needs --job")
        if a.action == "attach":
            if a.uid is None or a.gid is None:
                raise SlurmError("attach needs --uid and --gid")
            print("\n".join(attach(client, a, deadline)))
        elif a.action == "batch-exit":
            _ask(client, deadline, "batch_exit", job=a.job, status=a.status)
        else:
            try:
                code, sig = job_exit(job_record(_scontrol("show", "job", str(a.job)), a.job))
            except SlurmError:
                code, sig = 0, 0  # Slurm forgot it already: the end is what matters
            _ask(client, deadline, "end", job=a.job, exit_code=min(code, 255), signal=sig)
    except (ClientError, SlurmError) as e:
        print(f"error {' '.join(str(e).split())}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
