"""`colo demo`: a private daemon on simulated GPUs tells colo's story with real jobs (colo-burn):
two light profiled jobs share a GPU under MPS; a job nobody profiled runs alone, is profiled, and
its next run is placed from what was learned; a heavy job is kept off a GPU it would saturate;
meanwhile a budget refuses one allocation; an idle job is suspended for a waiting one and resumes
on its next CUDA call; the summary says what sharing saved against one job per GPU. Stops cleanly unless --keep. With --screenshot, `colo top` as it stood while heavy-2 was
kept off and the budget refusal was live is saved as an SVG: the README's picture."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ..node import fakegpu, native
from .. import profiles
from ..client import Client, ClientError
from ..units import format_duration, format_size

GiB = 1024**3
ENDED = ("succeeded", "failed", "cancelled", "lost")

# Profiles the demo ships to its daemon: what these colo-burn runs do, as if learned from 3 runs.
# (name, SM, bandwidth, cache-bound); colo-burn --duty D shows SM D % and bandwidth D/2 %.
DEMO_PROFILES = [("demo-light", 0.30, 0.15, False), ("demo-heavy", 0.95, 0.48, True), ("demo-tiny", 0.10, 0.05, False)]


def _say(msg: str = "") -> None:
    print(msg, flush=True)


def _write_profiles(d: Path) -> None:
    for name, sm, bw, cache in DEMO_PROFILES:
        n = 20
        p = profiles.from_samples(name, {"times": list(range(n)), "sm": [sm] * n, "mem": [512 * 1024**2] * n,
                                         "membw": [bw] * n}, runtime=20, cache_bound=cache)
        p.runs, p.gpu = 3, fakegpu.DEFAULT_NAME  # measured on the simulated GPU: no run alone to check
        profiles.save(p, d / f"{name}.profile")


def run_demo(keep: bool = False, screenshot: Path | None = None) -> int:
    native.ensure_built()
    if shutil.which("nvidia-smi"):
        _say("A real NVIDIA GPU seems present; this demo still uses simulated GPUs. Run the real daemon with "
             "`sudo colo daemon` (or the systemd unit in packaging/) and submit with `colo submit`.")
    root = Path(tempfile.mkdtemp(prefix="colo-demo-"))
    os.chmod(root, 0o755)  # MPS servers and job processes reach the simulated driver's state here
    state = root / "fakegpu" / "state"
    state.parent.mkdir()
    os.chmod(state.parent, 0o777)
    fakegpu.create(state, count=2, mem=16 * GiB, name="Colo Simulated GPU")
    prof = root / "profiles"
    prof.mkdir()
    _write_profiles(prof)
    conf = root / "colo.toml"
    # step 7: an idle job is suspended for a waiting one (simulated GPU memory costs no host memory)
    conf.write_text(f'profile_dirs = ["{prof}"]\nsample_interval = 0.5\nstop_grace = 3.0\nmps_idle_stop = 600.0\n'
                    'idle_jobs = "suspend"\nidle_after = 3.0\nsuspend_host_share = 1.0\n')
    sock = root / "colo.sock"
    env = {**os.environ, "COLO_SOCKET": str(sock)}
    env.pop("COLO_FAKEGPU_STATE", None)
    daemon = subprocess.Popen(
        [sys.executable, "-m", "colo", "daemon", "--state-dir", str(root / "state"), "--socket", str(sock),
         "--config", str(conf), "--fake-gpus", str(state)], env=env,
        stdout=open(root / "daemon.log", "wb"), stderr=subprocess.STDOUT, start_new_session=keep)
    client = Client(sock, timeout=30)
    ok = False
    try:
        hello = _wait_up(client, daemon, root)
        image = _demo_image() if hello["docker_error"] is None else None
        where = f"containers of the local image {image}" if image else "host processes (no Docker engine here)"
        _say(f"colo demo: a private daemon on 2 simulated 16 GiB GPUs; jobs run colo-burn as {where}.")
        recorder = Recorder(Client(sock, timeout=30)) if screenshot else None
        story = Story(client, image, root, recorder)
        try:
            ok = story.run()
        finally:
            shutil.rmtree(story.release, ignore_errors=True)
            if recorder:
                recorder.stop()
        if recorder and ok:
            ok = recorder.save(story.kept_off, story.greedy, screenshot)
        return 0 if ok else 1
    except (ClientError, RuntimeError) as e:
        _say(f"colo demo: {e} (daemon log: {root / 'daemon.log'})")
        keep = True
        return 1
    finally:
        if keep and daemon.poll() is None:
            _say(f"\nThe daemon is still up (pid {daemon.pid}); watch it with\n"
                 f"  COLO_SOCKET={sock} colo top\n"
                 f"stop it with `kill {daemon.pid}`; its state is in {root}")
        else:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(30)
            except subprocess.TimeoutExpired:
                daemon.kill()
            if keep:
                _say(f"state kept in {root}")
            else:
                _end_leftovers(root)
                shutil.rmtree(root, ignore_errors=True)


def _end_leftovers(root: Path) -> None:
    """The demo's private MPS control daemons outlive colo when a client was still detaching as it
    stopped (colo leaves MPS daemons with clients up, to adopt them at its restart): nothing else
    will ever adopt these, so end every process run from the demo's own folder."""
    import psutil

    mine = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if cmd and cmd[0].startswith(str(root) + os.sep):
            mine.append(p)
    for p in mine:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(mine, timeout=5)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass


