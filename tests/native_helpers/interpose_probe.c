/* Test caller for the interposer: runs a little script of driver calls given on the command line
 * and prints one line per command ("<cmd> <CUresult> [values]").
 *
 *   interpose_probe [--via direct|dlsym|gpa|gpa2] [--ver N] [--ptds] CMD...
 *
 * --via picks how the driver's functions are reached: linked directly, dlopen + dlsym, or
 * through cuGetProcAddress / _v2 with CUDA version N. Built by tests/test_interposer.py against
 * the simulated driver. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <fcntl.h>
#include <sys/mman.h>

#include "cuda_types.h"
#include "fakegpu.h"

/* What the program links against directly (the --via direct path). */
CUresult cuInit(unsigned int);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuCtxGetDevice(CUdevice *);
CUresult cuGetProcAddress(const char *, void **, int, cuuint64_t);
CUresult cuGetProcAddress_v2(const char *, void **, int, cuuint64_t, int *);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemAllocPitch_v2(CUdeviceptr *, size_t *, size_t, size_t, unsigned int);
CUresult cuMemAllocManaged(CUdeviceptr *, size_t, unsigned int);
CUresult cuMemAllocAsync(CUdeviceptr *, size_t, CUstream);
CUresult cuMemAllocFromPoolAsync(CUdeviceptr *, size_t, CUmemoryPool, CUstream);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemFreeAsync(CUdeviceptr, CUstream);
CUresult cuMemCreate(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
CUresult cuMemRelease(CUmemGenericAllocationHandle);
CUresult cuMemAddressReserve(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
CUresult cuMemAddressFree(CUdeviceptr, size_t);
CUresult cuMemMap(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
CUresult cuMemUnmap(CUdeviceptr, size_t);
CUresult cuArrayCreate_v2(CUarray *, const CUDA_ARRAY_DESCRIPTOR *);
CUresult cuArray3DCreate_v2(CUarray *, const CUDA_ARRAY3D_DESCRIPTOR *);
CUresult cuMipmappedArrayCreate(CUmipmappedArray *, const CUDA_ARRAY3D_DESCRIPTOR *, unsigned int);
CUresult cuArrayDestroy(CUarray);
CUresult cuMipmappedArrayDestroy(CUmipmappedArray);
CUresult cuMemGetInfo_v2(size_t *, size_t *);
CUresult cuDeviceTotalMem_v2(size_t *, CUdevice);
CUresult cuDevicePrimaryCtxReset_v2(CUdevice);
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice);
CUresult cuCtxCreate_v2(CUcontext *, unsigned int, CUdevice);
CUresult cuCtxDestroy_v2(CUcontext);
CUresult cuMemPoolCreate(CUmemoryPool *, const CUmemAllocationProp *);
CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *, CUdevice);
CUresult cuCtxSetLimit(int, size_t);
CUresult cuStreamCreate(CUstream *, unsigned int);
CUresult cuStreamSynchronize(CUstream);
CUresult cuStreamQuery(CUstream);
CUresult cuCtxSynchronize(void);
CUresult cuMemPoolSetAttribute(CUmemoryPool, int, void *);
CUresult cuMemPoolGetAttribute(CUmemoryPool, int, void *);
CUresult cuMemPoolTrimTo(CUmemoryPool, size_t);
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphExec_st *CUgraphExec;
typedef struct CUgraphNode_st *CUgraphNode;
typedef struct {
    CUmemAllocationProp poolProps;
    unsigned char rest[88 - sizeof(CUmemAllocationProp)];
    const void *accessDescs;
    size_t accessDescCount, bytesize;
    CUdeviceptr dptr;
} CUDA_MEM_ALLOC_NODE_PARAMS;
CUresult cuStreamBeginCapture_v2(CUstream, int);
CUresult cuStreamEndCapture(CUstream, CUgraph *);
CUresult cuGraphCreate(CUgraph *, unsigned int);
CUresult cuGraphAddMemAllocNode(CUgraphNode *, CUgraph, const CUgraphNode *, size_t, CUDA_MEM_ALLOC_NODE_PARAMS *);
CUresult cuGraphAddMemFreeNode(CUgraphNode *, CUgraph, const CUgraphNode *, size_t, CUdeviceptr);
CUresult cuGraphInstantiateWithFlags(CUgraphExec *, CUgraph, unsigned long long);
CUresult cuGraphLaunch(CUgraphExec, CUstream);
CUresult cuGraphExecDestroy(CUgraphExec);
CUresult cuDeviceGraphMemTrim(CUdevice);
CUresult cuDeviceGetGraphMemAttribute(CUdevice, int, void *);
/* Resolved when a command needs them (need()), since not every --ver has them. */
CUresult cuGraphInstantiate(CUgraphExec *, CUgraph, CUgraphNode *, char *, size_t);
CUresult cuGraphInstantiate_v2(CUgraphExec *, CUgraph, CUgraphNode *, char *, size_t);
typedef struct { cuuint64_t flags; CUstream upload; CUgraphNode err; int result; } CUDA_GRAPH_INSTANTIATE_PARAMS;
CUresult cuGraphInstantiateWithParams(CUgraphExec *, CUgraph, CUDA_GRAPH_INSTANTIATE_PARAMS *);
CUresult cuGraphUpload(CUgraphExec, CUstream);
CUresult cuGraphExecUpdate_v2(CUgraphExec, CUgraph, void *);
typedef struct {
    int type, reserved0[3];
    union {
        long long reserved1[29];
        CUDA_MEM_ALLOC_NODE_PARAMS alloc;
        struct { CUgraph graph; int ownership; } child;
    } u;
    long long reserved2;
} CUgraphNodeParams;
CUresult cuGraphAddNode(CUgraphNode *, CUgraph, const CUgraphNode *, size_t, CUgraphNodeParams *);
CUresult cuCtxPopCurrent_v2(CUcontext *);
CUresult cuGraphAddChildGraphNode(CUgraphNode *, CUgraph, const CUgraphNode *, size_t, CUgraph);

#define FNS(X)                                                                                     \
    X(cuMemAlloc_v2, "cuMemAlloc") X(cuMemAllocPitch_v2, "cuMemAllocPitch")                        \
    X(cuMemAllocManaged, "cuMemAllocManaged") X(cuMemAllocAsync, "cuMemAllocAsync")                \
    X(cuMemAllocFromPoolAsync, "cuMemAllocFromPoolAsync") X(cuMemFree_v2, "cuMemFree")             \
    X(cuMemFreeAsync, "cuMemFreeAsync") X(cuMemCreate, "cuMemCreate") X(cuMemRelease, "cuMemRelease") \
    X(cuMemMap, "cuMemMap") X(cuMemUnmap, "cuMemUnmap")                                            \
    X(cuArrayCreate_v2, "cuArrayCreate") X(cuArray3DCreate_v2, "cuArray3DCreate")                  \
    X(cuMipmappedArrayCreate, "cuMipmappedArrayCreate") X(cuArrayDestroy, "cuArrayDestroy")        \
    X(cuMipmappedArrayDestroy, "cuMipmappedArrayDestroy") X(cuMemGetInfo_v2, "cuMemGetInfo")       \
    X(cuDeviceTotalMem_v2, "cuDeviceTotalMem") X(cuDevicePrimaryCtxReset_v2, "cuDevicePrimaryCtxReset") \
    X(cuDevicePrimaryCtxRelease_v2, "cuDevicePrimaryCtxRelease") X(cuCtxCreate_v2, "cuCtxCreate")  \
    X(cuCtxDestroy_v2, "cuCtxDestroy") X(cuMemPoolCreate, "cuMemPoolCreate")                       \
    X(cuDeviceGetDefaultMemPool, "cuDeviceGetDefaultMemPool") X(cuCtxSetLimit, "cuCtxSetLimit")      \
    X(cuStreamCreate, "cuStreamCreate") X(cuStreamSynchronize, "cuStreamSynchronize")              \
    X(cuStreamQuery, "cuStreamQuery") X(cuCtxSynchronize, "cuCtxSynchronize")                      \
    X(cuMemPoolSetAttribute, "cuMemPoolSetAttribute") X(cuMemPoolGetAttribute, "cuMemPoolGetAttribute") \
    X(cuMemPoolTrimTo, "cuMemPoolTrimTo") X(cuStreamBeginCapture_v2, "cuStreamBeginCapture")       \
    X(cuStreamEndCapture, "cuStreamEndCapture") X(cuGraphCreate, "cuGraphCreate")                  \
    X(cuGraphAddMemAllocNode, "cuGraphAddMemAllocNode") X(cuGraphAddMemFreeNode, "cuGraphAddMemFreeNode") \
    X(cuGraphInstantiateWithFlags, "cuGraphInstantiateWithFlags") X(cuGraphLaunch, "cuGraphLaunch")         \
    X(cuGraphExecDestroy, "cuGraphExecDestroy") X(cuDeviceGraphMemTrim, "cuDeviceGraphMemTrim")    \
    X(cuDeviceGetGraphMemAttribute, "cuDeviceGetGraphMemAttribute")

#define AS_PTR(sym, base) static __typeof__(&sym) p_##sym;
FNS(AS_PTR)

static const char *via = "direct";
static int ver = 12000, ptds;
static struct fg_header *fake; /* the simulated driver's own state: its count, not ours */
static const char *tag = "";

static void *lookup(void *h, void *direct, const char *versioned, const char *base)
{
    if (!strcmp(via, "direct")) return direct;
    if (!strcmp(via, "dlsym")) return dlsym(h, versioned);
    void *p = NULL;
    CUresult rc;
    if (!strcmp(via, "gpa")) {
        CUresult (*gpa)(const char *, void **, int, cuuint64_t) = dlsym(h, "cuGetProcAddress");
        rc = gpa(base, &p, ver, ptds ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM : 0);
    } else {
        int st = 0;
        CUresult (*gpa2)(const char *, void **, int, cuuint64_t, int *) = dlsym(h, "cuGetProcAddress_v2");
        rc = gpa2(base, &p, ver, ptds ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM : 0, &st);
    }
    return rc == CUDA_SUCCESS ? p : NULL;
}

/* A function resolved the way --via says when a command needs it, at CUDA version v for
 * cuGetProcAddress (the ABI the command calls). */
static void *need(void *direct, const char *versioned, const char *base, int v)
{
    int saved = ver;
    ver = v;
    void *p = lookup(dlopen("libcuda.so.1", RTLD_NOW), direct, versioned, base);
    ver = saved;
    if (!p) { fprintf(stderr, "probe: cannot resolve %s\n", versioned); exit(91); }
    return p;
}
#define NEED(sym, base, v) ((__typeof__(&sym))need((void *)&sym, #sym, base, v))

static void resolve(void)
{
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) { fprintf(stderr, "probe: %s\n", dlerror()); exit(90); }
#define AS_LOOKUP(sym, base)                                                                       \
    p_##sym = (__typeof__(p_##sym))lookup(h, (void *)&sym, #sym, base);                            \
    if (!p_##sym) { fprintf(stderr, "probe: cannot resolve %s\n", #sym); exit(91); }
    FNS(AS_LOOKUP)
    const char *st = getenv("COLO_FAKEGPU_STATE");
    int fd = st ? open(st, O_RDONLY) : -1;
    if (fd >= 0) {
        void *m = mmap(NULL, sizeof *fake, PROT_READ, MAP_SHARED, fd, 0);
        if (m != MAP_FAILED) fake = m;
        close(fd);
    }
}

/* Stack of live allocations so that "free" knows what to call. */
enum { A_PTR, A_ASYNC, A_VMM, A_ARR, A_MIP };
static struct { int kind; uint64_t v, va, size; } live[4096];
static int nlive;
static int cur_dev;
static CUmemoryPool pool; /* "poolnew DEV": later "pool" allocations come from it */
static CUcontext made;    /* "ctxcreate" */
static CUstream stream;   /* "streamnew": later stream-ordered calls use it (NULL: the default stream) */
static CUgraph graph;     /* "graph": the graph later "gnode"/"gfree" add to */
static CUgraphExec gexec; /* "instantiate" */
static CUdeviceptr glast; /* the address of the last graph allocation made */

/* The driver freed everything made in a context: forget it (VMM handles outlive contexts). */
static void forget_ctx_allocs(void)
{
    for (int i = 0; i < nlive;)
        if (live[i].kind != A_VMM) live[i] = live[--nlive];
        else i++;
}

static void push(int kind, uint64_t v, uint64_t va, uint64_t size)
{
    if (nlive < 4096) { live[nlive].kind = kind; live[nlive].v = v; live[nlive].va = va; live[nlive++].size = size; }
}

/* Bytes the simulated driver has handed out on a device, all processes (CUDA_VISIBLE_DEVICES is
 * not set in these tests, so ordinal = physical index). */
static uint64_t fake_used(int dev) { return fake ? __atomic_load_n(&fake->dev[dev].used, __ATOMIC_ACQUIRE) : 0; }

static CUresult free_one(int i)
{
    CUresult rc;
    switch (live[i].kind) {
    case A_ASYNC: rc = p_cuMemFreeAsync(live[i].v, stream); break;
    case A_VMM:
        rc = live[i].va ? p_cuMemUnmap(live[i].va, live[i].size) : CUDA_SUCCESS;
        if (live[i].va) cuMemAddressFree(live[i].va, live[i].size);
        if (live[i].v) { CUresult r2 = p_cuMemRelease(live[i].v); if (!rc) rc = r2; }
        break;
    case A_ARR: rc = p_cuArrayDestroy((CUarray)(uintptr_t)live[i].v); break;
    case A_MIP: rc = p_cuMipmappedArrayDestroy((CUmipmappedArray)(uintptr_t)live[i].v); break;
    default: rc = p_cuMemFree_v2(live[i].v);
    }
    live[i] = live[--nlive];
    return rc;
}

static uint64_t num(const char *s)
{
    char *e;
    double v = strtod(s, &e);
    uint64_t m = *e == 'K' ? 1ULL << 10 : *e == 'M' ? 1ULL << 20 : *e == 'G' ? 1ULL << 30 : 1;
    return (uint64_t)(v * (double)m);
}

static void out(const char *cmd, CUresult rc, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void out(const char *cmd, CUresult rc, const char *fmt, ...)
{
    char extra[256] = "";
    if (fmt) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(extra, sizeof extra, fmt, ap);
        va_end(ap);
    }
    printf("%s%s %d%s%s\n", tag, cmd, rc, *extra ? " " : "", extra);
    fflush(stdout);
}

struct race { int iters; uint64_t size, budget; long ok, oom, bad, other; };

static void *racer(void *arg)
{
    struct race *r = arg;
    CUcontext c;
    cuDevicePrimaryCtxRetain(&c, cur_dev);
    cuCtxSetCurrent(c);
    for (int i = 0; i < r->iters; i++) {
        CUdeviceptr p;
        CUresult rc = p_cuMemAlloc_v2(&p, r->size);
        if (rc == CUDA_ERROR_OUT_OF_MEMORY) { r->oom++; continue; }
        if (rc) { r->other++; continue; }
        r->ok++;
        if (fake_used(cur_dev) > r->budget) r->bad++;
        sched_yield(); /* hold it while others try: the point is to contend */
        if (fake_used(cur_dev) > r->budget) r->bad++;
        p_cuMemFree_v2(p);
    }
    return NULL;
}

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

/* The simulated driver's count of synchronisations and trims this process made (fake only). */
static void fake_counts(unsigned long long *syncs, unsigned long long *trims)
{
    void (*f)(unsigned long long *, unsigned long long *) =
        (void (*)(unsigned long long *, unsigned long long *))dlsym(dlopen("libcuda.so.1", RTLD_NOW), "fakegpuCounts");
    *syncs = *trims = 0;
    if (f) f(syncs, trims);
}

static void note_raw(uint64_t *most) { uint64_t u = fake_used(cur_dev); if (u > *most) *most = u; }

/* Pool traffic until *stop: what a training step's allocator does (forkstorm). */
static void *pool_traffic(void *arg)
{
    volatile int *stop = arg;
    CUcontext c;
    CUstream st;
    cuDevicePrimaryCtxRetain(&c, cur_dev);
    cuCtxSetCurrent(c);
    p_cuStreamCreate(&st, 0);
    while (!*stop) {
        CUdeviceptr p;
        if (!p_cuMemAllocAsync(&p, 1 << 20, st)) p_cuMemFreeAsync(p, st);
        p_cuStreamSynchronize(st);
    }
    return NULL;
}

/* Allocate and free in context *arg until the context is gone (ctxrace); pairs counts the
 * allocations freed, exited the racers that saw it gone. */
struct racer_ctx { CUcontext ctx; uint64_t size; int pairs, exited; };
static void *ctx_racer(void *arg)
{
    struct racer_ctx *r = arg;
    cuCtxSetCurrent(r->ctx);
    for (;;) {
        CUdeviceptr p;
        CUresult rc = p_cuMemAlloc_v2(&p, r->size);
        if (rc == CUDA_ERROR_OUT_OF_MEMORY) continue;
        if (rc) break;
        p_cuMemFree_v2(p);
        __atomic_add_fetch(&r->pairs, 1, __ATOMIC_RELEASE);
    }
    __atomic_add_fetch(&r->exited, 1, __ATOMIC_RELEASE);
    return NULL;
}

/* ctxchurn: THREADS threads, each ROUNDS rounds of: make a context (the simulated driver hands
 * out a destroyed one's address again), publish it, allocate SIZE, set its malloc heap to SIZE or
 * 1.5 SIZE, allocate SIZE again, free the first on odd rounds, then destroy its neighbour's
 * context or its own (whoever takes a published context first destroys it: often while its owner
 * is still allocating or setting the limit in it). primchurn: the same with the primary context,
 * retained and released each round (the last release destroys it, while others retain it again
 * at the same address and allocate) and reset by one thread in four while the others go on
 * allocating in it; both allocations freed before the release, no limit. Every CHECK-th round all
 * threads stop half-way (nothing destroyed yet) and the first compares what the ledger counts with
 * what the driver holds (never less; more only where a limit set on a destroyed context's handle
 * cannot be told from one set on the context made at its address). A free never races the teardown that may have freed its memory already
 * (a write lock around teardowns, a read lock around frees): the driver might have given its
 * address to another thread meanwhile, and the program, not the ledger, would be wrong. */
struct churn {
    int threads, rounds, check, primary;
    uint64_t size, budget;
    CUcontext *slot;
    unsigned resets; /* primchurn: resets so far (under rw) */
    pthread_rwlock_t rw;
    pthread_barrier_t bar;
    int refused, under, over, checks;
    uint64_t worst; /* the most the ledger counted under what the driver held at a check */
};
static struct churn g_churn;
static void churn_destroy(int j)
{
    pthread_rwlock_wrlock(&g_churn.rw);
    CUcontext c = __atomic_exchange_n(&g_churn.slot[j], NULL, __ATOMIC_ACQ_REL);
    if (c) p_cuCtxDestroy_v2(c);
    pthread_rwlock_unlock(&g_churn.rw);
}
/* Free p unless a teardown since may have freed it: its context no longer published (ctxchurn),
 * or a reset after `resets` (primchurn). */
static void churn_free(CUdeviceptr p, int me, CUcontext c, unsigned resets)
{
    pthread_rwlock_rdlock(&g_churn.rw);
    if (g_churn.primary ? g_churn.resets == resets : __atomic_load_n(&g_churn.slot[me], __ATOMIC_ACQUIRE) == c)
        p_cuMemFree_v2(p);
    pthread_rwlock_unlock(&g_churn.rw);
}
static void *churn_thread(void *arg)
{
    struct churn *g = &g_churn;
    int me = (int)(intptr_t)arg;
    unsigned seed = 11u + (unsigned)me;
    for (int k = 0; k < g->rounds; k++) {
        int check = g->check && k % g->check == g->check - 1;
        CUcontext c = NULL, top;
        CUdeviceptr p1 = 0, p2 = 0;
        CUresult a = 1, b = 1, l = 0;
        unsigned resets = __atomic_load_n(&g->resets, __ATOMIC_ACQUIRE);
        int made = g->primary ? !cuDevicePrimaryCtxRetain(&c, cur_dev) : !p_cuCtxCreate_v2(&c, 0, cur_dev);
        if (made && g->primary) {
            if (!cuCtxSetCurrent(c)) a = p_cuMemAlloc_v2(&p1, g->size), b = p_cuMemAlloc_v2(&p2, g->size);
        } else if (made) {
            __atomic_store_n(&g->slot[me], c, __ATOMIC_RELEASE);
            a = p_cuMemAlloc_v2(&p1, g->size);
            l = p_cuCtxSetLimit(2 /* CU_LIMIT_MALLOC_HEAP_SIZE */, g->size + (rand_r(&seed) % 2) * (g->size / 2));
            b = p_cuMemAlloc_v2(&p2, g->size);
        }
        if (a == CUDA_ERROR_OUT_OF_MEMORY || l == CUDA_ERROR_OUT_OF_MEMORY || b == CUDA_ERROR_OUT_OF_MEMORY)
            __atomic_add_fetch(&g->refused, 1, __ATOMIC_RELAXED);
        if (!a && (g->primary || k % 2)) churn_free(p1, me, c, resets);
        if (!b && g->primary && !check) churn_free(p2, me, c, resets), b = 1;
        if (check) {
            if (pthread_barrier_wait(&g->bar) == PTHREAD_BARRIER_SERIAL_THREAD) {
                size_t f = 0, t = 0;
                p_cuMemGetInfo_v2(&f, &t);
                uint64_t counted = g->budget - f, held = fake_used(cur_dev);
                if (counted < held) g->under++;
                if (counted > held) g->over++;
                if (held > counted && held - counted > g->worst) g->worst = held - counted;
                g->checks++;
            }
            pthread_barrier_wait(&g->bar);
        }
        if (g->primary) {
            if (!b) churn_free(p2, me, c, resets); /* held over the check */
            if (made && rand_r(&seed) % 4 == 0) {
                pthread_rwlock_wrlock(&g->rw);
                p_cuDevicePrimaryCtxReset_v2(cur_dev);
                g->resets++;
                pthread_rwlock_unlock(&g->rw);
            }
            if (made) p_cuDevicePrimaryCtxRelease_v2(cur_dev);
            continue;
        }
        churn_destroy(rand_r(&seed) % 2 ? (me + 1) % g->threads : me);
        churn_destroy(me);
        while (!cuCtxPopCurrent_v2(&top)) {} /* made current by its creation; maybe destroyed since */
    }
    return NULL;
}

static int run(int argc, char **argv, int i);

int main(int argc, char **argv)
{
    int i = 1;
    for (; i < argc && !strncmp(argv[i], "--", 2); i++) {
        if (!strcmp(argv[i], "--via")) via = argv[++i];
        else if (!strcmp(argv[i], "--ver")) ver = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--ptds")) ptds = 1;
    }
    resolve();
    return run(argc, argv, i);
}

static int run(int argc, char **argv, int i)
{
    for (; i < argc; i++) {
        const char *c = argv[i];
        CUresult rc;
        if (!strcmp(c, "init")) {
            cur_dev = (i + 1 < argc && argv[i + 1][0] >= '0' && argv[i + 1][0] <= '9') ? atoi(argv[++i]) : 0;
            CUcontext ctx;
            rc = cuInit(0);
            if (!rc) rc = cuDevicePrimaryCtxRetain(&ctx, cur_dev);
            if (!rc) rc = cuCtxSetCurrent(ctx);
            out(c, rc, NULL);
        } else if (!strcmp(c, "alloc") || !strcmp(c, "managed") || !strcmp(c, "async") || !strcmp(c, "pool")) {
            uint64_t n = num(argv[++i]);
            CUdeviceptr p = 0;
            CUmemoryPool from = pool;
            if (!from) p_cuDeviceGetDefaultMemPool(&from, cur_dev);
            rc = !strcmp(c, "alloc") ? p_cuMemAlloc_v2(&p, n)
                 : !strcmp(c, "managed") ? p_cuMemAllocManaged(&p, n, 1)
                 : !strcmp(c, "async") ? p_cuMemAllocAsync(&p, n, stream)
                                       : p_cuMemAllocFromPoolAsync(&p, n, from, stream);
            if (!rc) push(!strcmp(c, "alloc") || !strcmp(c, "managed") ? A_PTR : A_ASYNC, p, 0, n);
            out(c, rc, NULL);
        } else if (!strcmp(c, "pitch")) {
            uint64_t w = num(argv[++i]), h = num(argv[++i]);
            CUdeviceptr p = 0;
            size_t pitch = 0;
            rc = p_cuMemAllocPitch_v2(&p, &pitch, w, h, 4);
            if (!rc) push(A_PTR, p, 0, pitch * h);
            out(c, rc, "%zu", pitch);
        } else if (!strcmp(c, "create") || !strcmp(c, "vmm")) {
            /* create: a bare handle; vmm: handle mapped into a reserved range, handle released. */
            uint64_t n = num(argv[++i]);
            CUmemAllocationProp prop = {.type = 1, .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = cur_dev}};
            CUmemGenericAllocationHandle h = 0;
            rc = p_cuMemCreate(&h, n, &prop, 0);
            uint64_t va = 0;
            if (!rc && !strcmp(c, "vmm")) {
                CUdeviceptr a = 0;
                rc = cuMemAddressReserve(&a, n, 0, 0, 0);
                if (!rc) rc = p_cuMemMap(a, n, 0, h, 0);
                if (!rc) rc = p_cuMemRelease(h);
                if (!rc) { va = a; h = 0; }
            }
            if (!rc) push(A_VMM, h, va, n);
            out(c, rc, NULL);
        } else if (!strcmp(c, "array") || !strcmp(c, "array3d") || !strcmp(c, "mipmap")) {
            uint64_t w = num(argv[++i]), h = num(argv[++i]);
            if (!strcmp(c, "array")) {
                CUDA_ARRAY_DESCRIPTOR d = {.Width = w, .Height = h, .Format = 0x20, .NumChannels = 1};
                CUarray a = NULL;
                rc = p_cuArrayCreate_v2(&a, &d);
                if (!rc) push(A_ARR, (uintptr_t)a, 0, 0);
            } else {
                uint64_t z = num(argv[++i]);
                CUDA_ARRAY3D_DESCRIPTOR d = {.Width = w, .Height = h, .Depth = z, .Format = 0x20, .NumChannels = 1};
                if (!strcmp(c, "array3d")) {
                    CUarray a = NULL;
                    rc = p_cuArray3DCreate_v2(&a, &d);
                    if (!rc) push(A_ARR, (uintptr_t)a, 0, 0);
                } else {
                    CUmipmappedArray m = NULL;
                    rc = p_cuMipmappedArrayCreate(&m, &d, (unsigned)num(argv[++i]));
                    if (!rc) push(A_MIP, (uintptr_t)m, 0, 0);
                }
            }
            out(c, rc, NULL);
        } else if (!strcmp(c, "free")) {
            out(c, nlive ? free_one(nlive - 1) : CUDA_ERROR_INVALID_VALUE, NULL);
        } else if (!strcmp(c, "freeall")) {
            rc = 0;
            while (nlive) { CUresult r = free_one(nlive - 1); if (!rc) rc = r; }
            out(c, rc, NULL);
        } else if (!strcmp(c, "info")) {
            size_t f = 0, t = 0;
            rc = p_cuMemGetInfo_v2(&f, &t);
            out(c, rc, "%zu %zu", f, t);
        } else if (!strcmp(c, "rawused")) {
            out(c, fake ? 0 : CUDA_ERROR_NOT_FOUND, "%llu", (unsigned long long)fake_used(cur_dev));
        } else if (!strcmp(c, "infos")) {
            /* infos N: N capacity views; answers the first error and the last view */
            int n = (int)num(argv[++i]);
            size_t f = 0, t = 0;
            rc = 0;
            for (int k = 0; k < n && !rc; k++) rc = p_cuMemGetInfo_v2(&f, &t);
            out(c, rc, "%zu %zu", f, t);
        } else if (!strcmp(c, "total")) {
            size_t t = 0;
            rc = p_cuDeviceTotalMem_v2(&t, cur_dev);
            out(c, rc, "%zu", t);
        } else if (!strcmp(c, "null")) {
            /* Every entry point with NULL where the driver rejects it: codes must be CUresults. */
            size_t f;
            CUmemAllocationProp prop = {.type = 1, .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0}};
            CUDA_ARRAY_DESCRIPTOR d = {.Width = 4, .Height = 4, .Format = 0x20, .NumChannels = 1};
            CUDA_ARRAY3D_DESCRIPTOR d3 = {.Width = 4, .Height = 4, .Depth = 4, .Format = 0x20, .NumChannels = 1};
            printf("%snull", tag);
            printf(" %d", p_cuMemAlloc_v2(NULL, 1024));
            printf(" %d", p_cuMemAllocPitch_v2(NULL, NULL, 64, 64, 4));
            printf(" %d", p_cuMemAllocManaged(NULL, 1024, 1));
            printf(" %d", p_cuMemAllocAsync(NULL, 1024, NULL));
            printf(" %d", p_cuMemAllocFromPoolAsync(NULL, 1024, NULL, NULL));
            printf(" %d", p_cuMemCreate(NULL, 1 << 21, &prop, 0));
            printf(" %d", p_cuMemCreate((CUmemGenericAllocationHandle *)&f, 1 << 21, NULL, 0));
            printf(" %d", p_cuArrayCreate_v2(NULL, &d));
            printf(" %d", p_cuArrayCreate_v2((CUarray *)&f, NULL));
            printf(" %d", p_cuArray3DCreate_v2(NULL, &d3));
            printf(" %d", p_cuMipmappedArrayCreate(NULL, &d3, 2));
            printf(" %d", p_cuMemGetInfo_v2(NULL, &f));
            printf(" %d", p_cuMemGetInfo_v2(&f, NULL));
            printf(" %d", p_cuDeviceTotalMem_v2(NULL, 0));
            printf(" %d", p_cuMemFree_v2(0));
            printf(" %d", p_cuMemFreeAsync(0, NULL));
            printf(" %d", p_cuArrayDestroy(NULL));
            printf(" %d", p_cuMipmappedArrayDestroy(NULL));
            printf(" %d", p_cuMemRelease(0));
            printf("\n");
            fflush(stdout);
        } else if (!strcmp(c, "which")) {
            /* Which library answers cuGetProcAddress(NAME, VER, FLAGS)? "interpose" or "driver". */
            const char *name = argv[++i];
            int v = atoi(argv[++i]);
            int fl = atoi(argv[++i]);
            void *h = dlopen("libcuda.so.1", RTLD_NOW);
            void *p = NULL;
            int st = 0;
            CUresult (*gpa2)(const char *, void **, int, cuuint64_t, int *) = dlsym(h, "cuGetProcAddress_v2");
            CUresult (*gpa)(const char *, void **, int, cuuint64_t) = dlsym(h, "cuGetProcAddress");
            rc = !strcmp(via, "gpa2") ? gpa2(name, &p, v, (cuuint64_t)fl, &st) : gpa(name, &p, v, (cuuint64_t)fl);
            Dl_info info = {0};
            if (p) dladdr(p, &info);
            out(c, rc, "%s %s %s", name, info.dli_fname && strstr(info.dli_fname, "libcolo-interpose") ? "interpose" : "driver",
                info.dli_sname ? info.dli_sname : "?");
        } else if (!strcmp(c, "loop")) {
            int n = (int)num(argv[++i]);
            uint64_t size = num(argv[++i]);
            long ok = 0, oom = 0;
            double t0 = now();
            for (int k = 0; k < n; k++) {
                CUdeviceptr p;
                rc = p_cuMemAlloc_v2(&p, size);
                if (!rc) { ok++; p_cuMemFree_v2(p); } else oom++;
            }
            out(c, 0, "%ld %ld %.1f", ok, oom, (now() - t0) * 1e9 / (n ? n : 1));
        } else if (!strcmp(c, "race")) {
            int nt = atoi(argv[++i]);
            struct race r[64] = {0};
            pthread_t th[64];
            int iters = atoi(argv[++i]);
            uint64_t size = num(argv[++i]), budget = num(argv[++i]);
            for (int t = 0; t < nt && t < 64; t++) {
                r[t].iters = iters; r[t].size = size; r[t].budget = budget;
                pthread_create(&th[t], NULL, racer, &r[t]);
            }
            long ok = 0, oom = 0, bad = 0, other = 0;
            for (int t = 0; t < nt && t < 64; t++) {
                pthread_join(th[t], NULL);
                ok += r[t].ok; oom += r[t].oom; bad += r[t].bad; other += r[t].other;
            }
            out(c, 0, "%ld %ld %ld %ld", ok, oom, bad, other);
        } else if (!strcmp(c, "reset") || !strcmp(c, "release")) {
            /* Primary context teardown; "release" drops the one retain "init" made. Then the
             * context is made current again (retained anew after a release). */
            CUcontext ctx;
            rc = !strcmp(c, "reset") ? p_cuDevicePrimaryCtxReset_v2(cur_dev) : p_cuDevicePrimaryCtxRelease_v2(cur_dev);
            if (!rc) forget_ctx_allocs();
            if (!rc) rc = cuDevicePrimaryCtxRetain(&ctx, cur_dev);
            if (!rc) rc = cuCtxSetCurrent(ctx);
            out(c, rc, NULL);
        } else if (!strcmp(c, "ctxcreate")) {
            rc = p_cuCtxCreate_v2(&made, 0, cur_dev); /* becomes current */
            out(c, rc, NULL);
        } else if (!strcmp(c, "ctxdestroy")) {
            rc = p_cuCtxDestroy_v2(made);
            if (!rc) forget_ctx_allocs();
            CUcontext ctx;
            if (!rc) rc = cuDevicePrimaryCtxRetain(&ctx, cur_dev);
            if (!rc) rc = cuCtxSetCurrent(ctx);
            out(c, rc, NULL);
        } else if (!strcmp(c, "poolnew") || !strcmp(c, "pooldefault")) {
            int d = atoi(argv[++i]);
            CUmemAllocationProp prop = {.type = 1, .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = d}};
            rc = !strcmp(c, "poolnew") ? p_cuMemPoolCreate(&pool, &prop) : p_cuDeviceGetDefaultMemPool(&pool, d);
            out(c, rc, NULL);
        } else if (!strcmp(c, "lose")) {
            /* The driver frees the last allocation behind the interposer's back (fake only). */
            CUresult (*lose)(CUdeviceptr) = (CUresult(*)(CUdeviceptr))dlsym(dlopen("libcuda.so.1", RTLD_NOW), "fakegpuLoseAllocation");
            rc = lose && nlive ? lose(live[nlive - 1].v) : CUDA_ERROR_NOT_FOUND;
            if (!rc) nlive--;
            out(c, rc, NULL);
        } else if (!strcmp(c, "limit")) {
            int which = atoi(argv[++i]);
            rc = p_cuCtxSetLimit(which, (size_t)num(argv[++i]));
            out(c, rc, NULL);
        } else if (!strcmp(c, "dlsym")) {
            const char *name = argv[++i];
            void *f = dlsym(dlopen("libcuda.so.1", RTLD_NOW), name);
            out(c, f ? 0 : CUDA_ERROR_NOT_FOUND, "%s", name);
        } else if (!strcmp(c, "many")) {
            /* N allocations kept (not freed); answers the first error (0: none) and how many. */
            int n = (int)num(argv[++i]), k = 0;
            uint64_t size = num(argv[++i]);
            rc = 0;
            for (; k < n; k++) {
                CUdeviceptr p;
                if ((rc = p_cuMemAlloc_v2(&p, size))) break;
                push(A_PTR, p, 0, size);
            }
            out(c, rc, "%d", k);
        } else if (!strcmp(c, "rawused1")) {
            out(c, fake ? 0 : CUDA_ERROR_NOT_FOUND, "%llu", (unsigned long long)fake_used(1));
        } else if (!strcmp(c, "serve")) {
            /* One line per request on stdin, "N SIZE": N alloc+free pairs; answers "serve <rc>"
             * (the first error, or 0). Ends at EOF. */
            char line[64];
            while (fgets(line, sizeof line, stdin)) {
                int n = 0;
                char sz[32] = "1M";
                if (sscanf(line, "%d %31s", &n, sz) < 1) break;
                uint64_t size = num(sz);
                rc = 0;
                for (int k = 0; k < n && !rc; k++) {
                    CUdeviceptr p;
                    rc = p_cuMemAlloc_v2(&p, size);
                    if (!rc) rc = p_cuMemFree_v2(p);
                }
                out(c, rc, NULL);
            }
        } else if (!strcmp(c, "streamnew")) {
            out(c, p_cuStreamCreate(&stream, 0), NULL);
        } else if (!strcmp(c, "sync")) {
            out(c, p_cuStreamSynchronize(stream), NULL);
        } else if (!strcmp(c, "query")) {
            out(c, p_cuStreamQuery(stream), NULL);
        } else if (!strcmp(c, "ctxsync")) {
            out(c, p_cuCtxSynchronize(), NULL);
        } else if (!strcmp(c, "afree")) {
            /* cuMemFreeAsync of the last allocation, whatever made it, on the current stream */
            rc = nlive ? p_cuMemFreeAsync(live[nlive - 1].v, stream) : CUDA_ERROR_INVALID_VALUE;
            if (nlive) nlive--;
            out(c, rc, NULL);
        } else if (!strcmp(c, "threshold") || !strcmp(c, "trim") || !strcmp(c, "reserved")) {
            /* on the pool "pool" uses (poolnew/pooldefault), else device cur_dev's default pool */
            CUmemoryPool pl = pool;
            if (!pl) p_cuDeviceGetDefaultMemPool(&pl, cur_dev);
            cuuint64_t v = 0;
            if (!strcmp(c, "reserved")) {
                rc = p_cuMemPoolGetAttribute(pl, 5 /* RESERVED_MEM_CURRENT */, &v);
                out(c, rc, "%llu", (unsigned long long)v);
            } else {
                v = num(argv[++i]);
                rc = !strcmp(c, "trim") ? p_cuMemPoolTrimTo(pl, v) : p_cuMemPoolSetAttribute(pl, 4 /* RELEASE_THRESHOLD */, &v);
                out(c, rc, NULL);
            }
        } else if (!strcmp(c, "graph")) {
            out(c, p_cuGraphCreate(&graph, 0), NULL);
        } else if (!strcmp(c, "gnode") || !strcmp(c, "gnodeon")) {
            /* an alloc node on the current device, or (gnodeon DEV SIZE) on device DEV */
            int dev = !strcmp(c, "gnodeon") ? atoi(argv[++i]) : cur_dev;
            CUDA_MEM_ALLOC_NODE_PARAMS prm = {.poolProps = {.type = 1, .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = dev}},
                                              .bytesize = num(argv[++i])};
            CUgraphNode node;
            rc = p_cuGraphAddMemAllocNode(&node, graph, NULL, 0, &prm);
            if (!rc) glast = prm.dptr;
            out(c, rc, NULL);
        } else if (!strcmp(c, "gfree")) {
            CUgraphNode node;
            out(c, p_cuGraphAddMemFreeNode(&node, graph, NULL, 0, glast), NULL);
        } else if (!strcmp(c, "capture")) {
            out(c, p_cuStreamBeginCapture_v2(stream, 0), NULL);
        } else if (!strcmp(c, "capalloc")) {
            /* cuMemAllocAsync on the capturing stream: an alloc node of the captured graph */
            rc = p_cuMemAllocAsync(&glast, num(argv[++i]), stream);
            out(c, rc, NULL);
        } else if (!strcmp(c, "endcapture")) {
            out(c, p_cuStreamEndCapture(stream, &graph), NULL);
        } else if (!strcmp(c, "instantiate")) {
            out(c, p_cuGraphInstantiateWithFlags(&gexec, graph, 0), NULL);
        } else if (!strcmp(c, "instantiate1") || !strcmp(c, "instantiate2")) {
            /* the CUDA 10 and 11 ABIs: cuGraphInstantiate, cuGraphInstantiate_v2 */
            char log[64];
            CUgraphNode err = NULL;
            rc = c[11] == '1' ? NEED(cuGraphInstantiate, "cuGraphInstantiate", 10000)(&gexec, graph, &err, log, sizeof log)
                              : NEED(cuGraphInstantiate_v2, "cuGraphInstantiate", 11040)(&gexec, graph, &err, log, sizeof log);
            out(c, rc, NULL);
        } else if (!strcmp(c, "instparams")) {
            /* cuGraphInstantiateWithParams with FLAGS (2: upload on the current stream) */
            CUDA_GRAPH_INSTANTIATE_PARAMS prm = {.flags = num(argv[++i]), .upload = stream};
            rc = NEED(cuGraphInstantiateWithParams, "cuGraphInstantiateWithParams", 12000)(&gexec, graph, &prm);
            out(c, rc, NULL);
        } else if (!strcmp(c, "upload")) {
            out(c, NEED(cuGraphUpload, "cuGraphUpload", 12000)(gexec, stream), NULL);
        } else if (!strcmp(c, "update")) {
            /* the instantiated graph takes the current graph's parameters */
            out(c, NEED(cuGraphExecUpdate_v2, "cuGraphExecUpdate", 12000)(gexec, graph, NULL), NULL);
        } else if (!strcmp(c, "addnode")) {
            /* an alloc node made through the generic cuGraphAddNode (CUDA 12.2) */
            CUgraphNodeParams prm = {.type = 10};
            prm.u.alloc.poolProps = (CUmemAllocationProp){.type = 1, .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = cur_dev}};
            prm.u.alloc.bytesize = num(argv[++i]);
            CUgraphNode node;
            rc = NEED(cuGraphAddNode, "cuGraphAddNode", 12020)(&node, graph, NULL, 0, &prm);
            if (!rc) glast = prm.u.alloc.dptr;
            out(c, rc, NULL);
        } else if (!strcmp(c, "childmove") || !strcmp(c, "childclone")) {
            /* The current graph becomes a child node of a new graph, which becomes the current one:
             * moved into it (cuGraphAddNode, ownership MOVE), or cloned (cuGraphAddChildGraphNode) */
            CUgraph parent;
            CUgraphNode node;
            rc = p_cuGraphCreate(&parent, 0);
            if (!rc && c[5] == 'm') {
                CUgraphNodeParams prm = {.type = 4};
                prm.u.child.graph = graph;
                prm.u.child.ownership = 1;
                rc = NEED(cuGraphAddNode, "cuGraphAddNode", 12020)(&node, parent, NULL, 0, &prm);
            } else if (!rc) {
                rc = NEED(cuGraphAddChildGraphNode, "cuGraphAddChildGraphNode", 12000)(&node, parent, NULL, 0, graph);
            }
            if (!rc) graph = parent;
            out(c, rc, NULL);
        } else if (!strcmp(c, "launch")) {
            out(c, p_cuGraphLaunch(gexec, stream), NULL);
        } else if (!strcmp(c, "gfreeout")) {
            /* the graph's allocation it left live, freed outside the graph */
            out(c, p_cuMemFreeAsync(glast, stream), NULL);
        } else if (!strcmp(c, "gtrim")) {
            out(c, p_cuDeviceGraphMemTrim(cur_dev), NULL);
        } else if (!strcmp(c, "greserved")) {
            cuuint64_t v = 0;
            rc = p_cuDeviceGetGraphMemAttribute(cur_dev, 2 /* RESERVED_MEM_CURRENT */, &v);
            out(c, rc, "%llu", (unsigned long long)v);
        } else if (!strcmp(c, "execdestroy")) {
            out(c, p_cuGraphExecDestroy(gexec), NULL);
        } else if (!strcmp(c, "instflags")) {
            /* cuGraphInstantiateWithFlags with FLAGS (1: AUTO_FREE_ON_LAUNCH) */
            out(c, p_cuGraphInstantiateWithFlags(&gexec, graph, num(argv[++i])), NULL);
        } else if (!strcmp(c, "replay")) {
            /* replay N SYNC: N launches of the instantiated graph (a sync after each when SYNC is
             * 1); answers the first error, how many ran, how many were refused, the most the
             * driver held */
            int n = (int)num(argv[++i]), sync = atoi(argv[++i]), ran = 0, refused = 0;
            uint64_t most = 0;
            rc = 0;
            for (int k = 0; k < n; k++) {
                CUresult r = p_cuGraphLaunch(gexec, stream);
                note_raw(&most);
                if (r == CUDA_SUCCESS) ran++;
                else if (r == CUDA_ERROR_OUT_OF_MEMORY) refused++;
                if (r && !rc) rc = r;
                if (sync) p_cuStreamSynchronize(stream);
            }
            out(c, rc, "%d %d %llu", ran, refused, (unsigned long long)most);
        } else if (!strcmp(c, "counts")) {
            unsigned long long sy, tr;
            fake_counts(&sy, &tr);
            out(c, 0, "%llu %llu", sy, tr);
        } else if (!strcmp(c, "poolloop")) {
            /* poolloop N SIZE SYNC: N steps of an allocation of SIZE from the current pool on the
             * current stream and its free (a sync after each when SYNC is 1); answers the first
             * error, the refusals, the most the driver held */
            int n = (int)num(argv[++i]), refused = 0;
            uint64_t size = num(argv[++i]), most = 0;
            int sync = atoi(argv[++i]);
            rc = 0;
            for (int k = 0; k < n; k++) {
                CUdeviceptr p;
                CUresult r = p_cuMemAllocAsync(&p, size, stream);
                note_raw(&most);
                if (r == CUDA_ERROR_OUT_OF_MEMORY) refused++;
                else if (!r) p_cuMemFreeAsync(p, stream);
                if (r && !rc) rc = r;
                if (sync) p_cuStreamSynchronize(stream);
            }
            out(c, rc, "%d %llu", refused, (unsigned long long)most);
        } else if (!strcmp(c, "pools")) {
            /* pools N SIZE: N pools on the current device, each keeping everything (release
             * threshold: all) after an allocation of SIZE was made from it and freed; answers the
             * first error, the pools made, the most the driver held at any step */
            int n = (int)num(argv[++i]), made = 0;
            uint64_t size = num(argv[++i]), most = 0, keep = UINT64_MAX;
            rc = 0;
            for (int k = 0; k < n && !rc; k++) {
                CUmemAllocationProp prop = {.type = 1, .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = cur_dev}};
                CUmemoryPool pl;
                CUdeviceptr p;
                if ((rc = p_cuMemPoolCreate(&pl, &prop))) break;
                made++;
                p_cuMemPoolSetAttribute(pl, 4 /* RELEASE_THRESHOLD */, &keep);
                rc = p_cuMemAllocFromPoolAsync(&p, size, pl, stream);
                note_raw(&most);
                if (!rc) rc = p_cuMemFreeAsync(p, stream);
                p_cuStreamSynchronize(stream);
                note_raw(&most);
            }
            out(c, rc, "%d %llu", made, (unsigned long long)most);
        } else if (!strcmp(c, "forkstorm")) {
            /* forkstorm N: N children forked while two other threads make pool traffic; each child
             * makes one pool allocation of its own and exits. Answers how many hung (not done in
             * 10 s: killed) and how many exited 0. */
            int n = (int)num(argv[++i]), hung = 0, fine = 0;
            volatile int stop = 0;
            pthread_t th[2];
            for (int t = 0; t < 2; t++) pthread_create(&th[t], NULL, pool_traffic, (void *)&stop);
            for (int k = 0; k < n; k++) {
                fflush(stdout);
                pid_t pid = fork();
                if (pid == 0) {
                    CUcontext cx;
                    CUdeviceptr p;
                    CUmemoryPool pl;
                    int bad = cuInit(0) || cuDevicePrimaryCtxRetain(&cx, cur_dev) || cuCtxSetCurrent(cx) ||
                              p_cuDeviceGetDefaultMemPool(&pl, cur_dev) || p_cuMemAllocAsync(&p, 1 << 20, NULL) ||
                              p_cuMemFreeAsync(p, NULL) || p_cuCtxSynchronize();
                    _exit(bad);
                }
                int st = 0, done = 0;
                for (int w = 0; w < 1000 && !done; w++) {
                    done = waitpid(pid, &st, WNOHANG) == pid;
                    if (!done) usleep(10000);
                }
                if (!done) {
                    hung++;
                    kill(pid, SIGKILL);
                    waitpid(pid, &st, 0);
                } else if (WIFEXITED(st) && WEXITSTATUS(st) == 0) {
                    fine++;
                }
            }
            stop = 1;
            for (int t = 0; t < 2; t++) pthread_join(th[t], NULL);
            out(c, 0, "%d %d", hung, fine);
        } else if (!strcmp(c, "ctxrace")) {
            /* ctxrace ROUNDS THREADS SIZE: each round, THREADS threads allocate and free SIZE in a
             * context of their own while this thread destroys it */
            int rounds = (int)num(argv[++i]), nt = atoi(argv[++i]);
            uint64_t size = num(argv[++i]);
            pthread_t th[64];
            unsigned seed = 7;
            rc = 0;
            if (nt > 64) nt = 64;
            for (int k = 0; k < rounds && !rc; k++) {
                CUcontext mine;
                struct racer_ctx r = {.size = size};
                if ((rc = p_cuCtxCreate_v2(&r.ctx, 0, cur_dev))) break;
                cuCtxPopCurrent_v2(&mine);
                for (int t = 0; t < nt; t++) pthread_create(&th[t], NULL, ctx_racer, &r);
                /* destroy it once the racers have done a random number of pairs (0: at once), so
                 * that a busy machine slows a round no more than the work it holds */
                int want = (int)(rand_r(&seed) % 24);
                while (__atomic_load_n(&r.pairs, __ATOMIC_ACQUIRE) < want && __atomic_load_n(&r.exited, __ATOMIC_ACQUIRE) < nt)
                    sched_yield();
                rc = p_cuCtxDestroy_v2(r.ctx);
                for (int t = 0; t < nt; t++) pthread_join(th[t], NULL);
            }
            out(c, rc, NULL);
        } else if (!strcmp(c, "ctxchurn") || !strcmp(c, "primchurn")) {
            /* ctxchurn|primchurn THREADS ROUNDS SIZE CHECK BUDGET: see churn_thread; answers refused
             * allocations, checks, checks where the ledger counted less than the driver held and
             * where more, the most it counted less */
            struct churn *g = &g_churn;
            *g = (struct churn){.threads = atoi(argv[++i]), .rounds = atoi(argv[++i]), .primary = c[0] == 'p'};
            if (g->primary) cuInit(0);
            g->size = num(argv[++i]);
            g->check = atoi(argv[++i]);
            g->budget = num(argv[++i]);
            if (g->threads < 1 || g->threads > 64) g->threads = 1;
            CUcontext slots[64] = {0};
            pthread_t th[64];
            g->slot = slots;
            pthread_barrier_init(&g->bar, NULL, (unsigned)g->threads);
            pthread_rwlock_init(&g->rw, NULL);
            for (int t = 0; t < g->threads; t++) pthread_create(&th[t], NULL, churn_thread, (void *)(intptr_t)t);
            for (int t = 0; t < g->threads; t++) pthread_join(th[t], NULL);
            pthread_barrier_destroy(&g->bar);
            out(c, 0, "%d %d %d %d %llu", g->refused, g->checks, g->under, g->over, (unsigned long long)g->worst);
        } else if (!strcmp(c, "deep")) {
            /* deep LIB SIZE: LIB dlopened with RTLD_DEEPBIND allocates SIZE by calling cuMemAlloc_v2,
             * then through its own dlsym; answers both codes and who answered its dlsym */
            void *h = dlopen(argv[++i], RTLD_NOW | RTLD_DEEPBIND);
            uint64_t size = num(argv[++i]);
            CUresult (*direct)(CUdeviceptr *, size_t) = h ? (CUresult(*)(CUdeviceptr *, size_t))dlsym(h, "deep_alloc") : NULL;
            CUresult (*viadl)(CUdeviceptr *, size_t) = h ? (CUresult(*)(CUdeviceptr *, size_t))dlsym(h, "deep_dlsym_alloc") : NULL;
            const char *(*who)(void) = h ? (const char *(*)(void))dlsym(h, "deep_dlsym_who") : NULL;
            if (!direct || !viadl || !who) { fprintf(stderr, "probe: %s\n", dlerror()); exit(92); }
            CUdeviceptr p = 0, q = 0;
            CUresult a = direct(&p, size), b = viadl(&q, size);
            if (!a) push(A_PTR, p, 0, size);
            if (!b) push(A_PTR, q, 0, size);
            out(c, 0, "%d %d %s", a, b, who());
        } else if (!strcmp(c, "ctxdevice")) {
            /* a driver function the interposer does not wrap, called as a program linked to
             * libcuda calls it (the symbol, whatever --via says) */
            CUdevice d = -1;
            rc = cuCtxGetDevice(&d);
            out(c, rc, "%d", d);
        } else if (!strcmp(c, "ready")) {
            out(c, 0, NULL); /* the test reads this line, then acts */
        } else if (!strcmp(c, "wait")) {
            char line[16];
            if (!fgets(line, sizeof line, stdin)) {}
        } else if (!strcmp(c, "fork")) {
            /* The child runs the commands up to "--parent" and exits; the parent waits for it,
             * then runs what follows. */
            int j = i + 1;
            while (j < argc && strcmp(argv[j], "--parent")) j++;
            fflush(stdout);
            pid_t pid = fork();
            if (pid == 0) { tag = "child "; int r = run(j, argv, i + 1); fflush(stdout); _exit(r); }
            int st = 0;
            waitpid(pid, &st, 0);
            out(c, 0, "%d", WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st));
            i = j;
        } else if (!strcmp(c, "exit")) {
            fflush(stdout);
            _exit(0); /* without freeing: the driver and the ledger must cope */
        } else {
            fprintf(stderr, "probe: unknown command %s\n", c);
            return 2;
        }
    }
    return 0;
}
