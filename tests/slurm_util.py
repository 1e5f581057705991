"""A real Slurm for tests and benches: slurmctld + slurmd for one node (this host) with a private
config in a folder of its own, on the shared munged. Used by tests/test_slurm.py and
bench/peers_bench.py (bench/ imports tests/ helpers, as it does daemon_util); not part of colo.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path

from daemon_util import wait_for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def munge_up() -> None:
    """Starts munged as .ci/run does, unless one already answers (it is shared, never stopped here)."""
    ok = lambda: subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode == 0  # noqa: E731
    if ok():
        return
    os.makedirs("/run/munge", exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    if not os.path.exists("/etc/munge/munge.key"):
        subprocess.run(["runuser", "-u", "munge", "--", "mungekey", "--create"], check=True)
    subprocess.run(["runuser", "-u", "munge", "--", "munged"], check=True)
    wait_for(ok, 20, "munged to answer")


class SlurmNode:
    """slurmctld + slurmd for one node named after this host, in a private folder `root`.

    `cpus` are declared to Slurm; `gpumem` (e.g. "12G") declares a count-only GRES of that name;
    `plugstack` (a plugstack.conf's text, which may be rewritten before start) turns SPANK plugins
    on; `extra` lines go into slurm.conf as they are."""

    def __init__(self, root: Path, cluster: str = "colotest", cpus: int = 8, gpumem: str | None = None,
                 plugstack: str | None = None, extra: tuple[str, ...] = ()):
        self.root = root
        self.conf = root / "slurm.conf"
        self.node = socket.gethostname().split(".")[0]
        root.mkdir(exist_ok=True)
        for d in ("state", "spool"):
            (root / d).mkdir()
        lines = [*extra]
        gres = ""
        if gpumem is not None:
            (root / "gres.conf").write_text(f"Name=gpumem Count={gpumem} Flags=CountOnly\n")
            lines.append("GresTypes=gpumem")
            gres = f" Gres=gpumem:{gpumem}"
        if plugstack is not None:
            (root / "plugstack.conf").write_text(plugstack + "\n")
            lines.append(f"PlugStackConfig={root}/plugstack.conf")
        own = "\n".join(lines)
        self.conf.write_text(f"""
ClusterName={cluster}
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SlurmdParameters=config_overrides
MinJobAge=600
{own}
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={cpus}{gres} State=UNKNOWN
PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.procs: list[subprocess.Popen] = []

    def start(self) -> "SlurmNode":
        for exe in ("slurmctld", "slurmd"):
            self.procs.append(subprocess.Popen([exe, "-D"], env=self.env, stdout=subprocess.DEVNULL,
                                               stderr=open(self.root / f"{exe}.err", "wb"), start_new_session=True))
        wait_for(lambda: self.run("sinfo", "-h", "-o", "%T").stdout.strip() == "idle", 90,
                 "the Slurm node to be idle")
        return self

    def run(self, *args: str, user=None) -> subprocess.CompletedProcess:
        """A Slurm command against this node, as `user` (a pwd entry) when given."""
        kw = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []} if user else {}
        return subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=60, cwd="/tmp", **kw)

    def sbatch(self, script: Path, *opts: str, user=None) -> int:
        r = self.run("sbatch", "--parsable", *opts, str(script), user=user)
        if r.returncode != 0:
            raise RuntimeError(f"sbatch failed: {r.stderr.strip()}")
        return int(r.stdout.strip().split(";")[0])

    def state(self, job: int) -> tuple[str, str]:
        """(state, reason) of a job squeue still lists, ("", "") once it is gone."""
        r = self.run("squeue", "-h", "-j", str(job), "-o", "%T %r")
        parts = r.stdout.split()
        return (parts[0], parts[1] if len(parts) > 1 else "") if parts else ("", "")

    def stop(self) -> None:
        self.run("scancel", "--full", "--partition", "main")
        for p in reversed(self.procs):
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
