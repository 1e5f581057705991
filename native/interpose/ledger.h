/* The job's ledger: a small file shared by every process of one job (and read by the colo daemon
 * from the host). Layout (little-endian, fixed; colo/node/interposer.py mirrors it):
 *
 *   [0, 4096)            header: magic, budget, refused count; from 256, one 64-byte line per
 *                        device with its total and peak (the one line every reservation touches)
 *   [4096 + i*5184, ...) slot i: state, generation, pid, refusals of one process, then its 16 lanes
 *
 * A lane (320 bytes: its own cachelines) holds op counters and per-device bytes. Lanes 1..15 each
 * belong to one thread of the slot's process at a time, which alone writes them (plain stores, no
 * locked instruction, no cacheline shared with the process's other threads); lane 0 is shared by
 * threads that found no free lane (atomic adds). A lane's bytes are its net changes modulo 2^64 (a
 * thread may free what another allocated): the process holds the sum over its lanes.
 *
 * No one ever waits on it (the one lock, a resync's, is only tried). The header total used[d] is the admission counter: a reservation
 * is one compare-and-swap that never takes it past the budget. Each slot says what its process
 * holds; a process's bytes go from the total when it dies. A process killed between its two
 * counter updates leaves at most its one operation's bytes counted too many (never too few); the
 * next reclaimer then recomputes the totals from the slots once no live process is mid-operation.
 *
 * Liveness: the owner of slot i holds an OFD write lock on the slot's first byte (and a classic
 * POSIX lock on its second byte, so that a reader in another pid namespace can learn the pid
 * through F_GETLK). A lock that can be taken means a dead owner: the kernel drops the lock when
 * the process dies, whatever the signal, and a reused pid cannot hold it. */
#ifndef COLO_LEDGER_H
#define COLO_LEDGER_H

#include <stdint.h>

#define LEDGER_MAGIC "COLOLDG1"
#define LEDGER_VERSION 4
#define LEDGER_HEADER_SIZE 4096
#define LEDGER_MAX_DEV 32
#define LEDGER_LANES 16
#define LEDGER_LANE_SIZE 320
#define LEDGER_SLOT_SIZE (64 + LEDGER_LANES * LEDGER_LANE_SIZE)
#define LEDGER_DEV_AT 256
#define LEDGER_RESYNC_LOCK (LEDGER_HEADER_SIZE - 1) /* header byte a resync holds an OFD lock on */

/* RECLAIMING: a reclaim of the dead owner's bytes is under way, or its reclaimer died too. */
enum { SLOT_FREE = 0, SLOT_OWNED = 1, SLOT_RECLAIMING = 2 };

struct ledger_dev {            /* one cacheline per device */
    uint64_t used;             /* admission counter: live slots' bytes + operations in flight */
    uint64_t peak;
    char pad[48];
};

struct ledger_header {
    char magic[8];
    uint32_t version;
    uint32_t header_size;
    uint32_t nslots;
    uint32_t slot_size;
    uint32_t max_devices;
    uint32_t devices;          /* informational: how many GPUs the job was given */
    uint64_t budget;           /* bytes per device */
    uint64_t refused;          /* allocations refused, all processes (atomic) */
    uint32_t resync;           /* >0: a process died mid-operation; totals to be recomputed */
    uint32_t hwm;              /* slots [0, hwm) have ever been owned: scans stop there */
    uint32_t reclaims;         /* dead-slot reclaims begun: a resync needs it unchanged */
    uint32_t suspend;          /* LEDGER_SUSPENDED | LEDGER_RESUME_WANTED (gate.c; colo suspend) */
    uint32_t lanes;            /* LEDGER_LANES */
    uint32_t lane_size;        /* LEDGER_LANE_SIZE */
    char pad[LEDGER_DEV_AT - 72];
    struct ledger_dev dev[LEDGER_MAX_DEV];
};

struct ledger_lane {
    uint64_t started, finished;/* counter operations begun / ended: equal when none is in flight */
    uint64_t used[LEDGER_MAX_DEV];
    char pad[LEDGER_LANE_SIZE - 16 - 8 * LEDGER_MAX_DEV];
};

struct ledger_slot {
    uint32_t state;
    uint32_t gen;
    int32_t pid;               /* in the owner's pid namespace (informational) */
    uint32_t spare0;
    uint64_t refused;          /* this process's refusals */
    char pad[64 - 24];
    struct ledger_lane lane[LEDGER_LANES];
};

/* `colo suspend` (gate.c): the daemon sets SUSPENDED while the job's processes are checkpointed;
 * a call that meets it sets RESUME_WANTED and waits for SUSPENDED to clear. */
enum { LEDGER_SUSPENDED = 1, LEDGER_RESUME_WANTED = 2 };
extern struct ledger_header *colo_gate_hdr;
void colo_gate_wait(void);
void *colo_gated(void *p); /* a driver function this library does not wrap, behind the gate */
/* The gate every wrapper passes (hooks.c real()): one load of the shared word when not suspended. */
static inline __attribute__((always_inline)) void colo_gate(void)
{
    struct ledger_header *h = colo_gate_hdr;
    if (__builtin_expect(h != 0, 1) && __builtin_expect(__atomic_load_n(&h->suspend, __ATOMIC_RELAXED) != 0, 0))
        colo_gate_wait();
}

/* Set up from the environment once per process (hooks.c: colo_interpose_setup); nothing touches
 * the ledger yet. Returns 1 when a budget applies. */
int ledger_env_init(void);
/* 1 when a budget applies (COLO_GPU_BUDGET, or colo's budget file): only then does the interposer
 * change anything; -1 until the library is set up. Read on every call: inline, one load. */
extern int colo_ledger_on;
/* Sets the library up on its first use from any thread, whichever comes first: a wrapper, a
 * dlsym or cuGetProcAddress answer, or our constructor (a library the program links runs its own
 * constructor, which may use the driver, before a preloaded library's). Returns colo_ledger_on. */
int colo_interpose_setup(void);
static inline int ledger_enabled(void)
{
    int v = colo_ledger_on; /* written once, before anything it guards is used */
    return __builtin_expect(v > 0, 1) ? 1 : v == 0 ? 0 : colo_interpose_setup();
}
/* Budget per device in bytes (0 when it could not be read: everything is refused). */
uint64_t ledger_budget(void);

/* Check-and-add `size` bytes on device `dev` for this process. 0 = reserved, else
 * CUDA_ERROR_OUT_OF_MEMORY (the refusal is counted and logged once per process). */
int ledger_reserve(int dev, uint64_t size);
void ledger_release(int dev, uint64_t size);
/* Refuse `size` on `dev` without trying (what it cannot count): counted and logged as a refusal;
 * returns CUDA_ERROR_OUT_OF_MEMORY. */
int ledger_refuse(int dev, uint64_t size);
/* The same reservation, but a "no" is not a refusal (nothing counted or logged): 1 = reserved. */
int ledger_try(int dev, uint64_t size);
/* Bytes the whole job holds on `dev` (dead processes reclaimed first if they hold any);
 * UINT64_MAX when the ledger is unusable (fail closed). */
uint64_t ledger_job_used(int dev);

/* fork(): the child drops the parent's slot and takes its own on first use. */
void ledger_atfork_prepare(void);
void ledger_atfork_parent(void);
void ledger_atfork_child(void);

#endif
