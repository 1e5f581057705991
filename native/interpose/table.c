/* Open-addressing hash table (linear probing, backward-shift deletion: no tombstones to slow
 * lookups down over a long run), grown at half load. One lock per process: a spinlock, since every
 * critical section is a few dozen instructions (a pthread mutex costs two locked instructions and
 * a call each way on every allocation and free); a waiter that spins long yields the CPU, so a
 * holder that was preempted gets it back. */
#include "table.h"

#include <sched.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

static int mu; /* 0 free, 1 held */

static void lock_mu(void)
{
    for (int spins = 0; __atomic_exchange_n(&mu, 1, __ATOMIC_ACQUIRE);) {
        while (__atomic_load_n(&mu, __ATOMIC_RELAXED)) {
            if (++spins < 64) __builtin_ia32_pause();
            else sched_yield();
        }
    }
}

static void unlock_mu(void) { __atomic_store_n(&mu, 0, __ATOMIC_RELEASE); }
#define pthread_mutex_lock(m) lock_mu()
#define pthread_mutex_unlock(m) unlock_mu()
static struct alloc *tab;   /* kind == 0 marks an empty cell */
static size_t cap, count;
static size_t max_cap = (size_t)1 << 40;  /* COLO_TEST_TABLE_MAX lowers it (tests only) */

void table_env_init(void)
{
    const char *v = getenv("COLO_TEST_TABLE_MAX");
    if (v && *v) max_cap = (size_t)strtoull(v, NULL, 10);
}

static size_t hash_in(int kind, uint64_t key, size_t c)
{
    /* A full mix (murmur3's finaliser): keys are driver addresses in arithmetic progressions
     * (pages 2 MiB apart, handles 4 MiB apart), which a plain multiplicative hash lays onto
     * overlapping lattices, and linear probing then builds long runs. */
    uint64_t h = key ^ ((uint64_t)kind << 59);
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 33;
    return (size_t)h & (c - 1);
}

static size_t hash(int kind, uint64_t key) { return hash_in(kind, key, cap); }

static void insert_raw(struct alloc *t, size_t c, const struct alloc *a)
{
    size_t i = hash_in(a->kind, a->key, c);
    while (t[i].kind) i = (i + 1) & (c - 1);
    t[i] = *a;
}

static int grow(void)
{
    size_t nc = cap ? cap * 2 : 1024;
    struct alloc *nt = nc <= max_cap ? calloc(nc, sizeof *nt) : NULL;
    if (!nt) return -1;
    for (size_t i = 0; i < cap; i++)
        if (tab[i].kind) insert_raw(nt, nc, &tab[i]);
    free(tab);
    tab = nt;
    cap = nc;
    return 0;
}

static long find(int kind, uint64_t key)
{
    if (!cap) return -1;
    for (size_t i = hash(kind, key);; i = (i + 1) & (cap - 1)) {
        if (!tab[i].kind) return -1;
        if (tab[i].key == key && tab[i].kind == kind) return (long)i;
    }
}

static void remove_at(size_t i)
{
    /* Shift later members of the probe run back so that no gap breaks it. */
    size_t j = i;
    for (;;) {
        tab[i].kind = 0;
        for (;;) {
            j = (j + 1) & (cap - 1);
            if (!tab[j].kind) { count--; return; }
            size_t h = hash(tab[j].kind, tab[j].key);
            /* Does j's home lie cyclically outside (i, j]? Then it may move into i. */
            if (i <= j ? (h <= i || h > j) : (h <= i && h > j)) break;
        }
        tab[i] = tab[j];
        i = j;
    }
}

int table_put(const struct alloc *a, struct alloc *old)
{
    int r = 0;
    pthread_mutex_lock(&mu);
    if ((count + 1) * 2 > cap && grow() != 0) {
        long i = find(a->kind, a->key); /* full: only a replacement can go in */
        if (i >= 0) {
            *old = tab[i];
            tab[i] = *a;
            r = 1;
        } else {
            r = -1;
        }
        pthread_mutex_unlock(&mu);
        return r;
    }
    size_t i = hash(a->kind, a->key); /* one probe run: the entry, or the empty cell it goes in */
    while (tab[i].kind && !(tab[i].key == a->key && tab[i].kind == a->kind)) i = (i + 1) & (cap - 1);
    if (tab[i].kind) {
        *old = tab[i];
        r = 1;
    } else {
        count++;
    }
    tab[i] = *a;
    pthread_mutex_unlock(&mu);
    return r;
}

