/* colo-burn: a GPU load generator that uses only the CUDA driver API through
 * dlopen("libcuda.so.1"), so it runs alike on a real GPU and on native/fakegpu.
 *
 *   colo-burn [--device N] [--mem SIZE] [--step SIZE --interval SECONDS] [--over SIZE]
 *             [--duty PCT] [--seconds S] [--quiet]
 *
 * Allocates --mem (in --step chunks every --interval seconds if asked), then tries --over more
 * (which a budget should refuse), keeps the device busy at --duty percent for --seconds, frees
 * everything and exits. Exit codes: 0 as asked (--mem held, --over refused); 1 other CUDA error;
 * 2 usage; 3 a --mem allocation was refused with CUDA_ERROR_OUT_OF_MEMORY; 4 --over was not
 * refused; 128+N when stopped by signal N (after freeing). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <ctype.h>
#include <dlfcn.h>
#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext;
enum { CUDA_SUCCESS = 0, CUDA_ERROR_OUT_OF_MEMORY = 2 };

static struct {
    CUresult (*Init)(unsigned);
    CUresult (*DeviceGet)(int *, int);
    CUresult (*PrimaryCtxRetain)(CUcontext *, int);
    CUresult (*PrimaryCtxRelease)(int);
    CUresult (*CtxSetCurrent)(CUcontext);
    CUresult (*CtxSynchronize)(void);
    CUresult (*MemAlloc)(CUdeviceptr *, size_t);
    CUresult (*MemFree)(CUdeviceptr);
    CUresult (*MemsetD32)(CUdeviceptr, unsigned, size_t);
    CUresult (*GetErrorName)(CUresult, const char **);
    int (*SetActivity)(int, int); /* fakegpuSetActivity: only the simulated driver has it */
} cu;

static volatile sig_atomic_t g_signal;
static int g_quiet;

static void on_signal(int sig) { g_signal = sig; }

static void say(const char *fmt, ...)
{
    if (g_quiet)
        return;
    va_list ap;
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    putchar('\n');
}

static const char *err_name(CUresult r)
{
    static char buf[32];
    const char *s = NULL;
    if (cu.GetErrorName && cu.GetErrorName(r, &s) == CUDA_SUCCESS && s)
        return s;
    snprintf(buf, sizeof buf, "CUresult %d", r);
    return buf;
}

static int parse_size(const char *t, uint64_t *out)
{
    char *end;
    errno = 0;
    double v = strtod(t, &end);
    if (end == t || errno || v <= 0)
        return -1;
    static const struct { const char *u; double m; } U[] = {
        {"", 1}, {"b", 1}, {"k", 1024.0}, {"kib", 1024.0}, {"kb", 1e3}, {"m", 1048576.0},
        {"mib", 1048576.0}, {"mb", 1e6}, {"g", 1073741824.0}, {"gib", 1073741824.0}, {"gb", 1e9},
        {"t", 1099511627776.0}, {"tib", 1099511627776.0}, {"tb", 1e12}};
    for (size_t i = 0; i < sizeof U / sizeof U[0]; i++)
        if (!strcasecmp(end, U[i].u)) {
            *out = (uint64_t)(v * U[i].m);
            return *out ? 0 : -1;
        }
    return -1;
}

