/* Fake libcuda.so.1: initialisation, devices, contexts, cuGetProcAddress and error strings.
 * Memory functions are in cuda_mem.c, the MPS client side in mps_client.c. */
#include "cuda_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define CTX_MAGIC 0x43545846u

pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
fg_state S = {.fd = -1, .own_slot = -1};
int g_inited;
int g_slot = -1;
int g_vis[FG_MAX_DEV];
int g_nvis;

static pid_t g_pid;
static struct fg_ctx g_primary[FG_MAX_DEV];
static struct fg_ctx *g_ctxs;            /* contexts made by cuCtxCreate */
/* Destroyed contexts, most recent first: like the real driver, a context made after a destroy may
 * get the destroyed one's address (handle) back, so callers that key by address must cope. */
static struct fg_ctx *g_ctx_free;
static int g_devctx[FG_MAX_DEV];         /* live contexts per ordinal */
static __thread struct fg_ctx *t_stack[32];
static __thread int t_depth;

/* ---- fork and exit ---------------------------------------------------------------------- */

static void ctx_free_all(void)
{
    for (struct fg_ctx *c = g_ctx_free, *n; c; c = n) {
        n = c->next;
        free(c);
    }
    g_ctx_free = NULL;
}

static void atfork_prepare(void) { pthread_mutex_lock(&g_mu); }
static void atfork_parent(void) { pthread_mutex_unlock(&g_mu); }

/* A forked child is not a CUDA process (as with the real driver): it drops the parent's fd (the
 * parent keeps the OFD locks), contexts and allocations, and may call cuInit afresh. */
static void atfork_child(void)
{
    pthread_mutex_init(&g_mu, NULL);
    if (S.fd >= 0)
        fg_close(&S);
    fg_mps_detach();
    for (struct fg_ctx *c = g_ctxs, *n; c; c = n) {
        n = c->next;
        free(c);
    }
    g_ctxs = NULL;
    ctx_free_all();
    memset(g_primary, 0, sizeof g_primary);
    memset(g_devctx, 0, sizeof g_devctx);
    fg_mem_reset();
    t_depth = 0;
    g_inited = 0;
    g_slot = -1;
}

__attribute__((constructor)) static void fg_cuda_load(void)
{
    pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
}

__attribute__((destructor)) static void fg_cuda_unload(void)
{
    if (fg_ckpt_held())
        return; /* locked by a checkpoint: the slot is reaped once the process is gone */
    pthread_mutex_lock(&g_mu);
    if (g_inited && getpid() == g_pid) {
        fg_lock(&S);
        fg_release_slot(&S, g_slot);
        fg_unlock(&S);
        fg_mps_detach();
        fg_mem_reset();
        for (struct fg_ctx *c = g_ctxs, *n; c; c = n) {
            n = c->next;
            free(c);
        }
        g_ctxs = NULL;
        ctx_free_all();
        fg_close(&S);
        g_inited = 0;
        g_slot = -1;
    }
    pthread_mutex_unlock(&g_mu);
}

/* ---- init ------------------------------------------------------------------------------ */

static int env_pct(const char *name, int dflt)
{
    const char *v = getenv(name);
    return v && *v ? fg_pct(atoi(v)) : dflt;
}

