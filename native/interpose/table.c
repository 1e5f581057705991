/* Open-addressing hash tables (linear probing, backward-shift deletion: no tombstones to slow
 * lookups down over a long run), grown at half load.
 *
 * Sharded: 64 independent tables, each with its own lock on its own cacheline, chosen by the top
 * bits of the key's hash (the low bits place it inside its shard). One table behind one lock made
 * every allocation and free of every thread of a process write the same line: with 8 threads on
 * 2 cores a preempted holder stalled the others, and the pair cost several times the 1-thread
 * cost (docs/interposer.md). Sharded, two threads meet only when their keys hash to the same
 * shard, and growth rehashes one shard under its own lock only.
 *
 * Each lock is a spinlock whose waiter yields the CPU after 64 pauses (every critical section is
 * a few dozen instructions; one that takes longer has a preempted holder). A futex lock that
 * sleeps instead was tried: its release must be a locked exchange (to see sleepers), which cost
 * +18 ns a pair with 1 thread, to better a case that sharding has made rare. */
#include "table.h"
#include "ctxid.h"

#include <sched.h>
#include <stdlib.h>
#include <string.h>

#define SHARD_BITS 6
#define NSHARD (1u << SHARD_BITS)
#define FIRST_CAP 16 /* cells a shard starts with (40 bytes each) */

struct shard {
    int mu;            /* 0 free, 1 held */
    size_t cap, count;
    struct alloc *tab; /* kind == 0 marks an empty cell */
} __attribute__((aligned(64)));

static struct shard shards[NSHARD];

static void lock_mu(int *mu)
{
    for (int spins = 0; __atomic_exchange_n(mu, 1, __ATOMIC_ACQUIRE);) {
        while (__atomic_load_n(mu, __ATOMIC_RELAXED)) {
            if (++spins < 64) __builtin_ia32_pause();
            else sched_yield();
        }
    }
}

static void unlock_mu(int *mu) { __atomic_store_n(mu, 0, __ATOMIC_RELEASE); }

/* Test hook: COLO_TEST_TABLE_MAX=N lets the table hold N/2 entries in all (as one table of N cells
 * at half load would), so that the out-of-memory path can be reached with a few hundred
 * allocations. `test_count` is kept only when the hook is set (one line all threads write). */
static size_t test_max, test_count;

void table_env_init(void)
{
    const char *v = getenv("COLO_TEST_TABLE_MAX");
    if (v && *v) test_max = (size_t)strtoull(v, NULL, 10);
}

static uint64_t hash(int kind, uint64_t key)
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
    return h;
}

static struct shard *shard_of(uint64_t h) { return &shards[h >> (64 - SHARD_BITS)]; }

static void insert_raw(struct alloc *t, size_t c, const struct alloc *a)
{
    size_t i = hash(a->kind, a->key) & (c - 1);
    while (t[i].kind) i = (i + 1) & (c - 1);
    t[i] = *a;
}

/* Room for one more entry in s: 0, or -1 when host memory ran out. */
static int room(struct shard *s)
{
    if (test_max && __atomic_load_n(&test_count, __ATOMIC_RELAXED) >= test_max / 2) return -1;
    if ((s->count + 1) * 2 <= s->cap) return 0;
    size_t nc = s->cap ? s->cap * 2 : FIRST_CAP;
    /* Whole cachelines (cells are 40 bytes, caps powers of 2 >= 16): shards share none. */
    struct alloc *nt = aligned_alloc(64, nc * sizeof *nt);
    if (!nt) return -1;
    memset(nt, 0, nc * sizeof *nt);
    for (size_t i = 0; i < s->cap; i++)
        if (s->tab[i].kind) insert_raw(nt, nc, &s->tab[i]);
    free(s->tab);
    s->tab = nt;
    s->cap = nc;
    return 0;
}

static long find(struct shard *s, uint64_t h, int kind, uint64_t key)
{
    if (!s->cap) return -1;
    for (size_t i = h & (s->cap - 1);; i = (i + 1) & (s->cap - 1)) {
        if (!s->tab[i].kind) return -1;
        if (s->tab[i].key == key && s->tab[i].kind == kind) return (long)i;
    }
}

