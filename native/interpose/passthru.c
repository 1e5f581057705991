/* Every driver entry point this library does not wrap, exported as a pass-through behind the
 * resume gate (gate.c). A program linked straight to libcuda binds its calls to the first
 * definition in the search order, which is ours (preloaded): without these, a call to a function
 * we do not wrap went straight into the driver and, while the job was suspended (checkpointed by
 * the driver), blocked there, unseen by the gate that asks the daemon to resume the job.
 *
 * The names come from driver_api.list (the build makes it into driver_api.inc). Each is a weak
 * 16-byte stub: the wrappers of hooks.c, strong definitions of the same names, win at link time.
 * A stub puts its slot in r11 and jumps to the common code, which checks the gate word and jumps
 * on to the driver's function with every argument register and the stack untouched. Only the
 * first call (the driver's function is looked up then) and a call made while suspended save the
 * argument registers and call into C. */
#include "ledger.h"

#include <stdint.h>

void *colo_driver_fn(const char *name); /* hooks.c */

#define AS_NAME(n) #n,
static const char *const pass_names[] = {
#define X AS_NAME
#include "driver_api.inc"
#undef X
};
#define N_PASS (sizeof pass_names / sizeof pass_names[0])
void *colo_pass_targets[N_PASS]; /* the driver's function of each stub, once looked up */

/* What a stub answers when the driver has no such function: CUDA_ERROR_NOT_FOUND. */
static int pass_missing(void) { return 500; }

/* Called with the argument registers saved: wait at the gate, then find the driver's function. */
__attribute__((used)) void *colo_pass_slow(unsigned i)
{
    colo_gate_wait();
    void *p = __atomic_load_n(&colo_pass_targets[i], __ATOMIC_ACQUIRE);
    if (p) return p;
    p = colo_driver_fn(pass_names[i]);
    if (!p) return (void *)pass_missing; /* not kept: the driver may be loaded later */
    __atomic_store_n(&colo_pass_targets[i], p, __ATOMIC_RELEASE);
    return p;
}

#if defined(__x86_64__)
#define STUB(n)                                                                                    \
    ".p2align 4\n.globl " #n "\n.weak " #n "\n.type " #n ",@function\n" #n ":\n"                     \
    "    endbr64\n    movl $colo_pass_i, %r11d\n    jmp colo_pass_common\n"                        \
    ".size " #n ",.-" #n "\n.set colo_pass_i, colo_pass_i + 1\n"
#define X STUB
__asm__(".text\n"
        ".set colo_pass_i, 0\n"
#include "driver_api.inc"
        ".p2align 4\n"
        "colo_pass_common:\n"
        "    movq colo_gate_hdr(%rip), %r10\n"
        "    testq %r10, %r10\n"
        "    jz 1f\n"
        "    movl 60(%r10), %r10d\n" /* ledger_header.suspend */
        "    testl %r10d, %r10d\n"
        "    jnz 2f\n"
        "1:  leaq colo_pass_targets(%rip), %r10\n"
        "    movq (%r10,%r11,8), %r10\n"
        "    testq %r10, %r10\n"
        "    jz 2f\n"
        "    jmp *%r10\n"
        "2:  push %rdi\n    push %rsi\n    push %rdx\n    push %rcx\n"
        "    push %r8\n    push %r9\n    push %rax\n    push %r11\n"
        "    sub $136, %rsp\n" /* xmm0-7, and the stack 16-byte aligned for the call */
        "    movdqu %xmm0, 0(%rsp)\n    movdqu %xmm1, 16(%rsp)\n    movdqu %xmm2, 32(%rsp)\n"
        "    movdqu %xmm3, 48(%rsp)\n    movdqu %xmm4, 64(%rsp)\n    movdqu %xmm5, 80(%rsp)\n"
        "    movdqu %xmm6, 96(%rsp)\n    movdqu %xmm7, 112(%rsp)\n"
        "    movl %r11d, %edi\n"
        "    call colo_pass_slow\n"
        "    movq %rax, %r10\n"
        "    movdqu 0(%rsp), %xmm0\n    movdqu 16(%rsp), %xmm1\n    movdqu 32(%rsp), %xmm2\n"
        "    movdqu 48(%rsp), %xmm3\n    movdqu 64(%rsp), %xmm4\n    movdqu 80(%rsp), %xmm5\n"
        "    movdqu 96(%rsp), %xmm6\n    movdqu 112(%rsp), %xmm7\n"
        "    add $136, %rsp\n"
        "    pop %r11\n    pop %rax\n    pop %r9\n    pop %r8\n"
        "    pop %rcx\n    pop %rdx\n    pop %rsi\n    pop %rdi\n"
        "    jmp *%r10\n");
#undef X
#else
#error "the pass-through stubs are written for x86_64 (see gate.c)"
#endif
