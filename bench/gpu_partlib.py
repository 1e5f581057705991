"""What every part of bench/gpu_check.py works with: the Part that records checks and results and
hands a snapshot to the runner after each one, child processes that report JSON lines, and colo's
view of GPU 0 (the simulated driver's when the run is simulated)."""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PROBE = HERE / "gpu_probe.py"
GiB, MiB = 1 << 30, 1 << 20
TAIL = 1500  # characters kept of a child's standard error


class Part:
    """What one part saw: checks (name, ok, detail), results, skipped items, and, when the whole part
    could not run here, the reason. Every change is sent to the runner at once (`emit`), so a part
    killed at its time limit keeps everything it had recorded."""

    def __init__(self, ctx: dict, emit=None):
        self.ctx = ctx
        self.simulated = bool(ctx.get("fake_state"))
        self.checks: list[dict] = []
        self.results: dict = {}
        self.skipped: list[str] = []
        self.skip_reason: str | None = None
        self._emit = emit or (lambda snap: None)
        self._t0 = time.monotonic()
        env = dict(os.environ)
        for k in ("LD_PRELOAD", "COLO_GPU_BUDGET", "COLO_LEDGER", "COLO_SOCKET"):
            env.pop(k, None)
        self.env = env
        self.tmp = Path(ctx["run_root"]) / ctx["part"]  # short: MPS socket paths must fit 107 bytes
        self.tmp.mkdir(mode=0o755, exist_ok=True)
        os.chmod(self.tmp, 0o755)  # other users' MPS clients and colo's jobs read from here

    def left(self, margin: float = 2.0) -> float:
        """Seconds left of this part's time limit, less a margin for recording what happened."""
        return max(1.0, self.ctx.get("limit", 600) - (time.monotonic() - self._t0) - margin)

    def snapshot(self) -> dict:
        return {"checks": self.checks, "results": self.results, "skipped": self.skipped,
                "skip_reason": self.skip_reason}

    def flush(self) -> None:
        self._emit(self.snapshot())

    def check(self, name: str, ok: bool, detail="") -> bool:
        self.checks.append({"name": name, "ok": bool(ok), "detail": detail})
        self.flush()
        if self.ctx.get("hang_part") == self.ctx["part"]:  # tests: a part cut at its limit after one check
            time.sleep(1e6)
        return bool(ok)

    def put(self, key: str, value) -> None:
        self.results[key] = value
        self.flush()

    def skip(self, what: str) -> None:
        self.skipped.append(what)
        self.flush()

    def skip_part(self, reason: str) -> None:
        """The whole part cannot run here (not a failure of colo): the report says why."""
        self.skip_reason = reason
        self.flush()


class Proc:
    """A child process whose JSON-line events are read as they come; it may wait on stdin ("hold")."""

    def __init__(self, argv: list[str], env: dict, cwd: str | None = None, user: int | None = None,
                 group: int | None = None):
        self.argv = argv
        kw = {"user": user, "group": group, "extra_groups": []} if user is not None else {}
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=env, cwd=cwd, start_new_session=True, **kw)
        self.events: list[dict] = []
        self.other: list[str] = []
        self._q: queue.Queue = queue.Queue()
        self._err: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=lambda: self._err.extend(self.p.stderr), daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stdout:
            try:
                ev = json.loads(line)
                if isinstance(ev, dict):
                    self.events.append(ev)
                    self._q.put(ev)
                    continue
            except ValueError:
                pass
            self.other.append(line.rstrip())
        self._q.put(None)

    def wait_event(self, name: str, timeout: float) -> dict | None:
        deadline = time.monotonic() + timeout
        for ev in self.events:
            if ev.get("event") == name:
                return ev
        while (left := deadline - time.monotonic()) > 0:
            try:
                ev = self._q.get(timeout=left)
            except queue.Empty:
                return None
            if ev is None:
                self._q.put(None)  # the process ended: later waits return at once too
                return None
            if ev.get("event") == name:
                return ev
        return None

    def send(self, line: str = "go") -> None:
        try:
            self.p.stdin.write(line + "\n")
            self.p.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            pass

    def finish(self, timeout: float) -> dict:
        try:
            rc = self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_group(self.p.pid)
            rc = self.p.wait()
            self.other.append(f"killed after {timeout:g}s")
        time.sleep(0.05)  # let the reader threads drain the pipes
        return {"rc": rc, "events": {e.get("event"): e for e in self.events},
                "stderr": "".join(self._err)[-TAIL:], "stdout_other": self.other[-10:]}

    def event(self, name: str) -> dict:
        return next((e for e in self.events if e.get("event") == name), {})


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def sh(argv: list[str], timeout: float = 30, env=None) -> tuple[int, str]:
    """(exit code, stdout+stderr stripped); 127 when the program is missing, 124 when it timed out."""
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, errors="replace")
        return r.returncode, (r.stdout + r.stderr).strip()
    except FileNotFoundError:
        return 127, f"{argv[0]}: not found"
    except subprocess.TimeoutExpired:
        return 124, f"{argv[0]}: timed out after {timeout:g}s"
    except OSError as e:
        return 126, f"{argv[0]}: {e}"


def nvml(ctx: dict):
    from colo.node.gpu import Nvml

    return Nvml(Path(ctx["fake_state"]) if ctx.get("fake_state") else None)


def gpu0(ctx: dict) -> dict:
    d = nvml(ctx).devices()[0]
    return {"uuid": d.uuid, "name": d.name, "total": d.total, "compute_mode": d.compute_mode}


def nvml_processes(ctx: dict) -> dict:
    """pid -> {used, mps} for device 0, through colo's own NVML view."""
    return {p.pid: {"used": p.used, "mps": p.mps} for p in nvml(ctx).devices()[0].processes}


def budget_env(part: Part, budget: int, name: str) -> tuple[dict, Path]:
    """The environment of a job held to `budget` by the interposer, and its ledger."""
    from colo.node import interposer

    ledger = part.tmp / f"ledger-{name}"
    interposer.create_ledger(ledger, budget)
    env = {**part.env, **interposer.job_env(budget, str(ledger), str(interposer.library_path()))}
    return env, ledger
