/* dlsym through the interposer must look as if the program called it: glibc finds the caller
 * from the return address (RTLD_NEXT, and the caller's local scope for RTLD_DEFAULT).
 *
 * Built three ways by tests/test_interposer.py: -DDEP (libdep.so: dep_only, shared_fn = 2),
 * -DPLUG (libplug.so, linked to libdep: shared_fn = 1, plug() looks both up), and the program,
 * which dlopens libplug.so with RTLD_LOCAL (so libdep is not in the global scope) and prints
 * "<dep_only()> <next shared_fn()>": "7 2" when dlsym saw libplug as its caller. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>

#if defined(DEP)
int dep_only(void) { return 7; }
int shared_fn(void) { return 2; }
#elif defined(PLUG)
int shared_fn(void) { return 1; }
void plug(int *a, int *b)
{
    int (*d)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, "dep_only");
    int (*n)(void) = (int (*)(void))dlsym(RTLD_NEXT, "shared_fn");
    *a = d ? d() : -1;
    *b = n ? n() : -1;
}
#else
int main(int argc, char **argv)
{
    void *h = dlopen(argc > 1 ? argv[1] : "libplug.so", RTLD_NOW | RTLD_LOCAL);
    if (!h) { fprintf(stderr, "%s\n", dlerror()); return 2; }
    void (*plug)(int *, int *) = (void (*)(int *, int *))dlsym(h, "plug");
    int a = 0, b = 0;
    plug(&a, &b);
    printf("%d %d\n", a, b);
    return 0;
}
#endif
