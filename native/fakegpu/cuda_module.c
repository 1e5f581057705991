/* Fake libcuda.so.1: modules and libraries whose globals (`__device__` variables) take device
 * memory at load, as a real module's do. The image format is the simulation's own: text starting
 * "FAKEGPU-MODULE globals=<bytes>" (anything else is CUDA_ERROR_INVALID_IMAGE), given in memory
 * (cuModuleLoadData[Ex], cuModuleLoadFatBinary, cuLibraryLoadData) or in a file (cuModuleLoad,
 * cuLibraryLoadFromFile). A module lives in the current context (its teardown frees it); a
 * library outlives contexts, its globals on the current context's device, until unloaded. */
#include "cuda_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CUDA_ERROR_INVALID_IMAGE 200
#define CUDA_ERROR_FILE_NOT_FOUND 301
static const char MAGIC[] = "FAKEGPU-MODULE globals=";

static CUresult parse(const char *img, uint64_t *globals)
{
    if (!img || strncmp(img, MAGIC, sizeof MAGIC - 1))
        return CUDA_ERROR_INVALID_IMAGE;
    char *end;
    unsigned long long v = strtoull(img + sizeof MAGIC - 1, &end, 10);
    if (end == img + sizeof MAGIC - 1)
        return CUDA_ERROR_INVALID_IMAGE;
    *globals = v;
    return CUDA_SUCCESS;
}

static CUresult read_file(const char *path, uint64_t *globals)
{
    char buf[128] = {0};
    FILE *f = path ? fopen(path, "re") : NULL;
    if (!f)
        return CUDA_ERROR_FILE_NOT_FOUND;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    return parse(buf, globals);
}

/* The globals' bytes, taken on the current context's device; *out: the handle. */
static CUresult load(uint64_t globals, int library, void **out)
{
    struct fg_ctx *c;
    CUresult r = fg_current(&c);
    if (r)
        return r;
    if (!out)
        return CUDA_ERROR_INVALID_VALUE;
    if (globals && (r = fg_dev_take(c->ord, globals)))
        return r;
    unsigned long long p = 0;
    if ((r = fg_record(c->ord, globals, K_MODULE, library ? NULL : c, NULL, 0, &p))) {
        fg_dev_give(c->ord, globals);
        return r;
    }
    *out = (void *)(uintptr_t)p;
    return CUDA_SUCCESS;
}

static CUresult load_image(const void *img, int library, void **out)
{
    uint64_t g = 0;
    CUresult r = parse(img, &g);
    return r ? r : load(g, library, out);
}

static CUresult load_path(const char *path, int library, void **out)
{
    uint64_t g = 0;
    CUresult r = read_file(path, &g);
    return r ? r : load(g, library, out);
}

static CUresult unload(void *h)
{
    CUresult r = fg_check_live();
    if (r)
        return r;
    struct alloc *a = h ? fg_unlink((uint64_t)(uintptr_t)h, K_MODULE) : NULL;
    if (!a)
        return CUDA_ERROR_INVALID_HANDLE;
    fg_release_alloc(a);
    return CUDA_SUCCESS;
}

FG_API CUresult cuModuleLoad(void **m, const char *path) { LOCKED(load_path(path, 0, m)); }
FG_API CUresult cuModuleLoadData(void **m, const void *img) { LOCKED(load_image(img, 0, m)); }
FG_API CUresult cuModuleLoadDataEx(void **m, const void *img, unsigned n, void *opts, void **vals)
{
    (void)n, (void)opts, (void)vals;
    LOCKED(load_image(img, 0, m));
}
FG_API CUresult cuModuleLoadFatBinary(void **m, const void *img) { LOCKED(load_image(img, 0, m)); }
FG_API CUresult cuModuleUnload(void *m) { LOCKED(unload(m)); }
FG_API CUresult cuLibraryLoadData(void **l, const void *img, void *jo, void **jv, unsigned nj, void *lo, void **lv,
                                  unsigned nl)
{
    (void)jo, (void)jv, (void)nj, (void)lo, (void)lv, (void)nl;
    LOCKED(load_image(img, 1, l));
}
FG_API CUresult cuLibraryLoadFromFile(void **l, const char *path, void *jo, void **jv, unsigned nj, void *lo,
                                      void **lv, unsigned nl)
{
    (void)jo, (void)jv, (void)nj, (void)lo, (void)lv, (void)nl;
    LOCKED(load_path(path, 1, l));
}
FG_API CUresult cuLibraryUnload(void *l) { LOCKED(unload(l)); }
