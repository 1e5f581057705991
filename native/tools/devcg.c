/* colo-devcg: hold the processes of one cgroup v2 to the devices they were given, as systemd's
 * DeviceAllow= and runc do on cgroup v2, where the `devices` controller of v1 does not exist.
 *
 *   colo-devcg CGROUP_DIR RULE...   attach a device program refusing the devices RULEs name
 *   colo-devcg --check              exit 0 when this kernel lets a device program be loaded
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

struct rule {
    int type;     /* BPF_DEVCG_DEV_CHAR or BPF_DEVCG_DEV_BLOCK */
    int major;
    int minor;    /* -1: every minor */
};

static int usage(void)
{
    fprintf(stderr, "usage: colo-devcg CGROUP_DIR TYPE:MAJOR:MINOR...   (e.g. c:195:1, c:195:*)\n"
                    "       colo-devcg --check\n");
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

static int load(const struct rule *rules, int n)
{
    static struct bpf_insn prog[4 + MAX_RULES * 5 + 2];
    static char log[8192];
    int len = build(rules, n, prog);
    union bpf_attr a;
    memset(&a, 0, sizeof a);
    a.prog_type = BPF_PROG_TYPE_CGROUP_DEVICE;
    a.insns = (uint64_t)(uintptr_t)prog;
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

int main(int argc, char **argv)
{
    if (argc == 2 && !strcmp(argv[1], "--check")) {
        int fd = load(NULL, 0);
        if (fd < 0)
            return 1;
        close(fd);
        return 0;
    }
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
