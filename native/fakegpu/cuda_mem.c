/* Fake libcuda.so.1: every allocation family takes bytes from the simulated device in the state
 * file (so a full device answers CUDA_ERROR_OUT_OF_MEMORY to every process) and gives them back on
 * free, on context destruction, or (through slot reaping) when the process dies. Pointers are
 * made-up device addresses: nothing is mapped on the host. */
#include "cuda_internal.h"

#include <stdlib.h>
#include <string.h>

#define NBUCKET 4096
#define GRANULE (2ull << 20)
static struct alloc *g_tab[NBUCKET];
static uint64_t g_next_addr = 0x7f2000000000ull;


static unsigned bucket(uint64_t p) { return (unsigned)((p >> 9) * 0x9E3779B97F4A7C15ull >> 52) % NBUCKET; }

/* Freed address ranges, most recent last: like the real driver, a new allocation of the same
 * span gets a just-freed address back (callers that key by address must cope). */
#define NREUSE 64
static struct { uint64_t ptr, span; } g_reuse[NREUSE];
static int g_nreuse;

static uint64_t span_of(uint64_t size) { return (size + GRANULE - 1) / GRANULE * GRANULE + GRANULE; /* a guard gap */ }

static uint64_t new_addr(uint64_t size)
{
    uint64_t span = span_of(size);
    for (int i = g_nreuse - 1; i >= 0 && i >= g_nreuse - 8; i--)
        if (g_reuse[i].span == span) {
            uint64_t p = g_reuse[i].ptr;
            g_reuse[i] = g_reuse[--g_nreuse];
            return p;
        }
    uint64_t p = g_next_addr;
    g_next_addr += span;
    return p;
}

static void forget_addr(uint64_t ptr, uint64_t size)
{
    if (g_nreuse == NREUSE) {
        memmove(g_reuse, g_reuse + 1, sizeof g_reuse[0] * (NREUSE - 1));
        g_nreuse--;
    }
    g_reuse[g_nreuse].ptr = ptr;
    g_reuse[g_nreuse++].span = span_of(size);
}

struct alloc *fg_find(uint64_t p)
{
    for (struct alloc *a = g_tab[bucket(p)]; a; a = a->next)
        if (a->ptr == p)
            return a;
    return NULL;
}

struct alloc *fg_unlink(uint64_t p, int kind)
{
    for (struct alloc **pp = &g_tab[bucket(p)]; *pp; pp = &(*pp)->next)
        if ((*pp)->ptr == p && (*pp)->kind == kind) {
            struct alloc *a = *pp;
            *pp = a->next;
            return a;
        }
    return NULL;
}

