/* Fake libnvidia-ml.so.1: reads the simulated devices from the state file. As the real NVML it
 * ignores CUDA_VISIBLE_DEVICES and reports host pids (translated from the pid namespace each
 * process recorded). Functions that are not here are simply not exported, so the real pynvml
 * raises NVMLError_FunctionNotFound for them. */
#include "fakegpu.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NO_PERMISSION = 4,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_UNKNOWN = 999,
};

struct nvml_dev { uint32_t magic; int index; };
typedef struct nvml_dev *nvmlDevice_t;
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned version; unsigned long long total, reserved, free, used; } nvmlMemory_v2_t;
typedef struct { unsigned gpu, memory; } nvmlUtilization_t;
typedef struct { unsigned pid; unsigned long long usedGpuMemory; } nvmlProcessInfo_v1_t;
typedef struct { unsigned pid; unsigned long long usedGpuMemory; unsigned gpuInstanceId, computeInstanceId; } nvmlProcessInfo_t;
typedef struct { unsigned pid; unsigned long long timeStamp; unsigned smUtil, memUtil, encUtil, decUtil; } nvmlProcessUtilizationSample_t;
typedef struct {
    char busIdLegacy[16];
    unsigned domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

#define DEV_MAGIC 0x4e564d4cu
#define NOT_AVAILABLE 0xFFFFFFFFu

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static fg_state S = {.fd = -1, .own_slot = -1};
static int g_refs;
static struct nvml_dev g_devs[FG_MAX_DEV];
static uint32_t g_usable; /* bit d: this process could open device d's node at init */

static void atfork_child(void)
{
    pthread_mutex_init(&g_mu, NULL);
    if (S.fd >= 0)
        pthread_mutex_init(&S.mu, NULL);
}
__attribute__((constructor)) static void nvml_load(void) { pthread_atfork(NULL, NULL, atfork_child); }

static nvmlReturn_t init(void)
{
    pthread_mutex_lock(&g_mu);
    nvmlReturn_t r = NVML_SUCCESS;
    if (g_refs == 0) {
        if (fg_open(&S, NULL) != 0) {
            r = NVML_ERROR_DRIVER_NOT_LOADED;
        } else if (!fg_node_open(&S, FG_NODE_CTL)) {
            fg_close(&S); /* as the real NVML when /dev/nvidiactl does not open */
            r = NVML_ERROR_NO_PERMISSION;
        } else {
            g_usable = fg_usable(&S);
            for (uint32_t i = 0; i < S.h->ndev; i++)
                g_devs[i] = (struct nvml_dev){DEV_MAGIC, (int)i};
        }
    }
    if (r == NVML_SUCCESS)
        g_refs++;
    pthread_mutex_unlock(&g_mu);
    return r;
}

FG_API nvmlReturn_t nvmlInit_v2(void) { return init(); }
FG_API nvmlReturn_t nvmlInit(void) { return init(); }
FG_API nvmlReturn_t nvmlInitWithFlags(unsigned flags) { (void)flags; return init(); }

FG_API nvmlReturn_t nvmlShutdown(void)
{
    pthread_mutex_lock(&g_mu);
    nvmlReturn_t r = NVML_SUCCESS;
    if (g_refs == 0)
        r = NVML_ERROR_UNINITIALIZED;
    else if (--g_refs == 0)
        fg_close(&S);
    pthread_mutex_unlock(&g_mu);
    return r;
}

__attribute__((destructor)) static void nvml_unload(void)
{
    if (g_refs)
        fg_close(&S);
    g_refs = 0;
}

FG_API const char *nvmlErrorString(nvmlReturn_t r)
{
    switch (r) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    default: return "Unknown Error";
    }
}

static int ready(void) { return g_refs > 0; }

static nvmlReturn_t dev_of(nvmlDevice_t d, struct fg_device **out)
{
    if (!ready())
        return NVML_ERROR_UNINITIALIZED;
    if (!d || d->magic != DEV_MAGIC || d->index < 0 || (uint32_t)d->index >= S.h->ndev)
        return NVML_ERROR_INVALID_ARGUMENT;
    uint32_t fail = __atomic_load_n(&S.h->dev[d->index].nvml_fail, __ATOMIC_ACQUIRE);
    if (fail)
        return (nvmlReturn_t)fail; /* a device fallen off the bus, an XID storm...: see colo-fakegpu */
    *out = &S.h->dev[d->index];
    return NVML_SUCCESS;
}

