/* colo-shim: the small root helper of one process job (as slurmstepd is for a Slurm step).
 *
 *   colo-shim EXITFILE [--cgroup DIR]... [--user UID:GID[:G1,G2...]] [--gpu-group GID] [--workdir DIR]
 *             [--env-fd N] [--tty-fd N | --stdio-fds IN,OUT,ERR] [--log-cap BYTES] [--reserve BYTES]
 *             [--out FILE] [--err FILE]
 *             -- CMD [ARGS...]
 *
 * Started by the daemon with stdout and stderr on the job's log (a root-owned file in a root-only
 * folder) and EXITFILE in a folder the job cannot write. It forks; the child starts a session of
 * its own, joins the job's cgroups, puts its output on a pipe to the shim, drops to the user's
 * groups, gid and uid (and checks it cannot get root back), and only then enters the workdir and
 * runs CMD: nothing the user named is touched with root's rights. --gpu-group adds the group that
 * may open the GPUs' device files on a gated node (docs/gating.md) to the job's groups: the job
 * holds it, its user need not. A failure on the way is the
 * job's failure, with its reason on the log and in EXITFILE; nothing is retried as root.
 *
 * The shim stays root: it copies the job's output to the log up to --log-cap bytes (then one marked
 * line, and the rest is dropped) and drops output while the log's file system has less than
 * --reserve bytes free. When CMD ends, whatever else the job started is killed (cgroup.kill, or a
 * kill loop over cgroup.procs; with no cgroup, every descendant: the shim is a child subreaper, so
 * double forks and setsid children stay its descendants) and reaped; then the exit status goes to
 * EXITFILE atomically: "CODE\n" and, when the job never ran, "REASON\n".
 * Exit code: CMD's, or 128+signal when a signal ended it.
 * TERM, INT, HUP, QUIT, USR1, USR2 sent to the shim are passed on to CMD.
 *
 * --tty-fd N: a session (colo shell): N is the slave end of a pty the daemon made. The child gives
 * it to the user (fchown, 0620 group tty, as login and sshd do), drops privileges, then makes it
 * its controlling terminal (TIOCSCTTY: it leads a session of its own) and its stdin, stdout and
 * stderr; so Ctrl-C, Ctrl-Z and window sizes reach the job's foreground process group. The job's
 * output then goes to the terminal, not the log; failures before the switch still go to the log.
 *
 * --stdio-fds IN,OUT,ERR: a session without a terminal (colo run fed from a pipe, as ssh without
 * one): three pipes the daemon made, whose other ends went to the client. The child gives them to
 * the user (fchown: /dev/stdin opens as for any pipe of theirs), drops privileges, then makes them
 * its stdin, stdout and stderr; it has no controlling terminal (a session of its own, as ever).
 *
 * --out and --err (sbatch -o, -e): the job's stdout (and stderr, unless --err) and its stderr also
 * go to these files, besides the log. Root never opens them: a writer process, forked before the
 * job, drops to the user's groups, gid and uid first, opens each without following a symlink in
 * its last component (O_NOFOLLOW) or blocking on a FIFO, takes only a regular file (or /dev/null),
 * and then copies what the shim hands it on pipes, as the user (their permissions, their quota). It
 * is no process of the job (its cgroup is not the job's: a job that ends has its output drained),
 * and it is not dumpable (the user cannot ptrace it). A file the user cannot open fails the job
 * before it runs, with the reason. A writer that stops taking output is dropped (the log keeps it all).
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAX_CGROUPS 8
#define MAX_GROUPS 1024
#define ENV_MAX (16u << 20)

extern char **environ;

static volatile pid_t child = -1;
static const char *cgroups[MAX_CGROUPS];
static int ncgroups;
static pid_t writer = -1;       /* --out/--err: the process that writes them as the user */
static int w_out = -1, w_err = -1; /* the shim's ends of the pipes to it */
static int writer_status = -1;  /* its exit status, once reaped */
static int main_status, main_done;

static void forward(int sig)
{
    if (child > 0)
        kill(child, sig);
}

static void die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("colo-shim: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(127);
}