/* Device bytes of the calling process on ordinal ord (an MPS client is held to its pinned limit). */
CUresult fg_dev_take(int ord, uint64_t size)
{
    int phys = g_vis[ord];
    CUresult r = CUDA_SUCCESS;
    fg_lock(&S);
    struct fg_device *dv = &S.h->dev[phys];
    struct fg_slot *sl = &S.h->slot[g_slot];
    if (sl->limit[phys] && (size > sl->limit[phys] || sl->used[phys] > sl->limit[phys] - size))
        r = CUDA_ERROR_OUT_OF_MEMORY; /* MPS pinned device memory limit */
    else if (size > dv->total - dv->used) {
        fg_reap(&S); /* memory of processes that died since is free again */
        if (size > dv->total - dv->used)
            r = CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (!r) {
        sl->used[phys] += size;
        dv->used += size;
    }
    fg_unlock(&S);
    return r;
}

/* Give bytes back to the device (the daemon already did if the client was terminated). */
void fg_dev_give(int ord, uint64_t size)
{
    if (!size)
        return;
    fg_lock(&S);
    struct fg_slot *sl = &S.h->slot[g_slot];
    if (!(sl->flags & FG_F_TERMINATED)) {
        int phys = g_vis[ord];
        sl->used[phys] -= size;
        S.h->dev[phys].used -= size;
    }
    fg_unlock(&S);
}

/* Forget an allocation record; its bytes go back to the device, or to its pool. */
void fg_release_alloc(struct alloc *a)
{
    if (a->pool)
        fg_pool_return(a->pool, a->size, NULL);
    else if (a->kind != K_VA)
        fg_dev_give(a->ord, a->size);
    if (!a->fixed)
        forget_addr(a->ptr, a->size);
    free(a);
}
#define give_back fg_release_alloc

/* A record for an allocation whose bytes the caller already took (from the device or a pool). */
CUresult fg_record(int ord, uint64_t size, int kind, struct fg_ctx *ctx, struct fg_pool *pool, uint64_t at,
                   unsigned long long *out)
{
    struct alloc *a = calloc(1, sizeof *a);
    if (!a)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *a = (struct alloc){.ptr = at ? at : new_addr(size), .size = size, .ord = ord, .kind = kind, .fixed = at != 0,
                        .ctx = ctx, .pool = pool};
    unsigned b = bucket(a->ptr);
    a->next = g_tab[b];
    g_tab[b] = a;
    *out = a->ptr;
    return CUDA_SUCCESS;
}

/* Take size bytes on ordinal ord for an allocation of kind in ctx; *out gets its address. */
static CUresult take(int ord, uint64_t size, int kind, struct fg_ctx *ctx, unsigned long long *out)
{
    if (size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = kind == K_VA ? CUDA_SUCCESS : fg_dev_take(ord, size);
    if (!r && (r = fg_record(ord, size, kind, ctx, NULL, 0, out)) && kind != K_VA)
        fg_dev_give(ord, size);
    return r;
}

void fg_mem_drop_ctx(struct fg_ctx *c)
{
    for (unsigned b = 0; b < NBUCKET; b++)
        for (struct alloc **pp = &g_tab[b]; *pp;) {
            struct alloc *a = *pp;
            if (a->ctx == c) {
                *pp = a->next;
                give_back(a);
            } else {
                pp = &a->next;
            }
        }
    fg_async_drop_ctx(c);
}

void fg_mem_reset(void)
{
    g_nreuse = 0;
    fg_async_reset();
    for (unsigned b = 0; b < NBUCKET; b++)
        for (struct alloc *a = g_tab[b], *n; a; a = n) {
            n = a->next;
            free(a);
        }
    memset(g_tab, 0, sizeof g_tab);
}

/* Allocation in the calling thread's current context. */
static CUresult ctx_take(uint64_t size, int kind, CUdeviceptr *out)
{
    struct fg_ctx *c;
    CUresult r = fg_current(&c);
    if (r)
        return r;
    if (!out)
        return CUDA_ERROR_INVALID_VALUE;
    return take(c->ord, size, kind, c, out);
}

static CUresult ctx_give(uint64_t p, int kind)
{
    struct fg_ctx *c;
    CUresult r = fg_current(&c);
    if (r)
        return r;
    if (p == 0)
        return CUDA_SUCCESS;
    struct alloc *a = fg_unlink(p, kind);
    if (!a)
        return CUDA_ERROR_INVALID_VALUE;
    give_back(a);
    return CUDA_SUCCESS;
}

FG_API CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) { LOCKED(ctx_take(n, K_MEM, p)); }
FG_API CUresult cuMemFree_v2(CUdeviceptr p) { LOCKED(ctx_give(p, K_MEM)); }
/* Fake only (tests): a made-up newer ABI, answered by cuGetProcAddress("cuMemAlloc") from 14000. */
FG_API CUresult cuMemAlloc_v3(CUdeviceptr *p, size_t n) { LOCKED(ctx_take(n, K_MEM, p)); }
/* Fake only (tests): free as a path an interposer does not see would, e.g. a teardown it missed. */
FG_API CUresult fakegpuLoseAllocation(CUdeviceptr p) { LOCKED(ctx_give(p, K_MEM)); }

/* CU_POINTER_ATTRIBUTE_CONTEXT (1), MEMORY_TYPE (2: device), DEVICE_ORDINAL (9), of an allocation's
 * own address (the simulated driver knows no interior pointers); an address it did not hand out,
 * or one freed since (with its context, say), is CUDA_ERROR_INVALID_VALUE. */
static CUresult pointer_attr(void *out, int attr, CUdeviceptr p)
{
    CUresult r = fg_check_live();
    if (r)
        return r;
    struct alloc *a = fg_find(p);
    if (!out || !a || (a->kind != K_MEM && a->kind != K_LIMIT))
        return CUDA_ERROR_INVALID_VALUE;
    switch (attr) {
    case 1: *(struct fg_ctx **)out = a->ctx; return CUDA_SUCCESS;
    case 2: *(unsigned *)out = 2; return CUDA_SUCCESS;
    case 9: *(int *)out = a->ord; return CUDA_SUCCESS;
    default: return CUDA_ERROR_INVALID_VALUE;
    }
}
FG_API CUresult cuPointerGetAttribute(void *out, int attr, CUdeviceptr p) { LOCKED(pointer_attr(out, attr, p)); }

FG_API CUresult cuMemAllocManaged(CUdeviceptr *p, size_t n, unsigned flags)
{
    if (flags != 1 && flags != 2) /* CU_MEM_ATTACH_GLOBAL / CU_MEM_ATTACH_HOST */
        return CUDA_ERROR_INVALID_VALUE;
    LOCKED(ctx_take(n, K_MEM, p));
}

FG_API CUresult cuMemAllocPitch_v2(CUdeviceptr *p, size_t *pitch, size_t width, size_t height, unsigned elem)
{
    if (!pitch || (elem != 4 && elem != 8 && elem != 16) || width == 0 || height == 0)
        return CUDA_ERROR_INVALID_VALUE;
    size_t pt = (width + 511) / 512 * 512;
    pthread_mutex_lock(&g_mu);
    CUresult r = ctx_take((uint64_t)pt * height, K_MEM, p);
    pthread_mutex_unlock(&g_mu);
    if (r == CUDA_SUCCESS)
        *pitch = pt;
    return r;
}

static CUresult mem_info(size_t *free_b, size_t *total_b)
{
    struct fg_ctx *c;
    CUresult r = fg_current(&c);
    if (r)
        return r;
    if (!free_b || !total_b)
        return CUDA_ERROR_INVALID_VALUE;
    int phys = g_vis[c->ord];
    fg_lock(&S);
    fg_reap(&S);
    struct fg_device *dv = &S.h->dev[phys];
    struct fg_slot *sl = &S.h->slot[g_slot];
    uint64_t total = dv->total, avail = dv->total - dv->used;
    if (sl->limit[phys]) { /* an MPS client sees its pinned limit as the device */
        uint64_t own = sl->limit[phys] > sl->used[phys] ? sl->limit[phys] - sl->used[phys] : 0;
        total = sl->limit[phys];
        avail = avail < own ? avail : own;
    }
    fg_unlock(&S);
    *free_b = (size_t)avail;
    *total_b = (size_t)total;
    return CUDA_SUCCESS;
}
FG_API CUresult cuMemGetInfo_v2(size_t *free_b, size_t *total_b) { LOCKED(mem_info(free_b, total_b)); }
FG_API CUresult cuMemGetInfo(unsigned *free_b, unsigned *total_b)
{
    size_t f = 0, t = 0;
    if (!free_b || !total_b)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    CUresult r = mem_info(&f, &t);
    pthread_mutex_unlock(&g_mu);
    *free_b = f > 0xffffffffu ? 0xffffffffu : (unsigned)f;
    *total_b = t > 0xffffffffu ? 0xffffffffu : (unsigned)t;
    return r;
}

/* Pre-3.2 entry points took 32-bit device pointers, which cannot hold this driver's addresses. */
FG_API CUresult cuMemAlloc(unsigned *p, unsigned n) { (void)p; (void)n; return CUDA_ERROR_NOT_SUPPORTED; }
FG_API CUresult cuMemFree(unsigned p) { (void)p; return CUDA_ERROR_NOT_SUPPORTED; }

static CUresult memset_check(CUdeviceptr p, uint64_t bytes)
{
    struct fg_ctx *c;
    CUresult r = fg_current(&c);
    if (r)
        return r;
    if (bytes == 0)
        return CUDA_SUCCESS;
    for (unsigned b = 0; b < NBUCKET; b++)
        for (struct alloc *a = g_tab[b]; a; a = a->next)
            if ((a->kind == K_MEM || a->kind == K_VA) && p >= a->ptr && p - a->ptr < a->size)
                return bytes <= a->size - (p - a->ptr) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    return CUDA_ERROR_INVALID_VALUE;
}
FG_API CUresult cuMemsetD8_v2(CUdeviceptr p, unsigned char v, size_t n)
{
    (void)v;
    LOCKED(memset_check(p, n));
}
FG_API CUresult cuMemsetD32_v2(CUdeviceptr p, unsigned v, size_t n)
{
    (void)v;
    if (p % 4)
        return CUDA_ERROR_INVALID_VALUE;
    LOCKED(memset_check(p, (uint64_t)n * 4));
}
FG_API CUresult cuMemsetD8_v2_ptds(CUdeviceptr p, unsigned char v, size_t n) __attribute__((alias("cuMemsetD8_v2")));
FG_API CUresult cuMemsetD32_v2_ptds(CUdeviceptr p, unsigned v, size_t n) __attribute__((alias("cuMemsetD32_v2")));

/* ---- arrays ---------------------------------------------------------------------------- */

typedef struct { size_t Width, Height; int Format; unsigned NumChannels; } ARRAY_DESC;
typedef struct { size_t Width, Height, Depth; int Format; unsigned NumChannels, Flags; } ARRAY3D_DESC;

/* Bits per texel of a plain format's channel (times NumChannels), or of a whole texel of the
 * others (-bits); block-compressed formats answer 0 (sized by 4x4 blocks). -1: not a format. */
static int fmt_bits(int f)
{
    switch (f) {
    case 0x01: case 0x08: return 8;
    case 0x02: case 0x09: case 0x10: return 16;
    case 0x03: case 0x0a: case 0x20: return 32;
    case 0xc0: case 0xc6: return -8;
    case 0xc1: case 0xc7: case 0xc3: case 0xc9: return -16;
    case 0xc2: case 0xc8: case 0xc4: case 0xca: return -32;
    case 0xc5: case 0xcb: return -64;
    case 0xb0: case 0x53: case 0x59: return -12;                       /* 8-bit 4:2:0 */
    case 0x9f: case 0xa1: case 0x54: case 0x5a: return -24;            /* 16-bit 4:2:0 */
    case 0xa2: case 0xa5: case 0x51: case 0x55: case 0x5b: return -16; /* 8-bit 4:2:2 */
    case 0xa3: case 0xa4: case 0xa6: case 0xa7: case 0x56: case 0x5c: return -32;
    case 0xb2: case 0xb4: case 0x57: case 0x5d: return -24;            /* 8-bit 4:4:4 */
    case 0xb3: case 0xb5: case 0x58: case 0x5e: return -48;
    case 0xa8: case 0xa9: case 0x50: case 0x52: return -32;
    case 0xb1: return -64;
    default: return f >= 0x91 && f <= 0x9e ? 0 : -1;
    }
}

static CUresult array_bytes(size_t w, size_t h, size_t d, int fmt, unsigned ch, uint64_t *out)
{
    int bits = fmt_bits(fmt);
    if (bits == -1 || (bits > 0 && ch != 1 && ch != 2 && ch != 4) || w == 0)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t hh = h ? h : 1, dd = d ? d : 1;
    if (bits == 0) { /* BC1, BC4: 8 bytes a 4x4 block; BC2, BC3, BC5, BC6H, BC7: 16 */
        uint64_t block = fmt <= 0x92 || fmt == 0x97 || fmt == 0x98 ? 8 : 16;
        *out = (uint64_t)((w + 3) / 4) * ((hh + 3) / 4) * dd * block;
    } else {
        uint64_t texel_bits = bits > 0 ? (uint64_t)bits * ch : (uint64_t)-bits;
        *out = ((uint64_t)w * hh * dd * texel_bits + 7) / 8;
    }
    return CUDA_SUCCESS;
}

static CUresult array_take(void **out, uint64_t bytes, int kind)
{
    CUdeviceptr p;
    CUresult r = ctx_take(bytes, kind, &p);
    if (r == CUDA_SUCCESS)
        *out = (void *)(uintptr_t)p;
    return r;
}

static CUresult array_create(CUarray *arr, const ARRAY_DESC *d)
{
    uint64_t n;
    CUresult r;
    if (!arr || !d)
        return CUDA_ERROR_INVALID_VALUE;
    if ((r = array_bytes(d->Width, d->Height, 0, d->Format, d->NumChannels, &n)))
        return r;
    return array_take(arr, n, K_ARRAY);
}
FG_API CUresult cuArrayCreate_v2(CUarray *arr, const ARRAY_DESC *d) { LOCKED(array_create(arr, d)); }

static CUresult array3d_create(CUarray *arr, const ARRAY3D_DESC *d)
{
    uint64_t n;
    CUresult r;
    if (!arr || !d)
        return CUDA_ERROR_INVALID_VALUE;
    if ((r = array_bytes(d->Width, d->Height, d->Depth, d->Format, d->NumChannels, &n)))
        return r;
    return array_take(arr, n, K_ARRAY);
}
FG_API CUresult cuArray3DCreate_v2(CUarray *arr, const ARRAY3D_DESC *d) { LOCKED(array3d_create(arr, d)); }

FG_API CUresult cuArrayDestroy(CUarray arr)
{
    if (!arr)
        return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&g_mu);
    CUresult r = ctx_give((uint64_t)(uintptr_t)arr, K_ARRAY);
    pthread_mutex_unlock(&g_mu);
    return r == CUDA_ERROR_INVALID_VALUE ? CUDA_ERROR_INVALID_HANDLE : r;
}

