/* Test caller for the ledger's per-thread lanes (tests/test_ledger_lanes.py):
 *
 *   ledger_lanes WAVES THREADS FREES
 *   ledger_lanes churn THREADS
 *
 * WAVES times, THREADS threads start, each allocates 1 MiB, waits until all of its wave have
 * allocated (so they hold lanes at once), and exits keeping it. Then the main thread frees the
 * first FREES of these allocations (another thread's: its lane goes "below 0"), prints
 * "ready <allocated> <refused>", and waits for a line on stdin: "free" frees the rest and prints
 * "done"; end of input exits holding them. pthread_join: every thread's exit (and the lane it
 * gives back) is over before the next wave starts.
 *
 * churn: THREADS threads allocate 1 MiB each in a loop and swap it into one of 32 shared boxes,
 * freeing what another thread left there, until killed. */
#include "threaded_cuda.h"

static CUcontext ctx;
static pthread_barrier_t bar;
static CUdeviceptr ptrs[4096];
static int nptrs, refused;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

static void *grab(void *arg)
{
    (void)arg;
    CUdeviceptr p = 0;
    cuCtxSetCurrent(ctx);
    CUresult rc = cuMemAlloc_v2(&p, 1 << 20);
    pthread_mutex_lock(&mu);
    if (rc == 0) ptrs[nptrs++] = p;
    else refused++;
    pthread_mutex_unlock(&mu);
    pthread_barrier_wait(&bar);
    return NULL;
}

static CUdeviceptr box[32];

static void *churn(void *arg)
{
    unsigned i = (unsigned)(uintptr_t)arg;
    cuCtxSetCurrent(ctx);
    for (;; i += 7) {
        CUdeviceptr p = 0;
        if (cuMemAlloc_v2(&p, 1 << 20)) continue;
        CUdeviceptr old = __atomic_exchange_n(&box[i % 32], p, __ATOMIC_ACQ_REL);
        if (old && cuMemFree_v2(old)) exit(5);
    }
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc == 3 && !strcmp(argv[1], "churn")) {
        int threads = atoi(argv[2]);
        if (threads < 1 || threads > 256 || cuInit(0) || cuDevicePrimaryCtxRetain(&ctx, 0)) return 2;
        pthread_t t;
        for (int k = 0; k < threads; k++)
            if (pthread_create(&t, NULL, churn, (void *)(uintptr_t)k)) return 4;
        pthread_exit(NULL);
    }
    if (argc != 4) return 2;
    int waves = atoi(argv[1]), threads = atoi(argv[2]), frees = atoi(argv[3]);
    if (threads < 1 || threads > 256 || waves < 1 || waves * threads > 4096) return 2;
    if (cuInit(0) || cuDevicePrimaryCtxRetain(&ctx, 0) || cuCtxSetCurrent(ctx)) return 3;
    pthread_barrier_init(&bar, NULL, (unsigned)threads);
    pthread_t th[256];
    for (int w = 0; w < waves; w++) {
        for (int t = 0; t < threads; t++)
            if (pthread_create(&th[t], NULL, grab, NULL)) return 4;
        for (int t = 0; t < threads; t++) pthread_join(th[t], NULL);
    }
    int i = 0;
    for (; i < frees && i < nptrs; i++)
        if (cuMemFree_v2(ptrs[i])) return 5;
    printf("ready %d %d\n", nptrs, refused);
    fflush(stdout);
    char line[64];
    if (!fgets(line, sizeof line, stdin)) return 0;
    if (!strncmp(line, "free", 4))
        for (; i < nptrs; i++)
            if (cuMemFree_v2(ptrs[i])) return 5;
    printf("done\n");
    return 0;
}
