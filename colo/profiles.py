"""Profiles: what a workload does to a GPU over time, stored as human-readable text files.

A profile holds time series resampled to a fixed step (SM activity, memory in use, memory
bandwidth, PCIe throughput when known), its run time alone, whether it is cache/bandwidth-bound,
and how many runs it was learned from. The format is documented in profiles/README.md.
"""
from __future__ import annotations

import hashlib
import math
import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

FORMAT = "colo-profile"
VERSION = 1
_STEPS = (0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0)
_MAX_POINTS = 1000
CACHE_BOUND_MEMBW = 0.5  # a learned profile whose mean bandwidth use passes this is cache-bound
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")


class ProfileError(ValueError):
    pass


@dataclass(eq=False)
class Profile:
    name: str
    step: float  # seconds between points
    sm: np.ndarray  # SM activity 0..1
    mem: np.ndarray  # bytes in use
    membw: np.ndarray  # memory-bandwidth use 0..1
    pcie: np.ndarray | None = None  # bytes/s, None when NVML did not give it
    runtime: float = 0.0  # seconds, running alone
    cache_bound: bool = False
    runs: int = 1
    gpu: str = ""
    version: int = VERSION
    note: str = ""
    # built from the first samples of a run still going (provisional()): its run time is a guess,
    # so nothing is compared with it, and it is never stored
    provisional: bool = False

    def __post_init__(self) -> None:
        self.sm = np.clip(np.asarray(self.sm, dtype=float), 0.0, 1.0)
        self.mem = np.maximum(np.asarray(self.mem, dtype=np.int64), 0)
        self.membw = np.clip(np.asarray(self.membw, dtype=float), 0.0, 1.0)
        if self.pcie is not None:
            self.pcie = np.maximum(np.asarray(self.pcie, dtype=float), 0.0)
        n = len(self.sm)
        if n == 0 or len(self.mem) != n or len(self.membw) != n or (self.pcie is not None and len(self.pcie) != n):
            raise ProfileError(f"profile {self.name!r}: series must be non-empty and of one length")
        if not self.step > 0:
            raise ProfileError(f"profile {self.name!r}: step must be > 0")
        if not self.runtime > 0:
            self.runtime = n * self.step

    peak_sm = property(lambda self: float(self.sm.max()))
    mean_sm = property(lambda self: float(self.sm.mean()))
    peak_mem = property(lambda self: int(self.mem.max()))
    mean_mem = property(lambda self: float(self.mem.mean()))
    peak_membw = property(lambda self: float(self.membw.max()))
    mean_membw = property(lambda self: float(self.membw.mean()))
    peak_pcie = property(lambda self: None if self.pcie is None else float(self.pcie.max()))
    mean_pcie = property(lambda self: None if self.pcie is None else float(self.pcie.mean()))

    def at(self, t: float) -> int:
        """Index of the point that covers elapsed time t."""
        return min(len(self.sm) - 1, max(0, int(t / self.step)))

    def summary(self) -> dict[str, Any]:
        return {"name": self.name, "gpu": self.gpu, "runs": self.runs, "runtime": self.runtime,
                "step": self.step, "cache_bound": self.cache_bound,
                "peak_sm": self.peak_sm, "mean_sm": self.mean_sm, "peak_mem": self.peak_mem,
                "mean_mem": self.mean_mem, "peak_membw": self.peak_membw,
                "mean_membw": self.mean_membw, "peak_pcie": self.peak_pcie}


# ---- text format ----------------------------------------------------------------------------

def dumps(p: Profile) -> str:
    cols = "sm mem membw" + (" pcie" if p.pcie is not None else "")
    lines = [f"{FORMAT} {VERSION}", f"name {p.name}", f"gpu {p.gpu}" if p.gpu else "gpu -",
             f"step {p.step:g}", f"runtime {p.runtime:.3f}", f"runs {p.runs}",
             f"cache_bound {'yes' if p.cache_bound else 'no'}"]
    if p.note:
        lines += [f"# {ln}" for ln in p.note.splitlines()]
    lines.append(f"series {cols}")
    for i in range(len(p.sm)):
        row = f"{p.sm[i]:.3f} {int(p.mem[i])} {p.membw[i]:.3f}"
        if p.pcie is not None:
            row += f" {p.pcie[i]:.4g}"
        lines.append(row)
    return "\n".join(lines) + "\n"


