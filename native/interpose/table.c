/* Open-addressing hash table (linear probing, backward-shift deletion: no tombstones to slow
 * lookups down over a long run), grown at half load. One mutex per process. */
#include "table.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static struct alloc *tab;   /* kind == 0 marks an empty cell */
static size_t cap, count;

static size_t hash_in(int kind, uint64_t key, size_t c)
{
    uint64_t h = (key ^ ((uint64_t)kind << 59)) * 0x9E3779B97F4A7C15ULL;
    return (size_t)(h >> 20) & (c - 1);
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
    struct alloc *nt = calloc(nc, sizeof *nt);
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

void table_put(const struct alloc *a)
{
    pthread_mutex_lock(&mu);
    if ((count + 1) * 2 > cap && grow() != 0) {
        /* Out of host memory: the entry is lost, so its free will not subtract (conservative). */
        pthread_mutex_unlock(&mu);
        return;
    }
    long i = find(a->kind, a->key);
    if (i >= 0) tab[i] = *a;
    else { insert_raw(tab, cap, a); count++; }
    pthread_mutex_unlock(&mu);
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

void table_take_range(uint64_t lo, uint64_t hi, void (*fn)(const struct alloc *))
{
    struct alloc got[64];
    for (;;) {
        int n = 0;
        pthread_mutex_lock(&mu);
        for (size_t i = 0; i < cap && n < 64; i++) {
            if (tab[i].kind == K_MAP && tab[i].key >= lo && tab[i].key < hi) {
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

void table_atfork_prepare(void) { pthread_mutex_lock(&mu); }
void table_atfork_parent(void) { pthread_mutex_unlock(&mu); }

void table_atfork_child(void)
{
    pthread_mutex_init(&mu, NULL);
    if (cap) memset(tab, 0, cap * sizeof *tab);
    count = 0;
}