/* The descriptor of a live array; one freed (with its context, say) is an invalid handle. */
/* The live array (or mipmapped array) h is, for a query: a handle freed, with its context say, is
 * invalid; *r says why there is none. */
static struct alloc *live_array(uint64_t h, int kind, const void *out, CUresult *r)
{
    struct alloc *a = NULL;
    if ((*r = fg_check_live()))
        return NULL;
    if (!(a = fg_find(h)) || a->kind != kind)
        *r = CUDA_ERROR_INVALID_HANDLE;
    else if (!out)
        *r = CUDA_ERROR_INVALID_VALUE;
    return *r ? NULL : a;
}

static CUresult array_descriptor(ARRAY_DESC *d, CUarray arr)
{
    CUresult r;
    struct alloc *a = live_array((uint64_t)(uintptr_t)arr, K_ARRAY, d, &r);
    if (!a)
        return r;
    memset(d, 0, sizeof *d);
    d->Width = a->size; /* its bytes, as 1-byte texels of one row: what the simulation keeps */
    d->Height = 1;
    d->Format = 0x08;
    d->NumChannels = 1;
    return CUDA_SUCCESS;
}
FG_API CUresult cuArrayGetDescriptor_v2(ARRAY_DESC *d, CUarray arr) { LOCKED(array_descriptor(d, arr)); }

