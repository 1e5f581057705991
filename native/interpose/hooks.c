/* The CUDA driver API and NVML entry points that colo's memory budget needs, and the three ways
 * a program can reach them: direct linking (these exported names), dlopen + dlsym (our dlsym),
 * and cuGetProcAddress / _v2 (we look at what the driver returned and wrap it when it is one of
 * ours). Everything else passes straight through, and with no COLO_GPU_BUDGET nothing changes. */
#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "ctxid.h"
#include "cuda_types.h"
#include "gotpatch.h"
#include "ledger.h"
#include "pools.h"
#include "table.h"

#define EXPORT __attribute__((visibility("default")))

/* Hooked entry points: X(name, family) with family 'c' (libcuda) or 'n' (libnvidia-ml). */
#define HOOKS(X)                                                                                   \
    X(cuGetProcAddress, c) X(cuGetProcAddress_v2, c)                                               \
    X(cuMemAlloc, c) X(cuMemAlloc_v2, c) X(cuMemAllocPitch, c) X(cuMemAllocPitch_v2, c)            \
    X(cuMemAllocManaged, c) X(cuMemAllocAsync, c) X(cuMemAllocAsync_ptsz, c)                       \
    X(cuMemAllocFromPoolAsync, c) X(cuMemAllocFromPoolAsync_ptsz, c)                               \
    X(cuMemFree, c) X(cuMemFree_v2, c) X(cuMemFreeAsync, c) X(cuMemFreeAsync_ptsz, c)              \
    X(cuMemCreate, c) X(cuMemRelease, c) X(cuMemMap, c) X(cuMemUnmap, c)                           \
    X(cuMemRetainAllocationHandle, c) X(cuMemExportToShareableHandle, c)                           \
    X(cuMemImportFromShareableHandle, c) X(cuModuleLoad, c) X(cuModuleLoadData, c)                  \
    X(cuModuleLoadDataEx, c) X(cuModuleLoadFatBinary, c) X(cuModuleUnload, c) X(cuLibraryLoadData, c) \
    X(cuLibraryLoadFromFile, c) X(cuLibraryUnload, c) X(cuEventRecord, c) X(cuEventRecord_ptsz, c) \
    X(cuEventRecordWithFlags, c) X(cuEventRecordWithFlags_ptsz, c) X(cuEventSynchronize, c)         \
    X(cuEventQuery, c) X(cuEventDestroy, c) X(cuEventDestroy_v2, c)                                \
    X(cuArrayCreate, c) X(cuArrayCreate_v2, c) X(cuArray3DCreate, c) X(cuArray3DCreate_v2, c)      \
    X(cuMipmappedArrayCreate, c) X(cuArrayDestroy, c) X(cuMipmappedArrayDestroy, c)                \
    X(cuMemGetInfo, c) X(cuMemGetInfo_v2, c) X(cuDeviceTotalMem, c) X(cuDeviceTotalMem_v2, c)      \
    X(cuDevicePrimaryCtxRetain, c) X(cuDevicePrimaryCtxRelease, c) X(cuDevicePrimaryCtxRelease_v2, c) \
    X(cuDevicePrimaryCtxReset, c) X(cuDevicePrimaryCtxReset_v2, c) X(cuCtxDestroy, c)              \
    X(cuCtxDestroy_v2, c) X(cuMemPoolCreate, c) X(cuMemPoolDestroy, c) X(cuDeviceGetDefaultMemPool, c) \
    X(cuDeviceGetMemPool, c) X(cuCtxSetLimit, c) X(cuMemPoolTrimTo, c) X(cuMemPoolSetAttribute, c)   \
    X(cuStreamSynchronize, c) X(cuStreamSynchronize_ptsz, c) X(cuStreamQuery, c)                   \
    X(cuStreamQuery_ptsz, c) X(cuCtxSynchronize, c) X(cuCtxSynchronize_v2, c)                      \
    X(cuGraphInstantiateWithFlags, c) X(cuGraphInstantiate, c) X(cuGraphInstantiate_v2, c)         \
    X(cuGraphInstantiateWithParams, c) X(cuGraphInstantiateWithParams_ptsz, c)                     \
    X(cuGraphExecUpdate, c) X(cuGraphExecUpdate_v2, c) X(cuGraphUpload, c) X(cuGraphUpload_ptsz, c) \
    X(cuGraphLaunch, c) X(cuGraphLaunch_ptsz, c) X(cuGraphExecDestroy, c) X(cuDeviceGraphMemTrim, c) \
    X(nvmlDeviceGetMemoryInfo, n) X(nvmlDeviceGetMemoryInfo_v2, n)
/* Real functions we call ourselves but do not wrap. */
#define HELPERS(X)                                                                                 \
    X(cuCtxGetDevice, c) X(cuDeviceGetCount, c) X(cuCtxGetCurrent, c) X(cuDevicePrimaryCtxGetState, c) \
    X(cuDeviceGetAttribute, c) X(cuDeviceGetUuid, c) X(cuDeviceGetUuid_v2, c) \
    X(nvmlDeviceGetIndex, n) X(nvmlDeviceGetUUID, n) X(nvmlDeviceGetMaxMigDeviceCount, n)         \
    X(nvmlDeviceGetMigDeviceHandleByIndex, n) X(cuMemPoolGetAttribute, c)                         \
    X(cuDeviceGetGraphMemAttribute, c) X(cuStreamGetCaptureInfo, c) X(cuStreamGetCaptureInfo_ptsz, c) \
    X(cuGraphGetNodes, c) X(cuGraphNodeGetType, c) X(cuGraphMemAllocNodeGetParams, c)             \
    X(cuGraphMemFreeNodeGetParams, c) X(cuGraphChildGraphNodeGetGraph, c) X(cuPointerGetAttribute, c)     \
    X(cuArrayGetDescriptor_v2, c) X(cuMipmappedArrayGetLevel, c) X(cuMemGetAllocationPropertiesFromHandle, c) \
    X(cuCtxGetApiVersion, c)

#define AS_ENUM(n, f) H_##n,
enum { HOOKS(AS_ENUM) N_HOOKS, HELPERS(AS_ENUM) N_ALL };
#define AS_NAME(n, f) #n,
static const char *const names[N_ALL] = {HOOKS(AS_NAME) "", HELPERS(AS_NAME)};
#define AS_FAMILY(n, f) (#f[0] == 'n'),
static const char is_nvml[N_ALL] = {HOOKS(AS_FAMILY) 0, HELPERS(AS_FAMILY)};

static void *reals[N_ALL];          /* the driver's functions, resolved once (atomic) */
static void *lib_handle[2];         /* libcuda / libnvidia-ml as the program opened them */
#define LOAD(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define ADD_RELAXED(p, v) __atomic_add_fetch((p), (v), __ATOMIC_RELAXED)
#define STORE(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)

/* Two dlsyms: glibc's own, for our lookups relative to us (RTLD_NEXT: the driver's function, or
 * that of an interposer preloaded after us); and the next one after us, which answers the
 * program's lookups that we do not wrap and the handle lookups of those we do: glibc's, or that of
 * another interposer preloaded after us (HAMi-core exports an unversioned dlsym, and sets itself
 * up when it sees a cu* name there: a program whose lookups never reached it crashed in its hooks
 * as soon as we called one). */
static void *(*glibc_dlsym_fn)(void *, const char *);
static void *(*next_dlsym_fn)(void *, const char *);

static void resolve_dlsym(void)
{
    /* glibc >= 2.34 has dlsym@@GLIBC_2.34 in libc; older ones only dlsym@GLIBC_2.2.5 (libdl). A
     * versioned lookup skips unversioned definitions: it finds glibc's. No dlvsym: glibc < 2.34
     * and a program that has not loaded libdl, so nothing calls dlsym yet. */
    if (!dlvsym) return;
    void *p = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
    if (!p) p = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
    void *(*g)(void *, const char *) = (void *(*)(void *, const char *))p;
    void *(*n)(void *, const char *) = g ? (void *(*)(void *, const char *))g(RTLD_NEXT, "dlsym") : NULL;
    STORE(&next_dlsym_fn, n ? n : g);
    STORE(&glibc_dlsym_fn, g);
}

static void *real_dlsym(void *h, const char *n)
{
    if (!LOAD(&glibc_dlsym_fn)) resolve_dlsym();
    return glibc_dlsym_fn ? glibc_dlsym_fn(h, n) : NULL;
}

static void *next_dlsym(void *h, const char *n)
{
    if (!LOAD(&next_dlsym_fn)) resolve_dlsym();
    return next_dlsym_fn ? next_dlsym_fn(h, n) : NULL;
}

static void *const *wrappers(void);
static int hook_id(const char *name);
static void *(*real_dlopen(void))(const char *, int);

static int is_ours(void *p)
{
    void *const *w = wrappers();
    for (int i = 0; i < N_HOOKS; i++)
        if (w[i] == p) return 1;
    return 0;
}

static void *library(int nvml)
{
    void *h = LOAD(&lib_handle[nvml]);
    void *(*open)(const char *, int) = h ? NULL : real_dlopen();
    if (open) {
        /* Only a library the program already loaded: never load the driver on our own. */
        h = open(nvml ? "libnvidia-ml.so.1" : "libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
        if (h) STORE(&lib_handle[nvml], h);
    }
    return h;
}

static void *real_slow(int id);
/* The driver's function: one load once resolved (every wrapper starts here). */
static inline __attribute__((always_inline)) void *real(int id)
{
    colo_gate(); /* colo suspend: waits here, before the driver, while the job is suspended */
    void *p = LOAD(&reals[id]);
    return __builtin_expect(p != NULL, 1) ? p : real_slow(id);
}

/* The driver's own function called name, for a pass-through stub (passthru.c); NULL: none. */
void *colo_driver_fn(const char *name)
{
    void *p = real_dlsym(RTLD_NEXT, name);
    if (!p) {
        void *h = library(0);
        p = h ? real_dlsym(h, name) : NULL;
    }
    return p;
}

static __attribute__((noinline)) void *real_slow(int id)
{
    void *p = real_dlsym(RTLD_NEXT, names[id]);
    if (!p || is_ours(p)) {
        void *h = library(is_nvml[id]);
        p = h ? real_dlsym(h, names[id]) : NULL;
        if (p && is_ours(p)) p = NULL;
    }
    if (p) STORE(&reals[id], p);
    return p;
}

#define REAL(id, T, f, missing)                                                                    \
    __typeof__(T) f = (__typeof__(T))real(H_##id);                                                 \
    if (!f) return missing
#define ON (ledger_enabled())

/* A one-argument entry point whose success we only have to follow with `then` (on x). */
#define AFTER_SUCCESS(name, T, then)                                                               \
    EXPORT CUresult name(T x)                                                                     \
    {                                                                                              \
        REAL(name, CUresult(*)(T), f, CUDA_ERROR_NOT_FOUND);                                       \
        CUresult rc = f(x);                                                                        \
        if (ON && rc == CUDA_SUCCESS) { then; }                                                    \
        return rc;                                                                                 \
    }

/* ---- accounting helpers ---------------------------------------------------------------------- */

static int g_ndev; /* devices this process sees, once the driver could tell (0: not yet) */

static int cur_dev(void)
{
    /* A job usually sees only its own GPU: then every context is on ordinal 0 and there is no
     * need to ask the driver on each allocation. */
    int n = LOAD(&g_ndev);
    if (!n) {
        CUresult (*count)(int *) = (CUresult(*)(int *))real(H_cuDeviceGetCount);
        if (count && count(&n) == CUDA_SUCCESS && n > 0) STORE(&g_ndev, n);
        else n = 0;
    }
    if (n == 1) return 0;
    CUresult (*f)(CUdevice *) = (CUresult(*)(CUdevice *))real(H_cuCtxGetDevice);
    CUdevice d = 0;
    if (f && f(&d) == CUDA_SUCCESS) return d;
    return 0; /* no context: the driver will refuse the allocation itself */
}

static uint64_t cur_ctx(void)
{
    CUresult (*f)(CUcontext *) = (CUresult(*)(CUcontext *))real(H_cuCtxGetCurrent);
    CUcontext c = NULL;
    return f && f(&c) == CUDA_SUCCESS ? (uint64_t)(uintptr_t)c : 0;
}

uint16_t colo_ctx_gen[CTX_GEN_SLOTS]; /* ctxid.h */

/* Keep the allocation's counted size by key. -1: no host memory to keep it (the caller undoes the
 * allocation: a pointer we could not subtract at its free would stay counted for ever). */
static void forgotten(const struct alloc *old);

/* Not inlined: inlined into every allocation wrapper (as gcc chose once more callers of table_put
 * came), it cost an alloc+free pair 4-6 ns more on the stub driver (bench/interposer_bench.py 1b). */
/* at: the context current at the driver call, seen: teardowns_seen() before it; the entry is
 * tagged with the context's identity as it goes in (ctxid.h: ctx_tag). at 0: ctx as given. */
static __attribute__((noinline)) int keep_aux(int kind, uint64_t key, int dev, uint64_t size, uint64_t ctx, uint64_t aux,
                                              uint64_t at, uint64_t seen)
{
    struct alloc a = {.key = key, .size = size, .aux = aux, .ctx = ctx, .kind = (uint16_t)kind, .dev = (uint16_t)dev,
                      .refs = 1};
    struct alloc old;
    int r = table_put_in(&a, &old, at, seen, 0);
    /* Still recorded, yet handed out again: the driver freed it without us (a path we do not see). */
    if (r == 1) forgotten(&old);
    return r < 0 ? -1 : 0;
}

static int keep(int kind, uint64_t key, int dev, uint64_t size, uint64_t ctx)
{
    return keep_aux(kind, key, dev, size, ctx, 0, 0, 0);
}

static int record(int kind, uint64_t key, int dev, uint64_t size, uint64_t seen)
{
    return keep_aux(kind, key, dev, size, 0, 0, kind == K_VMM ? 0 : cur_ctx(), seen);
}

static inline int admit(int dev, uint64_t size);

/* A context torn down while an allocation in it is between the driver and the table: the teardown
 * frees it but does not find it to forget (or finds it recorded under the generation it bumped to:
 * ctxid.h), and it would stay counted for good. Teardowns are counted (begun, then done once their
 * allocations are forgotten); an allocation that saw one begin or under way asks the driver, once
 * recorded and once that teardown is over, whether its memory still exists. Reading the two
 * counters costs the allocation two loads of a line only teardowns write. Teardowns take turns
 * (a lock held across the driver's destroy: they are rare), so that "over" is one count to wait
 * for: done reaching what begun was. */
uint64_t colo_teardowns_begun, colo_teardowns_done; /* ctxid.h */
static int g_teardown_mu;
static __thread int t_teardowns __attribute__((tls_model("initial-exec"))); /* this thread's, nested */

/* Nested on one thread: the driver called back into a teardown of ours (the lock is held). */
static void teardown_lock(void)
{
    if (!t_teardowns++)
        while (__atomic_exchange_n(&g_teardown_mu, 1, __ATOMIC_ACQUIRE)) sched_yield();
}
static void teardown_unlock(void)
{
    if (!--t_teardowns) __atomic_store_n(&g_teardown_mu, 0, __ATOMIC_RELEASE);
}
static void teardown_begin(void)
{
    teardown_lock();
    if (t_teardowns == 1) __atomic_add_fetch(&colo_teardowns_begun, 1, __ATOMIC_SEQ_CST);
}
static void teardown_end(void)
{
    if (t_teardowns == 1) __atomic_add_fetch(&colo_teardowns_done, 1, __ATOMIC_SEQ_CST);
    teardown_unlock();
}

/* Before the driver call: 0 when a teardown is under way, else how many have begun. */
static inline uint64_t teardowns_seen(void)
{
    uint64_t done = __atomic_load_n(&colo_teardowns_done, __ATOMIC_SEQ_CST);
    uint64_t begun = __atomic_load_n(&colo_teardowns_begun, __ATOMIC_SEQ_CST);
    return begun == done ? begun + 1 : 0;
}

static void recheck_alive(int kind, uint64_t key);
/* After the allocation was recorded: did a teardown overlap it? */
static inline void after_record(uint64_t seen, int kind, uint64_t key)
{
    if (__builtin_expect(!seen || __atomic_load_n(&colo_teardowns_begun, __ATOMIC_SEQ_CST) + 1 != seen, 0))
        recheck_alive(kind, key);
}

/* Reserve, call the driver, then record or roll back: never check-then-allocate-then-add. */
#define COUNTED_ALLOC(dev, size, kind, call, key, undo)                                            \
    do {                                                                                           \
        int d_ = (dev);                                                                            \
        uint64_t s_ = (size);                                                                      \
        int e_ = admit(d_, s_);                                                                    \
        if (e_) return e_;                                                                         \
        uint64_t t_ = teardowns_seen();                                                            \
        CUresult rc_ = (call);                                                                     \
        if (rc_ == CUDA_SUCCESS && record(kind, (uint64_t)(key), d_, s_, t_) != 0) {               \
            (void)(undo);                                                                          \
            rc_ = CUDA_ERROR_OUT_OF_MEMORY;                                                        \
        }                                                                                          \
        if (rc_ != CUDA_SUCCESS) ledger_release(d_, s_);                                           \
        else after_record(t_, kind, (uint64_t)(key));                                              \
        return rc_;                                                                                \
    } while (0)

/* Forget first (so a concurrent allocation that gets the same address back is not confused with
 * it), free, then subtract: the bytes leave the ledger only once the driver has them back. A
 * free enqueued on a stream (`async`) keeps them counted until the stream is known to be there. */
static void gone(const struct alloc *a, int async, CUstream s);
#define COUNTED_FREE_ON(kind, key, call, async, stream)                                           \
    do {                                                                                           \
        struct alloc a_, o_;                                                                       \
        uint64_t t_ = teardowns_seen();                                                            \
        int had_ = table_take(kind, (uint64_t)(key), &a_);                                         \
        CUresult rc_ = (call);                                                                     \
        if (had_) {                                                                                \
            if (rc_ == CUDA_SUCCESS) {                                                             \
                gone(&a_, async, stream);                                                          \
            } else { /* still the program's, unless a teardown freed it meanwhile */               \
                if (table_put(&a_, &o_) == 1) forgotten(&o_);                                     \
                after_record(t_, kind, (uint64_t)(key));                                           \
            }                                                                                      \
        }                                                                                          \
        return rc_;                                                                                \
    } while (0)
#define COUNTED_FREE(kind, key, call) COUNTED_FREE_ON(kind, key, call, 0, NULL)

static uint64_t mul_sat(uint64_t a, uint64_t b)
{
    uint64_t r;
    return __builtin_mul_overflow(a, b, &r) ? UINT64_MAX : r;
}

/* Half-bytes per texel of a CUarray_format (0: not a per-texel format). Plain formats are per
 * channel (times NumChannels); the normalised ones carry their channel count (X1/X2/X4); the
 * video formats are per pixel over all their planes (4:2:0 has a quarter-size chroma pair: 1.5
 * bytes a pixel at 8 bits). */
static uint64_t texel_halves(int format, unsigned ch)
{
    ch = ch ? ch : 1;
    switch (format) {
    case 0x01: case 0x08: return 2 * ch;                  /* (UN)SIGNED_INT8 */
    case 0x02: case 0x09: case 0x10: return 4 * ch;       /* (UN)SIGNED_INT16, HALF */
    case 0x03: case 0x0a: case 0x20: return 8 * ch;       /* (UN)SIGNED_INT32, FLOAT */
    case 0xc0: case 0xc6: return 2;                       /* UNORM/SNORM_INT8X1 */
    case 0xc1: case 0xc7: case 0xc3: case 0xc9: return 4; /* INT8X2, INT16X1 */
    case 0xc2: case 0xc8: case 0xc4: case 0xca: return 8; /* INT8X4, INT16X2 */
    case 0xc5: case 0xcb: return 16;                      /* INT16X4 */
    case 0xb0: case 0x53: case 0x59: return 3;            /* 8-bit 4:2:0: NV12, semi-planar, planar */
    case 0x9f: case 0xa1: case 0x54: case 0x5a: return 6; /* 16-bit 4:2:0: P010, P016, ... */
    case 0xa2: case 0xa5: case 0x51: case 0x55: case 0x5b: return 4; /* 8-bit 4:2:2: NV16, YUY2, ... */
    case 0xa3: case 0xa4: case 0xa6: case 0xa7: case 0x56: case 0x5c: return 8; /* 16-bit 4:2:2 */
    case 0xb2: case 0xb4: case 0x57: case 0x5d: return 6; /* 8-bit 4:4:4, three planes or two */
    case 0xb3: case 0xb5: case 0x58: case 0x5e: return 12; /* 16-bit (10 in 16) 4:4:4 */
    case 0xa8: case 0xa9: case 0x50: case 0x52: return 8; /* AYUV, Y410, 10:10:10:2, packed 4:4:4 (padded) */
    case 0xb1: return 16;                                 /* Y416 */
    default: return 0;
    }
}

static uint64_t mul3(uint64_t a, uint64_t b, uint64_t c) { return mul_sat(mul_sat(a, b), c); }

/* Block-compressed formats: bytes per 4x4 block (BC1, BC4: 8; BC2, BC3, BC5, BC6H, BC7: 16). */
static uint64_t block_bytes(int format)
{
    if (format < 0x91 || format > 0x9e) return 0;
    return format <= 0x92 || format == 0x97 || format == 0x98 ? 8 : 16;
}

static uint64_t array_bytes(uint64_t w, uint64_t h, uint64_t d, int fmt, unsigned ch)
{
    w = w ? w : 1, h = h ? h : 1, d = d ? d : 1;
    uint64_t b = block_bytes(fmt);
    if (b) return mul_sat(mul3((w + 3) / 4, (h + 3) / 4, d), b);
    uint64_t halves = texel_halves(fmt, ch);
    if (!halves) return mul_sat(mul3(w, h, d), mul_sat(16, ch ? ch : 1)); /* unknown: err on the large side */
    uint64_t n = mul_sat(mul3(w, h, d), halves);
    return n == UINT64_MAX ? n : (n + 1) / 2;
}

/* ---- allocation wrappers ---------------------------------------------------------------------- */

static CUresult free_v2_raw(uint64_t p);
static CUresult free_v1_raw(uint64_t p);
static CUresult release_raw(CUmemGenericAllocationHandle h);
static CUresult array_destroy_raw(CUarray a);
static CUresult mipmap_destroy_raw(CUmipmappedArray a);

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    REAL(cuMemAlloc_v2, CUresult(*)(CUdeviceptr *, size_t), f, CUDA_ERROR_NOT_FOUND);
    if (!ON || !dptr || !bytesize) return f(dptr, bytesize);
    COUNTED_ALLOC(cur_dev(), bytesize, K_PTR, f(dptr, bytesize), *dptr, free_v2_raw(*dptr));
}

EXPORT CUresult cuMemAlloc(CUdeviceptr_v1 *dptr, unsigned int bytesize)
{
    REAL(cuMemAlloc, CUresult(*)(CUdeviceptr_v1 *, unsigned int), f, CUDA_ERROR_NOT_FOUND);
    if (!ON || !dptr || !bytesize) return f(dptr, bytesize);
    COUNTED_ALLOC(cur_dev(), bytesize, K_PTR, f(dptr, bytesize), *dptr, free_v1_raw(*dptr));
}

/* Managed memory: COLO_GPU_MANAGED=full (default) charges all of it at allocation, since all of
 * it may come to live on the device; =none charges nothing (the driver pages it in and out, and
 * the job may then hold more device memory than its budget). */
static int g_managed_none;

EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
    REAL(cuMemAllocManaged, CUresult(*)(CUdeviceptr *, size_t, unsigned int), f, CUDA_ERROR_NOT_FOUND);
    if (!ON || !dptr || !bytesize || g_managed_none) return f(dptr, bytesize, flags);
    COUNTED_ALLOC(cur_dev(), bytesize, K_PTR, f(dptr, bytesize, flags), *dptr, free_v2_raw(*dptr));
}

