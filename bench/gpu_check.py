"""colo on a real GPU, in one command that fits a borrowed machine's limits (docs/gpu.md): each part
in its own process under a fixed time budget, the most valuable first, the whole within --deadline;
never stops at the first failure. OUT gets two files, gpu-report.json (everything, logs folded in)
and gpu-report.md, both rewritten after every check, so a part or a run cut short keeps whatever
had finished; the Markdown summary is also printed after every part and at the end.

    python bench/gpu_check.py --prepare            # here: native/build and .gpu-deps, to carry there
    python bench/gpu_check.py OUT [--deadline 420] [--parts machine,frameworks,...] [--budget 2GiB]
    python bench/gpu_check.py OUT --simulated      # the same parts on native/fakegpu (no GPU needed)

Parts, in the order they run (budget in seconds):
  machine (40)      what was carried loads here; driver, CUDA, framework versions, nvidia-smi -q,
                    kernel and glibc, /dev/nvidia* and the driver's device-file parameters, cgroups,
                    what cuGetProcAddress answers for the counted entry points at CUDA 12.0-13.3
  frameworks (90)   budgets as each framework sees them under the interposer (gpu_parts.py)
  mps (40)          colo's MPS daemon, two clients with limits, NVML per process, a second user
  colocation (160)  the co-location gain with real PyTorch jobs (MPS only if part mps passed)
  cost (40)         interposer overhead per alloc/free pair, PyTorch allocator churn
  mps_faults (30)   terminate_client and a fault in one client
  suspend (60)      the driver's checkpoint (colo suspend): 8 GiB of known tensors released, used by
                    another process, restored bit-identical; seconds per GiB (bench/gpu_suspend.py)
  groups (150)      only when named in --parts: 2-16 light and 2-4 medium jobs at once, a compute-
                    bound and a bandwidth-bound heavy pair, time-sliced and under MPS, against one
                    alone (what bench/fit_truth.py refits from)
  queues (150)      only when named in --parts: two queues of mixed PyTorch jobs, one that fits in
                    memory and one that does not, one after another, all at once without colo, and
                    under colo cold and learned (bench/gpu_queues.py)

Figures from --simulated describe the simulated driver, not a GPU: they check that this command
works, and never go into docs/gpu.md.
"""
from __future__ import annotations

import argparse
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
import checkout  # noqa: E402
checkout.use_colo()  # colo from this checkout: a lent GPU machine cannot install it

from gpu_partlib import GiB, MiB, Part, kill_group, sh  # noqa: E402
from gpu_queues import queues_md  # noqa: E402

DEPS_DIR = ROOT / ".gpu-deps"  # colo's dependencies for Python 3.12 (--prepare); the image's own copies win
PARTS = {"machine": 40, "frameworks": 90, "mps": 40, "colocation": 160, "cost": 40, "mps_faults": 30,
         "suspend": 60, "groups": 150, "queues": 150}
# run unless --parts says otherwise; `groups` (what bench/fit_truth.py refits the h200 truth from) is
# asked for by name: docs/gpu.md gives the call
DEFAULT_PARTS = ("machine", "frameworks", "mps", "colocation", "cost", "mps_faults", "suspend")
DEADLINE = 420  # seconds; the default parts' budgets but suspend's add up to 400 (it runs last, on what is
#                 left, or alone: --parts suspend)
FINISH_S, MIN_PART_S = 3.0, 5.0  # kept for the last report; a part given less is not started
LOG_CAP = 6000  # characters kept of each part's own output
SUMMARY_CAP = 10_000  # the printed summary, so that one whole copy fits in 12,000 characters of output
NVIDIA_DIRS = ("/usr/local/nvidia/bin", "/usr/local/cuda/bin")  # where an image may keep nvidia-cuda-mps-control
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")
CARRY_LIMIT = 64 * MiB  # what travels to the lent machine: the tree and the carried folders


def part_fn(name: str):
    import gpu_facts
    import gpu_parts
    import gpu_queues
    import gpu_suspend

    return {"machine": gpu_facts.part_machine, "frameworks": gpu_parts.part_frameworks, "mps": gpu_parts.part_mps,
            "colocation": gpu_parts.part_colocation, "cost": gpu_parts.part_cost,
            "mps_faults": gpu_parts.part_mps_faults, "suspend": gpu_suspend.part_suspend,
            "groups": gpu_parts.part_groups, "queues": gpu_queues.part_queues}[name]


# --- what travels: native/build and .gpu-deps ------------------------------------------------------

