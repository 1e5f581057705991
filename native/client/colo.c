/* colo: the command users run, installed as bin/colo (docs/fastcli.md).
 *
 * The hot commands (ls, show, cancel, submit, logs, wait) go to a per-user command server, a Python
 * process that has colo's CLI imported already (colo/cli/fastserve.py), as Mercurial's chg does:
 * this sends its argv, environment, umask, signal dispositions and identity, and hands over its
 * stdin, stdout, stderr and current directory (SCM_RIGHTS); a child of the server runs
 * colo.cli.entry's command() on them, and its exit status comes back here. Everything else, and
 * every failure before the child says it started, execs the Python script beside this file
 * (colo-py) with the same argv: the same behaviour, only slower. COLO_FAST=0 turns the server off.
 *
 * Safety: the socket lives in a directory only this user owns (checked with lstat: not a link,
 * owner, mode), and the server's SO_PEERCRED uid must be ours before anything is sent.
 * Plain C and libc only.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

/* Records both ways: two native int32s (type, value). Keep in step with colo/cli/fastserve.py. */
enum { STARTED = 1, EXITED = 2, SIGNALLED = 3, REFUSED = 4, STALE = 5, FORWARD = 6 };
#define MAGIC "COLOFAST1"
#define SCRIPT "colo-py"
static const char *const HOT[] = {"ls", "show", "cancel", "submit", "logs", "wait", "explain", "history", "gpus", NULL};
static const int FORWARDED[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGTSTP, SIGCONT, 0};

static char script[PATH_MAX];

/* A growing byte buffer; on allocation failure `bad` is set and the fast path is given up. */
struct buf { char *p; size_t n, cap; int bad; };

static void put(struct buf *b, const void *s, size_t n) {
    if (b->bad) return;
    if (b->n + n + 1 > b->cap) {
        size_t cap = (b->n + n + 1) * 2;
        char *p = realloc(b->p, cap);
        if (!p) { b->bad = 1; return; }
        b->p = p, b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}
static void puts0(struct buf *b, const char *s) { put(b, s, strlen(s) + 1); }
static void putf(struct buf *b, const char *fmt, unsigned long long v) {
    char t[64];
    int n = snprintf(t, sizeof t, fmt, v);
    put(b, t, (size_t)n);
}

static void fallback(char **argv) {
    argv[0] = script;
    execv(script, argv);
    fprintf(stderr, "colo: cannot run %s: %s\n", script, strerror(errno));
    exit(127);
}

static int hot(const char *cmd) {
    for (int i = 0; HOT[i]; i++)
        if (!strcmp(cmd, HOT[i])) return 1;
    return 0;
}

static int want_env(const char *e) {
    return !strncmp(e, "PYTHON", 6) || !strncmp(e, "LC_", 3) || !strncmp(e, "LANG=", 5) ||
           !strncmp(e, "LANGUAGE=", 9) || !strncmp(e, "HOME=", 5);
}

static int cmp(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }
static int cmpgid(const void *a, const void *b) {
    gid_t x = *(const gid_t *)a, y = *(const gid_t *)b;
    return x < y ? -1 : x > y;
}

/* What makes a fresh interpreter behave differently: the script (and so the install), who we
 * are, our limits and niceness, and the variables Python reads as it starts. The server makes the
 * same text of itself (fastserve.identity) and serves only an equal one; its hash names the socket. */
static void identity(struct buf *b) {
    put(b, "script=", 7), put(b, script, strlen(script));
    putf(b, "\nuid=%llu", getuid()), putf(b, "\ngid=%llu", getgid());
    gid_t g[NGROUPS_MAX + 1];
    int ng = getgroups(NGROUPS_MAX + 1, g);
    if (ng < 0) { b->bad = 1; return; }
    qsort(g, (size_t)ng, sizeof g[0], cmpgid);
    put(b, "\ngroups=", 8);
    for (int i = 0; i < ng; i++) putf(b, i ? ",%llu" : "%llu", g[i]);
    errno = 0;
    int nice = getpriority(PRIO_PROCESS, 0);
    if (errno) { b->bad = 1; return; }
    char t[32];
    snprintf(t, sizeof t, "\nnice=%d", nice), put(b, t, strlen(t));
    put(b, "\nlimits=", 8);
    for (int i = 0; i < 16; i++) {  /* Linux's RLIMIT_CPU (0) to RLIMIT_RTTIME (15), in order */
        struct rlimit r;
        if (getrlimit((__rlimit_resource_t)i, &r)) { b->bad = 1; return; }
        if (r.rlim_cur == RLIM_INFINITY) put(b, "inf", 3); else putf(b, "%llu", r.rlim_cur);
        put(b, ":", 1);
        if (r.rlim_max == RLIM_INFINITY) put(b, "inf", 3); else putf(b, "%llu", r.rlim_max);
        put(b, ",", 1);
    }
    size_t n = 0;
    for (char **e = environ; *e; e++) n++;
    char **v = malloc((n + 1) * sizeof *v);
    if (!v) { b->bad = 1; return; }
    size_t k = 0;
    for (char **e = environ; *e; e++)
        if (want_env(*e)) v[k++] = *e;
    qsort(v, k, sizeof *v, cmp);
    for (size_t i = 0; i < k; i++) put(b, "\nenv=", 5), put(b, v[i], strlen(v[i]));
    free(v);
}

static uint64_t fnv1a(const char *s, size_t n) {
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)s[i]) * 1099511628211ULL;
    return h;
}

