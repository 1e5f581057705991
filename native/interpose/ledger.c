/* The job's ledger (see ledger.h for the layout and the liveness rule).
 *
 * No lock: a reservation is one compare-and-swap on the device's total that never takes it past
 * the budget, so a process stopped (SIGSTOP, a frozen cgroup) anywhere in here blocks no one.
 * Each change is bracketed by the slot's started/finished counters, and ordered so that a
 * process killed between its two counter updates can only leave the total too high (the admission
 * counter moves first on the way up and last on the way down): never an overshoot. Reclaiming
 * such a slot asks for a resync, which recomputes the totals from the slots by a double collect
 * that only commits when no live process was mid-operation. */
#include "ledger.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
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
_Static_assert(sizeof(struct ledger_header) <= LEDGER_HEADER_SIZE, "ledger layout");
_Static_assert(offsetof(struct ledger_slot, started) == 24, "ledger layout");
_Static_assert(offsetof(struct ledger_slot, used) == 64, "ledger layout");
_Static_assert(sizeof(struct ledger_slot) == LEDGER_SLOT_SIZE, "ledger layout");

enum { ST_UNOPENED = 0, ST_READY = 1, ST_FAILED = 2 };

int colo_ledger_on; /* read inline by ledger_enabled() (ledger.h) */
static uint64_t g_budget;          /* min(COLO_GPU_BUDGET, the ledger's budget) */
static const char *g_env_error;    /* why the environment alone already fails closed */
static const char *g_path;

static pthread_mutex_t g_init_mu = PTHREAD_MUTEX_INITIALIZER; /* process-local: opening only */
static int g_state;                /* ST_*, read without the lock on the fast path */
static int g_fd = -1;
static struct ledger_header *g_hdr;
static size_t g_len;
static int g_slot = -1;
static struct ledger_slot *g_me;
static int g_logged;               /* the one refusal line of this process was written */

#define LOAD(p) __atomic_load_n((p), __ATOMIC_SEQ_CST)
#define STORE(p, v) __atomic_store_n((p), (v), __ATOMIC_SEQ_CST)
#define ADD(p, v) __atomic_add_fetch((p), (v), __ATOMIC_SEQ_CST)
#define CAS(p, expp, v) __atomic_compare_exchange_n((p), (expp), (v), 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)

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
    colo_ledger_on = 1;
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

uint64_t ledger_budget(void) { return g_budget; }

static struct ledger_slot *slot_at(uint32_t i)
{
    return (struct ledger_slot *)((char *)g_hdr + LEDGER_HEADER_SIZE + (size_t)i * LEDGER_SLOT_SIZE);
}

static off_t slot_off(uint32_t i) { return LEDGER_HEADER_SIZE + (off_t)i * LEDGER_SLOT_SIZE; }

/* OFD locks belong to the open file description, not the process: they survive in the owner for
 * as long as it lives and vanish when it dies, and they work across pid namespaces. Only ever
 * taken without waiting. */
static int ofd_lock(int cmd, short type, off_t start)
{
    struct flock fl = {.l_type = type, .l_whence = SEEK_SET, .l_start = start, .l_len = 1};
    return fcntl(g_fd, cmd, &fl);
}

/* Subtract up to v from *p, never below 0; returns what was subtracted. */
static uint64_t sub_clamped(uint64_t *p, uint64_t v)
{
    uint64_t cur = LOAD(p), take;
    do take = cur < v ? cur : v;
    while (take && !CAS(p, &cur, cur - take));
    return take;
}

/* We hold the dead owner's slot lock: give its bytes back and free the slot. */
static uint64_t reclaim_slot(struct ledger_slot *s)
{
    uint64_t back = 0;
    if (LOAD(&s->state) != SLOT_OWNED) return 0;
    ADD(&g_hdr->reclaims_begun, 1);
    int mid_op = LOAD(&s->started) != LOAD(&s->finished);
    for (int d = 0; d < LEDGER_MAX_DEV; d++) {
        uint64_t u = LOAD(&s->used[d]);
        if (!u) continue;
        back += sub_clamped(&g_hdr->used[d], u);
        STORE(&s->used[d], 0);
    }
    /* Killed between its two updates: the total may hold up to one operation too many. */
    if (mid_op) ADD(&g_hdr->resync, 1);
    STORE(&s->started, 0);
    STORE(&s->finished, 0);
    STORE(&s->state, SLOT_FREE);
    ADD(&g_hdr->reclaims_ended, 1);
    return back;
}