def prepare() -> int:
    """Build native/ and fill .gpu-deps with colo's dependencies as wheels for CPython 3.12 on
    x86-64 (numpy left out: the frameworks bring it); print what travels against the carry limit."""
    if subprocess.call(["make", "-s", "-C", str(ROOT / "native")]) != 0:
        print("gpu_check --prepare: building native/ failed", file=sys.stderr)
        return 1
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    deps = [d for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
            if not d.replace(" ", "").startswith("numpy")]
    shutil.rmtree(DEPS_DIR, ignore_errors=True)
    rc = subprocess.call([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile",
                          "--target", str(DEPS_DIR), "--python-version", "3.12", "--implementation", "cp",
                          "--only-binary=:all:", *(f"--platform={p}" for p in PLATFORMS), *deps])
    if rc != 0:
        print("gpu_check --prepare: pip could not fetch colo's dependencies for Python 3.12", file=sys.stderr)
        return rc
    shutil.rmtree(DEPS_DIR / "bin", ignore_errors=True)  # scripts naming this machine's interpreter
    from gpu_facts import glibc_needed, native_files

    tree = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-co", "--exclude-standard", "-z"],
                          capture_output=True).stdout.decode().split("\0")
    sizes = {"tree": sum((ROOT / f).stat().st_size for f in tree if f and (ROOT / f).is_file()),
             "native/build": _du(ROOT / "native" / "build"), ".gpu-deps": _du(DEPS_DIR)}
    total = sum(sizes.values())
    print("to carry: " + ", ".join(f"{k} {v / MiB:.1f} MiB" for k, v in sizes.items())
          + f"; {total / MiB:.1f} of {CARRY_LIMIT // MiB} MiB")
    libs, progs = native_files(ROOT / "native" / "build")
    print(f"native/build needs glibc <= {glibc_needed(libs + progs)}; this machine has {os.confstr('CS_GNU_LIBC_VERSION')}")
    return 0 if total <= CARRY_LIMIT else 1


def _du(d: Path) -> int:
    return sum(p.lstat().st_size for p in d.rglob("*") if p.is_file() and not p.is_symlink()) if d.is_dir() else 0


def ensure_native() -> dict:
    """The native files (carried, or built earlier here); built with make only when missing."""
    from colo.node import native

    d = native.native_dir()
    need = [d / native.INTERPOSER, d / native.BURN, d / "colo-shim", d / native.FAKEGPU_DIR / "libcuda.so.1"]
    info: dict = {"dir": str(d)}
    if all(p.exists() for p in need):
        rc, text = sh([sys.executable, "-c", "import ctypes, sys; ctypes.CDLL(sys.argv[1])", str(need[0])], 30)
        if rc == 0:
            return {**info, "how": "present (carried or built earlier)"}
        info["carried_error"] = (text.strip().splitlines() or ["?"])[-1][-600:]  # e.g. a newer glibc than here
    if d != ROOT / "native" / "build":
        return {**info, "how": "missing or unusable (COLO_NATIVE_DIR names a folder without usable files)"}
    t0 = time.monotonic()
    rc, text = sh(["make", "-s", "-B", "-C", str(ROOT / "native")], 180)
    return {**info, "how": ("rebuilt here (the carried files did not load)" if "carried_error" in info else
                            "built here") if rc == 0 else "build failed",
            "seconds": round(time.monotonic() - t0, 1), "build_log": text[-2000:]}


def overlay(run_root: Path) -> dict:
    """The distributions of .gpu-deps this interpreter lacks, linked into a folder put last on the
    parts' PYTHONPATH: what the image has (torch's, JAX's, their numpy and typing_extensions) always
    wins, since nothing it has is shadowed; the carried copies only fill the gaps."""
    if not DEPS_DIR.is_dir():
        return {"dir": None, "note": f"no {DEPS_DIR.name}/ (python bench/gpu_check.py --prepare makes it)"}
    ov = run_root / "pydeps"
    ov.mkdir()
    linked, image = [], []
    for info in sorted(DEPS_DIR.glob("*.dist-info")):
        dist = info.name[:-len(".dist-info")].rsplit("-", 1)[0]
        try:
            metadata.distribution(dist)
            image.append(dist)
            continue
        except metadata.PackageNotFoundError:
            pass
        try:  # its files, by their first folder (RECORD lists every file a wheel installed)
            tops = {line.split(",", 1)[0].split("/", 1)[0] for line in (info / "RECORD").read_text().splitlines()}
        except OSError:
            tops = set()
        for top in sorted(tops - {"..", "__pycache__", ""}) + [info.name]:
            if (DEPS_DIR / top).exists() and not (ov / top).exists():
                (ov / top).symlink_to(DEPS_DIR / top)
                if top != info.name:
                    linked.append(top.split(".")[0])
    return {"dir": str(ov), "linked_modules": linked, "image_has": image}


