/* The job's ledger (see ledger.h for the layout and the liveness rule).
 *
 * No lock: a reservation is one compare-and-swap on the device's total that never takes it past
 * the budget, so a process stopped (SIGSTOP, a frozen cgroup) anywhere in here blocks no one.
 * Each change is bracketed by the started/finished counters of the calling thread's lane, and
 * ordered so that a process killed between its two counter updates can only leave the total too
 * high (the admission counter moves first on the way up and last on the way down): never an
 * overshoot. Reclaiming such a slot asks for a resync, which recomputes the totals from the slots
 * by a double collect that only commits when no live process was mid-operation.
 *
 * Cost: an alloc+free pair makes two locked instructions (the total's compare-and-swap and
 * subtraction, on the device's own line); everything else a thread writes is its own lane, with
 * plain stores. Memory orders: see lane_add() and try_reserve(). */
#include "ledger.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "cuda_types.h"
#include "source.h"

_Static_assert(offsetof(struct ledger_header, lanes) == 64, "ledger layout");
_Static_assert(offsetof(struct ledger_header, dev) == LEDGER_DEV_AT, "ledger layout");
_Static_assert(sizeof(struct ledger_dev) == 64, "ledger layout");
_Static_assert(sizeof(struct ledger_header) <= LEDGER_HEADER_SIZE, "ledger layout");
_Static_assert(sizeof(struct ledger_lane) == LEDGER_LANE_SIZE && LEDGER_LANE_SIZE % 64 == 0, "ledger layout");
_Static_assert(offsetof(struct ledger_slot, lane) == 64, "ledger layout");
_Static_assert(sizeof(struct ledger_slot) == LEDGER_SLOT_SIZE && LEDGER_SLOT_SIZE % 64 == 0, "ledger layout");
_Static_assert(LEDGER_LANES <= 32, "lanes are a 32-bit mask");

enum { ST_UNOPENED = 0, ST_READY = 1, ST_FAILED = 2 };

int colo_ledger_on = -1; /* read inline by ledger_enabled() (ledger.h); set by colo_interpose_setup */
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

/* Test hook: COLO_TEST_LEDGER_STOP names points of a reclaim or resync (comma-separated) where
 * this process stops itself (SIGSTOP), for a test to SIGKILL or continue it there. Tests only;
 * a job can stop itself anyway. */
enum { STOP_RECLAIM_MARKED = 1, STOP_RECLAIM_SUBTRACTED = 2, STOP_RESYNC_START = 4, STOP_RESYNC_COMMIT = 8 };
static unsigned g_test_stop;
static void test_stop(unsigned point)
{
    if (__builtin_expect(g_test_stop & point, 0)) raise(SIGSTOP);
}

/* Lanes of our slot: bit k of g_lanes_taken set = lane k is some live thread's (lane 0, shared,
 * is never taken). A thread keeps its lane in t_lane until it exits (the key's destructor gives
 * it back; its bytes stay in it, for the next thread to add to). g_epoch tells a destructor
 * inherited through fork() from one of this process. initial-exec: the library is preloaded,
 * so its TLS is in the static block and a lookup is one %fs-relative load. */
static uint32_t g_lanes_taken;
static unsigned g_epoch;
static pthread_key_t g_lane_key;
static int g_lane_key_ok;
static __thread struct ledger_lane *t_lane __attribute__((tls_model("initial-exec")));
static __thread int t_shared __attribute__((tls_model("initial-exec")));

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

