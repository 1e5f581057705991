/* The job's ledger (see ledger.h for the layout and the liveness rule).
 *
 * Accounting is exact because every change of a counter happens under one process-shared robust
 * mutex, and the header totals are by construction the sum of the slots: if a process dies while
 * holding the mutex, the next locker recomputes the totals from the slots. Reservations are made
 * before the driver allocates and rolled back when it fails, so racing allocators can never pass
 * the budget together. */
#include "ledger.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "cuda_types.h"

_Static_assert(offsetof(struct ledger_header, used) == 64, "ledger layout");
_Static_assert(offsetof(struct ledger_header, peak) == 320, "ledger layout");
_Static_assert(offsetof(struct ledger_header, mutex) == LEDGER_MUTEX_OFFSET, "ledger layout");
_Static_assert(sizeof(struct ledger_header) <= LEDGER_HEADER_SIZE, "ledger layout");
_Static_assert(sizeof(struct ledger_slot) == LEDGER_SLOT_SIZE, "ledger layout");

enum { ST_UNOPENED = 0, ST_READY = 1, ST_FAILED = 2 };

static int g_enabled;
static uint64_t g_budget;          /* min(COLO_GPU_BUDGET, the ledger's budget) */
static const char *g_env_error;    /* why the environment alone already fails closed */
static const char *g_path;

static pthread_mutex_t g_init_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_state;                /* ST_*, read without the lock on the fast path */
static int g_fd = -1;
static struct ledger_header *g_hdr;
static size_t g_len;
static int g_slot = -1;
static struct ledger_slot *g_me;
static int g_logged;               /* the one refusal line of this process was written */

#define LOAD(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define STORE(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)

static void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void say(const char *fmt, ...)
{
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof buf - 1, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if (n > (int)sizeof buf - 2) n = sizeof buf - 2;
    buf[n++] = '\n';
    ssize_t w = write(2, buf, (size_t)n);
    (void)w;
}

static void human(uint64_t b, char *out, size_t n)
{
    if (b >= (1ULL << 30)) snprintf(out, n, "%.2f GiB", (double)b / (1ULL << 30));
    else if (b >= (1ULL << 20)) snprintf(out, n, "%.1f MiB", (double)b / (1ULL << 20));
    else snprintf(out, n, "%llu B", (unsigned long long)b);
}

void ledger_env_init(void)
{
    const char *b = getenv("COLO_GPU_BUDGET");
    if (!b || !*b) return;
    g_enabled = 1;
    char *end = NULL;
    errno = 0;
    unsigned long long v = strtoull(b, &end, 10);
    if (errno || end == b || *end || b[0] == '-')
        g_env_error = "COLO_GPU_BUDGET is not a number of bytes";
    else
        g_budget = v;
    g_path = getenv("COLO_LEDGER");
    if (!g_env_error && (!g_path || !*g_path)) g_env_error = "COLO_LEDGER is not set";
}

int ledger_enabled(void) { return g_enabled; }
uint64_t ledger_budget(void) { return g_budget; }

static struct ledger_slot *slot_at(int i)
{
    return (struct ledger_slot *)((char *)g_hdr + LEDGER_HEADER_SIZE + (size_t)i * LEDGER_SLOT_SIZE);
}

static off_t slot_off(int i) { return LEDGER_HEADER_SIZE + (off_t)i * LEDGER_SLOT_SIZE; }

/* OFD locks belong to the open file description, not the process: they survive in the owner for
 * as long as it lives and vanish when it dies, and they work across pid namespaces. */
static int ofd_lock(int cmd, short type, off_t start)
{
    struct flock fl = {.l_type = type, .l_whence = SEEK_SET, .l_start = start, .l_len = 1};
    return fcntl(g_fd, cmd, &fl);
}

static void lock_ledger(void)
{
    int r = pthread_mutex_lock(&g_hdr->mutex);
    if (r == EOWNERDEAD) {
        /* Its owner died mid-update: rebuild the totals from the slots, which are the truth. */
        for (int d = 0; d < LEDGER_MAX_DEV; d++) {
            uint64_t sum = 0;
            for (uint32_t i = 0; i < g_hdr->nslots; i++) sum += slot_at((int)i)->used[d];
            STORE(&g_hdr->used[d], sum);
        }
        pthread_mutex_consistent(&g_hdr->mutex);
    }
}

static void unlock_ledger(void) { pthread_mutex_unlock(&g_hdr->mutex); }

