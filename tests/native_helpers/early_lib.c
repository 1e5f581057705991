/* A library the program links (DT_NEEDED) that uses the driver from its own constructor, before
 * a preloaded interposer's constructor has run (tests/test_interposer_share.py): it allocates
 * EARLY_BYTES and caches the allocation function as dlsym and cuGetProcAddress answer it. With
 * EARLY_THREADS=N, all of it happens on N threads at once (EARLY_BYTES / N each), started
 * together, while the constructor waits. */
#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>

#include "cuda_types.h"

CUresult cuInit(unsigned int);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuGetProcAddress(const char *, void **, int, cuuint64_t);

int early_rc;
void *early_dlsym, *early_gpa;
static int nthreads = 1, waiting;

static void *early(void *arg)
{
    (void)arg;
    CUcontext ctx;
    CUdeviceptr p;
    void *d, *g = NULL;
    /* all threads reach the driver at once: the interposer's set-up is raced */
    __atomic_sub_fetch(&waiting, 1, __ATOMIC_SEQ_CST);
    while (__atomic_load_n(&waiting, __ATOMIC_SEQ_CST) > 0) sched_yield();
    CUresult rc = cuInit(0);
    if (!rc) rc = cuDevicePrimaryCtxRetain(&ctx, 0);
    if (!rc) rc = cuCtxSetCurrent(ctx);
    if (!rc) rc = cuMemAlloc_v2(&p, strtoull(getenv("EARLY_BYTES"), NULL, 10) / (unsigned)nthreads);
    if (rc) __atomic_store_n(&early_rc, rc, __ATOMIC_SEQ_CST);
    d = dlsym(RTLD_DEFAULT, "cuMemAlloc_v2");
    if (cuGetProcAddress("cuMemAlloc", &g, 12000, 0)) g = NULL;
    __atomic_store_n(&early_dlsym, d, __ATOMIC_SEQ_CST);
    __atomic_store_n(&early_gpa, g, __ATOMIC_SEQ_CST);
    return NULL;
}

__attribute__((constructor)) static void init(void)
{
    const char *n = getenv("EARLY_THREADS");
    if (!n) {
        waiting = 1;
        early(NULL);
        return;
    }
    pthread_t t[64];
    nthreads = atoi(n) > 0 && atoi(n) <= 64 ? atoi(n) : 1;
    waiting = nthreads;
    for (int i = 0; i < nthreads; i++)
        if (pthread_create(&t[i], NULL, early, NULL) != 0) early_rc = -1;
    for (int i = 0; i < nthreads; i++) pthread_join(t[i], NULL);
}
