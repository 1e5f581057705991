/* Fake nvidia-cuda-mps-control.
 *
 *   nvidia-cuda-mps-control -d     start the control daemon in the background (-f: foreground)
 *   echo CMD | nvidia-cuda-mps-control
 *                                  send commands, one per line, print each reply
 *
 * The daemon listens on $CUDA_MPS_PIPE_DIRECTORY/control (a Unix socket; default /tmp/nvidia-mps)
 * and logs to $CUDA_MPS_LOG_DIRECTORY/control.log. Its "server" is a forked process that holds a
 * slot (kind MPS server, a context on each of the daemon's devices) in the state file named by
 * COLO_FAKEGPU_STATE, so NVML lists it as the real one is listed. CUDA clients (the fake
 * libcuda at cuInit) keep a connection to the daemon while they live; their uid and pid come from
 * SO_PEERCRED. One server at a time: a client of another uid waits until the current server has
 * no clients left, unless COLO_FAKEGPU_MPS_MULTIUSER=1 was set for the daemon. Like the real one,
 * a server runs as its client's uid and first connects back to the control socket, so a uid that
 * cannot reach the pipe directory gets no server. No command checks its sender's uid (NVIDIA
 * documents no such check either): who can reach the socket decides. Test-only command:
 * `fake_fault SERVER_PID`. See native/README.md. */
#include "fakegpu.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <pwd.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAX_CONNS 512
enum { C_NEW, C_CTL, C_CLIENT };
enum { W_WAITING, W_ATTACHED, W_ORPHAN };
enum { ERR_CONNECTION_FAILED = 805, ERR_SERVER_NOT_READY = 807, ERR_MAX_CLIENTS = 808 };

struct conn {
    int fd, type, wait;
    char buf[1024];
    size_t len;
    uid_t uid;
    pid_t pid;          /* in the daemon's pid namespace (SO_PEERCRED) */
    int slot;
    uint32_t gen;
    int server;         /* pid of the server it is attached to */
};

struct server {
    pid_t pid;
    uid_t uid;
    int fd;             /* our end of a socketpair: EOF either way means the other side is gone */
    int fault;
    double atp;
    uint64_t limit[FG_MAX_DEV];
    int nclients;
};

static fg_state S;
static struct conn conns[MAX_CONNS];
static int nconns;
static struct server srv;
static int have_srv;
static int listen_fd = -1;
static int g_vis[FG_MAX_DEV], g_nvis;
static double def_atp = 100;
static uint64_t def_limit[FG_MAX_DEV];
static int multiuser, max_clients = 48;
static FILE *logf;
static volatile sig_atomic_t stop_flag;
static char sock_path[108], pid_path[4096];

static void logmsg(const char *fmt, ...)
{
    if (!logf)
        return;
    time_t t = time(NULL);
    char ts[64];
    strftime(ts, sizeof ts, "%Y-%m-%d %H:%M:%S", localtime(&t));
    fprintf(logf, "[%s] ", ts);
    va_list ap;
    va_start(ap, fmt);
    vfprintf(logf, fmt, ap);
    va_end(ap);
    fputc('\n', logf);
    fflush(logf);
}

static const char *pipe_dir(void)
{
    const char *d = getenv("CUDA_MPS_PIPE_DIRECTORY");
    return d && *d ? d : "/tmp/nvidia-mps";
}

static void mkdirs(const char *path, mode_t mode)
{
    char p[4096];
    snprintf(p, sizeof p, "%s", path);
    for (char *s = p + 1; *s; s++)
        if (*s == '/') {
            *s = 0;
            mkdir(p, mode);
            *s = '/';
        }
    mkdir(p, mode);
}

static void send_all(int fd, const char *s, size_t n)
{
    while (n) {
        ssize_t w = write(fd, s, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0 && errno == EAGAIN) { /* connections are non-blocking; replies are small */
            struct pollfd p = {.fd = fd, .events = POLLOUT};
            if (poll(&p, 1, 1000) <= 0)
                return;
            continue;
        }
        if (w <= 0)
            return;
        s += w;
        n -= (size_t)w;
    }
}

static void fmt_size(uint64_t b, char *out, size_t n)
{
    if (b == 0)
        snprintf(out, n, "0");
    else if (b % (1ull << 30) == 0)
        snprintf(out, n, "%lluG", (unsigned long long)(b >> 30));
    else
        snprintf(out, n, "%lluM", (unsigned long long)((b + (1ull << 20) - 1) >> 20));
}

