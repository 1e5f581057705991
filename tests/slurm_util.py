"""A real Slurm for tests and benches: slurmctld, one slurmd per node, all on this host (`slurmd -N
NAME`, one port each, as Slurm's own multi-slurmd test setups run), and with accounting slurmdbd on
a private MariaDB; a private config in a folder of its own, on the shared munged. Used by
tests/test_slurm.py and bench/peers_bench.py (bench/ imports tests/ helpers, as it does
harness.daemon); not part of colo.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path

from harness.daemon import wait_for


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


def cgroup_v1_devices() -> bool:
    """Whether Slurm's cgroup/v1 plugin can constrain devices here (the devices controller of v1)."""
    return os.path.isfile("/sys/fs/cgroup/devices/devices.allow")


class MariaDB:
    """A private mariadbd on 127.0.0.1 for slurmdbd (Debian's mariadb-server), data in `root`."""

    def __init__(self, root: Path):
        self.root, self.port = root, free_port()
        self.proc: subprocess.Popen | None = None

    def start(self) -> "MariaDB":
        """System tables (slurmdbd's stored procedures need them) but no grants: only this host's
        tests reach it, and whatever user slurmdbd names may create its database."""
        subprocess.run(["mariadb-install-db", "--no-defaults", f"--datadir={self.root}/data", "--user=root",
                        "--skip-test-db", "--skip-name-resolve"], check=True, capture_output=True)
        self.proc = subprocess.Popen(
            ["mariadbd", "--no-defaults", f"--datadir={self.root}/data", "--user=root", f"--port={self.port}",
             "--bind-address=127.0.0.1", f"--socket={self.root}/sock", "--skip-grant-tables",
             "--innodb-buffer-pool-size=32M", "--innodb-lock-wait-timeout=900", "--skip-log-bin"],
            stdout=subprocess.DEVNULL, stderr=open(self.root / "mariadbd.err", "wb"), start_new_session=True)
        wait_for(lambda: subprocess.run(["mariadb", "--no-defaults", "-S", f"{self.root}/sock", "-e", "SELECT 1"],
                                        capture_output=True).returncode == 0, 60, "MariaDB to answer", 0.05)
        return self

    def stop(self) -> None:
        if self.proc:
            self.proc.terminate()
            self.proc.wait(60)


