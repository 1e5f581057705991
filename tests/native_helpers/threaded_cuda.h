/* What the threaded test callers (ledger_lanes.c, table_shards.c) declare of the driver API: they
 * link against the simulated libcuda directly (tests/conftest.py build_native_helper). */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef void *CUcontext;
typedef unsigned long long CUdeviceptr;
CUresult cuInit(unsigned int);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, int);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