def loads(text: str, origin: str = "<text>") -> Profile:
    header: dict[str, str] = {}
    rows: list[list[str]] = []
    cols: list[str] | None = None
    version_seen = False
    notes = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            if line.startswith("# ") and version_seen and cols is None:
                notes.append(line[2:])
            continue
        if not version_seen:
            parts = line.split()
            if len(parts) != 2 or parts[0] != FORMAT or not parts[1].isdigit():
                raise ProfileError(f"{origin}:{n}: not a colo profile (first line must be '{FORMAT} {VERSION}')")
            if int(parts[1]) > VERSION:
                raise ProfileError(f"{origin}: profile format {parts[1]} is newer than this colo reads ({VERSION})")
            version_seen = True
            continue
        if cols is None:
            key, _, value = line.partition(" ")
            if key == "series":
                cols = value.split()
                if cols[:3] != ["sm", "mem", "membw"] or cols[3:] not in ([], ["pcie"]):
                    raise ProfileError(f"{origin}:{n}: series columns must be 'sm mem membw [pcie]'")
            else:
                header[key] = value.strip()
            continue
        parts = line.split()
        if len(parts) != len(cols):
            raise ProfileError(f"{origin}:{n}: expected {len(cols)} numbers, got {len(parts)}")
        rows.append(parts)
    if not version_seen or cols is None or not rows:
        raise ProfileError(f"{origin}: incomplete profile (needs the version line, a series line and rows)")
    try:
        arr = np.array(rows, dtype=float)
        if not np.isfinite(arr).all() or (arr[:, 1] >= 2.0**62).any():  # nan, inf, or past int64 memory
            raise ProfileError("series numbers must be finite (memory below 2^62 bytes)")
        return Profile(
            name=header.get("name") or Path(origin).stem, step=float(header.get("step", "1")),
            sm=arr[:, 0], mem=arr[:, 1].astype(np.int64), membw=arr[:, 2],
            pcie=arr[:, 3] if len(cols) == 4 else None, runtime=float(header.get("runtime", "0")),
            cache_bound=header.get("cache_bound", "no").lower() in ("yes", "true", "1"),
            runs=int(header.get("runs", "1")), gpu="" if header.get("gpu", "-") == "-" else header["gpu"],
            note="\n".join(notes))
    except ValueError as e:
        raise ProfileError(f"{origin}: {e}") from None


MAX_UPLOAD = 256 * 1024  # bytes of profile text a user may hand the daemon (1,000 rows of 4 columns fit)
_MAX_MEM = 1 << 50  # 1 PiB: past any GPU's memory


def check_upload(text: object) -> Profile:
    """A profile a user hands the root daemon (`colo profile record`), read as hostile input: at
    most MAX_UPLOAD bytes and _MAX_POINTS rows, no control or format characters (its name, GPU
    and note are shown on terminals), finite numbers in their ranges. What is stored is colo's
    own rewrite of it, counted as one run whatever the text claims (a recording is one run)."""
    if not isinstance(text, str):
        raise ProfileError("a profile must be text")
    if len(text.encode("utf-8", "surrogatepass")) > MAX_UPLOAD:
        raise ProfileError(f"profile larger than {MAX_UPLOAD // 1024} KiB")
    if any(not c.isprintable() and c != "\n" for c in text):
        raise ProfileError("profile text holds control or format characters")
    p = loads(text, "<upload>")
    if not valid_name(p.name):
        raise ProfileError(f"bad profile name {p.name!r}: use letters, digits, '.', '_', '-', '+'")
    if len(p.sm) > _MAX_POINTS:
        raise ProfileError(f"profile has {len(p.sm)} points; at most {_MAX_POINTS}")
    if len(p.gpu) > 96 or len(p.note) > 1024:
        raise ProfileError("profile's gpu (96) or note (1,024 characters) too long")
    nums = [np.asarray(p.sm, float), np.asarray(p.membw, float), np.array([p.step, p.runtime])]
    if p.pcie is not None:
        nums.append(p.pcie)
    if not all(np.isfinite(a).all() for a in nums) or not 0 < p.step <= 86400 or not 0 < p.runtime <= 1e8:
        raise ProfileError("profile numbers must be finite; step up to a day, runtime up to 1e8 s")
    if int(p.mem.max()) > _MAX_MEM:
        raise ProfileError("profile memory must be at most 1 PiB a point")
    p.runs = 1
    return p


