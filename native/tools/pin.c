/* colo-pin SOCKFD UID GID GROUPS PATH
 *
 * Run by the root daemon for a mount source a user named. It becomes that user first
 * (supplementary GROUPS, comma-separated or "-", then GID, then UID), then opens PATH one
 * component at a time from "/" with O_PATH | O_NOFOLLOW, so the kernel checks the user's search
 * permission on every folder on the way and no symlink is ever followed. The last component must
 * be a folder the user can read and search, or a regular file the user can read; it is reopened
 * read-only through /proc/self/fd (the same inode: nothing can be swapped in between) and sent
 * back on the Unix socket SOCKFD with SCM_RIGHTS. The daemon mounts exactly that file.
 *
 * Reply, one message on SOCKFD:  "ok dir" | "ok file" (with the descriptor attached)
 *                                "symlink DEPTH" | "errno ERRNO DEPTH" | "type DEPTH" | "bad DEPTH"
 *                                | "fuse DEPTH" (a FUSE file system: refused)
 * DEPTH: how many components of PATH lead to the one that failed (1 = the first).
 * Exit status: 0 when sent ok, 1 when refused, 2 on misuse.
 */
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

static int sock = -1;

static int reply(const char *msg, int fd)
{
    struct msghdr mh;
    struct iovec iov = {.iov_base = (void *)msg, .iov_len = strlen(msg)};
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } u;
    memset(&mh, 0, sizeof mh);
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    if (fd >= 0) {
        memset(&u, 0, sizeof u);
        mh.msg_control = u.buf;
        mh.msg_controllen = sizeof u.buf;
        struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(c), &fd, sizeof(int));
    }
    return sendmsg(sock, &mh, MSG_NOSIGNAL) < 0 ? 2 : (fd >= 0 ? 0 : 1);
}

static int refuse(const char *kind, int err, int depth)
{
    char msg[64];
    if (err)
        snprintf(msg, sizeof msg, "%s %d %d", kind, err, depth);
    else
        snprintf(msg, sizeof msg, "%s %d", kind, depth);
    return reply(msg, -1);
}

static int parse_id(const char *s, unsigned long *out)
{
    char *end;
    errno = 0;
    *out = strtoul(s, &end, 10);
    return errno || end == s || *end || *out > 0xfffffffeUL ? -1 : 0;
}

static int become(const char *uid_s, const char *gid_s, const char *groups_s)
{
    unsigned long uid, gid, g;
    if (parse_id(uid_s, &uid) || parse_id(gid_s, &gid))
        return -1;
    if (getuid() == (uid_t)uid && geteuid() == (uid_t)uid)
        return 0; /* a daemon run by this very user: nothing to drop */
    gid_t groups[1024];
    size_t n = 0;
    if (strcmp(groups_s, "-") != 0) {
        char *copy = strdup(groups_s), *save = NULL;
        if (!copy)
            return -1;
        for (char *t = strtok_r(copy, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
            if (n == sizeof groups / sizeof groups[0] || parse_id(t, &g)) {
                free(copy);
                return -1;
            }
            groups[n++] = (gid_t)g;
        }
        free(copy);
    }
    if (setgroups(n, groups) || setgid((gid_t)gid) || setuid((uid_t)uid))
        return -1;
    /* no way back, and the user may not ptrace what a root process set up */
    if (setuid(0) == 0 || getuid() != (uid_t)uid || geteuid() != (uid_t)uid || getgid() != (gid_t)gid ||
        getegid() != (gid_t)gid)
        return -1;
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc != 6) {
        fprintf(stderr, "usage: colo-pin SOCKFD UID GID GROUPS PATH\n");
        return 2;
    }
    unsigned long s;
    if (parse_id(argv[1], &s))
        return 2;
    sock = (int)s;
    if (become(argv[2], argv[3], argv[4]))
        return refuse("drop", errno ? errno : EPERM, 0);

    const char *path = argv[5];
    if (path[0] != '/')
        return refuse("bad", 0, 0);
    int cur = open("/", O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (cur < 0)
        return refuse("errno", errno, 0);
    char name[256];
    int depth = 0;
    struct stat st;
    if (fstat(cur, &st))
        return refuse("errno", errno, 0);
    const char *p = path;
    for (;;) {
        while (*p == '/')
            p++;
        if (!*p)
            break;
        size_t len = strcspn(p, "/");
        depth++;
        if (len >= sizeof name)
            return refuse("errno", ENAMETOOLONG, depth);
        memcpy(name, p, len);
        name[len] = 0;
        p += len;
        if (!strcmp(name, ".") || !strcmp(name, ".."))
            return refuse("bad", 0, depth);
        int next = openat(cur, name, O_PATH | O_NOFOLLOW | O_CLOEXEC);
        if (next < 0)
            return refuse("errno", errno, depth);
        close(cur);
        cur = next;
        if (fstat(cur, &st))
            return refuse("errno", errno, depth);
        if (S_ISLNK(st.st_mode))
            return refuse("symlink", 0, depth);
        while (*p == '/')
            p++;
        if (*p && !S_ISDIR(st.st_mode))
            return refuse("errno", ENOTDIR, depth);
    }
    /* a FUSE file system answers through its owner's process, which can make root wait for ever */
    struct statfs sf;
    if (fstatfs(cur, &sf) == 0 && sf.f_type == 0x65735546 /* FUSE_SUPER_MAGIC */)
        return refuse("fuse", 0, depth);
    int dir = S_ISDIR(st.st_mode);
    if (!dir && !S_ISREG(st.st_mode))
        return refuse("type", 0, depth);
    if (dir) { /* searchable: looking up "." in it needs the search bit, as the user */
        int dot = openat(cur, ".", O_PATH | O_CLOEXEC);
        if (dot < 0)
            return refuse("errno", errno, depth);
        close(dot);
    }
    char self[64];
    snprintf(self, sizeof self, "/proc/self/fd/%d", cur);
    /* readable: reopened read-only as the user; O_NONBLOCK and O_NOCTTY for what it cannot be anyway */
    int fd = open(self, O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC | (dir ? O_DIRECTORY : 0));
    if (fd < 0)
        return refuse("errno", errno, depth);
    struct stat st2;
    if (fstat(fd, &st2) || st2.st_dev != st.st_dev || st2.st_ino != st.st_ino)
        return refuse("errno", EAGAIN, depth);
    return reply(dir ? "ok dir" : "ok file", fd);
}