/* ---- the server process -------------------------------------------------------------------- */

static void server_main(int fd, uid_t uid)
{
    fg_close(&S);
    for (int i = 3; i < 4096; i++)
        if (i != fd)
            close(i);
    if (geteuid() == 0 && uid != 0) {
        struct passwd *pw = getpwuid(uid);
        gid_t gid = pw ? pw->pw_gid : (gid_t)uid;
        if (setgroups(0, NULL) != 0 || setgid(gid) != 0 || setuid(uid) != 0)
            _exit(3);
    }
    prctl(PR_SET_NAME, "nvidia-cuda-mps", 0, 0, 0);
    /* As the real server does, now running as the client's uid: connect back to the control
     * socket. A uid that cannot reach the pipe directory gets no server (its client: 805). */
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    snprintf(a.sun_path, sizeof a.sun_path, "%s/control", pipe_dir());
    int back = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (back < 0 || connect(back, (struct sockaddr *)&a, sizeof a) != 0) {
        send_all(fd, "E", 1);
        _exit(6);
    }
    close(back);
    if (fg_open(&S, NULL) != 0)
        _exit(4);
    int ok = 1;
    fg_lock(&S);
    fg_reap(&S);
    uint32_t mask = 0;
    for (int o = 0; o < g_nvis; o++) {
        int d = g_vis[o];
        mask |= 1u << d;
        if (S.h->dev[d].compute_mode == FG_MODE_PROHIBITED)
            ok = 0;
        if (S.h->dev[d].compute_mode == FG_MODE_EXCLUSIVE_PROCESS) /* the server is "the" process */
            for (uint32_t i = 0; i < S.h->hwm; i++)
                if (S.h->slot[i].state == FG_SLOT_LIVE && (S.h->slot[i].ctx_mask & (1u << d)) &&
                    S.h->slot[i].kind != FG_KIND_MPS_CLIENT)
                    ok = 0;
    }
    int slot = ok ? fg_claim_slot(&S, FG_KIND_MPS_SERVER) : -1;
    if (slot >= 0)
        S.h->slot[slot].ctx_mask = mask;
    fg_unlock(&S);
    send_all(fd, slot >= 0 ? "R" : "E", 1);
    if (slot < 0)
        _exit(5);
    char c;
    for (;;) { /* until the daemon closes its end or dies */
        ssize_t r = read(fd, &c, 1);
        if (r == 0 || (r < 0 && errno != EINTR))
            break;
    }
    fg_lock(&S);
    fg_release_slot(&S, slot);
    fg_unlock(&S);
    fg_close(&S);
    _exit(0);
}

static int start_server(uid_t uid)
{
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0)
        return -1;
    pid_t pid = fork();
    if (pid < 0) {
        close(sv[0]);
        close(sv[1]);
        return -1;
    }
    if (pid == 0)
        server_main(sv[1], uid);
    close(sv[1]);
    char c = 0;
    ssize_t r;
    do
        r = read(sv[0], &c, 1);
    while (r < 0 && errno == EINTR);
    if (r != 1 || c != 'R') {
        close(sv[0]);
        waitpid(pid, NULL, 0);
        logmsg("server for uid %u failed to start", (unsigned)uid);
        return -1;
    }
    srv = (struct server){.pid = pid, .uid = uid, .fd = sv[0], .atp = def_atp};
    memcpy(srv.limit, def_limit, sizeof srv.limit);
    have_srv = 1;
    logmsg("server %d started for uid %u", (int)pid, (unsigned)uid);
    return 0;
}

static void stop_server(void)
{
    if (!have_srv)
        return;
    close(srv.fd);
    waitpid(srv.pid, NULL, 0);
    logmsg("server %d exited", (int)srv.pid);
    have_srv = 0;
}

/* ---- clients ------------------------------------------------------------------------------- */

static struct fg_slot *client_slot(struct conn *c)
{
    if (c->slot < 0 || (uint32_t)c->slot >= S.h->nslots)
        return NULL;
    struct fg_slot *sl = &S.h->slot[c->slot];
    return sl->state == FG_SLOT_LIVE && sl->gen == c->gen ? sl : NULL;
}

static void set_client_flag(struct conn *c, uint32_t flag)
{
    fg_lock(&S);
    struct fg_slot *sl = client_slot(c);
    if (sl) {
        __atomic_or_fetch(&sl->flags, flag, __ATOMIC_RELEASE);
        if (flag == FG_F_TERMINATED) { /* the server frees what the client held */
            fg_slot_drop_memory(&S, c->slot);
            sl->ctx_mask = 0;
        }
    }
    fg_unlock(&S);
}

