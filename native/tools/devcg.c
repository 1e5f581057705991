/* colo-devcg: hold the processes of one cgroup v2 to the devices they were given, as systemd's
 * DeviceAllow= and runc do on cgroup v2, where the `devices` controller of v1 does not exist.
 *
 *   colo-devcg CGROUP_DIR RULE...   attach a device program refusing the devices RULEs name
 *   colo-devcg --check              exit 0 when this kernel lets a device program be loaded
 *   colo-devcg --gate CGROUP_DIR NAME ID:LEVEL... -- RULE...
 *                                   the node's gate (docs/gating.md): attach to CGROUP_DIR a program
 *                                   called NAME that refuses the RULE devices to every process but
 *                                   root's and those beneath the cgroup2 folders ID:LEVEL name (colo's
 *                                   jobs: the folder's cgroup id, its inode, at its depth LEVEL below
 *                                   the mount); programs of that NAME attached there before go
 *   colo-devcg --check-gate         exit 0 when this kernel loads such a program
 *   colo-devcg --list CGROUP_DIR    the names of the device programs attached there, one a line
 *
 * RULE is TYPE:MAJOR:MINOR, TYPE c (character) or b (block), MINOR a number or * (every minor):
 * `c:195:1` is /dev/nvidia1. Every other device stays as the cgroup's parents decide.
 *
 * The program is a BPF_PROG_TYPE_CGROUP_DEVICE program written here as raw instructions (no
 * libbpf, no clang): it reads the device's type, major and minor from its context and answers 0
 * (refuse) for a listed one, 1 (leave to the others) for the rest. It is attached with
 * BPF_F_ALLOW_MULTI, so it runs beside whatever the parents attached (systemd's DevicePolicy=,
 * the engine's): the kernel lets an open through only when every program in the path allows it,
 * so this can only take access away. The attachment holds the program; the tool exits, and the
 * program goes when the cgroup is removed.
 *
 * Exit: 0 attached; 1 the kernel refused (the reason on stderr: no bpf() here, not root, ...);
 * 2 usage. On a hybrid layout, a program on the cgroup2 leaf applies as well (the kernel runs the
 * programs of the task's cgroup2 before the v1 devices controller).
 */
#include <errno.h>
#include <fcntl.h>
#include <linux/bpf.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define MAX_RULES 256

/* The instruction macros of the kernel's own samples (filter.h), for the few kinds used here. */
#define INSN(c, d, s, o, i) ((struct bpf_insn){.code = (c), .dst_reg = (d), .src_reg = (s), .off = (o), .imm = (i)})
#define LDX_W(dst, src, off) INSN(BPF_LDX | BPF_MEM | BPF_W, dst, src, off, 0)
#define AND_IMM(dst, imm) INSN(BPF_ALU | BPF_AND | BPF_K, dst, 0, 0, imm)
#define JNE_IMM(dst, imm, off) INSN(BPF_JMP | BPF_JNE | BPF_K, dst, 0, off, imm)
#define MOV_IMM(dst, imm) INSN(BPF_ALU64 | BPF_MOV | BPF_K, dst, 0, 0, imm)
#define EXIT() INSN(BPF_JMP | BPF_EXIT, 0, 0, 0, 0)
#define JEQ_IMM(dst, imm, off) INSN(BPF_JMP | BPF_JEQ | BPF_K, dst, 0, off, imm)
#define JEQ_REG(dst, src, off) INSN(BPF_JMP | BPF_JEQ | BPF_X, dst, src, off, 0)
#define JA(off) INSN(BPF_JMP | BPF_JA, 0, 0, off, 0)
#define MOV32_REG(dst, src) INSN(BPF_ALU | BPF_MOV | BPF_X, dst, src, 0, 0)
#define CALL(fn) INSN(BPF_JMP | BPF_CALL, 0, 0, 0, fn)
#define LD_IMM64_LO(dst, v) INSN(BPF_LD | BPF_DW | BPF_IMM, dst, 0, 0, (int32_t)(uint32_t)(v))
#define LD_IMM64_HI(v) INSN(0, 0, 0, 0, (int32_t)(uint32_t)((uint64_t)(v) >> 32))
#define MAX_ALLOW 16
#define GATE_NAME_MAX 15 /* BPF_OBJ_NAME_LEN less its NUL */

