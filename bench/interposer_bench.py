"""Interposer overhead on the simulated driver, printed side by side with the bare driver:

  1. cuMemAlloc_v2 + cuMemFree_v2 pairs, 1 and 8 threads x 1 and 4 processes;
  1b. the same pairs on a stub driver that makes no system call, timed by each thread's CPU
     clock: the interposer's own cost, exactly (the simulated driver's file lock makes most of a
     pair system time, and the kernel splits CPU time into user and system only by sampling at
     each tick, so the user times of 1. carry tens of ns of noise);
  2. cuMemUnmap + cuMemRelease per 2 MiB page, with 100, 2,000 and 16,000 pages mapped
     (PyTorch's expandable segments map and unmap page by page);
  3. a race of 4 processes x 8 threads x 20,000 allocations of 24 MiB against a 64 MiB budget:
     the most the driver ever held, as seen by the racing threads after each allocation;
  4. what frameworks do, against a 256 MiB budget, through the C test caller
     (tests/native_helpers/interpose_probe.c): a CUDA graph whose memory nodes take 60 % of the
     budget replayed 50 times (without and with a sync between launches, and with its outputs left
     to AUTO_FREE_ON_LAUNCH as PyTorch's are), a training loop on a pool with a release threshold
     at 90 % of the budget (working set 70 %, 20 % per step), 100 pools keeping 4 MiB each, 100
     forks during pool traffic, a library loaded with RTLD_DEEPBIND allocating 160 + 160 MiB:
     what ran, what was refused, the synchronisations and trims the process asked the driver for,
     the most the driver held, bytes over the budget, children that hung;
  5. 200 processes started one after another, each allocating 60 MiB (half exit holding it): the
     wall time a process, interposed against bare (aim: under 50 ms added; the test of the same,
     test_interposer.py, checks only that they all start and the ledger's slots are reused).

    python bench/interposer_bench.py [--pairs N] [--repeat R] [--race-ops N] [--json-out FILE]
                                     [--before LIB] [--only 1,1b,2,3,4,5] [--starts N]

--before LIB adds a column to 1b: the same pairs through another build of the library (e.g. the
previous commit's, built into a folder of its own), interleaved with the others in the same run,
so that a change is judged against its predecessor on the same machine at the same moment.

Cells are medians over R runs (the notes add the best run of each, less disturbed by a busy
machine); direct and interposed runs alternate so that drift of the machine
hits both alike. Every run checks that the work happened (each call succeeded, counts match,
the driver and the ledger are back at 0) before anything is printed.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import checkout  # noqa: E402
checkout.use_colo()

from benchlib import Report  # noqa: E402

from colo.node import fakegpu, interposer, native  # noqa: E402

MiB = 1 << 20
BENCH_C = r"""
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <time.h>
#include "fakegpu.h"
typedef int CUresult; typedef void *CUcontext; typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct { int type, requestedHandleTypes; struct { int type, id; } location; void *w; unsigned char f[8]; } Prop;
CUresult cuInit(unsigned); CUresult cuDevicePrimaryCtxRetain(CUcontext *, int);
CUresult cuCtxSetCurrent(CUcontext); CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemCreate(CUmemGenericAllocationHandle *, size_t, const Prop *, unsigned long long);
CUresult cuMemRelease(CUmemGenericAllocationHandle);
CUresult cuMemAddressReserve(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
CUresult cuMemMap(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
CUresult cuMemUnmap(CUdeviceptr, size_t);
static int iters; static uint64_t size_b, budget; static pthread_barrier_t bar;
static double ns[64], cpu[64], tcpu[64]; static long ok[64], oom[64]; static uint64_t seen[64];
static struct fg_header *fake;
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e9 + t.tv_nsec; }
/* This thread's user-mode CPU time: what an interposer adds is user code; preemption by other
 * programs on a busy machine does not count in it. */
static double user_ns(void) { struct rusage r; getrusage(RUSAGE_THREAD, &r); return r.ru_utime.tv_sec * 1e9 + r.ru_utime.tv_usec * 1e3; }
/* This thread's CPU time, exact (user and system: a pair on the stub driver makes no system call). */
static double thread_ns(void) { struct timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec * 1e9 + t.tv_nsec; }
static void ctx(void) { CUcontext c; cuDevicePrimaryCtxRetain(&c, 0); cuCtxSetCurrent(c); }
static void *pairs(void *arg) {
    long id = (long)arg; CUdeviceptr p; ctx();
    for (int i = 0; i < 1000; i++) { cuMemAlloc_v2(&p, 1 << 20); cuMemFree_v2(p); }  /* warm up */
    pthread_barrier_wait(&bar);
    double t0 = now(), u0 = user_ns(), c0 = thread_ns();
    for (int i = 0; i < iters; i++) {
        if (cuMemAlloc_v2(&p, 1 << 20) || cuMemFree_v2(p)) { fprintf(stderr, "alloc/free failed\n"); exit(3); }
        ok[id]++;
    }
    ns[id] = (now() - t0) / iters;
    cpu[id] = (user_ns() - u0) / iters;
    tcpu[id] = (thread_ns() - c0) / iters;
    return NULL;
}
static void *race(void *arg) {
    long id = (long)arg; CUdeviceptr p; ctx();
    pthread_barrier_wait(&bar);
    for (int i = 0; i < iters; i++) {
        CUresult rc = cuMemAlloc_v2(&p, size_b);
        if (rc == 2) { oom[id]++; continue; }
        if (rc) { fprintf(stderr, "alloc failed %d\n", rc); exit(3); }
        ok[id]++;
        uint64_t u = __atomic_load_n(&fake->dev[0].used, __ATOMIC_ACQUIRE);
        if (u > seen[id]) seen[id] = u;
        sched_yield();  /* hold it while the others try */
        if (cuMemFree_v2(p)) { fprintf(stderr, "free failed\n"); exit(3); }
    }
    return NULL;
}
int main(int argc, char **argv) {
    const char *mode = argv[1]; int threads = atoi(argv[2]); iters = atoi(argv[3]);
    int fd = open(getenv("COLO_FAKEGPU_STATE"), O_RDONLY);
    fake = mmap(NULL, sizeof *fake, PROT_READ, MAP_SHARED, fd, 0);
    if (fake == MAP_FAILED) return 7;
    cuInit(0); ctx();
    if (!strcmp(mode, "once")) {  /* a process start: one allocation of argv[2] bytes, freed if argv[3] is 1 */
        CUdeviceptr p;
        if (cuMemAlloc_v2(&p, strtoull(argv[2], NULL, 10))) return 8;
        return atoi(argv[3]) && cuMemFree_v2(p) ? 9 : 0;
    }
    if (!strcmp(mode, "vmm")) {
        /* `iters` pages of 2 MiB: created, mapped side by side, handles kept; then timed:
         * unmap + release of each page. */
        size_t g = 2 << 20; CUdeviceptr va; int n = iters;
        CUmemGenericAllocationHandle *h = calloc(n, sizeof *h);
        Prop prop = {.type = 1, .location = {.type = 1, .id = 0}};
        if (cuMemAddressReserve(&va, g * n, 0, 0, 0)) return 4;
        for (int i = 0; i < n; i++)
            if (cuMemCreate(&h[i], g, &prop, 0) || cuMemMap(va + g * i, g, 0, h[i], 0)) return 5;
        uint64_t held = fake->dev[0].used;
        double t0 = now();
        for (int i = 0; i < n; i++)
            if (cuMemUnmap(va + g * i, g) || cuMemRelease(h[i])) return 6;
        double per = (now() - t0) / n;
        printf("%.2f %d %llu %llu\n", per, n, (unsigned long long)held, (unsigned long long)fake->dev[0].used);
        return 0;
    }
    size_b = strtoull(argv[4], NULL, 10); budget = strtoull(argv[5], NULL, 10);
    pthread_t th[64];
    pthread_barrier_init(&bar, NULL, threads);
    for (long t = 0; t < threads; t++) pthread_create(&th[t], NULL, !strcmp(mode, "race") ? race : pairs, (void *)t);
    double sum = 0, usum = 0, tsum = 0; long k = 0, o = 0; uint64_t mx = 0;
    for (int t = 0; t < threads; t++) {
        pthread_join(th[t], NULL); sum += ns[t]; usum += cpu[t]; tsum += tcpu[t]; k += ok[t]; o += oom[t];
        if (seen[t] > mx) mx = seen[t];
    }
    printf("%.2f %ld %ld %llu %.2f %.2f\n", sum / threads, k, o, (unsigned long long)mx, usum / threads, tsum / threads);
    return 0;
}
"""

# A driver that does nothing but hand out addresses: no lock, no system call, so that a thread's
# CPU clock times exactly what the interposer adds to a pair. Only what the pairs reach is real.
STUB_C = r"""
#include <stddef.h>
#include <stdint.h>
typedef int CUresult; typedef void *CUcontext; typedef unsigned long long CUdeviceptr;
static int primary; static __thread CUcontext cur; static __thread uint64_t base; static uint64_t threads;
CUresult cuInit(unsigned f) { (void)f; return 0; }
CUresult cuDeviceGetCount(int *n) { *n = 1; return 0; }
CUresult cuDevicePrimaryCtxRetain(CUcontext *c, int d) { (void)d; *c = &primary; return 0; }
CUresult cuCtxSetCurrent(CUcontext c) { cur = c; return 0; }
CUresult cuCtxGetCurrent(CUcontext *c) { *c = cur; return 0; }
CUresult cuCtxGetDevice(int *d) { *d = 0; return 0; }
/* One address per thread: each pair frees it before the next allocation. */
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
    (void)n;
    if (!base) base = (__atomic_add_fetch(&threads, 1, __ATOMIC_RELAXED)) << 40;
    *p = base; return 0;
}
CUresult cuMemFree_v2(CUdeviceptr p) { (void)p; return 0; }
#define NONE(name) CUresult name(void) { return 801; } /* not supported: never reached by pairs */
NONE(cuMemCreate) NONE(cuMemRelease) NONE(cuMemAddressReserve) NONE(cuMemMap) NONE(cuMemUnmap)
"""


def build(tmp: Path, lib_dir: Path, name: str = "interposer_bench") -> Path:
    src, exe = tmp / "bench.c", tmp / name
    src.write_text(BENCH_C)
    fg_inc = Path(__file__).resolve().parents[1] / "native" / "fakegpu"
    subprocess.run(["cc", "-O2", f"-I{fg_inc}", "-o", str(exe), str(src), str(lib_dir / "libcuda.so.1"),
                    "-lpthread"], check=True)
    return exe


def build_stub(tmp: Path) -> Path:
    """The stub driver as libcuda.so.1 in a folder of its own; returns the folder."""
    d = tmp / "stub"
    d.mkdir()
    (d / "stub.c").write_text(STUB_C)
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(d / "libcuda.so.1"),
                    str(d / "stub.c")], check=True)
    return d


def launch(exe: Path, env: dict, procs: int, *args) -> list[list[float]]:
    ps = [subprocess.Popen([str(exe), *map(str, args)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True) for _ in range(procs)]
    rows = []
    for p in ps:
        out, _ = p.communicate(timeout=1200)
        if p.returncode != 0:
            raise SystemExit(f"bench process failed ({p.returncode}): {args}")
        rows.append([float(x) for x in out.split()])
    return rows


HELPERS = Path(__file__).resolve().parents[1] / "tests" / "native_helpers"
NATIVE_SRC = Path(__file__).resolve().parents[1] / "native"


def build_probe(tmp: Path, lib_dir: Path) -> tuple[Path, Path]:
    """The interposer's C test caller, and the library section 4 loads with RTLD_DEEPBIND."""
    probe, deep = tmp / "interpose_probe", tmp / "libdeep.so"
    subprocess.run(["cc", "-O2", "-std=gnu11", f"-I{NATIVE_SRC / 'interpose'}", f"-I{NATIVE_SRC / 'fakegpu'}", "-o",
                    str(probe), str(HELPERS / "interpose_probe.c"), str(lib_dir / "libcuda.so.1"), "-ldl",
                    "-lpthread"], check=True)
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(deep), str(HELPERS / "deepbind_lib.c"),
                    str(lib_dir / "libcuda.so.1"), "-ldl"], check=True)
    return probe, deep


