"""The memory-budget interposer seen from Python: where the library is, the environment a job
needs, and the job's ledger (create it before the job starts, read it while it runs).

The ledger layout is defined in native/interpose/ledger.h; this module mirrors it. Reading never
writes: a slot counts only while its owner holds the OFD lock on the slot's first byte, so dead
processes are excluded at once (the job's own processes reclaim their bytes in the file).
"""
from __future__ import annotations

import fcntl
import os
import stat
import struct
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from colo.node import native

MAGIC = b"COLOLDG1"
VERSION = 4
HEADER_SIZE = 4096
MAX_DEVICES = 32
LANES = 16                        # per slot: lane 0 shared, 1.. one thread's each
LANE_SIZE = 320
SLOT_SIZE = 64 + LANES * LANE_SIZE
DEFAULT_SLOTS = 1024
SNAPSHOT_SLOTS = 16               # a ledger read takes up to this many slots whole, in one pread

# magic, version, header_size, nslots, slot_size, max_devices, devices, budget, refused,
# resync, hwm, reclaims (begun, ever), suspend (colo suspend: SUSPEND_AT), lanes, lane_size
_HEAD = struct.Struct("<8s6IQQ6I")
DEV_AT = 256                      # device d's line: used (the admission counter), peak
_DEVLINE = struct.Struct(f"<{MAX_DEVICES * 8}Q")  # 8 u64 a device: used, peak, 6 spare
_SLOT = struct.Struct("<IIiIQ")   # state, gen, pid, spare, refused
_LANES = struct.Struct(f"<{LANES * LANE_SIZE // 8}Q")  # per lane: started, finished, used[32], spare
_SLOT_OWNED = 1                   # 0 free, 2 reclaiming (its owner is dead)
_U64 = (1 << 64) - 1
_FLOCK = struct.Struct("hh4xqqi4x")  # struct flock on x86_64/aarch64 Linux

ENV_BUDGET = "COLO_GPU_BUDGET"
ENV_LEDGER = "COLO_LEDGER"
ENV_MANAGED = "COLO_GPU_MANAGED"
BUDGET_FILE = "budget"  # beside the ledger: what the interposer takes in a colo job (source.c)


class LedgerError(RuntimeError):
    pass


@dataclass
class Ledger:
    budget: int                                         # bytes per device
    devices: int
    used: dict[int, int] = field(default_factory=dict)   # device -> bytes held by live processes
    peak: dict[int, int] = field(default_factory=dict)   # device -> highest total ever counted
    processes: list[dict] = field(default_factory=list)  # {"pid", "host_pid", "used", "by_device", "refused"}
    refused: int = 0                                    # refused allocations, all processes
    # device -> the admission counter: live processes' bytes, operations in flight, and dead
    # processes' bytes until a job process reclaims them
    counted: dict[int, int] = field(default_factory=dict)
    scanned: int = 0                                    # slots looked at (at most the created ones)
    read_bytes: int = 0                                 # bytes read from the file for this snapshot

    @property
    def total_used(self) -> int:
        return sum(self.used.values())


def library_path() -> Path:
    return native.path(native.INTERPOSER)


def create_ledger(path: Path, budget: int, devices: int = 1, uid: int | None = None,
                  gid: int | None = None, slots: int = DEFAULT_SLOTS) -> None:
    """Write a fresh ledger (mode 0600, owned by uid:gid when given) atomically at `path`."""
    if budget <= 0:
        raise ValueError("budget must be a positive number of bytes")
    if not 1 <= devices <= MAX_DEVICES:
        raise ValueError(f"devices must be 1..{MAX_DEVICES}")
    path = Path(path)
    head = bytearray(HEADER_SIZE)
    _HEAD.pack_into(head, 0, MAGIC, VERSION, HEADER_SIZE, slots, SLOT_SIZE, MAX_DEVICES, devices, budget, 0,
                    0, 0, 0, 0, LANES, LANE_SIZE)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, bytes(head))
        os.ftruncate(fd, HEADER_SIZE + slots * SLOT_SIZE)
        if uid is not None or gid is not None:
            os.fchown(fd, -1 if uid is None else uid, -1 if gid is None else gid)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def write_budget(run_dir: Path, budget: int, uid: int, job: int, managed: str = "full") -> Path:
    """The budget a colo job's interposer takes (native/interpose/source.c), where the job cannot
    change it: a read-only file of the daemon's (root's) in the job's root-owned run folder, beside
    the ledger. Its own environment (COLO_GPU_BUDGET, COLO_LEDGER, COLO_GPU_MANAGED) is the job's
    to change, so the interposer of a process in a colo job reads this instead."""
    if managed not in ("full", "none"):
        raise ValueError("managed must be 'full' or 'none'")
    run_dir = Path(run_dir)
    tmp = run_dir / f".{BUDGET_FILE}.tmp"
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o444)
    try:
        os.write(fd, f"budget={int(budget)}\nmanaged={managed}\nuid={int(uid)}\njob={int(job)}\n".encode())
    finally:
        os.close(fd)
    os.replace(tmp, run_dir / BUDGET_FILE)
    return run_dir / BUDGET_FILE


