"""Issue 31 items 3-4 (invariants 10, 14): what a job cannot steer — its budget comes from a file
colo (root) wrote beside its ledger, not from its environment; the daemon reads only the ledger
slots it created, and by processes it knows, whatever the job writes into its ledger.

As real Unix users: the interposer's own rules (native/interpose/source.c) through the C test
caller, then each attack through a real daemon. Each attack test fails on ffbaf2e, where
`COLO_LEDGER` pointed at a ledger the job made, a larger `COLO_GPU_BUDGET`, or
`COLO_GPU_MANAGED=none`, took the budget away, and a ledger header the job rewrote made the
daemon read 16 MiB per sample.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from colo.client import Client
from colo.node import cgroup, interposer, native
from harness.daemon import DaemonProc, wait_for
from harness.ledger import CRAFT
from harness.probes import db_ro
from harness.users import run_as, shared_root


GiB = 1024**3
MiB = 1024**2
# Python as another user runs it (the test's own may live in root's home): the system's, with colo
PY = f"PYTHONPATH={Path(__file__).resolve().parent.parent} /usr/bin/python3"


@pytest.fixture(scope="module")
def probe_dir(probe):
    """A folder every user can reach: the C test caller, and a simulated GPU."""
    root = Path(tempfile.mkdtemp(prefix="colo-source-"))
    os.chmod(root, 0o755)
    shutil.copy(probe, root / "probe")
    os.chmod(root / "probe", 0o755)
    (root / "gpu").mkdir(mode=0o777)
    os.chmod(root / "gpu", 0o777)
    from colo.node import fakegpu
    fakegpu.create(root / "gpu" / "state", count=1, mem=16 * GiB)
    os.chmod(root / "gpu" / "state", 0o666)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _probe(probe_dir: Path, pw, env: dict, *cmds: str, job_cgroup: Path | None = None) -> subprocess.CompletedProcess:
    """The C caller as user `pw` under the interposer, first moved into `job_cgroup` if given."""
    full = {"PATH": "/usr/bin:/bin", "LD_PRELOAD": str(native.path(native.INTERPOSER)),
            "COLO_FAKEGPU_STATE": str(probe_dir / "gpu" / "state"),
            "LD_LIBRARY_PATH": str(native.native_dir() / native.FAKEGPU_DIR), **env}
    p = subprocess.Popen(["sh", "-c", f'read go; exec {probe_dir / "probe"} "$@"', "sh", "init", *cmds],
                         user=pw.pw_uid, group=pw.pw_gid, extra_groups=[], env=full, cwd="/tmp",
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if job_cgroup is not None:
        (job_cgroup / "cgroup.procs").write_text(str(p.pid))
    out, err = p.communicate("go\n", timeout=60)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def _codes(r: subprocess.CompletedProcess, cmd: str) -> list[int]:
    return [int(line.split()[1]) for line in r.stdout.splitlines() if line.split()[:1] == [cmd]]


@pytest.fixture
def place():
    """A folder of root's that other users can pass through (pytest's own are root-only)."""
    d = shared_root("colo-runs-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def colo_leaf():
    """A folder named as colo names a job's cgroup leaf (…/colo-<instance>/job-7), made by root."""
    mount = cgroup.v2_mount()
    if mount is None:
        pytest.skip("no cgroup v2 hierarchy here")
    top = mount / f"colo-sourcetest{os.getpid()}"
    leaf = top / "job-7"
    leaf.mkdir(parents=True)
    yield leaf
    for d in (leaf, top):
        for _ in range(100):
            try:
                d.rmdir()
                break
            except OSError:
                time.sleep(0.05)


def _run_dir(tmp: Path, pw, budget: int, job: int = 7, owner: int = 0, managed: str = "full") -> Path:
    """A job's run folder as colo makes it (root's, 0711) with its ledger (the user's) and budget file."""
    run = Path(tempfile.mkdtemp(prefix=f"run{job}-", dir=tmp))
    os.chmod(run, 0o711)
    interposer.create_ledger(run / "ledger", budget, uid=pw.pw_uid, gid=pw.pw_gid)
    interposer.write_budget(run, budget, pw.pw_uid, job, managed)
    if owner:
        os.chown(run / "budget", owner, owner)
    return run