static void drop_conn(int i)
{
    close(conns[i].fd);
    memmove(&conns[i], &conns[i + 1], (size_t)(nconns - i - 1) * sizeof conns[0]);
    nconns--;
}

static void reply_client(struct conn *c, const char *fmt, ...)
{
    char b[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(b, sizeof b, fmt, ap);
    va_end(ap);
    send_all(c->fd, b, strlen(b));
}

/* Give servers to waiting clients, in arrival order. */
static void schedule(void)
{
    if (have_srv && srv.fault && srv.nclients == 0) {
        srv.fault = 0;
        logmsg("server %d recovered from FAULT", (int)srv.pid);
    }
    for (int i = 0; i < nconns; i++) {
        struct conn *c = &conns[i];
        if (c->type != C_CLIENT || c->wait != W_WAITING)
            continue;
        uid_t uid = multiuser ? geteuid() : c->uid;
        if (have_srv && srv.uid != uid) {
            if (srv.nclients > 0)
                break; /* the other user's server must drain first */
            stop_server();
        }
        int err = 0;
        if (!have_srv && start_server(uid) != 0)
            err = ERR_CONNECTION_FAILED;
        else if (srv.fault)
            err = ERR_SERVER_NOT_READY;
        else if (srv.nclients >= max_clients)
            err = ERR_MAX_CLIENTS;
        if (err) {
            reply_client(c, "ERR %d\n", err);
            logmsg("client %d refused: %d", (int)c->pid, err);
            drop_conn(i--);
            continue;
        }
        char lim[FG_MAX_DEV * 24] = "";
        for (uint32_t d = 0; d < S.h->ndev; d++)
            snprintf(lim + strlen(lim), sizeof lim - strlen(lim), " %llu", (unsigned long long)srv.limit[d]);
        reply_client(c, "OK %d %d%s\n", (int)srv.pid, (int)(srv.atp + 0.5), lim);
        c->wait = W_ATTACHED;
        c->server = srv.pid;
        srv.nclients++;
        logmsg("client %d (uid %u) attached to server %d", (int)c->pid, (unsigned)c->uid, (int)srv.pid);
    }
}

static void client_hello(struct conn *c, const char *line)
{
    int slot, nspid;
    unsigned gen;
    unsigned long long ns;
    if (sscanf(line, "CLIENT %d %u %llu %d", &slot, &gen, &ns, &nspid) != 4) {
        c->type = C_CTL; /* not a client: treat as a (broken) control connection */
        return;
    }
    struct ucred cr;
    socklen_t len = sizeof cr;
    c->type = C_CLIENT;
    c->wait = W_WAITING;
    c->slot = slot;
    c->gen = gen;
    c->uid = 0;
    c->pid = nspid;
    if (getsockopt(c->fd, SOL_SOCKET, SO_PEERCRED, &cr, &len) == 0) {
        c->uid = cr.uid;
        if (cr.pid > 0)
            c->pid = cr.pid;
    }
}

static void client_gone(int i)
{
    struct conn *c = &conns[i];
    if (c->wait == W_ATTACHED && have_srv && c->server == srv.pid)
        srv.nclients--;
    logmsg("client %d disconnected", (int)c->pid);
    drop_conn(i);
}

/* ---- control commands ------------------------------------------------------------------------ */

static int dev_arg(const char *s)
{
    char *end;
    long v = strtol(s, &end, 10);
    return (*end || v < 0 || v >= g_nvis) ? -1 : g_vis[v];
}

static struct conn *find_client(int server, int pid)
{
    for (int i = 0; i < nconns; i++)
        if (conns[i].type == C_CLIENT && conns[i].wait == W_ATTACHED && conns[i].server == server &&
            conns[i].pid == pid)
            return &conns[i];
    return NULL;
}

/* Runs one command line; appends the reply to out. Returns 1 for quit. */
static int command(const char *line, char *out, size_t n)
{
    char cmd[64] = "", a[64] = "", b[64] = "", c3[64] = "";
    int k = sscanf(line, "%63s %63s %63s %63s", cmd, a, b, c3);
    int spid = atoi(a);
    int is_srv = have_srv && spid == srv.pid;
    double pct;
    uint64_t size;
    char sz[32];
    out[0] = 0;
    logmsg("command: %s", line);
    if (k < 1)
        return 0;
    if (!strcmp(cmd, "quit"))
        return 1;
    if (!strcmp(cmd, "get_server_list")) {
        if (have_srv)
            snprintf(out, n, "%d\n", (int)srv.pid);
    } else if (!strcmp(cmd, "get_server_status") && k >= 2) {
        snprintf(out, n, "%s\n", is_srv ? (srv.fault ? "FAULT" : "ACTIVE") : "NOT FOUND");
    } else if (!strcmp(cmd, "start_server") && k >= 3 && !strcmp(a, "-uid")) {
        uid_t uid = (uid_t)atoi(b);
        if (have_srv && srv.uid != uid && srv.nclients == 0)
            stop_server();
        if (have_srv && srv.uid != uid)
            snprintf(out, n, "Cannot start a server for uid %u: the server of uid %u has clients\n",
                     (unsigned)uid, (unsigned)srv.uid);
        else if (!have_srv && start_server(uid) != 0)
            snprintf(out, n, "Failed to start the server\n");
        schedule();
    } else if (!strcmp(cmd, "get_client_list") && k >= 2) {
        for (int i = 0; is_srv && i < nconns; i++)
            if (conns[i].type == C_CLIENT && conns[i].wait == W_ATTACHED && conns[i].server == spid)
                snprintf(out + strlen(out), n - strlen(out), "%d\n", (int)conns[i].pid);
    } else if (!strcmp(cmd, "set_default_active_thread_percentage") && k >= 2 &&
               (pct = atof(a)) > 0 && pct <= 100) {
        def_atp = pct;
        snprintf(out, n, "%.1f\n", def_atp);
    } else if (!strcmp(cmd, "get_default_active_thread_percentage")) {
        snprintf(out, n, "%.1f\n", def_atp);
    } else if (!strcmp(cmd, "set_active_thread_percentage") && k >= 3 && is_srv &&
               (pct = atof(b)) > 0 && pct <= 100) {
        srv.atp = pct; /* for clients created from now on */
        snprintf(out, n, "%.1f\n", srv.atp);
    } else if (!strcmp(cmd, "get_active_thread_percentage") && k >= 2 && is_srv) {
        snprintf(out, n, "%.1f\n", srv.atp);
    } else if (!strcmp(cmd, "set_default_device_pinned_mem_limit") && k >= 3 && dev_arg(a) >= 0 &&
               fg_parse_size(b, &size) == 0) {
        def_limit[dev_arg(a)] = size;
    } else if (!strcmp(cmd, "get_default_device_pinned_mem_limit") && k >= 2 && dev_arg(a) >= 0) {
        fmt_size(def_limit[dev_arg(a)], sz, sizeof sz);
        snprintf(out, n, "%s\n", sz);
    } else if (!strcmp(cmd, "set_device_pinned_mem_limit") && k >= 4 && is_srv && dev_arg(b) >= 0 &&
               fg_parse_size(c3, &size) == 0) {
        srv.limit[dev_arg(b)] = size;
    } else if (!strcmp(cmd, "get_device_pinned_mem_limit") && k >= 3 && is_srv && dev_arg(b) >= 0) {
        fmt_size(srv.limit[dev_arg(b)], sz, sizeof sz);
        snprintf(out, n, "%s\n", sz);
    } else if (!strcmp(cmd, "terminate_client") && k >= 3) {
        struct conn *cl = find_client(spid, atoi(b));
        if (cl)
            set_client_flag(cl, FG_F_TERMINATED);
        else
            snprintf(out, n, "Client %s of server %s not found\n", b, a);
    } else if (!strcmp(cmd, "fake_fault") && k >= 2 && is_srv) {
        srv.fault = 1; /* clients see the sticky error; new ones get 807 until all have exited */
        for (int i = 0; i < nconns; i++)
            if (conns[i].type == C_CLIENT && conns[i].wait == W_ATTACHED && conns[i].server == srv.pid)
                set_client_flag(&conns[i], FG_F_FAULT);
        logmsg("server %d entered FAULT", (int)srv.pid);
        schedule();
    } else {
        snprintf(out, n, "Invalid command or argument: %s\n", line);
    }
    return 0;
}

/* ---- daemon loop ----------------------------------------------------------------------------- */

static void on_signal(int sig) { (void)sig; stop_flag = 1; }

static void handle_input(int i, int *quit)
{
    struct conn *c = &conns[i];
    ssize_t r = read(c->fd, c->buf + c->len, sizeof c->buf - 1 - c->len);
    if (r < 0 && (errno == EINTR || errno == EAGAIN))
        return;
    if (r <= 0) {
        if (c->type == C_CLIENT)
            client_gone(i);
        else
            drop_conn(i);
        schedule();
        return;
    }
    c->len += (size_t)r;
    char *nl;
    while (c->type != C_CLIENT && (nl = memchr(c->buf, '\n', c->len))) {
        *nl = 0;
        if (c->type == C_NEW && !strncmp(c->buf, "CLIENT ", 7)) {
            client_hello(c, c->buf);
        } else {
            c->type = C_CTL;
            char out[16384];
            const char *line = !strncmp(c->buf, "CMD ", 4) ? c->buf + 4 : c->buf;
            *quit = command(line, out, sizeof out);
            send_all(c->fd, out, strlen(out) + 1); /* the NUL ends the reply */
        }
        size_t used = (size_t)(nl + 1 - c->buf);
        memmove(c->buf, nl + 1, c->len - used);
        c->len -= used;
    }
    if (c->type == C_CLIENT) {
        c->len = 0;
        schedule();
    } else if (c->len >= sizeof c->buf - 1) {
        drop_conn(i); /* a line that long is not ours */
    }
}

static void server_died(void)
{
    int status;
    close(srv.fd);
    waitpid(srv.pid, &status, 0);
    logmsg("server %d died", (int)srv.pid);
    for (int i = 0; i < nconns; i++)
        if (conns[i].type == C_CLIENT && conns[i].wait == W_ATTACHED && conns[i].server == srv.pid) {
            set_client_flag(&conns[i], FG_F_FAULT);
            conns[i].wait = W_ORPHAN;
        }
    have_srv = 0;
    schedule();
}

static void daemon_loop(void)
{
    int quit = 0;
    while (!quit && !stop_flag) {
        struct pollfd p[MAX_CONNS + 2];
        int np = 0;
        p[np++] = (struct pollfd){.fd = listen_fd, .events = POLLIN};
        int srv_at = -1;
        if (have_srv) {
            srv_at = np;
            p[np++] = (struct pollfd){.fd = srv.fd, .events = POLLIN};
        }
        int base = np;
        for (int i = 0; i < nconns; i++)
            p[np++] = (struct pollfd){.fd = conns[i].fd, .events = POLLIN};
        if (poll(p, (nfds_t)np, -1) < 0)
            continue; /* EINTR: stop_flag is checked above */
        if (srv_at >= 0 && p[srv_at].revents) {
            server_died();
            continue; /* the connection array may have changed */
        }
        /* handle_input may drop other connections: find each ready one again by its fd. */
        for (int j = base; j < np && !quit; j++) {
            if (!p[j].revents)
                continue;
            for (int i = 0; i < nconns; i++)
                if (conns[i].fd == p[j].fd) {
                    handle_input(i, &quit);
                    break;
                }
        }
        if (p[0].revents & POLLIN) {
            int fd = accept4(listen_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
            if (fd >= 0 && nconns < MAX_CONNS)
                conns[nconns++] = (struct conn){.fd = fd, .type = C_NEW, .slot = -1};
            else if (fd >= 0)
                close(fd);
        }
    }
    for (int i = nconns - 1; i >= 0; i--)
        drop_conn(i);
    stop_server();
    unlink(sock_path);
    unlink(pid_path);
    logmsg("control daemon exiting");
}

/* Set up the socket; *err gets a message on failure. */
static int daemon_setup(char *err, size_t n)
{
    if (fg_open(&S, NULL) != 0) {
        snprintf(err, n, "COLO_FAKEGPU_STATE does not name a simulated GPU state file");
        return -1;
    }
    g_nvis = fg_parse_visible(&S, getenv("CUDA_VISIBLE_DEVICES"), g_vis, ~0u); /* (root: every node opens) */
    const char *mu = getenv("COLO_FAKEGPU_MPS_MULTIUSER");
    multiuser = mu && *mu && strcmp(mu, "0") != 0;
    const char *mc = getenv("COLO_FAKEGPU_MPS_MAX_CLIENTS");
    if (mc && atoi(mc) > 0)
        max_clients = atoi(mc);
    const char *dir = pipe_dir();
    mkdirs(dir, 0755);
    const char *ld = getenv("CUDA_MPS_LOG_DIRECTORY");
    ld = ld && *ld ? ld : "/var/log/nvidia-mps";
    mkdirs(ld, 0755);
    char lp[4096];
    snprintf(lp, sizeof lp, "%s/control.log", ld);
    logf = fopen(lp, "ae");
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    if ((size_t)snprintf(a.sun_path, sizeof a.sun_path, "%s/control", dir) >= sizeof a.sun_path) {
        snprintf(err, n, "pipe directory path too long: %s", dir);
        return -1;
    }
    snprintf(sock_path, sizeof sock_path, "%s", a.sun_path);
    snprintf(pid_path, sizeof pid_path, "%s/nvidia-cuda-mps-control.pid", dir);
    int probe = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (probe >= 0 && connect(probe, (struct sockaddr *)&a, sizeof a) == 0) {
        close(probe);
        snprintf(err, n, "An instance of this daemon is already running");
        return -1;
    }
    if (probe >= 0)
        close(probe);
    unlink(sock_path);
    listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (listen_fd < 0 || bind(listen_fd, (struct sockaddr *)&a, sizeof a) != 0 ||
        chmod(sock_path, 0666) != 0 || listen(listen_fd, 128) != 0) {
        snprintf(err, n, "cannot listen on %s: %s", sock_path, strerror(errno));
        return -1;
    }
    FILE *pf = fopen(pid_path, "we");
    if (pf) {
        fprintf(pf, "%d\n", (int)getpid());
        fclose(pf);
    }
    struct sigaction sa = {.sa_handler = on_signal};
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    logmsg("control daemon started (pid %d, %d devices, multiuser %d)", (int)getpid(), g_nvis, multiuser);
    return 0;
}

static int run_daemon(int background)
{
    char err[512] = "";
    if (!background) {
        if (daemon_setup(err, sizeof err) != 0) {
            fprintf(stderr, "%s\n", err);
            return 1;
        }
        daemon_loop();
        return 0;
    }
    int pp[2];
    if (pipe2(pp, O_CLOEXEC) != 0)
        return 1;
    pid_t pid = fork();
    if (pid < 0)
        return 1;
    if (pid > 0) { /* return once the daemon listens (or say why it does not) */
        close(pp[1]);
        char msg[512] = "";
        ssize_t r = read(pp[0], msg, sizeof msg - 1);
        msg[r > 0 ? r : 0] = 0;
        if (strcmp(msg, "OK") != 0) {
            fprintf(stderr, "%s\n", msg[0] ? msg : "the control daemon failed to start");
            waitpid(pid, NULL, 0);
            return 1;
        }
        return 0;
    }
    close(pp[0]);
    setsid();
    int null = open("/dev/null", O_RDWR);
    if (null >= 0) {
        dup2(null, 0);
        dup2(null, 1);
        dup2(null, 2);
        if (null > 2)
            close(null);
    }
    /* Double fork so the daemon is not our caller's child (the caller may wait for its children). */
    pid_t d = fork();
    if (d != 0)
        _exit(d < 0);
    if (daemon_setup(err, sizeof err) != 0) {
        send_all(pp[1], err, strlen(err));
        _exit(1);
    }
    send_all(pp[1], "OK", 2);
    close(pp[1]);
    daemon_loop();
    _exit(0);
}

/* ---- command client -------------------------------------------------------------------------- */

static int run_client(void)
{
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    snprintf(a.sun_path, sizeof a.sun_path, "%s/control", pipe_dir());
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        fprintf(stderr, "Cannot find MPS control daemon process\n");
        return 1;
    }
    signal(SIGPIPE, SIG_IGN);
    char line[4096];
    while (fgets(line, sizeof line, stdin)) {
        line[strcspn(line, "\r\n")] = 0;
        char *s = line;
        while (*s == ' ' || *s == '\t')
            s++;
        if (!*s)
            continue;
        char msg[4200];
        int n = snprintf(msg, sizeof msg, "CMD %s\n", s);
        send_all(fd, msg, (size_t)n);
        char c;
        ssize_t r;
        while ((r = read(fd, &c, 1)) == 1 && c != 0)
            fputc(c, stdout);
        fflush(stdout);
        if (r != 1)
            break; /* the daemon quit */
    }
    close(fd);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc > 1 && !strcmp(argv[1], "-d"))
        return run_daemon(1);
    if (argc > 1 && !strcmp(argv[1], "-f"))
        return run_daemon(0);
    if (argc > 1) {
        fprintf(stderr, "usage: %s [-d | -f]   (commands on stdin)\n", argv[0]);
        return 2;
    }
    return run_client();
}