SUSPEND_AT = 60  # the header's suspend word (ledger.h): what colo suspend tells the job's interposers
SUSPENDED, RESUME_WANTED = 1, 2


def suspend_word(path: Path, value: int | None = None) -> int:
    """The ledger's suspend word (gate.c), read, or written first when `value` is given. The
    ledger lies in the job's root-owned run folder, so it cannot be swapped; it is opened without
    following links and must be a plain file all the same. 0 when there is no ledger."""
    try:
        fd = os.open(path, (os.O_RDWR if value is not None else os.O_RDONLY) | os.O_NOFOLLOW | os.O_NONBLOCK
                     | os.O_CLOEXEC)
    except FileNotFoundError:
        return 0
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a plain file")
        if value is not None:
            os.pwrite(fd, struct.pack("<I", value), SUSPEND_AT)
        raw = os.pread(fd, 4, SUSPEND_AT)
        return struct.unpack("<I", raw)[0] if len(raw) == 4 else 0
    finally:
        os.close(fd)


def _lock_holder(fd: int, cmd: int, start: int) -> tuple[bool, int]:
    """(someone holds a lock on byte `start`, their pid as F_GETLK reports it: 0/-1 if unknown)."""
    req = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, start, 1, 0)
    ltype, _, _, _, pid = _FLOCK.unpack(fcntl.fcntl(fd, cmd, req))
    return ltype != fcntl.F_UNLCK, pid


def read_ledger(path: Path, slots: int = DEFAULT_SLOTS, pids: dict[int, int] | None = None) -> Ledger:
    """A snapshot of the ledger; processes that died are left out (their bytes too).

    The file is the job's to write, so its header's counts are believed only up to `slots`, the
    number colo created (DEFAULT_SLOTS for the daemon's jobs): of those, each slot's first bytes
    are read, and its lanes only for a live process, one slot a process.

    Which processes live: `pids` ({pid as its slot records it: host pid}, ns_pids()) when the
    reader knows the job's processes from what the job cannot write (its cgroup, the engine); else
    the slot locks. A lock query walks every lock held on the file, and the job may hold
    thousands there (20,000 made one read take 1.9 s of CPU): with `pids` none is made, and a
    crafted ledger costs what the job's real processes would. (A slot left by a process whose pid
    another process of the job took before any slot was claimed again is then counted: the
    figures are the job's own, never what the patrol judges by.)"""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = os.pread(fd, HEADER_SIZE, 0)
        if len(data) < HEADER_SIZE:
            raise LedgerError(f"{path}: too small to be a colo ledger")
        (magic, version, hsize, nslots, ssize, maxdev, devices, budget, refused,
         _resync, hwm, _reclaims, _spare, lanes, lane_size) = _HEAD.unpack_from(data, 0)
        if magic != MAGIC or version != VERSION or (hsize, ssize, maxdev, lanes, lane_size) != (
                HEADER_SIZE, SLOT_SIZE, MAX_DEVICES, LANES, LANE_SIZE):
            raise LedgerError(f"{path}: not a colo ledger of version {VERSION}")
        lines = _DEVLINE.unpack_from(data, DEV_AT)
        counted, peak = lines[0::8], lines[1::8]
        # Slots past the high-water mark were never owned: only [0, hwm) is read.
        nread = max(0, min(hwm, nslots, slots))
        read_bytes, scanned = len(data), 0
        # A few slots (a job's usual count) are read whole in one pread: one snapshot of every
        # process's bytes, as close to an instant as a reader gets. Past that, each slot's first
        # bytes alone, then the lanes of the live ones.
        blob, at = b"", 0  # slots [at, at + len(blob) // SLOT_SIZE) as read in one go
        if nread <= SNAPSHOT_SLOTS:
            blob = os.pread(fd, nread * SLOT_SIZE, HEADER_SIZE)
            read_bytes += len(blob)
        heads = []
        for i in range(nread):
            off = HEADER_SIZE + i * SLOT_SIZE
            if blob:
                head = blob[i * SLOT_SIZE:i * SLOT_SIZE + _SLOT.size]
            else:
                head = os.pread(fd, _SLOT.size, off)
                read_bytes += len(head)
            scanned += 1
            if len(head) < _SLOT.size:
                break
            heads.append((i, *_SLOT.unpack(head)))
        pids_seen: set[int] = set()
        live = []  # (slot, pid in its namespace, host pid, its refusals)
        for i, state, _gen, pid, _, slot_refused in heads:
            if state != _SLOT_OWNED:
                continue
            off = HEADER_SIZE + i * SLOT_SIZE
            if pids is not None:
                host_pid = pids.get(pid, 0)
            else:
                alive, _ = _lock_holder(fd, fcntl.F_OFD_GETLK, off)
                if not alive:
                    continue
                # A classic lock beside it tells the pid as this reader's namespace sees it.
                _, host_pid = _lock_holder(fd, fcntl.F_GETLK, off + 1)
            # The interposer takes one slot a process (the lowest free one, so a process's live
            # slot comes before any it left): a slot of no known pid, or of one seen already, is
            # no process's (one process may lock every slot).
            if host_pid <= 0 or host_pid in pids_seen:
                continue
            pids_seen.add(host_pid)
            live.append((i, pid, host_pid, slot_refused))
        if live and not blob:
            lo, hi = live[0][0], live[-1][0]
            if hi - lo + 1 <= len(live) + SNAPSHOT_SLOTS:  # close together: one pread again
                blob, at = os.pread(fd, (hi - lo + 1) * SLOT_SIZE, HEADER_SIZE + lo * SLOT_SIZE), lo
                read_bytes += len(blob)
        used = [0] * MAX_DEVICES
        procs = []
        per_lane = LANE_SIZE // 8
        for i, pid, host_pid, slot_refused in live:
            if blob:
                body = blob[(i - at) * SLOT_SIZE + 64:(i - at + 1) * SLOT_SIZE]
            else:
                body = os.pread(fd, _LANES.size, HEADER_SIZE + i * SLOT_SIZE + 64)
                read_bytes += len(body)
            if len(body) < _LANES.size:
                break
            # Its bytes: the sum of its lanes' (each lane's are net changes modulo 2^64). The lanes
            # are read at slightly different times, so a free by one thread of memory another
            # allocated can be seen without that allocation: a sum "below 0" is such a tear.
            words = _LANES.unpack(body)
            lanes_used = (words[k * per_lane + 2:k * per_lane + 2 + MAX_DEVICES] for k in range(LANES))
            by_dev = [0 if (b := t & _U64) >> 63 else b for t in map(sum, zip(*lanes_used))]
            for d, b in enumerate(by_dev):
                used[d] += b
            procs.append({
                "slot": i, "pid": pid, "host_pid": host_pid,
                "used": sum(by_dev), "by_device": {d: b for d, b in enumerate(by_dev) if b},
                "refused": slot_refused,
            })
    finally:
        os.close(fd)
    shown = range(max(devices, 1))
    return Ledger(
        budget=budget, devices=devices,
        used={d: used[d] for d in range(MAX_DEVICES) if d in shown or used[d]},
        peak={d: peak[d] for d in range(MAX_DEVICES) if d in shown or peak[d]},
        processes=procs, refused=refused,
        counted={d: counted[d] for d in range(MAX_DEVICES) if d in shown or counted[d]},
        scanned=scanned, read_bytes=read_bytes,
    )


