/* colo-ckpt: the driver's checkpoint API (cuCheckpointProcess*, driver 570+) on a set of pids, all
 * or none. colo's daemon runs it (as root, in a worker thread) to suspend and resume a job's CUDA
 * processes; an admin may run it by hand. It reaches the driver only through
 * dlopen("libcuda.so.1"), as jobs do, so it runs alike on a real GPU and on native/fakegpu.
 *
 *   colo-ckpt [-t MS] state PID...     one line per pid: "PID STATE" (STATE none: no CUDA process)
 *   colo-ckpt [-t MS] suspend PID...   lock (waiting at most MS for running work) and checkpoint
 *   colo-ckpt resume PID...            restore and unlock
 *   colo-ckpt [-t MS] lock|checkpoint|restore|unlock PID...   one step
 *
 * suspend and resume are all or none: when one pid fails, those already moved are moved back and
 * the exit status is 1, with "error PID STEP CODE NAME: TEXT" on stdout (the driver's reason).
 * Both skip pids already where they lead, so a rerun after an interruption finishes the work. */
#include <dlfcn.h>
#include <signal.h>
#include <sys/prctl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef struct { unsigned int timeoutMs, reserved0; unsigned long long reserved1[7]; } LockArgs;
typedef struct { unsigned long long reserved[8]; } OtherArgs; /* checkpoint, restore, unlock */

enum { RUNNING = 0, LOCKED = 1, CHECKPOINTED = 2, FAILED = 3, NONE = -1 };
static const char *NAMES[] = {"running", "locked", "checkpointed", "failed"};

static struct {
    CUresult (*Init)(unsigned);
    CUresult (*Lock)(int, LockArgs *);
    CUresult (*Checkpoint)(int, OtherArgs *);
    CUresult (*Restore)(int, OtherArgs *);
    CUresult (*Unlock)(int, OtherArgs *);
    CUresult (*GetState)(int, int *);
    CUresult (*ErrName)(CUresult, const char **);
    CUresult (*ErrText)(CUresult, const char **);
} cu;

static unsigned g_timeout_ms = 10000;

static void report(int pid, const char *step, CUresult r)
{
    const char *name = NULL, *text = NULL;
    if (cu.ErrName)
        cu.ErrName(r, &name);
    if (cu.ErrText)
        cu.ErrText(r, &text);
    printf("error %d %s %d %s: %s\n", pid, step, r, name ? name : "CUDA_ERROR", text ? text : "unknown");
}

#define NOT_FOUND 500 /* CUDA_ERROR_NOT_FOUND: no CUDA process of that pid */

/* The pid's state, NONE for no CUDA process; another error is reported (as "state" failing). */
static int state_of(int pid, CUresult *err)
{
    int s = NONE;
    CUresult r = cu.GetState(pid, &s);
    if (err)
        *err = r == NOT_FOUND ? 0 : r;
    return r == 0 ? s : NONE;
}

static CUresult step(int pid, const char *what)
{
    OtherArgs o;
    memset(&o, 0, sizeof o);
    if (!strcmp(what, "lock")) {
        LockArgs a;
        memset(&a, 0, sizeof a);
        a.timeoutMs = g_timeout_ms;
        return cu.Lock(pid, &a);
    }
    if (!strcmp(what, "checkpoint"))
        return cu.Checkpoint(pid, &o);
    if (!strcmp(what, "restore"))
        return cu.Restore(pid, &o);
    return cu.Unlock(pid, &o);
}

/* Moves pids[0..n) through steps fwd[0] then fwd[1] (each taken by the pids in state from[k]); on
 * a failure undoes what this run did, last step first, through back[], and returns 1. */
static int all_or_none(int *pids, int n, const char *fwd[2], const int from[2], const char *back[2])
{
    int *st = calloc((size_t)n, sizeof *st), *moved = calloc((size_t)n, sizeof *moved);
    if (!st || !moved)
        return 2;
    int rc = 0;
    for (int i = 0; i < n; i++) {
        CUresult r;
        st[i] = state_of(pids[i], &r);
        if (r != 0) {
            report(pids[i], "state", r); /* e.g. not permitted, not supported (an MPS client) */
            rc = 1;
        }
    }
    if (rc) {
        free(st);
        free(moved);
        return rc;
    }
    for (int k = 0; k < 2 && !rc; k++)
        for (int i = 0; i < n && !rc; i++) {
            if (st[i] != from[k])
                continue; /* already past this step (a rerun), or no CUDA process */
            CUresult r = step(pids[i], fwd[k]);
            if (r != 0) {
                report(pids[i], fwd[k], r);
                rc = 1;
                break;
            }
            moved[i] |= 1 << k;
            st[i] = from[k] + 1; /* RUNNING->LOCKED->CHECKPOINTED; CHECKPOINTED->LOCKED handled below */
            if (from[k] == CHECKPOINTED)
                st[i] = LOCKED;
            else if (from[k] == LOCKED && !strcmp(fwd[k], "unlock"))
                st[i] = RUNNING;
        }
    for (int k = 1; rc && k >= 0; k--)
        for (int j = 0; j < n; j++)
            if (moved[j] & (1 << k)) {
                CUresult rb = step(pids[j], back[k]);
                if (rb != 0)
                    report(pids[j], back[k], rb);
            }
    free(st);
    free(moved);
    return rc;
}