static CUresult mipmap_create(CUmipmappedArray *h, const ARRAY3D_DESC *d, unsigned levels)
{
    uint64_t total = 0, n;
    CUresult r;
    if (!h || !d || levels == 0)
        return CUDA_ERROR_INVALID_VALUE;
    size_t w = d->Width, hh = d->Height, dd = d->Depth;
    for (unsigned l = 0; l < levels; l++) {
        if ((r = array_bytes(w, hh, dd, d->Format, d->NumChannels, &n)))
            return r;
        total += n;
        w = w > 1 ? w / 2 : 1;
        hh = hh > 1 ? hh / 2 : hh;
        dd = dd > 1 ? dd / 2 : dd;
    }
    return array_take(h, total, K_MIPMAP);
}
FG_API CUresult cuMipmappedArrayCreate(CUmipmappedArray *h, const ARRAY3D_DESC *d, unsigned levels)
{
    LOCKED(mipmap_create(h, d, levels));
}
/* Level 0 of a live mipmapped array is the array itself here (no separate level records). */
static CUresult mipmap_level(CUarray *out, CUmipmappedArray h, unsigned level)
{
    CUresult r;
    if (!live_array((uint64_t)(uintptr_t)h, K_MIPMAP, out, &r))
        return r;
    if (level)
        return CUDA_ERROR_INVALID_VALUE;
    *out = (CUarray)h;
    return CUDA_SUCCESS;
}
FG_API CUresult cuMipmappedArrayGetLevel(CUarray *out, CUmipmappedArray h, unsigned level) { LOCKED(mipmap_level(out, h, level)); }

