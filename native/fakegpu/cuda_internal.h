/* Internals shared by the files of the fake libcuda.so.1 (hidden symbols). */
#ifndef COLO_FAKEGPU_CUDA_INTERNAL_H
#define COLO_FAKEGPU_CUDA_INTERNAL_H

#include "fakegpu.h"

#include <stddef.h>

/* Driver API types, declared here so that no CUDA header is needed. */
typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct fg_ctx *CUcontext;
typedef void *CUstream;
typedef void *CUarray;
typedef void *CUmipmappedArray;
typedef void *CUmemoryPool;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef unsigned long long cuuint64_t;
typedef struct { char bytes[16]; } CUuuid;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_DEVICE_UNAVAILABLE = 46,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_OPERATING_SYSTEM = 304,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_ILLEGAL_ADDRESS = 700,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900,
    CUDA_ERROR_MPS_CONNECTION_FAILED = 805,
    CUDA_ERROR_MPS_RPC_FAILURE = 806,
    CUDA_ERROR_MPS_SERVER_NOT_READY = 807,
    CUDA_ERROR_MPS_MAX_CLIENTS_REACHED = 808,
    CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED = 809,
    CUDA_ERROR_MPS_CLIENT_TERMINATED = 810,
    CUDA_ERROR_UNKNOWN = 999,
};

struct fg_ctx {
    uint32_t magic;
    int ord;          /* device ordinal as this process sees it (after CUDA_VISIBLE_DEVICES) */
    int primary;
    int refs;         /* primary: retain count */
    int alive;
    unsigned flags;
    /* device memory held for cuCtxSetLimit: stack, printf FIFO, heap, device-runtime sync depth,
     * device-runtime pending launch count (cuda_mem.c: limit_bytes) */
    uint64_t limit_mem[5];
    unsigned long long limit_ptr[5];
    size_t limit_val[5];
    struct fg_ctx *next;
};

/* Process-wide state of the fake driver; all of it is guarded by g_mu (taken before the state lock). */
extern pthread_mutex_t g_mu;
extern fg_state S;
extern int g_inited;
extern int g_slot;
extern int g_vis[FG_MAX_DEV];
extern int g_nvis;

/* One allocation of this process. Stream-ordered ones (pool != NULL) hold no device bytes of their
 * own: their pool does. */
enum { K_MEM = 1, K_ARRAY, K_MIPMAP, K_HANDLE, K_VA, K_LIMIT, K_MODULE };
struct fg_pool;
struct alloc {
    uint64_t ptr, size;
    int ord, kind;
    int fixed;        /* a graph allocation's address: never handed out to another allocation */
    struct fg_ctx *ctx;
    struct fg_pool *pool;
    struct fg_shared *shared; /* K_HANDLE exported or imported: the physical memory's shared record */
    struct alloc *next;
};

#define LOCKED(expr)                   \
    do {                               \
        pthread_mutex_lock(&g_mu);     \
        CUresult r_ = (expr);          \
        pthread_mutex_unlock(&g_mu);   \
        return r_;                     \
    } while (0)

CUresult fg_check_live(void);                  /* not initialised / MPS terminated / fault */
CUresult fg_current(struct fg_ctx **out);      /* the calling thread's current context, under g_mu */
void fg_mem_drop_ctx(struct fg_ctx *c);        /* frees every allocation made in c, under g_mu */
void fg_mem_reset(void);                       /* forget all allocations (after fork), under g_mu */
/* cuda_mem.c, all under g_mu */
CUresult fg_dev_take(int ord, uint64_t size);  /* device bytes for this process, or OUT_OF_MEMORY */
void fg_dev_give(int ord, uint64_t size);
/* A record for bytes already taken; at != 0: at that address (a graph allocation's). */
CUresult fg_record(int ord, uint64_t size, int kind, struct fg_ctx *ctx, struct fg_pool *pool, uint64_t at,
                   unsigned long long *out);
struct alloc *fg_find(uint64_t p);
struct alloc *fg_unlink(uint64_t p, int kind);
void fg_release_alloc(struct alloc *a);        /* bytes back to the device or the pool; frees a */
/* cuda_share.c: a K_HANDLE's reference to memory shared through a shareable handle goes; the
 * bytes go back to the device with the last reference in any process. Frees a. Under g_mu. */
void fg_share_release(struct alloc *a);
/* cuda_async.c (streams, pools, graphs), all under g_mu */
void fg_pool_return(struct fg_pool *p, uint64_t bytes, void *stream); /* NULL stream: done now */
void fg_async_drop_ctx(struct fg_ctx *c);      /* the context's pending frees complete */
void fg_async_reset(void);
void fg_async_complete_all(void);              /* every stream reaches the end of its work */
/* checkpoint.c: the cuCheckpointProcess* API's thread in every CUDA process */
void fg_ckpt_start(void);                      /* cuInit, under g_mu */
int fg_ckpt_held(void);                        /* 1: LOCKED or CHECKPOINTED (g_mu is held for it) */
int fg_mps_attach(CUresult *err);              /* 1 client, 0 no daemon reachable, -1 *err set */
void fg_mps_detach(void);

#endif
