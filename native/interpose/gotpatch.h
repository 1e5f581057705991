/* Point other objects' references to named functions at ours, by writing their GOT entries (x86_64
 * ELF). For libraries loaded with RTLD_DEEPBIND, whose own scope (their dependencies: libcuda,
 * libc) comes before the preloaded library in every lookup they make, so that neither their
 * direct calls into the driver nor their own dlsym would reach the interposer otherwise. */
#ifndef COLO_GOTPATCH_H
#define COLO_GOTPATCH_H

/* For the object of `handle` (a dlopen handle) and every object loaded after it: each reference to
 * an undefined function for which ours(name) answers non-NULL is bound to that answer. Returns how
 * many references were rewritten. */
int got_patch_from(void *handle, void *(*ours)(const char *name));

#endif
