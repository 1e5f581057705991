/* Test caller for the interposer's sharded pointer table (tests/test_table_shards.py):
 *
 *   table_shards THREADS ROUNDS KEEP SCANS
 *
 * THREADS threads allocate KEEP allocations of 64 KiB each in the primary context and free them
 * again (every other one first, then the rest), ROUNDS times; then each allocates KEEP more and
 * keeps them. Meanwhile one more thread, SCANS times, creates a context of its own, allocates 16
 * in it and destroys it: each destruction makes the table scan every shard for that context's
 * entries while the others insert and remove theirs (and shards grow). Each scan's allocations
 * have a size of their own ((s + 2) x 2 MiB), so the simulated driver never hands their
 * addresses out again: an entry a scan missed would stay (not be replaced) and stay counted. Prints
 * "held <bytes>" (what the threads kept), waits for a line on stdin: "free" frees them all and
 * prints "done". Any call that fails exits non-zero, naming it. */
#include "threaded_cuda.h"

CUresult cuCtxCreate_v2(CUcontext *, unsigned int, int);
CUresult cuCtxDestroy_v2(CUcontext);

#define SIZE (64u << 10)
static CUcontext primary;
static int rounds, keep, scans;
static CUdeviceptr *kept; /* THREADS x KEEP */

static void must(CUresult rc, const char *what)
{
    if (rc) {
        fprintf(stderr, "%s failed: %d\n", what, rc);
        exit(5);
    }
}

static void *worker(void *arg)
{
    CUdeviceptr *mine = kept + (uintptr_t)arg * (size_t)keep;
    must(cuCtxSetCurrent(primary), "cuCtxSetCurrent");
    for (int r = 0; r < rounds; r++) {
        for (int i = 0; i < keep; i++) must(cuMemAlloc_v2(&mine[i], SIZE), "cuMemAlloc_v2");
        for (int i = 0; i < keep; i += 2) must(cuMemFree_v2(mine[i]), "cuMemFree_v2");
        for (int i = 1; i < keep; i += 2) must(cuMemFree_v2(mine[i]), "cuMemFree_v2");
    }
    for (int i = 0; i < keep; i++) must(cuMemAlloc_v2(&mine[i], SIZE), "cuMemAlloc_v2");
    return NULL;
}

static void *scanner(void *arg)
{
    (void)arg;
    for (int s = 0; s < scans; s++) {
        CUcontext c;
        CUdeviceptr p;
        must(cuCtxCreate_v2(&c, 0, 0), "cuCtxCreate_v2");
        for (int i = 0; i < 16; i++) must(cuMemAlloc_v2(&p, (size_t)(s + 2) << 21), "cuMemAlloc_v2 (own context)");
        must(cuCtxDestroy_v2(c), "cuCtxDestroy_v2");
    }
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc != 5) return 2;
    int threads = atoi(argv[1]);
    rounds = atoi(argv[2]);
    keep = atoi(argv[3]);
    scans = atoi(argv[4]);
    if (threads < 1 || threads > 64 || rounds < 0 || keep < 1 || keep > 4096 || scans < 0) return 2;
    must(cuInit(0), "cuInit");
    must(cuDevicePrimaryCtxRetain(&primary, 0), "cuDevicePrimaryCtxRetain");
    kept = calloc((size_t)threads * keep, sizeof *kept);
    pthread_t th[65];
    for (int t = 0; t < threads; t++)
        if (pthread_create(&th[t], NULL, worker, (void *)(uintptr_t)t)) return 4;
    if (pthread_create(&th[threads], NULL, scanner, NULL)) return 4;
    for (int t = 0; t <= threads; t++) pthread_join(th[t], NULL);
    printf("held %llu\n", (unsigned long long)threads * keep * SIZE);
    fflush(stdout);
    char line[64];
    if (!fgets(line, sizeof line, stdin) || strncmp(line, "free", 4)) return 0;
    must(cuCtxSetCurrent(primary), "cuCtxSetCurrent");
    for (size_t i = 0; i < (size_t)threads * keep; i++) must(cuMemFree_v2(kept[i]), "cuMemFree_v2 (kept)");
    printf("done\n");
    return 0;
}
