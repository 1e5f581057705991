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

/* ---- every other driver entry point --------------------------------------------------------
 *
 * The wrappers above cover the entry points this library counts. Any other one a program fetches
 * (dlsym on libcuda's handle, cuGetProcAddress: how the CUDA runtime reaches the driver) is handed
 * out as one of these trampolines instead of the driver's pointer: a few instructions that check
 * the same word and jump on to the driver's function with every argument untouched; only while
 * the job is suspended do they save the argument registers and wait in colo_gate_wait. A program
 * that links libcuda directly meets the same check in passthru.c's stubs. */
#define GATE_SLOTS 2048
void *colo_gate_targets[GATE_SLOTS]; /* trampoline i jumps to colo_gate_targets[i] */
static unsigned g_ngate;
extern char colo_gate_tramps[];      /* GATE_SLOTS trampolines of 16 bytes */

void *colo_gated(void *p)
{
    if (!p)
        return p;
    unsigned n = __atomic_load_n(&g_ngate, __ATOMIC_ACQUIRE);
    for (unsigned i = 0; i < n && i < GATE_SLOTS; i++)
        if (__atomic_load_n(&colo_gate_targets[i], __ATOMIC_ACQUIRE) == p)
            return colo_gate_tramps + 16 * i;
    unsigned i = __atomic_fetch_add(&g_ngate, 1, __ATOMIC_ACQ_REL);
    if (i >= GATE_SLOTS)
        return p; /* more distinct entry points than slots: handed out ungated */
    __atomic_store_n(&colo_gate_targets[i], p, __ATOMIC_RELEASE);
    return colo_gate_tramps + 16 * i;
}

#if defined(__x86_64__)
/* r11 carries the slot (it is no argument register and calls may clobber it); r10 is scratch. */
__asm__(".text\n"
        ".p2align 4\n"
        ".globl colo_gate_tramps\n.hidden colo_gate_tramps\n"
        "colo_gate_tramps:\n"
        ".set colo_gate_i, 0\n"
        ".rept 2048\n"
        "    endbr64\n"
        "    movl $colo_gate_i, %r11d\n"
        "    jmp colo_gate_common\n"
        "    .p2align 4\n"
        "    .set colo_gate_i, colo_gate_i + 1\n"
        ".endr\n"
        "colo_gate_common:\n"
        "    movq colo_gate_hdr(%rip), %r10\n"
        "    testq %r10, %r10\n"
        "    jz 1f\n"
        "    movl 60(%r10), %r10d\n" /* ledger_header.suspend */
        "    testl %r10d, %r10d\n"
        "    jnz 2f\n"
        "1:  leaq colo_gate_targets(%rip), %r10\n"
        "    jmp *(%r10,%r11,8)\n"
        "2:  push %rdi\n    push %rsi\n    push %rdx\n    push %rcx\n"
        "    push %r8\n    push %r9\n    push %rax\n    push %r11\n"
        "    sub $136, %rsp\n" /* xmm0-7, and the stack 16-byte aligned for the call */
        "    movdqu %xmm0, 0(%rsp)\n    movdqu %xmm1, 16(%rsp)\n    movdqu %xmm2, 32(%rsp)\n"
        "    movdqu %xmm3, 48(%rsp)\n    movdqu %xmm4, 64(%rsp)\n    movdqu %xmm5, 80(%rsp)\n"
        "    movdqu %xmm6, 96(%rsp)\n    movdqu %xmm7, 112(%rsp)\n"
        "    call colo_gate_wait\n"
        "    movdqu 0(%rsp), %xmm0\n    movdqu 16(%rsp), %xmm1\n    movdqu 32(%rsp), %xmm2\n"
        "    movdqu 48(%rsp), %xmm3\n    movdqu 64(%rsp), %xmm4\n    movdqu 80(%rsp), %xmm5\n"
        "    movdqu 96(%rsp), %xmm6\n    movdqu 112(%rsp), %xmm7\n"
        "    add $136, %rsp\n"
        "    pop %r11\n    pop %rax\n    pop %r9\n    pop %r8\n"
        "    pop %rcx\n    pop %rdx\n    pop %rsi\n    pop %rdi\n"
        "    jmp 1b\n");
#else
#error "the gate's trampolines are written for x86_64 (see gate.c)"
#endif
