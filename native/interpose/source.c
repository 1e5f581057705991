/* Where a job's budget comes from (invariant 14, docs/invariants.md).
 *
 * COLO_GPU_BUDGET, COLO_LEDGER and COLO_GPU_MANAGED are the job's to change: a job script could
 * point COLO_LEDGER at a ledger it made itself, with a larger budget. So colo (root) writes the
 * budget, the managed-memory policy, the job's uid and id into a file `budget` beside the ledger,
 * in the job's run folder (jobs/<ID>, root's, 0711). This library takes them from that file when
 * it is colo's: the folder and the file root's and writable by nobody else, the file regular and
 * opened without following a link, its uid the caller's. Inside a container the folder is colo's
 * own mount, /opt/colo/run, whatever COLO_LEDGER says.
 *
 * A process in a colo job's cgroup (…/colo-<instance>/job-<N>, as /proc/self/cgroup names it)
 * whose ledger folder holds no such file refuses every counted allocation (fail closed): it has
 * tried to leave its budget. That the cgroup's name can be made by anyone does not matter here:
 * it only ever makes this library refuse more. Any other process (`colo run-budgeted`, a test)
 * goes by its environment, as before. */
#include "source.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#define IN_CONTAINER "/opt/colo/run" /* colo's mount of the job's run folder (launchspec.py) */
#define BUDGET_FILE "budget"
#define BUDGET_MAX 1024

struct budget {
    uint64_t bytes;
    int have_bytes, managed_none;
    long uid, job;
};

/* fstat(2) itself: glibc's own fstat is versioned GLIBC_2.33, newer than this library may need
 * (glibc_compat.h); on x86_64 the kernel's struct stat is glibc's. */
static int fstat_fd(int fd, struct stat *st) { return (int)syscall(SYS_fstat, fd, st); }

static char g_ledger[4096];
static char g_why[768];