static CUresult do_init(unsigned flags)
{
    if (flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (g_inited)
        return CUDA_SUCCESS;
    if (fg_open(&S, NULL) != 0)
        return CUDA_ERROR_NO_DEVICE;
    /* As the real driver: no /dev/nvidiactl, no device; no /dev/nvidia-uvm, "unknown error" (what
     * CUDA says when nvidia-uvm is missing); a GPU whose node does not open is not enumerated. */
    uint32_t usable = fg_node_open(&S, FG_NODE_CTL) ? fg_usable(&S) : 0;
    if (!usable || !fg_node_open(&S, FG_NODE_UVM)) {
        fg_close(&S);
        return usable ? CUDA_ERROR_UNKNOWN : CUDA_ERROR_NO_DEVICE;
    }
    g_nvis = fg_parse_visible(&S, getenv("CUDA_VISIBLE_DEVICES"), g_vis, usable);
    fg_lock(&S);
    g_slot = fg_claim_slot(&S, FG_KIND_PROC);
    if (g_slot >= 0) {
        struct fg_slot *sl = &S.h->slot[g_slot];
        sl->sm_pct = env_pct("COLO_FAKEGPU_SM", 0);
        sl->membw_pct = env_pct("COLO_FAKEGPU_MEMBW", sl->sm_pct / 2);
    }
    fg_unlock(&S);
    if (g_slot < 0) {
        fg_close(&S);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    g_pid = getpid();
    CUresult err = CUDA_SUCCESS;
    if (fg_mps_attach(&err) < 0) {
        fg_lock(&S);
        fg_release_slot(&S, g_slot);
        fg_unlock(&S);
        fg_close(&S);
        g_slot = -1;
        return err;
    }
    g_inited = 1;
    fg_ckpt_start();
    return CUDA_SUCCESS;
}

FG_API CUresult cuInit(unsigned int flags) { LOCKED(do_init(flags)); }

FG_API CUresult cuDriverGetVersion(int *v)
{
    if (!v)
        return CUDA_ERROR_INVALID_VALUE;
    *v = 12040;
    return CUDA_SUCCESS;
}

CUresult fg_check_live(void)
{
    if (!g_inited)
        return CUDA_ERROR_NOT_INITIALIZED;
    uint32_t f = __atomic_load_n(&S.h->slot[g_slot].flags, __ATOMIC_ACQUIRE);
    if (f & FG_F_TERMINATED)
        return CUDA_ERROR_MPS_CLIENT_TERMINATED;
    if (f & FG_F_FAULT)
        return CUDA_ERROR_ILLEGAL_ADDRESS; /* the sticky error a fault leaves in every client */
    return CUDA_SUCCESS;
}

/* Simulated activity (fake only; colo-burn finds it with dlsym and skips it on a real driver). */
FG_API int fakegpuSetActivity(int sm_pct, int membw_pct)
{
    pthread_mutex_lock(&g_mu);
    CUresult r = fg_check_live();
    if (r == CUDA_SUCCESS) {
        fg_lock(&S);
        S.h->slot[g_slot].sm_pct = fg_pct(sm_pct);
        S.h->slot[g_slot].membw_pct = fg_pct(membw_pct);
        fg_unlock(&S);
    }
    pthread_mutex_unlock(&g_mu);
    return r;
}

/* ---- devices --------------------------------------------------------------------------- */

static CUresult dev_phys(CUdevice d, struct fg_device **out)
{
    CUresult r = fg_check_live();
    if (r)
        return r;
    if (d < 0 || d >= g_nvis)
        return CUDA_ERROR_INVALID_DEVICE;
    *out = &S.h->dev[g_vis[d]];
    return CUDA_SUCCESS;
}

/* dev_phys, then INVALID_VALUE where the arguments are not ok: the order every device call checks in. */
static CUresult dev_arg(CUdevice d, struct fg_device **out, int ok)
{
    CUresult r = dev_phys(d, out);
    return r ? r : ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

static CUresult device_get(CUdevice *out, int ordinal)
{
    CUresult r = fg_check_live();
    if (r)
        return r;
    if (!out)
        return CUDA_ERROR_INVALID_VALUE;
    if (ordinal < 0 || ordinal >= g_nvis)
        return CUDA_ERROR_INVALID_DEVICE;
    *out = ordinal;
    return CUDA_SUCCESS;
}
FG_API CUresult cuDeviceGet(CUdevice *out, int ordinal) { LOCKED(device_get(out, ordinal)); }

static CUresult device_count(int *n)
{
    CUresult r = fg_check_live();
    if (r)
        return r;
    if (!n)
        return CUDA_ERROR_INVALID_VALUE;
    *n = g_nvis;
    return CUDA_SUCCESS;
}
FG_API CUresult cuDeviceGetCount(int *n) { LOCKED(device_count(n)); }

static CUresult device_name(char *name, int len, CUdevice d)
{
    struct fg_device *dv;
    CUresult r = dev_arg(d, &dv, name && len > 0);
    if (r)
        return r;
    snprintf(name, (size_t)len, "%s", dv->name);
    return CUDA_SUCCESS;
}
FG_API CUresult cuDeviceGetName(char *name, int len, CUdevice d) { LOCKED(device_name(name, len, d)); }

static CUresult device_uuid(CUuuid *u, CUdevice d)
{
    struct fg_device *dv;
    CUresult r = dev_arg(d, &dv, u != NULL);
    if (r)
        return r;
    const char *p = dv->uuid + 4; /* skip "GPU-" */
    memset(u, 0, sizeof *u);
    for (int i = 0; i < 16 && *p;) {
        if (*p == '-') {
            p++;
            continue;
        }
        unsigned v;
        if (sscanf(p, "%2x", &v) != 1)
            break;
        u->bytes[i++] = (char)v;
        p += 2;
    }
    return CUDA_SUCCESS;
}
FG_API CUresult cuDeviceGetUuid(CUuuid *u, CUdevice d) { LOCKED(device_uuid(u, d)); }
FG_API CUresult cuDeviceGetUuid_v2(CUuuid *u, CUdevice d) { LOCKED(device_uuid(u, d)); }

static CUresult total_mem(size_t *bytes, CUdevice d)
{
    struct fg_device *dv;
    CUresult r = dev_arg(d, &dv, bytes != NULL);
    if (r)
        return r;
    *bytes = (size_t)dv->total;
    return CUDA_SUCCESS;
}
FG_API CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice d) { LOCKED(total_mem(bytes, d)); }

/* Pre-3.2 entry point with a 32-bit size, still exported by the real driver. */
FG_API CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice d)
{
    size_t b = 0;
    pthread_mutex_lock(&g_mu);
    CUresult r = total_mem(&b, d);
    pthread_mutex_unlock(&g_mu);
    if (r == CUDA_SUCCESS)
        *bytes = b > 0xffffffffu ? 0xffffffffu : (unsigned)b;
    return r;
}

static CUresult device_attr(int *pi, int attr, CUdevice d)
{
    struct fg_device *dv;
    CUresult r = dev_arg(d, &dv, pi && attr >= 1 && attr <= 150);
    if (r)
        return r;
    int v = 0;
    switch (attr) {
    case 1: v = 1024; break;                    /* max threads per block */
    case 2: case 3: v = 1024; break;            /* max block dim x, y */
    case 4: v = 64; break;
    case 5: v = 2147483647; break;              /* max grid dim x */
    case 6: case 7: v = 65535; break;
    case 8: v = 49152; break;                   /* shared memory per block */
    case 9: v = 65536; break;                   /* constant memory */
    case 10: v = 32; break;                     /* warp size */
    case 11: v = 2147483647; break;             /* max pitch */
    case 12: case 82: v = 65536; break;         /* registers */
    case 13: v = 1410000; break;                /* clock rate kHz */
    case 14: v = 512; break;
    case 15: case 19: case 31: case 41: case 78: case 79: case 80: case 83: case 89: case 90:
    case 95: case 99: case 102: case 115: v = 1; break;
    case 16: v = (int)dv->sms; break;
    case 20: v = (int)dv->compute_mode; break;
    case 33: v = (int)dv->pci_bus; break;
    case 36: v = 1215000; break;                /* memory clock kHz */
    case 37: v = 5120; break;                   /* bus width */
    case 38: v = 40 * 1024 * 1024; break;       /* L2 */
    case 39: v = 2048; break;                   /* threads per SM */
    case 40: v = 3; break;                      /* async engines */
    case 75: v = (int)dv->cc_major; break;
    case 76: v = (int)dv->cc_minor; break;
    case 81: v = 167936; break;
    case 97: v = 166912; break;
    case 106: v = 32; break;
    default: v = 0;
    }
    *pi = v;
    return CUDA_SUCCESS;
}
FG_API CUresult cuDeviceGetAttribute(int *pi, int attr, CUdevice d) { LOCKED(device_attr(pi, attr, d)); }

/* ---- contexts -------------------------------------------------------------------------- */

static int ctx_valid(struct fg_ctx *c)
{
    if (!c)
        return 0;
    for (int i = 0; i < g_nvis; i++)
        if (c == &g_primary[i])
            return c->alive;
    for (struct fg_ctx *p = g_ctxs; p; p = p->next)
        if (p == c)
            return c->alive;
    return 0;
}

CUresult fg_current(struct fg_ctx **out)
{
    CUresult r = fg_check_live();
    if (r)
        return r;
    struct fg_ctx *c = t_depth ? t_stack[t_depth - 1] : NULL;
    if (!ctx_valid(c))
        return CUDA_ERROR_INVALID_CONTEXT;
    *out = c;
    return CUDA_SUCCESS;
}

/* The first context of this process on a device makes it a GPU process of that device (NVML lists
 * it); compute modes are checked here, atomically with the other processes' contexts. */
static CUresult dev_ctx_up(int ord)
{
    if (g_devctx[ord]++ > 0)
        return CUDA_SUCCESS;
    int phys = g_vis[ord];
    CUresult r = CUDA_SUCCESS;
    fg_lock(&S);
    struct fg_header *h = S.h;
    struct fg_slot *me = &h->slot[g_slot];
    uint32_t mode = h->dev[phys].compute_mode;
    if (mode == FG_MODE_PROHIBITED) {
        r = CUDA_ERROR_DEVICE_UNAVAILABLE;
    } else if (mode == FG_MODE_EXCLUSIVE_PROCESS && me->kind != FG_KIND_MPS_CLIENT) {
        /* One process per device; under MPS that process is the server, and clients pass. */
        fg_reap(&S);
        for (uint32_t i = 0; i < h->hwm; i++)
            if ((int)i != g_slot && h->slot[i].state == FG_SLOT_LIVE &&
                (h->slot[i].ctx_mask & (1u << phys)))
                r = CUDA_ERROR_DEVICE_UNAVAILABLE;
    }
    if (r == CUDA_SUCCESS)
        me->ctx_mask |= 1u << phys;
    fg_unlock(&S);
    if (r)
        g_devctx[ord]--;
    return r;
}

static void dev_ctx_down(int ord)
{
    if (--g_devctx[ord] > 0)
        return;
    fg_lock(&S);
    S.h->slot[g_slot].ctx_mask &= ~(1u << g_vis[ord]);
    fg_unlock(&S);
}

static void stack_remove(struct fg_ctx *c)
{
    int k = 0;
    for (int i = 0; i < t_depth; i++)
        if (t_stack[i] != c)
            t_stack[k++] = t_stack[i];
    t_depth = k;
}

static CUresult primary_retain(CUcontext *pctx, CUdevice d)
{
    struct fg_device *dv;
    CUresult r = dev_arg(d, &dv, pctx != NULL);
    if (r)
        return r;
    struct fg_ctx *c = &g_primary[d];
    if (c->refs == 0) {
        if ((r = dev_ctx_up(d)))
            return r;
        *c = (struct fg_ctx){.magic = CTX_MAGIC, .ord = d, .primary = 1, .alive = 1, .flags = c->flags};
    }
    c->refs++;
    *pctx = c;
    return CUDA_SUCCESS;
}
FG_API CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice d) { LOCKED(primary_retain(pctx, d)); }

