/* colo_spank.so: colo as the per-node GPU-sharing layer under Slurm (a SPANK plugin).
 *
 *   plugstack.conf:  required /usr/lib/colo/colo_spank.so python=/opt/colo/bin/python3 \
 *                             socket=/run/colo/colo.sock [timeout=60]
 *   user option:     sbatch|srun --colo-profile=NAME   (the profile MPS/time-sliced is decided from)
 *
 * `%n` in socket= is the node's name (SLURMD_NODENAME), as in slurm.conf's SlurmdSpoolDir: several
 * slurmd on one host (a test cluster) reach one colo daemon each.
 *
 * Why SPANK and not TaskProlog/Prolog/Epilog scripts: the hooks colo needs run as root inside
 * slurmstepd at the points that matter. init_post_opt runs once per step before any task exists,
 * as root, and spank_setenv puts the interposer, ledger, budget, GPU and MPS pipe into every task's
 * environment (a TaskProlog runs as the user, once per task, and can only print exports);
 * task_exit runs the moment the batch script ends, while the job's other processes still live, so
 * colo can send terminate_client before Slurm's SIGKILL (an Epilog runs only after every process
 * of the job is gone); and --colo-profile is a real, checked sbatch option.
 *
 * Python runs only for jobs that asked for a GPU: a step whose environment, as slurmstepd made it,
 * has none of Slurm's GPU variables (SLURM_SHARDS_ON_NODE for colo's `gres/shard`, SLURM_STEP_GPUS /
 * SLURM_JOB_GPUS for `gres/gpu`) is left as it is, decided here in C, and so is the epilog of a job
 * with no SLURM_JOB_GPUS (slurmd sets it for both). A user who sets one of them in a CPU job only
 * makes the helper ask slurmctld, which says the job has no GPU.
 *
 * A step colo does not run (its GPU cannot hold it now: the helper requeued the job; or an error)
 * fails in task_init, before exec, with colo's reason on the job's stderr (failing init_post_opt
 * instead would make Slurm drain the node).
 *
 * The plugin itself decides nothing. A job's first step on a node runs colo's helper (`python -I -m
 * colo.cli.slurm attach`) with an empty environment and explicit arguments taken from Slurm (never
 * from the job's environment, which the user controls), reads `env NAME=VALUE` / `error TEXT` lines
 * from it, and gives up after `timeout` seconds; the helper asks slurmctld for the job's allocation
 * and talks to the node's colo daemon as root. The batch script's end and the job's end carry only
 * Slurm's ids and the script's wait status, so the plugin sends them to the daemon itself (one line
 * each, colo/protocol.py SLURM_WIRE): one Python start per job, not three. It does so only to a
 * socket in a root-owned folder no one else may write, answered by a root peer, within bounded
 * times; where it cannot reach the daemon it runs the helper as before (with --lost when the
 * daemon went away in the middle of the request, so the helper waits for it to be back).
 *
 * timing=FILE (for bench/slurm_bench.py): each hook that did colo's work appends
 * `HOOK job=J seconds=S python=0|1` to FILE (root's; never followed if a symlink). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <slurm/slurm.h>
#include <slurm/spank.h>

SPANK_PLUGIN(colo, 1);

#define OUT_MAX 65536
#define MAX_ARGS 24

static char g_python[512] = "/usr/bin/python3";
static char g_socket[512] = ""; /* may hold %n: the node's name */
static char g_slurm_conf[512] = ""; /* for scontrol in the helper; Slurm's default when empty */
static int g_timeout = 60;
static char g_timing[512] = ""; /* timing=FILE: a line per hook (bench/slurm_bench.py) */
static char g_profile[128] = "";
/* Why colo could not place this step, kept from init_post_opt (in slurmstepd) to task_init (in each
 * forked task): failing init_post_opt itself would make Slurm drain the node ("batch job complete
 * failure") and report the job as completed; failing the task fails only the job, with the line. */
static char g_refused[1024] = "";
static int g_placed; /* this step's job has a place in colo (so its batch exit concerns colo) */

/* colo's rule for profile names (colo/daemon/validate.py NAME), checked where sbatch/srun parse the
 * option, so a bad name is refused at submit rather than when the step starts. */
static int profile_name_ok(const char *s)
{
    size_t n = strlen(s);
    if (n == 0 || n > 64 || !isalnum((unsigned char)s[0]))
        return 0;
    for (size_t i = 0; i < n; i++)
        if (!isalnum((unsigned char)s[i]) && !strchr("._-", s[i]))
            return 0;
    return 1;
}