struct allow {
    uint64_t id;  /* a cgroup2 folder's id (its inode number) */
    int level;    /* its depth below the mount: 1 for /colo-x */
};

struct rule {
    int type;     /* BPF_DEVCG_DEV_CHAR or BPF_DEVCG_DEV_BLOCK */
    int major;
    int minor;    /* -1: every minor */
};

static int usage(void)
{
    fprintf(stderr, "usage: colo-devcg CGROUP_DIR TYPE:MAJOR:MINOR...   (e.g. c:195:1, c:195:*)\n"
                    "       colo-devcg --check\n"
                    "       colo-devcg --gate CGROUP_DIR NAME ID:LEVEL... -- TYPE:MAJOR:MINOR...\n"
                    "       colo-devcg --check-gate\n"
                    "       colo-devcg --list CGROUP_DIR\n");
    return 2;
}

static long sys_bpf(int cmd, union bpf_attr *attr)
{
    return syscall(__NR_bpf, cmd, attr, sizeof *attr);
}

static int parse_rule(const char *text, struct rule *r)
{
    char type;
    char minor[16];
    int major, used = 0;
    if (sscanf(text, "%c:%d:%15[0-9*]%n", &type, &major, minor, &used) != 3 || text[used] != '\0')
        return -1;
    if ((type != 'c' && type != 'b') || major < 0 || major > 4095)
        return -1;
    r->type = type == 'c' ? BPF_DEVCG_DEV_CHAR : BPF_DEVCG_DEV_BLOCK;
    r->major = major;
    if (!strcmp(minor, "*"))
        r->minor = -1;
    else if (strchr(minor, '*'))
        return -1;
    else
        r->minor = atoi(minor);
    return r->minor > 1048575 ? -1 : 0;
}

/* The program: r2 = type (low 16 bits of access_type), r4 = major, r5 = minor; then per rule a
 * block "if r2 != type || r4 != major || r5 != minor: next block; else return 0"; last, return 1. */
static int build(const struct rule *rules, int n, struct bpf_insn *out)
{
    int k = 0;
    out[k++] = LDX_W(BPF_REG_2, BPF_REG_1, offsetof(struct bpf_cgroup_dev_ctx, access_type));
    out[k++] = AND_IMM(BPF_REG_2, 0xFFFF);
    out[k++] = LDX_W(BPF_REG_4, BPF_REG_1, offsetof(struct bpf_cgroup_dev_ctx, major));
    out[k++] = LDX_W(BPF_REG_5, BPF_REG_1, offsetof(struct bpf_cgroup_dev_ctx, minor));
    for (int i = 0; i < n; i++) {
        int tests = rules[i].minor < 0 ? 2 : 3, len = tests + 2;
        out[k++] = JNE_IMM(BPF_REG_2, rules[i].type, len - 1);
        out[k++] = JNE_IMM(BPF_REG_4, rules[i].major, len - 2);
        if (rules[i].minor >= 0)
            out[k++] = JNE_IMM(BPF_REG_5, rules[i].minor, len - 3);
        out[k++] = MOV_IMM(BPF_REG_0, 0);
        out[k++] = EXIT();
    }
    out[k++] = MOV_IMM(BPF_REG_0, 1);
    out[k++] = EXIT();
    return k;
}

/* The gate: for a listed device, 1 (leave to the others) when the process is root's (real uid 0) or
 * beneath an allowed folder (bpf_get_current_ancestor_cgroup_id at its level is its id), else 0;
 * every other device 1. A process above an allowed folder's level gets ancestor id 0: no match. */