def load(path: str | Path) -> Profile:
    path = Path(path)
    try:
        return loads(path.read_text(), str(path))
    except OSError as e:
        raise ProfileError(f"cannot read profile {path}: {e.strerror}") from None


def save(profile: Profile, path: str | Path) -> Path:
    """Write atomically (rename), so a reader never sees half a profile."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(dumps(profile))
    os.replace(tmp, path)
    return path


# ---- building from samples ------------------------------------------------------------------

def pick_step(runtime: float) -> float:
    """The smallest usual step that keeps a profile under _MAX_POINTS points."""
    for s in _STEPS:
        if runtime / s <= _MAX_POINTS:
            return s
    return _STEPS[-1] * math.ceil(runtime / (_STEPS[-1] * _MAX_POINTS))


def _bins(t: np.ndarray, v: np.ndarray, step: float, n: int, how: str) -> np.ndarray:
    idx = np.clip((t / step).astype(int), 0, n - 1)
    out = np.full(n, np.nan)
    if how == "max":
        np.fmax.at(out, idx, v)
    else:
        s = np.bincount(idx, weights=v, minlength=n)
        c = np.bincount(idx, minlength=n)
        out = np.where(c > 0, s / np.maximum(c, 1), np.nan)
    # empty bins hold the value before them (a sample holds until the next one)
    good = ~np.isnan(out)
    if not good.any():
        return np.zeros(n)
    fill = np.maximum.accumulate(np.where(good, np.arange(n), 0))
    out = out[fill]
    first = int(np.argmax(good))
    out[:first] = out[first]
    return out


def _columns(samples: Any) -> dict[str, np.ndarray]:
    """Accept {'times': [...], 'sm': [...], ...} or a list of row dicts {'t': .., 'sm': ..}."""
    if isinstance(samples, dict):
        d = dict(samples)
        if "t" in d and "times" not in d:
            d["times"] = d.pop("t")
    else:
        rows = list(samples)
        d = {k: [r.get(k) for r in rows] for k in ("sm", "mem", "membw", "pcie")}
        d["times"] = [r.get("t", r.get("time")) for r in rows]
    need = ("times", "sm", "mem")
    if any(d.get(k) is None for k in need) or len(d["times"]) == 0:
        raise ProfileError("samples need times, sm and mem (and membw), one value each per sample")
    out = {"times": np.asarray(d["times"], dtype=float), "sm": np.asarray(d["sm"], dtype=float),
           "mem": np.asarray(d["mem"], dtype=float)}
    n = len(out["times"])
    mb = d.get("membw")
    out["membw"] = np.zeros(n) if mb is None else np.asarray([0.0 if x is None else x for x in mb], dtype=float)
    pc = d.get("pcie")
    if pc is not None and all(x is not None for x in pc):
        out["pcie"] = np.asarray(pc, dtype=float)
    if any(len(v) != n for v in out.values()):
        raise ProfileError("samples: every series needs one value per time")
    return out


def from_samples(name: str, samples: Any, runtime: float | None = None, step: float | None = None,
                 gpu: str = "", cache_bound: bool | None = None) -> Profile:
    """A one-run profile: samples binned to a fixed step (mean SM/bandwidth, peak memory)."""
    c = _columns(samples)
    t = c["times"] - c["times"].min()
    runtime = float(runtime if runtime is not None else max(t.max(), 1e-3))
    step = step or pick_step(runtime)
    n = max(1, math.ceil(runtime / step - 1e-9))
    pcie = _bins(t, c["pcie"], step, n, "mean") if "pcie" in c else None
    membw = _bins(t, c["membw"], step, n, "mean")
    if cache_bound is None:
        cache_bound = bool(membw.mean() >= CACHE_BOUND_MEMBW)
    return Profile(name=name, step=step, sm=_bins(t, c["sm"], step, n, "mean"),
                   mem=_bins(t, c["mem"], step, n, "max").astype(np.int64), membw=membw, pcie=pcie,
                   runtime=runtime, cache_bound=cache_bound, runs=1, gpu=gpu)


PROVISIONAL_AFTER = 30.0  # seconds of a run's samples from which a provisional profile is made
PROVISIONAL_HOLD = 3600.0  # how long a job with a provisional profile is taken to run on
# SM a run must have shown before it speaks for its family: one that has launched no kernels yet
# (loading its data: qmcpack reads 0 % for its first 94 s, then 100 %) says nothing of what it will do
PROVISIONAL_BUSY = 0.01


def provisional(name: str, samples: Any, elapsed: float | None = None, hold: float = PROVISIONAL_HOLD,
                gpu: str = "") -> Profile | None:
    """What a running job that has no profile is taken to do, from its samples so far (None
    before PROVISIONAL_AFTER seconds of them, and while it has shown no SM past PROVISIONAL_BUSY):
    the series as sampled, then, since how long it runs on is unknown, the highest SM, bandwidth
    and memory it showed held to `hold` seconds in all. Neighbours can then be placed beside it
    within its first minute instead of after its end; what its run really was replaces it at its
    end (ProfileStore.learn)."""
    c = _columns(samples)
    t = c["times"] - c["times"].min()
    seen = float(elapsed if elapsed is not None else t.max())
    if seen < PROVISIONAL_AFTER or not (c["sm"] > PROVISIONAL_BUSY).any():
        return None
    runtime = max(hold, seen)
    step = pick_step(runtime)
    k = max(1, math.ceil(seen / step - 1e-9))
    n = max(k, math.ceil(runtime / step - 1e-9))
    sm, bw = _bins(t, c["sm"], step, k, "mean"), _bins(t, c["membw"], step, k, "mean")
    mem = _bins(t, c["mem"], step, k, "max")
    pad = n - k
    return Profile(name=name, step=step, sm=np.append(sm, np.full(pad, sm.max())),
                   mem=np.append(mem, np.full(pad, mem.max())).astype(np.int64),
                   membw=np.append(bw, np.full(pad, bw.max())), runtime=runtime,
                   cache_bound=bool(bw.mean() >= CACHE_BOUND_MEMBW), runs=1, gpu=gpu,
                   note=f"provisional: {seen:.0f} s of a run still going", provisional=True)


def same_figures(a: Profile, b: Profile) -> bool:
    """Whether two profiles say the same to plan() (every field but the name and the note): a
    provisional profile remade from more samples of a steady run changes nothing to place."""
    def same(x, y) -> bool:
        return (x is None and y is None) or (x is not None and y is not None and np.array_equal(x, y))
    return (a.step, a.runtime, a.cache_bound, a.runs, a.gpu, a.provisional) == \
        (b.step, b.runtime, b.cache_bound, b.runs, b.gpu, b.provisional) and \
        all(same(getattr(a, k), getattr(b, k)) for k in ("sm", "mem", "membw", "pcie"))


def _stretch(v: np.ndarray, n: int) -> np.ndarray:
    """Resample a series to n points over the same run (aligned on progress, start to end)."""
    if len(v) == n:
        return v.astype(float)
    x = (np.arange(n) + 0.5) / n
    xp = (np.arange(len(v)) + 0.5) / len(v)
    return np.interp(x, xp, v.astype(float))


def merge(old: Profile, new: Profile) -> Profile:
    """Running mean over runs: the stored profile counts old.runs runs, `new` one more."""
    k = old.runs
    runtime = (old.runtime * k + new.runtime) / (k + 1)
    step = old.step
    n = max(1, math.ceil(runtime / step - 1e-9))

    def avg(a, b):
        return (_stretch(a, n) * k + _stretch(b, n)) / (k + 1)

    if old.pcie is not None and new.pcie is not None:
        pcie = avg(old.pcie, new.pcie)
    else:  # a run without PCIe figures keeps the ones learned before
        pcie = None if old.pcie is None else _stretch(old.pcie, n)
    return Profile(name=old.name, step=step, sm=avg(old.sm, new.sm), mem=avg(old.mem, new.mem).astype(np.int64),
                   membw=avg(old.membw, new.membw), pcie=pcie, runtime=runtime,
                   cache_bound=old.cache_bound or new.cache_bound, runs=k + 1, gpu=new.gpu or old.gpu,
                   note=old.note)


# ---- where profiles live --------------------------------------------------------------------

def shipped_dir() -> Path:
    env = os.environ.get("COLO_PROFILES_DIR")
    if env:
        return Path(env)
    packaged = Path(__file__).resolve().parent / "data" / "profiles"  # a wheel's copy (setup.py)
    return packaged if packaged.is_dir() else Path(__file__).resolve().parent.parent / "profiles"


def valid_name(name: str) -> bool:
    return bool(_NAME.match(name))


def _readable(image: str | None, argv: Sequence[str]) -> str:
    base = (image or "").rsplit("/", 1)[-1].split("@")[0].split(":")[0] or "proc"
    stem = Path(argv[0]).name if argv else ""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", f"{base}-{stem}" if stem else base).strip("-.")[:40] or "job"


def key_for(image: str | None, argv: Sequence[str]) -> str:
    """A stable profile name for a job submitted without --profile: readable stem + hash of the
    image and the whole command (the refinement: these exact arguments)."""
    digest = hashlib.sha256(("\0".join([image or ""] + list(argv))).encode()).hexdigest()[:10]
    return f"{_readable(image, argv)}-{digest}"


# what names the program a command runs, when its first word is an interpreter or launcher
_SCRIPT = re.compile(r"\.(py|sh|bash|jl|R|r|lua|js|pl|rb|ipynb)$")


def script_of(argv: Sequence[str]) -> str:
    """The script or module a command runs (`python train.py --lr 0.1`: train.py; `python -m
    pkg.train`: -m pkg.train; `torchrun --nproc 2 train.py`: train.py), else "" (the program
    itself is what runs: `./solver 100`)."""
    args = list(argv[1:])
    for i, a in enumerate(args):
        if a in ("-m", "-c") and i + 1 < len(args):
            return f"{a} {args[i + 1]}" if a == "-m" else "-c"
        if not a.startswith("-") and _SCRIPT.search(a):
            return a
    return ""


def family_for(image: str | None, argv: Sequence[str]) -> str:
    """The profile name of a job's family: the same image (or program) running the same script,
    whatever its other arguments. A new hyperparameter is a new key_for() but the same family,
    so its first run is placed with what its family's runs showed."""
    program, script = (Path(argv[0]).name if argv else ""), script_of(argv)
    digest = hashlib.sha256(("\0".join([image or "", program, script])).encode()).hexdigest()[:8]
    what = script.split()[-1] if script.startswith("-m ") else Path(script).stem if script != "-c" else ""
    stem = f"{_readable(image, argv)}-{what}" if what else _readable(image, argv)
    return f"{re.sub(r'[^A-Za-z0-9._-]+', '-', stem).strip('-.')[:48]}-family-{digest}"