static long long parse_num(const char *s, const char *what)
{
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || *end || v < 0)
        die("malformed %s: %s", what, s);
    return v;
}

static int write_all(int fd, const char *buf, size_t n)
{
    while (n) {
        ssize_t w = write(fd, buf, n);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        buf += w;
        n -= (size_t)w;
    }
    return 0;
}

/* ---- the job's output: capped, and dropped while the disk is short of its reserve ---- */
static long long log_size, log_cap, reserve;
static int capped, starved;

static void note(const char *msg)
{
    write_all(1, msg, strlen(msg));
}

static void relay(const char *buf, size_t n)
{
    char msg[256];
    if (capped)
        return;
    if (reserve > 0) {
        struct statvfs sv;
        if (fstatvfs(1, &sv) == 0) {
            unsigned long long avail = (unsigned long long)sv.f_bavail * sv.f_frsize;
            if (avail < (unsigned long long)reserve + n) {
                if (!starved) {
                    snprintf(msg, sizeof msg, "\n[colo: output dropped: less than %lld MiB free on the "
                             "state disk]\n", reserve >> 20);
                    note(msg);
                    starved = 1;
                }
                return;
            }
            if (starved) {
                note("[colo: output resumes: the state disk has room again]\n");
                starved = 0;
            }
        }
    }
    if (log_cap > 0 && log_size + (long long)n > log_cap) {
        size_t room = log_size < log_cap ? (size_t)(log_cap - log_size) : 0;
        if (room)
            write_all(1, buf, room);
        snprintf(msg, sizeof msg, "\n[colo: the log reached its cap of %lld bytes; further output is "
                 "dropped]\n", log_cap);
        note(msg);
        capped = 1;
        return;
    }
    if (write_all(1, buf, n) == 0)
        log_size += (long long)n;
}

/* ---- containment ---- */
static int read_pids(const char *dir, pid_t *out, int max)
{
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/cgroup.procs", dir);
    FILE *f = fopen(path, "re");
    if (!f)
        return -1;
    int n = 0;
    long p;
    while (n < max && fscanf(f, "%ld", &p) == 1)
        out[n++] = (pid_t)p;
    fclose(f);
    return n;
}

/* Kill everything in the first cgroup (the one that contains the job); 1 when it is empty. */
static int cgroup_kill(void)
{
    char path[PATH_MAX];
    pid_t pids[4096];
    snprintf(path, sizeof path, "%s/cgroup.kill", cgroups[0]);
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd >= 0) {
        (void)!write(fd, "1", 1);
        close(fd);
    }
    int n = read_pids(cgroups[0], pids, 4096);
    for (int i = 0; i < n; i++)
        kill(pids[i], SIGKILL);
    return n <= 0;
}

/* Without a cgroup: SIGKILL every descendant (found through /proc/PID/task/TID/children). */
static void kill_tree(pid_t pid, int depth)
{
    char path[PATH_MAX];
    if (depth > 64)
        return;
    snprintf(path, sizeof path, "/proc/%d/task", (int)pid);
    DIR *d = opendir(path);
    if (!d)
        return;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.')
            continue;
        char cpath[PATH_MAX];
        snprintf(cpath, sizeof cpath, "/proc/%d/task/%s/children", (int)pid, e->d_name);
        FILE *f = fopen(cpath, "re");
        if (!f)
            continue;
        long c;
        while (fscanf(f, "%ld", &c) == 1) {
            if (depth == 0 && (pid_t)c == writer)
                continue; /* colo's, not the job's: it drains the output after the job */
            kill((pid_t)c, SIGSTOP); /* stop it forking while its children are found */
            kill_tree((pid_t)c, depth + 1);
            kill((pid_t)c, SIGKILL);
        }
        fclose(f);
    }
    closedir(d);
}

static void reap(int *main_status, int *main_done)
{
    int st;
    pid_t p;
    while ((p = waitpid(-1, &st, WNOHANG)) > 0) {
        if (p == child) {
            *main_status = st;
            *main_done = 1;
        } else if (p == writer) {
            writer_status = st;
        }
    }
}