static int opt_profile(int val, const char *optarg, int remote)
{
    (void)val;
    (void)remote;
    if (!optarg || !profile_name_ok(optarg)) {
        slurm_error("colo: --colo-profile=%s: a profile name is 1-64 letters, digits, '.', '_' or '-', "
                    "starting with a letter or digit", optarg ? optarg : "");
        return -1;
    }
    snprintf(g_profile, sizeof g_profile, "%s", optarg);
    return 0;
}

static struct spank_option colo_opts[] = {
    {"colo-profile", "NAME", "colo: the stored profile to decide MPS or time-sliced from", 1, 0, opt_profile},
    SPANK_OPTIONS_TABLE_END,
};

static void parse_args(int ac, char **av)
{
    for (int i = 0; i < ac; i++) {
        if (!strncmp(av[i], "python=", 7))
            snprintf(g_python, sizeof g_python, "%s", av[i] + 7);
        else if (!strncmp(av[i], "socket=", 7))
            snprintf(g_socket, sizeof g_socket, "%s", av[i] + 7);
        else if (!strncmp(av[i], "slurm_conf=", 11))
            snprintf(g_slurm_conf, sizeof g_slurm_conf, "%s", av[i] + 11);
        else if (!strncmp(av[i], "timing=", 7))
            snprintf(g_timing, sizeof g_timing, "%s", av[i] + 7);
        else if (!strncmp(av[i], "timeout=", 8) && atoi(av[i] + 8) > 0)
            g_timeout = atoi(av[i] + 8);
        else
            slurm_error("colo: unknown plugstack.conf argument %s", av[i]);
    }
}

int slurm_spank_init(spank_t sp, int ac, char **av)
{
    parse_args(ac, av);
    for (struct spank_option *o = colo_opts; o->name; o++)
        if (spank_option_register(sp, o) != ESPANK_SUCCESS)
            slurm_error("colo: cannot register --%s", o->name);
    return 0;
}

/* The node's name as slurmd knows it (several slurmd on one host have different names). */
static const char *node_name(void)
{
    const char *n = getenv("SLURMD_NODENAME");
    return n && *n && strlen(n) < 200 ? n : NULL;
}

/* The node's colo socket, `%n` replaced by the node's name ("" when plugstack.conf gives none). */
static void socket_of_node(char *out, size_t outsz)
{
    const char *node = node_name();
    size_t k = 0;
    for (const char *c = g_socket; *c && k + 1 < outsz; c++) {
        if (c[0] == '%' && c[1] == 'n' && node) {
            k += snprintf(out + k, outsz - k, "%s", node);
            if (k >= outsz)
                k = outsz - 1;
            c++;
        } else
            out[k++] = *c;
    }
    out[k] = 0;
}

/* Run the helper with `args` (NULL-terminated, after the action), collecting its stdout into out.
 * Returns its exit status (0 ok), or -1 when it could not run or ran past the timeout. */
