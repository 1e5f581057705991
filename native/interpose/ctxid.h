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
 * teardown) are the ones hooks.c asks the driver about once the teardown is over (recheck_alive). */
#ifndef COLO_CTXID_H
#define COLO_CTXID_H

#include <stdint.h>

#define CTX_GEN_SLOTS 4096u
#define CTX_ADDR_MASK ((1ull << 48) - 1)
extern uint16_t colo_ctx_gen[CTX_GEN_SLOTS];

static inline unsigned ctx_slot(uint64_t addr) { return (unsigned)((addr >> 6) ^ (addr >> 18)) & (CTX_GEN_SLOTS - 1); }

/* The identity an entry made now in the context at addr carries (0: no context). */
static inline uint64_t ctx_id(uint64_t addr)
{
    return addr ? addr ^ (uint64_t)__atomic_load_n(&colo_ctx_gen[ctx_slot(addr)], __ATOMIC_ACQUIRE) << 48 : 0;
}

/* A teardown of the context at addr begins: returns the generation its entries were recorded under. */
static inline uint16_t ctx_bump(uint64_t addr)
{
    return __atomic_fetch_add(&colo_ctx_gen[ctx_slot(addr)], 1, __ATOMIC_SEQ_CST);
}

/* Was id recorded in the context at addr? */
static inline int ctx_id_at(uint64_t id, uint64_t addr) { return id && !((id ^ addr) & CTX_ADDR_MASK); }

/* Was id recorded in the context at addr under a generation not after gen (wrapping)? */
static inline int ctx_id_upto(uint64_t id, uint64_t addr, uint16_t gen)
{
    return ctx_id_at(id, addr) && (int16_t)(uint16_t)((uint16_t)((id ^ addr) >> 48) - gen) <= 0;
}

#endif