/* N of the colo job folder (…/colo-<instance>/job-<N>) this process is in, by name; -1 if none. */
static long job_of_self(void)
{
    char buf[8192];
    int fd = open("/proc/self/cgroup", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return -1;
    buf[n] = 0;
    for (char *line = buf, *next; line && *line; line = next) {
        next = strchr(line, '\n');
        if (next) *next++ = 0;
        char *path = strchr(line, ':');
        path = path ? strchr(path + 1, ':') : NULL; /* "ID:CONTROLLERS:PATH" */
        char *leaf = path ? strrchr(path, '/') : NULL;
        if (!leaf || strncmp(leaf, "/job-", 5) || !leaf[5]) continue;
        char *end;
        errno = 0;
        long job = strtol(leaf + 5, &end, 10);
        if (errno || *end || job < 0 || leaf[5] < '0' || leaf[5] > '9') continue;
        *leaf = 0;
        char *parent = strrchr(path, '/');
        if (parent && !strncmp(parent, "/colo-", 6)) return job;
    }
    return -1;
}

static int parse_num(const char *s, unsigned long long *out)
{
    char *end;
    errno = 0;
    if (*s < '0' || *s > '9') return -1;
    *out = strtoull(s, &end, 10);
    return errno || *end ? -1 : 0;
}

/* NULL when `dir` holds colo's budget file for this uid (read into *b), else why not. */
static const char *read_budget(const char *dir, struct budget *b)
{
    struct stat st;
    int dfd = open(dir, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC); /* 0711: searchable, not readable */
    if (dfd < 0) {
        snprintf(g_why, sizeof g_why, "cannot open %.400s: %s", dir, strerror(errno));
        return g_why;
    }
    if (fstat_fd(dfd, &st) != 0 || st.st_uid != 0 || (st.st_mode & 022)) {
        close(dfd);
        snprintf(g_why, sizeof g_why, "%.400s is not a folder only root can change: no budget colo wrote", dir);
        return g_why;
    }
    int fd = openat(dfd, BUDGET_FILE, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    close(dfd);
    if (fd < 0) {
        snprintf(g_why, sizeof g_why, "%.400s holds no budget colo wrote (%s)", dir, strerror(errno));
        return g_why;
    }
    char text[BUDGET_MAX + 1];
    ssize_t n = -1;
    if (fstat_fd(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == 0 && !(st.st_mode & 022) && st.st_size <= BUDGET_MAX)
        n = read(fd, text, BUDGET_MAX);
    close(fd);
    if (n < 0) {
        snprintf(g_why, sizeof g_why, "%.400s/%s is not colo's (root's, read-only, a small regular file)", dir, BUDGET_FILE);
        return g_why;
    }
    text[n] = 0;
    *b = (struct budget){.uid = -1, .job = -1};
    for (char *line = text, *next; line && *line; line = next) {
        next = strchr(line, '\n');
        if (next) *next++ = 0;
        char *eq = strchr(line, '=');
        if (!eq) continue;
        *eq = 0;
        unsigned long long v;
        const char *val = eq + 1;
        if (!strcmp(line, "budget") && parse_num(val, &v) == 0) b->bytes = v, b->have_bytes = 1;
        else if (!strcmp(line, "managed")) b->managed_none = !strcmp(val, "none");
        else if (!strcmp(line, "uid") && parse_num(val, &v) == 0 && v <= 0xffffffffull) b->uid = (long)v;
        else if (!strcmp(line, "job") && parse_num(val, &v) == 0 && v <= 0x7fffffffffffffffull) b->job = (long)v;
    }
    if (!b->have_bytes || b->uid < 0) {
        snprintf(g_why, sizeof g_why, "%.400s/%s is malformed", dir, BUDGET_FILE);
        return g_why;
    }
    if ((unsigned long)b->uid != (unsigned long)getuid()) {
        snprintf(g_why, sizeof g_why, "%.400s/%s is the budget of uid %ld, not of uid %u", dir, BUDGET_FILE, b->uid,
                 (unsigned)getuid());
        return g_why;
    }
    return NULL;
}

int budget_source(uint64_t *budget, const char **ledger, const char **error)
{
    int cfd = open(IN_CONTAINER, O_PATH | O_DIRECTORY | O_CLOEXEC);
    int container = cfd >= 0;
    if (cfd >= 0) close(cfd);
    long in_job = container ? -1 : job_of_self();
    const char *env = getenv("COLO_LEDGER");
    char dir[sizeof g_ledger - 8];
    if (container) {
        snprintf(dir, sizeof dir, "%s", IN_CONTAINER);
    } else if (env && *env && strlen(env) < sizeof dir) {
        snprintf(dir, sizeof dir, "%s", env);
        char *slash = strrchr(dir, '/');
        if (!slash) snprintf(dir, sizeof dir, ".");
        else if (slash == dir) dir[1] = 0;
        else *slash = 0;
    } else if (in_job < 0) {
        return 0;
    } else {
        *ledger = NULL;
        snprintf(g_why, sizeof g_why, "this process is in colo job %ld's cgroup but COLO_LEDGER is %s", in_job,
                 env && *env ? "too long" : "not set");
        *error = g_why;
        return 1;
    }
    struct budget b;
    const char *bad = read_budget(dir, &b);
    if (bad && !container && in_job < 0) return 0; /* not a colo job's: its environment says it all */
    if (!bad && in_job >= 0 && b.job >= 0 && b.job != in_job) {
        snprintf(g_why, sizeof g_why, "%.400s holds the budget of colo job %ld", dir, b.job);
        bad = g_why;
    }
    snprintf(g_ledger, sizeof g_ledger, "%s/ledger", strcmp(dir, "/") ? dir : "");
    *ledger = g_ledger;
    if (bad) {
        static char said[sizeof g_why + 64];
        if (in_job >= 0) snprintf(said, sizeof said, "this process is in colo job %ld's cgroup, but %s", in_job, bad);
        else snprintf(said, sizeof said, "%s", bad);
        *error = said;
        return 1;
    }
    *budget = b.bytes;
    /* hooks.c reads COLO_GPU_MANAGED right after this (its constructor): colo's policy, not the job's */
    if (b.managed_none) setenv("COLO_GPU_MANAGED", "none", 1);
    else unsetenv("COLO_GPU_MANAGED");
    return 1;
}