/* The pitch is only known afterwards: reserve an estimate, then settle on the real size (and
 * give the memory back if the difference does not fit). */
static CUresult settle_pitch(int dev, uint64_t est, uint64_t actual, uint64_t ptr, CUresult (*freefn)(uint64_t),
                             uint64_t seen)
{
    if (actual > est && ledger_reserve(dev, actual - est) != 0) {
        freefn(ptr);
        ledger_release(dev, est);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (actual < est) ledger_release(dev, est - actual);
    if (record(K_PTR, ptr, dev, actual, seen) != 0) {
        freefn(ptr);
        ledger_release(dev, actual);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    after_record(seen, K_PTR, ptr);
    return CUDA_SUCCESS;
}

static CUresult free_v2_raw(uint64_t p)
{
    CUresult (*f)(CUdeviceptr) = (CUresult(*)(CUdeviceptr))real(H_cuMemFree_v2);
    return f ? f(p) : CUDA_ERROR_NOT_FOUND;
}

static CUresult free_v1_raw(uint64_t p)
{
    CUresult (*f)(CUdeviceptr_v1) = (CUresult(*)(CUdeviceptr_v1))real(H_cuMemFree);
    return f ? f((CUdeviceptr_v1)p) : CUDA_ERROR_NOT_FOUND;
}

static CUresult release_raw(CUmemGenericAllocationHandle h)
{
    CUresult (*f)(CUmemGenericAllocationHandle) = (CUresult(*)(CUmemGenericAllocationHandle))real(H_cuMemRelease);
    return f ? f(h) : CUDA_ERROR_NOT_FOUND;
}

static CUresult array_destroy_raw(CUarray a)
{
    CUresult (*f)(CUarray) = (CUresult(*)(CUarray))real(H_cuArrayDestroy);
    return f ? f(a) : CUDA_ERROR_NOT_FOUND;
}

static CUresult mipmap_destroy_raw(CUmipmappedArray a)
{
    CUresult (*f)(CUmipmappedArray) = (CUresult(*)(CUmipmappedArray))real(H_cuMipmappedArrayDestroy);
    return f ? f(a) : CUDA_ERROR_NOT_FOUND;
}

static uint64_t pitch_estimate(uint64_t w, uint64_t h) { return mul_sat((w + 511) & ~511ULL, h); }

#define ALLOC_PITCH(name, P, S, freefn)                                                            \
    EXPORT CUresult name(P *dptr, S *pitch, S w, S h, unsigned int elem)                          \
    {                                                                                              \
        REAL(name, CUresult(*)(P *, S *, S, S, unsigned int), f, CUDA_ERROR_NOT_FOUND);            \
        if (!ON || !dptr || !pitch || !w || !h) return f(dptr, pitch, w, h, elem);                 \
        int dev = cur_dev();                                                                       \
        uint64_t est = pitch_estimate(w, h);                                                       \
        int e = admit(dev, est);                                                                   \
        if (e) return e;                                                                           \
        uint64_t seen = teardowns_seen();                                                          \
        CUresult rc = f(dptr, pitch, w, h, elem);                                                  \
        if (rc != CUDA_SUCCESS) {                                                                  \
            ledger_release(dev, est);                                                              \
            return rc;                                                                             \
        }                                                                                          \
        return settle_pitch(dev, est, mul_sat(*pitch, h), *dptr, freefn, seen);                    \
    }
ALLOC_PITCH(cuMemAllocPitch_v2, CUdeviceptr, size_t, free_v2_raw)
ALLOC_PITCH(cuMemAllocPitch, CUdeviceptr_v1, unsigned int, free_v1_raw)

EXPORT CUresult cuMemFree_v2(CUdeviceptr p)
{
    REAL(cuMemFree_v2, CUresult(*)(CUdeviceptr), f, CUDA_ERROR_NOT_FOUND);
    if (!ON || !p) return f(p);
    COUNTED_FREE(K_PTR, p, f(p));
}

EXPORT CUresult cuMemFree(CUdeviceptr_v1 p)
{
    REAL(cuMemFree, CUresult(*)(CUdeviceptr_v1), f, CUDA_ERROR_NOT_FOUND);
    if (!ON || !p) return f(p);
    COUNTED_FREE(K_PTR, p, f(p));
}

/* ---- virtual memory management: physical memory lives until its last handle is released AND
 * every mapping of it is unmapped. The handles may be many: cuMemRetainAllocationHandle, and
 * cuMemImportFromShareableHandle of an fd exported from it (cuMemExportToShareableHandle), which
 * makes a new handle to the same memory. So the memory is one entry (K_VOBJ, keyed by an id of
 * ours: a released handle's value may be handed out again while an import keeps the memory), counted
 * once and given back when the last handle reference or mapping of it goes. An import of memory this
 * process did not export (another process's, of this job or not) is counted to the importer from
 * its first mapping, at the mapping's size (the driver has no call that says a handle's size). ---- */

static uint64_t g_next_obj;
#define OBJ_TAG (1ULL << 63) /* never a handle, pointer or context value */

static void obj_unref(uint64_t obj)
{
    struct alloc a, e;
    if (table_ref(K_VOBJ, obj, -1, &a) != 1) return;
    if (a.aux && table_get(K_VEXP, a.aux, &e) && e.aux == obj) table_take(K_VEXP, a.aux, &e);
    if (a.size) ledger_release(a.dev, a.size);
}

/* One more reference of handle h to object obj (a new K_VMM entry, or one more on it). -1: no host
 * memory to keep it (nothing changed). */
static int handle_ref(uint64_t h, uint64_t obj)
{
    struct alloc o, a, old;
    if (table_ref(K_VOBJ, obj, +1, &o) < 0) return -1;
    if (table_ref(K_VMM, h, +1, &a) >= 0) {
        if (a.aux != obj) obj_unref(obj); /* the same handle value answers for the same memory */
        return 0;
    }
    struct alloc v = {.key = h, .aux = obj, .kind = K_VMM, .dev = o.dev, .refs = 1};
    int r = table_put(&v, &old);
    if (r < 0) { obj_unref(obj); return -1; }
    if (r == 1) obj_unref(old.aux);
    return 0;
}

/* A new object of `size` bytes already reserved in the ledger (0: an unsized import), held by h. */
static int obj_new(uint64_t h, int dev, uint64_t size)
{
    uint64_t obj = OBJ_TAG | __atomic_add_fetch(&g_next_obj, 1, __ATOMIC_RELAXED);
    struct alloc o = {.key = obj, .size = size, .kind = K_VOBJ, .dev = (uint16_t)dev, .refs = 1}, old;
    if (table_put(&o, &old) < 0) return -1;
    struct alloc v = {.key = h, .aux = obj, .kind = K_VMM, .dev = (uint16_t)dev, .refs = 1};
    int r = table_put(&v, &old);
    if (r < 0) { table_take(K_VOBJ, obj, &o); return -1; }
    if (r == 1) obj_unref(old.aux); /* a handle value whose release we did not see */
    return 0;
}

EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t size, const CUmemAllocationProp *prop,
                            unsigned long long flags)
{
    REAL(cuMemCreate,
         CUresult(*)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long), f,
         CUDA_ERROR_NOT_FOUND);
    if (!ON || !h || !prop || !size || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return f(h, size, prop, flags); /* host memory, or the driver's own error */
    int dev = prop->location.id, e = admit(dev, size);
    if (e) return e;
    CUresult rc = f(h, size, prop, flags);
    if (rc == CUDA_SUCCESS && obj_new(*h, dev, size) != 0) {
        release_raw(*h);
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (rc != CUDA_SUCCESS) ledger_release(dev, size);
    return rc;
}

EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle h)
{
    REAL(cuMemRelease, CUresult(*)(CUmemGenericAllocationHandle), f, CUDA_ERROR_NOT_FOUND);
    if (!ON) return f(h);
    struct alloc a, o;
    int r = table_ref(K_VMM, h, -1, &a); /* -1: a handle we do not count (host memory) */
    CUresult rc = f(h);
    if (r < 0) return rc;
    if (rc == CUDA_SUCCESS) {
        obj_unref(a.aux); /* the bytes go when nothing else holds the memory */
    } else if (r == 1) { /* still the program's */
        a.refs = 1;
        if (table_put(&a, &o) == 1) obj_unref(o.aux);
    } else {
        table_ref(K_VMM, h, +1, &a);
    }
    return rc;
}

static void unmapped(const struct alloc *m) { obj_unref(m->aux); }

static int set_aux(struct alloc *o, uint64_t aux)
{
    o->aux = aux;
    return 1;
}

static int size_if_unsized(struct alloc *o, uint64_t size)
{
    if (o->size) return 0;
    o->size = size;
    return 1;
}

EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle h,
                         unsigned long long flags)
{
    REAL(cuMemMap, CUresult(*)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long), f,
         CUDA_ERROR_NOT_FOUND);
    struct alloc v, o;
    if (!ON || !table_get(K_VMM, h, &v) || !table_get(K_VOBJ, v.aux, &o)) return f(ptr, size, offset, h, flags);
    /* An import from elsewhere is charged at its first mapping, before the driver maps it. */
    uint64_t charge = o.size ? 0 : offset + size;
    int e = charge ? admit(v.dev, charge) : 0;
    if (e) return e;
    CUresult rc = f(ptr, size, offset, h, flags);
    if (charge && (rc != CUDA_SUCCESS || table_update(K_VOBJ, v.aux, size_if_unsized, charge) != 1))
        ledger_release(v.dev, charge); /* failed, or sized by another thread's mapping meanwhile */
    if (rc != CUDA_SUCCESS) return rc;
    if (table_ref(K_VOBJ, v.aux, +1, &o) < 0) return rc; /* released meanwhile: nothing to hold */
    struct alloc m = {.key = ptr, .size = size, .aux = v.aux, .kind = K_MAP, .refs = 1}, old;
    int r = table_put(&m, &old);
    if (r == 1) unmapped(&old); /* a mapping we missed the end of */
    if (r < 0) {                /* no host memory to track it: undo the mapping */
        CUresult (*unmap)(CUdeviceptr, size_t) = (CUresult(*)(CUdeviceptr, size_t))real(H_cuMemUnmap);
        if (unmap) unmap(ptr, size);
        unmapped(&m);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return rc;
}

EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    REAL(cuMemUnmap, CUresult(*)(CUdeviceptr, size_t), f, CUDA_ERROR_NOT_FOUND);
    CUresult rc = f(ptr, size);
    /* A range is unmapped whole, mapping by mapping: one lookup each. */
    if (ON && rc == CUDA_SUCCESS && !table_take_maps(ptr, ptr + size, unmapped))
        table_take_range(ptr, ptr + size, unmapped);
    return rc;
}

EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *h, void *addr)
{
    REAL(cuMemRetainAllocationHandle, CUresult(*)(CUmemGenericAllocationHandle *, void *), f,
         CUDA_ERROR_NOT_FOUND);
    CUresult rc = f(h, addr);
    struct alloc a;
    if (!ON || rc != CUDA_SUCCESS || !h) return rc;
    /* The handle of the memory mapped at addr: a value we know, or a new one for it. */
    if (table_ref(K_VMM, *h, 0, &a) >= 0 || table_get(K_MAP, (uint64_t)(uintptr_t)addr, &a))
        handle_ref(*h, a.aux);
    return rc;
}