/* Under the mutex: return a dead slot's bytes and free it. */
static void drop_slot(struct ledger_slot *s)
{
    for (int d = 0; d < LEDGER_MAX_DEV; d++) {
        uint64_t u = s->used[d];
        if (!u) continue;
        uint64_t t = g_hdr->used[d];
        STORE(&g_hdr->used[d], t > u ? t - u : 0);
        STORE(&s->used[d], 0);
    }
    STORE(&s->state, SLOT_FREE);
}

/* Reclaim the slots of dead processes; returns how many bytes came back. */
static uint64_t reclaim_dead(void)
{
    uint64_t back = 0;
    for (uint32_t i = 0; i < g_hdr->nslots; i++) {
        if ((int)i == g_slot) continue;
        struct ledger_slot *s = slot_at((int)i);
        if (LOAD(&s->state) != SLOT_OWNED) continue;
        if (ofd_lock(F_OFD_SETLK, F_WRLCK, slot_off((int)i)) != 0) continue; /* alive */
        lock_ledger();
        if (s->state == SLOT_OWNED) {
            for (int d = 0; d < LEDGER_MAX_DEV; d++) back += s->used[d];
            drop_slot(s);
        }
        unlock_ledger();
        ofd_lock(F_OFD_SETLK, F_UNLCK, slot_off((int)i));
    }
    return back;
}

static int init_mutex(void)
{
    if (LOAD(&g_hdr->init_state) == LEDGER_INIT_DONE) return 0;
    /* First user of a fresh ledger: initialise the mutex under a file lock on byte 0, so that a
     * crash half way leaves it to be redone rather than half made. */
    if (ofd_lock(F_OFD_SETLKW, F_WRLCK, 0) != 0) return -1;
    int rc = 0;
    if (g_hdr->init_state != LEDGER_INIT_DONE) {
        pthread_mutexattr_t a;
        rc = pthread_mutexattr_init(&a) || pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED) ||
             pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST) ||
             pthread_mutex_init(&g_hdr->mutex, &a);
        pthread_mutexattr_destroy(&a);
        if (!rc) STORE(&g_hdr->init_state, LEDGER_INIT_DONE);
    }
    ofd_lock(F_OFD_SETLK, F_UNLCK, 0);
    return rc ? -1 : 0;
}

static int claim_slot(void)
{
    uint32_t n = g_hdr->nslots;
    uint32_t start = __atomic_fetch_add(&g_hdr->next_slot, 1, __ATOMIC_RELAXED);
    for (uint32_t k = 0; k < n; k++) {
        int i = (int)((start + k) % n);
        if (ofd_lock(F_OFD_SETLK, F_WRLCK, slot_off(i)) != 0) continue; /* a live owner */
        struct ledger_slot *s = slot_at(i);
        lock_ledger();
        if (s->state == SLOT_OWNED) drop_slot(s); /* its owner died: reclaim on the way */
        STORE(&s->pid, (int32_t)getpid());
        STORE(&s->refused, 0);
        STORE(&s->gen, s->gen + 1);
        STORE(&s->state, SLOT_OWNED);
        unlock_ledger();
        /* A classic lock too: F_GETLK on it tells a reader in any pid namespace our pid. */
        struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = slot_off(i) + 1, .l_len = 1};
        fcntl(g_fd, F_SETLK, &fl);
        g_slot = i;
        g_me = s;
        return 0;
    }
    return -1;
}

static const char *open_ledger(void)
{
    if (g_env_error) return g_env_error;
    g_fd = open(g_path, O_RDWR | O_CLOEXEC);
    if (g_fd < 0) return strerror(errno);
    off_t size = lseek(g_fd, 0, SEEK_END);
    if (size < LEDGER_HEADER_SIZE) return "file too small to be a ledger";
    struct ledger_header h;
    if (pread(g_fd, &h, sizeof h, 0) != (ssize_t)sizeof h) return "unreadable header";
    if (memcmp(h.magic, LEDGER_MAGIC, 8) != 0 || h.version != LEDGER_VERSION) return "not a colo ledger (magic/version)";
    if (h.header_size != LEDGER_HEADER_SIZE || h.slot_size != LEDGER_SLOT_SIZE || h.max_devices != LEDGER_MAX_DEV ||
        h.nslots == 0 || size < slot_off((int)h.nslots))
        return "ledger layout does not match this library";
    g_len = (size_t)slot_off((int)h.nslots);
    void *m = mmap(NULL, g_len, PROT_READ | PROT_WRITE, MAP_SHARED, g_fd, 0);
    if (m == MAP_FAILED) return strerror(errno);
    g_hdr = m;
    if (init_mutex() != 0) return "cannot initialise the ledger lock";
    if (h.budget < g_budget) g_budget = h.budget;
    if (claim_slot() != 0) return "no free process slot (too many live processes in this job)";
    return NULL;
}