def make_run_root() -> tuple[Path, dict]:
    """The run's scratch folder, short (MPS socket paths must fit 107 bytes), on the first of these
    filesystems that takes POSIX ACLs: colo runs no MPS where its pipe folders cannot carry one,
    and a sandbox's /tmp may not."""
    from colo.node import mps

    tried: dict = {}
    for base in ("/tmp", "/run", "/dev/shm", "/var/tmp"):
        try:
            d = Path(tempfile.mkdtemp(prefix="cgc", dir=base))
        except OSError as e:
            tried[base] = e.strerror
            continue
        os.chmod(d, 0o755)
        tried[base] = mps.acl_problem(d) or "takes ACLs"
        if tried[base] == "takes ACLs":
            return d, tried
        shutil.rmtree(d, ignore_errors=True)
    d = Path(tempfile.mkdtemp(prefix="cgc", dir="/tmp"))
    os.chmod(d, 0o755)
    return d, tried


def part_env(ctx: dict) -> dict[str, str]:
    """Environment of a part and of what it starts: this checkout's colo first, the carried packages
    last, the simulated driver first when asked."""
    from colo.node import native

    env = dict(os.environ)
    ov = (ctx.get("overlay") or {}).get("dir")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
                                        + ([ov] if ov else []))
    env["COLO_GPUCHECK_RUN"] = ctx["marker"]  # every process of this run, for the sweep of leftovers
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p]
    path += [d for d in NVIDIA_DIRS if os.path.isdir(d) and d not in path]
    if ctx.get("fake_state"):
        fake = str(native.native_dir() / native.FAKEGPU_DIR)
        env["COLO_FAKEGPU_STATE"] = ctx["fake_state"]
        env["LD_LIBRARY_PATH"] = os.pathsep.join([fake] + ([env["LD_LIBRARY_PATH"]] if env.get("LD_LIBRARY_PATH")
                                                           else []))
        path.insert(0, fake)
    env["PATH"] = os.pathsep.join(path)
    return env


# --- running a part ------------------------------------------------------------------------------

def child(name: str, ctx_file: str, fd: int) -> int:
    """In the part's own process: run it, sending a snapshot of its record after every change."""
    ctx = json.loads(Path(ctx_file).read_text())
    stream = os.fdopen(fd, "w")
    lock = threading.Lock()

    def emit(snap: dict) -> None:
        line = json.dumps(snap, default=str)
        with lock:
            stream.write(line + "\n")
            stream.flush()

    threading.Thread(target=orphan_watch, args=(os.getppid(), ctx), daemon=True).start()
    part = Part(ctx, emit)
    try:
        if ctx.get("fail_part") == name:
            raise RuntimeError(f"failure injected into part {name} (--fail-part)")
        part_fn(name)(part)
        emit({**part.snapshot(), "final": True})
    except Exception as e:  # noqa: BLE001 - the report says what broke, the other parts still run
        emit({**part.snapshot(), "final": True, "error": f"{type(e).__name__}: {e}",
              "traceback": traceback.format_exc()[-3000:]})
    return 0


def orphan_watch(parent: int, ctx: dict) -> None:
    """A part whose runner was killed outright (a machine's time limit) ends, and a process of its
    own ends everything else of the run and removes its folder: the part's own session outlives
    the runner's, and it would run on (and write into the folder) while it is being cleaned."""
    while os.getppid() == parent:
        time.sleep(0.5)
    subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--sweep", ctx["run_root"], ctx["marker"]],
                     start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os._exit(1)


class Cut(Exception):
    """The run was told to stop (SIGTERM, SIGINT)."""