/* An exported fd names the memory by its file only when the file is a regular one of its own (the
 * simulated driver's memfd); a device node or anonymous inode (as a real driver's fds may be) is
 * shared by every export, so it says nothing, and an import of it is counted as from elsewhere. */
static uint64_t fd_key(int fd)
{
    struct stat st; /* the system call: glibc's fstat symbol is GLIBC_2.33 (glibc_compat.h) */
    if (fd < 0 || syscall(SYS_fstat, fd, &st) != 0 || !S_ISREG(st.st_mode)) return 0;
    uint64_t k = ((uint64_t)st.st_dev * 0x9E3779B97F4A7C15ULL) ^ (uint64_t)st.st_ino;
    return k ? k : 1;
}

EXPORT CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle h, int type,
                                             unsigned long long flags)
{
    REAL(cuMemExportToShareableHandle, CUresult(*)(void *, CUmemGenericAllocationHandle, int, unsigned long long),
         f, CUDA_ERROR_NOT_FOUND);
    CUresult rc = f(out, h, type, flags);
    struct alloc v, e, old;
    uint64_t key;
    if (!ON || rc != CUDA_SUCCESS || type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || !out ||
        !table_get(K_VMM, h, &v) || !(key = fd_key(*(int *)out)))
        return rc;
    struct alloc x = {.key = key, .aux = v.aux, .kind = K_VEXP, .refs = 1};
    if (table_get(K_VEXP, key, &e) && e.aux != v.aux && table_get(K_VOBJ, e.aux, &old))
        x.aux = 0; /* another live allocation's fd had this file: the file names neither */
    if (table_put(&x, &old) >= 0 && x.aux) table_update(K_VOBJ, v.aux, set_aux, key);
    return rc;
}

EXPORT CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *h, void *os, int type)
{
    REAL(cuMemImportFromShareableHandle, CUresult(*)(CUmemGenericAllocationHandle *, void *, int), f,
         CUDA_ERROR_NOT_FOUND);
    CUresult rc = f(h, os, type);
    if (!ON || rc != CUDA_SUCCESS || !h) return rc;
    struct alloc e;
    uint64_t key = type == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR ? fd_key((int)(intptr_t)os) : 0;
    /* Exported by this process: the same memory, already counted. */
    if (key && table_get(K_VEXP, key, &e) && e.aux && handle_ref(*h, e.aux) == 0) return rc;
    /* From elsewhere: counted to us from its first mapping, on the device the driver says. */
    CUmemAllocationProp p = {0};
    CUresult (*props)(CUmemAllocationProp *, CUmemGenericAllocationHandle) =
        (CUresult(*)(CUmemAllocationProp *, CUmemGenericAllocationHandle))real(H_cuMemGetAllocationPropertiesFromHandle);
    int dev = cur_dev();
    if (props && props(&p, *h) == CUDA_SUCCESS) {
        if (p.location.type != CU_MEM_LOCATION_TYPE_DEVICE) return rc; /* host memory */
        dev = p.location.id;
    }
    if (obj_new(*h, dev, 0) != 0) { /* could not keep it: its mappings would go uncounted */
        release_raw(*h);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return rc;
}

/* ---- modules and libraries: their globals (`__device__` variables) take device memory at load.
 * No call says how much, so it is what the driver's free memory lost across the load (loads of a
 * process one at a time); a load that does not fit is undone and refused. A module is freed with
 * its context, a library when unloaded. ---- */

static pthread_mutex_t g_load_mu = PTHREAD_MUTEX_INITIALIZER;

static int real_free(size_t *fr)
{
    size_t t;
    CUresult (*f)(size_t *, size_t *) = (CUresult(*)(size_t *, size_t *))real(H_cuMemGetInfo_v2);
    return f && f(fr, &t) == CUDA_SUCCESS;
}

static CUresult module_unload_raw(void *m)
{
    CUresult (*f)(void *) = (CUresult(*)(void *))real(H_cuModuleUnload);
    return f ? f(m) : CUDA_ERROR_NOT_FOUND;
}

static CUresult library_unload_raw(void *l)
{
    CUresult (*f)(void *) = (CUresult(*)(void *))real(H_cuLibraryUnload);
    return f ? f(l) : CUDA_ERROR_NOT_FOUND;
}

#define COUNTED_LOAD(out, call, library)                                                           \
    do {                                                                                           \
        if (!ON || !(out)) return (call);                                                          \
        int dev_ = cur_dev();                                                                      \
        size_t f0_ = 0, f1_ = 0;                                                                   \
        pthread_mutex_lock(&g_load_mu);                                                            \
        int ok_ = real_free(&f0_);                                                                 \
        CUresult rc_ = (call);                                                                     \
        ok_ = ok_ && rc_ == CUDA_SUCCESS && real_free(&f1_);                                       \
        pthread_mutex_unlock(&g_load_mu);                                                          \
        if (rc_ != CUDA_SUCCESS) return rc_;                                                       \
        return loaded(*(void **)(out), library, dev_, ok_ && f1_ < f0_ ? f0_ - f1_ : 0);           \
    } while (0)

static CUresult loaded(void *h, int library, int dev, uint64_t size)
{
    CUresult rc = size ? admit(dev, size) : CUDA_SUCCESS;
    if (rc == CUDA_SUCCESS && keep(K_MODULE, (uint64_t)(uintptr_t)h, dev, size, library ? 0 : ctx_id(cur_ctx())) != 0) {
        ledger_release(dev, size);
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (rc != CUDA_SUCCESS) (void)(library ? library_unload_raw(h) : module_unload_raw(h));
    return rc;
}

EXPORT CUresult cuModuleLoad(CUmodule *m, const char *path)
{
    REAL(cuModuleLoad, CUresult(*)(CUmodule *, const char *), f, CUDA_ERROR_NOT_FOUND);
    COUNTED_LOAD(m, f(m, path), 0);
}

EXPORT CUresult cuModuleLoadData(CUmodule *m, const void *img)
{
    REAL(cuModuleLoadData, CUresult(*)(CUmodule *, const void *), f, CUDA_ERROR_NOT_FOUND);
    COUNTED_LOAD(m, f(m, img), 0);
}

EXPORT CUresult cuModuleLoadDataEx(CUmodule *m, const void *img, unsigned n, void *opts, void **vals)
{
    REAL(cuModuleLoadDataEx, CUresult(*)(CUmodule *, const void *, unsigned, void *, void **), f,
         CUDA_ERROR_NOT_FOUND);
    COUNTED_LOAD(m, f(m, img, n, opts, vals), 0);
}

EXPORT CUresult cuModuleLoadFatBinary(CUmodule *m, const void *img)
{
    REAL(cuModuleLoadFatBinary, CUresult(*)(CUmodule *, const void *), f, CUDA_ERROR_NOT_FOUND);
    COUNTED_LOAD(m, f(m, img), 0);
}

EXPORT CUresult cuLibraryLoadData(CUlibrary *l, const void *img, void *jo, void **jv, unsigned nj, void *lo,
                                  void **lv, unsigned nl)
{
    REAL(cuLibraryLoadData,
         CUresult(*)(CUlibrary *, const void *, void *, void **, unsigned, void *, void **, unsigned), f,
         CUDA_ERROR_NOT_FOUND);
    COUNTED_LOAD(l, f(l, img, jo, jv, nj, lo, lv, nl), 1);
}

EXPORT CUresult cuLibraryLoadFromFile(CUlibrary *l, const char *path, void *jo, void **jv, unsigned nj, void *lo,
                                      void **lv, unsigned nl)
{
    REAL(cuLibraryLoadFromFile,
         CUresult(*)(CUlibrary *, const char *, void *, void **, unsigned, void *, void **, unsigned), f,
         CUDA_ERROR_NOT_FOUND);
    COUNTED_LOAD(l, f(l, path, jo, jv, nj, lo, lv, nl), 1);
}

EXPORT CUresult cuModuleUnload(CUmodule m)
{
    REAL(cuModuleUnload, CUresult(*)(CUmodule), f, CUDA_ERROR_NOT_FOUND);
    if (!ON || !m) return f(m);
    COUNTED_FREE(K_MODULE, (uintptr_t)m, f(m));
}

EXPORT CUresult cuLibraryUnload(CUlibrary l)
{
    REAL(cuLibraryUnload, CUresult(*)(CUlibrary), f, CUDA_ERROR_NOT_FOUND);
    if (!ON || !l) return f(l);
    COUNTED_FREE(K_MODULE, (uintptr_t)l, f(l));
}

/* ---- arrays: sized from the descriptor (texel size x extent), recorded by handle ---------------- */

/* Sparse / deferred arrays have no backing of their own: it comes from cuMemCreate. */
#define ARRAY_CREATE(name, Desc, depth, flags)                                                    \
    EXPORT CUresult name(CUarray *ph, const Desc *d)                                              \
    {                                                                                              \
        REAL(name, CUresult(*)(CUarray *, const Desc *), f, CUDA_ERROR_NOT_FOUND);                 \
        if (!ON || !ph || !d || ((flags) & (CUDA_ARRAY3D_SPARSE | CUDA_ARRAY3D_DEFERRED_MAPPING))) \
            return f(ph, d);                                                                       \
        COUNTED_ALLOC(cur_dev(), array_bytes(d->Width, d->Height, depth, d->Format, d->NumChannels), K_ARRAY, \
                      f(ph, d), (uintptr_t)*ph, array_destroy_raw(*ph));                           \
    }
ARRAY_CREATE(cuArrayCreate_v2, CUDA_ARRAY_DESCRIPTOR, 1, 0)
ARRAY_CREATE(cuArrayCreate, CUDA_ARRAY_DESCRIPTOR_v1, 1, 0)
ARRAY_CREATE(cuArray3DCreate_v2, CUDA_ARRAY3D_DESCRIPTOR, d->Depth, d->Flags)
ARRAY_CREATE(cuArray3DCreate, CUDA_ARRAY3D_DESCRIPTOR_v1, d->Depth, 0)

EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *ph, const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned int levels)
{
    REAL(cuMipmappedArrayCreate, CUresult(*)(CUmipmappedArray *, const CUDA_ARRAY3D_DESCRIPTOR *, unsigned int), f,
         CUDA_ERROR_NOT_FOUND);
    if (!ON || !ph || !d || (d->Flags & (CUDA_ARRAY3D_SPARSE | CUDA_ARRAY3D_DEFERRED_MAPPING)))
        return f(ph, d, levels);
    uint64_t total = 0;
    for (unsigned l = 0; l < (levels ? levels : 1) && l < 64; l++) {
        uint64_t w = d->Width >> l, h = d->Height >> l, z = (d->Flags & 1) ? d->Depth : d->Depth >> l;
        uint64_t b = array_bytes(w ? w : 1, h ? h : 1, z ? z : 1, d->Format, d->NumChannels);
        total = total + b < total ? UINT64_MAX : total + b;
    }
    COUNTED_ALLOC(cur_dev(), total, K_MIPMAP, f(ph, d, levels), (uintptr_t)*ph, mipmap_destroy_raw(*ph));
}

EXPORT CUresult cuArrayDestroy(CUarray a)
{
    REAL(cuArrayDestroy, CUresult(*)(CUarray), f, CUDA_ERROR_NOT_FOUND);
    if (!ON || !a) return f(a);
    COUNTED_FREE(K_ARRAY, (uintptr_t)a, f(a));
}

EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray a)
{
    REAL(cuMipmappedArrayDestroy, CUresult(*)(CUmipmappedArray), f, CUDA_ERROR_NOT_FOUND);
    if (!ON || !a) return f(a);
    COUNTED_FREE(K_MIPMAP, (uintptr_t)a, f(a));
}

/* ---- context teardown: the driver frees every allocation made in the context, so do we ------ */

static void dropped(const struct alloc *a) { gone(a, 0, NULL); }

static void settle_all(void);
static void graph_trimmed(void);
/* The driver destroyed the context at ctx whose entries were recorded up to generation gen. */
static void drop_ctx(uint64_t ctx, uint16_t gen)
{
    if (!ctx) return;
    graph_trimmed(); /* the context's graph memory may go with it */
    table_take_ctx(ctx, gen, dropped);
    settle_all(); /* pools gave the context's allocations back to their reserve (or the device) */
}

/* The primary context of dev, if it is active (0 otherwise), without changing its retain count. */
static uint64_t primary_ctx(CUdevice dev)
{
    CUresult (*state)(CUdevice, unsigned *, int *) =
        (CUresult(*)(CUdevice, unsigned *, int *))real(H_cuDevicePrimaryCtxGetState);
    CUresult (*retain)(CUcontext *, CUdevice) = (CUresult(*)(CUcontext *, CUdevice))real(H_cuDevicePrimaryCtxRetain);
    CUresult (*release)(CUdevice) = (CUresult(*)(CUdevice))real(H_cuDevicePrimaryCtxRelease_v2);
    if (!release) release = (CUresult(*)(CUdevice))real(H_cuDevicePrimaryCtxRelease);
    unsigned flags = 0;
    int active = 0;
    CUcontext c = NULL;
    if (!state || !retain || !release || state(dev, &flags, &active) != CUDA_SUCCESS || !active) return 0;
    if (retain(&c, dev) != CUDA_SUCCESS) return 0;
    release(dev);
    return (uint64_t)(uintptr_t)c;
}

static int primary_active(CUdevice dev)
{
    CUresult (*state)(CUdevice, unsigned *, int *) =
        (CUresult(*)(CUdevice, unsigned *, int *))real(H_cuDevicePrimaryCtxGetState);
    unsigned flags = 0;
    int active = 1;
    if (state) state(dev, &flags, &active);
    return active;
}

/* A reset destroys the primary context (and everything allocated in it); so does the last
 * release (only_last: the context may still be active after it). Each bumps the context's
 * generation before the driver call (ctxid.h): the context the primary context is afterwards
 * (reset, or retained again) keeps what it records. */
#define PRIMARY_TEARDOWN(name, only_last)                                                          \
    EXPORT CUresult name(CUdevice dev)                                                            \
    {                                                                                              \
        REAL(name, CUresult(*)(CUdevice), f, CUDA_ERROR_NOT_FOUND);                                \
        if (!ON) return f(dev);                                                                    \
        teardown_begin();                                                                          \
        uint64_t pc = primary_ctx(dev);                                                            \
        uint16_t gen = pc ? ctx_bump(pc) : 0;                                                      \
        CUresult rc = f(dev);                                                                      \
        if (rc == CUDA_SUCCESS && pc && (!(only_last) || !primary_active(dev))) drop_ctx(pc, gen); \
        teardown_end();                                                                            \
        return rc;                                                                                 \
    }
/* A retain may make the primary context live again (at the same address): it takes its turn with
 * the teardowns, so that a last release's "is it still active?" is not answered by a retain that
 * came after it (its entries would then stay counted until the next teardown). */
EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    REAL(cuDevicePrimaryCtxRetain, CUresult(*)(CUcontext *, CUdevice), f, CUDA_ERROR_NOT_FOUND);
    if (!ON) return f(pctx, dev);
    teardown_lock();
    CUresult rc = f(pctx, dev);
    teardown_unlock();
    return rc;
}

PRIMARY_TEARDOWN(cuDevicePrimaryCtxRelease, 1)
PRIMARY_TEARDOWN(cuDevicePrimaryCtxRelease_v2, 1)
PRIMARY_TEARDOWN(cuDevicePrimaryCtxReset, 0)
PRIMARY_TEARDOWN(cuDevicePrimaryCtxReset_v2, 0)

#define CTX_DESTROY(name)                                                                          \
    EXPORT CUresult name(CUcontext c)                                                             \
    {                                                                                              \
        REAL(name, CUresult(*)(CUcontext), f, CUDA_ERROR_NOT_FOUND);                               \
        if (!ON) return f(c);                                                                      \
        teardown_begin();                                                                          \
        uint16_t gen = c ? ctx_bump((uint64_t)(uintptr_t)c) : 0;                                   \
        CUresult rc = f(c);                                                                        \
        if (rc == CUDA_SUCCESS) drop_ctx((uint64_t)(uintptr_t)c, gen);                             \
        teardown_end();                                                                            \
        return rc;                                                                                 \
    }
CTX_DESTROY(cuCtxDestroy)
CTX_DESTROY(cuCtxDestroy_v2)

/* Settle an entry that an allocation or limit overlapping a teardown recorded (or any entry whose
 * record a teardown overlapped): called under the entry's lock, with the teardowns held off, so
 * that neither the driver's answer nor a context's generation can change before the entry does,
 * and no allocation handed the address since can be recorded in between. 1: the driver no longer
 * knows it (that teardown, or a path we do not see, freed it): it goes. Otherwise it stays,
 * tagged with the current identity of the context that holds it, which the driver names for a
 * pointer: the allocation may be another context's, made at an address the teardown freed, whose
 * record ours replaced (its bytes given back), so that its context's teardown must release it,
 * not the next teardown at our context's address (which would leave it uncounted while it
 * lives). A limit (key: its context's address + the limit) goes when its context is no longer a
 * context; one whose address the driver gave to a new context meanwhile stays counted (too high,
 * never too low) until that context's teardown. Arrays keep their context's address. */