static CUresult primary_release(CUdevice d)
{
    struct fg_device *dv;
    CUresult r = dev_phys(d, &dv);
    if (r)
        return r;
    struct fg_ctx *c = &g_primary[d];
    if (c->refs == 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (--c->refs == 0) {
        fg_mem_drop_ctx(c);
        c->alive = 0;
        dev_ctx_down(d);
    }
    return CUDA_SUCCESS;
}
FG_API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) { LOCKED(primary_release(d)); }
FG_API CUresult cuDevicePrimaryCtxRelease(CUdevice d) { LOCKED(primary_release(d)); }

static CUresult primary_reset(CUdevice d)
{
    struct fg_device *dv;
    CUresult r = dev_phys(d, &dv);
    if (r)
        return r;
    if (g_primary[d].alive)
        fg_mem_drop_ctx(&g_primary[d]);
    return CUDA_SUCCESS;
}
FG_API CUresult cuDevicePrimaryCtxReset_v2(CUdevice d) { LOCKED(primary_reset(d)); }
FG_API CUresult cuDevicePrimaryCtxReset(CUdevice d) { LOCKED(primary_reset(d)); }

static CUresult primary_state(CUdevice d, unsigned *flags, int *active)
{
    struct fg_device *dv;
    CUresult r = dev_arg(d, &dv, flags && active);
    if (r)
        return r;
    *flags = g_primary[d].flags;
    *active = g_primary[d].refs > 0;
    return CUDA_SUCCESS;
}
FG_API CUresult cuDevicePrimaryCtxGetState(CUdevice d, unsigned *flags, int *active)
{
    LOCKED(primary_state(d, flags, active));
}

