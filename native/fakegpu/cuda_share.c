/* Fake libcuda.so.1: VMM memory shared through a shareable handle (POSIX file descriptor), as the
 * driver documents it: cuMemExportToShareableHandle hands out an fd naming the physical memory of
 * an allocation handle, cuMemImportFromShareableHandle (in this or any other process that got the
 * fd) makes a new handle to the same memory, and the memory lives until the last handle to it in
 * any process is released (mappings are not modelled as references: see docs/interposer.md).
 *
 * The fd is a memfd holding the memory's shared record (size, device, who was charged, and the
 * count of live handles in all processes). The bytes stay charged to the process that created the
 * memory until the last handle goes; if that process dies first, slot reaping already gave them
 * back (the simulation then holds them for nobody: a limit of the model). */
#include "cuda_internal.h"

#include <fcntl.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define SHARE_MAGIC 0x53484d31u /* "SHM1" */
#define CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR 1

struct fg_shm {
    uint32_t magic;
    int32_t refs;   /* live handles to the memory, in every process */
    uint64_t size;
    int32_t phys;   /* physical device */
    int32_t slot;   /* the slot charged for the bytes, at generation gen */
    uint32_t gen;
};

struct fg_shared {
    struct fg_shm *m;
    int fd;         /* this process's descriptor of the memfd (exports are dups of it) */
};

static struct fg_shared *attach(int fd)
{
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size != (off_t)sizeof(struct fg_shm))
        return NULL;
    struct fg_shm *m = mmap(NULL, sizeof *m, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED)
        return NULL;
    struct fg_shared *s = malloc(sizeof *s);
    if (!s || m->magic != SHARE_MAGIC) {
        free(s);
        munmap(m, sizeof *m);
        return NULL;
    }
    s->m = m;
    s->fd = fd;
    return s;
}

static void detach(struct fg_shared *s)
{
    munmap(s->m, sizeof *s->m);
    close(s->fd);
    free(s);
}

void fg_share_release(struct alloc *a)
{
    struct fg_shared *s = a->shared;
    if (__atomic_sub_fetch(&s->m->refs, 1, __ATOMIC_ACQ_REL) == 0) {
        fg_lock(&S);
        struct fg_slot *sl = &S.h->slot[s->m->slot];
        /* Not reaped meanwhile (reaping gave a dead creator's bytes back already). */
        if (sl->gen == s->m->gen && sl->state != 0 && !(sl->flags & FG_F_TERMINATED)) {
            sl->used[s->m->phys] -= s->m->size;
            S.h->dev[s->m->phys].used -= s->m->size;
        }
        fg_unlock(&S);
    }
    detach(s);
    a->shared = NULL;
    a->size = 0; /* the bytes were the shared record's: nothing of this process's to give */
    fg_release_alloc(a);
}

static CUresult export_fd(int *out, CUmemGenericAllocationHandle h, int type)
{
    CUresult r = fg_check_live();
    if (r)
        return r;
    struct alloc *a = fg_find(h);
    if (!out || !a || a->kind != K_HANDLE || type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return CUDA_ERROR_INVALID_VALUE;
    if (!a->shared) { /* first export: the memory gets its shared record, holding this handle */
        int fd = memfd_create("fakegpu-vmm", MFD_CLOEXEC);
        if (fd < 0 || ftruncate(fd, sizeof(struct fg_shm)) != 0) {
            if (fd >= 0)
                close(fd);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        struct fg_shm *m = mmap(NULL, sizeof *m, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        struct fg_shared *s = m == MAP_FAILED ? NULL : malloc(sizeof *s);
        if (!s) {
            if (m != MAP_FAILED)
                munmap(m, sizeof *m);
            close(fd);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        int phys = g_vis[a->ord];
        *m = (struct fg_shm){.magic = SHARE_MAGIC, .refs = 1, .size = a->size, .phys = phys, .slot = g_slot,
                             .gen = S.h->slot[g_slot].gen};
        *s = (struct fg_shared){.m = m, .fd = fd};
        a->shared = s;
    }
    int fd = fcntl(a->shared->fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *out = fd;
    return CUDA_SUCCESS;
}
FG_API CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle h, int type,
                                             unsigned long long flags)
{
    (void)flags;
    LOCKED(export_fd(out, h, type));
}

static CUresult import_fd(CUmemGenericAllocationHandle *h, void *os, int type)
{
    CUresult r = fg_check_live();
    if (r)
        return r;
    if (!h || type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return CUDA_ERROR_INVALID_VALUE;
    int fd = fcntl((int)(intptr_t)os, F_DUPFD_CLOEXEC, 0);
    struct fg_shared *s = fd < 0 ? NULL : attach(fd);
    if (!s) {
        if (fd >= 0)
            close(fd);
        return CUDA_ERROR_INVALID_VALUE;
    }
    int ord = -1;
    for (int i = 0; i < g_nvis; i++)
        if (g_vis[i] == s->m->phys)
            ord = i;
    /* A handle whose memory was released everywhere meanwhile cannot be revived. */
    int32_t n = __atomic_load_n(&s->m->refs, __ATOMIC_ACQUIRE);
    while (n > 0 && !__atomic_compare_exchange_n(&s->m->refs, &n, n + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
        ;
    if (ord < 0 || n <= 0) {
        if (n > 0)
            __atomic_sub_fetch(&s->m->refs, 1, __ATOMIC_ACQ_REL);
        detach(s);
        return ord < 0 ? CUDA_ERROR_INVALID_DEVICE : CUDA_ERROR_INVALID_VALUE;
    }
    /* A record holding no device bytes of this process's own (K_HANDLE: contexts do not free it). */
    unsigned long long p = 0;
    if ((r = fg_record(ord, s->m->size, K_HANDLE, NULL, NULL, 0, &p))) {
        __atomic_sub_fetch(&s->m->refs, 1, __ATOMIC_ACQ_REL);
        detach(s);
        return r;
    }
    fg_find(p)->shared = s;
    *h = p;
    return CUDA_SUCCESS;
}
FG_API CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *h, void *os, int type)
{
    LOCKED(import_fd(h, os, type));
}

typedef struct {
    int type, requestedHandleTypes;
    struct { int type, id; } location;
    void *win32HandleMetaData;
    unsigned char allocFlags[8];
} PROP;

static CUresult props(PROP *p, CUmemGenericAllocationHandle h)
{
    CUresult r = fg_check_live();
    if (r)
        return r;
    struct alloc *a = fg_find(h);
    if (!p || !a || a->kind != K_HANDLE)
        return CUDA_ERROR_INVALID_VALUE;
    *p = (PROP){.type = 1, .requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                .location = {.type = 1, .id = a->ord}};
    return CUDA_SUCCESS;
}
FG_API CUresult cuMemGetAllocationPropertiesFromHandle(PROP *p, CUmemGenericAllocationHandle h)
{
    LOCKED(props(p, h));
}