static int settle_entry(struct alloc *a, void *arg)
{
    (void)arg;
    uint64_t key = a->key, at = a->ctx & CTX_ADDR_MASK & ~CTX_UNSETTLED;
    CUresult rc = CUDA_SUCCESS;
    if (a->kind == K_LIMIT) {
        CUresult (*f)(CUcontext, unsigned *) = (CUresult(*)(CUcontext, unsigned *))real(H_cuCtxGetApiVersion);
        unsigned v = 0;
        at = key & ~7ull;
        if (f) rc = f((CUcontext)(uintptr_t)at, &v);
    } else if (a->kind == K_PTR) {
        CUresult (*f)(void *, int, CUdeviceptr) = (CUresult(*)(void *, int, CUdeviceptr))real(H_cuPointerGetAttribute);
        unsigned type = 0;
        CUcontext c = NULL;
        if (f) rc = f(&type, 2 /* CU_POINTER_ATTRIBUTE_MEMORY_TYPE */, key);
        if (f && rc == CUDA_SUCCESS && a->ctx && f(&c, 1 /* CU_POINTER_ATTRIBUTE_CONTEXT */, key) == CUDA_SUCCESS && c)
            at = (uint64_t)(uintptr_t)c;
    } else if (a->kind == K_ARRAY) {
        CUresult (*f)(CUDA_ARRAY_DESCRIPTOR *, CUarray) = (CUresult(*)(CUDA_ARRAY_DESCRIPTOR *, CUarray))real(H_cuArrayGetDescriptor_v2);
        CUDA_ARRAY_DESCRIPTOR d;
        if (f) rc = f(&d, (CUarray)(uintptr_t)key);
    } else if (a->kind == K_MIPMAP) {
        CUresult (*f)(CUarray *, CUmipmappedArray, unsigned) = (CUresult(*)(CUarray *, CUmipmappedArray, unsigned))real(H_cuMipmappedArrayGetLevel);
        CUarray level;
        if (f) rc = f(&level, (CUmipmappedArray)(uintptr_t)key, 0);
    }
    if (rc != CUDA_SUCCESS) return 1;
    if (a->ctx) a->ctx = ctx_id(at);
    return 0;
}

/* Once the teardown under way (if any) is over, and before another begins (a driver query under
 * a shard's lock: rare, only after a teardown overlapped the record). */
static void recheck_alive(int kind, uint64_t key)
{
    struct alloc a;
    teardown_lock();
    int r = table_settle(kind, key, settle_entry, NULL, &a);
    teardown_unlock();
    if (r == 1) dropped(&a);
}

/* ---- context limits: a larger stack, malloc heap or printf FIFO, and the device runtime's
 * reservations (sync depth, pending launches), are device memory the driver takes for the
 * context: charged to it, replaced when set again, released with the context. --- */

/* What limit `limit` set to `value` takes. The driver says nothing of 3 and 4 but that it reserves
 * memory for them (up to 150 MB per sync level on the GPUs of its day); assumed here, as the
 * simulated driver does (native/fakegpu/cuda_mem.c): per sync level the saved state of every
 * resident thread at 1 KiB (a register file's worth), per pending launch slot 4 KiB. */
static uint64_t limit_bytes(int limit, size_t value, int dev)
{
    if (limit != 0 && limit != 3) return limit == 4 ? mul_sat(value, 4096) : value;
    CUresult (*attr)(int *, int, CUdevice) = (CUresult(*)(int *, int, CUdevice))real(H_cuDeviceGetAttribute);
    int sms = 0, per_sm = 0;
    if (!attr || attr(&sms, 16, dev) || attr(&per_sm, 39, dev) || sms <= 0 || per_sm <= 0) sms = 256, per_sm = 2048;
    uint64_t threads = (uint64_t)sms * (uint64_t)per_sm; /* every thread the device can hold */
    return mul_sat(value, limit == 0 ? threads : mul_sat(threads, 1024));
}

/* The limit taken out for a call that failed goes back, unless another was set under its key
 * meanwhile (by a context made at the address since, or a call racing this one): that one is what
 * the driver holds, and the old one's bytes leave the ledger. */
static void limit_restore(const struct alloc *old)
{
    struct alloc newer;
    if (table_put(old, &newer) != 1) return;
    struct alloc mine;
    if (table_put(&newer, &mine) == 1) ledger_release(mine.dev, mine.size);
}

/* The limit just set on the context at ctx, recorded (tagged as it goes in: ctxid.h). Another
 * found under its key was set meanwhile, by a call racing this one or on a context made at the
 * address since (ours may then be the destroyed context's): which one the driver holds cannot be
 * told, so the larger stays counted (too high, never too low), under our tag (the context at the
 * address now: the other's may be the destroyed one's, whose teardown would take it), and the
 * other leaves the ledger. */
static void limit_keep(uint64_t key, int dev, uint64_t bytes, uint64_t ctx, uint64_t seen)
{
    struct alloc a = {.key = key, .size = bytes, .kind = K_LIMIT, .dev = (uint16_t)dev, .refs = 1};
    struct alloc other;
    if (table_put_in(&a, &other, ctx, seen, 1) == 1) ledger_release(other.dev, other.size < bytes ? other.size : bytes);
}

/* Its context may be destroyed while this runs (the limit's memory goes with it): as an
 * allocation, the limit is recorded under the context's identity and checked again when a
 * teardown overlapped the call. */
EXPORT CUresult cuCtxSetLimit(int limit, size_t value)
{
    REAL(cuCtxSetLimit, CUresult(*)(int, size_t), f, CUDA_ERROR_NOT_FOUND);
    uint64_t ctx;
    if (!ON || limit < 0 || limit > 4 || !(ctx = cur_ctx())) return f(limit, value);
    uint64_t seen = teardowns_seen();
    int dev = cur_dev();
    uint64_t bytes = limit_bytes(limit, value, dev);
    uint64_t key = ctx + (uint64_t)limit; /* contexts are aligned: one key per (context, limit) */
    struct alloc old = {0};
    int had = table_take(K_LIMIT, key, &old);
    uint64_t before = had ? old.size : 0;
    if (bytes > before) {
        int e = admit(dev, bytes - before);
        if (e) {
            if (had) limit_restore(&old);
            if (had) after_record(seen, K_LIMIT, key);
            return e;
        }
    }
    CUresult rc = f(limit, value);
    if (rc != CUDA_SUCCESS) {
        if (bytes > before) ledger_release(dev, bytes - before);
        if (had) limit_restore(&old);
        if (had) after_record(seen, K_LIMIT, key);
        return rc;
    }
    if (bytes < before) ledger_release(dev, before - bytes);
    if (bytes) limit_keep(key, dev, bytes, ctx, seen); /* no host memory: stays counted (too high) */
    if (bytes) after_record(seen, K_LIMIT, key);
    return rc;
}

/* ---- stream-ordered memory: pools, frees that complete at stream time, graph memory ----------
 *
 * What the driver holds for a pool is its reserved memory (CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT):
 * its live allocations, frees its streams have not reached yet, and what it keeps below its
 * release threshold. Each allocation from a pool is counted as any other, at the size asked; the
 * pool's own entry (pools.h) counts the rest, `extra` = max(0, reserved - live), read back from the
 * driver after each of our pool calls and at each synchronisation (the only times a pool gives
 * memory back by itself). A free moves the bytes from the allocation to `extra` (no ledger change),
 * and the next reading takes them off once the driver has really let them go. An allocation the
 * pool can serve from that reserve takes its bytes from `extra` instead of the ledger: the budget
 * is charged what the driver holds, once. The graph memory pool of each device is one more pool
 * (CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT), with no allocations of its own counted. */

static int g_npend;  /* K_PEND entries: frees of plain memory waiting for their stream */
static uint32_t g_free_seq; /* numbers the K_PEND entries in the order their frees were enqueued */

enum { MEMPOOL_ATTR_RESERVED_MEM_CURRENT = 5, GRAPH_MEM_ATTR_USED_MEM_CURRENT = 0,
       GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT = 2 };

static CUresult graph_mem_attr(int dev, int attr, uint64_t *v)
{
    CUresult (*f)(CUdevice, int, void *) = (CUresult(*)(CUdevice, int, void *))real(H_cuDeviceGetGraphMemAttribute);
    return f ? f(dev, attr, v) : CUDA_ERROR_NOT_FOUND;
}

/* Under the pools lock: bring `extra` to what the driver now holds beyond the live allocations (and
 * the reserve lent to allocations in flight). Less: given back at once. More (the driver grew the
 * pool by more than an allocation: its chunk): charged if it fits; if not, 0 is returned (strict:
 * the refusal is counted and logged) and the rest is left for a later reading, unless the caller
 * undoes the allocation (pool_grew). */
static int settle(struct pool *p, int strict)
{
    uint64_t reserved = 0;
    CUresult rc;
    if (p->dead) return 1;
    if (p->graph) {
        rc = graph_mem_attr(p->dev, GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, &reserved);
    } else {
        CUresult (*f)(CUmemoryPool, int, void *) = (CUresult(*)(CUmemoryPool, int, void *))real(H_cuMemPoolGetAttribute);
        rc = f ? f((CUmemoryPool)(uintptr_t)p->h, MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &reserved) : CUDA_ERROR_NOT_FOUND;
    }
    if (rc != CUDA_SUCCESS) return 1; /* unknown: keep what is counted (never too low) */
    uint64_t held = p->live + p->taken;
    uint64_t target = reserved > held ? reserved - held : 0;
    if (target < p->extra) {
        ledger_release(p->dev, p->extra - target);
        p->extra = target;
    } else if (target > p->extra) {
        uint64_t more = target - p->extra;
        if (!(strict ? ledger_reserve(p->dev, more) == 0 : ledger_try(p->dev, more))) return 0;
        p->extra = target;
    }
    return 1;
}

static void settle_all(void)
{
    if (!pools_count()) return;
    pools_lock();
    for (int i = 0; i < pools_count(); i++) settle(pool_at(i), 0);
    pools_unlock();
}

static void settle_pool(uint64_t h, int graph, int dev)
{
    pools_lock();
    struct pool *p = pool_find(h, graph, dev);
    if (p) settle(p, 0);
    pools_unlock();
}

/* An entry the table replaced (the driver handed its address out again: it is gone). */
static void forgotten(const struct alloc *old)
{
    if (old->kind == K_VMM || old->kind == K_VOBJ || old->kind == K_VEXP) return; /* ours: never replaced */
    if (old->kind != K_MAP && old->kind != K_EXECW && old->kind != K_EXECB) gone(old, 0, NULL);
}

/* The driver took an allocation back (or will, once stream s gets there: async). */
static void gone(const struct alloc *a, int async, CUstream s)
{
    if (a->kind == K_PTR && a->aux) { /* from a pool: its bytes stay the pool's until it lets them go */
        pools_lock();
        struct pool *p = pool_find(a->aux, 0, a->dev);
        if (p) {
            p->live -= a->size < p->live ? a->size : p->live;
            p->extra += a->size;
            settle(p, 0);
        }
        pools_unlock();
        if (!p) ledger_release(a->dev, a->size);
        return;
    }
    if (async && a->kind == K_PTR) {
        /* Plain memory freed on a stream: counted until that stream (or its context) is synchronised,
         * or an event recorded on it after the free is. */
        struct alloc p = {.key = a->key, .size = a->size, .aux = (uint64_t)(uintptr_t)s, .ctx = a->ctx, .kind = K_PEND,
                          .dev = a->dev, .refs = __atomic_add_fetch(&g_free_seq, 1, __ATOMIC_SEQ_CST)}, old;
        int r = table_put(&p, &old);
        if (r == 1) forgotten(&old);
        if (r >= 0) {
            ADD_RELAXED(&g_npend, 1);
            return;
        }
    }
    if (a->kind == K_PEND) ADD_RELAXED(&g_npend, -1);
    ledger_release(a->dev, a->size);
}

static void pend_done(const struct alloc *a) { gone(a, 0, NULL); }

/* Stream s (all: every stream of the current context) has reached all its work. */
static void stream_reached(CUstream s, int all)
{
    if (LOAD(&g_npend)) table_take_pending((uint64_t)(uintptr_t)s, all, all ? cur_ctx() : 0, pend_done);
}

/* Is stream s being captured into a graph? Then an allocation on it is a graph alloc node: the
 * driver allocates nothing now (its bytes are counted when the graph is uploaded or launched). */
static int capturing(CUstream s, int ptsz)
{
    CUresult (*f)(CUstream, int *, cuuint64_t *) =
        (CUresult(*)(CUstream, int *, cuuint64_t *))real(ptsz ? H_cuStreamGetCaptureInfo_ptsz : H_cuStreamGetCaptureInfo);
    int status = 0;
    cuuint64_t cid = 0;
    return f && f(s, &status, &cid) == CUDA_SUCCESS && status == 1 /* ACTIVE */;
}

static CUresult trim_pool(uint64_t h)
{
    CUresult (*f)(CUmemoryPool, size_t) = (CUresult(*)(CUmemoryPool, size_t))real(H_cuMemPoolTrimTo);
    return f ? f((CUmemoryPool)(uintptr_t)h, 0) : CUDA_ERROR_NOT_FOUND;
}

static void graph_trimmed(void);
static CUresult trim_graph(int dev)
{
    CUresult (*f)(CUdevice) = (CUresult(*)(CUdevice))real(H_cuDeviceGraphMemTrim);
    graph_trimmed();
    return f ? f(dev) : CUDA_ERROR_NOT_FOUND;
}

/* Give back to the device what the pools on dev keep idle. Entry by entry (the table may grow
 * meanwhile; an entry reused for another pool only costs that pool its idle reserve). */
static void trim_idle(int dev)
{
    for (int i = 0;; i++) {
        pools_lock();
        if (i >= pools_count()) {
            pools_unlock();
            return;
        }
        struct pool q = *pool_at(i);
        pools_unlock();
        if (q.dev != dev || !q.extra || q.dead) continue;
        if (q.graph) trim_graph(dev);
        else trim_pool(q.h);
        settle_pool(q.h, q.graph, dev);
    }
}

/* Reserve size on dev. At the edge of the budget, what pools keep idle (below their release
 * threshold, or freed but not yet trimmed) is given back to the device first: the driver would
 * hold it while refusing. */
/* At the edge: the frees pending on streams the driver says have finished their work are done (a
 * real GPU gets there without any call of ours seeing it). */
static void reach_finished_streams(void)
{
    uint64_t streams[64];
    CUresult (*query)(CUstream) = (CUresult(*)(CUstream))real(H_cuStreamQuery);
    int n = query ? table_pending_streams(streams, 64) : 0;
    for (int i = 0; i < n; i++)
        if (query((CUstream)(uintptr_t)streams[i]) == CUDA_SUCCESS) stream_reached((CUstream)(uintptr_t)streams[i], 0);
}

/* Out of line: only an allocation that does not fit at once comes here (admit stays one call). */
static __attribute__((noinline)) int admit_slow(int dev, uint64_t size)
{
    if (LOAD(&g_npend)) {
        reach_finished_streams();
        if (ledger_try(dev, size)) return 0;
    }
    if (pools_count()) trim_idle(dev);
    return ledger_reserve(dev, size);
}

static inline __attribute__((always_inline)) int admit(int dev, uint64_t size)
{
    return __builtin_expect(ledger_try(dev, size), 1) ? 0 : admit_slow(dev, size);
}

/* At the edge of the budget, a stream-ordered allocation first lets its stream reach the frees
 * enqueued on it (a synchronisation, only here): the pool would reuse them in stream order, but
 * only trimmed memory is memory the ledger may count as gone. */
static int admit_on_stream(int dev, uint64_t size, CUstream s, int ptsz)
{
    CUresult (*sync)(CUstream) = (CUresult(*)(CUstream))real(ptsz ? H_cuStreamSynchronize_ptsz : H_cuStreamSynchronize);
    if (sync && sync(s) == CUDA_SUCCESS) stream_reached(s, 0);
    return admit(dev, size);
}

/* Lend up to `bytes` of pool h's counted idle reserve to an allocation about to be made from it
 * (the driver serves an allocation from its idle memory first, and from frees enqueued on the same
 * stream: `extra` holds both). Returns what was lent; ~0: the pool cannot be kept (fail closed). */
static uint64_t pool_lend(uint64_t h, int dev, uint64_t bytes)
{
    pools_lock();
    struct pool *p = pool_get(h, 0, dev);
    uint64_t lent = UINT64_MAX;
    if (p) {
        lent = bytes < p->extra ? bytes : p->extra;
        p->extra -= lent;
        p->taken += lent;
    }
    pools_unlock();
    return lent;
}

/* After an allocation of `bytes` from pool h that borrowed `lent` of its reserve (bytes 0: the call
 * failed, and may still have grown the pool), the pool's real size replaces the reservation.
 * CUDA_ERROR_OUT_OF_MEMORY: the driver grew the pool by more than was reserved (its chunk, or
 * because the reserve it lent was a free enqueued on another stream) and the rest does not fit
 * the budget, even once the device's idle pool memory went back: the caller undoes the
 * allocation. */
static int pool_grew(uint64_t h, int dev, uint64_t bytes, uint64_t lent)
{
    pools_lock();
    struct pool *p = pool_find(h, 0, dev);
    int ok = 1;
    if (p) {
        p->taken -= lent;
        if (bytes) p->live += bytes;
        else p->extra += lent; /* nothing was made: the lent reserve is the pool's again */
        ok = settle(p, 0);
    }
    pools_unlock();
    if (ok || !bytes) return 0;
    trim_idle(dev);
    pools_lock();
    p = pool_find(h, 0, dev);
    ok = !p || settle(p, 1);
    pools_unlock();
    return ok ? 0 : CUDA_ERROR_OUT_OF_MEMORY;
}

/* Undo a stream-ordered allocation whose pool grew past the budget: free it, let its stream get
 * there, and give the pool's idle memory back, so that the driver holds no more than is counted. */
