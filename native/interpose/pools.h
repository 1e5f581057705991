/* What each memory pool of this process (and each device's graph memory pool) is charged beyond
 * the allocations the table holds: process-local bookkeeping, no driver calls. One lock guards
 * it, held by hooks.c across a pool's driver reading (settle) but never across an allocation, a
 * launch or a ledger wait. The table grows as pools are made: a pool it cannot keep (no host
 * memory) gets no allocation (fail closed), since its idle reserve could not be counted. */
#ifndef COLO_POOLS_H
#define COLO_POOLS_H

#include <stdint.h>

struct pool {
    uint64_t h;       /* CUmemoryPool; 0 with graph set: the device's graph memory */
    int dev, graph, dead;
    uint64_t live;    /* bytes of the allocations from it that the table holds */
    uint64_t extra;   /* charged beyond them: what the driver reserves for it above `live` */
    uint64_t taken;   /* part of `extra` lent to allocations in flight, which the pool will serve
                         from its idle reserve (they count in the ledger still) */
    uint64_t claimed; /* graph pool: idle memory launches in flight expect to reuse */
};

void pools_lock(void);
void pools_unlock(void);
int pools_count(void);                                /* entries ever made; 0: no pool yet (atomic) */
/* Under the lock. Found, or NULL. */
struct pool *pool_find(uint64_t h, int graph, int dev);
/* Under the lock. Found or added; NULL when host memory ran out. */
struct pool *pool_get(uint64_t h, int graph, int dev);
/* Under the lock: entry i (0 <= i < pools_count()); pointers are valid until the lock is let go. */
struct pool *pool_at(int i);
/* fork(): the child has none of the parent's pools (nor a lock another thread held). */
void pools_atfork_child(void);

#endif