def _job(snap: dict, i: int | None) -> dict:
    return next((j for j in snap["jobs"] if j["id"] == i), {})


def _kept_off(snap: dict, i: int | None) -> bool:
    """In `colo top`'s `snap`, job `i` waits, kept off by a prediction."""
    j = _job(snap, i)
    return j.get("state") == "queued" and "predicted" in (j.get("reason") or "")


def _refused(snap: dict, i: int | None) -> bool:
    """In `snap`, job `i` runs with a refusal by its budget counted."""
    j = _job(snap, i)
    return j.get("state") == "running" and bool(j.get("refused"))


class Recorder:
    """`colo top`'s snapshots through the demo, one per daemon sample, so that a picture
    of one moment can be drawn afterwards: live jobs would not hold still while the app renders."""

    def __init__(self, client: Client):
        self.c, self.frames, self.done = client, [], threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        while not self.done.is_set():
            try:
                self.frames.append(self.c.top())
            except ClientError:
                pass
            self.done.wait(0.5)  # the demo daemon's sample interval

    def stop(self) -> None:
        self.done.set()
        self.thread.join()

    def save(self, kept_off: int | None, greedy: int | None, path: Path) -> bool:
        """Draws, after the frames before it, a frame in which `kept_off` waits with its reason: best
        one where `greedy` runs with its refusal counted, then the one with the most jobs running."""
        from ..tui.app import screenshot

        def kept(snap: dict) -> bool:
            return _kept_off(snap, kept_off)

        def refused(snap: dict) -> bool:
            return _refused(snap, greedy)

        def score(i: int) -> tuple:
            return refused(self.frames[i]), sum(j["state"] == "running" for j in self.frames[i]["jobs"]), i

        at = [i for i, f in enumerate(self.frames) if kept(f)]
        if not at:
            _say(f"colo demo: no snapshot shows job {kept_off} kept off; {path} not written")
            return False
        best = max(at, key=score)
        screenshot(self.frames[:best + 1], path)
        also = f", job {greedy}'s allocation refused" if refused(self.frames[best]) else ""
        _say(f"wrote {path}: `colo top` at {time.strftime('%H:%M:%S', time.localtime(self.frames[best]['at']))}, "
             f"job {kept_off} kept off{also}")
        return True


