/* The library needs nothing but libc.so.6, at symbol versions no newer than GLIBC_2.17, so that a
 * build on a new host loads in any container with glibc 2.17 or later (a preload that cannot load
 * fails every process of the job; tests/test_interposer_glibc.py reads what the .so requires).
 *
 * - Functions libc has had since 2.2.5 are bound to that version (glibc 2.34 moved libpthread and
 *   libdl into libc and gave their functions a new default version, GLIBC_2.34).
 * - The ones that lived in libdl.so.2 / libpthread.so.0 before 2.34 are weak references: from
 *   libc on glibc >= 2.34, from libdl / libpthread on older ones when the program loaded them
 *   (every program that calls dlopen or makes threads did), NULL otherwise, and the callers check.
 *   Naming libdl.so.2 or libpthread.so.0 as NEEDED would fail to load in images without them.
 *   dlopen is not among them: the library exports its own (hooks.c) and finds the real one with
 *   dlvsym. */
#ifndef COLO_GLIBC_COMPAT_H
#define COLO_GLIBC_COMPAT_H
#include <features.h>
#if defined(__x86_64__) && defined(__GLIBC__)
#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
__asm__(".symver dlvsym,dlvsym@GLIBC_2.2.5");
__asm__(".symver dladdr1,dladdr1@GLIBC_2.3.3");
__asm__(".symver dlinfo,dlinfo@GLIBC_2.3.3");
__asm__(".symver pthread_key_create,pthread_key_create@GLIBC_2.2.5");
__asm__(".symver pthread_setspecific,pthread_setspecific@GLIBC_2.2.5");
#pragma weak dlvsym
#pragma weak dladdr1
#pragma weak dlinfo
#pragma weak pthread_key_create
#pragma weak pthread_setspecific
#endif
#endif