static int build_gate(const struct rule *rules, int n, const struct allow *allow, int na, struct bpf_insn *out)
{
    int k = 0;
    out[k++] = LDX_W(BPF_REG_2, BPF_REG_1, offsetof(struct bpf_cgroup_dev_ctx, access_type));
    out[k++] = AND_IMM(BPF_REG_2, 0xFFFF);
    out[k++] = LDX_W(BPF_REG_4, BPF_REG_1, offsetof(struct bpf_cgroup_dev_ctx, major));
    out[k++] = LDX_W(BPF_REG_5, BPF_REG_1, offsetof(struct bpf_cgroup_dev_ctx, minor));
    int judge = 0; /* where the rules' matches jump: after them and the "not listed" exit */
    for (int i = 0; i < n; i++)
        judge += (rules[i].minor < 0 ? 2 : 3) + 1;
    judge += 2;
    int at = 0; /* the offset of the rules' blocks so far */
    for (int i = 0; i < n; i++) {
        int tests = rules[i].minor < 0 ? 2 : 3, len = tests + 1;
        out[k++] = JNE_IMM(BPF_REG_2, rules[i].type, len - 1);
        out[k++] = JNE_IMM(BPF_REG_4, rules[i].major, len - 2);
        if (rules[i].minor >= 0)
            out[k++] = JNE_IMM(BPF_REG_5, rules[i].minor, len - 3);
        at += len;
        out[k++] = JA(judge - at); /* a listed device */
    }
    out[k++] = MOV_IMM(BPF_REG_0, 1);
    out[k++] = EXIT();
    /* judge: root's process, or one beneath an allowed folder */
    int allowed = 5 * na + 2; /* from the uid test to the last "allow" */
    out[k++] = CALL(BPF_FUNC_get_current_uid_gid);
    out[k++] = MOV32_REG(BPF_REG_0, BPF_REG_0); /* the uid: the low 32 bits */
    out[k++] = JEQ_IMM(BPF_REG_0, 0, allowed);
    for (int i = 0; i < na; i++) {
        out[k++] = MOV_IMM(BPF_REG_1, allow[i].level);
        out[k++] = CALL(BPF_FUNC_get_current_ancestor_cgroup_id);
        out[k++] = LD_IMM64_LO(BPF_REG_6, allow[i].id);
        out[k++] = LD_IMM64_HI(allow[i].id);
        out[k++] = JEQ_REG(BPF_REG_0, BPF_REG_6, allowed - 5 * (i + 1));
    }
    out[k++] = MOV_IMM(BPF_REG_0, 0);
    out[k++] = EXIT();
    out[k++] = MOV_IMM(BPF_REG_0, 1);
    out[k++] = EXIT();
    return k;
}

static struct bpf_insn prog[4 + MAX_RULES * 5 + 2 + 5 + MAX_ALLOW * 5 + 4];

static int load_insns(int len, const char *name)
{
    static char log[65536];
    union bpf_attr a;
    memset(&a, 0, sizeof a);
    if (name)
        strncpy(a.prog_name, name, sizeof a.prog_name - 1);
    a.prog_type = BPF_PROG_TYPE_CGROUP_DEVICE;
    a.insns = (uint64_t)(uintptr_t)prog;
    log[0] = '\0';
    a.insn_cnt = (uint32_t)len;
    a.license = (uint64_t)(uintptr_t)"GPL";
    a.log_buf = (uint64_t)(uintptr_t)log;
    a.log_size = sizeof log;
    a.log_level = 1;
    int fd = (int)sys_bpf(BPF_PROG_LOAD, &a);
    if (fd < 0) {
        int e = errno;
        fprintf(stderr, "colo-devcg: the kernel refused the device program: %s%s%s\n", strerror(e),
                log[0] ? "\n" : "", log);
        errno = e;
    }
    return fd;
}

static int load(const struct rule *rules, int n)
{
    return load_insns(build(rules, n, prog), NULL);
}

/* The ids of the device programs attached to the cgroup `cg` (at most 64), or -1 with the
 * error said (`what`: where, for the message). */
