/* A library a program loads with RTLD_DEEPBIND (tests/test_interposer_stacking.py): its own scope
 * comes first, so its references to the driver (it is linked against libcuda.so.1) and to dlsym
 * bind there, not to a preloaded library, unless the preload steps in. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);

CUresult deep_alloc(CUdeviceptr *p, size_t n) { return cuMemAlloc_v2(p, n); }

static void *found;

/* As cudart and CuPy reach the driver: dlopen + dlsym. */
CUresult deep_dlsym_alloc(CUdeviceptr *p, size_t n)
{
    found = dlsym(dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD), "cuMemAlloc_v2");
    return found ? ((CUresult(*)(CUdeviceptr *, size_t))found)(p, n) : 500;
}

const char *deep_dlsym_who(void)
{
    Dl_info i;
    return found && dladdr(found, &i) && i.dli_fname && strstr(i.dli_fname, "libcolo-interpose") ? "interpose" : "driver";
}
