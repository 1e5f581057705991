/* The program linked against early_lib.c: allocates through the pointers the library cached at
 * load time and prints what each call answered and the free memory the budget leaves. */
#include <stdio.h>
#include <stdlib.h>

#include "cuda_types.h"

extern int early_rc;
extern void *early_dlsym, *early_gpa;
CUresult cuMemGetInfo_v2(size_t *, size_t *);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuCtxSetCurrent(CUcontext);

int main(void)
{
    size_t n = strtoull(getenv("LATE_BYTES"), NULL, 10), f = 0, t = 0;
    CUdeviceptr p;
    CUresult (*by_dlsym)(CUdeviceptr *, size_t) = (CUresult(*)(CUdeviceptr *, size_t))early_dlsym;
    CUresult (*by_gpa)(CUdeviceptr *, size_t) = (CUresult(*)(CUdeviceptr *, size_t))early_gpa;
    CUcontext ctx; /* current in this thread too (the library's may have been another's) */
    if (!by_dlsym || !by_gpa || cuDevicePrimaryCtxRetain(&ctx, 0) || cuCtxSetCurrent(ctx)) return 3;
    int a = by_dlsym(&p, n), b = by_gpa(&p, n);
    cuMemGetInfo_v2(&f, &t);
    printf("early %d dlsym %d gpa %d free %zu\n", early_rc, a, b, f);
    return 0;
}
