/* A scriptable driver-API caller for tests: reads one command per line on stdin, answers one
 * line on stdout ("ok ..." or "err CODE ..."). It reaches libcuda.so.1 only through dlopen, as
 * real frameworks do, so it runs against native/fakegpu (or a real driver).
 *
 *   init | ctx DEV | pop | alloc SIZE | free PTR | fill CHUNK | freeall | info | memset PTR BYTES
 *   threadalloc SIZE | procaddr NAME VERSION | dlsym NAME | stress N SEED | exit
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext;

static void *lib;
static CUresult (*Init)(unsigned);
static CUresult (*DeviceGet)(int *, int);
static CUresult (*Retain)(CUcontext *, int);
static CUresult (*SetCurrent)(CUcontext);
static CUresult (*PopCurrent)(CUcontext *);
static CUresult (*Alloc)(CUdeviceptr *, size_t);
static CUresult (*Free)(CUdeviceptr);
static CUresult (*GetInfo)(size_t *, size_t *);
static CUresult (*MemsetD8)(CUdeviceptr, unsigned char, size_t);
static CUresult (*GetProc)(const char *, void **, int, unsigned long long, int *);

static CUdeviceptr held[4096];
static int nheld;

static void *must(const char *name)
{
    void *p = dlsym(lib, name);
    if (!p) {
        fprintf(stderr, "missing %s\n", name);
        exit(1);
    }
    return p;
}

static void *thread_alloc(void *arg)
{
    CUdeviceptr p;
    static CUresult r;
    r = Alloc(&p, (size_t)(uintptr_t)arg);
    return &r;
}

/* Random alloc/free, holding at most 8 buffers; OOM refusals are expected and counted. */
static void stress(int n, unsigned seed)
{
    CUdeviceptr mine[8] = {0};
    int allocs = 0, ooms = 0, errs = 0;
    for (int i = 0; i < n; i++) {
        int k = (int)(rand_r(&seed) % 8);
        if (mine[k]) {
            errs += Free(mine[k]) != 0;
            mine[k] = 0;
        } else {
            size_t sz = ((size_t)(rand_r(&seed) % 4096) + 1) << 20; /* 1 MiB .. 4 GiB */
            CUresult r = Alloc(&mine[k], sz);
            if (r == 0)
                allocs++;
            else if (r == 2)
                ooms++, mine[k] = 0;
            else
                errs++, mine[k] = 0;
        }
    }
    for (int k = 0; k < 8; k++)
        if (mine[k])
            errs += Free(mine[k]) != 0;
    printf("ok %d %d %d\n", allocs, ooms, errs);
}

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        fprintf(stderr, "%s\n", dlerror());
        return 1;
    }
    *(void **)&Init = must("cuInit");
    *(void **)&DeviceGet = must("cuDeviceGet");
    *(void **)&Retain = must("cuDevicePrimaryCtxRetain");
    *(void **)&SetCurrent = must("cuCtxSetCurrent");
    *(void **)&PopCurrent = must("cuCtxPopCurrent_v2");
    *(void **)&Alloc = must("cuMemAlloc_v2");
    *(void **)&Free = must("cuMemFree_v2");
    *(void **)&GetInfo = must("cuMemGetInfo_v2");
    *(void **)&MemsetD8 = must("cuMemsetD8_v2");
    *(void **)&GetProc = must("cuGetProcAddress_v2");
    char line[512], a[256];
    unsigned long long x, y;
    while (fgets(line, sizeof line, stdin)) {
        CUresult r = 0;
        if (!strncmp(line, "init", 4)) {
            r = Init(0);
        } else if (sscanf(line, "ctx %llu", &x) == 1) {
            int d;
            CUcontext c;
            if (!(r = DeviceGet(&d, (int)x)) && !(r = Retain(&c, d)))
                r = SetCurrent(c);
        } else if (!strncmp(line, "pop", 3)) {
            CUcontext c;
            r = PopCurrent(&c);
        } else if (sscanf(line, "alloc %llu", &x) == 1) {
            CUdeviceptr p = 0;
            if (!(r = Alloc(&p, x))) {
                held[nheld++ % 4096] = p;
                printf("ok %llu\n", p);
                continue;
            }
        } else if (sscanf(line, "free %llu", &x) == 1) {
            r = Free(x);
        } else if (sscanf(line, "fill %llu", &x) == 1) {
            CUdeviceptr p;
            int n = 0;
            while (nheld < 4096 && !(r = Alloc(&p, x)))
                held[nheld++] = p, n++;
            printf("n %d err %d\n", n, r);
            continue;
        } else if (!strncmp(line, "freeall", 7)) {
            while (nheld > 0 && !r)
                r = Free(held[--nheld]);
        } else if (!strncmp(line, "info", 4)) {
            size_t f = 0, t = 0;
            if (!(r = GetInfo(&f, &t))) {
                printf("ok %zu %zu\n", f, t);
                continue;
            }
        } else if (sscanf(line, "memset %llu %llu", &x, &y) == 2) {
            r = MemsetD8(x, 0, y);
        } else if (sscanf(line, "threadalloc %llu", &x) == 1) {
            pthread_t t;
            void *res;
            pthread_create(&t, NULL, thread_alloc, (void *)(uintptr_t)x);
            pthread_join(t, &res);
            r = *(CUresult *)res;
        } else if (sscanf(line, "procaddr %255s %llu", a, &x) == 2) {
            void *p = NULL;
            int status = -1;
            r = GetProc(a, &p, (int)x, 0, &status);
            printf("%s %d %p %d\n", r ? "err" : "ok", r, p, status);
            continue;
        } else if (sscanf(line, "dlsym %255s", a) == 1) {
            printf("ok %p\n", dlsym(lib, a));
            continue;
        } else if (sscanf(line, "stress %llu %llu", &x, &y) == 2) {
            stress((int)x, (unsigned)y);
            continue;
        } else if (!strncmp(line, "exit", 4)) {
            break;
        } else {
            printf("bad command\n");
            continue;
        }
        if (r)
            printf("err %d\n", r);
        else
            printf("ok\n");
    }
    dlclose(lib);
    return 0;
}
