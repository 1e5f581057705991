/* Preloaded before the interposer: counts the fcntl calls of the process on the job's ledger
 * ($COLO_LEDGER: its slot locks and liveness probes; the simulated driver's own locks on its
 * state file are not counted) and prints the count at exit. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

static unsigned long calls;

static int on_ledger(int fd)
{
    static struct stat led;
    static int have = -1;
    struct stat st;
    if (have < 0) have = getenv("COLO_LEDGER") && stat(getenv("COLO_LEDGER"), &led) == 0;
    return have && fstat(fd, &st) == 0 && st.st_dev == led.st_dev && st.st_ino == led.st_ino;
}

int fcntl(int fd, int cmd, ...)
{
    static int (*next)(int, int, ...);
    va_list ap;
    va_start(ap, cmd);
    void *arg = va_arg(ap, void *);
    va_end(ap);
    if (!next) next = (int (*)(int, int, ...))dlsym(RTLD_NEXT, "fcntl");
    if (on_ledger(fd)) __atomic_add_fetch(&calls, 1, __ATOMIC_RELAXED);
    return next(fd, cmd, arg);
}

__attribute__((destructor)) static void report(void) { fprintf(stderr, "fcntl calls: %lu\n", calls); }