/* Recompute the totals from the slots. Commits only if no live process was mid-operation and
 * nothing was reclaimed during the two collects, and each total is still what was read: then
 * the slots' sums are exactly what the totals must be. Otherwise it is left for later. */
static void resync(void)
{
    uint32_t f0 = LOAD(&g_hdr->resync);
    if (!f0) return;
    uint32_t b0 = LOAD(&g_hdr->reclaims_begun);
    if (b0 != LOAD(&g_hdr->reclaims_ended)) return;
    uint64_t h0[LEDGER_MAX_DEV], sum[LEDGER_MAX_DEV] = {0};
    for (int d = 0; d < LEDGER_MAX_DEV; d++) h0[d] = LOAD(&g_hdr->used[d]);
    uint32_t hwm = LOAD(&g_hdr->hwm);
    uint64_t ops = 0;
    for (uint32_t i = 0; i < hwm; i++) {
        struct ledger_slot *s = slot_at(i);
        uint64_t st = LOAD(&s->started);
        if (st != LOAD(&s->finished)) return; /* mid-operation (or dead, not yet reclaimed) */
        ops += st;
    }
    for (uint32_t i = 0; i < hwm; i++)
        for (int d = 0; d < LEDGER_MAX_DEV; d++) sum[d] += LOAD(&slot_at(i)->used[d]);
    uint64_t ops2 = 0;
    for (uint32_t i = 0; i < hwm; i++) {
        struct ledger_slot *s = slot_at(i);
        uint64_t st = LOAD(&s->started);
        if (st != LOAD(&s->finished)) return;
        ops2 += st;
    }
    if (ops2 != ops || hwm != LOAD(&g_hdr->hwm) || LOAD(&g_hdr->reclaims_begun) != b0 ||
        LOAD(&g_hdr->reclaims_ended) != b0)
        return;
    int ok = 1;
    for (int d = 0; d < LEDGER_MAX_DEV; d++) {
        uint64_t expect = h0[d];
        if (expect != sum[d] && !CAS(&g_hdr->used[d], &expect, sum[d])) ok = 0;
    }
    if (ok) CAS(&g_hdr->resync, &f0, 0);
}

/* Reclaim the slots of dead processes; returns non-zero when something came back. */
static uint64_t reclaim_dead(void)
{
    uint64_t back = 0;
    uint32_t hwm = LOAD(&g_hdr->hwm);
    for (uint32_t i = 0; i < hwm; i++) {
        if ((int)i == g_slot) continue;
        struct ledger_slot *s = slot_at(i);
        if (LOAD(&s->state) != SLOT_OWNED) continue;
        if (ofd_lock(F_OFD_SETLK, F_WRLCK, slot_off(i)) != 0) continue; /* alive */
        back += reclaim_slot(s);
        ofd_lock(F_OFD_SETLK, F_UNLCK, slot_off(i));
    }
    if (LOAD(&g_hdr->resync)) resync();
    return back;
}

