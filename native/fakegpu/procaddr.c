/* cuGetProcAddress(_v2): the driver's answer depends on (name, requested CUDA version), because
 * some _v2/_v3 entry points take other arguments than their base name. Each row says from which
 * version a symbol answers for a base name; the newest row not above the request wins. */
#include "cuda_internal.h"

#include <stdlib.h>
#include <string.h>

#define F(name) extern void name(void);
#define FUNCS(X)                                                                                  \
    X(cuInit) X(cuDriverGetVersion) X(cuDeviceGet) X(cuDeviceGetCount) X(cuDeviceGetName)       \
    X(cuDeviceGetUuid) X(cuDeviceGetUuid_v2) X(cuDeviceTotalMem) X(cuDeviceTotalMem_v2)         \
    X(cuDeviceGetAttribute) X(cuDevicePrimaryCtxRetain) X(cuDevicePrimaryCtxRelease)            \
    X(cuDevicePrimaryCtxRelease_v2) X(cuDevicePrimaryCtxReset) X(cuDevicePrimaryCtxReset_v2)    \
    X(cuDevicePrimaryCtxGetState) X(cuDevicePrimaryCtxSetFlags_v2) X(cuCtxCreate)               \
    X(cuCtxCreate_v2) X(cuCtxCreate_v3) X(cuCtxCreate_v4) X(cuCtxDestroy) X(cuCtxDestroy_v2)    \
    X(cuCtxSetCurrent) X(cuCtxGetCurrent) X(cuCtxPushCurrent) X(cuCtxPushCurrent_v2)            \
    X(cuCtxPopCurrent) X(cuCtxPopCurrent_v2) X(cuCtxGetDevice) X(cuCtxGetDevice_v2) X(cuCtxGetApiVersion) \
    X(cuCtxSynchronize) X(cuCtxSynchronize_v2) X(cuMemAlloc) X(cuMemAlloc_v2) X(cuMemAlloc_v3) X(cuMemFree)      \
    X(cuMemFree_v2) X(cuMemAllocPitch_v2) X(cuMemAllocManaged) X(cuMemAllocAsync)               \
    X(cuMemAllocAsync_ptsz) X(cuMemAllocFromPoolAsync) X(cuMemAllocFromPoolAsync_ptsz)           \
    X(cuMemFreeAsync) X(cuMemFreeAsync_ptsz) X(cuMemGetInfo) X(cuMemGetInfo_v2)                 \
    X(cuMemsetD8_v2) X(cuMemsetD8_v2_ptds) X(cuMemsetD32_v2) X(cuMemsetD32_v2_ptds)             \
    X(cuArrayCreate_v2) X(cuArray3DCreate_v2) X(cuArrayDestroy) X(cuMipmappedArrayCreate)       \
    X(cuMipmappedArrayDestroy) X(cuMemCreate) X(cuMemRelease) X(cuMemGetAllocationGranularity)  \
    X(cuMemAddressReserve) X(cuMemAddressFree) X(cuMemMap) X(cuMemUnmap) X(cuMemSetAccess)      \
    X(cuGetErrorName) X(cuGetErrorString) X(cuMemPoolCreate) X(cuMemPoolDestroy)                 \
    X(cuDeviceGetDefaultMemPool) X(cuDeviceGetMemPool) X(cuCtxSetLimit) X(cuCtxGetLimit)             \
    X(cuDeviceSetMemPool) X(cuMemPoolGetAttribute) X(cuMemPoolSetAttribute) X(cuMemPoolTrimTo)      \
    X(cuStreamCreate) X(cuStreamDestroy) X(cuStreamDestroy_v2) X(cuStreamSynchronize)              \
    X(cuStreamSynchronize_ptsz) X(cuStreamQuery) X(cuStreamQuery_ptsz) X(cuStreamBeginCapture_v2)   \
    X(cuStreamBeginCapture_v2_ptsz) X(cuStreamEndCapture) X(cuStreamEndCapture_ptsz)                \
    X(cuStreamIsCapturing) X(cuStreamIsCapturing_ptsz) X(cuStreamGetCaptureInfo)                    \
    X(cuStreamGetCaptureInfo_ptsz) X(cuGraphCreate) X(cuGraphDestroy) X(cuGraphAddMemAllocNode)     \
    X(cuGraphAddMemFreeNode) X(cuGraphInstantiateWithFlags) X(cuGraphExecDestroy) X(cuGraphLaunch)  \
    X(cuGraphLaunch_ptsz) X(cuDeviceGraphMemTrim) X(cuDeviceGetGraphMemAttribute)                   \
    X(cuDeviceSetGraphMemAttribute) X(cuGraphInstantiate) X(cuGraphInstantiate_v2)                 \
    X(cuGraphInstantiateWithParams) X(cuGraphInstantiateWithParams_ptsz) X(cuGraphUpload)          \
    X(cuGraphUpload_ptsz) X(cuGraphExecUpdate) X(cuGraphExecUpdate_v2) X(cuGraphAddNode)             \
    X(cuGraphAddNode_v2) X(cuGraphAddChildGraphNode) X(cuGraphGetNodes) X(cuGraphNodeGetType)       \
    X(cuGraphMemAllocNodeGetParams) X(cuGraphChildGraphNodeGetGraph) X(cuGraphMemFreeNodeGetParams)   \
    X(cuPointerGetAttribute) X(cuArrayGetDescriptor_v2) X(cuMipmappedArrayGetLevel)
