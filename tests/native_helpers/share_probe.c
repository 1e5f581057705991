/* C caller for the interposer's counting of memory shared through VMM shareable handles, of
 * module and library globals, and of array formats (tests/test_interposer_share.py). Linked
 * directly against the simulated libcuda; the budget is COLO_GPU_BUDGET (B).
 *
 *   same N       N rounds in one process: create B/2, export an fd, import it, map the import,
 *                release the original, unmap, release the import
 *   keep N       N rounds of create B/2, export, import, release the original, keeping the import
 *   cross N      `same` across two processes: the fd passed with SCM_RIGHTS, the peer imports and
 *                maps it, the creator releases, the peer unmaps and releases
 *   crosskeep N  as cross, the peer keeping each import mapped
 *   array F W H  one array of format F (hex), printed: code, bytes the ledger counts, bytes the
 *                driver took
 *   module PATH G  every load path with a module declaring G bytes of globals
 *   modctx G     a module of G bytes of globals, then the primary context reset: printed what the
 *                ledger and the device hold after
 *   events N     N randomised rounds of allocations freed on a stream (cuMemFreeAsync) and an event
 *                recorded there before or after the free, synchronised or queried; then a fitting
 *                allocation; printed: rounds, fitting allocations refused, over, uncounted
 *   edge         3B/4 freed on a stream nobody synchronises, then 3B/4 again (with
 *                COLO_FAKEGPU_STREAMS_RUN=1 the stream has done its work when asked)
 *
 * Every checkpoint compares what the device holds (the simulated driver's own count, all
 * processes) with the budget and with what the job's ledger counts (budget - free as the
 * interposer reports it); `over` and `uncounted` are the worst excess of each seen. */
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cuda_types.h"
#include "fakegpu.h"