/* The lowest slot no live process owns, so that scans stay short (hwm ~ peak process count). */
static int claim_slot(void)
{
    uint32_t n = g_hdr->nslots;
    for (uint32_t i = 0; i < n; i++) {
        if (ofd_lock(F_OFD_SETLK, F_WRLCK, slot_off(i)) != 0) continue; /* a live owner */
        uint32_t h = LOAD(&g_hdr->hwm);
        while (h < i + 1 && !CAS(&g_hdr->hwm, &h, i + 1)) {}
        struct ledger_slot *s = slot_at(i);
        reclaim_slot(s); /* its owner died: reclaim on the way */
        STORE(&s->pid, (int32_t)getpid());
        STORE(&s->refused, 0);
        STORE(&s->gen, s->gen + 1);
        STORE(&s->state, SLOT_OWNED);
        /* A classic lock too: F_GETLK on it tells a reader in any pid namespace our pid. */
        struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = slot_off(i) + 1, .l_len = 1};
        fcntl(g_fd, F_SETLK, &fl);
        g_slot = (int)i;
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
        h.nslots == 0 || h.nslots > 65536 || size < slot_off(h.nslots))
        return "ledger layout does not match this library";
    g_len = (size_t)slot_off(h.nslots);
    void *m = mmap(NULL, g_len, PROT_READ | PROT_WRITE, MAP_SHARED, g_fd, 0);
    if (m == MAP_FAILED) return strerror(errno);
    g_hdr = m;
    if (h.budget < g_budget) g_budget = h.budget;
    if (claim_slot() != 0) return "no free process slot (too many live processes in this job)";
    return NULL;
}

/* 1 when the ledger is usable; opens it on first use. */
static int ready_slow(void);
static inline __attribute__((always_inline)) int ready(void)
{
    int st = LOAD(&g_state);
    return __builtin_expect(st == ST_READY, 1) ? 1 : ready_slow();
}

static __attribute__((noinline)) int ready_slow(void)
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
    if (g_hdr) ADD(&g_hdr->refused, 1);
    if (g_me) ADD(&g_me->refused, 1);
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

/* The admission counter moves first: a process dying before its slot follows leaves the total
 * too high, never too low. */
static inline __attribute__((always_inline)) int try_reserve(int dev, uint64_t size, uint64_t *in_use)
{
    uint64_t *total = &g_hdr->used[dev];
    ADD(&g_me->started, 1);
    uint64_t u = LOAD(total);
    do {
        if (size > g_budget || u > g_budget - size) {
            ADD(&g_me->finished, 1);
            *in_use = u;
            return 0;
        }
    } while (!CAS(total, &u, u + size));
    ADD(&g_me->used[dev], size);
    ADD(&g_me->finished, 1);
    uint64_t pk = LOAD(&g_hdr->peak[dev]);
    while (u + size > pk && !CAS(&g_hdr->peak[dev], &pk, u + size)) {}
    return 1;
}

int ledger_reserve(int dev, uint64_t size)
{
    if (!ready()) return refuse(dev, size, 0);
    if (dev < 0 || dev >= LEDGER_MAX_DEV) return refuse(dev, size, 0);
    uint64_t in_use;
    if (try_reserve(dev, size, &in_use)) return 0;
    /* Before saying no, give back what dead processes still hold, then look again. */
    reclaim_dead();
    if (try_reserve(dev, size, &in_use)) return 0;
    return refuse(dev, size, in_use);
}

int ledger_try(int dev, uint64_t size)
{
    uint64_t in_use;
    return ready() && dev >= 0 && dev < LEDGER_MAX_DEV && try_reserve(dev, size, &in_use);
}

/* The slot moves first on the way down, the total last (same reason as above). */
void ledger_release(int dev, uint64_t size)
{
    if (LOAD(&g_state) != ST_READY || dev < 0 || dev >= LEDGER_MAX_DEV || !size) return;
    /* Only bytes this process added are ever released (the table is exact), so plain subtractions
     * cannot go below 0. */
    ADD(&g_me->started, 1);
    __atomic_sub_fetch(&g_me->used[dev], size, __ATOMIC_SEQ_CST);
    __atomic_sub_fetch(&g_hdr->used[dev], size, __ATOMIC_SEQ_CST);
    ADD(&g_me->finished, 1);
}

uint64_t ledger_job_used(int dev)
{
    if (!ready() || dev < 0 || dev >= LEDGER_MAX_DEV) return UINT64_MAX;
    uint64_t u = LOAD(&g_hdr->used[dev]);
    if (u > LOAD(&g_me->used[dev]) || LOAD(&g_hdr->resync)) { /* others hold memory: some may be dead */
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
