/* What this process allocated, by pointer or handle, so that a free subtracts exactly the bytes
 * its allocation added. Process-private: a forked child starts empty (the parent's allocations
 * stay the parent's). */
#ifndef COLO_TABLE_H
#define COLO_TABLE_H

#include <stdint.h>

enum { K_PTR = 1, K_VMM = 2, K_MAP = 3, K_ARRAY = 4, K_MIPMAP = 5 };

struct alloc {
    uint64_t key;
    uint64_t size;   /* bytes counted in the ledger (K_MAP: bytes mapped) */
    uint64_t aux;    /* K_MAP: the VMM handle that is mapped */
    uint16_t kind;
    uint16_t dev;
    uint32_t refs;   /* K_VMM: the handle itself plus each mapping of it */
};

void table_put(const struct alloc *a);
/* Remove and return the entry; 0 when it is not ours (imported, foreign, already freed). */
int table_take(int kind, uint64_t key, struct alloc *out);
/* Add `delta` to a K_VMM entry's refs; when they reach 0 the entry is removed and returned
 * (1); 0 when it stays; -1 for a handle that is not ours (imported). */
int table_ref(uint64_t handle, int delta, struct alloc *out);
/* Remove the K_MAP entries that start inside [lo, hi); calls fn for each. */
void table_take_range(uint64_t lo, uint64_t hi, void (*fn)(const struct alloc *));
void table_atfork_prepare(void);
void table_atfork_parent(void);
void table_atfork_child(void);

#endif
