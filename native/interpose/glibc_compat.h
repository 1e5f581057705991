/* Bind to the oldest versions of the glibc functions we call, so that a library built on a new
 * host still loads in a container with an older glibc (a failed LD_PRELOAD would silently run
 * the job without its budget). Every symbol named here exists at these versions since glibc 2.12. */
#ifndef COLO_GLIBC_COMPAT_H
#define COLO_GLIBC_COMPAT_H
#include <features.h>
#if defined(__x86_64__) && defined(__GLIBC__)
__asm__(".symver dlopen,dlopen@GLIBC_2.2.5");
__asm__(".symver dlvsym,dlvsym@GLIBC_2.2.5");
__asm__(".symver pthread_once,pthread_once@GLIBC_2.2.5");
__asm__(".symver pthread_mutexattr_init,pthread_mutexattr_init@GLIBC_2.2.5");
__asm__(".symver pthread_mutexattr_destroy,pthread_mutexattr_destroy@GLIBC_2.2.5");
__asm__(".symver pthread_mutexattr_setpshared,pthread_mutexattr_setpshared@GLIBC_2.2.5");
__asm__(".symver pthread_mutexattr_setrobust,pthread_mutexattr_setrobust@GLIBC_2.12");
__asm__(".symver pthread_mutex_consistent,pthread_mutex_consistent@GLIBC_2.12");
#endif
#endif