static void sleep_ms(long ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* ---- the exit record ---- */
static void write_status(const char *path, int code, const char *reason)
{
    char tmp[PATH_MAX], buf[1200];
    int n = snprintf(tmp, sizeof tmp, "%s.tmp", path);
    if (n < 0 || (size_t)n >= sizeof tmp)
        return;
    unlink(tmp);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) {
        fprintf(stderr, "colo-shim: cannot write %s: %s\n", tmp, strerror(errno));
        return;
    }
    int len = reason && *reason ? snprintf(buf, sizeof buf, "%d\n%s\n", code, reason)
                                : snprintf(buf, sizeof buf, "%d\n", code);
    if (len > (int)sizeof buf - 1)
        len = (int)sizeof buf - 1;
    if (write_all(fd, buf, (size_t)len) == 0 && fsync(fd) == 0)
        rename(tmp, path);
    close(fd);
}

/* ---- credentials: the user's groups, gid and uid, for good ---- */
static const char *drop_to(uid_t uid, gid_t gid, gid_t *groups, int ngroups)
{
    static char why[256];
    if (setgroups((size_t)ngroups, groups) != 0)
        snprintf(why, sizeof why, "cannot set the groups of uid %d: %s", (int)uid, strerror(errno));
    else if (setresgid(gid, gid, gid) != 0)
        snprintf(why, sizeof why, "cannot switch to gid %d: %s", (int)gid, strerror(errno));
    else if (setresuid(uid, uid, uid) != 0)
        snprintf(why, sizeof why, "cannot switch to uid %d: %s", (int)uid, strerror(errno));
    else {
        uid_t r, e, s;
        gid_t rg, eg, sg;
        if (getresuid(&r, &e, &s) || r != uid || e != uid || s != uid || getresgid(&rg, &eg, &sg) ||
            rg != gid || eg != gid || sg != gid)
            snprintf(why, sizeof why, "the switch to uid %d gid %d did not hold", (int)uid, (int)gid);
        else if (uid != 0 && (setuid(0) == 0 || seteuid(0) == 0))
            snprintf(why, sizeof why, "uid %d could become root again", (int)uid);
        else
            return NULL;
    }
    return why;
}

/* ---- --out/--err: the writer, as the user ---- */
static int open_as_user(const char *path, const char *opt, char *why, size_t n)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC, 0644);
    if (fd < 0) {
        snprintf(why, n, "cannot open %s %s as uid %d: %s", opt, path, (int)getuid(),
                 errno == ELOOP ? "it is a symbolic link (not followed there)" : strerror(errno));
        return -1;
    }
    struct stat st;
    int devnull = 0;
    if (fstat(fd, &st) == 0 && S_ISCHR(st.st_mode))
        devnull = major(st.st_rdev) == 1 && minor(st.st_rdev) == 3;
    if (fstat(fd, &st) != 0 || !(S_ISREG(st.st_mode) || devnull)) {
        snprintf(why, n, "%s %s is not a regular file", opt, path);
        close(fd);
        return -1;
    }
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    return fd;
}

/* The writer's own loop: each pipe to its file, until both are closed. Exit 0, or 2 when a write
 * failed (disk full, over quota): what is left is dropped, the log has it all. */
static void writer_loop(int in_out, int fd_out, int in_err, int fd_err)
{
    static char wbuf[65536];
    int ins[2] = {in_out, in_err}, outs[2] = {fd_out, fd_err}, failed = 0;
    for (;;) {
        struct pollfd p[2];
        int map[2], np = 0;
        for (int k = 0; k < 2; k++)
            if (ins[k] >= 0) {
                p[np] = (struct pollfd){ins[k], POLLIN, 0};
                map[np++] = k;
            }
        if (!np)
            break;
        if (poll(p, (nfds_t)np, -1) < 0 && errno != EINTR)
            break;
        for (int i = 0; i < np; i++) {
            if (!p[i].revents)
                continue;
            int k = map[i];
            ssize_t r = read(ins[k], wbuf, sizeof wbuf);
            if (r > 0) {
                if (!failed && write_all(outs[k], wbuf, (size_t)r) != 0)
                    failed = 1;
            } else if (r == 0 || (errno != EINTR && errno != EAGAIN)) {
                close(ins[k]);
                ins[k] = -1;
            }
        }
    }
    _exit(failed ? 2 : 0);
}