def _own_ledger(pw, budget: int) -> Path:
    """A ledger the user made for themselves, in a folder of their own."""
    d = Path(tempfile.mkdtemp(prefix="colo-mine-"))
    os.chmod(d, 0o755)
    os.chown(d, pw.pw_uid, pw.pw_gid)
    interposer.create_ledger(d / "ledger", budget, uid=pw.pw_uid, gid=pw.pw_gid)
    return d / "ledger"


# ---- the interposer's rules ---------------------------------------------------------------------

def test_the_budget_comes_from_colos_file_not_the_environment(probe_dir, users, place):
    _, bob = users
    run = _run_dir(place, bob, 64 * MiB)
    env = {"COLO_LEDGER": str(run / "ledger"), "COLO_GPU_BUDGET": str(8 * GiB), "COLO_GPU_MANAGED": "none"}
    r = _probe(probe_dir, bob, env, "alloc", "48M", "alloc", "48M", "managed", "48M")
    assert _codes(r, "alloc") == [0, 2] and _codes(r, "managed") == [2], (r.stdout, r.stderr)


def test_a_budget_file_that_is_not_colos_is_not_believed(probe_dir, users, place, colo_leaf):
    """In a colo job's cgroup: a budget file of the user's, of another uid, or of another job, and
    no budget file at all, each refuse every allocation with one line saying why."""
    alice, bob = users
    cases = [
        (_run_dir(place, bob, 64 * MiB, owner=bob.pw_uid), "is not colo's"),
        (_run_dir(place, alice, 64 * MiB), f"budget of uid {alice.pw_uid}"),
        (_run_dir(place, bob, 64 * MiB, job=8), "holds the budget of colo job 8"),
        (_own_ledger(bob, 8 * GiB).parent, "no budget colo wrote"),
        (place, "holds no budget colo wrote"),
    ]
    for run, why in cases:
        env = {"COLO_LEDGER": str(run / "ledger"), "COLO_GPU_BUDGET": str(8 * GiB)}
        r = _probe(probe_dir, bob, env, "alloc", "16M", job_cgroup=colo_leaf)
        assert _codes(r, "alloc") == [2], (run, r.stdout, r.stderr)
        assert "in colo job 7's cgroup" in r.stderr and why in r.stderr, r.stderr
        assert len([ln for ln in r.stderr.splitlines() if ln.startswith("colo:")]) == 1, r.stderr
    r = _probe(probe_dir, bob, {"COLO_GPU_BUDGET": str(8 * GiB)}, "alloc", "16M", job_cgroup=colo_leaf)
    assert _codes(r, "alloc") == [2] and "COLO_LEDGER is not set" in r.stderr, r.stderr
    good = _run_dir(place, bob, 64 * MiB)
    r = _probe(probe_dir, bob, {"COLO_LEDGER": str(good / "ledger")}, "alloc", "48M", "alloc", "48M", job_cgroup=colo_leaf)
    assert _codes(r, "alloc") == [0, 2], (r.stdout, r.stderr)


def test_outside_any_colo_job_the_environment_still_sets_the_budget(probe_dir, users):
    """`colo run-budgeted` (no daemon, the user's own choice) works from its environment."""
    _, bob = users
    ledger = _own_ledger(bob, 64 * MiB)
    try:
        env = {"COLO_LEDGER": str(ledger), "COLO_GPU_BUDGET": str(64 * MiB)}
        r = _probe(probe_dir, bob, env, "alloc", "48M", "alloc", "48M")
        assert _codes(r, "alloc") == [0, 2], (r.stdout, r.stderr)
    finally:
        shutil.rmtree(ledger.parent)


# ---- through the daemon ------------------------------------------------------------------------

pytestmark = pytest.mark.node("colo-source-d-", count=1, then=lambda n: n.daemon(), needs=("probe_dir",))


def _submit(d: DaemonProc, pw, spec: dict) -> int:
    return run_as(pw, lambda: Client(d.socket).submit({"workdir": "/tmp", **spec})["id"])


def _burn(d: DaemonProc) -> str:
    return str(next(d.state_dir.glob("native-*")) / "colo-burn")


