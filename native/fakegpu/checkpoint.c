/* Fake libcuda.so.1: the driver's checkpoint API (cuCheckpointProcess{Lock,Checkpoint,Restore,
 * Unlock,GetState}, driver 570+), over the shared state file, as an outside process (root, colo's
 * helper) uses it on a pid.
 *
 * As with the real driver, the work is done inside the target process: cuInit starts a thread in
 * every CUDA process that waits for requests in the process's entry of a table kept in the state
 * file past the header. LOCK takes the process's driver mutex (g_mu) and keeps it, so every CUDA
 * call the program makes blocks until UNLOCK; it first waits for the call in flight and for a
 * running simulated kernel (fakegpuKernel), and gives up after the lock's timeoutMs, leaving the
 * process RUNNING. CHECKPOINT moves the process's device bytes to "host memory" (the table
 * remembers them; NVML sees the process gone and the device's bytes free); RESTORE takes them again
 * on the same devices, or answers CUDA_ERROR_OUT_OF_MEMORY and leaves the process CHECKPOINTED.
 * MPS clients and servers are refused (CUDA_ERROR_NOT_SUPPORTED), as the real driver refuses them.
 * Device memory has no contents in the fake, so nothing is copied: the cost is only accounted. */
#include "cuda_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* CUprocessState, as cuda.h numbers it. */
enum { ST_RUNNING = 0, ST_LOCKED = 1, ST_CHECKPOINTED = 2, ST_FAILED = 3 };
enum { OP_NONE = 0, OP_LOCK, OP_CHECKPOINT, OP_RESTORE, OP_UNLOCK };
/* A request's life: posted by the asker, taken by the target's thread, or cancelled by an asker
 * that stopped waiting before it was taken (so a late target never acts on a stale request). */
enum { RQ_IDLE = 0, RQ_POSTED, RQ_TAKEN, RQ_DONE, RQ_CANCELLED };
enum { ERR_ILLEGAL_STATE = 401, ERR_NOT_PERMITTED = 800, ERR_TIMEOUT = 909 };

/* One per slot, at CK_OFF in the state file; an entry belongs to the slot's claim with its gen. */
struct fg_ck {
    uint32_t state;        /* ST_* */
    uint32_t gen;          /* the slot's gen when its process set the entry up */
    uint32_t rq;           /* RQ_*: the futex word both sides wait on */
    int32_t op;
    int32_t result;
    uint32_t timeout_ms;
    uint32_t ctx_mask;     /* the contexts the process held before CHECKPOINT */
    int32_t sm_pct, membw_pct;
    uint32_t pad;
    uint64_t busy_until_ns; /* a simulated kernel runs until then (CLOCK_REALTIME) */
    uint64_t saved[FG_MAX_DEV]; /* device bytes held in host memory while CHECKPOINTED */
    uint64_t spare[4];
};

#define CK_OFF ((sizeof(struct fg_header) + 4095) / 4096 * 4096)
#define CK_SIZE (sizeof(struct fg_ck) * FG_MAX_SLOTS)
/* Askers on one pid take turns on this OFD lock byte (past the slots' liveness bytes). */
#define CK_LOCK_BASE (FG_LOCK_SLOT_BASE + (1LL << 20))

static struct fg_ck *g_ck;     /* this process's mapping of the table */
static pid_t g_ck_pid;         /* the process that mapped it (a forked child maps its own) */

typedef struct { unsigned int timeoutMs, reserved0; cuuint64_t reserved1[7]; } LockArgs;

static long futex(uint32_t *w, int op, uint32_t v, const struct timespec *ts)
{
    return syscall(SYS_futex, w, op, v, ts, NULL, 0);
}

static void wake(uint32_t *w) { futex(w, FUTEX_WAKE, INT32_MAX, NULL); }

/* Wait while *w == v, at most ms milliseconds. */
static void wait_while(uint32_t *w, uint32_t v, long ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    futex(w, FUTEX_WAIT, v, &ts);
}

/* The table, grown into the file on first use (under the state lock: a mapping past the end of
 * the file would fault). */
static struct fg_ck *table(void)
{
    if (g_ck && g_ck_pid == getpid())
        return g_ck;
    struct stat st;
    fg_lock(&S);
    int ok = fstat(S.fd, &st) == 0 &&
             ((uint64_t)st.st_size >= CK_OFF + CK_SIZE || ftruncate(S.fd, (off_t)(CK_OFF + CK_SIZE)) == 0);
    fg_unlock(&S);
    if (!ok)
        return NULL;
    void *m = mmap(NULL, CK_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, S.fd, (off_t)CK_OFF);
    if (m == MAP_FAILED)
        return NULL;
    g_ck = m;
    g_ck_pid = getpid();
    return g_ck;
}

