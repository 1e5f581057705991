/* The shared state file: mapping, locking, per-process slots and their liveness.
 *
 * Liveness is an OFD lock each process holds on "its" byte (FG_LOCK_SLOT_BASE + slot) for as long
 * as it lives: the kernel drops it when the process dies, in whatever pid namespace or container it
 * ran, so a dead process is told from a live one without kill(pid, 0) and pid reuse cannot make a
 * dead slot look alive. All changes happen under one OFD lock on byte 0 plus a process mutex. */
#include "fakegpu.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

uint64_t fg_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

int fg_pct(int v) { return v < 0 ? 0 : v > 100 ? 100 : v; }

uint64_t fg_pidns_of(const char *procdir)
{
    char p[PATH_MAX];
    struct stat st;
    snprintf(p, sizeof p, "%s/ns/pid", procdir);
    return stat(p, &st) == 0 ? (uint64_t)st.st_ino : 0;
}

int fg_open(fg_state *s, const char *path)
{
    memset(s, 0, sizeof *s);
    s->fd = -1;
    s->own_slot = -1;
    if (!path)
        path = getenv("COLO_FAKEGPU_STATE");
    if (!path || !*path)
        return -ENOENT;
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    struct stat st;
    if (fstat(fd, &st) != 0 || (size_t)st.st_size < sizeof(struct fg_header)) {
        close(fd);
        return -EINVAL;
    }
    void *m = mmap(NULL, sizeof(struct fg_header), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) {
        int e = errno;
        close(fd);
        return -e;
    }
    struct fg_header *h = m;
    if (memcmp(h->magic, FG_MAGIC, 8) != 0 || h->version != FG_VERSION || h->ndev > FG_MAX_DEV ||
        h->nslots > FG_MAX_SLOTS) {
        munmap(m, sizeof *h);
        close(fd);
        return -EINVAL;
    }
    s->fd = fd;
    s->h = h;
    s->my_pidns = fg_pidns_of("/proc/self");
    pthread_mutex_init(&s->mu, NULL);
    return 0;
}

void fg_close(fg_state *s)
{
    if (s->h)
        munmap(s->h, sizeof *s->h);
    if (s->fd >= 0)
        close(s->fd);
    s->h = NULL;
    s->fd = -1;
    s->own_slot = -1;
}

static int ofd(int fd, int cmd, short type, off_t start)
{
    struct flock fl = {.l_type = type, .l_whence = SEEK_SET, .l_start = start, .l_len = 1, .l_pid = 0};
    int r;
    do
        r = fcntl(fd, cmd, &fl);
    while (r != 0 && errno == EINTR);
    if (r == 0 && cmd == F_OFD_GETLK)
        return fl.l_type != F_UNLCK;
    return r;
}

void fg_lock(fg_state *s)
{
    pthread_mutex_lock(&s->mu);
    ofd(s->fd, F_OFD_SETLKW, F_WRLCK, FG_LOCK_GLOBAL);
}

void fg_unlock(fg_state *s)
{
    ofd(s->fd, F_OFD_SETLK, F_UNLCK, FG_LOCK_GLOBAL);
    pthread_mutex_unlock(&s->mu);
}

int fg_slot_alive(fg_state *s, int i)
{
    if (i == s->own_slot)
        return 1;
    return ofd(s->fd, F_OFD_GETLK, F_WRLCK, FG_LOCK_SLOT_BASE + i) == 1;
}

void fg_slot_drop_memory(fg_state *s, int i)
{
    struct fg_slot *sl = &s->h->slot[i];
    for (uint32_t d = 0; d < s->h->ndev && d < FG_MAX_DEV; d++) {
        struct fg_device *dv = &s->h->dev[d];
        dv->used = dv->used >= sl->used[d] ? dv->used - sl->used[d] : 0;
        sl->used[d] = 0;
    }
}

static void slot_clear(fg_state *s, int i)
{
    fg_slot_drop_memory(s, i);
    uint32_t gen = s->h->slot[i].gen;
    memset(&s->h->slot[i], 0, sizeof s->h->slot[i]);
    s->h->slot[i].gen = gen;
}