def ns_pids(host_pids) -> dict[int, int]:
    """{pid as the process itself sees it (the innermost of its pid namespaces, as the interposer
    records it in its slot): host pid} for live processes given by host pid."""
    out = {}
    for hp in host_pids:
        try:
            with open(f"/proc/{int(hp)}/status", "rb") as f:
                status = f.read(8192)
        except (OSError, ValueError):
            continue
        for line in status.splitlines():
            if line.startswith(b"NSpid:"):
                out[int(line.split()[-1])] = int(hp)
                break
        else:
            out[int(hp)] = int(hp)  # a kernel before 4.1: no pid namespaces shown
    return out


def job_env(budget: int, ledger_in_job: str, library_in_job: str, preload: str = "",
            managed: str | None = None) -> dict[str, str]:
    """What a job's processes need: the budget, the ledger and the library preloaded first.

    `preload` is the job's own LD_PRELOAD, kept after ours. colo's variables must be set last,
    over anything the submitter asked for. `managed`: "full" (the library's default: managed
    memory is charged in full at allocation) or "none" (not charged; docs/interposer.md).
    """
    if managed not in (None, "full", "none"):
        raise ValueError("managed must be 'full' or 'none'")
    env = {
        ENV_BUDGET: str(int(budget)),
        ENV_LEDGER: ledger_in_job,
        "LD_PRELOAD": f"{library_in_job}:{preload}" if preload else library_in_job,
    }
    if managed:
        env[ENV_MANAGED] = managed
    return env


def library_problem(library: Path | None = None) -> str | None:
    """None when the library preloads cleanly into a program here, else the loader's complaint."""
    try:
        lib = library or library_path()
    except native.NativeMissing as e:
        return str(e)
    r = subprocess.run(["/bin/true"], env={**os.environ, "LD_PRELOAD": str(lib)},
                       capture_output=True, text=True, timeout=30)
    return r.stderr.strip() or None


def _visible_devices(env: dict[str, str]) -> int:
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd is None or not cvd.strip():
        return 1  # all of the host's GPUs, or none: budgets still apply to every ordinal
    return min(MAX_DEVICES, len([t for t in cvd.split(",") if t.strip()]))


def run_budgeted(argv: list[str], budget: int, extra_env: dict | None = None) -> int:
    """Run one command under the interposer with a private ledger (no daemon); its exit code
    (128 + N when a signal N ended it, as a shell reports it)."""
    env = {**os.environ, **(extra_env or {})}
    with tempfile.TemporaryDirectory(prefix="colo-budget-") as d:
        ledger = Path(d) / "ledger"
        create_ledger(ledger, budget, devices=_visible_devices(env))
        env.update(job_env(budget, str(ledger), str(library_path()), env.get("LD_PRELOAD", "")))
        rc = subprocess.call(argv, env=env)
    return 128 - rc if rc < 0 else rc
