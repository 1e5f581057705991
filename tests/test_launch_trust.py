"""What the root daemon does on a user's behalf (issue 11, items 1 and 3; invariant 10), tried as
real Unix users against a real daemon: a workdir the submitter cannot enter, an exit record the
job tries to forge, a ledger the job tries to swap for a FIFO.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path


from colo.client import Client, ClientError
from harness.daemon import DaemonProc, wait_for
from harness.users import run_as, shared_root



def _submit(d: DaemonProc, pw, spec: dict) -> int:
    return run_as(pw, lambda: Client(d.socket).submit(spec)["id"])


def test_workdir_is_entered_as_the_submitter(shared, users, tmp_path):
    """bob's --workdir into alice's 0700 folder, and into /root: the job fails with the reason, and
    nothing there is read (the old runtime entered the workdir as root and printed both files)."""
    d = shared
    alice, bob = users
    private = shared_root("colo-alice-") / "private"
    private.mkdir(mode=0o700)
    (private / "notes.txt").write_text("alice-secret\n")
    os.chown(private, alice.pw_uid, alice.pw_gid)
    os.chown(private / "notes.txt", alice.pw_uid, alice.pw_gid)
    rootdir = Path(f"/root/colo-trust-{os.getpid()}")
    rootdir.mkdir(mode=0o700, exist_ok=True)
    (rootdir / "notes.txt").write_text("root-secret\n")
    try:
        for where, secret in ((private, "alice-secret"), (rootdir, "root-secret")):
            j = _submit(d, bob, {"argv": ["cat", "notes.txt"], "gpus": 0, "workdir": str(where)})
            job = d.wait_state(j, "failed", "succeeded")
            log = "".join(d.client.logs(j))
            assert secret not in log, log
            assert job["state"] == "failed" and f"cannot enter the workdir {where}" in job["reason"], job
            assert "Permission denied" in job["reason"] and f"cannot enter the workdir {where}" in log
        # alice's own job in her folder still runs there, as alice
        j = _submit(d, alice, {"argv": ["sh", "-c", "cat notes.txt; id -u"], "gpus": 0, "workdir": str(private)})
        assert d.wait_state(j, "succeeded")
        assert "".join(d.client.logs(j)).split() == ["alice-secret", str(alice.pw_uid)]
    finally:
        shutil.rmtree(private.parent, ignore_errors=True)
        shutil.rmtree(rootdir, ignore_errors=True)


def test_a_job_cannot_forge_its_exit_code(shared, users):
    """The job makes exit.tmp a folder and `exit` a symlink to a root-only file holding 4242 (and
    tries the same on the ledger): its real exit code, 3, is what is recorded."""
    d = shared
    bob = users[1]
    secret = Path(f"/root/colo-exit-{os.getpid()}")
    secret.write_text("4242\n")
    os.chmod(secret, 0o600)
    run = d.state_dir / "jobs"
    script = (f'r={run}/$COLO_JOB_ID; rm -rf "$r/exit.tmp" "$r/exit"; mkdir "$r/exit.tmp"; '
              f'ln -sf {secret} "$r/exit"; mv "$r/ledger" "$r/l2"; ln -sf {secret} "$r/ledger"; '
              'ls -la "$r"; exit 3')
    try:
        j = _submit(d, bob, {"argv": ["sh", "-c", script], "gpus": 1, "gpu_mem": "64MiB"})
        job = d.wait_state(j, "failed", "succeeded")
        assert job["exit_code"] == 3 and job["reason"].startswith("exited with code 3"), job
    finally:
        secret.unlink()


def test_a_ledger_swapped_for_a_fifo_does_not_hang_the_daemon(shared, users):
    """The job replaces $COLO_LEDGER with a FIFO: the daemon (which reads ledgers for `ls`) keeps
    answering everyone; the old layout let the job do it and hung every user's `ls`."""
    d = shared
    alice, bob = users
    gate = d.root / "go"
    script = ('rm -f "$COLO_LEDGER"; mkfifo "$COLO_LEDGER"; mv "$COLO_LEDGER" "$COLO_LEDGER.x"; '
              f'mkfifo "$COLO_LEDGER"; echo tried; while [ ! -e {gate} ]; do sleep 0.05; done')
    j = _submit(d, bob, {"argv": ["sh", "-c", script], "gpus": 1, "gpu_mem": "64MiB"})
    d.wait_state(j, "running")
    wait_for(lambda: "tried" in "".join(d.client.logs(j)), 30, "the job to try")

    def others_ls():
        try:
            return [r["id"] for r in Client(d.socket, timeout=10).ls()]
        except ClientError as e:
            return str(e)

    for _ in range(3):  # across a few samples of the ledger
        assert j in run_as(alice, others_ls)
        assert d.client.show(j)["state"] == "running"
    other = _submit(d, alice, {"argv": ["true"], "gpus": 0})
    assert d.wait_state(other, "succeeded")
    gate.touch()
    assert d.wait_state(j, "succeeded", "failed")["state"] == "succeeded"