static int run_helper(const char *action, char **args, char *out, size_t outsz)
{
    char *argv[MAX_ARGS] = {g_python, "-I", "-m", "colo.cli.slurm", (char *)action};
    int n = 5;
    char sockarg[800], nodearg[256], timearg[64];
    const char *node = node_name();
    if (g_socket[0]) {
        size_t k = snprintf(sockarg, sizeof sockarg, "--socket=");
        socket_of_node(sockarg + k, sizeof sockarg - k);
        argv[n++] = sockarg;
    }
    if (node) { /* the helper runs with an empty environment: it learns the node's name here */
        snprintf(nodearg, sizeof nodearg, "--node=%s", node);
        argv[n++] = nodearg;
    }
    /* it gives up on the daemon first, so that it can still drain the node and requeue the job */
    snprintf(timearg, sizeof timearg, "--timeout=%d", g_timeout > 15 ? g_timeout - 10 : (g_timeout + 1) / 2);
    argv[n++] = timearg;
    for (int i = 0; args && args[i] && n < MAX_ARGS - 1; i++)
        argv[n++] = args[i];
    argv[n] = NULL;
    char *envp[] = {"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL=C.UTF-8", NULL};
    /* Slurm's own commands run by the helper (scontrol) must read this cluster's config. */
    char confenv[600];
    const char *conf = g_slurm_conf[0] ? g_slurm_conf : getenv("SLURM_CONF");
    if (conf && strlen(conf) < 500) {
        snprintf(confenv, sizeof confenv, "SLURM_CONF=%s", conf);
        envp[1] = confenv; /* LC_ALL is only a nicety */
    }

    int fds[2];
    if (pipe2(fds, O_CLOEXEC) != 0)
        return -1;
    pid_t pid = fork();
    if (pid < 0) {
        close(fds[0]);
        close(fds[1]);
        return -1;
    }
    if (pid == 0) {
        int devnull = open("/dev/null", O_RDWR);
        dup2(devnull, 0);
        dup2(fds[1], 1);
        dup2(fds[1], 2);
        for (int fd = 3; fd < 1024; fd++)
            close(fd);
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        execve(g_python, argv, envp);
        dprintf(1, "error cannot run %s: %s\n", g_python, strerror(errno));
        _exit(127);
    }
    close(fds[1]);
    size_t len = 0;
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    int timed_out = 0;
    for (;;) {
        struct timespec now;
        clock_gettime(CLOCK_MONOTONIC, &now);
        long left = (long)g_timeout * 1000 - ((now.tv_sec - t0.tv_sec) * 1000 + (now.tv_nsec - t0.tv_nsec) / 1000000);
        if (left <= 0) {
            timed_out = 1;
            break;
        }
        struct pollfd p = {.fd = fds[0], .events = POLLIN};
        int r = poll(&p, 1, (int)left);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0) {
            timed_out = r == 0;
            break;
        }
        char tmp[4096];
        ssize_t k = read(fds[0], tmp, sizeof tmp);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            break;
        size_t take = (size_t)k < outsz - 1 - len ? (size_t)k : outsz - 1 - len;
        memcpy(out + len, tmp, take);
        len += take;
    }
    out[len] = 0;
    close(fds[0]);
    if (timed_out)
        kill(pid, SIGKILL);
    int st = 0;
    while (waitpid(pid, &st, 0) < 0 && errno == EINTR)
        ;
    if (timed_out) {
        snprintf(out, outsz, "error colo's helper did not answer within %d s\n", g_timeout);
        return -1;
    }
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* Report the helper's `error` lines (or its exit status when it printed none). */
static void report(const char *what, int rc, char *out)
{
    int said = 0;
    for (char *line = strtok(out, "\n"); line; line = strtok(NULL, "\n"))
        if (!strncmp(line, "error ", 6)) {
            slurm_error("colo: %s: %s", what, line + 6);
            said = 1;
        }
    if (!said)
        slurm_error("colo: %s: helper exited with status %d", what, rc);
}

/* The lines sent to colo's daemon itself: colo/protocol.py slurm_request(SLURM_BATCH_EXIT, job, status)
 * and slurm_request(SLURM_END, job), byte for byte (tests/test_slurm_wire.py holds them equal). */
#define COLO_BATCH_EXIT_FMT "{\"v\":1,\"op\":\"slurm\",\"args\":{\"action\":\"batch_exit\",\"job\":%u,\"status\":%u}}\n"
#define COLO_END_FMT "{\"v\":1,\"op\":\"slurm\",\"args\":{\"action\":\"end\",\"job\":%u}}\n"
#define COLO_OK_HEAD "{\"v\":1,\"ok\":true,"
#define CONNECT_TIMEOUT 5 /* seconds to connect and send: the daemon's accept is quick or it is hung */

enum tell { TOLD, UNREACHED, LOST, REFUSED, HUNG };

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

/* The daemon's answer may take this long (it terminates a job's MPS clients first): as the helper's. */
static int answer_timeout(void)
{
    return g_timeout > 15 ? g_timeout - 10 : (g_timeout + 1) / 2;
}

/* Whether `sock` may be trusted with root's requests: it lies in a folder (not a symlink) of root's
 * that no one else may write, and is a socket of root's. Else another user could put their own in
 * its place and read what root sends, or answer it. */
static int socket_trusted(const char *sock, char *why, size_t whysz)
{
    char dir[600];
    struct stat st;
    snprintf(dir, sizeof dir, "%s", sock);
    char *slash = strrchr(dir, '/');
    if (!slash || slash == dir) {
        snprintf(why, whysz, "socket %s: not in a folder of its own", sock);
        return 0;
    }
    *slash = 0;
    if (lstat(dir, &st) != 0) {
        snprintf(why, whysz, "cannot check %s: %s", dir, strerror(errno));
        return 0;
    }
    if (!S_ISDIR(st.st_mode) || st.st_uid != 0 || (st.st_mode & (S_IWGRP | S_IWOTH))) {
        snprintf(why, whysz, "%s is not a folder of root's that only root may write", dir);
        return 0;
    }
    if (lstat(sock, &st) != 0 || !S_ISSOCK(st.st_mode) || st.st_uid != 0) {
        snprintf(why, whysz, "%s is not root's socket", sock);
        return 0;
    }
    return 1;
}