static CUresult undo_pool_alloc(CUdeviceptr ptr, CUstream s, int ptsz, uint64_t h, int dev)
{
    CUresult (*fr)(CUdeviceptr, CUstream) = (CUresult(*)(CUdeviceptr, CUstream))real(ptsz ? H_cuMemFreeAsync_ptsz : H_cuMemFreeAsync);
    CUresult (*sync)(CUstream) = (CUresult(*)(CUstream))real(ptsz ? H_cuStreamSynchronize_ptsz : H_cuStreamSynchronize);
    struct alloc a;
    int had = table_take(K_PTR, ptr, &a);
    if (fr) fr(ptr, s);
    if (had) gone(&a, 1, s); /* its bytes are the pool's until it lets them go */
    if (sync && sync(s) == CUDA_SUCCESS) stream_reached(s, 0);
    trim_pool(h);
    settle_pool(h, 0, dev);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

/* The device of a pool we saw made or looked up; the caller's current device otherwise. */
static int pool_dev(uint64_t h)
{
    pools_lock();
    struct pool *p = pool_find(h, 0, 0);
    int dev = p ? p->dev : -1;
    pools_unlock();
    return dev >= 0 ? dev : cur_dev();
}

static void note_pool(uint64_t h, int dev)
{
    pools_lock();
    pool_get(h, 0, dev); /* no host memory: the pool's allocations are refused (pool_lend) */
    pools_unlock();
}

static CUresult alloc_stream_ordered(CUresult (*f)(CUdeviceptr *, size_t, CUmemoryPool, CUstream),
                                     CUresult (*g)(CUdeviceptr *, size_t, CUstream), CUdeviceptr *dptr, size_t bytes,
                                     CUmemoryPool pool, CUstream s, int ptsz)
{
#define CALL() (f ? f(dptr, bytes, pool, s) : g(dptr, bytes, s))
    if (capturing(s, ptsz)) return CALL(); /* a graph alloc node: counted at upload or launch */
    int dev;
    uint64_t h = (uint64_t)(uintptr_t)pool;
    if (f) {
        dev = pool_dev(h);
    } else { /* cuMemAllocAsync: the device's current pool */
        dev = cur_dev();
        CUresult (*getpool)(CUmemoryPool *, CUdevice) = (CUresult(*)(CUmemoryPool *, CUdevice))real(H_cuDeviceGetMemPool);
        CUmemoryPool cp = NULL;
        if (getpool && getpool(&cp, dev) == CUDA_SUCCESS) h = (uint64_t)(uintptr_t)cp;
    }
    uint64_t lent = h ? pool_lend(h, dev, bytes) : 0;
    if (lent == UINT64_MAX) return ledger_refuse(dev, bytes); /* a pool whose reserve we could not count */
    uint64_t need = bytes - lent;
    int e = 0;
    if (need && !ledger_try(dev, need)) {
        /* The edge: the lent reserve goes back first, since the edge trims idle reserves. */
        if (lent) pool_grew(h, dev, 0, lent);
        lent = 0;
        need = bytes;
        e = admit_on_stream(dev, bytes, s, ptsz);
    }
    if (e) return e;
    uint64_t seen = teardowns_seen();
    CUresult rc = CALL();
    if (rc == CUDA_SUCCESS && keep_aux(K_PTR, *dptr, dev, bytes, 0, h, cur_ctx(), seen) != 0) {
        CUresult (*fr)(CUdeviceptr, CUstream) = (CUresult(*)(CUdeviceptr, CUstream))real(ptsz ? H_cuMemFreeAsync_ptsz : H_cuMemFreeAsync);
        if (fr) fr(*dptr, s);
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (rc != CUDA_SUCCESS) {
        ledger_release(dev, need);
        if (h) pool_grew(h, dev, 0, lent); /* a failed call may still have grown the pool */
        return rc;
    }
    if (h && pool_grew(h, dev, bytes, lent)) return undo_pool_alloc(*dptr, s, ptsz, h, dev);
    after_record(seen, K_PTR, *dptr);
    return rc;
#undef CALL
}

#define ALLOC_ASYNC(name, ptsz)                                                                    \
    EXPORT CUresult name(CUdeviceptr *dptr, size_t bytesize, CUstream s)                          \
    {                                                                                              \
        REAL(name, CUresult(*)(CUdeviceptr *, size_t, CUstream), f, CUDA_ERROR_NOT_FOUND);         \
        if (!ON || !dptr || !bytesize) return f(dptr, bytesize, s);                                \
        return alloc_stream_ordered(NULL, f, dptr, bytesize, NULL, s, ptsz);                       \
    }
ALLOC_ASYNC(cuMemAllocAsync, 0)
ALLOC_ASYNC(cuMemAllocAsync_ptsz, 1)

#define ALLOC_POOL(name, ptsz)                                                                     \
    EXPORT CUresult name(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream s)       \
    {                                                                                              \
        REAL(name, CUresult(*)(CUdeviceptr *, size_t, CUmemoryPool, CUstream), f,                  \
             CUDA_ERROR_NOT_FOUND);                                                                \
        if (!ON || !dptr || !bytesize || !pool) return f(dptr, bytesize, pool, s);                 \
        return alloc_stream_ordered(f, NULL, dptr, bytesize, pool, s, ptsz);                       \
    }
ALLOC_POOL(cuMemAllocFromPoolAsync, 0)
ALLOC_POOL(cuMemAllocFromPoolAsync_ptsz, 1)

static void graph_free_elsewhere(CUstream s, int ptsz);
/* A free on a stream of memory we did not count (a graph's allocation, say) may leave memory a
 * graph expects to reuse in use on another stream (graph_free_elsewhere). */
#define FREE_ASYNC(name, ptsz)                                                                     \
    EXPORT CUresult name(CUdeviceptr p, CUstream s)                                               \
    {                                                                                              \
        REAL(name, CUresult(*)(CUdeviceptr, CUstream), f, CUDA_ERROR_NOT_FOUND);                   \
        if (!ON || !p) return f(p, s);                                                             \
        struct alloc a, o;                                                                         \
        uint64_t t = teardowns_seen();                                                             \
        int had = table_take(K_PTR, p, &a);                                                        \
        CUresult rc = f(p, s);                                                                     \
        if (!had) {                                                                                \
            if (rc == CUDA_SUCCESS) graph_free_elsewhere(s, ptsz);                                 \
        } else if (rc == CUDA_SUCCESS) {                                                           \
            gone(&a, 1, s);                                                                        \
        } else {                                                                                   \
            if (table_put(&a, &o) == 1) forgotten(&o);                                             \
            after_record(t, K_PTR, p);                                                             \
        }                                                                                          \
        return rc;                                                                                 \
    }
FREE_ASYNC(cuMemFreeAsync, 0)
FREE_ASYNC(cuMemFreeAsync_ptsz, 1)

EXPORT CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemAllocationProp *props)
{
    REAL(cuMemPoolCreate, CUresult(*)(CUmemoryPool *, const CUmemAllocationProp *), f, CUDA_ERROR_NOT_FOUND);
    CUresult rc = f(pool, props);
    /* CUmemPoolProps begins like CUmemAllocationProp: type, handle types, location. */
    if (ON && rc == CUDA_SUCCESS && pool && props && props->location.type == CU_MEM_LOCATION_TYPE_DEVICE)
        note_pool((uint64_t)(uintptr_t)*pool, props->location.id);
    return rc;
}

/* The driver gives the idle reserve back at once; allocations still live keep theirs. */
EXPORT CUresult cuMemPoolDestroy(CUmemoryPool pool)
{
    REAL(cuMemPoolDestroy, CUresult(*)(CUmemoryPool), f, CUDA_ERROR_NOT_FOUND);
    CUresult rc = f(pool);
    if (ON && rc == CUDA_SUCCESS) {
        pools_lock();
        struct pool *p = pool_find((uint64_t)(uintptr_t)pool, 0, 0);
        if (p) {
            ledger_release(p->dev, p->extra);
            p->extra = 0;
            p->dead = 1;
        }
        pools_unlock();
    }
    return rc;
}

#define GET_POOL(name)                                                                             \
    EXPORT CUresult name(CUmemoryPool *pool, CUdevice dev)                                        \
    {                                                                                              \
        REAL(name, CUresult(*)(CUmemoryPool *, CUdevice), f, CUDA_ERROR_NOT_FOUND);                \
        CUresult rc = f(pool, dev);                                                                \
        if (ON && rc == CUDA_SUCCESS && pool && *pool) note_pool((uint64_t)(uintptr_t)*pool, dev); \
        return rc;                                                                                 \
    }
GET_POOL(cuDeviceGetDefaultMemPool)
GET_POOL(cuDeviceGetMemPool)

EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t keep_bytes)
{
    REAL(cuMemPoolTrimTo, CUresult(*)(CUmemoryPool, size_t), f, CUDA_ERROR_NOT_FOUND);
    CUresult rc = f(pool, keep_bytes);
    if (ON && rc == CUDA_SUCCESS && pool) settle_pool((uint64_t)(uintptr_t)pool, 0, pool_dev((uint64_t)(uintptr_t)pool));
    return rc;
}

EXPORT CUresult cuMemPoolSetAttribute(CUmemoryPool pool, int attr, void *value)
{
    REAL(cuMemPoolSetAttribute, CUresult(*)(CUmemoryPool, int, void *), f, CUDA_ERROR_NOT_FOUND);
    CUresult rc = f(pool, attr, value);
    if (ON && rc == CUDA_SUCCESS && pool) settle_pool((uint64_t)(uintptr_t)pool, 0, pool_dev((uint64_t)(uintptr_t)pool));
    return rc;
}

/* Synchronisation: the streams reached their frees, and pools gave back what is above their
 * release threshold. */
AFTER_SUCCESS(cuStreamSynchronize, CUstream, stream_reached(x, 0); settle_all())
AFTER_SUCCESS(cuStreamSynchronize_ptsz, CUstream, stream_reached(x, 0); settle_all())

/* A stream that answers "all done" has reached its frees (pools trim only at synchronisation). */
AFTER_SUCCESS(cuStreamQuery, CUstream, stream_reached(x, 0))
AFTER_SUCCESS(cuStreamQuery_ptsz, CUstream, stream_reached(x, 0))

/* ---- events: once an event is reached, so is every free enqueued on its stream before it was
 * recorded. Followed only while frees are pending (two loads a record otherwise). ---- */

static int g_nevents; /* K_EVENT entries */

#define EVENT_RECORD(name, params, args, ev, stream)                                               \
    EXPORT CUresult name params                                                                    \
    {                                                                                              \
        REAL(name, CUresult(*) params, f, CUDA_ERROR_NOT_FOUND);                                   \
        /* read before the record: every free numbered up to here was enqueued before it */       \
        uint32_t seq = __atomic_load_n(&g_free_seq, __ATOMIC_SEQ_CST);                             \
        CUresult rc = f args;                                                                      \
        if (rc == CUDA_SUCCESS && ON && (LOAD(&g_npend) || LOAD(&g_nevents))) event_recorded(ev, stream, seq); \
        return rc;                                                                                 \
    }

static void event_recorded(CUevent ev, CUstream s, uint32_t seq)
{
    struct alloc e = {.key = (uint64_t)(uintptr_t)ev, .aux = (uint64_t)(uintptr_t)s, .kind = K_EVENT, .refs = seq}, old;
    if (LOAD(&g_npend)) {
        if (table_put(&e, &old) == 0) ADD_RELAXED(&g_nevents, 1);
    } else if (table_take(K_EVENT, e.key, &old)) { /* its earlier record says nothing of this one */
        ADD_RELAXED(&g_nevents, -1);
    }
}

static void event_reached(CUevent ev)
{
    struct alloc e;
    if (LOAD(&g_npend) && LOAD(&g_nevents) && table_get(K_EVENT, (uint64_t)(uintptr_t)ev, &e))
        table_take_pending_upto(e.aux, e.refs, pend_done);
}

static void event_gone(CUevent ev)
{
    struct alloc e;
    if (LOAD(&g_nevents) && table_take(K_EVENT, (uint64_t)(uintptr_t)ev, &e)) ADD_RELAXED(&g_nevents, -1);
}

EVENT_RECORD(cuEventRecord, (CUevent e, CUstream s), (e, s), e, s)
EVENT_RECORD(cuEventRecord_ptsz, (CUevent e, CUstream s), (e, s), e, s)
EVENT_RECORD(cuEventRecordWithFlags, (CUevent e, CUstream s, unsigned fl), (e, s, fl), e, s)
EVENT_RECORD(cuEventRecordWithFlags_ptsz, (CUevent e, CUstream s, unsigned fl), (e, s, fl), e, s)
AFTER_SUCCESS(cuEventSynchronize, CUevent, event_reached(x))
AFTER_SUCCESS(cuEventQuery, CUevent, event_reached(x))
AFTER_SUCCESS(cuEventDestroy, CUevent, event_gone(x))
AFTER_SUCCESS(cuEventDestroy_v2, CUevent, event_gone(x))

EXPORT CUresult cuCtxSynchronize(void)
{
    REAL(cuCtxSynchronize, CUresult(*)(void), f, CUDA_ERROR_NOT_FOUND);
    CUresult rc = f();
    if (ON && rc == CUDA_SUCCESS) {
        stream_reached(NULL, 1);
        settle_all();
    }
    return rc;
}

EXPORT CUresult cuCtxSynchronize_v2(CUcontext c)
{
    REAL(cuCtxSynchronize_v2, CUresult(*)(CUcontext), f, CUDA_ERROR_NOT_FOUND);
    CUresult rc = f(c);
    if (ON && rc == CUDA_SUCCESS) {
        if (LOAD(&g_npend)) table_take_pending(0, 1, c ? (uint64_t)(uintptr_t)c : cur_ctx(), pend_done);
        settle_all();
    }
    return rc;
}

/* ---- graph memory: a graph's alloc nodes take their memory from the device's graph pool when it
 * is uploaded or launched. What each instantiated graph can take is read from the driver when it
 * is instantiated (its alloc nodes, child graphs included, whichever way they were added), and
 * whether all of its allocations are freed inside it.
 *
 * Replays. The driver keeps the memory it mapped for a graph mapped to it between launches, and
 * shares it among graphs launched into one stream (CUDA programming guide, "Graph Memory Nodes");
 * a graph launched again on the same stream takes nothing new, so nothing is reserved for it
 * ("backed"). What may take its memory away, so that its next launch maps afresh: a trim of the
 * graph pool (ours at the edge, or the program's), a graph launch or upload on another stream
 * (graphs that may run at once cannot share), a launch of a graph whose allocations outlive it
 * (they may hold memory shared with other graphs), a free of memory we do not count (a graph's)
 * enqueued on another stream, a context teardown. Each moves a process-wide epoch; a graph is
 * backed only at the epoch and on the stream of its last launch or upload. Any other launch
 * reserves its allocations' size less the graph pool's idle memory (reserved - used as the driver
 * reports them, less what other launches in flight expect to reuse); then the pool's real size
 * replaces the reservation. */

typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphExec_st *CUgraphExec;
typedef struct CUgraphNode_st *CUgraphNode;
typedef struct {
    CUmemAllocationProp poolProps; /* CUmemPoolProps starts alike; 88 bytes in all */
    unsigned char rest_of_props[88 - sizeof(CUmemAllocationProp)];
    const void *accessDescs;
    size_t accessDescCount;
    size_t bytesize;
    CUdeviceptr dptr;
} CUDA_MEM_ALLOC_NODE_PARAMS;
typedef struct {
    cuuint64_t flags;
    CUstream hUploadStream;
    CUgraphNode hErrNode_out;
    int result_out;
} CUDA_GRAPH_INSTANTIATE_PARAMS;
enum { CU_GRAPH_NODE_TYPE_GRAPH = 4, CU_GRAPH_NODE_TYPE_MEM_ALLOC = 10, CU_GRAPH_NODE_TYPE_MEM_FREE = 11,
       CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD = 2 };

/* Bytes per device an instantiated graph's allocations take; mask: the devices with any; outlives:
 * some allocation is not freed inside the graph. */
struct gweight {
    uint32_t mask;
    int outlives;
    uint64_t bytes[LEDGER_MAX_DEV];
};

struct gaddrs {
    uint64_t *v;
    size_t n, cap;
};

static int gaddrs_add(struct gaddrs *a, uint64_t x)
{
    if (a->n == a->cap) {
        size_t nc = a->cap ? a->cap * 2 : 16;
        uint64_t *v = realloc(a->v, nc * sizeof *v);
        if (!v) return -1;
        a->v = v;
        a->cap = nc;
    }
    a->v[a->n++] = x;
    return 0;
}

/* Add graph g's alloc nodes to *w, as the driver reports them, and the addresses its allocations
 * and frees name. CUDA_SUCCESS, the driver's error, or CUDA_ERROR_OUT_OF_MEMORY (no host memory). */
