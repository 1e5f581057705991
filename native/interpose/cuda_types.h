/* The few CUDA driver and NVML types the interposer needs, declared from the public ABI so that
 * no CUDA headers are required to build. Only layouts that the wrappers read are spelled out. */
#ifndef COLO_CUDA_TYPES_H
#define COLO_CUDA_TYPES_H

#include <stddef.h>

typedef int CUresult;
enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_FOUND = 500,
};
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;           /* CUdeviceptr_v2 */
typedef unsigned int CUdeviceptr_v1;              /* 32-bit pointers of the pre-3.2 API */
typedef unsigned long long CUmemGenericAllocationHandle;
typedef unsigned long long cuuint64_t;
typedef struct CUstream_st *CUstream;
typedef struct CUmemPoolHandle_st *CUmemoryPool;
typedef struct CUarray_st *CUarray;
typedef struct CUmipmappedArray_st *CUmipmappedArray;
typedef int CUdriverProcAddressQueryResult;
typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUevent_st *CUevent;
typedef struct CUlib_st *CUlibrary;

typedef struct {
    size_t Width, Height;
    int Format;
    unsigned int NumChannels;
} CUDA_ARRAY_DESCRIPTOR;

typedef struct {
    size_t Width, Height, Depth;
    int Format;
    unsigned int NumChannels, Flags;
} CUDA_ARRAY3D_DESCRIPTOR;

typedef struct {
    unsigned int Width, Height;
    int Format;
    unsigned int NumChannels;
} CUDA_ARRAY_DESCRIPTOR_v1;

typedef struct {
    unsigned int Width, Height, Depth;
    int Format;
    unsigned int NumChannels, Flags;
} CUDA_ARRAY3D_DESCRIPTOR_v1;

enum { CU_MEM_LOCATION_TYPE_DEVICE = 1, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1 };
typedef struct {
    int type;                    /* CUmemAllocationType */
    int requestedHandleTypes;
    struct { int type; int id; } location;
    void *win32HandleMetaData;
    unsigned char allocFlags[8];
} CUmemAllocationProp;

enum { CUDA_ARRAY3D_SPARSE = 0x40, CUDA_ARRAY3D_DEFERRED_MAPPING = 0x80 };
enum { CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM = 2 };

typedef int nvmlReturn_t;
enum { NVML_SUCCESS = 0 };
typedef struct nvmlDevice_st *nvmlDevice_t;
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned int version; unsigned long long total, reserved, free, used; } nvmlMemory_v2_t;

#endif
