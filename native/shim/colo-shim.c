/* colo-shim EXITFILE CMD [ARGS...]
 *
 * Runs CMD as its child and writes the child's exit status to EXITFILE (atomically) when it
 * ends, so a process job that outlives a colo daemon restart still has its exit code.
 * Exit code: the child's, or 128+signal when the child was killed by a signal.
 * Signals sent to the shim alone (TERM, INT, HUP, QUIT, USR1, USR2) are passed on to the child;
 * the handlers are reset by exec, so the child starts with default dispositions.
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static volatile pid_t child = -1;

static void forward(int sig)
{
    if (child > 0)
        kill(child, sig);
}

static void write_status(const char *path, int code)
{
    char tmp[4096], buf[32];
    int n = snprintf(tmp, sizeof tmp, "%s.tmp", path);
    if (n < 0 || (size_t)n >= sizeof tmp)
        return;
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
        return;
    int len = snprintf(buf, sizeof buf, "%d\n", code);
    if (write(fd, buf, (size_t)len) == len && fsync(fd) == 0)
        rename(tmp, path);
    close(fd);
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: colo-shim EXITFILE CMD [ARGS...]\n");
        return 2;
    }
    int sigs[] = {SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2};
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = forward;
    sigemptyset(&sa.sa_mask);
    for (size_t i = 0; i < sizeof sigs / sizeof sigs[0]; i++)
        sigaction(sigs[i], &sa, NULL);

    child = fork();
    if (child < 0) {
        perror("colo-shim: fork");
        return 127;
    }
    if (child == 0) {
        execvp(argv[2], argv + 2);
        fprintf(stderr, "colo: cannot run %s: %s\n", argv[2], strerror(errno));
        _exit(errno == ENOENT ? 127 : 126);
    }
    int status, code;
    while (waitpid(child, &status, 0) < 0) {
        if (errno != EINTR) {
            perror("colo-shim: waitpid");
            return 127;
        }
    }
    code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    write_status(argv[1], code);
    return code;
}