static uint32_t ld(uint32_t *w) { return __atomic_load_n(w, __ATOMIC_ACQUIRE); }
static void st(uint32_t *w, uint32_t v) { __atomic_store_n(w, v, __ATOMIC_RELEASE); }

/* ---- the target's side ---------------------------------------------------------------------- */

static CUresult do_lock(struct fg_ck *c)
{
    uint64_t deadline = c->timeout_ms ? fg_now_ns() + (uint64_t)c->timeout_ms * 1000000ull : 0;
    if (deadline) {
        struct timespec ts = {(time_t)(deadline / 1000000000ull), (long)(deadline % 1000000000ull)};
        if (pthread_mutex_timedlock(&g_mu, &ts) != 0)
            return ERR_TIMEOUT; /* a CUDA call of the program did not return in time */
    } else {
        pthread_mutex_lock(&g_mu);
    }
    fg_async_complete_all(); /* work queued on streams completes before the lock holds */
    for (;;) {
        uint64_t now = fg_now_ns(), busy = c->busy_until_ns;
        if (busy <= now)
            break;
        if (deadline && now >= deadline) {
            pthread_mutex_unlock(&g_mu);
            return ERR_TIMEOUT; /* a kernel still runs: the process stays RUNNING */
        }
        uint64_t until = deadline && deadline < busy ? deadline : busy, d = until - now;
        struct timespec ts = {(time_t)(d / 1000000000ull), (long)(d % 1000000000ull)};
        nanosleep(&ts, NULL);
    }
    st(&c->state, ST_LOCKED);
    return CUDA_SUCCESS; /* g_mu stays held by this thread until UNLOCK */
}

static int env_fails(const char *op)
{
    const char *e = getenv("COLO_FAKEGPU_CKPT_FAIL");
    return e && !strcmp(e, op);
}

static CUresult do_checkpoint(struct fg_ck *c)
{
    if (env_fails("checkpoint")) {
        st(&c->state, ST_FAILED);
        return CUDA_ERROR_UNKNOWN;
    }
    fg_lock(&S);
    struct fg_slot *sl = &S.h->slot[g_slot];
    for (uint32_t d = 0; d < S.h->ndev; d++) {
        struct fg_device *dv = &S.h->dev[d];
        c->saved[d] = sl->used[d];
        dv->used = dv->used >= sl->used[d] ? dv->used - sl->used[d] : 0;
        sl->used[d] = 0;
    }
    c->ctx_mask = sl->ctx_mask;
    c->sm_pct = sl->sm_pct;
    c->membw_pct = sl->membw_pct;
    sl->ctx_mask = 0; /* its device handles are released: NVML no longer lists it */
    sl->sm_pct = sl->membw_pct = 0;
    st(&c->state, ST_CHECKPOINTED);
    fg_unlock(&S);
    return CUDA_SUCCESS;
}

static CUresult do_restore(struct fg_ck *c)
{
    if (env_fails("restore")) {
        st(&c->state, ST_FAILED);
        return CUDA_ERROR_UNKNOWN;
    }
    CUresult r = CUDA_SUCCESS;
    fg_lock(&S);
    fg_reap(&S); /* memory of processes that died since is free again */
    for (uint32_t d = 0; d < S.h->ndev; d++)
        if (c->saved[d] > S.h->dev[d].total - S.h->dev[d].used)
            r = CUDA_ERROR_OUT_OF_MEMORY; /* the same device addresses need the same devices */
    if (r == CUDA_SUCCESS) {
        struct fg_slot *sl = &S.h->slot[g_slot];
        for (uint32_t d = 0; d < S.h->ndev; d++) {
            sl->used[d] = c->saved[d];
            S.h->dev[d].used += c->saved[d];
            c->saved[d] = 0;
        }
        sl->ctx_mask = c->ctx_mask;
        sl->sm_pct = c->sm_pct;
        sl->membw_pct = c->membw_pct;
        st(&c->state, ST_LOCKED);
    }
    fg_unlock(&S);
    return r;
}