static const char *fmt_size(uint64_t b)
{
    static char bufs[4][32];
    static int k;
    char *s = bufs[k++ % 4];
    if (b && b % (1ull << 30) == 0)
        snprintf(s, 32, "%lluGiB", (unsigned long long)(b >> 30));
    else if (b && b % (1ull << 20) == 0)
        snprintf(s, 32, "%lluMiB", (unsigned long long)(b >> 20));
    else if (b && b % 1024 == 0)
        snprintf(s, 32, "%lluKiB", (unsigned long long)(b >> 10));
    else
        snprintf(s, 32, "%lluB", (unsigned long long)b);
    return s;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Sleep, but wake up at once when a signal asks us to stop. */
static void nap(double s)
{
    double end = now_s() + s;
    while (!g_signal) {
        double left = end - now_s();
        if (left <= 0)
            break;
        struct timespec ts = {(time_t)left, (long)((left - (double)(time_t)left) * 1e9)};
        nanosleep(&ts, NULL);
    }
}

static void *sym(void *h, const char *a, const char *b)
{
    void *p = dlsym(h, a);
    return p || !b ? p : dlsym(h, b);
}

static int load(void)
{
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        fprintf(stderr, "colo-burn: cannot load libcuda.so.1: %s\n", dlerror());
        return -1;
    }
    *(void **)&cu.Init = sym(h, "cuInit", NULL);
    *(void **)&cu.DeviceGet = sym(h, "cuDeviceGet", NULL);
    *(void **)&cu.PrimaryCtxRetain = sym(h, "cuDevicePrimaryCtxRetain", NULL);
    *(void **)&cu.PrimaryCtxRelease = sym(h, "cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease");
    *(void **)&cu.CtxSetCurrent = sym(h, "cuCtxSetCurrent", NULL);
    *(void **)&cu.CtxSynchronize = sym(h, "cuCtxSynchronize", NULL);
    *(void **)&cu.MemAlloc = sym(h, "cuMemAlloc_v2", NULL);
    *(void **)&cu.MemFree = sym(h, "cuMemFree_v2", NULL);
    *(void **)&cu.MemsetD32 = sym(h, "cuMemsetD32_v2", NULL);
    *(void **)&cu.GetErrorName = sym(h, "cuGetErrorName", NULL);
    *(void **)&cu.SetActivity = sym(h, "fakegpuSetActivity", NULL);
    if (!cu.Init || !cu.DeviceGet || !cu.PrimaryCtxRetain || !cu.PrimaryCtxRelease || !cu.CtxSetCurrent ||
        !cu.CtxSynchronize || !cu.MemAlloc || !cu.MemFree || !cu.MemsetD32) {
        fprintf(stderr, "colo-burn: libcuda.so.1 lacks a needed driver function\n");
        return -1;
    }
    return 0;
}

struct held { CUdeviceptr p; uint64_t size; };
static struct held *g_held;
static size_t g_nheld, g_capheld;
static uint64_t g_total;

