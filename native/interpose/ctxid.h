/* A context's identity, not just its address. The driver may give a destroyed context's address
 * to the next context it makes (on another thread, even before the destroy call has returned to
 * us), and a teardown must release the destroyed context's entries only, never the new one's.
 *
 * Every context address hashes to a generation slot. A teardown bumps its context's slot before
 * it calls the driver, and every entry carries the address of the context it was made in with the
 * generation it was recorded under (id = address ^ generation << 48: user addresses fit in 48
 * bits). Once the driver has destroyed the context, the teardown releases the entries of that
 * address recorded under a generation up to the one it bumped from; a context the driver makes at
 * the address afterwards records under a later one and keeps its entries. A bump that destroys
 * nothing (a failed destroy, a primary release that was not the last, another address of the same
 * slot) only makes live entries older: they still go with their own context's next teardown.
 * Entries of the destroyed context recorded under the new generation (the allocation raced the
 * teardown) are the ones hooks.c asks the driver about once the teardown is over (recheck_alive).
 *
 * An entry is tagged when it goes into the table, under its shard's lock (table_put_in), not when
 * the driver answered: a teardown's release takes that lock too, so an entry tagged under the
 * generation it releases was in the table before it (and its memory was that context's). One
 * recorded after a teardown began (since `seen`, read before the driver call) is unsettled
 * (CTX_UNSETTLED): its memory may have been freed by that teardown and its address handed to
 * another allocation (whose record ours may have replaced), of another context or of the one made
 * at the address since. No teardown takes an unsettled entry; recheck_alive settles it, with the
 * teardowns held off, by the driver's answer: gone, or alive in the context the driver names. */
#ifndef COLO_CTXID_H
#define COLO_CTXID_H

#include <stdint.h>

#define CTX_GEN_SLOTS 4096u
#define CTX_ADDR_MASK ((1ull << 48) - 1)
extern uint16_t colo_ctx_gen[CTX_GEN_SLOTS];
/* Context teardowns begun and done (hooks.c: teardown_begin) */
extern uint64_t colo_teardowns_begun, colo_teardowns_done;
/* Bit 0 of an id (contexts are aligned): recorded while a teardown overlapped, not yet settled */
#define CTX_UNSETTLED 1ull

static inline unsigned ctx_slot(uint64_t addr) { return (unsigned)((addr >> 6) ^ (addr >> 18)) & (CTX_GEN_SLOTS - 1); }

/* The identity an entry made now in the context at addr carries (0: no context). */
static inline uint64_t ctx_id(uint64_t addr)
{
    return addr ? addr ^ (uint64_t)__atomic_load_n(&colo_ctx_gen[ctx_slot(addr)], __ATOMIC_ACQUIRE) << 48 : 0;
}

/* The id an entry made in the context at addr gets as it goes into the table; seen: what
 * hooks.c's teardowns_seen said before the driver call. The generation is read before the count
 * of teardowns begun (a teardown counts itself, then bumps): a count unchanged since seen means
 * the generation read is not after this context's teardown, if one has begun since. */
static inline uint64_t ctx_tag(uint64_t addr, uint64_t seen)
{
    if (!addr) return 0;
    uint64_t id = ctx_id(addr);
    if (!seen || __atomic_load_n(&colo_teardowns_begun, __ATOMIC_SEQ_CST) + 1 != seen) id |= CTX_UNSETTLED;
    return id;
}

/* A teardown of the context at addr begins: returns the generation its entries were recorded under. */
static inline uint16_t ctx_bump(uint64_t addr)
{
    return __atomic_fetch_add(&colo_ctx_gen[ctx_slot(addr)], 1, __ATOMIC_SEQ_CST);
}

/* Was id recorded in the context at addr? */
static inline int ctx_id_at(uint64_t id, uint64_t addr) { return id && !((id ^ addr) & CTX_ADDR_MASK & ~CTX_UNSETTLED); }

/* Was id recorded in the context at addr under a generation not after gen (wrapping)? */
static inline int ctx_id_upto(uint64_t id, uint64_t addr, uint16_t gen)
{
    return ctx_id_at(id, addr) && (int16_t)(uint16_t)((uint16_t)((id ^ addr) >> 48) - gen) <= 0;
}

#endif