static int programs(int cg, uint32_t ids[64], const char *what)
{
    union bpf_attr q;
    memset(&q, 0, sizeof q);
    q.query.target_fd = (uint32_t)cg;
    q.query.attach_type = BPF_CGROUP_DEVICE;
    q.query.prog_ids = (uint64_t)(uintptr_t)ids;
    q.query.prog_cnt = 64;
    if (sys_bpf(BPF_PROG_QUERY, &q) != 0) {
        fprintf(stderr, "colo-devcg: cannot list the device programs of %s: %s\n", what, strerror(errno));
        return -1;
    }
    return (int)(q.query.prog_cnt < 64 ? q.query.prog_cnt : 64);
}

/* A descriptor of program `id` with its name in `name` (the kernel's, up to 16 bytes with its
 * NUL; "" when it has none), or -1 when it is gone or cannot be read. */
static int program(uint32_t id, char name[16])
{
    union bpf_attr g;
    memset(&g, 0, sizeof g);
    g.prog_id = id;
    int fd = (int)sys_bpf(BPF_PROG_GET_FD_BY_ID, &g);
    name[0] = 0;
    if (fd < 0)
        return -1;
    struct bpf_prog_info info;
    memset(&info, 0, sizeof info);
    union bpf_attr inf;
    memset(&inf, 0, sizeof inf);
    inf.info.bpf_fd = (uint32_t)fd;
    inf.info.info_len = sizeof info;
    inf.info.info = (uint64_t)(uintptr_t)&info;
    if (sys_bpf(BPF_OBJ_GET_INFO_BY_FD, &inf) != 0) {
        close(fd);
        return -1;
    }
    memcpy(name, info.name, 16);
    name[15] = 0;
    return fd;
}

/* Detach every program called `name` from the cgroup `cg` but the one of id `keep` (an earlier
 * daemon's gate). */
static int detach_named_but(int cg, const char *name, uint32_t keep)
{
    uint32_t ids[64];
    char got[16];
    int n = programs(cg, ids, "the gate's folder");
    if (n < 0)
        return -1;
    for (int i = 0; i < n; i++) {
        if (ids[i] == keep)
            continue;
        int fd = program(ids[i], got);
        if (fd < 0)
            continue;
        if (!strncmp(got, name, sizeof got)) {
            union bpf_attr d;
            memset(&d, 0, sizeof d);
            d.target_fd = (uint32_t)cg;
            d.attach_bpf_fd = (uint32_t)fd;
            d.attach_type = BPF_CGROUP_DEVICE;
            if (sys_bpf(BPF_PROG_DETACH, &d) != 0) {
                fprintf(stderr, "colo-devcg: cannot detach the earlier %s: %s\n", name, strerror(errno));
                close(fd);
                return -1;
            }
        }
        close(fd);
    }
    return 0;
}

static int attach(int cg, int prog_fd, const char *where)
{
    union bpf_attr a;
    memset(&a, 0, sizeof a);
    a.target_fd = (uint32_t)cg;
    a.attach_bpf_fd = (uint32_t)prog_fd;
    a.attach_type = BPF_CGROUP_DEVICE;
    a.attach_flags = BPF_F_ALLOW_MULTI;
    if (sys_bpf(BPF_PROG_ATTACH, &a) != 0) {
        fprintf(stderr, "colo-devcg: cannot attach the device program to %s: %s\n", where, strerror(errno));
        return -1;
    }
    return 0;
}

static int list(const char *dir)
{
    uint32_t ids[64];
    char name[16];
    int cg = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (cg < 0) {
        fprintf(stderr, "colo-devcg: cannot open %s: %s\n", dir, strerror(errno));
        return 1;
    }
    int n = programs(cg, ids, dir);
    close(cg);
    if (n < 0)
        return 1;
    for (int i = 0; i < n; i++) {
        int fd = program(ids[i], name);
        if (fd >= 0) {
            printf("%s\n", name[0] ? name : "-");
            close(fd);
        }
    }
    return 0;
}

static int parse_allow(const char *text, struct allow *a)
{
    unsigned long long id;
    int level, used = 0;
    if (sscanf(text, "%llu:%d%n", &id, &level, &used) != 2 || text[used] != '\0' || level < 1 || level > 1000)
        return -1;
    a->id = id;
    a->level = level;
    return 0;
}