def run_part(name: str, ctx: dict, limit: float, rep: "Report") -> dict:
    rec = rep.data["parts"][name] = {"status": "running", "checks": [], "results": {}, "skipped": [],
                                     "budget": PARTS[name], "limit": round(limit)}
    ctx_file = Path(ctx["run_root"]) / f"{name}.ctx.json"
    ctx_file.write_text(json.dumps({**ctx, "part": name, "limit": limit}))
    r_ev, w_ev = os.pipe()
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--run-part", name, str(ctx_file),
                          "--events-fd", str(w_ev)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         pass_fds=(w_ev,), env=part_env(ctx), start_new_session=True)
    os.close(w_ev)
    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ, "log")
    sel.register(r_ev, selectors.EVENT_READ, "events")
    log, buf, timed_out, printed = b"", b"", False, 0
    deadline, exited_at = t0 + limit, None
    try:
        while sel.get_map():
            now = time.monotonic()
            if now >= deadline:
                timed_out = p.poll() is None
                break
            if p.poll() is not None:  # the part ended: what its leftovers still hold open is not waited for
                exited_at = exited_at or now
                if now - exited_at > 1.0:
                    break
            for key, _ in sel.select(timeout=min(0.5, deadline - now)):
                fd = key.fileobj if isinstance(key.fileobj, int) else key.fileobj.fileno()
                data = os.read(fd, 1 << 16)
                if not data:
                    sel.unregister(key.fileobj)
                elif key.data == "log":
                    log = (log + data)[-LOG_CAP:]
                else:
                    buf += data
                    while b"\n" in buf:
                        line, buf = buf.split(b"\n", 1)
                        try:
                            rec.update(json.loads(line))
                        except ValueError:
                            continue
                        for c in rec["checks"][printed:]:
                            print(f"  [{'x' if c['ok'] else ' '}] {name}: {c['name']}", flush=True)
                        printed = len(rec["checks"])
                        rec["seconds"] = round(time.monotonic() - t0, 1)
                        rep.save()
    except Cut:
        rec.update(status="cut", error="the run was stopped while this part ran")
        raise
    finally:
        if p.poll() is None:
            kill_group(p.pid)  # the part and everything it started in its session
        p.wait()
        sel.close()
        os.close(r_ev)
        rec["seconds"] = round(time.monotonic() - t0, 1)
        rec["log_tail"] = log.decode(errors="replace")
        rec["left_behind"] = sweep(Path(ctx["run_root"]), ctx["marker"])
    if timed_out:
        rec.update(status="timeout", error=f"killed at its time limit of {limit:.0f} s"
                   + (" (what the run's deadline left)" if limit < PARTS[name] else ""))
    elif not rec.get("final"):
        rec.update(status="error", error=f"its process exited {p.returncode} without a final report: "
                                         f"{rec['log_tail'].strip()[-400:]}")
    elif rec.get("error"):
        rec["status"] = "error"
    elif any(not c["ok"] for c in rec["checks"]):
        rec["status"] = "failed"
    else:
        rec["status"] = "skipped" if rec.get("skip_reason") or not rec["checks"] else "ok"
    return rec


def sweep(run_root: Path, marker: str) -> list[str]:
    """End what a part left running (MPS daemons daemonize, colo's jobs outlive their daemon by
    design): every process of this run, found by its environment or its command line. MPS control
    daemons are asked to quit first: killing a server under its clients can hang it."""
    import psutil

    mine = []
    for p in psutil.process_iter(["cmdline", "name"]):
        if p.pid == os.getpid():
            continue
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            if str(run_root) in cmd or p.environ().get("COLO_GPUCHECK_RUN") == marker:
                mine.append(p)
        except psutil.Error:
            continue
    for p in mine:
        if p.info["name"] == "nvidia-cuda-mps-control":
            try:
                subprocess.run([p.exe()], input="quit\n", env=p.environ(), capture_output=True, text=True, timeout=5)
            except (psutil.Error, OSError, subprocess.TimeoutExpired):
                pass
    _, alive = psutil.wait_procs(mine, timeout=2)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    return [f"{p.pid} {p.info['name']}" for p in mine]


# --- the report ----------------------------------------------------------------------------------

class Report:
    """gpu-report.json and gpu-report.md in OUT, rewritten whole (atomically) on every save."""

    def __init__(self, out: Path, data: dict):
        self.out, self.data = out, data
        self.t0 = time.monotonic()

    def save(self) -> None:
        self.data["seconds"] = round(time.monotonic() - self.t0, 1)
        for name, text in (("gpu-report.json", json.dumps(self.data, indent=1, default=str) + "\n"),
                           ("gpu-report.md", markdown(self.data))):
            tmp = self.out / f"{name}.tmp"
            tmp.write_text(text)
            os.replace(tmp, self.out / name)

    def summary(self) -> str:
        text = markdown(self.data)
        if len(text) > SUMMARY_CAP:
            text = markdown(self.data, passed=False)
        if len(text) > SUMMARY_CAP:
            text = text[:SUMMARY_CAP - 120] + "\n\n… (cut here: gpu-report.md and gpu-report.json hold all of it)\n"
        return text


def _mib(x) -> str:
    return f"{x / MiB:,.0f} MiB" if isinstance(x, (int, float)) else "?"


def _s(x, fmt: str = ".1f", unit: str = " s") -> str:
    return f"{x:{fmt}}{unit}" if isinstance(x, (int, float)) else "-"