static CUresult graph_scan(CUgraph g, struct gweight *w, struct gaddrs *allocs, struct gaddrs *frees, int depth)
{
    CUresult (*nodes_of)(CUgraph, CUgraphNode *, size_t *) =
        (CUresult(*)(CUgraph, CUgraphNode *, size_t *))real(H_cuGraphGetNodes);
    CUresult (*type_of)(CUgraphNode, int *) = (CUresult(*)(CUgraphNode, int *))real(H_cuGraphNodeGetType);
    CUresult (*alloc_of)(CUgraphNode, CUDA_MEM_ALLOC_NODE_PARAMS *) =
        (CUresult(*)(CUgraphNode, CUDA_MEM_ALLOC_NODE_PARAMS *))real(H_cuGraphMemAllocNodeGetParams);
    CUresult (*free_of)(CUgraphNode, CUdeviceptr *) = (CUresult(*)(CUgraphNode, CUdeviceptr *))real(H_cuGraphMemFreeNodeGetParams);
    CUresult (*child_of)(CUgraphNode, CUgraph *) = (CUresult(*)(CUgraphNode, CUgraph *))real(H_cuGraphChildGraphNodeGetGraph);
    if (!nodes_of || !type_of || !alloc_of || !child_of) return CUDA_ERROR_NOT_FOUND;
    if (depth > 64) return CUDA_ERROR_INVALID_VALUE;
    size_t n = 0;
    CUresult rc = nodes_of(g, NULL, &n);
    if (rc != CUDA_SUCCESS || !n) return rc;
    CUgraphNode *nodes = malloc(n * sizeof *nodes);
    if (!nodes) return CUDA_ERROR_OUT_OF_MEMORY;
    rc = nodes_of(g, nodes, &n);
    for (size_t i = 0; rc == CUDA_SUCCESS && i < n; i++) {
        int type = -1;
        if ((rc = type_of(nodes[i], &type)) != CUDA_SUCCESS) break;
        if (type == CU_GRAPH_NODE_TYPE_MEM_ALLOC) {
            CUDA_MEM_ALLOC_NODE_PARAMS p;
            memset(&p, 0, sizeof p);
            if ((rc = alloc_of(nodes[i], &p)) != CUDA_SUCCESS) break;
            int d = p.poolProps.location.id;
            if (p.poolProps.location.type != CU_MEM_LOCATION_TYPE_DEVICE || d < 0 || d >= LEDGER_MAX_DEV)
                continue; /* a graph allocation of host memory */
            w->bytes[d] = w->bytes[d] + p.bytesize < w->bytes[d] ? UINT64_MAX : w->bytes[d] + p.bytesize;
            w->mask |= 1u << d;
            if (gaddrs_add(allocs, p.dptr)) rc = CUDA_ERROR_OUT_OF_MEMORY;
        } else if (type == CU_GRAPH_NODE_TYPE_MEM_FREE) {
            CUdeviceptr at = 0;
            if (!free_of || free_of(nodes[i], &at) != CUDA_SUCCESS) w->outlives = 1; /* cannot tell: assume so */
            else if (gaddrs_add(frees, at)) rc = CUDA_ERROR_OUT_OF_MEMORY;
        } else if (type == CU_GRAPH_NODE_TYPE_GRAPH) {
            CUgraph child = NULL;
            if ((rc = child_of(nodes[i], &child)) == CUDA_SUCCESS) rc = graph_scan(child, w, allocs, frees, depth + 1);
        }
    }
    free(nodes);
    return rc;
}

static CUresult graph_weight(CUgraph g, struct gweight *w)
{
    struct gaddrs allocs = {0}, frees = {0};
    CUresult rc = graph_scan(g, w, &allocs, &frees, 0);
    for (size_t i = 0; rc == CUDA_SUCCESS && i < allocs.n && !w->outlives; i++) {
        size_t k = 0;
        while (k < frees.n && frees.v[k] != allocs.v[i]) k++;
        if (k == frees.n) w->outlives = 1;
    }
    free(allocs.v);
    free(frees.v);
    return rc;
}

/* The weight of an instantiated graph is kept by (exec, device): device 0's entry (key exec) also
 * holds the mask and, at bit 32, outlives; device d's has key exec ^ d << 56 (user addresses stay
 * below 2^47). K_EXECB (key exec): the stream and epoch at which it is backed. */
static uint64_t exec_key(CUgraphExec x, int d) { return (uint64_t)(uintptr_t)x ^ ((uint64_t)d << 56); }

static void forget_exec(CUgraphExec x)
{
    struct alloc a;
    table_take(K_EXECB, (uint64_t)(uintptr_t)x, &a);
    if (!table_take(K_EXECW, exec_key(x, 0), &a)) return;
    for (int d = 1; d < LEDGER_MAX_DEV; d++)
        if (a.aux & (1u << d)) table_take(K_EXECW, exec_key(x, d), &a);
}

static int keep_exec(CUgraphExec x, const struct gweight *w)
{
    forget_exec(x);
    if (!w->mask) return 0;
    for (int d = 0; d < LEDGER_MAX_DEV; d++) {
        if (d && !(w->mask & (1u << d))) continue;
        struct alloc a = {.key = exec_key(x, d), .size = w->bytes[d],
                          .aux = d ? 0 : w->mask | (uint64_t)(w->outlives != 0) << 32, .kind = K_EXECW,
                          .dev = (uint16_t)d, .refs = 1}, o;
        if (table_put(&a, &o) < 0) {
            forget_exec(x);
            return -1;
        }
    }
    return 0;
}

static void exec_weight(CUgraphExec x, struct gweight *w)
{
    struct alloc a;
    w->mask = 0;
    w->outlives = 0;
    if (!table_get(K_EXECW, exec_key(x, 0), &a)) return;
    w->mask = (uint32_t)a.aux;
    w->outlives = (int)(a.aux >> 32 & 1);
    w->bytes[0] = a.size;
    for (int d = 1; d < LEDGER_MAX_DEV; d++)
        if (w->mask & (1u << d)) w->bytes[d] = table_get(K_EXECW, exec_key(x, d), &a) ? a.size : 0;
}

static uint32_t g_gepoch;  /* moves when a graph's retained memory may have been taken from it */
static uint64_t g_gstream; /* stream_key() of the last graph launch or upload; 0: none yet */

static void graph_trimmed(void) { __atomic_add_fetch(&g_gepoch, 1, __ATOMIC_ACQ_REL); }

static uint64_t stream_key(CUstream s, int ptsz) { return (uint64_t)(uintptr_t)s << 2 | (uint64_t)ptsz << 1 | 1; }

static void graph_free_elsewhere(CUstream s, int ptsz)
{
    uint64_t last = LOAD(&g_gstream);
    if (last && last != stream_key(s, ptsz)) graph_trimmed();
}

/* A launch or upload on stream key k: a change of stream moves the epoch. */
static void graph_on_stream(uint64_t k)
{
    if (__atomic_exchange_n(&g_gstream, k, __ATOMIC_ACQ_REL) != k) graph_trimmed();
}

static int exec_backed(CUgraphExec x, uint64_t k)
{
    struct alloc a;
    return table_get(K_EXECB, (uint64_t)(uintptr_t)x, &a) && a.size == k && (uint32_t)a.aux == LOAD(&g_gepoch);
}

/* No host memory to note it: the graph is simply not backed at its next launch. */
static void exec_mark(CUgraphExec x, uint64_t k, uint32_t epoch)
{
    struct alloc a = {.key = (uint64_t)(uintptr_t)x, .size = k, .aux = epoch, .kind = K_EXECB, .refs = 1}, o;
    table_put(&a, &o);
}

/* Hand back what graph_admit took on the devices in `upto` (a bit mask). */
static void graph_unadmit(const struct gweight *r, const struct gweight *claim, uint32_t upto)
{
    for (int d = 0; d < LEDGER_MAX_DEV; d++) {
        if (!(upto & (1u << d))) continue;
        pools_lock();
        struct pool *p = pool_find(0, 1, d);
        if (p) p->claimed -= claim->bytes[d];
        pools_unlock();
        ledger_release(d, r->bytes[d]);
    }
}

/* Reserve, on every device of w or none, what a launch may add to the graph pools: nothing when
 * backed; else w less the pool's idle memory that no other launch in flight expects (claim). */
static int graph_admit(const struct gweight *w, int backed, struct gweight *r, struct gweight *claim)
{
    memset(r, 0, sizeof *r);
    memset(claim, 0, sizeof *claim);
    r->mask = claim->mask = w->mask;
    if (backed) return 0;
    for (int d = 0; d < LEDGER_MAX_DEV; d++) {
        if (!(w->mask & (1u << d))) continue;
        uint64_t used = 0;
        int known = graph_mem_attr(d, GRAPH_MEM_ATTR_USED_MEM_CURRENT, &used) == CUDA_SUCCESS;
        pools_lock();
        struct pool *p = pool_get(0, 1, d);
        if (p && known) {
            uint64_t idle = p->extra > used ? p->extra - used : 0;
            idle = idle > p->claimed ? idle - p->claimed : 0;
            claim->bytes[d] = w->bytes[d] < idle ? w->bytes[d] : idle;
            p->claimed += claim->bytes[d];
        }
        pools_unlock();
        if (!p) { /* a graph pool we could not keep */
            graph_unadmit(r, claim, (1u << d) - 1);
            return ledger_refuse(d, w->bytes[d]);
        }
        r->bytes[d] = w->bytes[d] - claim->bytes[d];
        if (!r->bytes[d] || ledger_try(d, r->bytes[d])) continue;
        /* The edge: the claim goes back, since the edge trims idle memory (this pool's too). */
        pools_lock();
        p = pool_find(0, 1, d);
        if (p) p->claimed -= claim->bytes[d];
        pools_unlock();
        claim->bytes[d] = 0;
        r->bytes[d] = w->bytes[d];
        int e = admit(d, r->bytes[d]);
        if (e) {
            r->bytes[d] = 0;
            graph_unadmit(r, claim, (2u << d) - 1);
            return e;
        }
    }
    return 0;
}

/* After the upload or launch: each reservation becomes its graph pool's, then the pool's real size
 * replaces it (nothing was taken when the call failed). */
static void graph_settle(const struct gweight *r, const struct gweight *claim, int ok)
{
    for (int d = 0; d < LEDGER_MAX_DEV; d++) {
        if (!(r->mask & (1u << d))) continue;
        pools_lock();
        struct pool *p = pool_find(0, 1, d);
        if (p) {
            p->claimed -= claim->bytes[d];
            if (ok) {
                p->extra += r->bytes[d];
                settle(p, 0);
            }
        }
        pools_unlock();
        if (!ok || !p) ledger_release(d, r->bytes[d]);
    }
}

/* An upload or launch of x (NULL: one being instantiated) with weight w on stream key k: what is
 * admitted first, so that one the budget cannot take fails with CUDA_ERROR_OUT_OF_MEMORY before the
 * driver backs or runs it, and the epoch to mark it backed at once it succeeded. */
struct gback {
    struct gweight r, claim;
    uint32_t epoch;
};

static int graph_back_begin(CUgraphExec x, const struct gweight *w, uint64_t k, struct gback *b)
{
    graph_on_stream(k);
    int backed = x && exec_backed(x, k);
    if (w->outlives) graph_trimmed(); /* its allocations may hold memory other graphs keep mapped */
    b->epoch = LOAD(&g_gepoch);
    return graph_admit(w, backed, &b->r, &b->claim);
}

static void graph_back_end(CUgraphExec x, uint64_t k, const struct gback *b, int ok)
{
    graph_settle(&b->r, &b->claim, ok);
    if (ok && x) exec_mark(x, k, b->epoch);
}

static CUresult exec_destroy_raw(CUgraphExec x)
{
    CUresult (*f)(CUgraphExec) = (CUresult(*)(CUgraphExec))real(H_cuGraphExecDestroy);
    return f ? f(x) : CUDA_ERROR_NOT_FOUND;
}

/* Every way to instantiate: the graph's weight is read first (an upload at instantiation, on
 * stream key k (0: none), is admitted like a launch), then kept for the executable graph; with no
 * host memory to keep it, the instantiation is undone (its launches could not be checked). */
#define INSTANTIATE(exec, g, k, call)                                                              \
    do {                                                                                           \
        struct gweight w_ = {0};                                                                   \
        struct gback b_;                                                                           \
        CUresult rc_ = graph_weight(g, &w_);                                                       \
        if (rc_ != CUDA_SUCCESS) return rc_;                                                       \
        int up_ = (k) && w_.mask;                                                                  \
        if (up_ && (rc_ = graph_back_begin(NULL, &w_, k, &b_))) return rc_;                        \
        rc_ = (call);                                                                              \
        if (up_) graph_back_end(NULL, k, &b_, rc_ == CUDA_SUCCESS);                                \
        if (rc_ == CUDA_SUCCESS && keep_exec(*(exec), &w_) != 0) {                                 \
            exec_destroy_raw(*(exec));                                                             \
            rc_ = CUDA_ERROR_OUT_OF_MEMORY;                                                        \
        }                                                                                          \
        if (rc_ == CUDA_SUCCESS && up_) exec_mark(*(exec), k, b_.epoch);                           \
        return rc_;                                                                                \
    } while (0)

EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec *exec, CUgraph g, unsigned long long flags)
{
    REAL(cuGraphInstantiateWithFlags, CUresult(*)(CUgraphExec *, CUgraph, unsigned long long), f,
         CUDA_ERROR_NOT_FOUND);
    if (!ON || !exec || !g) return f(exec, g, flags);
    INSTANTIATE(exec, g, 0, f(exec, g, flags));
}

/* The CUDA 10 and 11 ABIs (error node and log buffer). */
#define INSTANTIATE_LOG(name)                                                                      \
    EXPORT CUresult name(CUgraphExec *exec, CUgraph g, CUgraphNode *err, char *log, size_t n)     \
    {                                                                                              \
        REAL(name, CUresult(*)(CUgraphExec *, CUgraph, CUgraphNode *, char *, size_t), f,          \
             CUDA_ERROR_NOT_FOUND);                                                                \
        if (!ON || !exec || !g) return f(exec, g, err, log, n);                                    \
        INSTANTIATE(exec, g, 0, f(exec, g, err, log, n));                                          \
    }
INSTANTIATE_LOG(cuGraphInstantiate)
INSTANTIATE_LOG(cuGraphInstantiate_v2)

#define INSTANTIATE_PARAMS(name, ptsz)                                                             \
    EXPORT CUresult name(CUgraphExec *exec, CUgraph g, CUDA_GRAPH_INSTANTIATE_PARAMS *p)          \
    {                                                                                              \
        REAL(name, CUresult(*)(CUgraphExec *, CUgraph, CUDA_GRAPH_INSTANTIATE_PARAMS *), f,        \
             CUDA_ERROR_NOT_FOUND);                                                                \
        if (!ON || !exec || !g || !p) return f(exec, g, p);                                        \
        uint64_t k = p->flags & CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD ? stream_key(p->hUploadStream, ptsz) : 0; \
        INSTANTIATE(exec, g, k, f(exec, g, p));                                                    \
    }
INSTANTIATE_PARAMS(cuGraphInstantiateWithParams, 0)
INSTANTIATE_PARAMS(cuGraphInstantiateWithParams_ptsz, 1)

/* An update gives the executable graph the new graph's node parameters: its weight follows (and
 * it is no longer backed). Read first: with no host memory to read it, the update is refused and
 * the graph stays as it was. */
#define EXEC_UPDATE(name, Rest, rest)                                                              \
    EXPORT CUresult name(CUgraphExec x, CUgraph g Rest)                                           \
    {                                                                                              \
        REAL(name, CUresult(*)(CUgraphExec, CUgraph Rest), f, CUDA_ERROR_NOT_FOUND);               \
        if (!ON || !x || !g) return f(x, g rest);                                                  \
        struct gweight w = {0};                                                                    \
        CUresult rc = graph_weight(g, &w);                                                         \
        if (rc != CUDA_SUCCESS) return rc;                                                         \
        rc = f(x, g rest);                                                                         \
        if (rc == CUDA_SUCCESS && keep_exec(x, &w) != 0) rc = CUDA_ERROR_OUT_OF_MEMORY;            \
        return rc;                                                                                 \
    }
#define COMMA ,
EXEC_UPDATE(cuGraphExecUpdate, COMMA CUgraphNode *err COMMA int *result, COMMA err COMMA result)
EXEC_UPDATE(cuGraphExecUpdate_v2, COMMA void *info, COMMA info)

AFTER_SUCCESS(cuGraphExecDestroy, CUgraphExec, forget_exec(x))

#define GRAPH_RUN(name, ptsz)                                                                      \
    EXPORT CUresult name(CUgraphExec x, CUstream s)                                               \
    {                                                                                              \
        REAL(name, CUresult(*)(CUgraphExec, CUstream), f, CUDA_ERROR_NOT_FOUND);                   \
        if (!ON) return f(x, s);                                                                   \
        struct gweight w;                                                                          \
        exec_weight(x, &w);                                                                        \
        if (!w.mask) return f(x, s);                                                               \
        uint64_t k = stream_key(s, ptsz);                                                          \
        struct gback b;                                                                            \
        int e = graph_back_begin(x, &w, k, &b);                                                    \
        if (e) return e;                                                                           \
        CUresult rc = f(x, s);                                                                     \
        graph_back_end(x, k, &b, rc == CUDA_SUCCESS);                                              \
        return rc;                                                                                 \
    }
GRAPH_RUN(cuGraphLaunch, 0)
GRAPH_RUN(cuGraphLaunch_ptsz, 1)
GRAPH_RUN(cuGraphUpload, 0)
GRAPH_RUN(cuGraphUpload_ptsz, 1)

/* A trim may take any graph's memory: the epoch moves first, so that no launch meanwhile counts on
 * memory the trim is giving back. */
EXPORT CUresult cuDeviceGraphMemTrim(CUdevice dev)
{
    REAL(cuDeviceGraphMemTrim, CUresult(*)(CUdevice), f, CUDA_ERROR_NOT_FOUND);
    if (ON) graph_trimmed();
    CUresult rc = f(dev);
    if (ON && rc == CUDA_SUCCESS) settle_pool(0, 1, dev);
    return rc;
}


/* ---- capacity views: total = budget, free = what is left of it (never above the real free) ---- */

static void virtualise(int dev, uint64_t *free_b, uint64_t *total_b)
{
    uint64_t budget = ledger_budget(), used = ledger_job_used(dev);
    uint64_t left = used >= budget ? 0 : budget - used;  /* unusable ledger: used is UINT64_MAX */
    if (*total_b > budget) *total_b = budget;
    if (*free_b > left) *free_b = left;
    if (*free_b > *total_b) *free_b = *total_b;
}