class Story:
    def __init__(self, client: Client, image: str | None, root: Path, recorder: Recorder | None = None):
        self.c, self.image, self.root, self.recorder = client, image, root, recorder
        # Step 4-5's jobs run until the story lets them go (a file in a folder of their own: none
        # under the daemon's may be mounted), so that the moment it shows holds however busy the
        # machine is: a fixed run time raced the engine's start.
        self.release = Path(tempfile.mkdtemp(prefix="colo-demo-go-"))
        os.chmod(self.release, 0o755)
        self.burn = "/opt/colo/native/colo-burn" if image else str(native.path(native.BURN))
        self.ids: dict[int, str] = {}
        self.kept_off: int | None = None  # heavy-2, once submitted
        self.greedy: int | None = None
        self.gpu_index = {g["uuid"]: g["index"] for g in client.gpus()["gpus"]}

    def submit(self, name: str, budget: str, burn_args: list[str], profile: str | None = None,
               gpu_ids: list[int] | None = None, argv: list[str] | None = None, held: bool = False) -> int:
        spec = {"argv": argv or [self.burn, *burn_args], "image": self.image, "name": name, "gpu_mem": budget, "gpus": 1,
                "workdir": None if self.image else str(self.root), "profile": profile}
        if held:
            seen = "/release" if self.image else str(self.release)
            # burn until let go (then exit 0), or until it ends on its own (with its own code)
            script = (f"{self.burn} {' '.join(burn_args)} --seconds 600 & b=$!; while kill -0 $b 2>/dev/null; do "
                      f"if [ -e {seen}/{name} ]; then kill $b; wait $b; exit 0; fi; sleep 0.2; done; wait $b")
            spec["argv"] = ["sh", "-c", script]
            if self.image:
                spec["mounts"] = [{"source": str(self.release), "target": "/release", "read_only": True}]
        if gpu_ids:
            spec["gpu_ids"] = gpu_ids
        job = self.c.submit(spec)
        self.ids[job["id"]] = name
        return job["id"]

    def until(self, what: str, cond, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            got = cond()
            if got:
                return got
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}")
            time.sleep(0.2)

    def state(self, j: int, *states: str) -> dict | None:
        job = self.c.show(j)
        return job if job["state"] in states else None

    def waits_because(self, j: int, words: str) -> dict | None:
        job = self.c.show(j)
        return job if job["state"] == "queued" and words in (job["reason"] or "") else None

    def moment(self, kept_off: int, greedy: int) -> bool:
        """`kept_off` waits and `greedy`'s refusal is counted, in `colo top` (and in a snapshot the
        recorder took, when one records: the picture is drawn from those)."""
        if self.recorder is not None:
            return any(_kept_off(f, kept_off) and _refused(f, greedy) for f in list(self.recorder.frames))
        top = self.c.top()
        return _kept_off(top, kept_off) and _refused(top, greedy)

    def where(self, job: dict) -> str:
        return f"GPU{self.gpu_index.get(job['gpus'][0], '?')}" if job.get("gpus") else "-"

    def told(self, j: int) -> str:
        d = self.c.explain(j)["decision"]
        return d["reason"] if d else self.c.show(j)["reason"]

    def run(self) -> bool:
        burn = ["--mem", "1GiB", "--duty", "30", "--seconds", "10"]
        _say("\n1. Two light jobs with profiles (30 % SM each) share one GPU as MPS clients:")
        a = self.submit("light-a", "2GiB", burn, "demo-light")
        b = self.submit("light-b", "2GiB", burn, "demo-light")
        for j in (a, b):
            job = self.until("the light jobs to start", lambda j=j: self.state(j, "running", *ENDED))
            _say(f"   job {j} {self.ids[j]:<8} {self.told(j)}")

        _say("\n2. A job nobody has profiled yet runs alone, so that its first profile is clean:")
        fresh_args = self.fresh_args = ["--mem", "768MiB", "--duty", "40", "--seconds", "5"]
        f1 = self.submit("fresh", "2GiB", fresh_args)
        job = self.until("fresh to be placed", lambda: self.waits_because(f1, "no profile") or self.state(f1, "running", *ENDED))
        if job["state"] == "queued":
            _say(f"   job {f1} fresh    waits: {job['reason'].removeprefix('waiting: ')}")
        job = self.until("fresh to start", lambda: self.state(f1, "running", *ENDED))
        _say(f"   job {f1} fresh    {self.told(f1)}")
        self.until("fresh to end", lambda: self.state(f1, *ENDED))
        try:
            learned = self.until("fresh's profile to be learned", self.learned_profile, timeout=30)
        except RuntimeError:
            learned = None
            _say("   (no profile was learned from it: too few samples; its next run is placed as unprofiled)")
        if learned is not None:
            _say(f"   learned from its run: profile {learned.name}, {format_duration(learned.runtime)}, "
                 f"peak SM {learned.peak_sm * 100:.0f} %, peak memory {format_size(learned.peak_mem)}")

        _say("\n3. Its next run is placed from what was learned:")
        # both on the GPU fresh ran on: beside the light pair they would share too (the model says
        # 90-100 % SM costs nobody anything), and the story's GPUs would be another's
        there = [self.gpu_index[g] for g in self.c.show(f1).get("gpus") or []]
        c = self.submit("light-c", "2GiB", ["--mem", "1GiB", "--duty", "30", "--seconds", "6"], "demo-light", there)
        self.until("light-c to start", lambda: self.state(c, "running", *ENDED))
        f2 = self.submit("fresh", "2GiB", fresh_args, gpu_ids=there)
        job = self.until("fresh's second run to start", lambda: self.state(f2, "running", *ENDED))
        _say(f"   job {f2} fresh    {self.told(f2)}")

        _say("\n4. Heavy jobs (95 % SM, cache-bound) saturate a GPU by themselves:")
        heavy = ["--mem", "2GiB", "--duty", "95", "--seconds"]
        # heavy-1 runs until greedy (5.) has ended, so that heavy-2 still waits while greedy runs
        h1 = self.submit("heavy-1", "4GiB", heavy[:-1], "demo-heavy", held=True)
        job = self.until("heavy-1 to start", lambda: self.state(h1, "running", *ENDED))
        _say(f"   job {h1} heavy-1  {self.told(h1)}")
        # heavy-2 may go only where heavy-1 runs: once the story's other jobs leave the other GPU it
        # would start there, and the moment step 5 shows (heavy-2 kept off) would end by timing
        h1_gpu = [self.gpu_index[g] for g in job.get("gpus") or []]
        h2 = self.kept_off = self.submit("heavy-2", "4GiB", [*heavy, "5"], "demo-heavy", h1_gpu)
        self.until("heavy-2's decision", lambda: self.waits_because(h2, "predicted") or self.state(h2, "running", *ENDED))
        _say(f"   job {h2} heavy-2  kept off: {self.told(h2).removeprefix('waiting: ')}")

        # While heavy-2 waits, so that one moment shows the whole story (`colo demo --screenshot`).
        _say("\n5. A budget holds: a job asks for 2 GiB more than its 1 GiB budget; only that allocation is refused:")
        greedy = ["--mem", "512MiB", "--over", "2GiB"]
        g = self.greedy = self.submit("greedy", "1GiB", greedy, "demo-tiny", held=True)
        self.until("greedy's refusal to be counted", lambda: self.moment(h2, g) or self.state(g, *ENDED), timeout=120)
        (self.release / "greedy").touch()
        job = self.until("greedy to end", lambda: self.state(g, *ENDED))
        _say(f"   job {g} greedy   {job['state']} ({job['mode']} on {self.where(job)}): {job['reason']}")
        (self.release / "heavy-1").touch()

        self.until("every job to end", lambda: all(self.state(j, *ENDED) for j in self.ids), timeout=120)
        self.first_minute(there)
        self.suspend_idle()
        return self.summary()

    def first_minute(self, there: list[int]) -> None:
        """Three settings of a program nobody has profiled: the first runs alone; its first 30 s of
        samples make a provisional profile of its family, and the other two join it while it runs."""
        _say("\n6. New jobs share from their first minute: three settings of a program nobody has profiled:")
        ids = []
        for k, duty in enumerate(("10", "12", "14")):
            script = f"exec {self.burn} --mem 1GiB --duty {duty} --seconds 45"
            ids.append(self.submit(f"sweep-{k}", "2GiB", [], gpu_ids=there, argv=["sh", "-c", script]))
        first, rest = ids[0], ids[1:]
        self.until("the first setting to start", lambda: self.state(first, "running", *ENDED))
        _say(f"   job {first} {self.ids[first]:<8} {self.told(first)}")
        job = self.until("the next to wait", lambda: self.waits_because(rest[0], "no profile")
                         or self.state(rest[0], "running", *ENDED))
        if job["state"] == "queued":
            why = job["reason"].removeprefix("waiting: ").split("; ways out")[0]
            _say(f"   job {rest[0]} {self.ids[rest[0]]:<8} waits: {why}")
        for j in rest:
            self.until("its family to join it", lambda j=j: self.state(j, "running", *ENDED), timeout=120)
            _say(f"   job {j} {self.ids[j]:<8} {self.told(j)}")
        self.until("the settings to end", lambda: all(self.state(j, *ENDED) for j in ids), timeout=120)

    def suspend_idle(self) -> None:
        """An idle notebook-like job holds most of GPU 0; a job that needs GPU 0 waits; colo
        suspends the idle one (idle_jobs = "suspend"), the waiting one starts in its memory, and the
        notebook's next CUDA call waits until that memory is free again and resumes it."""
        _say("\n7. An idle job gives its GPU memory to a waiting one and gets it back on its next CUDA call:")
        nb = self.root / "notebook"
        nb.mkdir()
        (nb / "notebook.py").write_text(NOTEBOOK)
        # a host process whatever the runtime: the driver's checkpoint needs the job's own pids
        spec = {"argv": [sys.executable, str(nb / "notebook.py"), "4096", str(nb)], "name": "notebook",
                "gpu_mem": "8GiB", "gpus": 1, "gpu_ids": [0], "workdir": str(self.root)}
        n = self.c.submit(spec)["id"]
        self.ids[n] = "notebook"
        self.until("the notebook to allocate", lambda: (nb / "ready").exists() or self.state(n, *ENDED))
        job = self.until("the notebook to be marked idle", lambda: "idle" in (self.c.show(n)["reason"] or "")
                         and self.c.show(n))
        _say(f"   job {n} notebook holds 4 GiB of its 8 GiB on GPU0, then waits for its user: {job['reason']}")
        t = self.submit("train", "10GiB", ["--mem", "6GiB", "--duty", "60", "--seconds", "6"], gpu_ids=[0])
        job = self.until("train to start", lambda: self.state(t, "running", *ENDED), timeout=120)
        note = self.c.show(n).get("suspended") or "not suspended"
        _say(f"   job {t} train    asks for 10 GiB on GPU0, more than the notebook's 8 GiB leave: colo suspended the "
             f"notebook ({note.split(' (colo resume')[0]}),\n"
             f"                     and train started in its memory: {self.told(t)}")
        (nb / "poke").touch()  # the notebook's user runs a cell: its next CUDA call
        why = self.until("the notebook's call to ask for its resume",
                         lambda: "resume asked" in (self.c.explain(n)["reason"] or "")
                         and self.c.explain(n)["reason"] or (nb / "done").exists())
        if isinstance(why, str):
            _say(f"   job {n} notebook runs a cell: its CUDA call holds at colo's gate and asks for the resume, which "
                 f"{why.split('; resume asked, ')[-1]}")
        done = self.until("the notebook's call to return", lambda: (nb / "done").exists() and (nb / "done").read_text(),
                          timeout=120)
        job = self.until("train to end", lambda: self.state(t, *ENDED))
        rc, free = done.split()[:2]
        _say(f"   job {n} notebook resumed once train ended ({job['state']}): its call answered {rc} "
             f"(CUDA_SUCCESS), its 4 GiB back on GPU0 ({format_size(int(free))} free)")
        self.until("the notebook to end", lambda: self.state(n, *ENDED))

    def learned_profile(self):
        """The profile the daemon learned for `fresh` (named after its image and command)."""
        name = profiles.key_for(self.image, [self.burn, *self.fresh_args])
        own = self.root / "state" / "profiles" / "users" / str(os.getuid())  # the submitter's own copy
        for d in (own, self.root / "state" / "profiles", self.root / "profiles"):
            try:
                return profiles.load(d / f"{name}.profile")
            except (OSError, profiles.ProfileError):
                continue
        return None

    def summary(self) -> bool:
        _say("\nSummary")
        ok, spans, busy = True, [], {}
        for i in self.ids:
            j = self.c.show(i)
            ran = (j["ended_at"] or time.time()) - (j["started_at"] or time.time())
            _say(f"  job {i:>2} {j['name']:<8} {j['state']:<9} {j['mode'] or '-':<10} {self.where(j):<5} budget "
                 f"{format_size(j['budget']):>7}  ran {format_duration(ran):>4}  {j['reason'] or ''}")
            ok &= j["state"] == "succeeded"
            if j["started_at"] and j["ended_at"] and j.get("gpus"):
                spans.append(ran - (j.get("off_gpu") or 0.0))  # suspended: it needed no GPU time then
                busy.setdefault(j["gpus"][0], []).append((j["started_at"], j["ended_at"]))
        alone = sum(spans)
        used = sum(_union(iv) for iv in busy.values())
        if alone > 0:
            a, b = list(self.ids)[:2]  # step 1's pair, the first two submitted
            _say(f"\nWhat sharing saved: the jobs ran {alone:.0f} s in all; one job per GPU needs that much GPU time, "
                 f"sharing needed {used:.0f} s ({(alone - used) / alone * 100:.0f} % less). (Simulated GPUs do not "
                 f"slow co-running jobs; on a real one the MPS pair of step 1 (jobs {a} and {b}) was predicted to lose nothing, and "
                 f"what it really lost would be learned.)")
        _say("Every budget held: no GPU ever had more memory promised than it has.")
        _say(next_step(bool(shutil.which("nvidia-smi"))))
        return ok