/* dev_of, then INVALID_ARGUMENT where the arguments are not ok: the order every getter checks in. */
static nvmlReturn_t dev_arg(nvmlDevice_t d, struct fg_device **out, int ok)
{
    nvmlReturn_t r = dev_of(d, out);
    return r ? r : ok ? NVML_SUCCESS : NVML_ERROR_INVALID_ARGUMENT;
}

static nvmlReturn_t copy_str(char *buf, unsigned len, const char *s)
{
    if (!buf)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(s) + 1 > len)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(buf, s, strlen(s) + 1);
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlSystemGetDriverVersion(char *v, unsigned len)
{
    return ready() ? copy_str(v, len, "550.54.15") : NVML_ERROR_UNINITIALIZED;
}
FG_API nvmlReturn_t nvmlSystemGetNVMLVersion(char *v, unsigned len)
{
    return ready() ? copy_str(v, len, "12.550.54.15") : NVML_ERROR_UNINITIALIZED;
}
FG_API nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *v)
{
    if (!v)
        return NVML_ERROR_INVALID_ARGUMENT;
    *v = 12040;
    return NVML_SUCCESS;
}
FG_API nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *v) { return nvmlSystemGetCudaDriverVersion(v); }

/* As the real NVML (5.319+): _v2 counts every device, and a handle of one this process may not open
 * is NVML_ERROR_NO_PERMISSION; the old _v1 pair counts and indexes only those it may open. */
FG_API nvmlReturn_t nvmlDeviceGetCount_v2(unsigned *n)
{
    if (!ready())
        return NVML_ERROR_UNINITIALIZED;
    if (!n)
        return NVML_ERROR_INVALID_ARGUMENT;
    *n = S.h->ndev;
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlDeviceGetCount(unsigned *n)
{
    nvmlReturn_t r = nvmlDeviceGetCount_v2(n);
    if (r == NVML_SUCCESS)
        *n = (unsigned)__builtin_popcount(g_usable & ((1u << S.h->ndev) - 1));
    return r;
}

FG_API nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned i, nvmlDevice_t *d)
{
    if (!ready())
        return NVML_ERROR_UNINITIALIZED;
    if (!d || i >= S.h->ndev)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!(g_usable & (1u << i)))
        return NVML_ERROR_NO_PERMISSION;
    uint32_t fail = __atomic_load_n(&S.h->dev[i].nvml_fail, __ATOMIC_ACQUIRE);
    if (fail)
        return (nvmlReturn_t)fail;
    *d = &g_devs[i];
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned i, nvmlDevice_t *d)
{
    if (!ready())
        return NVML_ERROR_UNINITIALIZED;
    for (unsigned k = 0; k < S.h->ndev; k++)
        if ((g_usable & (1u << k)) && i-- == 0)
            return nvmlDeviceGetHandleByIndex_v2(k, d);
    return NVML_ERROR_INVALID_ARGUMENT;
}

FG_API nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *d)
{
    if (!ready())
        return NVML_ERROR_UNINITIALIZED;
    if (!uuid || !d)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (uint32_t i = 0; i < S.h->ndev; i++)
        if (strcasecmp(S.h->dev[i].uuid, uuid) == 0) {
            if (!(g_usable & (1u << i)))
                return NVML_ERROR_NO_PERMISSION;
            *d = &g_devs[i];
            return NVML_SUCCESS;
        }
    return NVML_ERROR_NOT_FOUND;
}

FG_API nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t d, unsigned *i)
{
    struct fg_device *dv;
    nvmlReturn_t r = dev_arg(d, &dv, i != NULL);
    if (r)
        return r;
    *i = (unsigned)d->index;
    return NVML_SUCCESS;
}
FG_API nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t d, unsigned *i) { return nvmlDeviceGetIndex(d, i); }

FG_API nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *buf, unsigned len)
{
    struct fg_device *dv;
    nvmlReturn_t r = dev_of(d, &dv);
    return r ? r : copy_str(buf, len, dv->name);
}

FG_API nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *buf, unsigned len)
{
    struct fg_device *dv;
    nvmlReturn_t r = dev_of(d, &dv);
    return r ? r : copy_str(buf, len, dv->uuid);
}