/* `line` to the node's colo daemon, its one-line answer awaited within answer_timeout() seconds.
 * TOLD: it answered ok; UNREACHED: not connected, nothing sent (the helper may try); LOST: it went
 * away in the middle (the request may have been acted on); REFUSED: it answered no (in `why`);
 * HUNG: no answer in time. */
static enum tell tell_daemon(const char *line, char *why, size_t whysz)
{
    char sock[600];
    socket_of_node(sock, sizeof sock);
    if (!sock[0])
        snprintf(sock, sizeof sock, "/run/colo/colo.sock");
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (strlen(sock) >= sizeof addr.sun_path) {
        snprintf(why, whysz, "socket path too long: %s", sock);
        return UNREACHED;
    }
    if (!socket_trusted(sock, why, whysz))
        return UNREACHED;
    memcpy(addr.sun_path, sock, strlen(sock) + 1);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        snprintf(why, whysz, "socket: %s", strerror(errno));
        return UNREACHED;
    }
    struct timeval tv = {.tv_sec = CONNECT_TIMEOUT};
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv); /* bounds connect and send */
    enum tell res = UNREACHED;
    struct ucred peer;
    socklen_t plen = sizeof peer;
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
        snprintf(why, whysz, "cannot connect to %s: %s", sock, strerror(errno));
        goto out;
    }
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &peer, &plen) != 0 || peer.uid != 0) {
        snprintf(why, whysz, "%s is not answered by root", sock);
        goto out;
    }
    size_t len = strlen(line), sent = 0;
    while (sent < len) {
        ssize_t k = send(fd, line + sent, len - sent, MSG_NOSIGNAL);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0) {
            snprintf(why, whysz, "sending to %s: %s", sock, k < 0 ? strerror(errno) : "closed");
            res = sent ? LOST : UNREACHED;
            goto out;
        }
        sent += (size_t)k;
    }
    char ans[2048];
    size_t got = 0;
    double end = now_s() + answer_timeout();
    res = LOST;
    while (got < sizeof ans - 1 && !memchr(ans, '\n', got)) {
        int left = (int)((end - now_s()) * 1000);
        struct pollfd p = {.fd = fd, .events = POLLIN};
        int r = left > 0 ? poll(&p, 1, left) : 0;
        if (r < 0 && errno == EINTR)
            continue;
        if (r == 0) {
            snprintf(why, whysz, "colo's daemon did not answer within %d s", answer_timeout());
            res = HUNG;
            goto out;
        }
        ssize_t k = r > 0 ? recv(fd, ans + got, sizeof ans - 1 - got, 0) : -1;
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0) {
            snprintf(why, whysz, "colo's daemon went away while answering");
            goto out;
        }
        got += (size_t)k;
    }
    ans[got] = 0;
    if (!strncmp(ans, COLO_OK_HEAD, strlen(COLO_OK_HEAD))) {
        res = TOLD;
    } else {
        ans[strcspn(ans, "\n")] = 0;
        snprintf(why, whysz, "colo's daemon refused it: %.400s", ans);
        res = REFUSED;
    }
out:
    close(fd);
    return res;
}

/* timing=FILE: `hook job=J seconds=S python=0|1` appended (root's file; a symlink is not followed). */
static void note_time(const char *hook, uint32_t job, double t0, int python)
{
    if (!g_timing[0])
        return;
    int fd = open(g_timing, O_WRONLY | O_APPEND | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0)
        return;
    dprintf(fd, "%s job=%u seconds=%.4f python=%d\n", hook, job, now_s() - t0, python);
    close(fd);
}

/* `line` told the daemon; where it cannot be, the helper runs `action` with `args` as before (with
 * --lost when the daemon went away in the middle). Whether the helper ran. */
