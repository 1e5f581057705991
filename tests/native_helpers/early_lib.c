/* A library the program links (DT_NEEDED) that uses the driver from its own constructor, before
 * a preloaded interposer's constructor has run (tests/test_interposer_share.py): it allocates
 * EARLY_BYTES and caches the allocation function as dlsym and cuGetProcAddress answer it. With
 * EARLY_THREAD set, all of it happens on a second thread while the constructor waits. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>

#include "cuda_types.h"

CUresult cuInit(unsigned int);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuGetProcAddress(const char *, void **, int, cuuint64_t);

int early_rc = -1;
void *early_dlsym, *early_gpa;

static void *early(void *arg)
{
    (void)arg;
    CUcontext ctx;
    CUdeviceptr p;
    early_rc = cuInit(0);
    if (!early_rc) early_rc = cuDevicePrimaryCtxRetain(&ctx, 0);
    if (!early_rc) early_rc = cuCtxSetCurrent(ctx);
    if (!early_rc) early_rc = cuMemAlloc_v2(&p, strtoull(getenv("EARLY_BYTES"), NULL, 10));
    early_dlsym = dlsym(RTLD_DEFAULT, "cuMemAlloc_v2");
    if (cuGetProcAddress("cuMemAlloc", &early_gpa, 12000, 0)) early_gpa = NULL;
    return NULL;
}

__attribute__((constructor)) static void init(void)
{
    if (getenv("EARLY_THREAD")) {
        pthread_t t;
        if (pthread_create(&t, NULL, early, NULL) == 0) pthread_join(t, NULL);
    } else {
        early(NULL);
    }
}