FG_API nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t d, nvmlPciInfo_t *p)
{
    struct fg_device *dv;
    nvmlReturn_t r = dev_arg(d, &dv, p != NULL);
    if (r)
        return r;
    memset(p, 0, sizeof *p);
    p->bus = dv->pci_bus;
    p->pciDeviceId = 0x20b010de;
    snprintf(p->busId, sizeof p->busId, "00000000:%02X:00.0", dv->pci_bus);
    snprintf(p->busIdLegacy, sizeof p->busIdLegacy, "0000:%02X:00.0", dv->pci_bus);
    return NVML_SUCCESS;
}

/* Memory and processes are read under the state lock, after reaping dead processes. */
static void mem_read(int idx, uint64_t *total, uint64_t *used)
{
    fg_lock(&S);
    fg_reap(&S);
    *total = S.h->dev[idx].total;
    *used = S.h->dev[idx].used;
    fg_unlock(&S);
}

FG_API nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m)
{
    struct fg_device *dv;
    nvmlReturn_t r = dev_arg(d, &dv, m != NULL);
    if (r)
        return r;
    uint64_t total, used;
    mem_read(d->index, &total, &used);
    *m = (nvmlMemory_t){.total = total, .used = used, .free = total - used};
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t d, nvmlMemory_v2_t *m)
{
    struct fg_device *dv;
    nvmlReturn_t r = dev_arg(d, &dv, m != NULL);
    if (r)
        return r;
    if (m->version != (unsigned)(sizeof(nvmlMemory_v2_t) | (2u << 24)))
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    uint64_t total, used;
    mem_read(d->index, &total, &used);
    m->total = total;
    m->reserved = 0;
    m->used = used;
    m->free = total - used;
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t d, nvmlUtilization_t *u)
{
    struct fg_device *dv;
    nvmlReturn_t r = dev_arg(d, &dv, u != NULL);
    if (r)
        return r;
    int sm = 0, bw = 0;
    fg_lock(&S);
    fg_device_procs(&S, d->index, NULL, 0, &sm, &bw);
    fg_unlock(&S);
    u->gpu = (unsigned)sm;
    u->memory = (unsigned)bw;
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlDeviceGetComputeMode(nvmlDevice_t d, int *mode)
{
    struct fg_device *dv;
    nvmlReturn_t r = dev_arg(d, &dv, mode != NULL);
    if (r)
        return r;
    *mode = (int)dv->compute_mode;
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlDeviceSetComputeMode(nvmlDevice_t d, int mode)
{
    struct fg_device *dv;
    nvmlReturn_t r =
        dev_arg(d, &dv, mode == FG_MODE_DEFAULT || mode == FG_MODE_PROHIBITED || mode == FG_MODE_EXCLUSIVE_PROCESS);
    if (r)
        return r;
    if (geteuid() != 0) /* as on the real driver, root only */
        return NVML_ERROR_NO_PERMISSION;
    fg_lock(&S);
    dv->compute_mode = (uint32_t)mode;
    fg_unlock(&S);
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t d, int *major, int *minor)
{
    struct fg_device *dv;
    nvmlReturn_t r = dev_arg(d, &dv, major && minor);
    if (r)
        return r;
    *major = (int)dv->cc_major;
    *minor = (int)dv->cc_minor;
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t d, unsigned *cur, unsigned *pending)
{
    struct fg_device *dv;
    nvmlReturn_t r = dev_arg(d, &dv, cur && pending);
    if (r)
        return r;
    *cur = *pending = 0; /* NVML_DEVICE_MIG_DISABLE */
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t d, int sensor, unsigned *t)
{
    nvmlUtilization_t u;
    nvmlReturn_t r = nvmlDeviceGetUtilizationRates(d, &u);
    if (r)
        return r;
    if (!t || sensor != 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    *t = 35 + u.gpu * 45 / 100;
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t d, unsigned *mw)
{
    nvmlUtilization_t u;
    nvmlReturn_t r = nvmlDeviceGetUtilizationRates(d, &u);
    if (r)
        return r;
    if (!mw)
        return NVML_ERROR_INVALID_ARGUMENT;
    *mw = 50000 + u.gpu * 3000; /* 50 W idle .. 350 W busy */
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t d, unsigned *mw)
{
    struct fg_device *dv;
    nvmlReturn_t r = dev_arg(d, &dv, mw != NULL);
    if (r)
        return r;
    *mw = 350000;
    return NVML_SUCCESS;
}

/* want_mps: 0 = compute processes (ordinary contexts and MPS servers), 1 = MPS clients. */
static nvmlReturn_t procs(nvmlDevice_t d, unsigned *count, void *infos, int v1, int want_mps)
{
    struct fg_device *dv;
    nvmlReturn_t r = dev_arg(d, &dv, count && (!*count || infos));
    if (r)
        return r;
    struct fg_proc all[FG_MAX_SLOTS];
    fg_lock(&S);
    int n = fg_device_procs(&S, d->index, all, FG_MAX_SLOTS, NULL, NULL);
    fg_unlock(&S);
    unsigned k = 0;
    for (int i = 0; i < n; i++)
        if ((all[i].kind == FG_KIND_MPS_CLIENT) == want_mps)
            all[k++] = all[i];
    if (*count < k) {
        *count = k;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned i = 0; i < k; i++) {
        if (v1)
            ((nvmlProcessInfo_v1_t *)infos)[i] = (nvmlProcessInfo_v1_t){(unsigned)all[i].pid, all[i].used};
        else
            ((nvmlProcessInfo_t *)infos)[i] =
                (nvmlProcessInfo_t){(unsigned)all[i].pid, all[i].used, NOT_AVAILABLE, NOT_AVAILABLE};
    }
    *count = k;
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned *c, nvmlProcessInfo_t *p) { return procs(d, c, p, 0, 0); }
FG_API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t d, unsigned *c, nvmlProcessInfo_t *p) { return procs(d, c, p, 0, 0); }
FG_API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t d, unsigned *c, nvmlProcessInfo_v1_t *p) { return procs(d, c, p, 1, 0); }
FG_API nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v3(nvmlDevice_t d, unsigned *c, nvmlProcessInfo_t *p) { return procs(d, c, p, 0, 1); }
FG_API nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v2(nvmlDevice_t d, unsigned *c, nvmlProcessInfo_t *p) { return procs(d, c, p, 0, 1); }
FG_API nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses(nvmlDevice_t d, unsigned *c, nvmlProcessInfo_v1_t *p) { return procs(d, c, p, 1, 1); }

FG_API nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t d, unsigned *c, nvmlProcessInfo_t *p)
{
    struct fg_device *dv;
    nvmlReturn_t r = dev_arg(d, &dv, c != NULL);
    (void)p;
    if (r)
        return r;
    *c = 0;
    return NVML_SUCCESS;
}
FG_API nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t d, unsigned *c, nvmlProcessInfo_t *p)
{
    return nvmlDeviceGetGraphicsRunningProcesses_v3(d, c, p);
}

