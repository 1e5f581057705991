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
    CUDA_ERROR_ILLEGAL_ADDRESS = 700,
    CUDA_ERROR_NOT_SUPPORTED = 801,
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
    uint64_t limit_mem[3];   /* device memory held for cuCtxSetLimit: stack, printf FIFO, heap */
    unsigned long long limit_ptr[3];
    size_t limit_val[3];
    struct fg_ctx *next;
};

/* Process-wide state of the fake driver; all of it is guarded by g_mu (taken before the state lock). */
extern pthread_mutex_t g_mu;
extern fg_state S;
extern int g_inited;
extern int g_slot;
extern int g_vis[FG_MAX_DEV];
extern int g_nvis;

CUresult fg_check_live(void);                  /* not initialised / MPS terminated / fault */
CUresult fg_current(struct fg_ctx **out);      /* the calling thread's current context, under g_mu */
void fg_mem_drop_ctx(struct fg_ctx *c);        /* frees every allocation made in c, under g_mu */
void fg_mem_reset(void);                       /* forget all allocations (after fork), under g_mu */
int fg_mps_attach(CUresult *err);              /* 1 client, 0 no daemon reachable, -1 *err set */
void fg_mps_detach(void);

#endif