static CUresult primary_set_flags(CUdevice d, unsigned flags)
{
    struct fg_device *dv;
    CUresult r = dev_phys(d, &dv);
    if (r)
        return r;
    g_primary[d].flags = flags;
    return CUDA_SUCCESS;
}
FG_API CUresult cuDevicePrimaryCtxSetFlags_v2(CUdevice d, unsigned flags) { LOCKED(primary_set_flags(d, flags)); }

static CUresult ctx_create(CUcontext *pctx, unsigned flags, CUdevice d)
{
    struct fg_device *dv;
    CUresult r = dev_arg(d, &dv, pctx != NULL);
    if (r)
        return r;
    if (t_depth >= (int)(sizeof t_stack / sizeof t_stack[0]))
        return CUDA_ERROR_INVALID_VALUE;
    struct fg_ctx *c = g_ctx_free;
    if (c)
        g_ctx_free = c->next;
    else if (!(c = calloc(1, sizeof *c)))
        return CUDA_ERROR_OUT_OF_MEMORY;
    if ((r = dev_ctx_up(d))) {
        c->next = g_ctx_free;
        g_ctx_free = c;
        return r;
    }
    *c = (struct fg_ctx){.magic = CTX_MAGIC, .ord = d, .alive = 1, .flags = flags, .next = g_ctxs};
    g_ctxs = c;
    t_stack[t_depth++] = c;
    *pctx = c;
    return CUDA_SUCCESS;
}
FG_API CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned flags, CUdevice d) { LOCKED(ctx_create(pctx, flags, d)); }
FG_API CUresult cuCtxCreate(CUcontext *pctx, unsigned flags, CUdevice d) { LOCKED(ctx_create(pctx, flags, d)); }
FG_API CUresult cuCtxCreate_v3(CUcontext *pctx, void *params, int n, unsigned flags, CUdevice d)
{
    (void)params;
    (void)n;
    LOCKED(ctx_create(pctx, flags, d));
}
FG_API CUresult cuCtxCreate_v4(CUcontext *pctx, void *params, unsigned flags, CUdevice d)
{
    (void)params;
    LOCKED(ctx_create(pctx, flags, d));
}

