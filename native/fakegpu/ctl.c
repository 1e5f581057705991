/* colo-fakegpu: create, inspect and change a simulated-GPU state file.
 *
 *   colo-fakegpu create PATH [--count N] [--mem SIZE] [--name NAME] [--sms N] [--uuid UUID]...
 *   colo-fakegpu show PATH                      JSON on stdout (pids as this process sees them)
 *   colo-fakegpu set-compute-mode PATH INDEX default|exclusive_process|prohibited
 *   colo-fakegpu set-sms PATH INDEX N           SM count (CUDA's default order is fastest first)
 *   colo-fakegpu fail-nvml PATH INDEX|all lost|unknown|CODE|off
 *                                               NVML queries of the device fail with that code
 *   colo-fakegpu xid PATH INDEX CODE            an Xid error event on the device (NVML event sets)
 *   colo-fakegpu ecc PATH INDEX N               N more uncorrectable ECC errors (retirement pending)
 *   colo-fakegpu mps-attribution PATH client|server
 *                                               whose pid NVML's per-process samples give MPS
 *                                               clients' activity ($COLO_FAKEGPU_MPS_ATTRIBUTION
 *                                               in a reading process overrides it)
 */
#include "fakegpu.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int usage(void)
{
    fprintf(stderr,
            "usage: colo-fakegpu create PATH [--count N] [--mem SIZE] [--name NAME] [--sms N] [--uuid UUID]...\n"
            "       colo-fakegpu show PATH\n"
            "       colo-fakegpu set-compute-mode PATH INDEX default|exclusive_process|prohibited\n"
            "       colo-fakegpu set-sms PATH INDEX N\n"
            "       colo-fakegpu fail-nvml PATH INDEX|all lost|unknown|CODE|off\n"
            "       colo-fakegpu xid PATH INDEX CODE\n"
            "       colo-fakegpu ecc PATH INDEX N\n"
            "       colo-fakegpu mps-attribution PATH client|server\n");
    return 2;
}

static const char *mode_name(uint32_t m)
{
    return m == FG_MODE_EXCLUSIVE_PROCESS ? "exclusive_process" : m == FG_MODE_PROHIBITED ? "prohibited" : "default";
}

static const char *kind_name(int k)
{
    return k == FG_KIND_MPS_CLIENT ? "mps_client" : k == FG_KIND_MPS_SERVER ? "mps_server" : "process";
}

static void json_str(const char *s)
{
    putchar('"');
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\')
            printf("\\%c", c);
        else if (c < 0x20)
            printf("\\u%04x", c);
        else
            putchar(c);
    }
    putchar('"');
}

static int cmd_create(int argc, char **argv)
{
    int count = 2, sms = 108, nuuid = 0;
    uint64_t mem = 16ull << 30;
    const char *name = "Colo Simulated GPU";
    char *uuids[FG_MAX_DEV];
    for (int i = 3; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v)
            return usage();
        if (!strcmp(a, "--count")) {
            char *end;
            count = (int)strtol(v, &end, 10);
            if (*end || end == v)
                return usage();
        }
        else if (!strcmp(a, "--mem")) {
            if (fg_parse_size(v, &mem) != 0)
                return usage();
        } else if (!strcmp(a, "--name"))
            name = v;
        else if (!strcmp(a, "--sms"))
            sms = atoi(v);
        else if (!strcmp(a, "--uuid") && nuuid < FG_MAX_DEV)
            uuids[nuuid++] = (char *)v;
        else
            return usage();
        i++;
    }
    int r = fg_create(argv[2], count, mem, name, sms, uuids, nuuid);
    if (r != 0) {
        fprintf(stderr, "colo-fakegpu: cannot create %s: %s\n", argv[2], strerror(-r));
        return 1;
    }
    return 0;
}

static int cmd_show(fg_state *s)
{
    static struct fg_proc procs[FG_MAX_SLOTS];
    printf("{\"devices\": [");
    for (uint32_t d = 0; d < s->h->ndev; d++) {
        int sm = 0, bw = 0;
        fg_lock(s);
        int n = fg_device_procs(s, (int)d, procs, FG_MAX_SLOTS, &sm, &bw);
        struct fg_device dv = s->h->dev[d];
        fg_unlock(s);
        printf("%s{\"index\": %u, \"uuid\": ", d ? ", " : "", d);
        json_str(dv.uuid);
        printf(", \"name\": ");
        json_str(dv.name);
        printf(", \"total\": %llu, \"used\": %llu, \"free\": %llu, \"sms\": %u, \"compute_mode\": \"%s\", "
               "\"cc\": [%u, %u], \"sm_util\": %d, \"mem_util\": %d, \"processes\": [",
               (unsigned long long)dv.total, (unsigned long long)dv.used,
               (unsigned long long)(dv.total - dv.used), dv.sms, mode_name(dv.compute_mode), dv.cc_major,
               dv.cc_minor, sm, bw);
        for (int i = 0; i < n && i < FG_MAX_SLOTS; i++)
            printf("%s{\"pid\": %d, \"uid\": %u, \"used\": %llu, \"kind\": \"%s\", \"mps\": %s, \"sm\": %d, "
                   "\"membw\": %d}",
                   i ? ", " : "", procs[i].pid, procs[i].uid, (unsigned long long)procs[i].used,
                   kind_name(procs[i].kind), procs[i].kind == FG_KIND_MPS_CLIENT ? "true" : "false",
                   procs[i].sm, procs[i].membw);
        printf("]}");
    }
    printf("]}\n");
    return 0;
}