FG_API CUresult cuMipmappedArrayDestroy(CUmipmappedArray h)
{
    if (!h)
        return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&g_mu);
    CUresult r = ctx_give((uint64_t)(uintptr_t)h, K_MIPMAP);
    pthread_mutex_unlock(&g_mu);
    return r == CUDA_ERROR_INVALID_VALUE ? CUDA_ERROR_INVALID_HANDLE : r;
}

/* ---- virtual memory management ----------------------------------------------------------- */

typedef struct {
    int type, requestedHandleTypes;
    struct { int type, id; } location;
    void *win32HandleMetaData;
    unsigned char compressionType, gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
} MEM_PROP;

static CUresult prop_ordinal(const MEM_PROP *p, int *ord)
{
    if (!p || p->type != 1 /* PINNED */ || p->location.type != 1 /* DEVICE */)
        return CUDA_ERROR_INVALID_VALUE;
    if (p->location.id < 0 || p->location.id >= g_nvis)
        return CUDA_ERROR_INVALID_DEVICE;
    *ord = p->location.id;
    return CUDA_SUCCESS;
}

static CUresult mem_create(CUmemGenericAllocationHandle *h, size_t size, const MEM_PROP *prop, unsigned long long flags)
{
    int ord;
    CUresult r = fg_check_live();
    if (r)
        return r;
    if (!h || flags != 0 || size == 0 || size % GRANULE)
        return CUDA_ERROR_INVALID_VALUE;
    if ((r = prop_ordinal(prop, &ord)))
        return r;
    return take(ord, size, K_HANDLE, NULL, h); /* handles outlive contexts: freed by cuMemRelease */
}
FG_API CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t size, const MEM_PROP *prop, unsigned long long flags)
{
    LOCKED(mem_create(h, size, prop, flags));
}