def test_a_job_cannot_point_colo_ledger_at_a_ledger_of_its_own(node, users):
    """Bob's job makes a ledger with a 100 GiB budget and runs colo-burn with COLO_LEDGER at it and
    COLO_GPU_BUDGET raised: on ffbaf2e his 3 GiB under a 1 GiB budget were allocated (exit 0)."""
    _, bob = users
    d = node
    make = (f"{PY} -c 'import sys; from colo.node import interposer; "
            f"interposer.create_ledger(sys.argv[1], 100 << 30)' \"$t/ledger\"")
    script = (f't=$(mktemp -d) && {make} && echo "budget=107374182400" > "$t/budget" && '
              f'COLO_LEDGER="$t/ledger" COLO_GPU_BUDGET=107374182400 {_burn(d)} --mem 3GiB --duty 0; '
              f'r=$?; rm -rf "$t"; exit $r')
    j = _submit(d, bob, {"argv": ["sh", "-c", script], "gpu_mem": GiB})
    job = d.wait_state(j, "succeeded", "failed", timeout=60)
    log = "".join(d.client.logs(j))
    assert job["exit_code"] == 3, (job, log)  # a --mem allocation refused
    assert "no budget colo wrote" in log, log


def test_a_job_cannot_stop_managed_memory_being_charged(node, users, probe_dir):
    _, bob = users
    d = node
    j = _submit(d, bob, {"argv": ["sh", "-c", f"COLO_GPU_MANAGED=none COLO_GPU_BUDGET=107374182400 "
                                             f"{probe_dir / 'probe'} init managed 3G"], "gpu_mem": GiB})
    d.wait_state(j, "succeeded", "failed", timeout=60)
    log = "".join(d.client.logs(j))
    assert "managed 2" in log, log  # CUDA_ERROR_OUT_OF_MEMORY: charged, past the budget


@pytest.mark.docker
def test_a_container_job_cannot_point_colo_ledger_elsewhere(node, users, test_image):
    """In a container /opt/colo/run is colo's, whatever COLO_LEDGER says: bob's own ledger (100 GiB)
    mounted at /x is not used."""
    _, bob = users
    d = node
    ledger = _own_ledger(bob, 100 * GiB)
    try:
        script = "COLO_LEDGER=/x/ledger COLO_GPU_BUDGET=107374182400 /opt/colo/native/colo-burn --mem 3GiB --duty 0"
        j = _submit(d, bob, {"argv": ["sh", "-c", script], "gpu_mem": GiB, "image": test_image,
                             "mounts": [f"{ledger.parent}:/x"]})
        job = d.wait_state(j, "succeeded", "failed", timeout=90)
        assert job["exit_code"] == 3, (job, "".join(d.client.logs(j)))
    finally:
        shutil.rmtree(ledger.parent)




def _rchar(pid: int) -> int:
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar")


def _samples(d: DaemonProc, job: int) -> int:
    with db_ro(d.state_dir) as db:
        return db.execute("SELECT count(*) FROM samples WHERE job_id = ?", (job,)).fetchone()[0]


def test_a_ledger_header_the_job_rewrote_costs_the_daemon_nothing_more(node, users, place):
    """Bob's job claims 65,536 slots in its ledger's header, marks each owned and holds every lock
    colo's 1,024 slots have. On ffbaf2e the daemon read 16 MiB of it every sample; now it reads
    the 1,024 slots it made, 24 bytes each, and the lanes of the job's one real process."""
    _, bob = users
    d = node
    script = place / "craft.py"
    script.write_text(CRAFT)
    os.chmod(script, 0o644)
    j = _submit(d, bob, {"argv": ["sh", "-c", f"{PY} {script}"], "gpu_mem": GiB})
    d.wait_state(j, "running", timeout=60)
    said = wait_for(lambda: "crafted" in (t := "".join(d.client.logs(j))) and t, 60, "the job to rewrite its ledger")
    crafter = int(said.split("crafted")[1].split()[0])
    daemon_pid = d.proc.pid
    n0, r0 = _samples(d, j), _rchar(daemon_pid)
    wait_for(lambda: _samples(d, j) >= n0 + 3, 30, "three more samples of the job")
    read = _rchar(daemon_pid) - r0
    assert read < 4 * MiB, f"the daemon read {read} bytes over three samples"
    # the same read the sampler makes (by the job's processes), and one by the locks, looked at closely
    ledger = d.state_dir / "jobs" / str(j) / "ledger"
    for pids in (interposer.ns_pids([crafter]), None):
        led = interposer.read_ledger(ledger, pids=pids)
        assert led.scanned == interposer.DEFAULT_SLOTS and len(led.processes) == 1, (led.scanned, led.processes)
        assert led.read_bytes == interposer.HEADER_SIZE + 1024 * 24 + interposer.SLOT_SIZE