/* Fork the writer; NULL once it has opened the files, else why it could not (the job then fails). */
static const char *start_writer(const char *out, const char *err, int have_user, uid_t uid, gid_t gid,
                                gid_t *groups, int ngroups)
{
    static char why[1024];
    int po[2] = {-1, -1}, pe[2] = {-1, -1}, st[2];
    if ((out && pipe2(po, O_CLOEXEC) != 0) || (err && pipe2(pe, O_CLOEXEC) != 0) || pipe2(st, O_CLOEXEC) != 0) {
        snprintf(why, sizeof why, "pipe: %s", strerror(errno));
        return why;
    }
    writer = fork();
    if (writer < 0) {
        snprintf(why, sizeof why, "fork: %s", strerror(errno));
        return why;
    }
    if (writer == 0) {
        char msg[1024] = "";
        close(st[0]);
        if (po[1] >= 0)
            close(po[1]);
        if (pe[1] >= 0)
            close(pe[1]);
        int null = open("/dev/null", O_RDWR | O_CLOEXEC); /* not the log: the user's process holds nothing of root's */
        for (int i = 0; i < 3 && null >= 0; i++)
            dup2(null, i);
        signal(SIGPIPE, SIG_IGN);
        for (int s = 1; s < NSIG; s++)
            if (s != SIGPIPE)
                signal(s, SIG_DFL);
        prctl(PR_SET_NAME, "colo-writer");
        const char *dropped = have_user ? drop_to(uid, gid, groups, ngroups) : NULL;
        prctl(PR_SET_DUMPABLE, 0); /* after the switch: the user cannot ptrace it or read its fds */
        umask(022);
        int fo = -1, fe = -1;
        if (dropped)
            snprintf(msg, sizeof msg, "the output writer: %s", dropped);
        else if (out)
            fo = open_as_user(out, "--output", msg, sizeof msg);
        if (!msg[0] && err && !(out && !strcmp(out, err)))
            fe = open_as_user(err, "--error", msg, sizeof msg);
        if (!msg[0] && out && err && fe >= 0) { /* one file named twice: one descriptor, one offset */
            struct stat a, b;
            if (fstat(fo, &a) == 0 && fstat(fe, &b) == 0 && a.st_dev == b.st_dev && a.st_ino == b.st_ino) {
                close(fe);
                fe = -1;
            }
        }
        if (err && fe < 0)
            fe = fo;
        write_all(st[1], msg[0] ? msg : "ok", msg[0] ? strlen(msg) : 2);
        close(st[1]);
        if (msg[0])
            _exit(1);
        writer_loop(po[0], fo, pe[0], fe);
    }
    close(st[1]);
    if (po[0] >= 0)
        close(po[0]);
    if (pe[0] >= 0)
        close(pe[0]);
    w_out = po[1];
    w_err = pe[1];
    ssize_t n, got = 0;
    while ((n = read(st[0], why + got, sizeof why - 1 - (size_t)got)) > 0 || (n < 0 && errno == EINTR))
        got += n > 0 ? n : 0;
    close(st[0]);
    why[got] = '\0';
    if (!strcmp(why, "ok")) {
        if (w_out >= 0)
            fcntl(w_out, F_SETFL, O_NONBLOCK);
        if (w_err >= 0)
            fcntl(w_err, F_SETFL, O_NONBLOCK);
        return NULL;
    }
    if (!got)
        snprintf(why, sizeof why, "the output writer ended before it opened the files");
    return why;
}

static void writer_drop(const char *what)
{
    char msg[256];
    if (w_out >= 0)
        close(w_out);
    if (w_err >= 0)
        close(w_err);
    w_out = w_err = -1;
    snprintf(msg, sizeof msg, "\n[colo: %s; --output/--error get no more, colo logs has it all]\n", what);
    note(msg);
}

