"""Generate the shipped profiles from the study figures in docs/invariants.md ("Figures from the
studies").

Deterministic (no randomness): run `python profiles/make_shipped.py` to rewrite profiles/*.profile.
The study ran these 11 applications alone on a 12 GB NVIDIA TITAN Xp. What that page states is
used as given; what it does not state (exact run times, SM levels inside a class, bandwidth) is
chosen to agree with it, and marked "chosen" below:
- class GPU-heavy (>= 40 % average use): vgg11, vgg16, resnet50/101/152, QMCPACK, HOOMD, LAMMPS;
  GPU-light (< 40 %): alexnet, GROMACS; googlenet is in neither list (chosen: 0.42).
- memory-heavy (>= 50 % of 12 GB): vgg11, vgg16, resnet50/101/152; memory-light: alexnet,
  googlenet, QMCPACK, HOOMD, GROMACS; LAMMPS is in neither (its peak is heavy, its mean light).
- ML jobs: near-constant use after loading (chosen: 8 s of loading at low SM).
- LAMMPS: ~40 % average GPU, memory climbing 363 MB -> 8,499 MB, 100 % GPU at its memory peak.
- QMCPACK: three steps; no GPU memory until ~95 s, then ~5,135 MB.
- GROMACS: little memory, runs long; up to three fit at once.
- Run times (chosen) make the 30-job mixes' exclusive makespans match the study: GPU-heavy mean
  160 s (30 jobs ~ 4,807 s), GPU-light mean 76.5 s (30 jobs ~ 2,295 s).
MB in the study are read as MiB (as nvidia-smi prints them).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from colo.profiles import Profile, save  # noqa: E402

GPU = "NVIDIA TITAN Xp (12 GB) - from the study figures in docs/invariants.md"
STEP = 2.0
MiB = 1024**2

# name: (runtime s, steady SM, peak memory MiB, memory bandwidth, cache-bound)   (all chosen within the stated class)
ML = {
    "vgg11": (120, 0.80, 7400, 0.65, True),
    "vgg16": (180, 0.90, 8600, 0.70, True),
    "resnet50": (130, 0.75, 6600, 0.45, False),
    "resnet101": (170, 0.85, 7800, 0.60, True),
    "resnet152": (220, 0.90, 9500, 0.65, True),
    "alexnet": (45, 0.30, 2100, 0.25, False),
    "googlenet": (90, 0.42, 2600, 0.35, False),
}


def ml(name, runtime, sm, mem_mib, bw, cb):
    t = (np.arange(int(np.ceil(runtime / STEP))) + 0.5) * STEP
    loading = t < 8.0
    return Profile(name=name, step=STEP, runtime=runtime, cache_bound=cb, gpu=GPU,
                   sm=np.where(loading, 0.05, sm), membw=np.where(loading, 0.02, bw),
                   mem=(mem_mib * MiB * np.minimum(1.0, t / 4.0)).astype(np.int64),
                   note=f"TensorFlow benchmark {name}: constant after 8 s of loading")


def lammps():
    runtime = 150
    x = np.linspace(0.0, 1.0, runtime // 2)  # start to peak, both ends included
    k = 2.4  # mean of 0.15 + 0.85 x^k is 0.40 (the stated average) and it reaches 1.0 at the end
    return Profile(name="lammps", step=STEP, runtime=runtime, cache_bound=False, gpu=GPU,
                   sm=0.15 + 0.85 * x**k, membw=0.10 + 0.60 * x**k,
                   mem=((363 + (8499 - 363) * x) * MiB).astype(np.int64),
                   note="LAMMPS: memory 363 -> 8,499 MB, ~40 % GPU on average, 100 % at its memory peak")


def qmcpack():
    runtime = 200
    t = (np.arange(runtime // 2) + 0.5) * STEP
    sm = np.select([t < 95, t < 140], [0.0, 0.70], 1.0)
    return Profile(name="qmcpack", step=STEP, runtime=runtime, cache_bound=False, gpu=GPU,
                   sm=sm, membw=np.select([t < 95, t < 140], [0.0, 0.35], 0.50),
                   mem=np.where(t < 95, 0, 5135 * MiB).astype(np.int64),
                   note="QMCPACK: three steps; no GPU memory until ~95 s, then ~5,135 MB")


def flat(name, runtime, sm, mem_mib, bw, cb, note):
    n = int(np.ceil(runtime / STEP))
    return Profile(name=name, step=STEP, runtime=runtime, cache_bound=cb, gpu=GPU, sm=np.full(n, sm),
                   membw=np.full(n, bw), mem=np.full(n, mem_mib * MiB, dtype=np.int64), note=note)


def all_profiles() -> list[Profile]:
    out = [ml(n, *v) for n, v in ML.items()]
    out += [lammps(), qmcpack(),
            flat("hoomd", 110, 0.65, 1200, 0.75, True, "HOOMD-blue: GPU-heavy, memory-light"),
            flat("gromacs", 108, 0.22, 600, 0.15, False, "GROMACS: little memory, runs long; three fit at once")]
    return out


def main(dest: Path = Path(__file__).resolve().parent) -> None:
    for p in all_profiles():
        save(p, dest / f"{p.name}.profile")
        print(f"{p.name:10s} runtime {p.runtime:5.0f}s  mean SM {p.mean_sm:.2f}  peak mem {p.peak_mem / MiB:6.0f} MiB")


if __name__ == "__main__":
    main()