def markdown(r: dict, passed: bool = True) -> str:
    parts = r["parts"]
    mach = parts.get("machine", {}).get("results", {})
    sysr, nv = mach.get("system", {}), mach.get("nvml", {})
    smi = (mach.get("nvidia_smi") or {}).get("summary", {})
    L = [f"# colo GPU check: {r['date']}", ""]
    if r["simulated"]:
        L += ["**SIMULATED DRIVER (native/fakegpu): these figures check that the command works; they say nothing "
              "about a GPU and never go into docs/gpu.md.**", ""]
    ov = r.get("overlay") or {}
    L += [f"- result: **{r.get('verdict', 'running')}**, {r.get('seconds', 0):.0f} s of a {r['deadline']:.0f} s "
          f"deadline" + (f"; {r['cut']}" if r.get("cut") else ""),
          f"- GPU: {nv.get('gpu0', '?')}, {_mib(nv.get('gpu0_memory'))}, driver {nv.get('driver', '?')}, CUDA (driver) "
          f"{nv.get('cuda_driver', '?')}, compute mode {nv.get('compute_mode', '?')}, MIG "
          f"{smi.get('MIG Mode/Current', '?')}, persistence {smi.get('Persistence Mode', '?')}",
          f"- machine: kernel {sysr.get('kernel', '?')} (sandbox: {sysr.get('sandbox', '?')}), {sysr.get('os', '?')}, "
          f"glibc {sysr.get('glibc', '?')}, Python {sysr.get('python', '?')}, {sysr.get('cpus', '?')} CPUs; "
          f"nvcc: {sysr.get('nvcc', '?')}; MPS control: {sysr.get('mps_control', '?')}",
          "- frameworks: " + ("; ".join(f"{k} {v}" for k, v in (mach.get("frameworks") or {}).items()) or "?"),
          f"- carried: native files {(r.get('native') or {}).get('how', '?')} (need glibc <= "
          f"{(mach.get('native') or {}).get('glibc_needed_at_most', '?')}); .gpu-deps fills in "
          f"{', '.join(ov.get('linked_modules') or []) or 'nothing'}"
          + (f" (the image's own: {', '.join(ov['image_has'])})" if ov.get("image_has") else "")
          + (f"; {ov['note']}" if ov.get("note") else ""),
          f"- command: `{r['command']}`", "",
          "| part | status | checks passed | seconds (limit) |", "|---|---|---|---|"]
    for name, p in parts.items():
        cs = p.get("checks", [])
        L.append(f"| {name} | {p['status']} | {sum(c['ok'] for c in cs)}/{len(cs)} | {p.get('seconds', '-')} "
                 f"({p.get('limit', '-')}) |")
    probs = []
    for name, p in parts.items():
        if p.get("error"):
            probs.append(f"- {name}: **{p['status']}**: {p['error'][:400]}")
        if p.get("skip_reason"):
            probs.append(f"- {name}: skipped: {p['skip_reason'][:500]}")
        probs += [f"- {name}: [ ] {c['name']} — `{json.dumps(c['detail'], default=str)[:300]}`"
                  for c in p.get("checks", []) if not c["ok"]]
        probs += [f"- {name}: skipped: {s[:200]}" for s in p.get("skipped", [])]
    if probs:
        L += ["", "## Failed, skipped or cut", ""] + probs
    L += frameworks_md(parts) + colocation_md(parts) + groups_md(parts) + queues_md(parts) + mps_md(parts)
    L += procaddr_md(mach) + gating_md(mach)
    if passed:
        L += ["", "## Checks passed", ""]
        for name, p in parts.items():
            ok = [c["name"] for c in p.get("checks", []) if c["ok"]]
            if ok:
                L.append(f"- {name}: " + "; ".join(ok))
    L += ["", "## Table for docs/gpu.md", ""] + table(parts) + [""]
    return "\n".join(L)


def frameworks_md(parts: dict) -> list[str]:
    fw = parts.get("frameworks", {}).get("results", {}).get("frameworks", [])
    if not fw:
        return []
    L = ["", "## Budgets as each framework sees them", "",
         "| framework | version | total it sees | its OOM at the budget | computes after | ledger | NVML, same process |",
         "|---|---|---|---|---|---|---|"]
    for x in fw:
        h = x.get("at_hold") or {}
        L.append(f"| {x['name']} | {x.get('version') or '-'} | {_mib(x.get('total_seen'))} of {_mib(x['card'])} | "
                 f"{'yes' if x.get('refused') else 'NO'}: {(x.get('oom_error') or '')[:70]} | "
                 f"{'yes' if x.get('after_rc') == 0 and x['rc'] == 0 else 'NO'} | "
                 f"{_mib(h.get('ledger_process_used'))} | {_mib((h.get('nvml') or {}).get('used'))} |")
    return L