static int cmd_mode(fg_state *s, const char *idx, const char *mode)
{
    int d = atoi(idx), m;
    if (!strcmp(mode, "default"))
        m = FG_MODE_DEFAULT;
    else if (!strcmp(mode, "exclusive_process"))
        m = FG_MODE_EXCLUSIVE_PROCESS;
    else if (!strcmp(mode, "prohibited"))
        m = FG_MODE_PROHIBITED;
    else
        return usage();
    if (d < 0 || (uint32_t)d >= s->h->ndev) {
        fprintf(stderr, "colo-fakegpu: no device %s\n", idx);
        return 1;
    }
    fg_lock(s);
    s->h->dev[d].compute_mode = (uint32_t)m;
    fg_unlock(s);
    return 0;
}

static int cmd_sms(fg_state *s, const char *idx, const char *n)
{
    int d = atoi(idx), v = atoi(n);
    if (d < 0 || (uint32_t)d >= s->h->ndev || v <= 0) {
        fprintf(stderr, "colo-fakegpu: no device %s, or SM count %s not positive\n", idx, n);
        return 1;
    }
    fg_lock(s);
    s->h->dev[d].sms = (uint32_t)v;
    fg_unlock(s);
    return 0;
}

static int cmd_fail_nvml(fg_state *s, const char *idx, const char *how)
{
    char *end = "";
    long code;
    if (!strcmp(how, "off"))
        code = 0;
    else if (!strcmp(how, "lost"))
        code = 15; /* NVML_ERROR_GPU_IS_LOST */
    else if (!strcmp(how, "unknown"))
        code = 999; /* NVML_ERROR_UNKNOWN */
    else
        code = strtol(how, &end, 10);
    if (*end || code < 0)
        return usage();
    int all = !strcmp(idx, "all"), d = all ? 0 : atoi(idx);
    if (!all && (d < 0 || (uint32_t)d >= s->h->ndev)) {
        fprintf(stderr, "colo-fakegpu: no device %s\n", idx);
        return 1;
    }
    fg_lock(s);
    for (uint32_t i = 0; i < s->h->ndev; i++)
        if (all || i == (uint32_t)d)
            __atomic_store_n(&s->h->dev[i].nvml_fail, (uint32_t)code, __ATOMIC_RELEASE);
    fg_unlock(s);
    return 0;
}

/* A simulated fault: an Xid event (`xid`: its code) or uncorrectable ECC errors (`ecc`: how many). */
static int cmd_fault(fg_state *s, const char *what, const char *idx, const char *n)
{
    char *end = NULL;
    long d = strtol(idx, &end, 10);
    if (*end || d < 0 || (uint32_t)d >= s->h->ndev) {
        fprintf(stderr, "colo-fakegpu: no device %s\n", idx);
        return 1;
    }
    unsigned long v = strtoul(n, &end, 10);
    if (*end || !*n || v == 0 || v > 0xFFFFFFFFul) {
        fprintf(stderr, "colo-fakegpu: %s needs a positive number, not %s\n", what, n);
        return 1;
    }
    struct fg_device *dv = &s->h->dev[d];
    fg_lock(s);
    if (!strcmp(what, "xid")) {
        __atomic_store_n(&dv->xid_last, (uint32_t)v, __ATOMIC_RELEASE);
        __atomic_add_fetch(&dv->xid_seq, 1, __ATOMIC_RELEASE); /* after the code: a reader sees both */
    } else {
        __atomic_add_fetch(&dv->ecc_dbe, (uint64_t)v, __ATOMIC_RELEASE);
    }
    fg_unlock(s);
    return 0;
}

static int cmd_attribution(fg_state *s, const char *how)
{
    uint32_t v;
    if (!strcmp(how, "client"))
        v = FG_ATTR_CLIENT;
    else if (!strcmp(how, "server"))
        v = FG_ATTR_SERVER;
    else
        return usage();
    __atomic_store_n(&s->h->mps_attribution, v, __ATOMIC_RELEASE);
    return 0;
}

int main(int argc, char **argv)
{
    /* `create --help` once made a state file named --help: a PATH never starts with '-' (./-x does) */
    if (argc < 3 || argv[2][0] == '-')
        return usage();
    if (!strcmp(argv[1], "create"))
        return cmd_create(argc, argv);
    fg_state s;
    int r = fg_open(&s, argv[2]);
    if (r != 0) {
        fprintf(stderr, "colo-fakegpu: cannot open %s: %s\n", argv[2],
                r == -22 ? "not a simulated GPU state file" : strerror(-r));
        return 1;
    }
    if (!strcmp(argv[1], "show") && argc == 3)
        r = cmd_show(&s);
    else if (!strcmp(argv[1], "set-compute-mode") && argc == 5)
        r = cmd_mode(&s, argv[3], argv[4]);
    else if (!strcmp(argv[1], "set-sms") && argc == 5)
        r = cmd_sms(&s, argv[3], argv[4]);
    else if (!strcmp(argv[1], "fail-nvml") && argc == 5)
        r = cmd_fail_nvml(&s, argv[3], argv[4]);
    else if ((!strcmp(argv[1], "xid") || !strcmp(argv[1], "ecc")) && argc == 5)
        r = cmd_fault(&s, argv[1], argv[3], argv[4]);
    else if (!strcmp(argv[1], "mps-attribution") && argc == 4)
        r = cmd_attribution(&s, argv[3]);
    else
        r = usage();
    fg_close(&s);
    return r;
}