/* A directory that is ours alone: made 0700 if missing, then lstat: a directory (not a link),
 * ours, nobody else may enter. Anything else (another user made it first): no fast path. */
static int own_dir(const char *d) {
    struct stat st;
    if (mkdir(d, 0700) && errno != EEXIST) return 0;
    return !lstat(d, &st) && S_ISDIR(st.st_mode) && st.st_uid == getuid() && !(st.st_mode & 077);
}

static int sock_dir(char *out, size_t cap) {
    const char *xdg = getenv("XDG_RUNTIME_DIR");
    struct stat st;
    if (xdg && xdg[0] == '/' && !lstat(xdg, &st) && S_ISDIR(st.st_mode) && st.st_uid == getuid() &&
        !(st.st_mode & 022)) {
        if ((size_t)snprintf(out, cap, "%s/colo-fast", xdg) < cap && own_dir(out)) return 1;
    }
    if ((size_t)snprintf(out, cap, "/tmp/colo-fast-%llu", (unsigned long long)getuid()) >= cap) return 0;
    return own_dir(out);
}

static void close_from(int low) {
#ifdef SYS_close_range
    if (syscall(SYS_close_range, low, ~0U, 0) == 0) return;
#endif
    DIR *d = opendir("/proc/self/fd");
    if (!d) return;
    int dfd = dirfd(d);
    for (struct dirent *e; (e = readdir(d));) {
        int fd = atoi(e->d_name);
        if (fd >= low && fd != dfd) close(fd);
    }
    closedir(d);
}

/* The server, detached (its own session, no terminal, in /), started with our environment, so
 * that its identity is ours; this call goes on by the Python path meanwhile. */
static void spawn(const char *sock) {
    pid_t p = fork();
    if (p < 0) return;
    if (p == 0) {
        if (setsid() < 0 || fork() != 0) _exit(0);
        int fd = open("/dev/null", O_RDWR);
        if (fd < 0) _exit(0);
        dup2(fd, 0), dup2(fd, 1), dup2(fd, 2);
        close_from(3);  /* nothing of our caller's (a pipe someone waits on) held for minutes */
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        for (int s = 1; s < NSIG; s++) signal(s, SIG_DFL);  /* (an ignored one would carry over) */
        if (chdir("/")) _exit(0);
        char *argv[] = {script, "--colo-fast-server", (char *)sock, NULL};
        execv(script, argv);
        _exit(0);
    }
    waitpid(p, NULL, 0);
}