def names_for(image: str | None, argv: Sequence[str], profile: str | None = None) -> list[str]:
    """The profile names a job's profile is looked up under, in order: the one it named
    (--profile), else its own key (these arguments), then its family's."""
    if profile:
        return [profile]
    return [key_for(image, argv), family_for(image, argv)]


class ProfileStore:
    """Profiles from several folders; the first folder that has a name wins. New and learned
    profiles go to the first writable folder (the user's or daemon's own, before the shipped)."""

    def __init__(self, dirs: Iterable[str | Path]):
        self.dirs = [Path(d) for d in dirs]
        self._cache: dict[Path, tuple[float, Profile]] = {}

    def _path(self, d: Path, name: str) -> Path:
        return d / f"{name}.profile"

    def get(self, name: str) -> Profile | None:
        if not valid_name(name):
            return None
        for d in self.dirs:
            p = self._path(d, name)
            try:
                mtime = p.stat().st_mtime_ns
            except OSError:
                continue
            hit = self._cache.get(p)
            if hit and hit[0] == mtime:
                return hit[1]
            prof = load(p)
            self._cache[p] = (mtime, prof)
            return prof
        return None

    def ls(self) -> list[Profile]:
        seen: dict[str, Profile] = {}
        for d in self.dirs:
            for p in sorted(d.glob("*.profile")) if d.is_dir() else []:
                if p.stem not in seen:
                    prof = self.get(p.stem)
                    if prof is not None:
                        seen[p.stem] = prof
        return sorted(seen.values(), key=lambda p: p.name)

    def writable_dir(self) -> Path:
        for d in self.dirs:
            try:
                d.mkdir(parents=True, exist_ok=True)
            except OSError:
                continue
            if os.access(d, os.W_OK):
                return d
        raise ProfileError("no writable profile folder among " + ", ".join(map(str, self.dirs)))

    def save(self, profile: Profile) -> Path:
        if not valid_name(profile.name):
            raise ProfileError(f"bad profile name {profile.name!r}: use letters, digits, '.', '_', '-', '+'")
        return save(profile, self._path(self.writable_dir(), profile.name))

    def first(self, names: Sequence[str]) -> Profile | None:
        """The profile of the first of `names` that has one (names_for(): own key, then family)."""
        for name in names:
            got = self.get(name)
            if got is not None:
                return got
        return None

    def learn(self, name: str, samples: Any, runtime: float | None = None, gpu: str = "",
              family: str | None = None) -> Profile:
        """Merge a finished job's samples into the profile `name` (made if new) and store it; and
        into its `family`'s (family_for()), which a new member starts from."""
        new = from_samples(name, samples, runtime=runtime, gpu=gpu)
        for other in [family] if family and family != name else []:
            old = self.get(other)
            self.save(merge(old, new) if old is not None else Profile(
                **{**new.__dict__, "name": other, "note": "a family: every command of this image and script"}))
        old = self.get(name)
        prof = merge(old, new) if old is not None else new
        self.save(prof)
        return prof


