/* Shared state of the simulated GPUs: layout of the state file and the helpers that every part of
 * the fake (libcuda, libnvidia-ml, the MPS control daemon, the colo-fakegpu CLI) links in.
 * Nothing here is exported from the shared libraries (they are built with -fvisibility=hidden).
 * The layout is documented in native/README.md; bump FG_VERSION when it changes. */
#ifndef COLO_FAKEGPU_H
#define COLO_FAKEGPU_H

#include <pthread.h>
#include <stdint.h>
#include <sys/types.h>

#define FG_API __attribute__((visibility("default")))

#define FG_MAGIC "COLOFGPU"
#define FG_VERSION 1
#define FG_MAX_DEV 16
#define FG_MAX_SLOTS 512
/* Byte offsets of the advisory OFD locks (they may lie past the end of the file). */
#define FG_LOCK_GLOBAL 0
#define FG_LOCK_SLOT_BASE (1LL << 30)

enum { FG_MODE_DEFAULT = 0, FG_MODE_PROHIBITED = 2, FG_MODE_EXCLUSIVE_PROCESS = 3 };
enum { FG_SLOT_FREE = 0, FG_SLOT_LIVE = 1 };
enum { FG_KIND_PROC = 0, FG_KIND_MPS_CLIENT = 1, FG_KIND_MPS_SERVER = 2 };
/* NVML per-process utilisation of MPS clients: each client's own pid (client), or all of a server's
 * clients' activity under the server's pid, as some real drivers report it (server). */
enum { FG_ATTR_CLIENT = 0, FG_ATTR_SERVER = 1 };
/* Slot flags written by the MPS daemon into a client's slot. */
enum { FG_F_TERMINATED = 1, FG_F_FAULT = 2 };

struct fg_device {
    char name[96];
    char uuid[64];        /* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" */
    uint64_t total;       /* bytes */
    uint64_t used;        /* bytes; always the sum of the live slots' used[] for this device */
    uint32_t sms;
    uint32_t compute_mode;
    uint32_t cc_major, cc_minor;
    uint32_t pci_bus;
    uint32_t nvml_fail;   /* non-zero: every NVML query of this device returns this code (tests) */
    uint32_t xid_seq;     /* bumped at each simulated Xid error: event sets deliver what is new to them */
    uint32_t xid_last;    /* the latest Xid's code */
    uint64_t ecc_dbe;     /* uncorrectable (double-bit) ECC errors since the driver loaded; >0: retirement pending */
    uint64_t spare[4];
};

struct fg_slot {
    uint32_t state;        /* FG_SLOT_* */
    uint32_t kind;         /* FG_KIND_* */
    int32_t pid;           /* getpid() in the owner's own pid namespace */
    uint32_t uid;
    uint64_t pidns;        /* inode of the owner's /proc/self/ns/pid */
    uint64_t start_ns;     /* CLOCK_REALTIME at claim */
    uint32_t gen;          /* bumped at each claim, so stale references can be detected */
    uint32_t ctx_mask;     /* bit d: the process holds a context on physical device d */
    uint32_t flags;        /* FG_F_* */
    int32_t server_pid;    /* MPS client: its server's pid as the control daemon sees it */
    int32_t sm_pct;        /* simulated SM activity the process claims (0..100) */
    int32_t membw_pct;     /* simulated memory-bandwidth activity (0..100) */
    int32_t thread_pct;    /* MPS active thread percentage (caps sm_pct), 100 otherwise */
    int32_t pad;
    char comm[16];
    uint64_t used[FG_MAX_DEV];   /* bytes allocated on each physical device */
    uint64_t limit[FG_MAX_DEV];  /* MPS pinned device memory limit, 0 = none */
};

struct fg_header {
    char magic[8];
    uint32_t version;
    uint32_t ndev;
    uint32_t nslots;
    uint32_t hwm;          /* slots [0, hwm) have ever been used: scans stop there */
    uint64_t created_ns;
    uint32_t mps_attribution; /* FG_ATTR_*: whose process NVML's per-process samples name for MPS work */
    uint32_t pad0;
    uint64_t spare[3];
    struct fg_device dev[FG_MAX_DEV];
    struct fg_slot slot[FG_MAX_SLOTS];
};

typedef struct fg_state {
    int fd;
    struct fg_header *h;
    uint64_t my_pidns;
    int own_slot;          /* slot this process holds through this fd (-1): never reaped by itself */
    pthread_mutex_t mu;    /* OFD locks do not exclude threads sharing the fd */
} fg_state;

/* One process as a reader sees it (pids translated into the reader's pid namespace). */
struct fg_proc {
    int slot;
    int pid;
    uint32_t uid;
    int kind;
    uint64_t used;
    int sm, membw;         /* this process's share of the device's activity */
    uint64_t start_ns;
};

int fg_open(fg_state *s, const char *path);            /* 0 or -errno; path NULL: $COLO_FAKEGPU_STATE */
void fg_close(fg_state *s);
int fg_create(const char *path, int count, uint64_t mem, const char *name, int sms,
              char *const *uuids, int nuuids);       /* 0 or -errno */
void fg_lock(fg_state *s);
void fg_unlock(fg_state *s);
int fg_slot_alive(fg_state *s, int i);                 /* under lock */
void fg_reap(fg_state *s);                             /* under lock: frees slots of dead processes */
int fg_claim_slot(fg_state *s, int kind);              /* under lock: index, or -1 when full */
void fg_release_slot(fg_state *s, int i);              /* under lock */
void fg_slot_drop_memory(fg_state *s, int i);          /* under lock: return a slot's memory */
uint64_t fg_pidns_of(const char *procdir);             /* inode of <procdir>/ns/pid, 0 if unknown */
int fg_translate_pid(fg_state *s, int pid, uint64_t pidns);  /* to the caller's namespace, 0 if unknown */
/* Under lock: processes with a context on physical device d, and the device's utilisation. */
int fg_device_procs(fg_state *s, int d, struct fg_proc *out, int max, int *sm_util, int *mem_util);
/* CUDA_VISIBLE_DEVICES -> physical, over the devices in `usable` (bit d: device d may be opened). */
int fg_parse_visible(fg_state *s, const char *env, int *map, uint32_t usable);
/* Device nodes, as the real driver's /dev/nvidiactl, /dev/nvidia-uvm and /dev/nvidiaN: the folder
 * "<state file>.dev" beside the state file (found from the opened file's own path, so no variable
 * can point elsewhere). Each is tried with open(O_RDWR) as the real driver does, so file modes and
 * a devices cgroup both decide; a character device no driver serves here (ENXIO) passed both.
 * Without the folder every node opens (a state made before nodes existed). */
#define FG_NODE_CTL (-1)
#define FG_NODE_UVM (-2)
int fg_node_open(fg_state *s, int which);              /* which: device index, FG_NODE_CTL/UVM; 1 or 0 */
uint32_t fg_usable(fg_state *s);                        /* bit d: /dev/nvidiaD opens */
int fg_parse_size(const char *text, uint64_t *out);    /* "4G", "512MiB", "1000" -> bytes */
int fg_pct(int v);
/* FG_ATTR_*: $COLO_FAKEGPU_MPS_ATTRIBUTION (client|server) in the reading process, else the state
 * file's setting (colo-fakegpu mps-attribution). */
int fg_mps_attribution(fg_state *s);
uint64_t fg_now_ns(void);

#endif