static CUresult ctx_destroy(CUcontext c)
{
    CUresult r = fg_check_live();
    if (r)
        return r;
    if (!c || c->primary || !ctx_valid(c))
        return CUDA_ERROR_INVALID_CONTEXT;
    fg_mem_drop_ctx(c);
    for (struct fg_ctx **pp = &g_ctxs; *pp; pp = &(*pp)->next)
        if (*pp == c) {
            *pp = c->next;
            break;
        }
    stack_remove(c);
    dev_ctx_down(c->ord);
    *c = (struct fg_ctx){.next = g_ctx_free};
    g_ctx_free = c;
    return CUDA_SUCCESS;
}
FG_API CUresult cuCtxDestroy_v2(CUcontext c) { LOCKED(ctx_destroy(c)); }
FG_API CUresult cuCtxDestroy(CUcontext c) { LOCKED(ctx_destroy(c)); }

static CUresult ctx_set_current(CUcontext c)
{
    CUresult r = fg_check_live();
    if (r)
        return r;
    if (!c) {
        if (t_depth)
            t_depth--;
        return CUDA_SUCCESS;
    }
    if (!ctx_valid(c))
        return CUDA_ERROR_INVALID_CONTEXT;
    if (t_depth)
        t_stack[t_depth - 1] = c;
    else
        t_stack[t_depth++] = c;
    return CUDA_SUCCESS;
}
FG_API CUresult cuCtxSetCurrent(CUcontext c) { LOCKED(ctx_set_current(c)); }

static CUresult ctx_get_current(CUcontext *pc)
{
    CUresult r = fg_check_live();
    if (r)
        return r;
    if (!pc)
        return CUDA_ERROR_INVALID_VALUE;
    *pc = t_depth ? t_stack[t_depth - 1] : NULL;
    return CUDA_SUCCESS;
}
/* No process lock: the context stack is the calling thread's own (as on the real driver, where
 * this is a thread-local read that interposers may call on every allocation). */
FG_API CUresult cuCtxGetCurrent(CUcontext *pc) { return ctx_get_current(pc); }

static CUresult ctx_push(CUcontext c)
{
    CUresult r = fg_check_live();
    if (r)
        return r;
    if (!ctx_valid(c) || t_depth >= (int)(sizeof t_stack / sizeof t_stack[0]))
        return CUDA_ERROR_INVALID_CONTEXT;
    t_stack[t_depth++] = c;
    return CUDA_SUCCESS;
}
FG_API CUresult cuCtxPushCurrent_v2(CUcontext c) { LOCKED(ctx_push(c)); }
FG_API CUresult cuCtxPushCurrent(CUcontext c) { LOCKED(ctx_push(c)); }

static CUresult ctx_pop(CUcontext *pc)
{
    CUresult r = fg_check_live();
    if (r)
        return r;
    if (!t_depth)
        return CUDA_ERROR_INVALID_CONTEXT;
    struct fg_ctx *c = t_stack[--t_depth];
    if (pc)
        *pc = c;
    return CUDA_SUCCESS;
}
FG_API CUresult cuCtxPopCurrent_v2(CUcontext *pc) { LOCKED(ctx_pop(pc)); }
FG_API CUresult cuCtxPopCurrent(CUcontext *pc) { LOCKED(ctx_pop(pc)); }