/* Hand the writer what the job wrote on stream k (0 stdout, 1 stderr). It may be slow (a file
 * system): the job waits for it as for a file of its own; but once the job's main process has
 * ended, 10 s without progress drop it, so that the job's end is never held up for good. */
static void reap(int *main_status, int *main_done);
static void to_writer(int k, const char *buf, size_t n)
{
    int fd = k == 1 && w_err >= 0 ? w_err : w_out;
    long stuck = 0;
    if (fd < 0 || (k == 0 && w_out < 0))
        return;
    while (n) {
        ssize_t w = write(fd, buf, n);
        if (w > 0) {
            buf += w;
            n -= (size_t)w;
            stuck = 0;
            continue;
        }
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0 && errno == EAGAIN) {
            struct pollfd p = {fd, POLLOUT, 0};
            poll(&p, 1, 100);
            reap(&main_status, &main_done);
            if (main_done && (stuck += 100) >= 10000) {
                writer_drop("the output writer took nothing for 10 s after the job ended");
                return;
            }
            continue;
        }
        writer_drop("the output writer is gone");
        return;
    }
}

/* Are there children of the shim other than the writer (the job's, with no cgroup)? */
static int other_children(void)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/self/task/%d/children", (int)getpid());
    FILE *f = fopen(path, "re");
    if (!f)
        return 0;
    long c;
    int any = 0;
    while (fscanf(f, "%ld", &c) == 1)
        if ((pid_t)c != writer)
            any = 1;
    fclose(f);
    return any;
}

/* ---- the child: cgroups, output, credentials, workdir, exec ---- */
static int errfd = -1;

static void child_fail(int code, const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    dprintf(2, "colo: %s\n", msg);
    if (errfd >= 0)
        write_all(errfd, msg, strlen(msg));
    _exit(code);
}

static void run_child(int out_w, int err_w, int have_user, uid_t uid, gid_t gid, gid_t *groups, int ngroups,
                      const char *workdir, char **envp, char **argv, int ttyfd, gid_t ttygid, const int *stdio)
{
    setsid();
    for (int i = 0; i < ncgroups; i++) {
        char path[PATH_MAX], pid[32];
        snprintf(path, sizeof path, "%s/cgroup.procs", cgroups[i]);
        int fd = open(path, O_WRONLY | O_CLOEXEC);
        int len = snprintf(pid, sizeof pid, "%d", (int)getpid());
        if (fd < 0 || write(fd, pid, (size_t)len) != len)
            child_fail(126, "cannot join the job's cgroup %s: %s", cgroups[i], strerror(errno));
        close(fd);
    }
    if (dup2(out_w, 1) < 0 || dup2(err_w, 2) < 0)
        _exit(126);
    if (out_w > 2)
        close(out_w);
    if (err_w > 2 && err_w != out_w)
        close(err_w);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    for (int s = 1; s < NSIG; s++)
        signal(s, SIG_DFL);
    umask(022);
    if (ttyfd >= 0 && have_user &&
        (fchown(ttyfd, uid, ttygid) != 0 || fchmod(ttyfd, ttygid == gid ? 0600 : 0620) != 0))
        child_fail(126, "cannot give the session's terminal to uid %d: %s", (int)uid, strerror(errno));
    for (int k = 0; stdio[0] >= 0 && have_user && k < 3; k++)
        if (fchown(stdio[k], uid, gid) != 0)
            child_fail(126, "cannot give the session's pipes to uid %d: %s", (int)uid, strerror(errno));
    if (have_user) {
        const char *why = drop_to(uid, gid, groups, ngroups);
        if (why)
            child_fail(126, "%s", why);
    }
    if (ttyfd >= 0) { /* as the user: the session's terminal becomes the job's own */
        if (ioctl(ttyfd, TIOCSCTTY, 0) != 0)
            child_fail(126, "cannot make the session's terminal its controlling terminal: %s", strerror(errno));
        if (dup2(ttyfd, 0) < 0 || dup2(ttyfd, 1) < 0 || dup2(ttyfd, 2) < 0)
            child_fail(126, "cannot put the session's terminal on its stdin and stdout: %s", strerror(errno));
        if (ttyfd > 2)
            close(ttyfd);
    }
    if (stdio[0] >= 0) { /* as the user: the session's pipes become its stdin, stdout and stderr */
        for (int k = 0; k < 3; k++)
            if (dup2(stdio[k], k) < 0)
                child_fail(126, "cannot put the session's pipes on its stdin and stdout: %s", strerror(errno));
        for (int k = 0; k < 3; k++)
            if (stdio[k] > 2)
                close(stdio[k]);
    }
    /* As the user: a folder the user cannot enter is refused by the kernel, as for them. */
    if (workdir && chdir(workdir) != 0)
        child_fail(126, "cannot enter the workdir %s as uid %d: %s", workdir, (int)getuid(), strerror(errno));
    environ = envp; /* execvp looks CMD up in the job's own PATH */
    execvp(argv[0], argv);
    child_fail(errno == ENOENT ? 127 : 126, "cannot run %s: %s", argv[0], strerror(errno));
}