EXPORT CUresult cuMemGetInfo_v2(size_t *free_b, size_t *total_b)
{
    REAL(cuMemGetInfo_v2, CUresult(*)(size_t *, size_t *), f, CUDA_ERROR_NOT_FOUND);
    CUresult rc = f(free_b, total_b);
    if (!ON || rc != CUDA_SUCCESS) return rc;
    uint64_t fr = free_b ? *free_b : UINT64_MAX, to = total_b ? *total_b : UINT64_MAX;
    virtualise(cur_dev(), &fr, &to);
    if (free_b) *free_b = fr;
    if (total_b) *total_b = to;
    return rc;
}

EXPORT CUresult cuMemGetInfo(unsigned int *free_b, unsigned int *total_b)
{
    REAL(cuMemGetInfo, CUresult(*)(unsigned int *, unsigned int *), f, CUDA_ERROR_NOT_FOUND);
    CUresult rc = f(free_b, total_b);
    if (!ON || rc != CUDA_SUCCESS) return rc;
    uint64_t fr = free_b ? *free_b : UINT64_MAX, to = total_b ? *total_b : UINT64_MAX;
    virtualise(cur_dev(), &fr, &to);
    if (free_b) *free_b = (unsigned int)fr;  /* only ever smaller than what the driver wrote */
    if (total_b) *total_b = (unsigned int)to;
    return rc;
}

EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    REAL(cuDeviceTotalMem_v2, CUresult(*)(size_t *, CUdevice), f, CUDA_ERROR_NOT_FOUND);
    CUresult rc = f(bytes, dev);
    if (ON && rc == CUDA_SUCCESS && bytes && *bytes > ledger_budget()) *bytes = ledger_budget();
    return rc;
}

EXPORT CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice dev)
{
    REAL(cuDeviceTotalMem, CUresult(*)(unsigned int *, CUdevice), f, CUDA_ERROR_NOT_FOUND);
    CUresult rc = f(bytes, dev);
    if (ON && rc == CUDA_SUCCESS && bytes && *bytes > ledger_budget()) *bytes = (unsigned int)ledger_budget();
    return rc;
}

/* NVML numbers devices its own way (PCI order); CUDA's ordinals follow CUDA_DEVICE_ORDER (fastest
 * first by default) and CUDA_VISIBLE_DEVICES. Find which CUDA ordinal of this process an NVML
 * device is; -1 when it is not one of the job's devices. */
typedef nvmlReturn_t (*uuid_fn)(nvmlDevice_t, char *, unsigned int);

static int uuid_bytes(const char *s, unsigned char out[16])
{
    if (!strncmp(s, "GPU-", 4) || !strncmp(s, "MIG-", 4)) s += 4;
    int n = 0;
    for (; *s && n < 32; s++) {
        if (*s == '-') continue;
        int v = *s >= '0' && *s <= '9' ? *s - '0' : *s >= 'a' && *s <= 'f' ? *s - 'a' + 10
              : *s >= 'A' && *s <= 'F' ? *s - 'A' + 10 : -1;
        if (v < 0) return 0;
        out[n / 2] = (unsigned char)(n % 2 ? out[n / 2] | v : v << 4);
        n++;
    }
    return n == 32;
}

/* The UUIDs an NVML device answers to: its own, and those of its MIG instances (a job given a
 * MIG instance that asks about the parent GPU asks about its own device). */
static int nvml_uuids(nvmlDevice_t dev, char (*out)[96], int max)
{
    uuid_fn get_uuid = (uuid_fn)real(H_nvmlDeviceGetUUID);
    nvmlReturn_t (*mig_count)(nvmlDevice_t, unsigned int *) =
        (nvmlReturn_t(*)(nvmlDevice_t, unsigned int *))real(H_nvmlDeviceGetMaxMigDeviceCount);
    nvmlReturn_t (*mig_at)(nvmlDevice_t, unsigned int, nvmlDevice_t *) =
        (nvmlReturn_t(*)(nvmlDevice_t, unsigned int, nvmlDevice_t *))real(H_nvmlDeviceGetMigDeviceHandleByIndex);
    int n = 0;
    if (!get_uuid || get_uuid(dev, out[n], 96) != NVML_SUCCESS) return 0;
    n++;
    unsigned int count = 0;
    if (mig_count && mig_at && mig_count(dev, &count) == NVML_SUCCESS)
        for (unsigned int i = 0; i < count && n < max; i++) {
            nvmlDevice_t m;
            if (mig_at(dev, i, &m) == NVML_SUCCESS && get_uuid(m, out[n], 96) == NVML_SUCCESS) n++;
        }
    return n;
}

static int nvml_ordinal(nvmlDevice_t dev)
{
    char uuids[8][96];
    int nu = nvml_uuids(dev, uuids, 8);
    /* CUDA is up in this process: ask it for each ordinal's UUID (exact, whatever the order). */
    CUresult (*count)(int *) = (CUresult(*)(int *))real(H_cuDeviceGetCount);
    CUresult (*cu_uuid)(unsigned char *, CUdevice) = (CUresult(*)(unsigned char *, CUdevice))real(H_cuDeviceGetUuid_v2);
    if (!cu_uuid) cu_uuid = (CUresult(*)(unsigned char *, CUdevice))real(H_cuDeviceGetUuid);
    int n = 0;
    if (nu && cu_uuid && count && count(&n) == CUDA_SUCCESS && n > 0) {
        for (int o = 0; o < n; o++) {
            unsigned char have[16];
            if (cu_uuid(have, o) != CUDA_SUCCESS) continue;
            for (int k = 0; k < nu; k++) {
                unsigned char want[16];
                if (uuid_bytes(uuids[k], want) && !memcmp(want, have, 16)) return o;
            }
        }
        return -1;
    }
    /* No CUDA yet (an NVML-only process): read CUDA_VISIBLE_DEVICES. UUIDs are exact; an index is
     * taken as NVML's (PCI) order, which is CUDA's only with CUDA_DEVICE_ORDER=PCI_BUS_ID (colo
     * pins jobs by UUID). */
    nvmlReturn_t (*get_index)(nvmlDevice_t, unsigned int *) =
        (nvmlReturn_t(*)(nvmlDevice_t, unsigned int *))real(H_nvmlDeviceGetIndex);
    unsigned int idx = 0;
    int have_idx = get_index && get_index(dev, &idx) == NVML_SUCCESS;
    const char *cvd = getenv("CUDA_VISIBLE_DEVICES");
    if (!cvd) return have_idx ? (int)idx : 0;
    int ordinal = 0;
    for (const char *t = cvd; *t; ordinal++) {
        while (*t == ' ') t++;
        size_t len = strcspn(t, ",");
        if ((len > 4 && (!strncmp(t, "GPU-", 4) || !strncmp(t, "MIG-", 4)))) {
            for (int k = 0; k < nu; k++)
                if (len <= strlen(uuids[k]) && !strncmp(uuids[k], t, len)) return ordinal;
        } else {
            char *end;
            long v = strtol(t, &end, 10);
            if (end == t) return -1; /* CUDA stops at the first malformed entry */
            if (have_idx && v == (long)idx) return ordinal;
        }
        t += len;
        if (*t == ',') t++;
    }
    return -1;
}

/* reserved (v2 only): the driver's own share, which a job's view leaves out. */
#define NVML_MEMINFO(name, T, more)                                                                \
    EXPORT nvmlReturn_t name(nvmlDevice_t dev, T *m)                                              \
    {                                                                                              \
        REAL(name, nvmlReturn_t(*)(nvmlDevice_t, T *), f, 13);                                     \
        nvmlReturn_t rc = f(dev, m);                                                               \
        int ord;                                                                                   \
        if (!ON || rc != NVML_SUCCESS || !m || (ord = nvml_ordinal(dev)) < 0) return rc;          \
        uint64_t fr = m->free, to = m->total;                                                      \
        virtualise(ord, &fr, &to);                                                                 \
        m->total = to;                                                                             \
        m->free = fr;                                                                              \
        m->used = to - fr;                                                                         \
        more;                                                                                      \
        return rc;                                                                                 \
    }
NVML_MEMINFO(nvmlDeviceGetMemoryInfo, nvmlMemory_t, (void)0)
NVML_MEMINFO(nvmlDeviceGetMemoryInfo_v2, nvmlMemory_v2_t, m->reserved = 0)

/* ---- cuGetProcAddress ------------------------------------------------------------------------- */

/* Which of our wrappers stands for the versioned function (name, cudaVersion, flags) resolves
 * to. Used only when the driver's pointer is not one we know by address. */
static const struct rule {
    const char *base;
    int v2_from;            /* cudaVersion from which the _v2 ABI is returned (0: one version) */
    int old_id, new_id, ptsz_id;
} rules[] = {
    {"cuMemAlloc", 3020, H_cuMemAlloc, H_cuMemAlloc_v2, -1},
    {"cuMemAllocPitch", 3020, H_cuMemAllocPitch, H_cuMemAllocPitch_v2, -1},
    {"cuMemFree", 3020, H_cuMemFree, H_cuMemFree_v2, -1},
    {"cuMemGetInfo", 3020, H_cuMemGetInfo, H_cuMemGetInfo_v2, -1},
    {"cuDeviceTotalMem", 3020, H_cuDeviceTotalMem, H_cuDeviceTotalMem_v2, -1},
    {"cuArrayCreate", 3020, H_cuArrayCreate, H_cuArrayCreate_v2, -1},
    {"cuArray3DCreate", 3020, H_cuArray3DCreate, H_cuArray3DCreate_v2, -1},
    {"cuGetProcAddress", 12000, H_cuGetProcAddress, H_cuGetProcAddress_v2, -1},
    {"cuMemAllocAsync", 0, H_cuMemAllocAsync, H_cuMemAllocAsync, H_cuMemAllocAsync_ptsz},
    {"cuMemFreeAsync", 0, H_cuMemFreeAsync, H_cuMemFreeAsync, H_cuMemFreeAsync_ptsz},
    {"cuMemAllocFromPoolAsync", 0, H_cuMemAllocFromPoolAsync, H_cuMemAllocFromPoolAsync,
     H_cuMemAllocFromPoolAsync_ptsz},
    {"cuMemAllocManaged", 0, H_cuMemAllocManaged, H_cuMemAllocManaged, -1},
    {"cuMemCreate", 0, H_cuMemCreate, H_cuMemCreate, -1},
    {"cuMemRelease", 0, H_cuMemRelease, H_cuMemRelease, -1},
    {"cuMemMap", 0, H_cuMemMap, H_cuMemMap, -1},
    {"cuMemUnmap", 0, H_cuMemUnmap, H_cuMemUnmap, -1},
    {"cuMemRetainAllocationHandle", 0, H_cuMemRetainAllocationHandle, H_cuMemRetainAllocationHandle, -1},
    {"cuMemExportToShareableHandle", 0, H_cuMemExportToShareableHandle, H_cuMemExportToShareableHandle, -1},
    {"cuMemImportFromShareableHandle", 0, H_cuMemImportFromShareableHandle, H_cuMemImportFromShareableHandle, -1},
    {"cuModuleLoad", 0, H_cuModuleLoad, H_cuModuleLoad, -1},
    {"cuModuleLoadData", 0, H_cuModuleLoadData, H_cuModuleLoadData, -1},
    {"cuModuleLoadDataEx", 0, H_cuModuleLoadDataEx, H_cuModuleLoadDataEx, -1},
    {"cuModuleLoadFatBinary", 0, H_cuModuleLoadFatBinary, H_cuModuleLoadFatBinary, -1},
    {"cuModuleUnload", 0, H_cuModuleUnload, H_cuModuleUnload, -1},
    {"cuLibraryLoadData", 0, H_cuLibraryLoadData, H_cuLibraryLoadData, -1},
    {"cuLibraryLoadFromFile", 0, H_cuLibraryLoadFromFile, H_cuLibraryLoadFromFile, -1},
    {"cuLibraryUnload", 0, H_cuLibraryUnload, H_cuLibraryUnload, -1},
    {"cuMipmappedArrayCreate", 0, H_cuMipmappedArrayCreate, H_cuMipmappedArrayCreate, -1},
    {"cuArrayDestroy", 0, H_cuArrayDestroy, H_cuArrayDestroy, -1},
    {"cuMipmappedArrayDestroy", 0, H_cuMipmappedArrayDestroy, H_cuMipmappedArrayDestroy, -1},
    {"cuDevicePrimaryCtxRetain", 0, H_cuDevicePrimaryCtxRetain, H_cuDevicePrimaryCtxRetain, -1},
    {"cuDevicePrimaryCtxRelease", 11000, H_cuDevicePrimaryCtxRelease, H_cuDevicePrimaryCtxRelease_v2, -1},
    {"cuDevicePrimaryCtxReset", 11000, H_cuDevicePrimaryCtxReset, H_cuDevicePrimaryCtxReset_v2, -1},
    {"cuCtxDestroy", 4000, H_cuCtxDestroy, H_cuCtxDestroy_v2, -1},
    {"cuCtxSetLimit", 0, H_cuCtxSetLimit, H_cuCtxSetLimit, -1},
    {"cuEventRecord", 0, H_cuEventRecord, H_cuEventRecord, H_cuEventRecord_ptsz},
    {"cuEventRecordWithFlags", 0, H_cuEventRecordWithFlags, H_cuEventRecordWithFlags, H_cuEventRecordWithFlags_ptsz},
    {"cuEventSynchronize", 0, H_cuEventSynchronize, H_cuEventSynchronize, -1},
    {"cuEventQuery", 0, H_cuEventQuery, H_cuEventQuery, -1},
    {"cuEventDestroy", 4000, H_cuEventDestroy, H_cuEventDestroy_v2, -1},
    {"cuMemPoolCreate", 0, H_cuMemPoolCreate, H_cuMemPoolCreate, -1},
    {"cuMemPoolDestroy", 0, H_cuMemPoolDestroy, H_cuMemPoolDestroy, -1},
    {"cuDeviceGetDefaultMemPool", 0, H_cuDeviceGetDefaultMemPool, H_cuDeviceGetDefaultMemPool, -1},
    {"cuDeviceGetMemPool", 0, H_cuDeviceGetMemPool, H_cuDeviceGetMemPool, -1},
    {"cuMemPoolTrimTo", 0, H_cuMemPoolTrimTo, H_cuMemPoolTrimTo, -1},
    {"cuMemPoolSetAttribute", 0, H_cuMemPoolSetAttribute, H_cuMemPoolSetAttribute, -1},
    {"cuStreamSynchronize", 0, H_cuStreamSynchronize, H_cuStreamSynchronize, H_cuStreamSynchronize_ptsz},
    {"cuStreamQuery", 0, H_cuStreamQuery, H_cuStreamQuery, H_cuStreamQuery_ptsz},
    {"cuCtxSynchronize", 13000, H_cuCtxSynchronize, H_cuCtxSynchronize_v2, -1},
    {"cuGraphInstantiateWithFlags", 0, H_cuGraphInstantiateWithFlags, H_cuGraphInstantiateWithFlags, -1},
    {"cuGraphInstantiate", 11000, H_cuGraphInstantiate, H_cuGraphInstantiate_v2, -1}, /* and third_abi */
    {"cuGraphInstantiateWithParams", 0, H_cuGraphInstantiateWithParams, H_cuGraphInstantiateWithParams,
     H_cuGraphInstantiateWithParams_ptsz},
    {"cuGraphExecUpdate", 12000, H_cuGraphExecUpdate, H_cuGraphExecUpdate_v2, -1},
    {"cuGraphUpload", 0, H_cuGraphUpload, H_cuGraphUpload, H_cuGraphUpload_ptsz},
    {"cuGraphLaunch", 0, H_cuGraphLaunch, H_cuGraphLaunch, H_cuGraphLaunch_ptsz},
    {"cuGraphExecDestroy", 0, H_cuGraphExecDestroy, H_cuGraphExecDestroy, -1},
    {"cuDeviceGraphMemTrim", 0, H_cuDeviceGraphMemTrim, H_cuDeviceGraphMemTrim, -1},
};

/* Names with a third ABI: from CUDA 12.0, cuGraphInstantiate is cuGraphInstantiateWithFlags. */
static const struct { const char *base; int from, id; } third_abi[] = {
    {"cuGraphInstantiate", 12000, H_cuGraphInstantiateWithFlags},
};

/* Every wrapped driver function, resolved once before pointers are compared (idempotent, so a race
 * only repeats it; no pthread_once: libpthread's before glibc 2.34). */
static int cu_resolved;
static void resolve_all_cu(void)
{
    if (LOAD(&cu_resolved)) return;
    for (int i = 0; i < N_HOOKS; i++)
        if (!is_nvml[i]) real(i);
    STORE(&cu_resolved, 1);
}

/* The newest CUDA version whose ABIs of the names above this library knows. Above it, a driver's
 * answer for a counted name that is not one of the functions we know by address may be a new
 * ABI: wrapping it as an old one would break the call, passing it through would bypass the
 * budget. So the driver is asked again, at this version: the same pointer means the same ABI
 * (CUDA 13.2's cuMemAlloc is 13.0's cuMemAlloc_v2), and it is wrapped as that; another one is
 * refused (fail closed, one line on stderr). */
#define KNOWN_THROUGH 13000

/* The driver's own cuGetProcAddress (v2: _v2's signature), to ask it again. */
struct gpa_ask {
    void *fn;
    int v2;
};

static void *driver_answer(const struct gpa_ask *ask, const char *sym, int ver, cuuint64_t flags)
{
    void *q = NULL;
    CUresult rc;
    if (!ask || !ask->fn) return NULL;
    if (ask->v2) {
        CUdriverProcAddressQueryResult st = 0;
        rc = ((CUresult(*)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *))ask->fn)(
            sym, &q, ver, flags, &st);
    } else {
        rc = ((CUresult(*)(const char *, void **, int, cuuint64_t))ask->fn)(sym, &q, ver, flags);
    }
    return rc == CUDA_SUCCESS ? q : NULL;
}

