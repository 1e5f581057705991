"""Interposer overhead: cuMemAlloc_v2 + cuMemFree_v2 pairs through the interposer vs directly, on
the simulated driver, 1 and 8 threads x 1 and 4 processes, printed side by side.

    python bench/interposer_bench.py [--pairs N] [--repeat R]

Each cell is the median over R runs of (wall time of a thread's loop / pairs), averaged over the
processes; "added" is interposed minus direct. Direct and interposed runs alternate so that
drift of the machine hits both alike.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from colo import fakegpu, interposer, native  # noqa: E402

BENCH_C = r"""
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
typedef int CUresult; typedef void *CUcontext; typedef unsigned long long CUdeviceptr;
CUresult cuInit(unsigned); CUresult cuDevicePrimaryCtxRetain(CUcontext *, int);
CUresult cuCtxSetCurrent(CUcontext); CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
static int pairs; static pthread_barrier_t bar; static double ns[64];
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e9 + t.tv_nsec; }
static void *loop(void *arg) {
    long id = (long)arg; CUcontext c; CUdeviceptr p;
    cuDevicePrimaryCtxRetain(&c, 0); cuCtxSetCurrent(c);
    for (int i = 0; i < 1000; i++) { cuMemAlloc_v2(&p, 1 << 20); cuMemFree_v2(p); }  /* warm up */
    pthread_barrier_wait(&bar);
    double t0 = now();
    for (int i = 0; i < pairs; i++) {
        if (cuMemAlloc_v2(&p, 1 << 20)) { fprintf(stderr, "alloc failed\n"); exit(3); }
        cuMemFree_v2(p);
    }
    ns[id] = (now() - t0) / pairs;
    return NULL;
}
int main(int argc, char **argv) {
    int threads = atoi(argv[1]); pairs = atoi(argv[2]);
    pthread_t th[64]; cuInit(0);
    pthread_barrier_init(&bar, NULL, threads);
    for (long t = 0; t < threads; t++) pthread_create(&th[t], NULL, loop, (void *)t);
    double sum = 0;
    for (int t = 0; t < threads; t++) { pthread_join(th[t], NULL); sum += ns[t]; }
    printf("%.2f\n", sum / threads);
    return 0;
}
"""


def build(tmp: Path, lib_dir: Path) -> Path:
    src, exe = tmp / "bench.c", tmp / "interposer_bench"
    src.write_text(BENCH_C)
    subprocess.run(["cc", "-O2", "-o", str(exe), str(src), str(lib_dir / "libcuda.so.1"), "-lpthread"], check=True)
    return exe


def one(exe: Path, env: dict, procs: int, threads: int, pairs: int) -> float:
    ps = [subprocess.Popen([str(exe), str(threads), str(pairs)], env=env, stdout=subprocess.PIPE, text=True)
          for _ in range(procs)]
    vals = []
    for p in ps:
        out, _ = p.communicate(timeout=600)
        if p.returncode != 0:
            raise SystemExit(f"bench process failed ({p.returncode})")
        vals.append(float(out))
    return sum(vals) / len(vals)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=200_000, help="alloc+free pairs per thread")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    native.ensure_built()
    with tempfile.TemporaryDirectory(prefix="colo-bench-") as d:
        tmp = Path(d)
        state, ledger = tmp / "fakegpu.state", tmp / "ledger"
        fakegpu.create(state, count=1, mem=64 << 30)
        node = fakegpu.FakeNode(state)
        interposer.create_ledger(ledger, 32 << 30)
        exe = build(tmp, Path(node.lib_dir))
        base = {**os.environ, **node.env}
        for k in ("LD_PRELOAD", "COLO_GPU_BUDGET", "COLO_LEDGER"):
            base.pop(k, None)
        budgeted = {**base, **interposer.job_env(32 << 30, str(ledger), str(interposer.library_path()))}
        print(f"{args.pairs} alloc+free pairs of 1 MiB per thread, median of {args.repeat} runs, "
              f"{os.cpu_count()} CPUs")
        print(f"{'procs':>5} {'threads':>7} {'direct ns':>10} {'interposed ns':>14} {'added ns':>9} {'ratio':>6}")
        for procs in (1, 4):
            for threads in (1, 8):
                direct, inter = [], []
                for _ in range(args.repeat):
                    direct.append(one(exe, base, procs, threads, args.pairs))
                    inter.append(one(exe, budgeted, procs, threads, args.pairs))
                dm, im = statistics.median(direct), statistics.median(inter)
                print(f"{procs:>5} {threads:>7} {dm:>10.1f} {im:>14.1f} {im - dm:>9.1f} {im / dm:>6.2f}")
        led = interposer.read_ledger(ledger)
        assert led.used[0] == 0 and led.refused == 0, led


if __name__ == "__main__":
    main()
