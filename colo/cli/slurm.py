"""colo's side of its Slurm plugin (native/slurm/colo_spank.c), run by it as root:

    python3 -I -m colo.cli.slurm attach     --job J --step S --uid U --gid G --node N [--profile NAME]
    python3 -I -m colo.cli.slurm batch-exit --job J --status WAITSTATUS [--lost]
    python3 -I -m colo.cli.slurm end        --job J --node N [--lost]

(batch-exit and end only where the plugin could not send them to the daemon itself, the same
request: colo/protocol.py SLURM_WIRE; --lost: its own went away in the middle)

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
import sys
import time

from .. import protocol
from ..client import Client, ClientError, ConnectionLost, DaemonUnavailable
from ..daemon.slurmcmd import admin_note, scontrol
from ..slurmjob import (GRES, MiB, SlurmError, admin_comment, allocation, job_exit, job_record,  # noqa: F401
                        profile_key, reference)

# The share of its --timeout (the plugin's timeout less 10 s) a helper whose daemon went away while
# answering may spend waiting for it to be back; the rest is for draining the node and requeueing.
RESTART_SHARE = 0.8


def _hostnames(nodes: str) -> list[str]:
    return scontrol("show", "hostnames", nodes).split()


def _env_line(k: str, v: str) -> str:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k) or "\n" in v or "\0" in v:
        raise SlurmError(f"refusing a malformed variable {k!r}")
    return f"env {k}={v}"


def _requeue(ref: str, rec: str, why: str) -> str:
    """The job back in Slurm's queue (it runs again later, here or elsewhere), with the reason on it."""
    admin_note(ref, f"colo: requeued: {why}", admin_comment(rec))
    try:
        scontrol("requeue", ref)
    except SlurmError as e:  # an interactive job (salloc, srun) or one submitted with --no-requeue
        return f"cannot run here now, and it could not be requeued ({e}): {why}"
    return f"requeued, it runs again later: {why}"


def _drain(node: str, why: str) -> None:
    """No more jobs for a node whose colo does not answer (scontrol update ... state=resume, once it does)."""
    try:
        scontrol("update", f"nodename={node}", "state=drain", f"reason=colo: {why}"[:200])
    except SlurmError:
        pass


def _ask(client: Client, deadline: float, action: str, lost: bool = False, **args) -> dict:
    """client.slurm(action, ...), asked again once the daemon is back if it went away while
    answering (killed, and restarted by systemd: a job's step must not fail for that), until
    `deadline` (time.monotonic()). Every action may be asked twice (the daemon finds the job it
    placed, or finishes a placement its restart cut short; a batch exit or an end it recorded
    already is found so). A daemon that was not there to begin with is not waited for: the caller
    drains the node at once. `lost`: the plugin's own request went that way already (--lost), so
    the daemon is waited for from the start."""
    if not lost:
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
        rec = job_record(scontrol("show", "job", "-d", str(a.job)), a.job)
        ref = reference(rec)
        mem, on, gpus = allocation(rec, a.node, _hostnames)
        if mem:
            res = _ask(client, deadline, "attach", job=a.job, ref=ref, node=a.node, uid=a.uid, gid=a.gid, gpu_mem=mem,
                               gpu_index=on, profile=a.profile or profile_key(rec), comment=admin_comment(rec))
        elif gpus:
            res = _ask(client, deadline, "hold", job=a.job, ref=ref, node=a.node, uid=a.uid, gpu_index=gpus)
        else:  # no GPU asked: nothing to do (the plugin normally decides so without running this)
            return []
    except DaemonUnavailable as e:
        why = f"its daemon on {a.node} does not answer: {' '.join(str(e).split())}"
        _drain(a.node, why)
        rec = rec or job_record(scontrol("show", "job", "-d", str(a.job)), a.job)
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
        scontrol("update", f"nodename={node}", "state=resume")
        return True, f"colo answers on {node}: resumed (it was drained for: {reason})"
    return True, f"colo answers on {node}"


def node_state(node: str) -> tuple[str, str]:
    """(State=, Reason= without Slurm's "[user@time]" tail) of `node` in `scontrol show node`."""
    rec = scontrol("show", "node", node)
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
    ap.add_argument("--lost", action="store_true", help="the plugin's own request to the daemon was cut short")
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
        elif a.action == "batch-exit":  # what the plugin sends the daemon itself (protocol.slurm_batch_exit)
            _ask(client, deadline, protocol.SLURM_BATCH_EXIT, a.lost, job=a.job, status=a.status)
        else:  # the daemon takes the job's exit from its batch exit, or from Slurm (protocol.slurm_end)
            _ask(client, deadline, protocol.SLURM_END, a.lost, job=a.job)
    except (ClientError, SlurmError) as e:
        print(f"error {' '.join(str(e).split())}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