static CUresult ctx_api_version(CUcontext c, unsigned *v)
{
    CUresult r = fg_check_live();
    if (r)
        return r;
    if (!v)
        return CUDA_ERROR_INVALID_VALUE;
    if (!ctx_valid(c ? c : t_depth ? t_stack[t_depth - 1] : NULL))
        return CUDA_ERROR_INVALID_CONTEXT;
    *v = 3020;
    return CUDA_SUCCESS;
}
FG_API CUresult cuCtxGetApiVersion(CUcontext c, unsigned *v) { LOCKED(ctx_api_version(c, v)); }

static CUresult ctx_get_device(CUdevice *d, CUcontext c)
{
    CUresult r;
    if (!d)
        return CUDA_ERROR_INVALID_VALUE;
    if (!c && (r = fg_current(&c)))
        return r;
    if ((r = fg_check_live()))
        return r;
    if (!ctx_valid(c))
        return CUDA_ERROR_INVALID_CONTEXT;
    *d = c->ord;
    return CUDA_SUCCESS;
}
FG_API CUresult cuCtxGetDevice(CUdevice *d) { LOCKED(ctx_get_device(d, NULL)); }
FG_API CUresult cuCtxGetDevice_v2(CUdevice *d, CUcontext c) { LOCKED(ctx_get_device(d, c)); }

/* Every stream reaches the end of its work (stream-ordered frees complete, pools trim). */
static CUresult ctx_sync(CUcontext c)
{
    CUresult r;
    if (!c && (r = fg_current(&c)))
        return r;
    if ((r = fg_check_live()))
        return r;
    if (!ctx_valid(c))
        return CUDA_ERROR_INVALID_CONTEXT;
    fg_async_complete_all();
    return CUDA_SUCCESS;
}
FG_API CUresult cuCtxSynchronize(void) { LOCKED(ctx_sync(NULL)); }
FG_API CUresult cuCtxSynchronize_v2(CUcontext c) { LOCKED(ctx_sync(c)); }

/* ---- error strings --------------------------------------------------------------------- */

static const struct { int code; const char *name, *text; } ERRS[] = {
    {0, "CUDA_SUCCESS", "no error"},
    {1, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {3, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {4, "CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
    {46, "CUDA_ERROR_DEVICE_UNAVAILABLE", "CUDA-capable device(s) is/are busy or unavailable"},
    {100, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {101, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {201, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {304, "CUDA_ERROR_OPERATING_SYSTEM", "OS call failed or operation not supported on this OS"},
    {400, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {401, "CUDA_ERROR_ILLEGAL_STATE", "the operation cannot be performed in the present state"},
    {500, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {700, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
    {709, "CUDA_ERROR_CONTEXT_IS_DESTROYED", "context is destroyed"},
    {800, "CUDA_ERROR_NOT_PERMITTED", "operation not permitted"},
    {801, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {805, "CUDA_ERROR_MPS_CONNECTION_FAILED", "MPS client failed to connect to the MPS control daemon or the MPS server"},
    {806, "CUDA_ERROR_MPS_RPC_FAILURE", "the remote procedural call between the MPS server and the MPS client failed"},
    {807, "CUDA_ERROR_MPS_SERVER_NOT_READY", "MPS server is not ready to accept new MPS client requests"},
    {808, "CUDA_ERROR_MPS_MAX_CLIENTS_REACHED", "the hardware resources required to create MPS client have been exhausted"},
    {809, "CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED", "the hardware resources required to support device connections have been exhausted"},
    {810, "CUDA_ERROR_MPS_CLIENT_TERMINATED", "the MPS client has been terminated by the server"},
    {909, "CUDA_ERROR_TIMEOUT", "wait operation timed out"},
    {999, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

static CUresult err_lookup(CUresult e, const char **out, int want_name)
{
    if (!out)
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof ERRS / sizeof ERRS[0]; i++)
        if (ERRS[i].code == e) {
            *out = want_name ? ERRS[i].name : ERRS[i].text;
            return CUDA_SUCCESS;
        }
    *out = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}
FG_API CUresult cuGetErrorName(CUresult e, const char **out) { return err_lookup(e, out, 1); }
FG_API CUresult cuGetErrorString(CUresult e, const char **out) { return err_lookup(e, out, 0); }