# ---- recording ------------------------------------------------------------------------------

Sampler = Callable[[], dict]


def record(argv: Sequence[str], sampler: Sampler, hz: float = 10, name: str | None = None,
           gpu: str = "", env: dict | None = None) -> Profile:
    """Run argv alone and sample the GPU with sampler() about hz times a second until it exits.
    sampler() returns dict(sm=0..1, mem=bytes, membw=0..1, pcie=bytes/s or None)."""
    if not argv:
        raise ProfileError("record: no command given")
    period = 1.0 / hz
    rows: list[dict] = []
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(list(argv), env=env)
    except OSError as e:
        raise ProfileError(f"cannot run {argv[0]}: {e.strerror}") from None
    try:
        while True:
            s = sampler()
            rows.append({"t": time.monotonic() - t0, "sm": float(s.get("sm") or 0.0),
                         "mem": int(s.get("mem") or 0), "membw": float(s.get("membw") or 0.0),
                         "pcie": s.get("pcie")})
            try:
                proc.wait(timeout=period)  # the sampling period; also notices the exit at once
                break
            except subprocess.TimeoutExpired:
                continue
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    runtime = time.monotonic() - t0
    if proc.returncode != 0:
        raise ProfileError(f"{argv[0]} exited with status {proc.returncode}; no profile recorded")
    if all(r["pcie"] is None for r in rows):
        for r in rows:
            r.pop("pcie")
    else:
        for r in rows:
            r["pcie"] = float(r["pcie"] or 0.0)
    return from_samples(name or key_for(None, argv), rows, runtime=runtime, gpu=gpu)
