/* Fake libcuda.so.1, MPS client side. At cuInit the driver tries the control daemon's socket in
 * $CUDA_MPS_PIPE_DIRECTORY (default /tmp/nvidia-mps); if nothing answers there the process is an
 * ordinary context. Otherwise it waits until the daemon gives it a server (a client of another
 * uid waits, as with the real daemon), then keeps the connection open for its lifetime: the
 * daemon counts its clients by these connections. */
#include "cuda_internal.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

static int g_mps_fd = -1;

void fg_mps_detach(void)
{
    if (g_mps_fd >= 0)
        close(g_mps_fd);
    g_mps_fd = -1;
}

static int connect_daemon(void)
{
    const char *dir = getenv("CUDA_MPS_PIPE_DIRECTORY");
    if (!dir || !*dir)
        dir = "/tmp/nvidia-mps";
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    if ((size_t)snprintf(a.sun_path, sizeof a.sun_path, "%s/control", dir) >= sizeof a.sun_path)
        return -1;
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

/* One reply line, waiting at most COLO_FAKEGPU_MPS_WAIT_S seconds (default: as long as it takes). */
static int read_line(int fd, char *buf, size_t n)
{
    const char *w = getenv("COLO_FAKEGPU_MPS_WAIT_S");
    double wait_s = w && *w ? atof(w) : -1;
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    size_t len = 0;
    while (len + 1 < n) {
        int timeout = -1;
        if (wait_s >= 0) {
            struct timespec t;
            clock_gettime(CLOCK_MONOTONIC, &t);
            double left = wait_s - ((double)(t.tv_sec - t0.tv_sec) + (double)(t.tv_nsec - t0.tv_nsec) / 1e9);
            if (left <= 0)
                return -1;
            timeout = (int)(left * 1000) + 1;
        }
        struct pollfd p = {.fd = fd, .events = POLLIN};
        int r = poll(&p, 1, timeout);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        ssize_t k = read(fd, buf + len, 1);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return -1;
        if (buf[len] == '\n') {
            buf[len] = 0;
            return 0;
        }
        len++;
    }
    return -1;
}

/* CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=4G,1=2G" (ordinals as this process sees them). */
static void env_limits(uint64_t *lim)
{
    const char *e = getenv("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT");
    if (!e)
        return;
    char buf[512];
    snprintf(buf, sizeof buf, "%s", e);
    char *save = NULL;
    for (char *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        char *eq = strchr(t, '=');
        uint64_t v;
        if (!eq)
            continue;
        *eq = 0;
        int ord = atoi(t);
        if (ord >= 0 && ord < g_nvis && fg_parse_size(eq + 1, &v) == 0)
            lim[g_vis[ord]] = v;
    }
}

int fg_mps_attach(CUresult *err)
{
    int fd = connect_daemon();
    if (fd < 0)
        return 0;
    struct fg_slot *sl = &S.h->slot[g_slot];
    char line[1024];
    int n = snprintf(line, sizeof line, "CLIENT %d %u %llu %d\n", g_slot, sl->gen,
                     (unsigned long long)S.my_pidns, (int)getpid());
    if (write(fd, line, (size_t)n) != n || read_line(fd, line, sizeof line) != 0) {
        close(fd);
        *err = CUDA_ERROR_MPS_CONNECTION_FAILED;
        return -1;
    }
    int code = 0;
    if (sscanf(line, "ERR %d", &code) == 1) {
        close(fd);
        *err = code;
        return -1;
    }
    int server = 0, pct = 100, off = 0;
    if (sscanf(line, "OK %d %d %n", &server, &pct, &off) < 2) {
        close(fd);
        *err = CUDA_ERROR_MPS_RPC_FAILURE;
        return -1;
    }
    uint64_t lim[FG_MAX_DEV] = {0}, mine[FG_MAX_DEV] = {0};
    char *p = line + off;
    for (uint32_t d = 0; d < S.h->ndev; d++) {
        char *end;
        lim[d] = strtoull(p, &end, 10);
        p = end;
    }
    env_limits(mine);
    const char *atp = getenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE");
    int env_pct = atp && *atp ? fg_pct(atoi(atp)) : 100;
    fg_lock(&S);
    sl->kind = FG_KIND_MPS_CLIENT;
    sl->server_pid = server;
    sl->thread_pct = env_pct < pct ? env_pct : pct; /* a client can only lower the daemon's values */
    for (uint32_t d = 0; d < S.h->ndev; d++)
        sl->limit[d] = mine[d] && (!lim[d] || mine[d] < lim[d]) ? mine[d] : lim[d];
    fg_unlock(&S);
    g_mps_fd = fd;
    return 1;
}