static int tell_or_run(const char *what, const char *line, const char *action, char **args)
{
    char why[1400] = "";
    enum tell t = tell_daemon(line, why, sizeof why);
    if (t == TOLD)
        return 0;
    if (t == REFUSED || t == HUNG) { /* the helper would be refused or wait the same */
        slurm_error("colo: %s: %s", what, why);
        return 0;
    }
    char *argv[8];
    int n = 0;
    for (; args[n] && n < 6; n++)
        argv[n] = args[n];
    if (t == LOST)
        argv[n++] = "--lost";
    argv[n] = NULL;
    static char out[OUT_MAX];
    int rc = run_helper(action, argv, out, sizeof out);
    if (rc != 0)
        report(what, rc, out);
    return 1;
}

static int get_ids(spank_t sp, uint32_t *job, uint32_t *step, uid_t *uid, gid_t *gid)
{
    if (spank_get_item(sp, S_JOB_ID, job) != ESPANK_SUCCESS)
        return -1;
    if (step && spank_get_item(sp, S_JOB_STEPID, step) != ESPANK_SUCCESS)
        return -1;
    if (uid && spank_get_item(sp, S_JOB_UID, uid) != ESPANK_SUCCESS)
        return -1;
    if (gid && spank_get_item(sp, S_JOB_GID, gid) != ESPANK_SUCCESS)
        return -1;
    return 0;
}

/* Does this step's job hold a GPU on this node? Decided from the variables slurmstepd set for its
 * GRES (a user's own value of one only makes the helper ask slurmctld, which knows better). */