# Step 7's idle job, a notebook between cells: holds MIB MiB through the driver API, writes
# DIR/ready, waits for DIR/poke (its user's next cell), makes one CUDA call and writes the answer
# (result, free bytes) to DIR/done.
NOTEBOOK = """import ctypes, os, sys, time
mib, folder = int(sys.argv[1]), sys.argv[2]
cu = ctypes.CDLL("libcuda.so.1")
ctx, dev, ptr = ctypes.c_void_p(), ctypes.c_int(), ctypes.c_ulonglong()
assert cu.cuInit(0) == 0 and cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0 and cu.cuCtxSetCurrent(ctx) == 0
assert cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(mib << 20)) == 0
open(os.path.join(folder, "ready"), "w").close()
while not os.path.exists(os.path.join(folder, "poke")):
    time.sleep(0.1)
free, total = ctypes.c_size_t(), ctypes.c_size_t()
r = cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
with open(os.path.join(folder, ".done"), "w") as f:
    f.write(f"{r} {free.value}")
os.rename(os.path.join(folder, ".done"), os.path.join(folder, "done"))
"""

FAKE_GPUS = "~/.colo-gpus"  # where the README's and the demo's next step keep simulated GPUs


def next_step(have_gpu: bool) -> str:
    """The demo's last line: what to run after it, on this machine (with a GPU or without)."""
    start = ("`sudo colo daemon &` (or the systemd unit: docs/install.md)" if have_gpu else
             f"`colo-fakegpu create {FAKE_GPUS} && colo daemon --fake-gpus {FAKE_GPUS} &` (simulated GPUs: this "
             "machine has no NVIDIA driver)")
    return (f"Next: {start}, then `colo submit --process --gpu-mem 1GiB -- CMD` and `colo top` to watch; "
            "`colo demo --keep` leaves this demo's daemon up.")


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _wait_up(client: Client, daemon: subprocess.Popen, root: Path) -> dict:
    deadline = time.monotonic() + 30
    while True:
        if daemon.poll() is not None:
            raise RuntimeError(f"the demo daemon exited: {(root / 'daemon.log').read_text()[-500:]}")
        try:
            return client.hello()
        except ClientError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _demo_image() -> str | None:
    try:
        import docker

        from ..runtimes.image import build_local_image

        return build_local_image(docker.from_env(), "colo/demo:1", with_shell=True)
    except Exception as e:  # noqa: BLE001 - fall back to host processes
        _say(f"(could not build the demo image: {e}; using host processes)")
        return None