class SlurmCluster:
    """slurmctld and one slurmd per node of `nodes` (name -> the rest of its NodeName line, e.g.
    "CPUs=4 Gres=gpu:2,shard:32256"), all on this host; `gres` is gres.conf's text, `gres_types`
    slurm.conf's GresTypes; `plugstack` (a plugstack.conf's text, which may be rewritten before
    start) turns SPANK plugins on; `cgroup` uses task/cgroup with ConstrainDevices (cgroup v1);
    `accounting` runs slurmdbd on a private MariaDB with every user in `users` given an account;
    `extra` lines go into slurm.conf as they are."""

    def __init__(self, root: Path, nodes: dict[str, str], cluster: str = "colotest", gres: str = "",
                 gres_types: str = "", plugstack: str | None = None, extra: tuple[str, ...] = (),
                 accounting: bool = False, cgroup: bool = False, users: tuple[str, ...] = ("root",)):
        self.root, self.cluster, self.nodes, self.users = root, cluster, list(nodes), users
        self.conf = root / "slurm.conf"
        root.mkdir(exist_ok=True)
        for d in ("state", *(f"spool-{n}" for n in nodes)):
            (root / d).mkdir()
        lines = [*extra]
        if gres_types:
            (root / "gres.conf").write_text(gres)
            lines.append(f"GresTypes={gres_types}")
        if plugstack is not None:
            (root / "plugstack.conf").write_text(plugstack + "\n")
            lines.append(f"PlugStackConfig={root}/plugstack.conf")
        self.db: MariaDB | None = None
        if accounting:
            self.db = MariaDB(root / "mariadb")
            dbd = root / "slurmdbd.conf"  # read from slurm.conf's folder
            dbd.write_text(f"AuthType=auth/munge\nDbdHost=localhost\nDbdAddr=127.0.0.1\nDbdPort={(dbd_port := free_port())}\n"
                           f"SlurmUser=root\nLogFile={root}/slurmdbd.log\nPidFile={root}/slurmdbd.pid\n"
                           f"StorageType=accounting_storage/mysql\nStorageHost=127.0.0.1\nStoragePort={self.db.port}\n"
                           f"StorageUser=slurm\nStoragePass=slurm\nStorageLoc=slurm_{cluster}\n")
            dbd.chmod(0o600)
            lines += ["AccountingStorageType=accounting_storage/slurmdbd", "AccountingStorageHost=127.0.0.1",
                      f"AccountingStoragePort={dbd_port}", "AccountingStorageEnforce=associations,limits,qos"]
            if gres_types:
                lines.append("AccountingStorageTRES=" + ",".join(f"gres/{t}" for t in gres_types.split(",")))
        else:
            lines.append("AccountingStorageType=accounting_storage/none")
        if cgroup:
            (root / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\n"
                                              "ConstrainDevices=yes\n")
            lines += ["TaskPlugin=task/cgroup", "ProctrackType=proctrack/cgroup"]
        else:
            lines += ["TaskPlugin=task/none", "ProctrackType=proctrack/linuxproc"]
        own = "\n".join(lines)
        node_lines = "\n".join(f"NodeName={n} NodeAddr=127.0.0.1 Port={free_port()} {rest} State=UNKNOWN"
                               for n, rest in nodes.items())
        self.conf.write_text(f"""
ClusterName={cluster}
SlurmctldHost={socket.gethostname().split(".")[0]}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=2
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
SlurmdParameters=config_overrides
MinJobAge=600
{own}
{node_lines}
PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.procs: list[subprocess.Popen] = []

    def _daemon(self, *argv: str, log: str) -> None:
        self.procs.append(subprocess.Popen(list(argv), env=self.env, stdout=subprocess.DEVNULL,
                                           stderr=open(self.root / log, "wb"), start_new_session=True))

    def start(self) -> "SlurmCluster":
        if self.db is not None:
            self.db.start()
            self._daemon("slurmdbd", "-D", log="slurmdbd.err")
            wait_for(lambda: self.run("sacctmgr", "-n", "list", "cluster").returncode == 0, 60, "slurmdbd to answer")
            self.sacctmgr("add", "cluster", self.cluster)
            self.sacctmgr("add", "account", "colo", f"Cluster={self.cluster}")
            self.sacctmgr("add", "user", ",".join(self.users), "Account=colo", f"Cluster={self.cluster}")
        self._daemon("slurmctld", "-D", "-i", log="slurmctld.err")
        for n in self.nodes:
            self._daemon("slurmd", "-D", "-N", n, log=f"slurmd-{n}.err")
        wait_for(lambda: self.run("sinfo", "-h", "-N", "-o", "%T").stdout.split() == ["idle"] * len(self.nodes), 90,
                 "every Slurm node to be idle")
        if self.db is not None:  # slurmctld has the users' associations from slurmdbd (else: "Invalid account")
            wait_for(lambda: all(f"UserName={u}(" in self.run("scontrol", "show", "assoc_mgr", "flags=assoc").stdout
                                 for u in self.users), 60, "slurmctld to know the users' accounts")
        return self

    def sacctmgr(self, *args: str) -> str:
        r = self.run("sacctmgr", "-i", *args)
        if r.returncode != 0:
            raise RuntimeError(f"sacctmgr {' '.join(args)}: {r.stderr.strip() or r.stdout.strip()}")
        return r.stdout

    def run(self, *args: str, user=None) -> subprocess.CompletedProcess:
        """A Slurm command against this cluster, as `user` (a pwd entry) when given."""
        kw = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []} if user else {}
        return subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=60, cwd="/tmp", **kw)

    def sbatch(self, script: Path, *opts: str, user=None) -> int:
        r = self.run("sbatch", "--parsable", *opts, str(script), user=user)
        if r.returncode != 0:
            raise RuntimeError(f"sbatch failed: {r.stderr.strip()}")
        return int(r.stdout.strip().split(";")[0])

    def state(self, job: int | str) -> tuple[str, str]:
        """(state, reason) of a job squeue still lists, ("", "") once it is gone. `job` as squeue
        names it ("12", "12_3", "12+1"; a bare array's or heterogeneous job's id: any of its
        tasks or components). squeue -j of "12+0" lists every component."""
        r = self.run("squeue", "-h", "-j", str(job), "-o", "%i %T %r")
        rows = [line.split() for line in r.stdout.splitlines() if line.strip()]
        mine = [p for p in rows if p[0] == str(job)] or [p for p in rows if p[0].startswith((f"{job}_", f"{job}+"))]
        return (mine[0][1], mine[0][2] if len(mine[0]) > 2 else "") if mine else ("", "")

    def show(self, job: int | str) -> dict[str, str]:
        """`scontrol show job`'s fields of one job (an array task as "12_3"), {} once Slurm forgot it."""
        r = self.run("scontrol", "show", "job", "-o", str(job))
        out: dict[str, str] = {}
        key = None
        for word in r.stdout.split(" ") if r.returncode == 0 else []:
            k, eq, v = word.partition("=")
            if eq and k.isalnum():  # a value may hold spaces: the words up to the next Key= are its own
                key, out[k] = k, v
            elif key:
                out[key] += " " + word
        return {k: v.strip() for k, v in out.items()}

    def stop(self) -> None:
        self.run("scancel", "--full", "--partition", "main")
        for p in reversed(self.procs):
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.db is not None:
            self.db.stop()


def SlurmNode(root: Path, cluster: str = "colotest", cpus: int = 8, extra: tuple[str, ...] = ()) -> SlurmCluster:
    """One node named after this host, no GRES, no accounting (bench/peers_bench.py)."""
    return SlurmCluster(root, {socket.gethostname().split(".")[0]: f"CPUs={cpus}"}, cluster=cluster, extra=extra)