/* Under lock. Server attribution: each MPS client's activity is added to its server's sample and the
 * client has none of its own (a client whose server is not on this device keeps its own). */
static int fold_into_servers(struct fg_proc *all, int n)
{
    int k = 0;
    for (int i = 0; i < n; i++) {
        struct fg_slot *c = &S.h->slot[all[i].slot];
        int to = -1;
        for (int j = 0; c->kind == FG_KIND_MPS_CLIENT && j < n; j++)
            if (all[j].kind == FG_KIND_MPS_SERVER && S.h->slot[all[j].slot].pid == c->server_pid)
                to = j;
        if (to < 0)
            continue;
        all[to].sm = fg_pct(all[to].sm + all[i].sm);
        all[to].membw = fg_pct(all[to].membw + all[i].membw);
        all[i].kind = -1; /* folded */
    }
    for (int i = 0; i < n; i++)
        if (all[i].kind != -1)
            all[k++] = all[i];
    return k;
}

/* One sample per process with a context, stamped now; NOT_FOUND when there is none (as NVML).
 * Under MPS, whose pid carries a client's activity follows fg_mps_attribution(). */
FG_API nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t d, nvmlProcessUtilizationSample_t *s,
                                                    unsigned *count, unsigned long long last_seen)
{
    struct fg_device *dv;
    nvmlReturn_t r = dev_arg(d, &dv, count != NULL);
    (void)last_seen;
    if (r)
        return r;
    struct fg_proc all[FG_MAX_SLOTS];
    fg_lock(&S);
    int n = fg_device_procs(&S, d->index, all, FG_MAX_SLOTS, NULL, NULL);
    if (fg_mps_attribution(&S) == FG_ATTR_SERVER)
        n = fold_into_servers(all, n);
    fg_unlock(&S);
    if (n == 0) {
        *count = 0;
        return NVML_ERROR_NOT_FOUND;
    }
    if (!s || *count < (unsigned)n) {
        *count = (unsigned)n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    unsigned long long now_us = fg_now_ns() / 1000;
    for (int i = 0; i < n; i++)
        s[i] = (nvmlProcessUtilizationSample_t){(unsigned)all[i].pid, now_us, (unsigned)all[i].sm,
                                                (unsigned)all[i].membw, 0, 0};
    *count = (unsigned)n;
    return NVML_SUCCESS;
}

/* Health as colo and the NVIDIA device plugin read it: uncorrectable ECC errors (and so a page
 * retirement pending until the GPU is reset), and Xid critical errors through an event set.
 * `colo-fakegpu ecc` and `colo-fakegpu xid` raise them. */
enum { NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1, NVML_ERROR_TIMEOUT = 10, NVML_ERROR_MEMORY = 20 };
#define EVENT_XID 0x8ULL /* nvmlEventTypeXidCriticalError: the only kind simulated */
#define SET_MAGIC 0x4e564556u

FG_API nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t d, int type, int counter, unsigned long long *count)
{
    struct fg_device *dv;
    nvmlReturn_t r = dev_arg(d, &dv, count != NULL && (type == 0 || type == 1) && (counter == 0 || counter == 1));
    if (r)
        return r;
    *count = type == NVML_MEMORY_ERROR_TYPE_UNCORRECTED ? __atomic_load_n(&dv->ecc_dbe, __ATOMIC_ACQUIRE) : 0;
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t d, int *pending)
{
    struct fg_device *dv;
    nvmlReturn_t r = dev_arg(d, &dv, pending != NULL);
    if (r)
        return r;
    *pending = __atomic_load_n(&dv->ecc_dbe, __ATOMIC_ACQUIRE) > 0;
    return NVML_SUCCESS;
}