/* 0 success, else the CUresult; the refusal is printed here. */
static CUresult grab(uint64_t size, const char *what)
{
    CUdeviceptr p = 0;
    CUresult r = cu.MemAlloc(&p, (size_t)size);
    if (r != CUDA_SUCCESS) {
        say("allocation of %s %s: %s", fmt_size(size), r == CUDA_ERROR_OUT_OF_MEMORY ? "refused" : "failed",
            err_name(r));
        return r;
    }
    if (g_nheld == g_capheld) {
        g_capheld = g_capheld ? g_capheld * 2 : 16;
        struct held *n = realloc(g_held, g_capheld * sizeof *n);
        if (!n) {
            cu.MemFree(p);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        g_held = n;
    }
    g_held[g_nheld++] = (struct held){p, size};
    g_total += size;
    say("allocated %s%s (holding %s)", fmt_size(size), what, fmt_size(g_total));
    return CUDA_SUCCESS;
}

static void busy(double duty, double seconds)
{
    const double period = 0.1;
    CUdeviceptr buf = g_nheld ? g_held[0].p : 0;
    size_t words = g_nheld ? (size_t)((g_held[0].size < (256u << 20) ? g_held[0].size : (256u << 20)) / 4) : 0;
    say("busy at %.0f%% for %gs", duty, seconds);
    if (cu.SetActivity)
        cu.SetActivity((int)duty, (int)(duty / 2));
    double end = now_s() + seconds;
    unsigned v = 0;
    while (!g_signal && now_s() < end) {
        double t0 = now_s();
        if (cu.SetActivity) { /* simulated: the activity is declared, one memset keeps the path honest */
            if (words && duty > 0)
                cu.MemsetD32(buf, v++, words);
        } else {
            while (words && duty > 0 && now_s() - t0 < period * duty / 100 && !g_signal) {
                cu.MemsetD32(buf, v++, words);
                cu.CtxSynchronize();
            }
        }
        double left = period - (now_s() - t0);
        if (left > 0)
            nap(left < end - now_s() ? left : end - now_s());
    }
    if (cu.SetActivity)
        cu.SetActivity(0, 0);
}

static int usage(void)
{
    fprintf(stderr, "usage: colo-burn [--device N] [--mem SIZE] [--step SIZE --interval SECONDS] [--over SIZE]\n"
                    "                 [--duty PCT] [--seconds S] [--quiet]\n");
    return 2;
}

int main(int argc, char **argv)
{
    int device = 0;
    uint64_t mem = 0, step = 0, over = 0;
    double interval = 0, duty = 100, seconds = 0;
    int duty_set = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        char *end = NULL;
        if (!strcmp(a, "--quiet")) {
            g_quiet = 1;
            continue;
        }
        if (!v)
            return usage();
        i++;
        if (!strcmp(a, "--device")) {
            device = (int)strtol(v, &end, 10);
            if (*end || device < 0)
                return usage();
        } else if (!strcmp(a, "--mem")) {
            if (parse_size(v, &mem))
                return usage();
        } else if (!strcmp(a, "--step")) {
            if (parse_size(v, &step))
                return usage();
        } else if (!strcmp(a, "--over")) {
            if (parse_size(v, &over))
                return usage();
        } else if (!strcmp(a, "--interval")) {
            interval = strtod(v, &end);
            if (*end || interval < 0)
                return usage();
        } else if (!strcmp(a, "--duty")) {
            duty = strtod(v, &end);
            duty_set = 1;
            if (*end || duty < 0 || duty > 100)
                return usage();
        } else if (!strcmp(a, "--seconds")) {
            seconds = strtod(v, &end);
            if (*end || seconds < 0)
                return usage();
        } else {
            return usage();
        }
    }
    if ((step && !mem) || (interval > 0 && !step))
        return usage();
    if (!duty_set && seconds > 0 && !mem)
        duty = 100;
    setvbuf(stdout, NULL, _IOLBF, 0);
    struct sigaction sa = {.sa_handler = on_signal};
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    if (load() != 0)
        return 1;

    int dev = 0, rc = 0;
    CUcontext ctx = NULL;
    CUresult r = cu.Init(0);
    if (!r)
        r = cu.DeviceGet(&dev, device);
    if (!r)
        r = cu.PrimaryCtxRetain(&ctx, dev);
    if (!r && (r = cu.CtxSetCurrent(ctx)))
        cu.PrimaryCtxRelease(dev);
    if (r) {
        fprintf(stderr, "colo-burn: cannot use device %d: %s\n", device, err_name(r));
        return 1;
    }
    for (uint64_t done = 0; mem && done < mem && !g_signal;) {
        uint64_t n = step && step < mem - done ? step : mem - done;
        if ((r = grab(n, ""))) {
            rc = r == CUDA_ERROR_OUT_OF_MEMORY ? 3 : 1;
            break;
        }
        done += n;
        if (step && interval > 0 && done < mem)
            nap(interval);
    }
    if (!rc && over && !g_signal) {
        r = grab(over, " beyond --mem (expected a refusal)");
        rc = r == CUDA_SUCCESS ? 4 : r == CUDA_ERROR_OUT_OF_MEMORY ? 0 : 1;
    }
    if (rc != 1 && rc != 3 && seconds > 0 && !g_signal) {
        if (!g_nheld && duty > 0 && grab(64u << 20, " as a scratch buffer") != CUDA_SUCCESS)
            rc = 1;
        else
            busy(duty, seconds);
    }
    for (size_t i = 0; i < g_nheld; i++)
        cu.MemFree(g_held[i].p);
    if (g_nheld)
        say("freed %s", fmt_size(g_total));
    free(g_held);
    cu.PrimaryCtxRelease(dev);
    if (g_signal) {
        say("stopped by signal %d", (int)g_signal);
        return 128 + g_signal;
    }
    return rc;
}
