/* A second interposer preloaded after colo's, as HAMi-core would be: it exports an unversioned
 * dlsym (the real one found with dlvsym on first use; RTLD_NEXT answered relative to itself, and
 * cu* names it wraps answered with its own functions) that sets it up at the first cu* name, as
 * HAMi-core's does (or its cuInit); a cuDeviceGetCount that cannot work before that set-up (it
 * aborts: HAMi-core's hooks call through a table filled then); cuGetProcAddress(_v2); and a
 * cuMemAlloc_v2 that counts its calls and forwards to the next definition. At exit it prints its
 * counts. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;

static void *(*next_dlsym)(void *, const char *);
static CUresult (*next_count)(int *); /* the set-up */
static unsigned long n_alloc, n_dlsym, n_gpa;

static void init(void)
{
    if (!next_dlsym) next_dlsym = (void *(*)(void *, const char *))dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
}

/* The driver's functions, from its own handle (a program may have loaded it RTLD_LOCAL). */
static void *driver(const char *name)
{
    init();
    void *h = dlopen("libcuda.so.1", RTLD_LAZY);
    return h ? next_dlsym(h, name) : NULL;
}

static void set_up(void)
{
    if (!next_count) next_count = (CUresult(*)(int *))driver("cuDeviceGetCount");
}

CUresult cuInit(unsigned flags)
{
    set_up();
    CUresult (*next)(unsigned) = (CUresult(*)(unsigned))driver("cuInit");
    return next ? next(flags) : 500;
}

CUresult cuDeviceGetCount(int *n)
{
    if (!next_count) {
        fprintf(stderr, "second: cuDeviceGetCount before its set-up\n");
        abort();
    }
    return next_count(n);
}

CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n)
{
    static CUresult (*next)(CUdeviceptr *, size_t);
    init();
    if (!next) next = (CUresult(*)(CUdeviceptr *, size_t))driver("cuMemAlloc_v2");
    __atomic_add_fetch(&n_alloc, 1, __ATOMIC_RELAXED);
    return next ? next(p, n) : 500;
}

void *dlsym(void *h, const char *name)
{
    init();
    __atomic_add_fetch(&n_dlsym, 1, __ATOMIC_RELAXED);
    if (h == RTLD_NEXT) return next_dlsym(RTLD_NEXT, name);
    if (name[0] == 'c' && name[1] == 'u') set_up(); /* before its first cu* name it is not set up */
    if (!strcmp(name, "cuMemAlloc_v2")) return (void *)cuMemAlloc_v2;
    return next_dlsym(h, name);
}

static void *ours(const char *sym, int ver, void *p)
{
    __atomic_add_fetch(&n_gpa, 1, __ATOMIC_RELAXED);
    return !strcmp(sym, "cuMemAlloc") && ver >= 3020 ? (void *)cuMemAlloc_v2 : p;
}

CUresult cuGetProcAddress(const char *sym, void **pfn, int ver, unsigned long long flags)
{
    static CUresult (*next)(const char *, void **, int, unsigned long long);
    init();
    if (!next) next = (CUresult(*)(const char *, void **, int, unsigned long long))driver("cuGetProcAddress");
    CUresult rc = next ? next(sym, pfn, ver, flags) : 500;
    if (!rc && pfn) *pfn = ours(sym, ver, *pfn);
    return rc;
}

CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int ver, unsigned long long flags, int *st)
{
    static CUresult (*next)(const char *, void **, int, unsigned long long, int *);
    init();
    if (!next)
        next = (CUresult(*)(const char *, void **, int, unsigned long long, int *))driver("cuGetProcAddress_v2");
    CUresult rc = next ? next(sym, pfn, ver, flags, st) : 500;
    if (!rc && pfn) *pfn = ours(sym, ver, *pfn);
    return rc;
}

__attribute__((destructor)) static void report(void)
{
    fprintf(stderr, "second: alloc %lu dlsym %lu gpa %lu\n", n_alloc, n_dlsym, n_gpa);
}
