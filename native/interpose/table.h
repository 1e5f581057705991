/* What this process allocated, by pointer or handle, so that a free subtracts exactly the bytes
 * its allocation added. Process-private: a forked child starts empty (the parent's allocations
 * stay the parent's). Sharded by hash, a lock per shard: every call may come from any thread. */
#ifndef COLO_TABLE_H
#define COLO_TABLE_H

#include <stdint.h>

/* K_PEND: a cuMemFreeAsync of memory not from a pool, still counted until its stream is known to
 * have reached it (aux: the stream). K_EXECW: bytes an instantiated graph's allocations take on
 * one device (hooks.c: exec_key). K_EXECB: the stream and epoch at which an instantiated graph's
 * memory is known to be mapped to it (hooks.c: exec_backed). K_VOBJ: one physical VMM allocation,
 * counted once (key: an id of ours; refs: the handle references and mappings holding it; size 0:
 * imported from elsewhere, not sized until mapped; aux: its export's K_VEXP key). K_VMM: a handle
 * value (refs: its references; aux: its K_VOBJ). K_VEXP: an exported fd's file (key: device and
 * inode; aux: the K_VOBJ, 0 when two live allocations shared the file). K_MODULE: a loaded module
 * or library, its globals' size. K_PEND's refs: the free's sequence number (hooks.c: g_free_seq).
 * K_EVENT: an event recorded while frees were pending (aux: its stream; refs: the last free's
 * sequence number before the record). */
enum { K_PTR = 1, K_VMM = 2, K_MAP = 3, K_ARRAY = 4, K_MIPMAP = 5, K_POOL = 6, K_LIMIT = 7, K_PEND = 8,
       K_EXECW = 11, K_EXECB = 12, K_VOBJ = 13, K_VEXP = 14, K_MODULE = 15, K_EVENT = 16 };

struct alloc {
    uint64_t key;
    uint64_t size;   /* bytes counted in the ledger (K_MAP: bytes mapped) */
    uint64_t aux;    /* K_MAP: the K_VOBJ that is mapped; K_PTR: its pool (0: none); K_PEND: stream */
    uint64_t ctx;    /* the context it was made in, as ctxid.h's id (0: outlives contexts, e.g. VMM handles) */
    uint16_t kind;
    uint16_t dev;
    uint32_t refs;   /* K_VMM: references to the handle; K_VOBJ: handle references and mappings */
};

/* Insert a. Returns 0, or -1 when host memory ran out (nothing stored: the caller must undo the
 * allocation). If the same (kind, key) was still recorded, the driver has handed the address out
 * again, so the old allocation is gone: it is replaced and returned in *old (result 1). */
int table_put(const struct alloc *a, struct alloc *old);
/* table_put, tagging the entry (a->ctx) with ctxid.h's ctx_tag(at, seen) under the shard's lock
 * when at is a context (0: a->ctx as given). merge: an entry replaced keeps its size if that is
 * larger (the caller releases the smaller of the two). */
int table_put_in(struct alloc *a, struct alloc *old, uint64_t at, uint64_t seen, int merge);
/* fn(entry, arg) under the entry's lock: 1 removes it (copied to *out), 0 keeps it (as fn left
 * it). Returns fn's answer, or -1 when there is no such entry. */
int table_settle(int kind, uint64_t key, int (*fn)(struct alloc *, void *), void *arg, struct alloc *out);
/* Copy the entry out without removing it; 0 when there is none. */
int table_get(int kind, uint64_t key, struct alloc *out);
/* Remove and return the entry; 0 when it is not ours (imported, foreign, already freed). */
int table_take(int kind, uint64_t key, struct alloc *out);
/* Add `delta` to an entry's refs (K_VMM, K_VOBJ) and copy it out: 1 when they reached 0 and the
 * entry was removed; 0 when it stays; -1 when there is none (not ours). */
int table_ref(int kind, uint64_t key, int delta, struct alloc *out);
/* fn(entry, arg) under the entry's lock; its result, or -1 when there is no such entry. */
int table_update(int kind, uint64_t key, int (*fn)(struct alloc *, uint64_t), uint64_t arg);
/* Remove the K_MAP entries that tile [lo, hi) (each mapping starts where the previous ended):
 * one lookup per mapping. Calls fn for each; returns how many. */
int table_take_maps(uint64_t lo, uint64_t hi, void (*fn)(const struct alloc *));
/* Remove the K_MAP entries that start inside [lo, hi) by a scan (a range that does not start
 * at a mapping: rare). */
void table_take_range(uint64_t lo, uint64_t hi, void (*fn)(const struct alloc *));
/* Remove every entry made in the context at address ctx under a generation up to gen (its
 * teardown freed them: ctxid.h), unsettled ones left; calls fn for each. */
void table_take_ctx(uint64_t ctx, uint16_t gen, void (*fn)(const struct alloc *));
/* Remove the K_PEND entries of stream `stream` (all: of every stream of the context at ctx). */
void table_take_pending(uint64_t stream, int all, uint64_t ctx, void (*fn)(const struct alloc *));
/* Remove the K_PEND entries of stream `stream` whose sequence number (refs) is not after seq: the
 * frees enqueued before an event recorded there. */
void table_take_pending_upto(uint64_t stream, uint32_t seq, void (*fn)(const struct alloc *));
/* Up to max distinct streams that K_PEND entries wait for (a scan: at the budget's edge only). */
int table_pending_streams(uint64_t *out, int max);
void table_atfork_prepare(void);
void table_atfork_parent(void);
void table_atfork_child(void);
/* Test hook: COLO_TEST_TABLE_MAX=N lets the table hold N/2 entries in all (as N cells at half
 * load), to exercise the out-of-memory path. */
void table_env_init(void);

#endif