FUNCS(F)
#undef F

/* COLO_FAKEGPU_PROCADDR_THUNKS=1: cuGetProcAddress answers with entry points that are not the
 * exported symbols (a jump to each), as a real driver may: a caller cannot then recognise an
 * entry point by its exported address, only by what the driver answers. */
#if defined(__x86_64__)
#define THUNK(name)                                                                                \
    __asm__(".text\n.p2align 4\n.globl fg_thunk_" #name "\n.hidden fg_thunk_" #name "\n"       \
            "fg_thunk_" #name ":\n\tjmp " #name "\n");                                           \
    extern void fg_thunk_##name(void);
FUNCS(THUNK)
#define AS_THUNK(name) {(void *)name, (void *)fg_thunk_##name},
static const struct { void *fn, *thunk; } THUNKS[] = {FUNCS(AS_THUNK)};
#endif

static void *thunk_of(void *fn)
{
#if defined(__x86_64__)
    static int on = -1;
    if (on < 0) {
        const char *v = getenv("COLO_FAKEGPU_PROCADDR_THUNKS");
        on = v && *v == '1';
    }
    for (size_t i = 0; on && i < sizeof THUNKS / sizeof THUNKS[0]; i++)
        if (THUNKS[i].fn == fn)
            return THUNKS[i].thunk;
#endif
    return fn;
}
FG_API CUresult cuGetProcAddress(const char *sym, void **pfn, int version, cuuint64_t flags);
FG_API CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int version, cuuint64_t flags, int *status);