static CUresult mem_release(CUmemGenericAllocationHandle h)
{
    CUresult r = fg_check_live();
    if (r)
        return r;
    struct alloc *a = fg_unlink(h, K_HANDLE);
    if (!a)
        return CUDA_ERROR_INVALID_VALUE;
    if (a->shared)
        fg_share_release(a); /* exported or imported: the last reference anywhere frees it */
    else
        give_back(a);
    return CUDA_SUCCESS;
}
FG_API CUresult cuMemRelease(CUmemGenericAllocationHandle h) { LOCKED(mem_release(h)); }

FG_API CUresult cuMemGetAllocationGranularity(size_t *g, const MEM_PROP *prop, int option)
{
    int ord;
    (void)option;
    pthread_mutex_lock(&g_mu);
    CUresult r = fg_check_live();
    if (!r)
        r = g ? prop_ordinal(prop, &ord) : CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_unlock(&g_mu);
    if (!r)
        *g = GRANULE;
    return r;
}

static CUresult va_reserve(CUdeviceptr *p, size_t size, size_t align, CUdeviceptr addr, unsigned long long flags)
{
    (void)align;
    (void)addr;
    CUresult r = fg_check_live();
    if (r)
        return r;
    if (!p || flags != 0 || size == 0 || size % GRANULE)
        return CUDA_ERROR_INVALID_VALUE;
    return take(0, size, K_VA, NULL, p);
}
FG_API CUresult cuMemAddressReserve(CUdeviceptr *p, size_t size, size_t align, CUdeviceptr addr, unsigned long long flags)
{
    LOCKED(va_reserve(p, size, align, addr, flags));
}

static CUresult va_free(CUdeviceptr p, size_t size)
{
    CUresult r = fg_check_live();
    if (r)
        return r;
    struct alloc *a = fg_find(p);
    if (!a || a->kind != K_VA || a->size != size)
        return CUDA_ERROR_INVALID_VALUE;
    give_back(fg_unlink(p, K_VA));
    return CUDA_SUCCESS;
}
FG_API CUresult cuMemAddressFree(CUdeviceptr p, size_t size) { LOCKED(va_free(p, size)); }

