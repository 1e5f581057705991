"""The MPS control daemons of all GPUs colo manages (MpsManager)."""
from __future__ import annotations

import logging
import os
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from .access import acl_problem
from .daemon import PID_FILE, MpsDaemon, MpsError

log = logging.getLogger("colo.node.mps")


@dataclass
class CheckReport:
    """What MpsManager.check() found: log lines, and the MPS client pids of FAULT servers per GPU
    uuid (each client reported once per fault); their jobs fail with FAULT_REASON."""
    events: list[tuple[str, str]] = field(default_factory=list)  # (uuid, message)
    faults: dict[str, list[int]] = field(default_factory=dict)  # uuid -> client pids


FAULT_REASON = "MPS server fault"


class MpsManager:
    """The MPS control daemons of all GPUs colo manages. Thread-safe."""

    def __init__(self, root: Path, control: Path | str = "nvidia-cuda-mps-control",
                 env: dict | None = None, multi_user: bool = False, idle_stop_s: float = 300):
        self.root = Path(root)
        self.control = str(control)
        self.env = env
        self.multi_user = multi_user
        self.idle_stop_s = idle_stop_s
        self.cgroup: Path | None = None  # where control daemons start (MpsDaemon.cgroup), set by the daemon
        self._daemons: dict[str, MpsDaemon] = {}
        self._states: dict[str, str] = {}
        self._idle_since: dict[str, float] = {}
        self._reported: dict[str, set[tuple[int, int]]] = {}
        self._lock = threading.RLock()
        path = (env or os.environ).get("PATH")
        self._binary = shutil.which(self.control, path=path)
        # Fail closed: without ACLs the pipe directory could only be open to every user (anyone
        # could `quit` the daemon under other users' jobs) or to none; so no MPS at all.
        self._acl_problem = acl_problem(self.root) if self._binary else None
        if not self.available():
            log.warning("%s", self.unavailable_reason)

    def available(self) -> bool:
        return self._binary is not None and self._acl_problem is None

    @property
    def unavailable_reason(self) -> str:
        if self._binary and self._acl_problem:
            return (f"MPS unavailable: its pipe directories could not be kept to the jobs' own users: "
                    f"{self._acl_problem}; all jobs run time-sliced")
        return (f"MPS unavailable: {self.control} not found (no NVIDIA driver or MPS tools?); "
                "all jobs run time-sliced")

    def daemon_for(self, uuid: str, index: int) -> MpsDaemon:
        """The daemon of this GPU, started if it is not running."""
        return self.ensure(uuid, index)

    def ensure(self, uuid: str, index: int) -> MpsDaemon:
        if not self.available():
            raise MpsError(self.unavailable_reason)
        with self._lock:
            d = self._daemons.get(uuid)
            if d is None:
                d = self._daemons[uuid] = MpsDaemon(self.root, uuid, index, self._binary, self.env,
                                                    self.multi_user, cgroup=self.cgroup)
            self._idle_since.pop(uuid, None)
            if not d.running():
                d.start()
                self._states[uuid] = "active"
            return d

    def allow(self, uuid: str, index: int, uids: Iterable[int] | Callable[[], Iterable[int]],
              restart: bool = True) -> None:
        """Exactly these uids (those of the GPU's starting and running MPS jobs) may reach its
        control daemon from now on (docs/mps.md "Who may reach the daemon"). `uids` may be a
        callable: it is read under the daemon's lock, so a revoke (keep_only) that comes meanwhile
        is never undone by a list read before it.

        An ACL gates only new connections: a process of a uid that has since lost access may still
        hold one (its job handed a descriptor out, or a process outside the job connected while the
        job ran), and could `quit` the daemon under the next user's jobs, or stay attached as a
        client colo does not account for. So when uids come in and none of the current ones stays
        (the daemon serves one uid at a time without multi-user MPS), a daemon that served other
        uids is restarted first: it serves no colo job then, and every old connection is dropped.
        `restart=False` (after a colo restart, for jobs that already run there) never restarts."""
        with self._lock:
            d = self._daemons.get(uuid)
            if d is None:
                d = self._daemons[uuid] = MpsDaemon(self.root, uuid, index, self._binary, self.env,
                                                    self.multi_user, cgroup=self.cgroup)
            with d._lock:
                new = frozenset(int(u) for u in (uids() if callable(uids) else uids))
                if new == d.users:
                    return
                stale = d.served is None or bool(d.served - new)
                if restart and new - d.users and not new & d.users and stale and d.running():
                    d.stop()  # closed to all while it is down: users are set after the stop
                    d.set_users(new)
                    d.start()
                    self._states[uuid] = "active"
                    log.info("MPS daemon on %s restarted for uid(s) %s, so that no connection of an "
                             "earlier user outlives its jobs", d.name, ", ".join(map(str, sorted(new))))
                else:
                    d.set_users(new)
                if d.served is not None:
                    d.served |= new

    def keep_only(self, uuid: str, uids: Iterable[int]) -> None:
        """Revoke: of the uids that may reach this GPU's daemon, keep these. Never grants, never
        restarts, and takes no lock when nothing changes (it runs on colo's event loop)."""
        keep = set(uids)
        d = self._daemons.get(uuid)
        if d is None or d.users <= keep:
            return
        with d._lock:
            d.set_users(d.users & keep)

    def adopt(self, uuid: str, index: int) -> bool:
        """After a colo restart: take over this GPU's daemon if one still runs (its clients keep
        their server); never starts one. Returns whether one was found."""
        if not self.available():
            return False
        with self._lock:
            d = self._daemons.setdefault(uuid, MpsDaemon(self.root, uuid, index, self._binary,
                                                         self.env, self.multi_user, cgroup=self.cgroup))
            try:
                d.set_users(d.users)  # the mode an older colo left (0755) closed at once
            except MpsError as e:
                log.error("%s", e)
            if d.running() or ((d.pipe_dir / PID_FILE).exists() and d._adopt()):
                d.served = None  # who connected while colo was away is unknown
                d._started = True
                self._states[uuid] = "active"
                return True
            return False

    def get(self, uuid: str) -> MpsDaemon | None:
        return self._daemons.get(uuid)

    def states(self) -> dict[str, str]:
        """uuid -> "off" | "active" | "fault" for GpuView.mps, as of the last check() (call it every
        few seconds). GPUs without a daemon are absent: read them as "off"."""
        with self._lock:
            return {u: ("off" if s == "dead" else s) for u, s in self._states.items()}

    def check(self) -> CheckReport:
        """Health check of every daemon colo started: restart the dead, report FAULT clients."""
        rep = CheckReport()
        with self._lock:
            for uuid, d in list(self._daemons.items()):
                h = d.health()
                if h == "dead":
                    try:
                        d.start()
                        h = "active"
                        rep.events.append((uuid, f"MPS daemon on {d.name} died; restarted"))
                    except MpsError as e:
                        rep.events.append((uuid, f"MPS daemon on {d.name} died; "
                                                 f"restart failed: {e}"))
                if h == "fault":
                    self._collect_fault(uuid, d, rep)
                else:
                    self._reported.pop(uuid, None)
                self._states[uuid] = h
        for uuid, msg in rep.events:
            log.warning("%s", msg)
        return rep

    def _collect_fault(self, uuid: str, d: MpsDaemon, rep: CheckReport) -> None:
        seen = self._reported.setdefault(uuid, set())
        fresh: list[int] = []
        try:
            for s in d.server_list():
                if not d.server_status(s).startswith("FAULT"):
                    continue
                for c in d.client_list(s):
                    if (s, c) not in seen:
                        seen.add((s, c))
                        fresh.append(c)
        except MpsError as e:
            rep.events.append((uuid, f"MPS daemon on {d.name} does not answer: {e}"))
            return
        if fresh:
            rep.faults[uuid] = fresh
            pids = ", ".join(map(str, fresh))
            rep.events.append((uuid, f"{FAULT_REASON} on {d.name}: clients {pids}"))

    def release_idle(self, now: float, busy_uuids: Iterable[str]) -> list[str]:
        """Stop daemons that had no job for idle_stop_s (`now` in any one clock the caller keeps);
        a daemon that still lists clients is never stopped. Returns the stopped uuids."""
        busy = set(busy_uuids)
        stopped = []
        with self._lock:
            for uuid, d in self._daemons.items():
                if uuid in busy or not d.running():
                    self._idle_since.pop(uuid, None)
                    continue
                since = self._idle_since.setdefault(uuid, now)
                if now - since < self.idle_stop_s:
                    continue
                try:
                    if any(d.client_list(s) for s in d.server_list()):
                        continue
                except MpsError:
                    continue
                d.stop()
                self._idle_since.pop(uuid, None)
                self._states[uuid] = "off"
                stopped.append(uuid)
                log.info("MPS daemon on %s stopped after %.0fs idle", d.name, now - since)
        return stopped

    def own_pids(self) -> set[int]:
        """The control daemons colo runs and the servers they forked (for telling them from
        foreign GPU processes)."""
        import psutil

        out: set[int] = set()
        for d in list(self._daemons.values()):
            pid = d.pid
            if pid is None:
                continue
            out.add(pid)
            try:
                out.update(c.pid for c in psutil.Process(pid).children(recursive=True))
            except psutil.NoSuchProcess:
                pass
        return out

    def stop_unused(self) -> list[str]:
        """At colo shutdown: stop the daemons no client uses; those serving jobs outlive colo and are
        adopted again at its restart."""
        return self.release_idle(float("inf"), ()) if self.idle_stop_s < float("inf") else []

    def terminate_then(self, uuid: str, client_pids: int | Iterable[int],
                       kill: Callable[[], None]) -> bool:
        """Invariant 6: send terminate_client for each client (to the server whose client list holds
        it), then call kill(). kill() runs even when terminate_client fails or the daemon does not
        answer, because a stuck client must not live forever; the failure is logged. Returns whether
        every listed client was sent terminate_client without error."""
        pids = [client_pids] if isinstance(client_pids, int) else list(client_pids)
        d = self._daemons.get(uuid)
        ok = True
        try:
            if pids and (d is None or not d.running()):
                ok = False
                log.warning("no MPS daemon runs on GPU %s: cannot send terminate_client for %s; "
                            "killing anyway", uuid, pids)
            elif pids:
                owner = {c: s for s in d.server_list() for c in d.client_list(s)}
                for c in pids:
                    if c not in owner:
                        continue  # not (or no longer) an MPS client: nothing to terminate
                    try:
                        d.terminate_client(owner[c], c)
                    except MpsError as e:
                        ok = False
                        log.warning("terminate_client for pid %d failed, killing anyway: %s", c, e)
        except MpsError as e:
            ok = False
            log.warning("MPS daemon on %s does not answer, killing its client(s) anyway: %s",
                        d.name, e)
        finally:
            kill()
        return ok

    def stop_all(self) -> None:
        with self._lock:
            for uuid, d in self._daemons.items():
                d.stop()
                self._states[uuid] = "off"
            self._idle_since.clear()
            self._reported.clear()