def colocation_md(parts: dict) -> list[str]:
    res = parts.get("colocation", {}).get("results", {})
    if "exclusive" not in res:
        return []
    excl = res["exclusive"]["wall_s"]
    n = (res.get("setup") or {}).get("jobs", "?")
    L = ["", f"## Co-location: {n} light PyTorch jobs", "",
         f"{(res.get('setup') or {}).get('mps', '')}", "",
         "| how they ran | wall | throughput vs one after another | how colo ran them |", "|---|---|---|---|"]
    for label, key in (("one after another, no colo", "exclusive"), ("all at once, time-sliced, no colo", "timesliced"),
                       ("colo, cold (no profile)", "colo_cold"), ("colo, seeded with their profile", "colo_seeded")):
        w = (res.get(key) or {}).get("wall_s")
        modes = (res.get(key) or {}).get("modes")
        L.append(f"| {label} | {_s(w)} | {_s(excl / w if w else None, '.2f', 'x')} | "
                 f"{', '.join(f'{k}: {v}' for k, v in modes.items()) if modes else '-'} |")
    sp = res.get("seeded_profile")
    if sp:
        L += ["", f"Seeded profile (from the second run alone): mean SM {sp['mean_sm']:.0%}, peak {sp['peak_sm']:.0%}, "
              f"bandwidth {sp['mean_membw']:.0%}, {_mib(sp['peak_mem'])}, {sp['runtime_s']} s, {sp['samples']} samples"
              + (f"; learned by colo in the cold run: {res['colo_cold']['learned']}"
                 if (res.get("colo_cold") or {}).get("learned") else "")]
    return L


def groups_md(parts: dict) -> list[str]:
    gs = parts.get("groups", {}).get("results", {}).get("groups", [])
    if not gs:
        return []
    L = ["", "## Groups of like jobs at once (the fit's observations)", "",
         "| jobs | mode | one alone | together | throughput vs one after another | SM, bandwidth alone "
         "| device SM together: read, as colo's watch expects (SM alone x throughput) |",
         "|---|---|---|---|---|---|---|"]
    L += [f"| {g['n']} {g['kind']} | {g['mode']} | {g['alone_s']:.1f} s | {g['together_s']:.1f} s | "
          f"{g['throughput']:.2f}x | {g['mean_sm']:.0%}, {g.get('mean_membw', 0):.0%} | "
          + (f"{g['together_sm']:.0%}, {min(1.0, g['mean_sm'] * g['throughput']):.0%} |" if "together_sm" in g else "— |")
          for g in gs]
    return L


def mps_md(parts: dict) -> list[str]:
    res = parts.get("mps", {}).get("results", {})
    view = res.get("nvml")
    L = []
    if view:
        L += ["", "## NVML per process with MPS clients (while both are busy)", ""]
        util = {u["pid"]: u for u in view.get("utilization", [])} if isinstance(view.get("utilization"), list) else {}
        for key in ("compute", "mps"):
            rows = view.get(key)
            if isinstance(rows, str):
                L.append(f"- {key} list: {rows}")
                continue
            for x in rows or []:
                u = util.get(x["pid"], {})
                L.append(f"- {key} list: pid {x['pid']} ({x['role']}): {_mib(x['used'])}, SM {u.get('sm', '-')} %, "
                         f"memory {u.get('mem', '-')} %")
        if isinstance(view.get("utilization"), str):
            L.append(f"- utilisation: {view['utilization']}")
        L += [f"- utilisation only: pid {p} ({u['role']}): SM {u['sm']} %" for p, u in util.items()
              if not any(isinstance(view.get(k), list) and any(x["pid"] == p for x in view[k]) for k in ("compute", "mps"))]
    su = res.get("second_user")
    if su:
        L += ["", f"Second user (uid {su['uid']}): client rc {su['rc']}, its server {su['servers']}, "
              f"control.log names the uid: {su['control_log_mentions_uid']}"]
    return L


def procaddr_md(mach: dict) -> list[str]:
    pa = mach.get("procaddr")
    if not pa:
        return []
    s = pa["summary"]
    L = ["", "## cuGetProcAddress (the bare driver)", "",
         f"- cuGetProcAddress(\"cuMemAlloc\", 13020) is {s['cuMemAlloc@13020']}: the same pointer as "
         f"dlsym(\"cuMemAlloc_v2\"): **{'yes' if s['cuMemAlloc@13020_is_dlsym_cuMemAlloc_v2'] else 'no'}**",
         f"- answers that are no exported symbol: {', '.join(s['unexported'][:20]) or 'none'}"
         + (f" (+{len(s['unexported']) - 20})" if len(s["unexported"]) > 20 else ""),
         f"- refused by the interposer where the driver answers: {', '.join(s['refused_by_interposer'][:20]) or 'none'}",
         "- answers that change across " + "/".join(map(str, pa["versions"])) + ":"]
    L += [f"  - {k}: " + ", ".join(f"{v}" for v in by.values()) for k, by in list(s["changes"].items())[:25]]
    return L