static CUresult va_map(CUdeviceptr p, size_t size, CUmemGenericAllocationHandle h)
{
    CUresult r = fg_check_live();
    if (r)
        return r;
    struct alloc *a = fg_find(h);
    if (!a || a->kind != K_HANDLE || size == 0 || size > a->size || p == 0)
        return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}
FG_API CUresult cuMemMap(CUdeviceptr p, size_t size, size_t offset, CUmemGenericAllocationHandle h, unsigned long long flags)
{
    (void)offset;
    (void)flags;
    LOCKED(va_map(p, size, h));
}
FG_API CUresult cuMemUnmap(CUdeviceptr p, size_t size)
{
    (void)size;
    pthread_mutex_lock(&g_mu);
    CUresult r = fg_check_live();
    pthread_mutex_unlock(&g_mu);
    return r ? r : p ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
FG_API CUresult cuMemSetAccess(CUdeviceptr p, size_t size, const void *desc, size_t count)
{
    (void)size;
    pthread_mutex_lock(&g_mu);
    CUresult r = fg_check_live();
    pthread_mutex_unlock(&g_mu);
    return r ? r : (p && desc && count) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* ---- context limits --------------------------------------------------------------------- */

/* Setting a limit that the driver backs with device memory takes that memory for the context.
 * What it takes (the same rule as the interposer's, native/interpose/hooks.c: limit_bytes):
 *   0 stack size: per resident thread, value x SMs x 2048;
 *   1 printf FIFO, 2 malloc heap: the value;
 *   3 device-runtime sync depth: per level, the saved state of every resident thread, assumed
 *     1 KiB each (a register file's worth: 255 32-bit registers), value x SMs x 2048 x 1 KiB;
 *   4 device-runtime pending launch count: per launch slot, assumed 4 KiB (a kernel's parameter
 *     buffer), value x 4 KiB.
 * 3 and 4 are assumptions (the driver documents only that it reserves memory for them: up to
 * 150 MB per sync level on the GPUs of its day); the defaults (1 KiB stack, 1 MiB FIFO, 8 MiB heap,
 * depth 2, 2048 launches) take none here: like the context itself, they are not modelled. */
static uint64_t limit_bytes(int limit, size_t value, uint32_t sms)
{
    switch (limit) {
    case 0: return (uint64_t)value * sms * 2048;
    case 3: return (uint64_t)value * sms * 2048 * 1024;
    case 4: return (uint64_t)value * 4096;
    default: return value;
    }
}

static CUresult set_limit(int limit, size_t value)
{
    struct fg_ctx *c;
    CUresult r = fg_current(&c);
    if (r)
        return r;
    if (limit < 0 || limit > 4)
        return limit <= 6 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE; /* others hold no memory */
    uint64_t bytes = limit_bytes(limit, value, S.h->dev[g_vis[c->ord]].sms);
    unsigned long long p = 0;
    if (bytes && (r = take(c->ord, bytes, K_LIMIT, c, &p)))
        return r;
    if (c->limit_ptr[limit]) {
        struct alloc *a = fg_unlink(c->limit_ptr[limit], K_LIMIT);
        if (a)
            give_back(a);
    }
    c->limit_ptr[limit] = p;
    c->limit_mem[limit] = bytes;
    c->limit_val[limit] = value;
    return CUDA_SUCCESS;
}
FG_API CUresult cuCtxSetLimit(int limit, size_t value) { LOCKED(set_limit(limit, value)); }

static CUresult get_limit(size_t *value, int limit)
{
    static const size_t dflt[5] = {1024, 1 << 20, 8 << 20, 2, 2048};
    struct fg_ctx *c;
    CUresult r = fg_current(&c);
    if (r)
        return r;
    if (!value || limit < 0 || limit > 4)
        return CUDA_ERROR_INVALID_VALUE;
    *value = c->limit_ptr[limit] || c->limit_val[limit] ? c->limit_val[limit] : dflt[limit];
    return CUDA_SUCCESS;
}
FG_API CUresult cuCtxGetLimit(size_t *value, int limit) { LOCKED(get_limit(value, limit)); }
