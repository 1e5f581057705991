/* The resume gate of `colo suspend` (docs/suspend.md). While the daemon has a job suspended (its
 * CUDA processes checkpointed by the driver: their calls would block inside the driver until
 * restored), it sets LEDGER_SUSPENDED in the ledger's header. Every wrapper of this library starts
 * by fetching the driver's function (hooks.c: real()), and there it loads that one word: 0, and the
 * call goes on. Otherwise the calling thread says that the job wants its GPU back
 * (LEDGER_RESUME_WANTED, which the daemon's sampler watches) and waits before reaching the driver
 * until the daemon has restored the job and cleared the word. */
#include "ledger.h"

#include <time.h>

struct ledger_header *colo_gate_hdr; /* the mapped ledger (ledger.c sets it once open); NULL: none */

__attribute__((noinline)) void colo_gate_wait(void)
{
    struct ledger_header *h = __atomic_load_n(&colo_gate_hdr, __ATOMIC_ACQUIRE);
    if (!h)
        return;
    /* the daemon writes the word with pwrite (it cannot wake a futex in here): a short poll, only
     * while suspended */
    struct timespec ts = {0, 20 * 1000 * 1000};
    while (__atomic_load_n(&h->suspend, __ATOMIC_ACQUIRE) & LEDGER_SUSPENDED) {
        if (!(__atomic_load_n(&h->suspend, __ATOMIC_ACQUIRE) & LEDGER_RESUME_WANTED))
            __atomic_or_fetch(&h->suspend, LEDGER_RESUME_WANTED, __ATOMIC_ACQ_REL);
        nanosleep(&ts, NULL);
    }
}