static CUresult do_unlock(struct fg_ck *c)
{
    st(&c->state, ST_RUNNING);
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

static void *serve(void *arg)
{
    struct fg_ck *c = arg;
    for (;;) {
        uint32_t rq = ld(&c->rq);
        if (rq != RQ_POSTED) {
            wait_while(&c->rq, rq, 1000);
            continue;
        }
        if (!__atomic_compare_exchange_n(&c->rq, &rq, RQ_TAKEN, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            continue; /* the asker cancelled it */
        CUresult r;
        switch (c->op) {
        case OP_LOCK: r = do_lock(c); break;
        case OP_CHECKPOINT: r = do_checkpoint(c); break;
        case OP_RESTORE: r = do_restore(c); break;
        case OP_UNLOCK: r = do_unlock(c); break;
        default: r = CUDA_ERROR_INVALID_VALUE;
        }
        c->result = r;
        st(&c->rq, RQ_DONE);
        wake(&c->rq);
    }
    return NULL;
}

/* cuInit, under g_mu, once this process holds its slot. */
void fg_ckpt_start(void)
{
    struct fg_ck *t = table();
    if (!t)
        return; /* the process runs without checkpoint support: askers get NOT_FOUND */
    struct fg_ck *c = &t[g_slot];
    fg_lock(&S);
    memset(c, 0, sizeof *c);
    c->gen = S.h->slot[g_slot].gen;
    fg_unlock(&S);
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old); /* the program's signals go to its own threads */
    pthread_attr_t a;
    pthread_attr_init(&a);
    pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&a, 64 * 1024);
    pthread_t th;
    if (pthread_create(&th, &a, serve, c) != 0)
        c->gen = 0; /* no thread to serve requests: look like no entry at all */
    pthread_attr_destroy(&a);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
}

/* 1 when this process is LOCKED or CHECKPOINTED: its checkpoint thread holds g_mu, so the exit
 * path must not wait for it (the slot is reaped when the process is gone). */
int fg_ckpt_held(void)
{
    return g_ck && g_ck_pid == getpid() && g_slot >= 0 && ld(&g_ck[g_slot].state) != ST_RUNNING;
}

/* Simulated activity (fake only): a kernel runs on the device for ms milliseconds from now. */
FG_API CUresult fakegpuKernel(unsigned ms)
{
    pthread_mutex_lock(&g_mu);
    CUresult r = fg_check_live();
    if (r == CUDA_SUCCESS && g_ck && g_ck_pid == getpid())
        __atomic_store_n(&g_ck[g_slot].busy_until_ns, fg_now_ns() + (uint64_t)ms * 1000000ull, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&g_mu);
    return r;
}

/* ---- the asker's side ----------------------------------------------------------------------- */

/* The live slot of pid (as the caller's pid namespace names it), or -1. Under the state lock. */
static int slot_of(int pid)
{
    fg_reap(&S);
    for (uint32_t i = 0; i < S.h->hwm && i < S.h->nslots; i++) {
        struct fg_slot *sl = &S.h->slot[i];
        if (sl->state != FG_SLOT_LIVE)
            continue;
        if (fg_translate_pid(&S, sl->pid, sl->pidns) == pid)
            return (int)i;
    }
    return -1;
}

/* Finds pid's entry and checks what the real driver checks before acting. */
static CUresult target(int pid, int *slot, uint32_t *gen)
{
    if (!g_inited)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (pid <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    struct fg_ck *t = table();
    if (!t)
        return CUDA_ERROR_OPERATING_SYSTEM;
    fg_lock(&S);
    int i = slot_of(pid);
    CUresult r = CUDA_SUCCESS;
    if (i < 0 || t[i].gen != S.h->slot[i].gen || t[i].gen == 0)
        r = CUDA_ERROR_NOT_FOUND; /* not a CUDA process (or one from before checkpoint support) */
    else if (S.h->slot[i].kind != FG_KIND_PROC)
        r = CUDA_ERROR_NOT_SUPPORTED; /* MPS clients and servers cannot be checkpointed */
    else if (getuid() != 0 && getuid() != S.h->slot[i].uid)
        r = ERR_NOT_PERMITTED;
    if (r == CUDA_SUCCESS) {
        *slot = i;
        *gen = t[i].gen;
    }
    fg_unlock(&S);
    return r;
}

static int alive(int slot, uint32_t gen)
{
    fg_lock(&S);
    int ok = S.h->slot[slot].state == FG_SLOT_LIVE && S.h->slot[slot].gen == gen && fg_slot_alive(&S, slot);
    fg_unlock(&S);
    return ok;
}

static void turn(int slot, short type)
{
    struct flock fl = {.l_type = type, .l_whence = SEEK_SET, .l_start = CK_LOCK_BASE + slot, .l_len = 1};
    while (fcntl(S.fd, type == F_UNLCK ? F_OFD_SETLK : F_OFD_SETLKW, &fl) != 0 && errno == EINTR)
        ;
}

/* Posts op to pid's checkpoint thread and waits for its answer. `from`: the state op needs. */
static CUresult ask(int pid, int op, uint32_t from, unsigned timeout_ms)
{
    int slot;
    uint32_t gen;
    CUresult r = target(pid, &slot, &gen);
    if (r)
        return r;
    struct fg_ck *c = &g_ck[slot];
    turn(slot, F_WRLCK);
    /* An asker that died left its request: taken back if the target has not taken it, else
     * waited for, so that its answer never reads as ours. */
    for (uint32_t rq; (rq = ld(&c->rq)) == RQ_POSTED || rq == RQ_TAKEN;) {
        if (rq == RQ_POSTED &&
            __atomic_compare_exchange_n(&c->rq, &rq, RQ_CANCELLED, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            break;
        if (!alive(slot, gen)) {
            turn(slot, F_UNLCK);
            return CUDA_ERROR_NOT_FOUND;
        }
        wait_while(&c->rq, rq, 100);
    }
    if (ld(&c->state) != from) {
        turn(slot, F_UNLCK);
        return ERR_ILLEGAL_STATE;
    }
    c->op = op;
    c->timeout_ms = timeout_ms;
    c->result = CUDA_ERROR_UNKNOWN;
    st(&c->rq, RQ_POSTED);
    wake(&c->rq);
    /* A stopped or hung target never takes it: give up after the lock's own timeout (plus time to
     * be scheduled), and take the request back so that it never runs later. */
    uint64_t give_up = fg_now_ns() + ((uint64_t)(timeout_ms ? timeout_ms : 0) + 30000ull) * 1000000ull;
    for (;;) {
        uint32_t rq = ld(&c->rq);
        if (rq == RQ_DONE) {
            r = c->result;
            break;
        }
        int gone = !alive(slot, gen);
        if (rq == RQ_POSTED && (gone || fg_now_ns() >= give_up)) {
            if (__atomic_compare_exchange_n(&c->rq, &rq, RQ_CANCELLED, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
                r = gone ? CUDA_ERROR_NOT_FOUND : ERR_TIMEOUT;
                break;
            }
            continue;
        }
        if (gone) {
            r = CUDA_ERROR_NOT_FOUND; /* it died while acting on the request */
            break;
        }
        wait_while(&c->rq, rq, 100);
    }
    st(&c->rq, RQ_IDLE);
    turn(slot, F_UNLCK);
    return r;
}

FG_API CUresult cuCheckpointProcessLock(int pid, LockArgs *args)
{
    if (args && (args->reserved0 || args->reserved1[0]))
        return CUDA_ERROR_INVALID_VALUE;
    return ask(pid, OP_LOCK, ST_RUNNING, args ? args->timeoutMs : 0);
}

FG_API CUresult cuCheckpointProcessCheckpoint(int pid, void *args)
{
    (void)args;
    return ask(pid, OP_CHECKPOINT, ST_LOCKED, 0);
}

FG_API CUresult cuCheckpointProcessRestore(int pid, void *args)
{
    (void)args; /* GPU remapping pairs: the fake restores on the same devices only */
    return ask(pid, OP_RESTORE, ST_CHECKPOINTED, 0);
}

FG_API CUresult cuCheckpointProcessUnlock(int pid, void *args)
{
    (void)args;
    return ask(pid, OP_UNLOCK, ST_LOCKED, 0);
}

FG_API CUresult cuCheckpointProcessGetState(int pid, int *state)
{
    if (!state)
        return CUDA_ERROR_INVALID_VALUE;
    int slot;
    uint32_t gen;
    CUresult r = target(pid, &slot, &gen);
    if (r == CUDA_SUCCESS)
        *state = (int)ld(&g_ck[slot].state);
    return r;
}

FG_API CUresult cuCheckpointProcessGetRestoreThreadId(int pid, int *tid)
{
    (void)pid;
    (void)tid;
    return CUDA_ERROR_NOT_SUPPORTED;
}