void fg_reap(fg_state *s)
{
    struct fg_header *h = s->h;
    uint32_t hwm = h->hwm < h->nslots ? h->hwm : h->nslots;
    for (uint32_t i = 0; i < hwm; i++)
        if (h->slot[i].state != FG_SLOT_FREE && !fg_slot_alive(s, (int)i))
            slot_clear(s, (int)i);
}

int fg_claim_slot(fg_state *s, int kind)
{
    struct fg_header *h = s->h;
    fg_reap(s);
    for (uint32_t i = 0; i < h->nslots; i++) {
        if (h->slot[i].state != FG_SLOT_FREE)
            continue;
        if (ofd(s->fd, F_OFD_SETLK, F_WRLCK, FG_LOCK_SLOT_BASE + i) != 0)
            continue; /* a process is between death and reaping: leave its byte alone */
        struct fg_slot *sl = &h->slot[i];
        uint32_t gen = sl->gen + 1;
        memset(sl, 0, sizeof *sl);
        sl->gen = gen;
        sl->state = FG_SLOT_LIVE;
        sl->kind = (uint32_t)kind;
        sl->pid = getpid();
        sl->uid = getuid();
        sl->pidns = s->my_pidns;
        sl->start_ns = fg_now_ns();
        sl->thread_pct = 100;
        FILE *f = fopen("/proc/self/comm", "re");
        if (f) {
            if (fgets(sl->comm, sizeof sl->comm, f))
                sl->comm[strcspn(sl->comm, "\n")] = 0;
            fclose(f);
        }
        if (i + 1 > h->hwm)
            h->hwm = i + 1;
        s->own_slot = (int)i;
        return (int)i;
    }
    return -1;
}

void fg_release_slot(fg_state *s, int i)
{
    if (i < 0)
        return;
    slot_clear(s, i);
    ofd(s->fd, F_OFD_SETLK, F_UNLCK, FG_LOCK_SLOT_BASE + i);
    if (s->own_slot == i)
        s->own_slot = -1;
}

static int nspid_last(const char *procdir)
{
    char p[PATH_MAX], line[256];
    snprintf(p, sizeof p, "%s/status", procdir);
    FILE *f = fopen(p, "re");
    if (!f)
        return -1;
    int last = -1;
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, "NSpid:", 6) != 0)
            continue;
        char *save = NULL;
        for (char *t = strtok_r(line + 6, " \t\n", &save); t; t = strtok_r(NULL, " \t\n", &save))
            last = atoi(t);
        break;
    }
    fclose(f);
    return last;
}

int fg_translate_pid(fg_state *s, int pid, uint64_t pidns)
{
    if (pidns == 0 || pidns == s->my_pidns)
        return pid;
    DIR *d = opendir("/proc");
    if (!d)
        return 0;
    int found = 0;
    struct dirent *e;
    char dir[300];
    while (!found && (e = readdir(d))) {
        if (!isdigit((unsigned char)e->d_name[0]))
            continue;
        snprintf(dir, sizeof dir, "/proc/%s", e->d_name);
        if (fg_pidns_of(dir) == pidns && nspid_last(dir) == pid)
            found = atoi(e->d_name);
    }
    closedir(d);
    return found;
}