static volatile sig_atomic_t pending[NSIG];
static void on_signal(int s) { pending[s] = 1; }

static int send_all(int fd, const char *p, size_t n) {
    while (n) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return -1;
        p += w, n -= (size_t)w;
    }
    return 0;
}

static int forward(int fd, int sig) {
    int32_t rec[2] = {FORWARD, sig};
    return send_all(fd, (const char *)rec, sizeof rec);
}

/* sig with its default action, now (a stop returns once continued, with sig blocked again) */
static void raise_default(int sig) {
    signal(sig, SIG_DFL);
    sigset_t s;
    sigemptyset(&s);
    sigaddset(&s, sig);
    sigprocmask(SIG_UNBLOCK, &s, NULL);
    raise(sig);
    sigprocmask(SIG_BLOCK, &s, NULL);
}

static void catch(int sig) {
    struct sigaction act = {.sa_handler = on_signal};
    sigemptyset(&act.sa_mask);
    sigaction(sig, &act, NULL);
}

static void die_by(int sig) {
    raise_default(sig);
    exit(128 + sig);
}

int main(int argc, char **argv) {
    (void)argc;
    char self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) { fprintf(stderr, "colo: cannot read /proc/self/exe: %s\n", strerror(errno)); return 127; }
    self[n] = 0;
    char *slash = strrchr(self, '/');
    *slash = 0;
    if ((size_t)snprintf(script, sizeof script, "%s/%s", self, SCRIPT) >= sizeof script) {
        fprintf(stderr, "colo: path too long\n");
        return 127;
    }
    const char *fast = getenv("COLO_FAST");
    if (!argv[1] || !hot(argv[1]) || (fast && !strcmp(fast, "0")) || getuid() != geteuid() ||
        getgid() != getegid())
        fallback(argv);
    for (int fd = 0; fd < 3; fd++)
        if (fcntl(fd, F_GETFD) < 0) fallback(argv);  /* a closed one cannot be handed over */

    struct buf id = {0}, req = {0};
    identity(&id);
    char dir[PATH_MAX - 40];
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (id.bad || !sock_dir(dir, sizeof dir)) fallback(argv);
    if ((size_t)snprintf(sa.sun_path, sizeof sa.sun_path, "%s/%016llx.sock", dir,
                         (unsigned long long)fnv1a(id.p, id.n)) >= sizeof sa.sun_path)
        fallback(argv);
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s < 0) fallback(argv);
    if (connect(s, (struct sockaddr *)&sa, sizeof sa)) {
        close(s);
        if (errno == ENOENT || errno == ECONNREFUSED) spawn(sa.sun_path);
        fallback(argv);
    }
    struct ucred cr;
    socklen_t cl = sizeof cr;
    if (getsockopt(s, SOL_SOCKET, SO_PEERCRED, &cr, &cl) || cr.uid != getuid()) fallback(argv);
    int cwd = open(".", O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (cwd < 0) fallback(argv);

    /* The request: u32 length, then NUL-ended fields: magic, identity, script, umask, ignored
     * signals, blocked signals, argc, argv[1..], then the environment. */
    mode_t um = umask(0);
    umask(um);
    unsigned long long ign = 0, blocked = 0;
    sigset_t mask;
    sigprocmask(SIG_SETMASK, NULL, &mask);
    for (int sig = 1; sig < NSIG && sig <= 64; sig++) {
        struct sigaction sa0;
        if (!sigaction(sig, NULL, &sa0) && sa0.sa_handler == SIG_IGN) ign |= 1ULL << (sig - 1);
        if (sigismember(&mask, sig) == 1) blocked |= 1ULL << (sig - 1);
    }
    uint32_t len = 0;
    put(&req, &len, sizeof len);
    puts0(&req, MAGIC);
    puts0(&req, id.p);
    puts0(&req, script);
    putf(&req, "%llo", um), put(&req, "", 1);
    putf(&req, "%llu", ign), put(&req, "", 1);
    putf(&req, "%llu", blocked), put(&req, "", 1);
    int nargs = 0;
    while (argv[nargs + 1]) nargs++;
    putf(&req, "%llu", (unsigned long long)nargs), put(&req, "", 1);
    for (int i = 1; i <= nargs; i++) puts0(&req, argv[i]);
    for (char **e = environ; *e; e++) puts0(&req, *e);
    if (req.bad || req.n - sizeof len > UINT32_MAX) fallback(argv);
    len = (uint32_t)(req.n - sizeof len);
    memcpy(req.p, &len, sizeof len);

    /* Signals we would get are the child's: caught from here on, sent on (ppoll below). */
    sigset_t block, old;
    sigemptyset(&block);
    for (int i = 0; FORWARDED[i]; i++) sigaddset(&block, FORWARDED[i]);
    sigprocmask(SIG_BLOCK, &block, &old);
    for (int i = 0; FORWARDED[i]; i++) {
        struct sigaction cur;
        /* one we ignore stays ignored (as the Python path would have it) */
        if (!sigaction(FORWARDED[i], NULL, &cur) && cur.sa_handler != SIG_IGN) catch(FORWARDED[i]);
    }

    int fds[4] = {0, 1, 2, cwd};
    char cbuf[CMSG_SPACE(sizeof fds)];
    memset(cbuf, 0, sizeof cbuf);
    struct iovec iov = {.iov_base = req.p, .iov_len = req.n};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof cbuf};
    struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
    cm->cmsg_level = SOL_SOCKET, cm->cmsg_type = SCM_RIGHTS, cm->cmsg_len = CMSG_LEN(sizeof fds);
    memcpy(CMSG_DATA(cm), fds, sizeof fds);
    ssize_t w;
    do w = sendmsg(s, &mh, MSG_NOSIGNAL); while (w < 0 && errno == EINTR);
    if (w <= 0 || send_all(s, req.p + w, req.n - (size_t)w)) goto give_up;
    close(cwd);

    int started = 0, sent_sig = 0;
    int32_t rec[2];
    size_t got = 0;
    for (;;) {
        for (int sig = 1; sig < NSIG; sig++) {
            if (!pending[sig]) continue;
            pending[sig] = 0;
            /* a stop: the child's group is orphaned (TSTP would be dropped), so it gets STOP; then us */
            if (forward(s, sig == SIGTSTP ? SIGSTOP : sig) == 0 && sig != SIGCONT) sent_sig = sig;
            if (sig == SIGTSTP) {
                raise_default(SIGTSTP);
                catch(SIGTSTP);
                sent_sig = 0;
            }
        }
        struct pollfd pf = {.fd = s, .events = POLLIN};
        int r = ppoll(&pf, 1, NULL, &old);
        if (r < 0) {
            if (errno == EINTR) continue;
            break;
        }
        ssize_t k = recv(s, (char *)rec + got, sizeof rec - got, 0);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) break;
        got += (size_t)k;
        if (got < sizeof rec) continue;
        got = 0;
        if (rec[0] == STARTED) { started = 1; continue; }
        if (!started && sent_sig) die_by(sent_sig);  /* stopped before it began: as if it had run */
        if (!started) goto give_up;                     /* refused, stale, or the child never began */
        if (rec[0] == EXITED) return rec[1];
        if (rec[0] == SIGNALLED) die_by(rec[1]);
        break;
    }
    if (!started) {
        if (sent_sig) die_by(sent_sig);
        goto give_up;
    }
    fprintf(stderr, "colo: the command server went away (COLO_FAST=0 runs colo without it)\n");
    return 255;

give_up:
    close(s);
    sigprocmask(SIG_SETMASK, &old, NULL);
    for (int i = 0; FORWARDED[i]; i++) {
        struct sigaction cur;
        if (!sigaction(FORWARDED[i], NULL, &cur) && cur.sa_handler == on_signal) signal(FORWARDED[i], SIG_DFL);
    }
    fallback(argv);
    return 127;
}