def gating_md(mach: dict) -> list[str]:
    g = mach.get("gating")
    if not g:
        return []
    cg = g["cgroup"]
    L = ["", "## Gating facts", "",
         "- device files: " + ("; ".join(f"{d['path']} {d['mode']} {d['owner']}:{d['group']}" for d in g["dev_nvidia"])
                               or "none"),
         f"- driver parameters: {g['device_file_params']}",
         f"- cgroup: {'v2' if cg['v2'] else 'not v2'}, controllers {(cg['controllers'] or '-').strip()}, own "
         f"{(cg['own'] or '-').strip()}, cgroup.kill {'yes' if cg['own_has_cgroup_kill'] else 'no'}; child: "
         f"{cg['child_cgroup']}; bpftool {cg['bpftool']}, bpffs {'yes' if cg['bpffs'] else 'no'}"]
    return L


def table(parts: dict) -> list[str]:
    """Parts cost and colocation, as the table in docs/gpu.md."""
    rows = []
    cost = parts.get("cost", {}).get("results", {})
    for x in cost.get("pairs", []):
        rows.append((f"cuMemAlloc+cuMemFree pair, 1 MiB, {x['threads']} thread(s)",
                     f"{x['interposed_ns']:.0f} ns interposed vs {x['native_ns']:.0f} ns native "
                     f"(+{x['added_ns']:.0f} ns, {x['ratio']:.2f}x)"))
    for x in cost.get("churn", []):
        rows.append((f"PyTorch churn, 10,000 tensors, caching allocator {'on' if x['caching'] else 'off'}",
                     f"{x['interposed_s']:.2f} s interposed vs {x['native_s']:.2f} s native ({x['ratio']:.2f}x)"))
    res = parts.get("colocation", {}).get("results", {})
    lt = res.get("light")
    if lt:
        rows.append((f"{lt['jobs']} light jobs: throughput vs one at a time",
                     f"time-sliced {lt['timesliced_vs_exclusive']:.2f}x, colo cold "
                     f"{_s(lt.get('colo_cold_vs_exclusive'), '.2f', 'x')}, colo seeded "
                     f"{_s(lt.get('colo_seeded_vs_exclusive'), '.2f', 'x')} (walls: {lt['exclusive_s']:.1f} s, "
                     f"{lt['timesliced_s']:.1f} s, {_s(lt.get('colo_cold_s'))}, {_s(lt.get('colo_seeded_s'))})"))
    if res.get("pair"):
        p = res["pair"]
        ratio = f" (MPS {p['mps_vs_timesliced']:.2f}x the throughput)" if p.get("mps_vs_timesliced") else ""
        rows.append(("saturating pair: MPS vs time-sliced", f"{_s(p.get('mps_s'))} vs {_s(p['timesliced_s'])}; "
                     f"one after the other {_s(p['exclusive_s'])}{ratio}"))
    if res.get("budget_jobs"):
        rows.append(("a job over its budget", "; ".join(f"{k}: {v['state']} (exit {v.get('exit_code')})"
                                                         for k, v in res["budget_jobs"].items())))
    out = ["| what | measured |", "|---|---|"] + [f"| {a} | {b} |" for a, b in rows]
    return out if rows else ["(no figures: parts cost and colocation did not run)"]


# --- the run -------------------------------------------------------------------------------------