int fg_device_procs(fg_state *s, int d, struct fg_proc *out, int max, int *sm_util, int *mem_util)
{
    struct fg_header *h = s->h;
    int n = 0, sm_sum = 0, bw_sum = 0;
    fg_reap(s);
    for (uint32_t i = 0; i < h->hwm && i < h->nslots; i++) {
        struct fg_slot *sl = &h->slot[i];
        if (sl->state != FG_SLOT_LIVE || !(sl->ctx_mask & (1u << d)))
            continue;
        int sm = fg_pct(sl->sm_pct), bw = fg_pct(sl->membw_pct), cap = fg_pct(sl->thread_pct);
        if (sl->kind == FG_KIND_MPS_CLIENT && sm > cap)
            sm = cap;
        sm_sum += sm;
        bw_sum += bw;
        if (n < max) {
            int pid = fg_translate_pid(s, sl->pid, sl->pidns);
            out[n] = (struct fg_proc){.slot = (int)i, .pid = pid ? pid : sl->pid, .uid = sl->uid,
                                      .kind = (int)sl->kind, .used = sl->used[d], .sm = sm,
                                      .membw = bw, .start_ns = sl->start_ns};
        }
        n++;
    }
    /* Contexts whose demands exceed the device share it in proportion (time-slicing or MPS alike). */
    for (int k = 0; k < n && k < max; k++) {
        if (sm_sum > 100)
            out[k].sm = out[k].sm * 100 / sm_sum;
        if (bw_sum > 100)
            out[k].membw = out[k].membw * 100 / bw_sum;
    }
    if (sm_util)
        *sm_util = fg_pct(sm_sum);
    if (mem_util)
        *mem_util = fg_pct(bw_sum);
    return n;
}

/* CUDA's enumeration order over the usable devices: CUDA_DEVICE_ORDER=PCI_BUS_ID is the physical
 * (NVML) order; the default, FASTEST_FIRST, puts devices with more SMs first (ties in PCI order).
 * A device whose node cannot be opened is not enumerated at all, as with the real driver. */
static int cuda_order(fg_state *s, int *order, uint32_t usable)
{
    int ndev = (int)s->h->ndev, n = 0;
    const char *o = getenv("CUDA_DEVICE_ORDER");
    int pci = o && !strcmp(o, "PCI_BUS_ID");
    for (int i = 0; i < ndev; i++) {
        if (!(usable & (1u << i)))
            continue;
        int k = n++;
        while (!pci && k > 0 && s->h->dev[order[k - 1]].sms < s->h->dev[i].sms) {
            order[k] = order[k - 1];
            k--;
        }
        order[k] = i;
    }
    return n;
}

int fg_parse_visible(fg_state *s, const char *env, int *map, uint32_t usable)
{
    int n = 0, order[FG_MAX_DEV];
    int ndev = cuda_order(s, order, usable);
    if (!env) {
        for (int i = 0; i < ndev; i++)
            map[i] = order[i];
        return ndev;
    }
    char buf[1024];
    snprintf(buf, sizeof buf, "%s", env);
    char *save = NULL;
    /* As the real driver: stop at the first entry that is invalid or repeated. */
    for (char *t = strtok_r(buf, ",", &save); t && n < ndev; t = strtok_r(NULL, ",", &save)) {
        while (isspace((unsigned char)*t))
            t++;
        t[strcspn(t, " \t\n")] = 0;
        int idx = -1;
        if (isdigit((unsigned char)*t)) {
            char *end;
            long v = strtol(t, &end, 10);
            if (*end == 0 && v < ndev)
                idx = order[v];
        } else if (strncasecmp(t, "GPU-", 4) == 0 && strlen(t) > 4) {
            for (int k = 0; k < ndev; k++) {
                int i = order[k];
                if (strncasecmp(s->h->dev[i].uuid, t, strlen(t)) == 0) {
                    if (idx >= 0) { idx = -1; break; } /* ambiguous prefix */
                    idx = i;
                }
            }
        }
        if (idx < 0)
            break;
        int dup = 0;
        for (int k = 0; k < n; k++)
            dup |= map[k] == idx;
        if (dup)
            break;
        map[n++] = idx;
    }
    return n;
}

/* The folder "<state file>.dev" (an fd of it), found from the file this process opened, not from
 * the name it was given: a symlink or /proc/self/fd path to someone's state cannot bring a folder
 * of its own along. A hard link could (the state is 0666, so anyone may link it beside a folder of
 * their own), so the folder must be beside that very file (its folder, opened, holds the state's
 * inode under that name: no path swapped in meanwhile), belong to the state's owner and be
 * writable by no one else. -ENOENT: no folder, a state made before nodes existed, where every node
 * opens; never for a state with other links (a link is no old state). -1: no node opens. */