/* ptds: the per-thread-default-stream variant, answered when that flag is passed. */
static const struct { const char *name; int version; void *fn, *ptds; } TABLE[] = {
    {"cuInit", 2000, (void *)cuInit, 0},
    {"cuDriverGetVersion", 2020, (void *)cuDriverGetVersion, 0},
    {"cuDeviceGet", 2000, (void *)cuDeviceGet, 0},
    {"cuDeviceGetCount", 2000, (void *)cuDeviceGetCount, 0},
    {"cuDeviceGetName", 2000, (void *)cuDeviceGetName, 0},
    {"cuDeviceGetUuid", 9020, (void *)cuDeviceGetUuid, 0},
    {"cuDeviceGetUuid", 11040, (void *)cuDeviceGetUuid_v2, 0},
    {"cuDeviceTotalMem", 2000, (void *)cuDeviceTotalMem, 0},
    {"cuDeviceTotalMem", 3020, (void *)cuDeviceTotalMem_v2, 0},
    {"cuDeviceGetAttribute", 2000, (void *)cuDeviceGetAttribute, 0},
    {"cuDevicePrimaryCtxRetain", 7000, (void *)cuDevicePrimaryCtxRetain, 0},
    {"cuDevicePrimaryCtxRelease", 7000, (void *)cuDevicePrimaryCtxRelease, 0},
    {"cuDevicePrimaryCtxRelease", 11000, (void *)cuDevicePrimaryCtxRelease_v2, 0},
    {"cuDevicePrimaryCtxReset", 7000, (void *)cuDevicePrimaryCtxReset, 0},
    {"cuDevicePrimaryCtxReset", 11000, (void *)cuDevicePrimaryCtxReset_v2, 0},
    {"cuDevicePrimaryCtxGetState", 7000, (void *)cuDevicePrimaryCtxGetState, 0},
    {"cuDevicePrimaryCtxSetFlags", 11000, (void *)cuDevicePrimaryCtxSetFlags_v2, 0},
    {"cuCtxCreate", 2000, (void *)cuCtxCreate, 0},
    {"cuCtxCreate", 3020, (void *)cuCtxCreate_v2, 0},
    {"cuCtxCreate", 11040, (void *)cuCtxCreate_v3, 0},
    {"cuCtxCreate", 12050, (void *)cuCtxCreate_v4, 0},
    {"cuCtxDestroy", 2000, (void *)cuCtxDestroy, 0},
    {"cuCtxDestroy", 4000, (void *)cuCtxDestroy_v2, 0},
    {"cuCtxSetCurrent", 4000, (void *)cuCtxSetCurrent, 0},
    {"cuCtxGetCurrent", 4000, (void *)cuCtxGetCurrent, 0},
    {"cuCtxPushCurrent", 2000, (void *)cuCtxPushCurrent, 0},
    {"cuCtxPushCurrent", 4000, (void *)cuCtxPushCurrent_v2, 0},
    {"cuCtxPopCurrent", 2000, (void *)cuCtxPopCurrent, 0},
    {"cuCtxPopCurrent", 4000, (void *)cuCtxPopCurrent_v2, 0},
    {"cuCtxGetApiVersion", 3020, (void *)cuCtxGetApiVersion, 0},
    {"cuCtxGetDevice", 2000, (void *)cuCtxGetDevice, 0},
    {"cuCtxGetDevice", 13000, (void *)cuCtxGetDevice_v2, 0},
    {"cuCtxSynchronize", 2000, (void *)cuCtxSynchronize, 0},
    {"cuCtxSynchronize", 13000, (void *)cuCtxSynchronize_v2, 0},
    {"cuMemAlloc", 2000, (void *)cuMemAlloc, 0},
    {"cuMemAlloc", 3020, (void *)cuMemAlloc_v2, 0},
    {"cuMemAlloc", 14000, (void *)cuMemAlloc_v3, 0}, /* made up: a future ABI, for tests */
    {"cuMemFree", 2000, (void *)cuMemFree, 0},
    {"cuMemFree", 3020, (void *)cuMemFree_v2, 0},
    {"cuMemAllocPitch", 3020, (void *)cuMemAllocPitch_v2, 0},
    {"cuMemAllocManaged", 6000, (void *)cuMemAllocManaged, 0},
    {"cuMemAllocAsync", 11020, (void *)cuMemAllocAsync, (void *)cuMemAllocAsync_ptsz},
    {"cuMemAllocFromPoolAsync", 11020, (void *)cuMemAllocFromPoolAsync, (void *)cuMemAllocFromPoolAsync_ptsz},
    {"cuMemFreeAsync", 11020, (void *)cuMemFreeAsync, (void *)cuMemFreeAsync_ptsz},
    {"cuMemGetInfo", 2000, (void *)cuMemGetInfo, 0},
    {"cuMemGetInfo", 3020, (void *)cuMemGetInfo_v2, 0},
    {"cuMemsetD8", 3020, (void *)cuMemsetD8_v2, (void *)cuMemsetD8_v2_ptds},
    {"cuMemsetD32", 3020, (void *)cuMemsetD32_v2, (void *)cuMemsetD32_v2_ptds},
    {"cuArrayCreate", 3020, (void *)cuArrayCreate_v2, 0},
    {"cuArray3DCreate", 3020, (void *)cuArray3DCreate_v2, 0},
    {"cuArrayDestroy", 2000, (void *)cuArrayDestroy, 0},
    {"cuMipmappedArrayCreate", 5000, (void *)cuMipmappedArrayCreate, 0},
    {"cuMipmappedArrayDestroy", 5000, (void *)cuMipmappedArrayDestroy, 0},
    {"cuMemCreate", 10020, (void *)cuMemCreate, 0},
    {"cuMemRelease", 10020, (void *)cuMemRelease, 0},
    {"cuMemGetAllocationGranularity", 10020, (void *)cuMemGetAllocationGranularity, 0},
    {"cuMemAddressReserve", 10020, (void *)cuMemAddressReserve, 0},
    {"cuMemAddressFree", 10020, (void *)cuMemAddressFree, 0},
    {"cuMemMap", 10020, (void *)cuMemMap, 0},
    {"cuMemUnmap", 10020, (void *)cuMemUnmap, 0},
    {"cuMemSetAccess", 10020, (void *)cuMemSetAccess, 0},
    {"cuCtxSetLimit", 3010, (void *)cuCtxSetLimit, 0},
    {"cuCtxGetLimit", 3010, (void *)cuCtxGetLimit, 0},
    {"cuMemPoolCreate", 11020, (void *)cuMemPoolCreate, 0},
    {"cuMemPoolDestroy", 11020, (void *)cuMemPoolDestroy, 0},
    {"cuDeviceGetDefaultMemPool", 11020, (void *)cuDeviceGetDefaultMemPool, 0},
    {"cuDeviceGetMemPool", 11020, (void *)cuDeviceGetMemPool, 0},
    {"cuDeviceSetMemPool", 11020, (void *)cuDeviceSetMemPool, 0},
    {"cuMemPoolGetAttribute", 11020, (void *)cuMemPoolGetAttribute, 0},
    {"cuMemPoolSetAttribute", 11020, (void *)cuMemPoolSetAttribute, 0},
    {"cuMemPoolTrimTo", 11020, (void *)cuMemPoolTrimTo, 0},
    {"cuStreamCreate", 2000, (void *)cuStreamCreate, 0},
    {"cuStreamDestroy", 2000, (void *)cuStreamDestroy, 0},
    {"cuStreamDestroy", 4000, (void *)cuStreamDestroy_v2, 0},
    {"cuStreamSynchronize", 2000, (void *)cuStreamSynchronize, (void *)cuStreamSynchronize_ptsz},
    {"cuStreamQuery", 2000, (void *)cuStreamQuery, (void *)cuStreamQuery_ptsz},
    {"cuStreamBeginCapture", 10010, (void *)cuStreamBeginCapture_v2, (void *)cuStreamBeginCapture_v2_ptsz},
    {"cuStreamEndCapture", 10000, (void *)cuStreamEndCapture, (void *)cuStreamEndCapture_ptsz},
    {"cuStreamIsCapturing", 10000, (void *)cuStreamIsCapturing, (void *)cuStreamIsCapturing_ptsz},
    {"cuStreamGetCaptureInfo", 10010, (void *)cuStreamGetCaptureInfo, (void *)cuStreamGetCaptureInfo_ptsz},
    {"cuGraphCreate", 10000, (void *)cuGraphCreate, 0},
    {"cuGraphDestroy", 10000, (void *)cuGraphDestroy, 0},
    {"cuGraphAddMemAllocNode", 11040, (void *)cuGraphAddMemAllocNode, 0},
    {"cuGraphAddMemFreeNode", 11040, (void *)cuGraphAddMemFreeNode, 0},
    {"cuGraphInstantiateWithFlags", 11040, (void *)cuGraphInstantiateWithFlags, 0},
    {"cuGraphInstantiate", 10000, (void *)cuGraphInstantiate, 0},
    {"cuGraphInstantiate", 11000, (void *)cuGraphInstantiate_v2, 0},
    {"cuGraphInstantiate", 12000, (void *)cuGraphInstantiateWithFlags, 0},
    {"cuGraphInstantiateWithParams", 12000, (void *)cuGraphInstantiateWithParams,
     (void *)cuGraphInstantiateWithParams_ptsz},
    {"cuGraphUpload", 11010, (void *)cuGraphUpload, (void *)cuGraphUpload_ptsz},
    {"cuGraphExecUpdate", 10020, (void *)cuGraphExecUpdate, 0},
    {"cuGraphExecUpdate", 12000, (void *)cuGraphExecUpdate_v2, 0},
    {"cuGraphAddNode", 12020, (void *)cuGraphAddNode, 0},
    {"cuGraphAddNode", 12030, (void *)cuGraphAddNode_v2, 0},
    {"cuGraphAddChildGraphNode", 10000, (void *)cuGraphAddChildGraphNode, 0},
    {"cuGraphGetNodes", 10000, (void *)cuGraphGetNodes, 0},
    {"cuGraphNodeGetType", 10000, (void *)cuGraphNodeGetType, 0},
    {"cuGraphMemAllocNodeGetParams", 11040, (void *)cuGraphMemAllocNodeGetParams, 0},
    {"cuGraphChildGraphNodeGetGraph", 10000, (void *)cuGraphChildGraphNodeGetGraph, 0},
    {"cuGraphMemFreeNodeGetParams", 11040, (void *)cuGraphMemFreeNodeGetParams, 0},
    {"cuPointerGetAttribute", 4000, (void *)cuPointerGetAttribute, 0},
    {"cuArrayGetDescriptor", 3020, (void *)cuArrayGetDescriptor_v2, 0},
    {"cuMipmappedArrayGetLevel", 5000, (void *)cuMipmappedArrayGetLevel, 0},
    {"cuGraphExecDestroy", 10000, (void *)cuGraphExecDestroy, 0},
    {"cuGraphLaunch", 10000, (void *)cuGraphLaunch, (void *)cuGraphLaunch_ptsz},
    {"cuDeviceGraphMemTrim", 11040, (void *)cuDeviceGraphMemTrim, 0},
    {"cuDeviceGetGraphMemAttribute", 11040, (void *)cuDeviceGetGraphMemAttribute, 0},
    {"cuDeviceSetGraphMemAttribute", 11040, (void *)cuDeviceSetGraphMemAttribute, 0},
    {"cuGetErrorName", 6000, (void *)cuGetErrorName, 0},
    {"cuGetErrorString", 6000, (void *)cuGetErrorString, 0},
    {"cuGetProcAddress", 11030, (void *)cuGetProcAddress, 0},
    {"cuGetProcAddress", 12000, (void *)cuGetProcAddress_v2, 0},
};