static void remove_at(struct shard *s, size_t i)
{
    /* Shift later members of the probe run back so that no gap breaks it. */
    struct alloc *tab = s->tab;
    size_t j = i, m = s->cap - 1;
    if (test_max) __atomic_sub_fetch(&test_count, 1, __ATOMIC_RELAXED);
    for (;;) {
        tab[i].kind = 0;
        for (;;) {
            j = (j + 1) & m;
            if (!tab[j].kind) { s->count--; return; }
            size_t h = hash(tab[j].kind, tab[j].key) & m;
            /* Does j's home lie cyclically outside (i, j]? Then it may move into i. */
            if (i <= j ? (h <= i || h > j) : (h <= i && h > j)) break;
        }
        tab[i] = tab[j];
        i = j;
    }
}

int table_put_in(struct alloc *a, struct alloc *old, uint64_t at, uint64_t seen, int merge)
{
    int r = 0;
    uint64_t h = hash(a->kind, a->key);
    struct shard *s = shard_of(h);
    lock_mu(&s->mu);
    if (at) a->ctx = ctx_tag(at, seen);
    if (room(s) != 0) {
        long i = find(s, h, a->kind, a->key); /* full: only a replacement can go in */
        if (i >= 0) {
            *old = s->tab[i];
            if (merge && old->size > a->size) a->size = old->size;
            s->tab[i] = *a;
            r = 1;
        } else {
            r = -1;
        }
        unlock_mu(&s->mu);
        return r;
    }
    size_t i = h & (s->cap - 1); /* one probe run: the entry, or the empty cell it goes in */
    while (s->tab[i].kind && !(s->tab[i].key == a->key && s->tab[i].kind == a->kind)) i = (i + 1) & (s->cap - 1);
    if (s->tab[i].kind) {
        *old = s->tab[i];
        if (merge && old->size > a->size) a->size = old->size;
        r = 1;
    } else {
        s->count++;
        if (test_max) __atomic_add_fetch(&test_count, 1, __ATOMIC_RELAXED);
    }
    s->tab[i] = *a;
    unlock_mu(&s->mu);
    return r;
}

int table_put(const struct alloc *a, struct alloc *old)
{
    struct alloc c = *a;
    return table_put_in(&c, old, 0, 0, 0);
}

int table_get(int kind, uint64_t key, struct alloc *out)
{
    uint64_t h = hash(kind, key);
    struct shard *s = shard_of(h);
    lock_mu(&s->mu);
    long i = find(s, h, kind, key);
    if (i >= 0) *out = s->tab[i];
    unlock_mu(&s->mu);
    return i >= 0;
}

int table_take(int kind, uint64_t key, struct alloc *out)
{
    uint64_t h = hash(kind, key);
    struct shard *s = shard_of(h);
    lock_mu(&s->mu);
    long i = find(s, h, kind, key);
    if (i >= 0) { *out = s->tab[i]; remove_at(s, (size_t)i); }
    unlock_mu(&s->mu);
    return i >= 0;
}

int table_settle(int kind, uint64_t key, int (*fn)(struct alloc *, void *), void *arg, struct alloc *out)
{
    uint64_t h = hash(kind, key);
    struct shard *s = shard_of(h);
    lock_mu(&s->mu);
    long i = find(s, h, kind, key);
    int r = i >= 0 ? fn(&s->tab[i], arg) : -1;
    if (r == 1) { *out = s->tab[i]; remove_at(s, (size_t)i); }
    unlock_mu(&s->mu);
    return r;
}

int table_ref(int kind, uint64_t key, int delta, struct alloc *out)
{
    int gone = -1;
    uint64_t h = hash(kind, key);
    struct shard *s = shard_of(h);
    lock_mu(&s->mu);
    long i = find(s, h, kind, key);
    if (i >= 0) {
        gone = 0;
        s->tab[i].refs += (uint32_t)delta;
        *out = s->tab[i];
        if (s->tab[i].refs == 0) { remove_at(s, (size_t)i); gone = 1; }
    }
    unlock_mu(&s->mu);
    return gone;
}