/* 1 when the ledger is usable; opens it on first use. */
static int ready(void)
{
    int st = LOAD(&g_state);
    if (st != ST_UNOPENED) return st == ST_READY;
    pthread_mutex_lock(&g_init_mu);
    if (g_state == ST_UNOPENED) {
        const char *err = open_ledger();
        if (err) {
            say("colo: GPU memory budget set but the ledger %s is unusable (%s): refusing all GPU allocations",
                g_path ? g_path : "(unset)", err);
            g_logged = 1;
            STORE(&g_state, ST_FAILED);
        } else {
            STORE(&g_state, ST_READY);
        }
    }
    pthread_mutex_unlock(&g_init_mu);
    return LOAD(&g_state) == ST_READY;
}

static int refuse(int dev, uint64_t size, uint64_t in_use)
{
    if (g_hdr) __atomic_fetch_add(&g_hdr->refused, 1, __ATOMIC_RELAXED);
    if (g_me) __atomic_fetch_add(&g_me->refused, 1, __ATOMIC_RELAXED);
    if (!__atomic_exchange_n(&g_logged, 1, __ATOMIC_RELAXED)) {
        char a[32], b[32], c[32];
        human(size, a, sizeof a);
        human(g_budget, b, sizeof b);
        human(in_use, c, sizeof c);
        say("colo: allocation of %s refused: job budget %s, in use %s (GPU %d, pid %d; further refusals not logged)",
            a, b, c, dev, (int)getpid());
    }
    return CUDA_ERROR_OUT_OF_MEMORY;
}

static int try_reserve(int dev, uint64_t size, uint64_t *in_use)
{
    lock_ledger();
    uint64_t u = g_hdr->used[dev];
    int ok = size <= g_budget && u <= g_budget - size;
    if (ok) {
        STORE(&g_hdr->used[dev], u + size);
        STORE(&g_me->used[dev], g_me->used[dev] + size);
        if (u + size > g_hdr->peak[dev]) STORE(&g_hdr->peak[dev], u + size);
    }
    unlock_ledger();
    *in_use = u;
    return ok;
}

int ledger_reserve(int dev, uint64_t size)
{
    if (!ready()) return refuse(dev, size, 0);
    if (dev < 0 || dev >= LEDGER_MAX_DEV) return refuse(dev, size, 0);
    uint64_t in_use;
    if (try_reserve(dev, size, &in_use)) return 0;
    /* Before saying no, give back what dead processes still hold, then look again. */
    if (reclaim_dead() && try_reserve(dev, size, &in_use)) return 0;
    return refuse(dev, size, in_use);
}

void ledger_release(int dev, uint64_t size)
{
    if (LOAD(&g_state) != ST_READY || dev < 0 || dev >= LEDGER_MAX_DEV || !size) return;
    lock_ledger();
    uint64_t t = g_hdr->used[dev], m = g_me->used[dev];
    STORE(&g_hdr->used[dev], t > size ? t - size : 0);
    STORE(&g_me->used[dev], m > size ? m - size : 0);
    unlock_ledger();
}

uint64_t ledger_job_used(int dev)
{
    if (!ready() || dev < 0 || dev >= LEDGER_MAX_DEV) return UINT64_MAX;
    uint64_t u = LOAD(&g_hdr->used[dev]);
    if (u > LOAD(&g_me->used[dev])) {  /* others hold memory: some of them may be dead */
        reclaim_dead();
        u = LOAD(&g_hdr->used[dev]);
    }
    return u;
}

void ledger_atfork_prepare(void) { pthread_mutex_lock(&g_init_mu); }
void ledger_atfork_parent(void) { pthread_mutex_unlock(&g_init_mu); }

void ledger_atfork_child(void)
{
    /* The inherited descriptor shares the parent's lock: let go of it (the parent keeps its
     * slot and its allocations) and take a slot of our own when the child first needs one. */
    pthread_mutex_init(&g_init_mu, NULL);
    if (g_fd >= 0) close(g_fd);
    if (g_hdr) munmap(g_hdr, g_len);
    g_fd = -1;
    g_hdr = NULL;
    g_me = NULL;
    g_slot = -1;
    g_logged = 0;
    if (g_state == ST_READY) g_state = ST_UNOPENED;
    else if (g_state == ST_FAILED) g_logged = 1;  /* still failed closed; already said so */
}