def mps_state(parts: dict) -> tuple[bool, str]:
    """Whether MPS worked here (part mps passed), and if not, why: parts after it use MPS only then."""
    p = parts.get("mps")
    if p is None:
        return False, "part mps was not run"
    if p["status"] == "ok":
        return True, ""
    if p.get("skip_reason"):
        return False, p["skip_reason"]
    bad = next((c["name"] for c in p.get("checks", []) if not c["ok"]), None)
    return False, f"part mps {p['status']}" + (f": {bad}" if bad else f": {p.get('error', '')}"[:300])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, nargs="?", help="folder for gpu-report.json and gpu-report.md")
    ap.add_argument("--simulated", action="store_true", help="run on native/fakegpu (no GPU needed)")
    ap.add_argument("--parts", default=",".join(DEFAULT_PARTS), help=f"parts to run, in order (any of {', '.join(PARTS)})")
    ap.add_argument("--budget", default="2GiB", help="the budget each framework runs under in part frameworks")
    ap.add_argument("--deadline", type=float, default=DEADLINE, help="seconds for everything")
    ap.add_argument("--light-jobs", type=int, default=6, help="jobs of part colocation")
    ap.add_argument("--light-steps", type=int, default=2000,
                    help="training steps of each light job (2,000: about 6 s alone on an H200)")
    ap.add_argument("--heavy-iters", type=int, default=1000, help="4096x4096 matmuls of each saturating job")
    ap.add_argument("--prepare", action="store_true", help="build native/ and fill .gpu-deps/ to carry (needs "
                    "a package index)")
    ap.add_argument("--fail-part", help=argparse.SUPPRESS)  # tests: this part fails at once
    ap.add_argument("--hang-part", help=argparse.SUPPRESS)  # tests: this part hangs after its first check
    ap.add_argument("--run-part", nargs=2, metavar=("NAME", "CTX"), help=argparse.SUPPRESS)
    ap.add_argument("--events-fd", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--sweep", nargs=2, metavar=("RUN_ROOT", "MARKER"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.sweep:  # after a runner killed outright (orphan_watch)
        time.sleep(0.5)  # the part that started this has exited
        sweep(Path(a.sweep[0]), a.sweep[1])
        shutil.rmtree(a.sweep[0], ignore_errors=True)
        return 0
    if a.run_part:
        return child(a.run_part[0], a.run_part[1], a.events_fd)
    if a.prepare:
        return prepare()
    if a.out is None:
        ap.error("give the folder for the report")
    from colo.units import parse_size

    out = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    run_root, acl = make_run_root()
    names = [p for p in a.parts.split(",") if p]
    rep = Report(out, {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "simulated": a.simulated,
                       "command": " ".join(["python", "bench/gpu_check.py", *sys.argv[1:]]), "deadline": a.deadline,
                       "budgets": PARTS, "run_root": str(run_root), "run_root_acl": acl, "verdict": "running",
                       "parts": {}})

    def stop(signum, _frame):
        raise Cut(f"stopped by signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        rep.data["native"] = ensure_native()
        rep.data["overlay"] = overlay(run_root)
        ctx = {"budget": parse_size(a.budget), "fail_part": a.fail_part, "hang_part": a.hang_part,
               "run_root": str(run_root), "marker": run_root.name, "overlay": rep.data["overlay"],
               "native": rep.data["native"], "fake_state": None, "pairs": 2000, "repeat": 3,  # ~65 us a pair on an H200
               "light_jobs": a.light_jobs, "light_steps": a.light_steps, "heavy_iters": a.heavy_iters}
        if a.simulated:
            from colo.node import fakegpu

            state = run_root / "fake" / "gpus"
            state.parent.mkdir(mode=0o755)
            fakegpu.create(state, count=1, mem=80 * GiB, name="Colo Simulated GPU (80 GiB)")
            os.chmod(state, 0o666)
            ctx.update(fake_state=str(state), pairs=5000, repeat=2)
        rep.save()
        for name in names:
            left = a.deadline - (time.monotonic() - rep.t0) - FINISH_S
            if name not in PARTS:
                rep.data["parts"][name] = {"status": "error", "checks": [],
                                           "error": f"no part {name!r}; parts: {', '.join(PARTS)}"}
            elif left < MIN_PART_S:
                rep.data["parts"][name] = {"status": "not run", "checks": [], "budget": PARTS[name],
                                           "error": f"the deadline ({a.deadline:.0f} s) left {max(left, 0):.0f} s"}
            else:
                mps_ok, mps_why = mps_state(rep.data["parts"])
                limit = min(PARTS[name], left)
                print(f"gpu_check: part {name} (limit {limit:.0f} s) ...", flush=True)
                res = run_part(name, {**ctx, "mps_ok": mps_ok, "mps_why": mps_why}, limit, rep)
                print(f"gpu_check: part {name}: {res['status']} in {res['seconds']} s", flush=True)
                rep.save()
                print(rep.summary(), flush=True)
            rep.save()
    except Cut as e:
        rep.data["cut"] = f"{e} after {time.monotonic() - rep.t0:.0f} s"
        for name in names:
            rep.data["parts"].setdefault(name, {"status": "not run", "checks": [], "error": "the run was stopped"})
    finally:
        sweep(run_root, run_root.name)
        shutil.rmtree(run_root, ignore_errors=True)
        bad = [n for n, p in rep.data["parts"].items() if p["status"] not in ("ok", "skipped")]
        rep.data["verdict"] = "passed" if not bad and not rep.data.get("cut") else (
            "not passed: " + ", ".join(f"{n} {rep.data['parts'][n]['status']}" for n in bad) if bad else "cut")
        rep.save()
        print(rep.summary(), flush=True)
        print(f"gpu_check: wrote {out / 'gpu-report.json'} and {out / 'gpu-report.md'}", flush=True)
    return 0 if rep.data["verdict"] == "passed" else 1


if __name__ == "__main__":
    sys.exit(main())
