/* The pool table (pools.h): a growable array scanned linearly (processes make a few pools; 100
 * cost a scan of 100 entries on a pool's calls, nothing on others). */
#include "pools.h"

#include <pthread.h>
#include <stdlib.h>

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static struct pool *g_tab;
static int g_n, g_cap;

void pools_lock(void) { pthread_mutex_lock(&g_mu); }
void pools_unlock(void) { pthread_mutex_unlock(&g_mu); }
int pools_count(void) { return __atomic_load_n(&g_n, __ATOMIC_ACQUIRE); }
struct pool *pool_at(int i) { return &g_tab[i]; }

static int same(const struct pool *p, uint64_t h, int graph, int dev)
{
    return p->h == h && p->graph == graph && (h || p->dev == dev);
}

struct pool *pool_find(uint64_t h, int graph, int dev)
{
    for (int i = 0; i < g_n; i++)
        if (same(&g_tab[i], h, graph, dev)) return &g_tab[i];
    return NULL;
}

struct pool *pool_get(uint64_t h, int graph, int dev)
{
    struct pool *p = pool_find(h, graph, dev);
    if (p) return p;
    for (int i = 0; i < g_n && !p; i++) /* a destroyed pool that holds nothing any more */
        if (g_tab[i].dead && !g_tab[i].live && !g_tab[i].extra && !g_tab[i].taken && !g_tab[i].claimed) p = &g_tab[i];
    if (!p) {
        if (g_n == g_cap) {
            int nc = g_cap ? g_cap * 2 : 16;
            struct pool *t = realloc(g_tab, (size_t)nc * sizeof *t);
            if (!t) return NULL;
            g_tab = t;
            g_cap = nc;
        }
        p = &g_tab[g_n];
        __atomic_store_n(&g_n, g_n + 1, __ATOMIC_RELEASE);
    }
    *p = (struct pool){.h = h, .graph = graph, .dev = dev};
    return p;
}

void pools_atfork_child(void)
{
    /* Another thread of the parent may have held the lock, or been growing the array: start over
     * (the parent's array is left to it). */
    pthread_mutex_init(&g_mu, NULL);
    g_tab = NULL;
    g_n = g_cap = 0;
}