extern int fakegpuSetActivity(int, int);

enum { PA_SUCCESS = 0, PA_SYMBOL_NOT_FOUND = 1, PA_VERSION_NOT_SUFFICIENT = 2 };

static CUresult lookup(const char *sym, void **pfn, int version, cuuint64_t flags, int *status)
{
    if (!sym || !pfn)
        return CUDA_ERROR_INVALID_VALUE;
    *pfn = NULL;
    if (strcmp(sym, "fakegpuSetActivity") == 0) {
        *pfn = (void *)fakegpuSetActivity;
        *status = PA_SUCCESS;
        return CUDA_SUCCESS;
    }
    int best = -1, seen = 0;
    for (size_t i = 0; i < sizeof TABLE / sizeof TABLE[0]; i++) {
        if (strcmp(TABLE[i].name, sym) != 0)
            continue;
        seen = 1;
        if (TABLE[i].version <= version && (best < 0 || TABLE[i].version > TABLE[best].version))
            best = (int)i;
    }
    if (best < 0) {
        *status = seen ? PA_VERSION_NOT_SUFFICIENT : PA_SYMBOL_NOT_FOUND;
        return CUDA_ERROR_NOT_FOUND;
    }
    *pfn = thunk_of((flags & 2 /* PER_THREAD_DEFAULT_STREAM */) && TABLE[best].ptds ? TABLE[best].ptds : TABLE[best].fn);
    *status = PA_SUCCESS;
    return CUDA_SUCCESS;
}

FG_API CUresult cuGetProcAddress(const char *sym, void **pfn, int version, cuuint64_t flags)
{
    int status;
    return lookup(sym, pfn, version, flags, &status);
}

FG_API CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int version, cuuint64_t flags, int *status)
{
    int st = PA_SYMBOL_NOT_FOUND;
    CUresult r = lookup(sym, pfn, version, flags, &st);
    if (status)
        *status = st;
    return r;
}
FG_API CUresult cuGetProcAddress_v2_ptsz(const char *sym, void **pfn, int version, cuuint64_t flags, int *status)
    __attribute__((alias("cuGetProcAddress_v2")));