static int unknown_counted_version(const char *name)
{
    char base[96];
    size_t n = name ? strlen(name) : 0;
    if (n < 4 || n >= sizeof base || name[0] != 'c' || name[1] != 'u') return 0;
    memcpy(base, name, n + 1);
    if (n > 5 && (!strcmp(base + n - 5, "_ptsz") || !strcmp(base + n - 5, "_ptds"))) base[n -= 5] = 0;
    char *v = strrchr(base, '_');
    if (!v || v[1] != 'v' || !v[2]) return 0;
    for (const char *q = v + 2; *q; q++)
        if (*q < '0' || *q > '9') return 0;
    *v = 0;
    for (size_t r = 0; r < sizeof rules / sizeof rules[0]; r++)
        if (!strcmp(rules[r].base, base)) return hook_id(name) < 0;
    return 0;
}

static void *refused_symbol(const char *name, int ver)
{
    static int said;
    if (!__atomic_exchange_n(&said, 1, __ATOMIC_RELAXED)) {
        char buf[256];
        int n = snprintf(buf, sizeof buf,
                         "colo: %s (CUDA %d) is an ABI this library does not know: refused, so that it cannot "
                         "bypass the GPU memory budget\n", name, ver);
        if (n > 0) {
            ssize_t w = write(2, buf, (size_t)n < sizeof buf ? (size_t)n : sizeof buf - 1);
            (void)w;
        }
    }
    return NULL;
}

static void *substitute(const char *sym, void *p, int ver, cuuint64_t flags, const struct gpa_ask *ask)
{
    resolve_all_cu();
    void *const *w = wrappers();
    for (int i = 0; i < N_HOOKS; i++)
        if (!is_nvml[i] && LOAD(&reals[i]) == p) return w[i];
    if (is_ours(p)) return p;
    for (size_t r = 0; r < sizeof rules / sizeof rules[0]; r++) {
        if (strcmp(sym, rules[r].base) != 0) continue;
        if (ver > KNOWN_THROUGH) {
            if (driver_answer(ask, sym, KNOWN_THROUGH, flags) != p) return refused_symbol(sym, ver);
            ver = KNOWN_THROUGH; /* the driver answers with the ABI it had then */
        }
        int id = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) && rules[r].ptsz_id >= 0
                     ? rules[r].ptsz_id
                     : (rules[r].v2_from && ver < rules[r].v2_from ? rules[r].old_id : rules[r].new_id);
        for (size_t k = 0; k < sizeof third_abi / sizeof third_abi[0]; k++)
            if (!strcmp(sym, third_abi[k].base) && ver >= third_abi[k].from) id = third_abi[k].id;
        /* A known ABI the driver answers with an unexported pointer: wrap it by (name, version). */
        void *expect = NULL;
        __atomic_compare_exchange_n(&reals[id], &expect, p, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
        return w[id];
    }
    if (unknown_counted_version(sym)) return refused_symbol(sym, ver);
    return colo_gated(p); /* not an entry point we count: through colo suspend's gate (gate.c) */
}

EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int ver, cuuint64_t flags)
{
    REAL(cuGetProcAddress, CUresult(*)(const char *, void **, int, cuuint64_t), f, CUDA_ERROR_NOT_FOUND);
    CUresult rc = f(symbol, pfn, ver, flags);
    struct gpa_ask ask = {(void *)f, 0};
    if (ON && rc == CUDA_SUCCESS && symbol && pfn && *pfn && !(*pfn = substitute(symbol, *pfn, ver, flags, &ask)))
        rc = CUDA_ERROR_NOT_FOUND;
    return rc;
}

EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int ver, cuuint64_t flags,
                                    CUdriverProcAddressQueryResult *status)
{
    REAL(cuGetProcAddress_v2,
         CUresult(*)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *), f,
         CUDA_ERROR_NOT_FOUND);
    CUresult rc = f(symbol, pfn, ver, flags, status);
    struct gpa_ask ask = {(void *)f, 1};
    if (ON && rc == CUDA_SUCCESS && symbol && pfn && *pfn && !(*pfn = substitute(symbol, *pfn, ver, flags, &ask))) {
        rc = CUDA_ERROR_NOT_FOUND;
        if (status) *status = 2; /* CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT */
    }
    return rc;
}

static void *const *wrappers(void)
{
#define AS_PTR(n, f) (void *)&n,
    static void *const w[N_HOOKS] = {HOOKS(AS_PTR)};
    return w;
}

/* ---- dlsym ------------------------------------------------------------------------------------ */

static int hook_id(const char *name)
{
    if (!name || !((name[0] == 'c' && name[1] == 'u') || !strncmp(name, "nvml", 4))) return -1;
    for (int i = 0; i < N_HOOKS; i++)
        if (!strcmp(name, names[i])) return i;
    return -1;
}

static void *dlsym_hooked(void *handle, const char *name, int id)
{
    void *p;
    if (handle == RTLD_DEFAULT || handle == RTLD_NEXT) {
        p = real(id); /* the driver's own, skipping us */
    } else {
        p = next_dlsym(handle, name); /* an interposer after us answers with its own */
        if (p && is_ours(p)) p = real(id); /* the handle's scope includes us (dlopen(NULL)) */
        else if (p) {
            void *expect = NULL;
            __atomic_compare_exchange_n(&lib_handle[(int)is_nvml[id]], &expect, handle, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE);
            expect = NULL;
            __atomic_compare_exchange_n(&reals[id], &expect, p, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
        }
    }
    return p ? wrappers()[id] : NULL; /* NULL: the library really lacks it; say so */
}

/* Names from a family we count, in a version this library does not know (cuMemAlloc_v3 from a
 * future driver): handing them out unwrapped would let them bypass the budget. */
static int unknown_counted_version(const char *name);
static void *refused_symbol(const char *name, int ver);

static void *dlsym_wrapped(void *handle, const char *name) { return dlsym_hooked(handle, name, hook_id(name)); }
static void *dlsym_refused(void *handle, const char *name) { (void)handle; return refused_symbol(name, 0); }
static void *dlsym_none(void *handle, const char *name) { (void)handle; (void)name; return NULL; }
/* Another driver function from the driver's handle: through colo suspend's gate (gate.c). */
static void *dlsym_gated(void *handle, const char *name)
{
    void *p = next_dlsym(handle, name);
    return p && !is_ours(p) ? colo_gated(p) : p;
}

/* dlsym and dlopen are exported as small trampolines that ask which function answers (the *_target
 * below), then *jump* to it with the program's own return address still on the stack: glibc's
 * dlsym and dlopen find their caller from that address (dlsym: for RTLD_NEXT and the caller's
 * local scope; dlopen: its namespace and its RPATH/RUNPATH), so they must not see us. A tail call
 * in C would do the same only when the compiler chooses to emit one (not at -O0). The caller's
 * return address is also passed on as a third argument (%rdx), which dlsym and dlopen ignore. */
#if defined(__x86_64__)
#define TRAMPOLINE(v234, v225, target)                                                             \
    __asm__(".text\n"                                                                              \
            ".globl " v234 "\n.type " v234 ", @function\n"                                         \
            ".globl " v225 "\n.type " v225 ", @function\n" v234 ":\n" v225 ":\n"                   \
            "    .cfi_startproc\n"                                                                 \
            "    endbr64\n"                                                                        \
            "    push %rdi\n    .cfi_adjust_cfa_offset 8\n"                                        \
            "    push %rsi\n    .cfi_adjust_cfa_offset 8\n"                                        \
            "    mov 16(%rsp), %rdx\n"                   /* the caller's return address */        \
            "    push %rdx\n    .cfi_adjust_cfa_offset 8\n" /* (and the stack 16-byte aligned) */  \
            "    call " target "\n"                                                                \
            "    pop %rdx\n    .cfi_adjust_cfa_offset -8\n"                                        \
            "    pop %rsi\n    .cfi_adjust_cfa_offset -8\n"                                        \
            "    pop %rdi\n    .cfi_adjust_cfa_offset -8\n"                                        \
            "    jmp *%rax\n"                                                                      \
            "    .cfi_endproc\n"                                                                   \
            ".size " v234 ", .-" v234 "\n.size " v225 ", .-" v225 "\n")
#else
#error "the dlsym and dlopen trampolines are written for x86_64 (see hooks.c)"
#endif

/* Which function answers this dlsym: ours for the names we wrap, else the real one. */
__attribute__((used)) void *colo_dlsym_target(void *handle, const char *name)
{
    (void)handle;
    if (ledger_enabled()) {
        if (hook_id(name) >= 0) return (void *)dlsym_wrapped;
        if (unknown_counted_version(name)) return (void *)dlsym_refused;
        /* an explicit handle only: RTLD_NEXT and RTLD_DEFAULT depend on the caller's address */
        if (name && name[0] == 'c' && name[1] == 'u' && handle != RTLD_DEFAULT && handle != RTLD_NEXT)
            return (void *)dlsym_gated;
    }
    if (!LOAD(&next_dlsym_fn)) resolve_dlsym();
    return next_dlsym_fn ? (void *)next_dlsym_fn : (void *)dlsym_none;
}
TRAMPOLINE("colo_dlsym_234", "colo_dlsym_225", "colo_dlsym_target");
__asm__(".symver colo_dlsym_234, dlsym@@GLIBC_2.34");
__asm__(".symver colo_dlsym_225, dlsym@GLIBC_2.2.5");
extern void colo_dlsym_234(void), colo_dlopen_234(void);

/* ---- dlopen: RTLD_DEEPBIND ------------------------------------------------------------------
 *
 * A library opened with RTLD_DEEPBIND looks its symbols up in its own scope (itself and its
 * dependencies: libcuda, libc) before the global one, where the preloaded library is: its calls
 * into the driver and its own dlsym would bypass the budget (by accident, often). So such a
 * dlopen is made here, with the flag kept, and then each object it loaded has its references to
 * the functions we wrap, and to dlsym and dlopen, bound to ours (gotpatch.c): the library keeps
 * its own symbols first, only the driver's and the loader's are ours. Made from here, the dlopen
 * would search our RPATH (none) instead of the caller's: a bare name is looked up first in the
 * caller's RPATH/RUNPATH and LD_LIBRARY_PATH (dlinfo RTLD_DI_SERINFO of the caller's object). Any
 * other dlopen goes straight to the real one. */

static void *(*real_dlopen_fn)(const char *, int);

static void *(*real_dlopen(void))(const char *, int)
{
    void *(*f)(const char *, int) = LOAD(&real_dlopen_fn);
    if (!f && dlvsym) {
        void *p = dlvsym(RTLD_NEXT, "dlopen", "GLIBC_2.34");
        if (!p) p = dlvsym(RTLD_NEXT, "dlopen", "GLIBC_2.2.5");
        f = (void *(*)(const char *, int))p;
        STORE(&real_dlopen_fn, f);
    }
    return f;
}

static void *our_export(const char *name)
{
    if (!strcmp(name, "dlsym")) return (void *)colo_dlsym_234;
    if (!strcmp(name, "dlopen")) return (void *)colo_dlopen_234;
    int id = hook_id(name);
    return id >= 0 ? wrappers()[id] : NULL;
}

/* The first of a ':'-separated list of folders ($ORIGIN: the object's own) holding file. */
static int search_dirs(const char *list, const char *origin, const char *file, char *out, size_t n)
{
    for (const char *d = list; d && *d;) {
        size_t len = strcspn(d, ":");
        const char *rest = d, *base = "";
        size_t restlen = len;
        if (origin && len >= 7 && !strncmp(d, "$ORIGIN", 7)) base = origin, rest = d + 7, restlen = len - 7;
        else if (origin && len >= 9 && !strncmp(d, "${ORIGIN}", 9)) base = origin, rest = d + 9, restlen = len - 9;
        int w = len ? snprintf(out, n, "%s%.*s/%s", base, (int)restlen, rest, file) : -1;
        if (w > 0 && (size_t)w < n && access(out, F_OK) == 0) return 1;
        d += len + (d[len] == ':');
    }
    return 0;
}

/* Where the caller's own search path finds a bare name, in the dynamic linker's order: its
 * DT_RPATH; or LD_LIBRARY_PATH, then its DT_RUNPATH. 0 when neither does (then the caches and
 * default folders, which are the same from anywhere). Read from the caller's dynamic section
 * (dlinfo's RTLD_DI_SERINFO leaves out the main program's). */
static int caller_path(const char *file, void *caller, char *out, size_t n)
{
    Dl_info info;
    struct link_map *lm = NULL;
    if (!dladdr1 || !dladdr1(caller, &info, (void **)&lm, RTLD_DL_LINKMAP) || !lm || !lm->l_ld) return 0;
    const char *strtab = NULL;
    long rpath = -1, runpath = -1;
    for (const ElfW(Dyn) *d = lm->l_ld; d->d_tag != DT_NULL; d++) {
        if (d->d_tag == DT_STRTAB) strtab = (const char *)(d->d_un.d_ptr < lm->l_addr ? lm->l_addr + d->d_un.d_ptr : d->d_un.d_ptr);
        else if (d->d_tag == DT_RPATH) rpath = (long)d->d_un.d_val;
        else if (d->d_tag == DT_RUNPATH) runpath = (long)d->d_un.d_val;
    }
    if (!strtab || (rpath < 0 && runpath < 0)) return 0;
    char origin[4096];
    const char *self = lm->l_name && *lm->l_name ? lm->l_name : NULL;
    ssize_t k = self ? (ssize_t)snprintf(origin, sizeof origin, "%s", self) : readlink("/proc/self/exe", origin, sizeof origin - 1);
    if (k <= 0 || (size_t)k >= sizeof origin) return 0;
    origin[k] = 0;
    char *slash = strrchr(origin, '/');
    if (!slash) return 0;
    *slash = 0;
    if (runpath >= 0)
        return search_dirs(getenv("LD_LIBRARY_PATH"), NULL, file, out, n) ||
               search_dirs(strtab + runpath, origin, file, out, n);
    return search_dirs(strtab + rpath, origin, file, out, n);
}

static void *dlopen_deep(const char *file, int mode, void *caller)
{
    char path[4096];
    void *(*f)(const char *, int) = real_dlopen();
    if (!f) return NULL;
    if (file && !strchr(file, '/') && caller_path(file, caller, path, sizeof path)) file = path;
    void *h = f(file, mode);
    if (h) got_patch_from(h, our_export);
    return h;
}

static void *dlopen_none(const char *file, int mode) { (void)file; (void)mode; return NULL; }

__attribute__((used)) void *colo_dlopen_target(const char *file, int mode, void *caller)
{
    (void)file;
    (void)caller;
    if (ledger_enabled() && (mode & RTLD_DEEPBIND)) return (void *)dlopen_deep;
    void *(*f)(const char *, int) = real_dlopen();
    return f ? (void *)f : (void *)dlopen_none;
}
TRAMPOLINE("colo_dlopen_234", "colo_dlopen_225", "colo_dlopen_target");
__asm__(".symver colo_dlopen_234, dlopen@@GLIBC_2.34");
__asm__(".symver colo_dlopen_225, dlopen@GLIBC_2.2.5");

/* ---- process set-up: read the environment only; the ledger opens at the first counted call --- */

static void before_fork(void) { ledger_atfork_prepare(); table_atfork_prepare(); }
static void after_fork_parent(void) { table_atfork_parent(); ledger_atfork_parent(); }
static void after_fork_child(void)
{
    /* The child has no CUDA context of the parent's: none of its pools, pending frees or graphs. */
    pools_atfork_child();
    g_npend = 0;
    g_nevents = 0;
    g_gstream = 0;
    /* a thread of the parent may have been inside a load: the child would wait on its lock for good */
    pthread_mutex_init(&g_load_mu, NULL);
    /* nor a teardown under way on another thread of the parent */
    g_teardown_mu = 0;
    colo_teardowns_done = colo_teardowns_begun;
    table_atfork_child();
    ledger_atfork_child();
}

/* Set up once, by the first thread to need it; others wait for it (a yield loop: pthread_once is
 * libpthread's before glibc 2.34). What the setup itself calls passes through unchanged. */
static int g_setup; /* 0: not begun, 1: under way, 2: done */
static __thread int t_in_setup __attribute__((tls_model("initial-exec")));

int colo_interpose_setup(void)
{
    int s = 0;
    if (__atomic_compare_exchange_n(&g_setup, &s, 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
        t_in_setup = 1;
        resolve_dlsym();
        int on = ledger_env_init();
        table_env_init();
        const char *m = getenv("COLO_GPU_MANAGED");
        if (m && !strcmp(m, "none")) g_managed_none = 1;
        else if (m && *m && strcmp(m, "full") && on)
            fprintf(stderr, "colo: COLO_GPU_MANAGED=%s is not full or none: managed memory is charged in full\n", m);
        if (on) pthread_atfork(before_fork, after_fork_parent, after_fork_child);
        t_in_setup = 0;
        __atomic_store_n(&colo_ledger_on, on, __ATOMIC_RELEASE);
        __atomic_store_n(&g_setup, 2, __ATOMIC_RELEASE);
    } else if (s == 1) {
        if (t_in_setup) return 0;
        while (__atomic_load_n(&g_setup, __ATOMIC_ACQUIRE) != 2) sched_yield();
    }
    return __atomic_load_n(&colo_ledger_on, __ATOMIC_ACQUIRE);
}

__attribute__((constructor)) static void colo_interpose_init(void) { (void)ledger_enabled(); }