int table_get(int kind, uint64_t key, struct alloc *out)
{
    pthread_mutex_lock(&mu);
    long i = find(kind, key);
    if (i >= 0) *out = tab[i];
    pthread_mutex_unlock(&mu);
    return i >= 0;
}

int table_take(int kind, uint64_t key, struct alloc *out)
{
    pthread_mutex_lock(&mu);
    long i = find(kind, key);
    if (i >= 0) { *out = tab[i]; remove_at((size_t)i); }
    pthread_mutex_unlock(&mu);
    return i >= 0;
}

int table_ref(uint64_t handle, int delta, struct alloc *out)
{
    int gone = -1;
    pthread_mutex_lock(&mu);
    long i = find(K_VMM, handle);
    if (i >= 0) {
        gone = 0;
        tab[i].refs += (uint32_t)delta;
        if (tab[i].refs == 0) { *out = tab[i]; remove_at((size_t)i); gone = 1; }
    }
    pthread_mutex_unlock(&mu);
    return gone;
}

int table_take_maps(uint64_t lo, uint64_t hi, void (*fn)(const struct alloc *))
{
    int n = 0;
    for (uint64_t at = lo; at < hi;) {
        struct alloc m;
        if (!table_take(K_MAP, at, &m)) break;
        fn(&m);
        n++;
        if (!m.size) break;
        at += m.size;
    }
    return n;
}

/* Scans the whole table, 64 entries per pass under the lock: only for rare cases. */
static void take_where(int (*match)(const struct alloc *, uint64_t, uint64_t), uint64_t x, uint64_t y,
                       void (*fn)(const struct alloc *))
{
    struct alloc got[64];
    for (;;) {
        int n = 0;
        pthread_mutex_lock(&mu);
        for (size_t i = 0; i < cap && n < 64; i++) {
            if (tab[i].kind && match(&tab[i], x, y)) {
                got[n++] = tab[i];
                remove_at(i);
                i--;  /* the shift may have moved another entry into i */
            }
        }
        pthread_mutex_unlock(&mu);
        for (int k = 0; k < n; k++) fn(&got[k]);
        if (n < 64) return;
    }
}

static int in_range(const struct alloc *a, uint64_t lo, uint64_t hi)
{
    return a->kind == K_MAP && a->key >= lo && a->key < hi;
}

static int in_ctx(const struct alloc *a, uint64_t ctx, uint64_t unused)
{
    (void)unused;
    return a->ctx == ctx && (a->kind == K_PTR || a->kind == K_ARRAY || a->kind == K_MIPMAP || a->kind == K_LIMIT ||
                             a->kind == K_PEND);
}

static int of_stream(const struct alloc *a, uint64_t stream, uint64_t ctx_or_any)
{
    if (a->kind != K_PEND) return 0;
    return ctx_or_any ? a->ctx == (ctx_or_any & ~1ULL) : a->aux == stream;
}

void table_take_pending(uint64_t stream, int all, uint64_t ctx, void (*fn)(const struct alloc *))
{
    /* contexts are aligned: bit 0 marks "every stream of this context" */
    take_where(of_stream, stream, all ? (ctx | 1) : 0, fn);
}

void table_take_range(uint64_t lo, uint64_t hi, void (*fn)(const struct alloc *)) { take_where(in_range, lo, hi, fn); }
void table_take_ctx(uint64_t ctx, void (*fn)(const struct alloc *)) { take_where(in_ctx, ctx, 0, fn); }

void table_atfork_prepare(void) { pthread_mutex_lock(&mu); }
void table_atfork_parent(void) { pthread_mutex_unlock(&mu); }

void table_atfork_child(void)
{
    mu = 0;
    if (cap) memset(tab, 0, cap * sizeof *tab);
    count = 0;
}