int ledger_env_init(void)
{
    if (budget_source(&g_budget, &g_path, &g_env_error)) /* a colo job's: colo's file, not the env */
        return 1;
    const char *b = getenv("COLO_GPU_BUDGET");
    if (!b || !*b) return 0;
    char *end = NULL;
    errno = 0;
    unsigned long long v = strtoull(b, &end, 10);
    if (errno || end == b || *end || b[0] == '-')
        g_env_error = "COLO_GPU_BUDGET is not a number of bytes";
    else
        g_budget = v;
    g_path = getenv("COLO_LEDGER");
    if (!g_env_error && (!g_path || !*g_path)) g_env_error = "COLO_LEDGER is not set";
    const char *t = getenv("COLO_TEST_LEDGER_STOP");
    if (t) {
        static const char *const names[] = {"reclaim-marked", "reclaim-subtracted", "resync-start", "resync-commit"};
        for (unsigned i = 0; i < sizeof names / sizeof *names; i++)
            if (strstr(t, names[i])) g_test_stop |= 1u << i;
    }
    return 1;
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

/* Bytes slot s holds on device d: the sum of its lanes, modulo 2^64. */
static uint64_t slot_used(struct ledger_slot *s, int d)
{
    uint64_t u = 0;
    for (int k = 0; k < LEDGER_LANES; k++) u += LOAD(&s->lane[k].used[d]);
    return u;
}

/* Operations slot s has begun, or UINT64_MAX when one is in flight. finished is read before
 * started: equal then means that lane was idle at the first read (started only grows, and never
 * below finished), not merely that an operation begun before the first read ended by the second. */
static uint64_t slot_ops(struct ledger_slot *s)
{
    uint64_t ops = 0;
    for (int k = 0; k < LEDGER_LANES; k++) {
        uint64_t fin = LOAD(&s->lane[k].finished);
        if (LOAD(&s->lane[k].started) != fin) return UINT64_MAX;
        ops += fin;
    }
    return ops;
}

/* We hold the dead owner's slot lock: give its bytes back and free the slot.
 *
 * A reclaimer can be killed too, anywhere in here. Subtracting a device's bytes and clearing its
 * lanes are two steps, so the slot is marked RECLAIMING before the first subtraction: whoever
 * finds it still so (its reclaimer died: the lock was free) cannot know what was subtracted and
 * subtracts nothing more. It only clears the lanes, which can leave the totals too high (by what
 * the dead reclaimer had not yet subtracted), never too low, and asks for a resync, which makes
 * them exact. The mark is also what keeps a resync off a reclaim half done (see resync()): a
 * per-slot state, so a death cannot leave it standing once the slot is reclaimed again. */
static uint64_t reclaim_slot(struct ledger_slot *s)
{
    uint64_t back = 0;
    uint32_t st = LOAD(&s->state);
    if (st != SLOT_OWNED && st != SLOT_RECLAIMING) return 0;
    int again = st == SLOT_RECLAIMING;
    /* Mark, then count: a resync that read the count before it was raised sees the mark. */
    STORE(&s->state, SLOT_RECLAIMING);
    ADD(&g_hdr->reclaims, 1);
    test_stop(STOP_RECLAIM_MARKED);
    /* Killed between its two updates: the total may hold up to one operation too many for each
     * lane that was mid-operation. */
    int mid_op = again || slot_ops(s) == UINT64_MAX;
    for (int d = 0; d < LEDGER_MAX_DEV; d++) {
        uint64_t u = again ? 0 : slot_used(s, d);
        /* A sum above 2^63 is no real holding (a slot written by hand): subtract nothing, which
         * can only leave the total too high, and recompute it. */
        if ((int64_t)u < 0) mid_op = 1;
        else if (u) {
            back += sub_clamped(&g_hdr->dev[d].used, u);
            test_stop(STOP_RECLAIM_SUBTRACTED);
        }
        for (int k = 0; k < LEDGER_LANES; k++)
            if (LOAD(&s->lane[k].used[d])) STORE(&s->lane[k].used[d], 0);
    }
    if (mid_op) ADD(&g_hdr->resync, 1);
    for (int k = 0; k < LEDGER_LANES; k++) {
        STORE(&s->lane[k].started, 0);
        STORE(&s->lane[k].finished, 0);
    }
    STORE(&s->state, SLOT_FREE); /* after every store above: a resync that sees FREE sees them */
    return back;
}

/* Recompute the totals from the slots. Commits only if no live process was mid-operation and no
 * reclaim was under way or begun during the two collects, and each total is still what was read:
 * then the slots' sums are exactly what the totals must be. Otherwise it is left for later.
 *
 * The totals are read between the collects, when every slot is known idle and unchanged (the
 * first collect saw its operations finished, the second that none began since): h0 and the sums
 * are then of one instant, and a total still h0 at the compare-and-swap can only have moved by
 * whole operations since, which moved the slots as much. Read before the first collect, a free
 * counted in the sums (after h0) and an allocation after the second collect (total back to h0)
 * would set the total one allocation too low. */
static void resync_locked(void)
{
    uint32_t f0 = LOAD(&g_hdr->resync);
    if (!f0) return;
    uint32_t r0 = LOAD(&g_hdr->reclaims);
    test_stop(STOP_RESYNC_START);
    uint64_t h0[LEDGER_MAX_DEV], sum[LEDGER_MAX_DEV] = {0};
    uint32_t hwm = LOAD(&g_hdr->hwm);
    uint64_t ops = 0;
    for (uint32_t i = 0; i < hwm; i++) {
        struct ledger_slot *s = slot_at(i);
        /* A reclaim counted before r0 is still under way (or its reclaimer died): wait for it. One
         * counted after r0 fails the check below. */
        if (LOAD(&s->state) == SLOT_RECLAIMING) return;
        uint64_t o = slot_ops(s);
        if (o == UINT64_MAX) return; /* mid-operation (or dead, not yet reclaimed) */
        ops += o;
    }
    for (int d = 0; d < LEDGER_MAX_DEV; d++) h0[d] = LOAD(&g_hdr->dev[d].used);
    for (uint32_t i = 0; i < hwm; i++)
        for (int d = 0; d < LEDGER_MAX_DEV; d++) sum[d] += slot_used(slot_at(i), d);
    uint64_t ops2 = 0;
    for (uint32_t i = 0; i < hwm; i++) {
        uint64_t o = slot_ops(slot_at(i));
        if (o == UINT64_MAX) return;
        ops2 += o;
    }
    test_stop(STOP_RESYNC_COMMIT);
    if (ops2 != ops || hwm != LOAD(&g_hdr->hwm) || LOAD(&g_hdr->reclaims) != r0) return;
    int ok = 1;
    for (int d = 0; d < LEDGER_MAX_DEV; d++) {
        uint64_t expect = h0[d];
        if (expect != sum[d] && !CAS(&g_hdr->dev[d].used, &expect, sum[d])) ok = 0;
    }
    if (ok) CAS(&g_hdr->resync, &f0, 0);
}

/* One resync at a time in the job. The compare-and-swap proves a total is h0 again, not that it
 * never moved: another resync's commit (the total down to its sums) and then allocations (back
 * up to h0) would let ours set it too low by those allocations. Both locks are only tried: a
 * resync already running (or stopped) leaves the totals high for a while, never waits. The OFD
 * lock goes with a dead resyncer; g_resyncing covers our own threads, which share its owner. */
static int g_resyncing;

static void resync(void)
{
    if (!LOAD(&g_hdr->resync) || __atomic_exchange_n(&g_resyncing, 1, __ATOMIC_ACQUIRE)) return;
    if (ofd_lock(F_OFD_SETLK, F_WRLCK, LEDGER_RESYNC_LOCK) == 0) {
        resync_locked();
        ofd_lock(F_OFD_SETLK, F_UNLCK, LEDGER_RESYNC_LOCK);
    }
    __atomic_store_n(&g_resyncing, 0, __ATOMIC_RELEASE);
}

/* Reclaim the slots of dead processes; returns non-zero when something came back. */
static uint64_t reclaim_dead(void)
{
    uint64_t back = 0;
    uint32_t hwm = LOAD(&g_hdr->hwm);
    for (uint32_t i = 0; i < hwm; i++) {
        if ((int)i == g_slot) continue;
        struct ledger_slot *s = slot_at(i);
        if (LOAD(&s->state) == SLOT_FREE) continue; /* OWNED, or RECLAIMING by one that died */
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

static void lane_exit(void *v);

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
        h.lanes != LEDGER_LANES || h.lane_size != LEDGER_LANE_SIZE || h.nslots == 0 || h.nslots > 65536 || size < slot_off(h.nslots))
        return "ledger layout does not match this library";
    g_len = (size_t)slot_off(h.nslots);
    void *m = mmap(NULL, g_len, PROT_READ | PROT_WRITE, MAP_SHARED, g_fd, 0);
    if (m == MAP_FAILED) return strerror(errno);
    g_hdr = m;
    __atomic_store_n(&colo_gate_hdr, g_hdr, __ATOMIC_RELEASE); /* gate.c: the suspend word */
    if (h.budget < g_budget) g_budget = h.budget;
    if (claim_slot() != 0) return "no free process slot (too many live processes in this job)";
    /* Weak (libpthread's before glibc 2.34): without it, lanes of exited threads are not reused. */
    if (!g_lane_key_ok && pthread_key_create && pthread_setspecific)
        g_lane_key_ok = pthread_key_create(&g_lane_key, lane_exit) == 0;
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

/* A thread's first operation: take the lowest free lane, or share lane 0 when all are taken. */
static __attribute__((noinline)) struct ledger_lane *lane_slow(void)
{
    uint32_t m = __atomic_load_n(&g_lanes_taken, __ATOMIC_RELAXED);
    for (;;) {
        uint32_t free = ~m & (uint32_t)(((uint64_t)1 << LEDGER_LANES) - 2); /* lanes 1.. */
        if (!free) {
            t_shared = 1;
            return t_lane = &g_me->lane[0];
        }
        int k = __builtin_ctz(free);
        /* acquire: the lane's last owner's plain stores (released in lane_exit) are ours to add to. */
        if (__atomic_compare_exchange_n(&g_lanes_taken, &m, m | (1u << k), 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) {
            if (g_lane_key_ok) pthread_setspecific(g_lane_key, (void *)(((uintptr_t)g_epoch << 8) | (uintptr_t)k));
            t_shared = 0;
            return t_lane = &g_me->lane[k];
        }
    }
}

static inline __attribute__((always_inline)) struct ledger_lane *my_lane(void)
{
    struct ledger_lane *l = t_lane;
    return __builtin_expect(l != NULL, 1) ? l : lane_slow();
}

/* *p += v on our lane. A private lane has one writer (this thread), so a plain load and a
 * release store replace the locked add: the store is a plain mov on x86. release, because a
 * reader in another process (reclaim, resync) that sees this value with an acquire load must
 * also see every store this thread made before it, in particular the lane's started count
 * before its bytes, and its bytes and the total before its finished count. Not reentrant: the
 * interposer is not async-signal-safe anyway (its table takes a lock). */
static inline __attribute__((always_inline)) void lane_add(uint64_t *p, uint64_t v)
{
    if (__builtin_expect(!t_shared, 1))
        __atomic_store_n(p, __atomic_load_n(p, __ATOMIC_RELAXED) + v, __ATOMIC_RELEASE);
    else
        ADD(p, v);
}

/* The thread is gone: its lane (bytes and all) is free for the next thread. */
static void lane_exit(void *v)
{
    uintptr_t x = (uintptr_t)v;
    t_lane = NULL; /* a later destructor that frees memory takes a lane again */
    if ((x >> 8) != ((uintptr_t)g_epoch & (UINTPTR_MAX >> 8))) return; /* a parent's, before fork() */
    __atomic_fetch_and(&g_lanes_taken, ~(1u << (x & 0xff)), __ATOMIC_RELEASE);
}

/* The admission counter moves first: a process dying before its lane follows leaves the total
 * too high, never too low. The started count (a relaxed-ordered plain store on a private lane)
 * is ordered before the total's change by the compare-and-swap being a release operation (all
 * the total's changes are read-modify-writes, so a resync's acquire load of any later value of
 * the total sees it). */
static inline __attribute__((always_inline)) int try_reserve(int dev, uint64_t size, uint64_t *in_use)
{
    struct ledger_dev *dv = &g_hdr->dev[dev];
    struct ledger_lane *l = my_lane();
    lane_add(&l->started, 1);
    uint64_t u = LOAD(&dv->used);
    do {
        if (size > g_budget || u > g_budget - size) {
            lane_add(&l->finished, 1);
            *in_use = u;
            return 0;
        }
    } while (!CAS(&dv->used, &u, u + size));
    lane_add(&l->used[dev], size);
    lane_add(&l->finished, 1);
    /* The peak shares the total's line (ours now): a plain load, and a CAS only for a new peak. */
    uint64_t pk = __atomic_load_n(&dv->peak, __ATOMIC_RELAXED);
    while (u + size > pk && !CAS(&dv->peak, &pk, u + size)) {}
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

int ledger_refuse(int dev, uint64_t size)
{
    return refuse(dev, size, ready() && dev >= 0 && dev < LEDGER_MAX_DEV ? LOAD(&g_hdr->dev[dev].used) : 0);
}

int ledger_try(int dev, uint64_t size)
{
    uint64_t in_use;
    return ready() && dev >= 0 && dev < LEDGER_MAX_DEV && try_reserve(dev, size, &in_use);
}

/* The lane moves first on the way down, the total last (same reason as above). */
void ledger_release(int dev, uint64_t size)
{
    if (LOAD(&g_state) != ST_READY || dev < 0 || dev >= LEDGER_MAX_DEV || !size) return;
    /* Only bytes this process added are ever released (the table is exact), so the total cannot
     * go below 0; a lane may (modulo 2^64: another thread's allocation), the slot's sum cannot. */
    struct ledger_lane *l = my_lane();
    lane_add(&l->started, 1);
    lane_add(&l->used[dev], -size);
    __atomic_sub_fetch(&g_hdr->dev[dev].used, size, __ATOMIC_SEQ_CST);
    lane_add(&l->finished, 1);
}

/* Capacity views reclaim dead processes' memory at most once per VIEW_SCAN_NS in a process: a scan
 * takes one fcntl per slot in use, and frameworks ask for free memory often (per allocation,
 * some). A view may then show a process that died in the last 50 ms as still holding its bytes;
 * an allocation that does not fit reclaims at once (ledger_reserve). */
#define VIEW_SCAN_NS 50000000ull
static uint64_t g_view_scan_ns;

static uint64_t coarse_ns(void)
{
    struct timespec ts;
    if (clock_gettime(CLOCK_MONOTONIC_COARSE, &ts) != 0) return 0;
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

uint64_t ledger_job_used(int dev)
{
    if (!ready() || dev < 0 || dev >= LEDGER_MAX_DEV) return UINT64_MAX;
    uint64_t u = LOAD(&g_hdr->dev[dev].used);
    if (u > slot_used(g_me, dev) || LOAD(&g_hdr->resync)) { /* others hold memory: some may be dead */
        uint64_t now = coarse_ns(), last = __atomic_load_n(&g_view_scan_ns, __ATOMIC_RELAXED);
        if (!now || !last || now - last >= VIEW_SCAN_NS) {
            __atomic_store_n(&g_view_scan_ns, now, __ATOMIC_RELAXED);
            reclaim_dead();
            u = LOAD(&g_hdr->dev[dev].used);
        }
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
    colo_gate_hdr = NULL; /* gate.c: the mapping goes; the child's own ledger open sets it again */
    if (g_fd >= 0) close(g_fd);
    if (g_hdr) munmap(g_hdr, g_len);
    g_fd = -1;
    g_hdr = NULL;
    g_me = NULL;
    g_slot = -1;
    g_logged = 0;
    g_resyncing = 0; /* another thread of the parent's may have been resyncing */
    g_view_scan_ns = 0;
    /* We are the only thread: every lane is free, and ours was the parent's. */
    g_lanes_taken = 0;
    g_epoch++;
    t_lane = NULL;
    t_shared = 0;
    if (g_state == ST_READY) g_state = ST_UNOPENED;
    else if (g_state == ST_FAILED) g_logged = 1;  /* still failed closed; already said so */
}