static int node_dir(fg_state *s)
{
    char fdp[64], real[PATH_MAX], *slash;
    struct stat st, at, dst;
    snprintf(fdp, sizeof fdp, "/proc/self/fd/%d", s->fd);
    ssize_t len = readlink(fdp, real, sizeof real - 8);
    if (len <= 0 || fstat(s->fd, &st) != 0)
        return -1;
    real[len] = 0;
    if (strstr(real, " (deleted)") || !(slash = strrchr(real, '/')) || !slash[1])
        return -1;
    *slash = 0;
    int parent = open(slash == real ? "/" : real, O_PATH | O_DIRECTORY | O_CLOEXEC); /* search, not read */
    if (parent < 0)
        return -1;
    int dfd = -1;
    if (fstatat(parent, slash + 1, &at, AT_SYMLINK_NOFOLLOW) == 0 && at.st_dev == st.st_dev &&
        at.st_ino == st.st_ino) {
        strcat(slash + 1, ".dev");
        dfd = openat(parent, slash + 1, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (dfd < 0)
            dfd = errno == ENOENT && st.st_nlink == 1 ? -ENOENT : -1;
        else if (fstat(dfd, &dst) != 0 || dst.st_uid != st.st_uid || (dst.st_mode & 022)) {
            close(dfd);
            dfd = -1;
        }
    }
    close(parent);
    return dfd;
}

/* dir/nvidiactl, dir/nvidia-uvm or dir/nvidiaN */
static void node_path(char *out, size_t n, const char *dir, int which)
{
    if (which == FG_NODE_CTL)
        snprintf(out, n, "%s/nvidiactl", dir);
    else if (which == FG_NODE_UVM)
        snprintf(out, n, "%s/nvidia-uvm", dir);
    else
        snprintf(out, n, "%s/nvidia%d", dir, which);
}

int fg_node_open(fg_state *s, int which)
{
    char p[64];
    int dir = node_dir(s);
    if (dir < 0)
        return dir == -ENOENT; /* no folder beside an unlinked state: nodes made before they existed */
    node_path(p, sizeof p, ".", which);
    int fd = openat(dir, p, O_RDWR | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
    int e = errno;
    close(dir);
    if (fd >= 0) {
        close(fd);
        return 1;
    }
    /* A character device of a major no driver serves here (e.g. 195 with no NVIDIA driver): the
     * devices cgroup (EPERM) and the file's mode (EACCES) were checked before the kernel found no
     * driver, so this process may open it. */
    return e == ENXIO || e == ENODEV;
}

uint32_t fg_usable(fg_state *s)
{
    uint32_t m = 0;
    for (uint32_t d = 0; d < s->h->ndev && d < FG_MAX_DEV; d++)
        if (fg_node_open(s, (int)d))
            m |= 1u << d;
    return m;
}

int fg_parse_size(const char *text, uint64_t *out)
{
    char *end;
    errno = 0;
    double v = strtod(text, &end);
    if (end == text || errno || v < 0)
        return -1;
    while (isspace((unsigned char)*end))
        end++;
    static const struct { const char *u; double m; } units[] = {
        {"", 1}, {"b", 1}, {"k", 1024.0}, {"kib", 1024.0}, {"kb", 1e3}, {"m", 1048576.0},
        {"mib", 1048576.0}, {"mb", 1e6}, {"g", 1073741824.0}, {"gib", 1073741824.0}, {"gb", 1e9},
        {"t", 1099511627776.0}, {"tib", 1099511627776.0}, {"tb", 1e12}};
    for (size_t i = 0; i < sizeof units / sizeof units[0]; i++)
        if (strcasecmp(end, units[i].u) == 0) {
            *out = (uint64_t)(v * units[i].m);
            return 0;
        }
    return -1;
}

static void random_uuid(char *out, size_t n)
{
    unsigned char b[16] = {0};
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd < 0 || read(fd, b, sizeof b) != (ssize_t)sizeof b) {
        uint64_t t = fg_now_ns() ^ (uint64_t)getpid();
        memcpy(b, &t, sizeof t);
    }
    if (fd >= 0)
        close(fd);
    snprintf(out, n,
             "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1],
             b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

/* The device nodes of a new state: plain files any process may open (0666, as the real driver's
 * default DeviceFileMode). Nodes already there are kept: an admin may have made them character
 * devices or changed their group and mode (colo-fakegpu nodes, docs/gating.md). */
static int make_nodes(const char *path, int count)
{
    char real[PATH_MAX], dir[PATH_MAX + 8], p[PATH_MAX + 32];
    if (!realpath(path, real))
        return -errno;
    snprintf(dir, sizeof dir, "%s.dev", real);
    if (mkdir(dir, 0755) != 0 && errno != EEXIST)
        return -errno;
    chmod(dir, 0755);
    for (int i = -2; i < count; i++) {
        node_path(p, sizeof p, dir, i);
        int fd = open(p, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
        if (fd < 0) {
            if (errno == EEXIST)
                continue;
            return -errno;
        }
        int e = fchmod(fd, 0666) != 0 ? -errno : 0;
        close(fd);
        if (e)
            return e;
    }
    return 0;
}

int fg_create(const char *path, int count, uint64_t mem, const char *name, int sms,
              char *const *uuids, int nuuids)
{
    if (count < 1 || count > FG_MAX_DEV || mem == 0 || sms < 1 || nuuids > count)
        return -EINVAL;
    struct fg_header *h = calloc(1, sizeof *h);
    if (!h)
        return -ENOMEM;
    memcpy(h->magic, FG_MAGIC, 8);
    h->version = FG_VERSION;
    h->ndev = (uint32_t)count;
    h->nslots = FG_MAX_SLOTS;
    h->created_ns = fg_now_ns();
    for (int i = 0; i < count; i++) {
        struct fg_device *d = &h->dev[i];
        snprintf(d->name, sizeof d->name, "%s", name && *name ? name : "Colo Simulated GPU");
        if (i < nuuids && uuids[i])
            snprintf(d->uuid, sizeof d->uuid, "%s", uuids[i]);
        else
            random_uuid(d->uuid, sizeof d->uuid);
        d->total = mem;
        d->sms = (uint32_t)sms;
        d->cc_major = 8;
        d->cc_minor = 0;
        d->pci_bus = (uint32_t)(0x17 + i);
    }
    /* Write a sibling and rename it, so a reader never maps a half-written file. */
    char tmp[PATH_MAX];
    snprintf(tmp, sizeof tmp, "%s.XXXXXX", path);
    int fd = mkstemp(tmp);
    int err = 0;
    if (fd < 0) {
        err = -errno;
    } else {
        const char *p = (const char *)h;
        size_t left = sizeof *h;
        while (left && !err) {
            ssize_t w = write(fd, p, left);
            if (w < 0 && errno != EINTR)
                err = -errno;
            else if (w > 0) {
                p += w;
                left -= (size_t)w;
            }
        }
        if (!err && fchmod(fd, 0666) != 0) /* job processes of any uid must be able to use it */
            err = -errno;
        if (close(fd) != 0 && !err)
            err = -errno;
        if (!err && rename(tmp, path) != 0)
            err = -errno;
        if (err)
            unlink(tmp);
    }
    free(h);
    return err ? err : make_nodes(path, count);
}

int fg_mps_attribution(fg_state *s)
{
    const char *e = getenv("COLO_FAKEGPU_MPS_ATTRIBUTION");
    if (e && !strcmp(e, "server"))
        return FG_ATTR_SERVER;
    if (e && !strcmp(e, "client"))
        return FG_ATTR_CLIENT;
    return __atomic_load_n(&s->h->mps_attribution, __ATOMIC_ACQUIRE) == FG_ATTR_SERVER ? FG_ATTR_SERVER
                                                                                     : FG_ATTR_CLIENT;
}