def probe_lines(probe: Path, env: dict, *script: str) -> list[str]:
    r = subprocess.run([str(probe), *script], env=env, capture_output=True, text=True, timeout=1200)
    if r.returncode != 0:
        raise SystemExit(f"probe failed ({r.returncode}): {script[:6]}: {r.stderr[-400:]}")
    return r.stdout.splitlines()


def field(lines: list[str], cmd: str) -> list[int]:
    """The numbers of the first `cmd` line (its code first)."""
    return [int(x) for x in next(x for x in lines if x.split()[0] == cmd).split()[1:] if x.lstrip("-").isdigit()]


def frameworks(rep: Report, tmp: Path, node, base: dict, budgeted) -> None:
    budget = 256 * MiB
    probe, deep = build_probe(tmp, Path(node.lib_dir))
    graph, ws, step, keep = (str(budget * pct // 100) for pct in (60, 70, 20, 90))
    cases = [
        # name, script, how to read (ran, refused, most held) from its lines
        ("graph replay x50, no sync", ["init", "streamnew", "graph", "gnode", graph, "gfree", "instantiate",
                                       "replay", "50", "0", "counts"], "replay"),
        ("graph replay x50, sync each", ["init", "streamnew", "graph", "gnode", graph, "gfree", "instantiate",
                                         "replay", "50", "1", "counts"], "replay"),
        ("graph replay x50, auto-free", ["init", "streamnew", "graph", "gnode", graph, "instflags", "1",
                                         "replay", "50", "0", "counts"], "replay"),
        ("pool loop x200, 90 % kept", ["init", "streamnew", "threshold", keep, "async", ws,
                                       "poolloop", "200", step, "1", "counts"], "poolloop"),
        ("100 pools x 4 MiB kept", ["init", "streamnew", "pools", "100", "4M", "counts"], "pools"),
        ("deepbind lib, 160+160 MiB", ["init", "deep", str(deep), "160M", "rawused", "counts"], "deep"),
    ]
    print(f"\n4. what frameworks do, budget {budget // MiB} MiB: bare simulated driver vs interposed")
    print(f"{'case':<28} {'':>10} {'ran':>4} {'refused':>7} {'syncs':>6} {'trims':>6} {'most held':>10} {'over':>9}")
    for name, script, cmd in cases:
        row = {}
        for who in ("bare", "interposed"):
            env = base if who == "bare" else budgeted(budget)[0]
            lines = probe_lines(probe, env, *script)
            syncs, trims = field(lines, "counts")[1:3]
            f = field(lines, cmd)
            if cmd == "replay":
                ran, refused, most = f[1], f[2], f[3]
            elif cmd == "poolloop":
                ran, refused, most = 200 - f[1], f[1], f[2]
            elif cmd == "pools":
                ran, refused, most = f[1], 100 - f[1], f[2]
            else:  # deep: the two allocations' codes, then what the driver held after them
                codes = f[1:3]
                ran, refused, most = codes.count(0), codes.count(2), field(lines, "rawused")[1]
            over = max(0, most - budget)
            row[who] = (ran, refused, syncs, trims, most, over)
            print(f"{name if who == 'bare' else '':<28} {who:>10} {ran:>4} {refused:>7} {syncs:>6} {trims:>6} "
                  f"{most // MiB:>6} MiB {over // MiB:>5} MiB")
        b, i = row["bare"], row["interposed"]
        rep.check(i[5] == 0, f"{name}: the driver held {i[4]} bytes under a {budget}-byte budget")
        key = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
        if cmd in ("deep", "pools"):  # what must hold here is the budget (trims at its edge are its price)
            rep.figure(f"fw_{key}_over", f"interposer, {name}: bytes over budget, simulated driver", i[5], "B",
                       baseline=b[5], baseline_what="bare simulated driver, no budget",
                       note=f"interposed: {i[2]} syncs {i[3]} trims {i[1]} refused")
            continue
        rep.figure(f"fw_{key}_extra_syncs_trims_refusals",
                   f"interposer, {name}: syncs + trims + refusals beyond the bare driver's, simulated driver",
                   (i[2] - b[2]) + (i[3] - b[3]) + (i[1] - b[1]), "calls", baseline=0,
                   baseline_what="bare simulated driver",
                   note=f"bare {b[2]} syncs {b[3]} trims {b[1]} refused; interposed {i[2]} / {i[3]} / {i[1]}; "
                        f"most held {i[4] // MiB} MiB of {budget // MiB}")
    forks = 100
    row = {}
    for who in ("bare", "interposed"):
        env = base if who == "bare" else budgeted(budget)[0]
        hung, fine = field(probe_lines(probe, env, "init", "forkstorm", str(forks)), "forkstorm")[1:3]
        row[who] = hung
        print(f"{forks} forks during pool traffic {who:>10}: {hung} hung, {fine} exited 0")
    rep.check(row["interposed"] == 0, f"{row['interposed']} of {forks} children hung")
    rep.figure("fw_fork_hung", f"interposer, {forks} forks during pool traffic: children hung, simulated driver",
               row["interposed"], "children", baseline=row["bare"], baseline_what="bare simulated driver")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=200_000, help="alloc+free pairs per thread")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--race-ops", type=int, default=20_000, help="allocations per racing thread")
    ap.add_argument("--json-out", help="also save the figures as JSON (bench/readme_table.py)")
    ap.add_argument("--before", type=Path, help="another libcolo-interpose.so to time beside this one in 1b")
    ap.add_argument("--only", default="1,1b,2,3,4,5", help="sections to run, comma-separated")
    ap.add_argument("--starts", type=int, default=200, help="processes started one after another (5.)")
    args = ap.parse_args()
    only = set(args.only.split(","))
    if not only <= {"1", "1b", "2", "3", "4", "5"}:
        ap.error(f"--only: unknown section in {args.only!r} (sections: 1,1b,2,3,4,5)")
    if args.before is not None and not args.before.is_file():
        ap.error(f"--before: {args.before} is not a file")
    rep = Report("interposer_bench")
    native.ensure_built()
    with tempfile.TemporaryDirectory(prefix="colo-bench-") as d:
        tmp = Path(d)
        state = tmp / "fakegpu.state"
        fakegpu.create(state, count=1, mem=64 << 30)
        node = fakegpu.FakeNode(state)
        exe = build(tmp, Path(node.lib_dir))
        base = {**os.environ, **node.env}
        for k in ("LD_PRELOAD", "COLO_GPU_BUDGET", "COLO_LEDGER"):
            base.pop(k, None)

        def budgeted(budget: int) -> tuple[dict, Path]:
            ledger = Path(tempfile.mkdtemp(dir=tmp)) / "ledger"
            interposer.create_ledger(ledger, budget)
            return {**base, **interposer.job_env(budget, str(ledger), str(interposer.library_path()))}, ledger

        def settled(ledger: Path | None) -> None:
            used = fakegpu.FakeNode(state).read()["devices"][0]["used"]
            rep.check(used == 0, f"the simulated driver still holds {used} bytes")
            if ledger is not None:
                led = interposer.read_ledger(ledger)
                rep.check(led.counted[0] == 0 and led.refused == 0, f"ledger not back at 0: {led}")

        print(f"simulated driver, {os.cpu_count()} CPUs; medians of {args.repeat} runs")
        shapes = [(p, t) for p in (1, 4) for t in (1, 8)]
        if "1" in only:
            env, ledger = budgeted(32 << 30)
            print(f"\n1. {args.pairs} alloc+free pairs of 1 MiB per thread: wall time, and user-mode CPU time of")
            print("   the looping threads (what the interposer adds is user code; time other programs take")
            print("   from a busy machine does not count in it)")
            print(f"{'procs':>5} {'threads':>7} {'direct ns':>10} {'interposed':>11} {'added':>8}   "
                  f"{'user direct':>11} {'user interp.':>12} {'added':>7}")
            for procs, threads in shapes:
                direct, inter, udirect, uinter = [], [], [], []
                for _ in range(args.repeat):
                    for e, led, acc, uacc in ((base, None, direct, udirect), (env, ledger, inter, uinter)):
                        rows = launch(exe, e, procs, "pairs", threads, args.pairs, MiB, 0)
                        rep.check(all(r[1] == threads * args.pairs for r in rows), f"pairs missing: {rows}")
                        settled(led)
                        acc.append(sum(r[0] for r in rows) / len(rows))
                        uacc.append(sum(r[4] for r in rows) / len(rows))
                dm, im = statistics.median(direct), statistics.median(inter)
                du, iu = statistics.median(udirect), statistics.median(uinter)
                print(f"{procs:>5} {threads:>7} {dm:>10.1f} {im:>11.1f} {im - dm:>8.1f}   "
                      f"{du:>11.1f} {iu:>12.1f} {iu - du:>7.1f}")
                rep.figure(f"pair_{procs}p_{threads}t", f"interposer, alloc+free pair, {procs} proc x {threads} thr, simulated driver", im, "ns",
                           baseline=dm, baseline_what="bare simulated driver (wall)",
                           note=f"added {im - dm:+.0f} ns; best runs {min(inter):.0f} vs {min(direct):.0f}")
                rep.figure(f"pair_user_{procs}p_{threads}t", f"interposer, alloc+free pair, user CPU, {procs} proc x {threads} thr, simulated driver", iu, "ns",
                           baseline=du, baseline_what="bare simulated driver (user CPU)",
                           note=f"added {iu - du:+.0f} ns")

        if "1b" in only:
            stub_pairs = args.pairs * 10
            stub = build_stub(tmp)
            stub_exe = build(tmp, stub, "interposer_bench_stub")
            sbase = {**base, "LD_LIBRARY_PATH": f"{stub}:{base.get('LD_LIBRARY_PATH', '')}"}
            senv, sledger = budgeted(32 << 30)
            senv["LD_LIBRARY_PATH"] = sbase["LD_LIBRARY_PATH"]
            runs = [(sbase, None), (senv, sledger)]
            if args.before is not None:
                benv, bledger = budgeted(32 << 30)
                benv["LD_LIBRARY_PATH"] = sbase["LD_LIBRARY_PATH"]
                benv["LD_PRELOAD"] = str(args.before.resolve())
                runs.append((benv, bledger))
            print(f"\n1b. {stub_pairs} pairs per thread on a stub driver that makes no system call: each thread's")
            print("   CPU time a pair (exact: the thread's CPU clock)")
            if args.before is not None:
                print(f"   'before': {args.before}, run interleaved with the others")
            print(f"{'procs':>5} {'threads':>7} {'direct ns':>10} {'interposed':>11} {'added':>8} {'best added':>11}"
                  + (f" {'before':>8} {'added':>8} {'best added':>11}" if args.before is not None else ""))
            for procs, threads in shapes:
                acc: list[list[float]] = [[] for _ in runs]
                for _ in range(args.repeat):
                    for (e, led), a in zip(runs, acc):
                        rows = launch(stub_exe, e, procs, "pairs", threads, stub_pairs, MiB, 0)
                        rep.check(all(r[1] == threads * stub_pairs for r in rows), f"stub pairs missing: {rows}")
                        if led is not None:
                            c = interposer.read_ledger(led)
                            rep.check(c.counted[0] == 0 and c.refused == 0, f"ledger not back at 0: {c}")
                        a.append(sum(r[5] for r in rows) / len(rows))
                direct, inter = acc[0], acc[1]
                dm, im = statistics.median(direct), statistics.median(inter)
                best = min(inter) - min(direct)
                line = f"{procs:>5} {threads:>7} {dm:>10.1f} {im:>11.1f} {im - dm:>8.1f} {best:>11.1f}"
                note = f"added {im - dm:+.0f} ns; best runs {min(inter):.0f} vs {min(direct):.0f}"
                if args.before is not None:
                    bm = statistics.median(acc[2])
                    line += f" {bm:>8.1f} {bm - dm:>8.1f} {min(acc[2]) - min(direct):>11.1f}"
                    note += f"; before ({args.before}): added {bm - dm:+.0f} ns"
                print(line)
                rep.figure(f"pair_cpu_stub_{procs}p_{threads}t", f"interposer, alloc+free pair, thread CPU, {procs} proc x {threads} thr, stub driver", im, "ns",
                           baseline=dm, baseline_what="bare stub driver (no system call)", note=note)

        if "2" in only:
            print("\n2. cuMemUnmap + cuMemRelease per 2 MiB page")
            print(f"{'pages':>6} {'direct ns':>10} {'interposed ns':>14} {'added ns':>9} {'ratio':>6}")
            env, ledger = budgeted(48 << 30)
            for pages in (100, 2_000, 16_000):
                direct, inter = [], []
                for _ in range(args.repeat):
                    for e, led, acc in ((base, None, direct), (env, ledger, inter)):
                        (per, n, held, after), = launch(exe, e, 1, "vmm", 1, pages)
                        rep.check(n == pages and held == pages * 2 * MiB and after == 0, f"vmm: {n} {held} {after}")
                        settled(led)
                        acc.append(per)
                dm, im = statistics.median(direct), statistics.median(inter)
                print(f"{pages:>6} {dm:>10.1f} {im:>14.1f} {im - dm:>9.1f} {im / dm:>6.2f}")
                rep.figure(f"unmap_{pages}", f"interposer, unmap+release, {pages} pages mapped, simulated driver", im, "ns", baseline=dm,
                           baseline_what="bare simulated driver", note=f"added {im - dm:+.0f} ns")

        if "3" in only:
            budget, size, ops = 64 * MiB, 24 * MiB, args.race_ops
            print(f"\n3. race: 4 processes x 8 threads x {ops} allocations of 24 MiB, budget 64 MiB")
            print(f"{'':>12} {'allocated':>10} {'refused':>8} {'most held':>10} {'over budget':>12}")
            env, ledger = budgeted(budget)
            for name, e, led in (("direct", base, None), ("interposed", env, ledger)):
                rows = launch(exe, e, 4, "race", 8, ops, size, budget)
                got, refused, most = sum(r[1] for r in rows), sum(r[2] for r in rows), max(r[3] for r in rows)
                rep.check(got + refused == 4 * 8 * ops, f"race: {got} + {refused} operations")  # every one was made
                if led is not None:
                    peak = interposer.read_ledger(led).peak[0]
                    rep.check(refused > 0 and peak <= budget, f"race: refused {refused}, ledger peak {peak}")
                    led.unlink()
                    interposer.create_ledger(led, budget)  # the refusals were the point; settle the rest
                settled(led)
                over = max(0, int(most) - budget)
                print(f"{name:>12} {got:>10.0f} {refused:>8.0f} {int(most) // MiB:>7} MiB {over // MiB:>8} MiB")
                if led is None:
                    direct_most = most
                else:
                    rep.figure("race_over", f"interposer, race 4x8x{ops:,}: bytes over budget, simulated driver", over, "B", baseline=direct_most - budget,
                               baseline_what="bare driver, no budget", note=f"most held {int(most) // MiB} MiB")
        if "4" in only:
            frameworks(rep, tmp, node, base, budgeted)

        if "5" in only:
            n = args.starts
            print(f"\n5. {n} processes started one after another, each allocating 60 MiB (every other one exits")
            print("   holding it): wall time a process")
            env, ledger = budgeted(64 * MiB)
            direct, inter = [], []
            for _ in range(args.repeat):
                for e, led, acc in ((base, None, direct), (env, ledger, inter)):
                    t0 = time.perf_counter()
                    for i in range(n):
                        r = subprocess.run([str(exe), "once", str(60 * MiB), str(i % 2)], env=e, capture_output=True)
                        rep.check(r.returncode == 0, f"process {i} failed ({r.returncode}): {r.stderr!r}")
                    acc.append((time.perf_counter() - t0) / n * 1e3)
                    if led is not None:  # the last one freed; the dead ones' were reclaimed by the next
                        c = interposer.read_ledger(led)
                        rep.check(c.counted[0] == 0 and c.refused == 0 and c.peak[0] == 60 * MiB, f"ledger: {c}")
            dm, im = statistics.median(direct), statistics.median(inter)
            print(f"{'direct ms':>10} {'interposed':>11} {'added':>8} {'ratio':>6}")
            print(f"{dm:>10.2f} {im:>11.2f} {im - dm:>8.2f} {im / dm:>6.2f}")
            rep.figure("start_sequential", f"interposer, process start + 60 MiB allocation, {n} one after another, "
                       "simulated driver", im, "ms", baseline=dm, baseline_what="bare simulated driver",
                       note=f"added {im - dm:+.2f} ms a process (aim: < 50)")
    print()
    sys.exit(rep.finish(args.json_out))


if __name__ == "__main__":
    main()
