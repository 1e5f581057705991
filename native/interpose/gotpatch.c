/* GOT rewriting (gotpatch.h). Relocations read: R_X86_64_JUMP_SLOT (calls through the PLT, bound
 * lazily or at load), R_X86_64_GLOB_DAT (addresses taken) and R_X86_64_64 (addresses in data),
 * from DT_RELA and DT_JMPREL. An entry in the RELRO segment (read-only once relocated) is made
 * writable for the one store and read-only again. A PLT entry not bound yet is bound by the store:
 * the lazy resolver is never asked for it. */
#include "gotpatch.h"

#include <dlfcn.h>
#include <elf.h>
#include <link.h>
#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h>

#define MAX_OBJS 512

struct patch {
    ElfW(Addr) bases[MAX_OBJS];
    int nbases, done;
    void *(*ours)(const char *);
};

/* A d_ptr of the dynamic section: ld.so relocates them in place when the section is writable
 * (x86_64), so an address below the object's base is still relative. */
static uintptr_t dyn_ptr(ElfW(Addr) base, ElfW(Addr) v) { return v < base ? base + v : v; }

static void store(void **slot, void *value, uintptr_t relro_lo, uintptr_t relro_hi)
{
    if (*slot == value) return;
    uintptr_t at = (uintptr_t)slot;
    if (at >= relro_lo && at < relro_hi) {
        uintptr_t page = at & ~((uintptr_t)sysconf(_SC_PAGESIZE) - 1);
        if (mprotect((void *)page, (size_t)sysconf(_SC_PAGESIZE), PROT_READ | PROT_WRITE) != 0) return;
        __atomic_store_n(slot, value, __ATOMIC_RELEASE);
        mprotect((void *)page, (size_t)sysconf(_SC_PAGESIZE), PROT_READ);
        return;
    }
    __atomic_store_n(slot, value, __ATOMIC_RELEASE);
}

static int patch_relas(struct patch *pt, ElfW(Addr) base, const ElfW(Rela) *r, size_t n, const ElfW(Sym) *symtab,
                       const char *strtab, uintptr_t relro_lo, uintptr_t relro_hi)
{
    int done = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned type = ELF64_R_TYPE(r[i].r_info), sym = ELF64_R_SYM(r[i].r_info);
        if (!sym || (type != R_X86_64_JUMP_SLOT && type != R_X86_64_GLOB_DAT && type != R_X86_64_64)) continue;
        if (symtab[sym].st_shndx != SHN_UNDEF) continue; /* its own function: it keeps it */
        void *f = pt->ours(strtab + symtab[sym].st_name);
        if (!f) continue;
        if (type == R_X86_64_64) f = (char *)f + r[i].r_addend;
        store((void **)(base + r[i].r_offset), f, relro_lo, relro_hi);
        done++;
    }
    return done;
}

static int patch_object(struct dl_phdr_info *info, size_t size, void *arg)
{
    (void)size;
    struct patch *pt = arg;
    int mine = 0;
    for (int i = 0; i < pt->nbases && !mine; i++) mine = info->dlpi_addr == pt->bases[i];
    if (!mine) return 0;
    const ElfW(Dyn) *dyn = NULL;
    uintptr_t relro_lo = 0, relro_hi = 0;
    for (int i = 0; i < info->dlpi_phnum; i++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        if (ph->p_type == PT_DYNAMIC) dyn = (const ElfW(Dyn) *)(info->dlpi_addr + ph->p_vaddr);
        if (ph->p_type == PT_GNU_RELRO) {
            relro_lo = info->dlpi_addr + ph->p_vaddr;
            relro_hi = relro_lo + ph->p_memsz;
        }
    }
    if (!dyn) return 0;
    ElfW(Addr) base = info->dlpi_addr;
    const ElfW(Sym) *symtab = NULL;
    const char *strtab = NULL;
    const ElfW(Rela) *rela = NULL, *jmprel = NULL;
    size_t relasz = 0, pltrelsz = 0;
    long pltrel = DT_RELA;
    for (const ElfW(Dyn) *d = dyn; d->d_tag != DT_NULL; d++) {
        switch (d->d_tag) {
        case DT_SYMTAB: symtab = (const ElfW(Sym) *)dyn_ptr(base, d->d_un.d_ptr); break;
        case DT_STRTAB: strtab = (const char *)dyn_ptr(base, d->d_un.d_ptr); break;
        case DT_RELA: rela = (const ElfW(Rela) *)dyn_ptr(base, d->d_un.d_ptr); break;
        case DT_RELASZ: relasz = d->d_un.d_val; break;
        case DT_JMPREL: jmprel = (const ElfW(Rela) *)dyn_ptr(base, d->d_un.d_ptr); break;
        case DT_PLTRELSZ: pltrelsz = d->d_un.d_val; break;
        case DT_PLTREL: pltrel = (long)d->d_un.d_val; break;
        default: break;
        }
    }
    if (!symtab || !strtab) return 0;
    if (rela) pt->done += patch_relas(pt, base, rela, relasz / sizeof *rela, symtab, strtab, relro_lo, relro_hi);
    if (jmprel && pltrel == DT_RELA)
        pt->done += patch_relas(pt, base, jmprel, pltrelsz / sizeof *jmprel, symtab, strtab, relro_lo, relro_hi);
    return 0;
}

int got_patch_from(void *handle, void *(*ours)(const char *name))
{
#if defined(__x86_64__)
    struct link_map *lm = NULL;
    if (!handle || !dlinfo || dlinfo(handle, RTLD_DI_LINKMAP, &lm) != 0 || !lm) return 0;
    struct patch pt = {.ours = ours};
    for (; lm && pt.nbases < MAX_OBJS; lm = lm->l_next)
        if (lm->l_addr) pt.bases[pt.nbases++] = lm->l_addr;
    dl_iterate_phdr(patch_object, &pt);
    return pt.done;
#else
    (void)handle;
    (void)ours;
    return 0;
#endif
}