CUresult cuInit(unsigned int);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuMemGetInfo_v2(size_t *, size_t *);
CUresult cuMemCreate(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
CUresult cuMemRelease(CUmemGenericAllocationHandle);
CUresult cuMemAddressReserve(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
CUresult cuMemAddressFree(CUdeviceptr, size_t);
CUresult cuMemMap(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
CUresult cuMemUnmap(CUdeviceptr, size_t);
CUresult cuMemExportToShareableHandle(void *, CUmemGenericAllocationHandle, int, unsigned long long);
CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *, void *, int);
CUresult cuArray3DCreate_v2(CUarray *, const CUDA_ARRAY3D_DESCRIPTOR *);
CUresult cuArrayDestroy(CUarray);
CUresult cuModuleLoad(CUmodule *, const char *);
CUresult cuModuleLoadData(CUmodule *, const void *);
CUresult cuModuleLoadDataEx(CUmodule *, const void *, unsigned, void *, void **);
CUresult cuModuleLoadFatBinary(CUmodule *, const void *);
CUresult cuModuleUnload(CUmodule);
CUresult cuLibraryLoadData(CUlibrary *, const void *, void *, void **, unsigned, void *, void **, unsigned);
CUresult cuLibraryLoadFromFile(CUlibrary *, const char *, void *, void **, unsigned, void *, void **, unsigned);
CUresult cuLibraryUnload(CUlibrary);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuDevicePrimaryCtxReset_v2(CUdevice);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemFreeAsync(CUdeviceptr, CUstream);
CUresult cuStreamCreate(CUstream *, unsigned);
CUresult cuStreamSynchronize(CUstream);
CUresult cuEventCreate(CUevent *, unsigned);
CUresult cuEventRecord(CUevent, CUstream);
CUresult cuEventSynchronize(CUevent);
CUresult cuEventQuery(CUevent);
CUresult cuEventDestroy_v2(CUevent);

static struct fg_header *fake;
static uint64_t budget, over, uncounted;

static void die(const char *what, CUresult rc)
{
    fprintf(stderr, "share_probe: %s failed: %d\n", what, rc);
    exit(90);
}
#define CHECK(call)                                                                                \
    do {                                                                                           \
        CUresult rc_ = (call);                                                                     \
        if (rc_) die(#call, rc_);                                                                  \
    } while (0)

static void init(void)
{
    CUcontext ctx;
    CHECK(cuInit(0));
    CHECK(cuDevicePrimaryCtxRetain(&ctx, 0));
    CHECK(cuCtxSetCurrent(ctx));
    int fd = open(getenv("COLO_FAKEGPU_STATE"), O_RDONLY);
    void *m = fd < 0 ? MAP_FAILED : mmap(NULL, sizeof *fake, PROT_READ, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) die("mapping the simulated driver's state", 0);
    fake = m;
    close(fd);
}

static uint64_t device_used(void) { return __atomic_load_n(&fake->dev[0].used, __ATOMIC_ACQUIRE); }

static uint64_t ledger_used(void)
{
    size_t f = 0, t = 0;
    CHECK(cuMemGetInfo_v2(&f, &t));
    return t - f;
}

/* What the device holds against the budget and against what the ledger counts. */
static void checkpoint(void)
{
    uint64_t d = device_used(), l = ledger_used();
    if (d > budget && d - budget > over) over = d - budget;
    if (d > l && d - l > uncounted) uncounted = d - l;
}

static CUmemAllocationProp prop = {.type = 1, .requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                                   .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0}};

static CUresult import_map(int fd, uint64_t n, CUmemGenericAllocationHandle *h, CUdeviceptr *va)
{
    CUresult rc = cuMemImportFromShareableHandle(h, (void *)(intptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    if (rc) return rc;
    CHECK(cuMemAddressReserve(va, n, 0, 0, 0));
    rc = cuMemMap(*va, n, 0, *h, 0);
    if (rc) {
        CHECK(cuMemAddressFree(*va, n));
        CHECK(cuMemRelease(*h));
        *va = 0;
    }
    return rc;
}

static void unmap_release(CUmemGenericAllocationHandle h, CUdeviceptr va, uint64_t n)
{
    CHECK(cuMemUnmap(va, n));
    CHECK(cuMemAddressFree(va, n));
    CHECK(cuMemRelease(h));
}

static int same(int rounds, int keep)
{
    uint64_t n = budget / 2;
    int ok = 0, refused = 0;
    for (int i = 0; i < rounds; i++) {
        CUmemGenericAllocationHandle h, h2;
        CUdeviceptr va = 0;
        int fd = -1;
        CUresult rc = cuMemCreate(&h, n, &prop, 0);
        checkpoint();
        if (rc) { refused++; continue; }
        CHECK(cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
        if (keep) {
            CHECK(cuMemImportFromShareableHandle(&h2, (void *)(intptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
        } else {
            CHECK(import_map(fd, n, &h2, &va));
        }
        checkpoint();
        CHECK(cuMemRelease(h)); /* the import keeps the memory */
        checkpoint();
        close(fd);
        if (!keep) {
            unmap_release(h2, va, n);
            checkpoint();
        }
        ok++;
    }
    printf("rounds %d refused %d over %llu uncounted %llu ledger %llu device %llu\n", ok, refused,
           (unsigned long long)over, (unsigned long long)uncounted, (unsigned long long)ledger_used(),
           (unsigned long long)device_used());
    return 0;
}

static void send_fd(int sock, int fd)
{
    char c = 'f';
    struct iovec iov = {&c, 1};
    union { struct cmsghdr h; char buf[CMSG_SPACE(sizeof(int))]; } u;
    memset(&u, 0, sizeof u);
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf, .msg_controllen = sizeof u.buf};
    struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(cm), &fd, sizeof fd);
    if (sendmsg(sock, &msg, 0) != 1) die("sendmsg", 0);
}

static int recv_fd(int sock)
{
    char c;
    struct iovec iov = {&c, 1};
    union { struct cmsghdr h; char buf[CMSG_SPACE(sizeof(int))]; } u;
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf, .msg_controllen = sizeof u.buf};
    if (recvmsg(sock, &msg, 0) != 1) return -1;
    struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
    int fd = -1;
    if (cm && cm->cmsg_type == SCM_RIGHTS) memcpy(&fd, CMSG_DATA(cm), sizeof fd);
    return fd;
}

static void say(int sock, char c) { if (write(sock, &c, 1) != 1) die("write", 0); }
static char hear(int sock)
{
    char c = 0;
    if (read(sock, &c, 1) != 1) die("read", 0);
    return c;
}

/* The peer: imports each fd it is sent, maps it, answers 'm' (mapped) or 'r' (refused); then, told
 * 'u', unmaps and releases it (unless keeping). */
static int peer(int sock, uint64_t n, int keep)
{
    init();
    for (;;) {
        int fd = recv_fd(sock);
        if (fd < 0) return 0;
        CUmemGenericAllocationHandle h;
        CUdeviceptr va = 0;
        CUresult rc = import_map(fd, n, &h, &va);
        close(fd);
        say(sock, rc ? 'r' : 'm');
        if (hear(sock) != 'u') return 1;
        if (!rc && !keep) unmap_release(h, va, n);
        say(sock, 'd');
    }
}

static int cross(int rounds, int keep)
{
    uint64_t n = budget / 2;
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv)) die("socketpair", 0);
    pid_t pid = fork(); /* before either touches the driver: each its own process of the job */
    if (pid == 0) {
        close(sv[0]);
        _exit(peer(sv[1], n, keep));
    }
    close(sv[1]);
    init();
    int ok = 0, refused = 0, peer_refused = 0;
    for (int i = 0; i < rounds; i++) {
        CUmemGenericAllocationHandle h;
        int fd = -1;
        CUresult rc = cuMemCreate(&h, n, &prop, 0);
        checkpoint();
        if (rc) { refused++; continue; }
        CHECK(cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
        send_fd(sv[0], fd);
        close(fd);
        if (hear(sv[0]) == 'r') peer_refused++;
        checkpoint();
        CHECK(cuMemRelease(h)); /* the peer's import keeps the memory */
        checkpoint();
        say(sv[0], 'u');
        hear(sv[0]);
        checkpoint();
        ok++;
    }
    close(sv[0]);
    int st = 0;
    waitpid(pid, &st, 0);
    printf("rounds %d refused %d peer_refused %d over %llu uncounted %llu peer_exit %d\n", ok, refused,
           peer_refused, (unsigned long long)over, (unsigned long long)uncounted,
           WIFEXITED(st) ? WEXITSTATUS(st) : 128);
    return 0;
}

static int array(int fmt, uint64_t w, uint64_t h)
{
    CUDA_ARRAY3D_DESCRIPTOR d = {.Width = w, .Height = h, .Depth = 0, .Format = fmt, .NumChannels = 4};
    uint64_t l0 = ledger_used(), d0 = device_used();
    CUarray a = NULL;
    CUresult rc = cuArray3DCreate_v2(&a, &d);
    printf("array %d %llu %llu\n", rc, (unsigned long long)(ledger_used() - l0),
           (unsigned long long)(device_used() - d0));
    if (!rc) CHECK(cuArrayDestroy(a));
    return 0;
}

/* Each load path with a module of `globals` bytes: code, ledger count, device bytes; then unloaded. */
static int modules(const char *path, uint64_t globals)
{
    char img[96];
    snprintf(img, sizeof img, "FAKEGPU-MODULE globals=%llu\n", (unsigned long long)globals);
    const char *names[] = {"load", "data", "dataex", "fatbin", "libdata", "libfile"};
    for (int k = 0; k < 6; k++) {
        void *m = NULL;
        uint64_t l0 = ledger_used(), d0 = device_used();
        CUresult rc;
        switch (k) {
        case 0: rc = cuModuleLoad((CUmodule *)&m, path); break;
        case 1: rc = cuModuleLoadData((CUmodule *)&m, img); break;
        case 2: rc = cuModuleLoadDataEx((CUmodule *)&m, img, 0, NULL, NULL); break;
        case 3: rc = cuModuleLoadFatBinary((CUmodule *)&m, img); break;
        case 4: rc = cuLibraryLoadData((CUlibrary *)&m, img, NULL, NULL, 0, NULL, NULL, 0); break;
        default: rc = cuLibraryLoadFromFile((CUlibrary *)&m, path, NULL, NULL, 0, NULL, NULL, 0); break;
        }
        uint64_t l1 = ledger_used(), d1 = device_used();
        if (!rc) CHECK(k < 4 ? cuModuleUnload(m) : cuLibraryUnload(m));
        printf("%s %d %llu %llu %llu\n", names[k], rc, (unsigned long long)(l1 - l0),
               (unsigned long long)(d1 - d0), (unsigned long long)(ledger_used() - l0 + device_used() - d0));
    }
    return 0;
}

/* A fitting allocation (the device holds room for it within the budget) must not be refused. */
static int refused_fitting;
static CUresult alloc_checked(CUdeviceptr *p, uint64_t n)
{
    uint64_t d = device_used();
    CUresult rc = cuMemAlloc_v2(p, n);
    if (rc == CUDA_ERROR_OUT_OF_MEMORY && d + n <= budget) refused_fitting++;
    checkpoint();
    return rc;
}

static int events(int rounds)
{
    CUstream s;
    CUevent e;
    CHECK(cuStreamCreate(&s, 0));
    CHECK(cuEventCreate(&e, 0));
    srand(46);
    uint64_t mib = 1 << 20, q = budget / mib;
    for (int i = 0; i < rounds; i++) {
        CUdeviceptr p, p2;
        uint64_t n = (q / 4 + (uint64_t)rand() % (q / 2)) * mib;
        int before = rand() % 4 == 0, query = rand() % 2;
        if (alloc_checked(&p, n)) continue;
        if (before) CHECK(cuEventRecord(e, s)); /* recorded before the free: says nothing of it */
        CHECK(cuMemFreeAsync(p, s));
        checkpoint();
        if (!before) CHECK(cuEventRecord(e, s));
        if (query) {
            CUresult rc = cuEventQuery(e);
            if (rc && rc != 600 /* NOT_READY */) die("cuEventQuery", rc);
            if (rc) CHECK(cuEventSynchronize(e));
        } else {
            CHECK(cuEventSynchronize(e));
        }
        checkpoint();
        if (before) CHECK(cuStreamSynchronize(s));
        if (!alloc_checked(&p2, budget - budget / 4)) CHECK(cuMemFree_v2(p2));
        checkpoint();
    }
    CHECK(cuEventDestroy_v2(e));
    printf("rounds %d refused_fitting %d over %llu uncounted %llu ledger %llu\n", rounds, refused_fitting,
           (unsigned long long)over, (unsigned long long)uncounted, (unsigned long long)ledger_used());
    return 0;
}

static int modctx(uint64_t globals)
{
    char img[96];
    CUmodule m;
    CUcontext ctx;
    snprintf(img, sizeof img, "FAKEGPU-MODULE globals=%llu\n", (unsigned long long)globals);
    CHECK(cuModuleLoadData(&m, img));
    uint64_t held = ledger_used();
    CHECK(cuDevicePrimaryCtxReset_v2(0)); /* frees the module with its context */
    CHECK(cuDevicePrimaryCtxRetain(&ctx, 0));
    CHECK(cuCtxSetCurrent(ctx));
    printf("loaded %llu ledger %llu device %llu\n", (unsigned long long)held, (unsigned long long)ledger_used(),
           (unsigned long long)device_used());
    return 0;
}

static int edge(void)
{
    CUstream s;
    CUdeviceptr p, p2;
    uint64_t n = budget - budget / 4;
    CHECK(cuStreamCreate(&s, 0));
    CHECK(cuMemAlloc_v2(&p, n));
    CHECK(cuMemFreeAsync(p, s));
    CUresult rc = alloc_checked(&p2, n);
    printf("edge %d refused_fitting %d uncounted %llu\n", rc, refused_fitting, (unsigned long long)uncounted);
    return 0;
}

int main(int argc, char **argv)
{
    const char *b = getenv("COLO_GPU_BUDGET");
    budget = b ? strtoull(b, NULL, 10) : 0;
    if (argc < 2 || !budget) {
        fprintf(stderr, "usage: share_probe same|keep|cross|crosskeep N | array F W H | module PATH G\n");
        return 2;
    }
    setvbuf(stdout, NULL, _IONBF, 0);
    const char *c = argv[1];
    if (argc >= 3 && (!strcmp(c, "cross") || !strcmp(c, "crosskeep"))) return cross(atoi(argv[2]), !strcmp(c, "crosskeep"));
    init();
    if (argc >= 3 && (!strcmp(c, "same") || !strcmp(c, "keep"))) return same(atoi(argv[2]), !strcmp(c, "keep"));
    if (!strcmp(c, "array") && argc == 5)
        return array((int)strtol(argv[2], NULL, 16), strtoull(argv[3], NULL, 10), strtoull(argv[4], NULL, 10));
    if (!strcmp(c, "module") && argc == 4) return modules(argv[2], strtoull(argv[3], NULL, 10));
    if (!strcmp(c, "events") && argc == 3) return events(atoi(argv[2]));
    if (!strcmp(c, "edge")) return edge();
    if (!strcmp(c, "modctx") && argc == 3) return modctx(strtoull(argv[2], NULL, 10));
    return 2;
}