static char **read_env(int fd)
{
    size_t cap = 65536, len = 0;
    char *buf = malloc(cap);
    if (!buf)
        die("out of memory");
    for (;;) {
        if (len == cap) {
            if (cap >= ENV_MAX)
                die("environment larger than %u bytes", ENV_MAX);
            cap *= 2;
            if (!(buf = realloc(buf, cap)))
                die("out of memory");
        }
        ssize_t r = read(fd, buf + len, cap - len);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            die("cannot read the environment: %s", strerror(errno));
        if (r == 0)
            break;
        len += (size_t)r;
    }
    close(fd);
    size_t n = 0;
    for (size_t i = 0; i < len; i++)
        n += buf[i] == '\0';
    char **env = calloc(n + 1, sizeof *env);
    if (!env)
        die("out of memory");
    size_t k = 0, start = 0;
    for (size_t i = 0; i < len; i++) {
        if (buf[i] == '\0') {
            env[k++] = buf + start;
            start = i + 1;
        }
    }
    return env;
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: colo-shim EXITFILE [--cgroup DIR]... [--user UID:GID[:G,...]] [--gpu-group GID] "
                        "[--workdir DIR] [--env-fd N] [--tty-fd N | --stdio-fds IN,OUT,ERR] [--log-cap BYTES] [--reserve BYTES] [--out FILE] "
                        "[--err FILE] -- CMD [ARGS...]\n");
        return 2;
    }
    const char *exitfile = argv[1], *workdir = NULL, *out_path = NULL, *err_path = NULL;
    int have_user = 0, have_gpu_group = 0, ngroups = 0, envfd = -1, ttyfd = -1, stdio[3] = {-1, -1, -1}, i;
    gid_t gpu_group = 0;
    uid_t uid = 0;
    gid_t gid = 0;
    static gid_t groups[MAX_GROUPS];
    for (i = 2; i < argc && strcmp(argv[i], "--") != 0; i++) {
        if (i + 1 >= argc)
            die("%s needs a value", argv[i]);
        const char *opt = argv[i], *val = argv[++i];
        if (!strcmp(opt, "--cgroup")) {
            if (ncgroups == MAX_CGROUPS)
                die("too many cgroups");
            cgroups[ncgroups++] = val;
        } else if (!strcmp(opt, "--user")) {
            char *copy = strdup(val), *save = NULL;
            char *u = strtok_r(copy, ":", &save), *g = strtok_r(NULL, ":", &save), *gs = strtok_r(NULL, ":", &save);
            if (!u || !g)
                die("malformed --user %s", val);
            uid = (uid_t)parse_num(u, "uid");
            gid = (gid_t)parse_num(g, "gid");
            for (char *t = gs ? strtok_r(gs, ",", &save) : NULL; t; t = strtok_r(NULL, ",", &save)) {
                if (ngroups == MAX_GROUPS)
                    die("too many groups");
                groups[ngroups++] = (gid_t)parse_num(t, "group");
            }
            have_user = 1;
        } else if (!strcmp(opt, "--gpu-group")) {
            gpu_group = (gid_t)parse_num(val, "--gpu-group");
            have_gpu_group = 1;
        } else if (!strcmp(opt, "--workdir")) {
            workdir = val;
        } else if (!strcmp(opt, "--env-fd")) {
            envfd = (int)parse_num(val, "--env-fd");
        } else if (!strcmp(opt, "--tty-fd")) {
            ttyfd = (int)parse_num(val, "--tty-fd");
            if (!isatty(ttyfd))
                die("--tty-fd %d is not a terminal", ttyfd);
        } else if (!strcmp(opt, "--stdio-fds")) {
            char *copy = strdup(val), *save = NULL, *t = strtok_r(copy, ",", &save);
            for (int k = 0; k < 3; k++, t = strtok_r(NULL, ",", &save)) {
                struct stat pst;
                if (!t)
                    die("malformed --stdio-fds %s: IN,OUT,ERR", val);
                stdio[k] = (int)parse_num(t, "--stdio-fds");
                if (fstat(stdio[k], &pst) != 0 || !S_ISFIFO(pst.st_mode))
                    die("--stdio-fds: %d is not a pipe", stdio[k]);
            }
            free(copy);
        } else if (!strcmp(opt, "--log-cap")) {
            log_cap = parse_num(val, "--log-cap");
        } else if (!strcmp(opt, "--reserve")) {
            reserve = parse_num(val, "--reserve");
        } else if (!strcmp(opt, "--out")) {
            out_path = val;
        } else if (!strcmp(opt, "--err")) {
            err_path = val;
        } else {
            die("unknown option %s", opt);
        }
    }
    if (ttyfd >= 0 && stdio[0] >= 0)
        die("--tty-fd and --stdio-fds: one or the other");
    if (i >= argc - 1)
        die("missing command after --");
    int user_ngroups = ngroups; /* the writer of --out/--err gets the user's own groups, not the GPUs' */
    if (have_gpu_group) {
        if (!have_user)
            die("--gpu-group needs --user");
        int known = 0;
        for (int k = 0; k < ngroups; k++)
            known |= groups[k] == gpu_group;
        if (!known) {
            if (ngroups == MAX_GROUPS)
                die("too many groups");
            groups[ngroups++] = gpu_group;
        }
    }
    char **cmd = argv + i + 1;
    char **envp = envfd >= 0 ? read_env(envfd) : environ;
    struct group *tty_group = ttyfd >= 0 ? getgrnam("tty") : NULL; /* (looked up before the fork) */
    gid_t ttygid = tty_group ? tty_group->gr_gid : gid;
    struct stat st;
    if (fstat(1, &st) == 0 && S_ISREG(st.st_mode))
        log_size = st.st_size;

    int sigs[] = {SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2};
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = forward;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    for (size_t k = 0; k < sizeof sigs / sizeof sigs[0]; k++)
        sigaction(sigs[k], &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    prctl(PR_SET_CHILD_SUBREAPER, 1); /* orphans of the job (double forks) stay ours to kill and reap */

    if (out_path || err_path) {
        const char *why = start_writer(out_path, err_path, have_user, uid, gid, groups, user_ngroups);
        if (why) { /* the job's failure, with the reason, before anything of it ran */
            fprintf(stderr, "colo: %s\n", why);
            write_status(exitfile, 126, why);
            return 126;
        }
    }
    /* the job's stdout, its stderr (a pipe of its own only for --err), the reason it never ran */
    int out[2], se[2] = {-1, -1}, err[2];
    if (pipe2(out, O_CLOEXEC) != 0 || (err_path && pipe2(se, O_CLOEXEC) != 0) || pipe2(err, O_CLOEXEC) != 0)
        die("pipe: %s", strerror(errno));
    child = fork();
    if (child < 0)
        die("fork: %s", strerror(errno));
    if (child == 0) {
        close(out[0]);
        if (se[0] >= 0)
            close(se[0]);
        close(err[0]);
        errfd = err[1];
        run_child(out[1], se[1] >= 0 ? se[1] : out[1], have_user, uid, gid, groups, ngroups, workdir, envp, cmd,
                  ttyfd, ttygid, stdio);
    }
    if (ttyfd >= 0)
        close(ttyfd); /* the job's alone: its client reads EIO once the job's last holder has gone */
    for (int k = 0; k < 3; k++)
        if (stdio[k] >= 0)
            close(stdio[k]); /* the job's alone: its client reads the end of its output once the job's have gone */
    close(out[1]);
    if (se[1] >= 0)
        close(se[1]);
    close(err[1]);

    static char buf[65536];
    int pfd[2] = {out[0], se[0]}, peof[2] = {0, se[0] < 0}, eof = 0;
    long after_ms = 0; /* time spent waiting since the main process ended */
    for (;;) {
        struct pollfd p[2];
        int map[2], np = 0, r = 0;
        for (int k = 0; k < 2; k++)
            if (!peof[k]) {
                p[np] = (struct pollfd){pfd[k], POLLIN, 0};
                map[np++] = k;
            }
        if (np)
            r = poll(p, (nfds_t)np, 100);
        for (int i = 0; r > 0 && i < np; i++) {
            if (!p[i].revents)
                continue;
            int k = map[i];
            ssize_t n = read(pfd[k], buf, sizeof buf);
            if (n > 0) {
                relay(buf, (size_t)n);
                to_writer(k, buf, (size_t)n);
            } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
                peof[k] = 1;
            }
        }
        eof = peof[0] && peof[1];
        reap(&main_status, &main_done);
        if (!main_done) {
            if (eof)
                sleep_ms(50); /* it closed its output but runs on */
            continue;
        }
        /* The main process ended: so does everything else the job started. */
        int empty;
        if (ncgroups > 0) {
            empty = cgroup_kill();
        } else {
            kill_tree(getpid(), 0);
            reap(&main_status, &main_done);
            empty = !other_children();
        }
        if (empty && (eof || after_ms >= 2000))
            break; /* (a pipe end passed to a process outside the job is not waited for long) */
        if (!empty && after_ms >= 60000) {
            fprintf(stderr, "colo-shim: processes of the job are still there after 60 s\n");
            break;
        }
        if (eof || r == 0) {
            sleep_ms(eof ? 20 : 0);
            after_ms += eof ? 20 : 100;
        }
    }
    for (int k = 0; k < 2; k++) { /* whatever is still in the pipes */
        while (!peof[k]) {
            struct pollfd p = {pfd[k], POLLIN, 0};
            if (poll(&p, 1, 0) <= 0)
                break;
            ssize_t n = read(pfd[k], buf, sizeof buf);
            if (n <= 0)
                break;
            relay(buf, (size_t)n);
            to_writer(k, buf, (size_t)n);
        }
    }
    if (writer > 0) { /* the files get the rest, then the writer ends: up to 30 s */
        if (w_out >= 0)
            close(w_out);
        if (w_err >= 0)
            close(w_err);
        w_out = w_err = -1;
        for (int waited = 0; writer_status < 0 && waited < 30000; waited += 20) {
            int st;
            pid_t p = waitpid(writer, &st, WNOHANG);
            if (p == writer)
                writer_status = st;
            else if (p < 0)
                break;
            else
                sleep_ms(20);
        }
        if (writer_status < 0) {
            kill(writer, SIGKILL);
            waitpid(writer, NULL, 0);
            note("\n[colo: the output writer did not finish within 30 s: --output/--error may lack the end]\n");
        } else if (!WIFEXITED(writer_status) || WEXITSTATUS(writer_status) != 0) {
            note("\n[colo: --output/--error could not be written in full (disk full, over quota, or the writer "
                 "was killed); colo logs has it all]\n");
        }
    }
    char reason[1024] = "";
    fcntl(err[0], F_SETFL, O_NONBLOCK);
    ssize_t rn = read(err[0], reason, sizeof reason - 1);
    reason[rn > 0 ? rn : 0] = '\0';
    for (char *c = reason; *c; c++)
        if (*c == '\n')
            *c = ' ';
    int code = WIFEXITED(main_status) ? WEXITSTATUS(main_status) : 128 + WTERMSIG(main_status);
    write_status(exitfile, code, reason);
    for (int k = 0; k < ncgroups; k++)
        rmdir(cgroups[k]);
    return code;
}