int table_update(int kind, uint64_t key, int (*fn)(struct alloc *, uint64_t), uint64_t arg)
{
    int r = -1;
    uint64_t h = hash(kind, key);
    struct shard *s = shard_of(h);
    lock_mu(&s->mu);
    long i = find(s, h, kind, key);
    if (i >= 0) r = fn(&s->tab[i], arg);
    unlock_mu(&s->mu);
    return r;
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

/* Scans every shard, one at a time and 64 entries per pass under its lock: only for rare cases.
 * Entries put into a shard already scanned are not seen (as with one table, where they would be
 * put after the scan); none is lost or seen twice, since each is removed under its shard's lock. */
static void take_where(int (*match)(const struct alloc *, uint64_t, uint64_t), uint64_t x, uint64_t y,
                       void (*fn)(const struct alloc *))
{
    struct alloc got[64];
    for (unsigned k = 0; k < NSHARD; k++) {
        struct shard *s = &shards[k];
        for (int n = 64; n == 64;) {
            n = 0;
            lock_mu(&s->mu);
            for (size_t i = 0; i < s->cap && n < 64; i++) {
                if (s->tab[i].kind && match(&s->tab[i], x, y)) {
                    got[n++] = s->tab[i];
                    remove_at(s, i);
                    i--; /* the shift may have moved another entry into i */
                }
            }
            unlock_mu(&s->mu);
            for (int g = 0; g < n; g++) fn(&got[g]);
        }
    }
}

static int in_range(const struct alloc *a, uint64_t lo, uint64_t hi)
{
    return a->kind == K_MAP && a->key >= lo && a->key < hi;
}

static int in_ctx(const struct alloc *a, uint64_t ctx, uint64_t gen)
{
    return !(a->ctx & CTX_UNSETTLED) && ctx_id_upto(a->ctx, ctx, (uint16_t)gen) && (a->kind == K_PTR || a->kind == K_ARRAY || a->kind == K_MIPMAP || a->kind == K_LIMIT ||
                             a->kind == K_PEND || a->kind == K_MODULE);
}

/* K_PEND of stream x enqueued up to sequence number y (refs; wrapping). */
static int of_stream_upto(const struct alloc *a, uint64_t stream, uint64_t seq)
{
    return a->kind == K_PEND && a->aux == stream && (int32_t)(a->refs - (uint32_t)seq) <= 0;
}

void table_take_pending_upto(uint64_t stream, uint32_t seq, void (*fn)(const struct alloc *))
{
    take_where(of_stream_upto, stream, seq, fn);
}

int table_pending_streams(uint64_t *out, int max)
{
    int n = 0;
    for (unsigned k = 0; k < NSHARD && n < max; k++) {
        struct shard *s = &shards[k];
        lock_mu(&s->mu);
        for (size_t i = 0; i < s->cap && n < max; i++) {
            if (s->tab[i].kind != K_PEND) continue;
            int seen = 0;
            for (int j = 0; j < n && !seen; j++) seen = out[j] == s->tab[i].aux;
            if (!seen) out[n++] = s->tab[i].aux;
        }
        unlock_mu(&s->mu);
    }
    return n;
}

static int of_stream(const struct alloc *a, uint64_t stream, uint64_t ctx_or_any)
{
    if (a->kind != K_PEND) return 0;
    return ctx_or_any ? ctx_id_at(a->ctx, ctx_or_any & ~1ULL) : a->aux == stream;
}

void table_take_pending(uint64_t stream, int all, uint64_t ctx, void (*fn)(const struct alloc *))
{
    /* contexts are aligned: bit 0 marks "every stream of this context" */
    take_where(of_stream, stream, all ? (ctx | 1) : 0, fn);
}

void table_take_range(uint64_t lo, uint64_t hi, void (*fn)(const struct alloc *)) { take_where(in_range, lo, hi, fn); }
void table_take_ctx(uint64_t ctx, uint16_t gen, void (*fn)(const struct alloc *)) { take_where(in_ctx, ctx, gen, fn); }

/* Every lock, in shard order (the only place that holds more than one), so that the child's copy
 * of the table is not caught mid-update. */
void table_atfork_prepare(void)
{
    for (unsigned k = 0; k < NSHARD; k++) lock_mu(&shards[k].mu);
}

void table_atfork_parent(void)
{
    for (unsigned k = NSHARD; k-- > 0;) unlock_mu(&shards[k].mu);
}

void table_atfork_child(void)
{
    for (unsigned k = 0; k < NSHARD; k++) {
        struct shard *s = &shards[k];
        s->mu = 0;
        if (s->cap) memset(s->tab, 0, s->cap * sizeof *s->tab);
        s->count = 0;
    }
    test_count = 0;
}