static int gate(int argc, char **argv)
{
    /* --gate CGROUP_DIR NAME ID:LEVEL... -- RULE... */
    static struct rule rules[MAX_RULES];
    static struct allow allow[MAX_ALLOW];
    int n = 0, na = 0, i = 4;
    const char *dir = argv[2], *name = argv[3];
    if (!name[0] || strlen(name) > GATE_NAME_MAX)
        return usage();
    for (; i < argc && strcmp(argv[i], "--"); i++)
        if (na == MAX_ALLOW || parse_allow(argv[i], &allow[na++]) != 0)
            return usage();
    if (i >= argc - 1 || argc - i - 1 > MAX_RULES)
        return usage();
    for (i++; i < argc; i++)
        if (parse_rule(argv[i], &rules[n++]) != 0) {
            fprintf(stderr, "colo-devcg: malformed rule %s\n", argv[i]);
            return usage();
        }
    int cg = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (cg < 0) {
        fprintf(stderr, "colo-devcg: cannot open %s: %s\n", dir, strerror(errno));
        return 1;
    }
    int fd = load_insns(build_gate(rules, n, allow, na, prog), name);
    /* the new gate first, then the old ones go: never a moment without one */
    if (fd < 0 || attach(cg, fd, dir) != 0)
        return 1;
    uint32_t keep;
    {
        struct bpf_prog_info info;
        union bpf_attr inf;
        memset(&info, 0, sizeof info);
        memset(&inf, 0, sizeof inf);
        inf.info.bpf_fd = (uint32_t)fd;
        inf.info.info_len = sizeof info;
        inf.info.info = (uint64_t)(uintptr_t)&info;
        if (sys_bpf(BPF_OBJ_GET_INFO_BY_FD, &inf) != 0) {
            fprintf(stderr, "colo-devcg: cannot read back the gate: %s\n", strerror(errno));
            return 1;
        }
        keep = info.id;
    }
    return detach_named_but(cg, name, keep) == 0 ? 0 : 1;
}

int main(int argc, char **argv)
{
    if (argc == 2 && !strcmp(argv[1], "--check")) {
        int fd = load(NULL, 0);
        if (fd < 0)
            return 1;
        close(fd);
        return 0;
    }
    if (argc == 2 && !strcmp(argv[1], "--check-gate")) {
        static const struct rule r = {BPF_DEVCG_DEV_CHAR, 195, -1};
        static const struct allow a = {1, 1};
        int fd = load_insns(build_gate(&r, 1, &a, 1, prog), "colo_check");
        if (fd < 0)
            return 1;
        close(fd);
        return 0;
    }
    if (argc == 3 && !strcmp(argv[1], "--list"))
        return list(argv[2]);
    if (argc >= 6 && !strcmp(argv[1], "--gate"))
        return gate(argc, argv);
    if (argc < 3 || argv[1][0] == '-' || argc - 2 > MAX_RULES)
        return usage();
    static struct rule rules[MAX_RULES];
    int n = 0;
    for (int i = 2; i < argc; i++)
        if (parse_rule(argv[i], &rules[n++]) != 0) {
            fprintf(stderr, "colo-devcg: malformed rule %s\n", argv[i]);
            return usage();
        }
    int cg = open(argv[1], O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (cg < 0) {
        fprintf(stderr, "colo-devcg: cannot open %s: %s\n", argv[1], strerror(errno));
        return 1;
    }
    int prog = load(rules, n);
    if (prog < 0)
        return 1;
    union bpf_attr a;
    memset(&a, 0, sizeof a);
    a.target_fd = (uint32_t)cg;
    a.attach_bpf_fd = (uint32_t)prog;
    a.attach_type = BPF_CGROUP_DEVICE;
    a.attach_flags = BPF_F_ALLOW_MULTI;
    if (sys_bpf(BPF_PROG_ATTACH, &a) != 0) {
        fprintf(stderr, "colo-devcg: cannot attach the device program to %s: %s\n", argv[1], strerror(errno));
        return 1;
    }
    close(prog);
    close(cg);
    return 0;
}