static void *sym(void *h, const char *name)
{
    return dlsym(h, name);
}

int main(int argc, char **argv)
{
    /* colo's daemon runs this: when the daemon is killed, its restart finishes or undoes the step,
     * and must not race an orphaned helper still acting on the same pids */
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    int a = 1;
    if (a + 1 < argc && !strcmp(argv[a], "-t")) {
        g_timeout_ms = (unsigned)strtoul(argv[a + 1], NULL, 10);
        a += 2;
    }
    if (argc - a < 2) {
        fprintf(stderr, "usage: colo-ckpt [-t MS] state|suspend|resume|lock|checkpoint|restore|unlock PID...\n");
        return 2;
    }
    const char *cmd = argv[a++];
    int n = argc - a;
    int *pids = calloc((size_t)n, sizeof *pids);
    if (!pids)
        return 2;
    for (int i = 0; i < n; i++) {
        char *end;
        long v = strtol(argv[a + i], &end, 10);
        if (*end || v <= 0 || v > INT32_MAX) {
            fprintf(stderr, "colo-ckpt: not a pid: %s\n", argv[a + i]);
            return 2;
        }
        pids[i] = (int)v;
    }
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        fprintf(stderr, "colo-ckpt: cannot load libcuda.so.1: %s\n", dlerror());
        return 3;
    }
    *(void **)&cu.Init = sym(h, "cuInit");
    *(void **)&cu.Lock = sym(h, "cuCheckpointProcessLock");
    *(void **)&cu.Checkpoint = sym(h, "cuCheckpointProcessCheckpoint");
    *(void **)&cu.Restore = sym(h, "cuCheckpointProcessRestore");
    *(void **)&cu.Unlock = sym(h, "cuCheckpointProcessUnlock");
    *(void **)&cu.GetState = sym(h, "cuCheckpointProcessGetState");
    *(void **)&cu.ErrName = sym(h, "cuGetErrorName");
    *(void **)&cu.ErrText = sym(h, "cuGetErrorString");
    if (!cu.Init || !cu.Lock || !cu.Checkpoint || !cu.Restore || !cu.Unlock || !cu.GetState) {
        fprintf(stderr, "colo-ckpt: this driver has no checkpoint API (driver 570 or later has)\n");
        return 3;
    }
    CUresult r = cu.Init(0);
    if (r != 0) {
        report(0, "init", r);
        return 3;
    }
    int rc = 0;
    if (!strcmp(cmd, "state")) {
        for (int i = 0; i < n; i++) {
            int s = state_of(pids[i], &r);
            if (r != 0) {
                report(pids[i], "state", r);
                rc = 1;
            } else {
                printf("%d %s\n", pids[i], s >= 0 && s <= FAILED ? NAMES[s] : "none");
            }
        }
    } else if (!strcmp(cmd, "suspend")) {
        const char *fwd[2] = {"lock", "checkpoint"}, *back[2] = {"unlock", "restore"};
        const int from[2] = {RUNNING, LOCKED};
        rc = all_or_none(pids, n, fwd, from, back);
    } else if (!strcmp(cmd, "resume")) {
        const char *fwd[2] = {"restore", "unlock"}, *back[2] = {"checkpoint", "lock"};
        const int from[2] = {CHECKPOINTED, LOCKED};
        rc = all_or_none(pids, n, fwd, from, back);
    } else if (!strcmp(cmd, "lock") || !strcmp(cmd, "checkpoint") || !strcmp(cmd, "restore") ||
               !strcmp(cmd, "unlock")) {
        for (int i = 0; i < n; i++)
            if ((r = step(pids[i], cmd)) != 0) {
                report(pids[i], cmd, r);
                rc = 1;
            }
    } else {
        fprintf(stderr, "colo-ckpt: unknown command: %s\n", cmd);
        return 2;
    }
    if (rc == 0 && strcmp(cmd, "state"))
        for (int i = 0; i < n; i++) {
            int s = state_of(pids[i], NULL);
            printf("%d %s\n", pids[i], s >= 0 && s <= FAILED ? NAMES[s] : "none");
        }
    return rc;
}