static int asks_gpu(spank_t sp)
{
    static const char *vars[] = {"SLURM_SHARDS_ON_NODE", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS", NULL};
    char v[256];
    for (int i = 0; vars[i]; i++)
        if (spank_getenv(sp, vars[i], v, sizeof v) == ESPANK_SUCCESS && v[0])
            return 1;
    return 0;
}

/* colo's interposer first, then the job's own libraries less any copy of colo's interposer (a step
 * on another node, or a step inherited from the batch step, carries that node's): one per process. */
static void join_preload(char *out, size_t outsz, const char *colo, const char *theirs)
{
    const char *base = strrchr(colo, '/');
    base = base ? base + 1 : colo;
    snprintf(out, outsz, "%s", colo);
    char copy[4096], *save = NULL;
    snprintf(copy, sizeof copy, "%s", theirs);
    for (char *t = strtok_r(copy, ": ", &save); t; t = strtok_r(NULL, ": ", &save)) {
        const char *tb = strrchr(t, '/');
        if (!strcmp(tb ? tb + 1 : t, base))
            continue;
        size_t len = strlen(out);
        if (len + 1 + strlen(t) >= outsz)
            break;
        snprintf(out + len, outsz - len, ":%s", t);
    }
}

/* Once per step, as root, before any task exists: ask colo for the job's place and environment. */
int slurm_spank_init_post_opt(spank_t sp, int ac, char **av)
{
    (void)ac;
    (void)av;
    if (!spank_remote(sp))
        return 0;
    uint32_t job, step;
    uid_t uid;
    gid_t gid;
    if (get_ids(sp, &job, &step, &uid, &gid) != 0) {
        slurm_error("colo: cannot read the job's ids from Slurm");
        return -1;
    }
    if (step == SLURM_EXTERN_CONT || !asks_gpu(sp))
        return 0; /* the extern step runs no user task; a step without a GPU needs nothing of colo */
    char a_job[32], a_step[32], a_uid[32], a_gid[32], a_prof[160];
    snprintf(a_job, sizeof a_job, "--job=%u", job);
    snprintf(a_step, sizeof a_step, "--step=%u", step);
    snprintf(a_uid, sizeof a_uid, "--uid=%u", (unsigned)uid);
    snprintf(a_gid, sizeof a_gid, "--gid=%u", (unsigned)gid);
    char *args[8] = {a_job, a_step, a_uid, a_gid, NULL};
    if (g_profile[0]) {
        snprintf(a_prof, sizeof a_prof, "--profile=%s", g_profile);
        args[4] = a_prof;
    }
    static char out[OUT_MAX];
    double t0 = now_s();
    int rc = run_helper("attach", args, out, sizeof out);
    note_time("attach", job, t0, 1);
    if (rc != 0) {
        char *e = strstr(out, "error ");
        snprintf(g_refused, sizeof g_refused, "%s", e ? e + 6 : "colo's helper failed");
        g_refused[strcspn(g_refused, "\n")] = 0;
        report("this step does not run", rc, out);
        return 0;
    }
    char *save = NULL;
    for (char *line = strtok_r(out, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        if (strncmp(line, "env ", 4) != 0)
            continue;
        char *kv = line + 4, *eq = strchr(kv, '=');
        if (!eq)
            continue;
        *eq = 0;
        const char *val = eq + 1;
        char joined[8192];
        if (!strcmp(kv, "LD_PRELOAD")) {
            char theirs[4096];
            if (spank_getenv(sp, "LD_PRELOAD", theirs, sizeof theirs) == ESPANK_SUCCESS && theirs[0]) {
                join_preload(joined, sizeof joined, val, theirs);
                val = joined;
            }
        }
        if (!strcmp(kv, "COLO_LEDGER"))
            g_placed = 1;
        if (spank_setenv(sp, kv, val, 1) != ESPANK_SUCCESS) {
            snprintf(g_refused, sizeof g_refused, "cannot set %s in the job's environment", kv);
            return 0;
        }
    }
    return 0;
}

/* In each task, just before exec: a step colo could not place does not run (its GPU memory would
 * be nobody's budget). The line goes to the task's stderr, i.e. the job's output. */
int slurm_spank_task_init(spank_t sp, int ac, char **av)
{
    (void)ac;
    (void)av;
    if (!spank_remote(sp) || !g_refused[0])
        return 0;
    fprintf(stderr, "colo: this step does not run: %s\n", g_refused);
    fflush(stderr);
    return -1;
}

/* The batch script ended (by itself, or killed by scancel / a time limit): Slurm is about to kill
 * whatever the job still runs, so colo sends terminate_client to its MPS clients now, first. */
int slurm_spank_task_exit(spank_t sp, int ac, char **av)
{
    (void)ac;
    (void)av;
    if (!spank_remote(sp))
        return 0;
    uint32_t job, step;
    int status = 0;
    if (!g_placed || get_ids(sp, &job, &step, NULL, NULL) != 0 || step != SLURM_BATCH_SCRIPT)
        return 0;
    double t0 = now_s();
    spank_get_item(sp, S_TASK_EXIT_STATUS, &status);
    char line[256], a_job[32], a_st[32];
    snprintf(line, sizeof line, COLO_BATCH_EXIT_FMT, job, (unsigned)status);
    snprintf(a_job, sizeof a_job, "--job=%u", job);
    snprintf(a_st, sizeof a_st, "--status=%u", (unsigned)status);
    char *args[] = {a_job, a_st, NULL};
    int python = tell_or_run("batch script ended", line, "batch-exit", args);
    note_time("batch_exit", job, t0, python);
    return 0;
}

/* Does colo follow this job on this node? The daemon keeps a root-only mark per Slurm job it placed
 * or holds GPUs for, beside its socket (`slurm-jobs/<job id>`): after a slurmctld restart slurmd
 * runs the epilog with SLURM_JOB_GPUS empty, and without this the job would be found `lost`. */
static int colo_knows(uint32_t job)
{
    char sock[600], mark[700];
    socket_of_node(sock, sizeof sock);
    if (!sock[0])
        snprintf(sock, sizeof sock, "/run/colo/colo.sock");
    char *slash = strrchr(sock, '/');
    if (!slash)
        return 0;
    *slash = 0;
    snprintf(mark, sizeof mark, "%s/slurm-jobs/%u", sock, job);
    return access(mark, F_OK) == 0;
}

/* After every process of the job is gone: colo records its end and learns its profile. Never
 * fails the epilog (that would drain the node): a daemon that missed it finds out from Slurm.
 * slurmd sets SLURM_JOB_GPUS in the epilog's environment for a job with GPUs (gres/gpu and
 * gres/shard); without it (a CPU job, or any job after a slurmctld restart) Python runs only for a
 * job colo marked as its own. */
int slurm_spank_job_epilog(spank_t sp, int ac, char **av)
{
    parse_args(ac, av);
    uint32_t job = 0;
    if (spank_get_item(sp, S_JOB_ID, &job) != ESPANK_SUCCESS) {
        const char *e = getenv("SLURM_JOB_ID");
        job = e ? (uint32_t)strtoul(e, NULL, 10) : 0;
    }
    if (!job)
        return 0;
    const char *gpus = getenv("SLURM_JOB_GPUS");
    if ((!gpus || !*gpus) && !colo_knows(job))
        return 0;
    double t0 = now_s();
    char line[256], a_job[32];
    snprintf(line, sizeof line, COLO_END_FMT, job);
    snprintf(a_job, sizeof a_job, "--job=%u", job);
    char *args[] = {a_job, NULL};
    int python = tell_or_run("job end", line, "end", args);
    note_time("end", job, t0, python);
    return 0;
}