/* A set remembers, per device, how far into the device's Xid sequence it has delivered: an event
 * raised before the device was registered is not delivered (as NVML's), several raised between two
 * waits are delivered as one, with the latest code. */
struct nvml_event_set { uint32_t magic; uint64_t types[FG_MAX_DEV]; uint32_t seen[FG_MAX_DEV]; };
typedef struct nvml_event_set *nvmlEventSet_t;
typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType, eventData;
    unsigned gpuInstanceId, computeInstanceId;
} nvmlEventData_t;

FG_API nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set)
{
    if (!ready())
        return NVML_ERROR_UNINITIALIZED;
    if (!set)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!(*set = calloc(1, sizeof **set)))
        return NVML_ERROR_MEMORY;
    (*set)->magic = SET_MAGIC;
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set)
{
    if (!set || set->magic != SET_MAGIC)
        return NVML_ERROR_INVALID_ARGUMENT;
    set->magic = 0;
    free(set);
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t d, unsigned long long *types)
{
    struct fg_device *dv;
    nvmlReturn_t r = dev_arg(d, &dv, types != NULL);
    if (r)
        return r;
    *types = EVENT_XID;
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t d, unsigned long long types, nvmlEventSet_t set)
{
    struct fg_device *dv;
    nvmlReturn_t r = dev_arg(d, &dv, set != NULL && set->magic == SET_MAGIC);
    if (r)
        return r;
    if (types & ~EVENT_XID)
        return NVML_ERROR_NOT_SUPPORTED;
    set->types[d->index] |= types;
    set->seen[d->index] = __atomic_load_n(&dv->xid_seq, __ATOMIC_ACQUIRE);
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned timeout_ms)
{
    if (!ready())
        return NVML_ERROR_UNINITIALIZED;
    if (!set || set->magic != SET_MAGIC || !data)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned waited = 0;; waited += 10) {
        for (uint32_t i = 0; i < S.h->ndev; i++) {
            uint32_t seq = __atomic_load_n(&S.h->dev[i].xid_seq, __ATOMIC_ACQUIRE);
            if (!(set->types[i] & EVENT_XID) || seq == set->seen[i])
                continue;
            set->seen[i] = seq;
            *data = (nvmlEventData_t){&g_devs[i], EVENT_XID,
                                      __atomic_load_n(&S.h->dev[i].xid_last, __ATOMIC_ACQUIRE), 0xFFFFFFFFu,
                                      0xFFFFFFFFu};
            return NVML_SUCCESS;
        }
        if (waited >= timeout_ms)
            return NVML_ERROR_TIMEOUT;
        usleep(10000);
    }
}

FG_API nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_t *data, unsigned timeout_ms)
{
    return nvmlEventSetWait_v2(set, data, timeout_ms);
}
