/* Fake libcuda.so.1, stream-ordered memory: streams, memory pools and graph memory nodes.
 *
 * The model (bytes are fungible: no fragmentation):
 * - A stream reaches its enqueued work only when it is synchronised (cuStreamSynchronize, or
 *   cuCtxSynchronize for all streams); until then cuStreamQuery answers CUDA_ERROR_NOT_READY.
 * - A pool holds `reserved` device bytes: its live allocations (`used`), frees its streams have
 *   not reached yet (`pending`, per stream) and `idle` bytes. An allocation takes idle bytes first,
 *   then pending frees of its own stream (stream-ordered reuse), then new device bytes.
 * - At a synchronisation the reached frees become idle, and every pool gives idle bytes back to
 *   the device down to its release threshold (CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, default 0);
 *   cuMemPoolTrimTo gives idle bytes back down to the size asked.
 * - cuMemFreeAsync of memory that is not from a pool gives it back when the stream reaches it.
 * - Graph memory: each device has a graph pool (a pool that never trims by itself). A graph's
 *   alloc nodes (cuGraphAddMemAllocNode, or cuMemAllocAsync on a capturing stream) take their
 *   bytes from it when the graph is launched (idle bytes first, then frees pending on the launch
 *   stream, as stream order allows); free nodes give them back to it; allocations left outstanding
 *   are freed later like any pool allocation, or by the graph's next launch when it was
 *   instantiated with CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH. USED_MEM_CURRENT counts the
 *   graph allocations whose lifetime has not ended on the device (live, or freed on a stream that
 *   has not got there: still mapped). cuDeviceGraphMemTrim returns idle bytes.
 */
#include "cuda_internal.h"

#include <stdlib.h>
#include <string.h>

#define POOL_MAGIC 0x504f4f4cu
#define STREAM_MAGIC 0x5354524du
#define GRAPH_MAGIC 0x47525048u
#define EXEC_MAGIC 0x47455845u

struct fg_stream {
    uint32_t magic;
    struct fg_graph *capture; /* the graph being captured, if any */
    struct fg_stream *next;
};

struct pend {
    struct fg_stream *stream;
    struct fg_pool *pool; /* pool bytes; NULL: `a`, a plain allocation given back when reached */
    struct alloc *a;
    uint64_t bytes;
    struct fg_ctx *ctx;
    uint64_t seq;         /* order of enqueueing: an event recorded after it is reached after it */
    struct pend *next;
};

struct fg_pool {
    uint32_t magic;
    int ord, graph, dead;
    uint64_t reserved, used, idle, threshold, res_high, used_high;
    struct fg_pool *next;
};

/* Node types as the driver numbers them (CUgraphNodeType). */
enum { NODE_GRAPH = 4, NODE_EMPTY = 5, NODE_ALLOC = 10, NODE_FREE = 11 };

struct gnode {
    uint32_t magic;
    int type, ord;
    uint64_t bytes, dptr;
    struct fg_graph *child; /* NODE_GRAPH: the graph the node owns */
    struct gnode *next;
};

/* A graph, or an instantiated one (magic EXEC_MAGIC: its nodes are a flattened copy, child graphs
 * inlined). */
struct fg_graph {
    uint32_t magic;
    cuuint64_t flags; /* an instantiated graph's CUDA_GRAPH_INSTANTIATE_FLAG_* */
    struct gnode *nodes;
    struct fg_graph *next;
};

static struct fg_stream g_null_stream = {.magic = STREAM_MAGIC};
/* Synchronisations (stream or context) and trims (pool or graph memory) this process asked for:
 * what a layer above the driver costs the program in them (fakegpuCounts, for tests and benches). */
static unsigned long long g_syncs, g_trims;
static struct fg_stream *g_streams;
static struct pend *g_pend;
static uint64_t g_pend_seq;
static struct fg_pool g_defpool[FG_MAX_DEV], g_graphpool[FG_MAX_DEV];
static struct fg_pool *g_curpool[FG_MAX_DEV];
static struct fg_pool *g_pools;
static struct fg_graph *g_graphs;
static struct fg_graph *g_execs;

/* ---- streams ---------------------------------------------------------------------------- */

static struct fg_stream *stream_of(CUstream h)
{
    if (h == NULL || h == (CUstream)1 || h == (CUstream)2) /* legacy / per-thread default stream */
        return &g_null_stream;
    for (struct fg_stream *s = g_streams; s; s = s->next)
        if ((CUstream)s == h)
            return s;
    return NULL;
}

/* COLO_FAKEGPU_POOL_CHUNK (bytes; unset: 1): memory pools other than the graph pool get device
 * memory in whole chunks, as the real driver's do, and give back only whole idle chunks. */
static uint64_t pool_chunk(const struct fg_pool *p)
{
    static uint64_t chunk;
    if (p->graph)
        return 1;
    if (!chunk) {
        const char *v = getenv("COLO_FAKEGPU_POOL_CHUNK");
        chunk = v && *v ? strtoull(v, NULL, 10) : 1;
        if (!chunk)
            chunk = 1;
    }
    return chunk;
}

/* Pools give idle bytes back to the device down to their threshold (done at synchronisation). */
static void pool_shrink(struct fg_pool *p, uint64_t keep)
{
    uint64_t over = p->reserved > keep ? p->reserved - keep : 0, c = pool_chunk(p);
    uint64_t x = over < p->idle ? over : p->idle;
    uint64_t left = (p->reserved - x + c - 1) / c * c; /* a chunk still partly used stays */
    x = left < p->reserved ? p->reserved - left : 0;
    p->reserved -= x;
    p->idle -= x;
    fg_dev_give(p->ord, x);
}

static void apply_thresholds(void)
{
    for (int d = 0; d < g_nvis; d++)
        if (g_defpool[d].magic)
            pool_shrink(&g_defpool[d], g_defpool[d].threshold);
    for (struct fg_pool *p = g_pools; p; p = p->next)
        pool_shrink(p, p->dead ? 0 : p->threshold);
}

/* The frees pending on stream s (NULL: any) made in context c (NULL: any), enqueued up to
 * sequence number upto (0: all), are reached. */
static void reach_upto(struct fg_stream *s, struct fg_ctx *c, uint64_t upto)
{
    for (struct pend **pp = &g_pend; *pp;) {
        struct pend *e = *pp;
        if ((s && e->stream != s) || (c && e->ctx != c) || (upto && e->seq > upto)) {
            pp = &e->next;
            continue;
        }
        *pp = e->next;
        if (e->pool)
            e->pool->idle += e->bytes;
        else
            fg_release_alloc(e->a);
        free(e);
    }
}

static void reach(struct fg_stream *s, struct fg_ctx *c) { reach_upto(s, c, 0); }

/* The stream (NULL: every stream) reaches the end of its work. */
static void complete(struct fg_stream *s)
{
    reach(s, NULL);
    apply_thresholds();
}

void fg_async_complete_all(void)
{
    g_syncs++;
    complete(NULL);
}

FG_API void fakegpuCounts(unsigned long long *syncs, unsigned long long *trims)
{
    pthread_mutex_lock(&g_mu);
    if (syncs)
        *syncs = g_syncs;
    if (trims)
        *trims = g_trims;
    pthread_mutex_unlock(&g_mu);
}

void fg_async_drop_ctx(struct fg_ctx *c) { reach(NULL, c); }

static void free_graph(struct fg_graph *g);

static void free_nodes(struct gnode *n)
{
    for (struct gnode *x; n; n = x) {
        x = n->next;
        if (n->child)
            free_graph(n->child);
        free(n);
    }
}

static void free_graph(struct fg_graph *g)
{
    free_nodes(g->nodes);
    free(g);
}

static void free_graphs(struct fg_graph *g)
{
    for (struct fg_graph *n; g; g = n) {
        n = g->next;
        free_graph(g);
    }
}

void fg_async_reset(void)
{
    for (struct pend *e = g_pend, *n; e; e = n) {
        n = e->next;
        free(e);
    }
    g_pend = NULL;
    for (struct fg_stream *s = g_streams, *n; s; s = n) {
        n = s->next;
        free(s);
    }
    g_streams = NULL;
    g_null_stream.capture = NULL;
    g_syncs = g_trims = 0;
    for (struct fg_pool *p = g_pools, *n; p; p = n) {
        n = p->next;
        free(p);
    }
    g_pools = NULL;
    free_graphs(g_graphs);
    g_graphs = NULL;
    free_graphs(g_execs);
    g_execs = NULL;
    memset(g_defpool, 0, sizeof g_defpool);
    memset(g_graphpool, 0, sizeof g_graphpool);
    memset(g_curpool, 0, sizeof g_curpool);
}

static CUresult stream_create(CUstream *out, unsigned flags)
{
    CUresult r = fg_check_live();
    if (r)
        return r;
    if (!out || flags > 1)
        return CUDA_ERROR_INVALID_VALUE;
    struct fg_stream *s = calloc(1, sizeof *s);
    if (!s)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *s = (struct fg_stream){.magic = STREAM_MAGIC, .next = g_streams};
    g_streams = s;
    *out = (CUstream)s;
    return CUDA_SUCCESS;
}
FG_API CUresult cuStreamCreate(CUstream *out, unsigned flags) { LOCKED(stream_create(out, flags)); }

static CUresult stream_destroy(CUstream h)
{
    CUresult r = fg_check_live();
    if (r)
        return r;
    struct fg_stream *s = stream_of(h);
    if (!s || s == &g_null_stream)
        return CUDA_ERROR_INVALID_HANDLE;
    complete(s); /* its work still runs to the end */
    for (struct fg_stream **pp = &g_streams; *pp; pp = &(*pp)->next)
        if (*pp == s) {
            *pp = s->next;
            break;
        }
    free(s);
    return CUDA_SUCCESS;
}
FG_API CUresult cuStreamDestroy_v2(CUstream h) { LOCKED(stream_destroy(h)); }
FG_API CUresult cuStreamDestroy(CUstream h) { LOCKED(stream_destroy(h)); }

/* A call on stream h in the current context: no context first, then an unknown stream. */
static CUresult current_stream(CUstream h, struct fg_stream **out)
{
    struct fg_ctx *c;
    CUresult r = fg_current(&c);
    if (r)
        return r;
    *out = stream_of(h);
    return *out ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

static CUresult stream_sync(CUstream h)
{
    struct fg_stream *s;
    CUresult r = current_stream(h, &s);
    if (r)
        return r;
    if (s->capture)
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    g_syncs++;
    complete(s);
    return CUDA_SUCCESS;
}
FG_API CUresult cuStreamSynchronize(CUstream h) { LOCKED(stream_sync(h)); }
FG_API CUresult cuStreamSynchronize_ptsz(CUstream h) { LOCKED(stream_sync(h)); }

/* COLO_FAKEGPU_STREAMS_RUN=1: a stream has done its work whenever it is queried (tests of callers
 * that must ask; by default streams get there only when synchronised). */
static int g_streams_run = -1;

static CUresult stream_query(CUstream h)
{
    struct fg_stream *s;
    if (g_streams_run < 0) {
        const char *v = getenv("COLO_FAKEGPU_STREAMS_RUN");
        g_streams_run = v && !strcmp(v, "1");
    }
    CUresult r = current_stream(h, &s);
    if (r)
        return r;
    if (g_streams_run) { /* as a GPU that ran the work meanwhile: the query finds it done */
        complete(s);
        return CUDA_SUCCESS;
    }
    for (struct pend *e = g_pend; e; e = e->next)
        if (e->stream == s)
            return CUDA_ERROR_NOT_READY;
    return CUDA_SUCCESS;
}
FG_API CUresult cuStreamQuery(CUstream h) { LOCKED(stream_query(h)); }
FG_API CUresult cuStreamQuery_ptsz(CUstream h) { LOCKED(stream_query(h)); }

/* ---- events: reached when synchronised, with every free enqueued on their stream before the
 * record (streams get nowhere by themselves here: cuEventQuery says ready only once that is so) */

#define EVENT_MAGIC 0x45564e54u
struct fg_event {
    uint32_t magic;
    struct fg_stream *stream; /* NULL: never recorded */
    uint64_t seq;             /* the last pending free enqueued before the record */
};

static struct fg_event *event_of(void *h)
{
    struct fg_event *e = h;
    return e && e->magic == EVENT_MAGIC ? e : NULL; /* handles are never freed memory: see destroy */
}

static CUresult event_create(void **out, unsigned flags)
{
    (void)flags;
    CUresult r = fg_check_live();
    if (r)
        return r;
    struct fg_event *e = out ? calloc(1, sizeof *e) : NULL;
    if (!e)
        return out ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_ERROR_INVALID_VALUE;
    e->magic = EVENT_MAGIC;
    *out = e;
    return CUDA_SUCCESS;
}
FG_API CUresult cuEventCreate(void **out, unsigned flags) { LOCKED(event_create(out, flags)); }

static CUresult event_record(void *h, CUstream sh)
{
    struct fg_event *e = event_of(h);
    struct fg_stream *s;
    CUresult r = current_stream(sh, &s);
    if (r)
        return r;
    if (!e)
        return CUDA_ERROR_INVALID_HANDLE;
    e->stream = s;
    e->seq = g_pend_seq;
    return CUDA_SUCCESS;
}
FG_API CUresult cuEventRecord(void *e, CUstream s) { LOCKED(event_record(e, s)); }
FG_API CUresult cuEventRecord_ptsz(void *e, CUstream s) { LOCKED(event_record(e, s)); }
FG_API CUresult cuEventRecordWithFlags(void *e, CUstream s, unsigned f) { (void)f; LOCKED(event_record(e, s)); }
FG_API CUresult cuEventRecordWithFlags_ptsz(void *e, CUstream s, unsigned f) { (void)f; LOCKED(event_record(e, s)); }

static CUresult event_sync(void *h, int query)
{
    struct fg_event *e = event_of(h);
    CUresult r = fg_check_live();
    if (r)
        return r;
    if (!e)
        return CUDA_ERROR_INVALID_HANDLE;
    if (!e->stream || !e->seq)
        return CUDA_SUCCESS;
    if (query) {
        for (struct pend *p = g_pend; p; p = p->next)
            if (p->stream == e->stream && p->seq <= e->seq)
                return CUDA_ERROR_NOT_READY;
        return CUDA_SUCCESS;
    }
    g_syncs++;
    reach_upto(e->stream, NULL, e->seq);
    apply_thresholds();
    return CUDA_SUCCESS;
}
FG_API CUresult cuEventSynchronize(void *e) { LOCKED(event_sync(e, 0)); }
FG_API CUresult cuEventQuery(void *e) { LOCKED(event_sync(e, 1)); }

static CUresult event_destroy(void *h)
{
    struct fg_event *e = event_of(h);
    if (!e)
        return CUDA_ERROR_INVALID_HANDLE;
    e->magic = 0; /* kept (a few bytes each): a destroyed handle stays recognisably invalid */
    return CUDA_SUCCESS;
}
FG_API CUresult cuEventDestroy(void *e) { LOCKED(event_destroy(e)); }
FG_API CUresult cuEventDestroy_v2(void *e) { LOCKED(event_destroy(e)); }

/* ---- pools -------------------------------------------------------------------------------- */

static struct fg_pool *default_pool_of(int ord)
{
    struct fg_pool *p = &g_defpool[ord];
    if (!p->magic)
        *p = (struct fg_pool){.magic = POOL_MAGIC, .ord = ord};
    return p;
}

static struct fg_pool *graph_pool_of(int ord)
{
    struct fg_pool *p = &g_graphpool[ord];
    if (!p->magic)
        *p = (struct fg_pool){.magic = POOL_MAGIC, .ord = ord, .graph = 1, .threshold = UINT64_MAX};
    return p;
}

static struct fg_pool *pool_of(CUmemoryPool h)
{
    for (int i = 0; i < g_nvis; i++)
        if (h == (CUmemoryPool)&g_defpool[i])
            return default_pool_of(i);
    for (struct fg_pool *p = g_pools; p; p = p->next)
        if (h == (CUmemoryPool)p && !p->dead)
            return p;
    return NULL;
}

/* Bytes for an allocation of `bytes` from pool p on stream s: idle first, then frees pending on
 * the same stream, then new device bytes. Nothing changes when it fails. */
static CUresult pool_take_bytes(struct fg_pool *p, uint64_t bytes, struct fg_stream *s)
{
    uint64_t from_idle = bytes < p->idle ? bytes : p->idle, rest = bytes - from_idle, same = 0;
    for (struct pend *e = g_pend; e && same < rest; e = e->next)
        if (e->pool == p && e->stream == s)
            same += e->bytes;
    uint64_t from_pend = same < rest ? same : rest, fresh = rest - from_pend, c = pool_chunk(p);
    uint64_t grow = (fresh + c - 1) / c * c; /* the rest of the chunk stays idle in the pool */
    if (grow) {
        CUresult r = fg_dev_take(p->ord, grow);
        if (r)
            return r;
    }
    for (struct pend **pp = &g_pend; *pp && from_pend;) {
        struct pend *e = *pp;
        if (e->pool != p || e->stream != s) {
            pp = &e->next;
            continue;
        }
        uint64_t x = e->bytes < from_pend ? e->bytes : from_pend;
        e->bytes -= x;
        from_pend -= x;
        if (!e->bytes) {
            *pp = e->next;
            free(e);
        }
    }
    p->idle = p->idle - from_idle + (grow - fresh);
    p->reserved += grow;
    p->used += bytes;
    if (p->reserved > p->res_high)
        p->res_high = p->reserved;
    if (p->used > p->used_high)
        p->used_high = p->used;
    return CUDA_SUCCESS;
}

/* An allocation of p's gives its bytes back: to its stream's pending frees, or (NULL) idle now. */
void fg_pool_return(struct fg_pool *p, uint64_t bytes, void *stream)
{
    p->used -= bytes;
    if (stream) {
        struct pend *e = calloc(1, sizeof *e);
        if (e) {
            *e = (struct pend){.stream = stream, .pool = p, .bytes = bytes, .seq = ++g_pend_seq, .next = g_pend};
            g_pend = e;
            return;
        }
    }
    p->idle += bytes;
    if (p->dead)
        pool_shrink(p, 0);
}

/* Stream capture: an allocation on a capturing stream becomes an alloc node of its graph. */
static CUresult capture_alloc(struct fg_stream *s, int ord, uint64_t bytes, CUdeviceptr *out);

static CUresult alloc_from(CUdeviceptr *out, uint64_t n, struct fg_pool *p, CUstream h, struct fg_ctx *c)
{
    if (!out || n == 0)
        return CUDA_ERROR_INVALID_VALUE;
    struct fg_stream *s = stream_of(h);
    if (!s)
        return CUDA_ERROR_INVALID_HANDLE;
    if (s->capture)
        return capture_alloc(s, p->ord, n, out);
    CUresult r = pool_take_bytes(p, n, s);
    if (r)
        return r;
    if ((r = fg_record(p->ord, n, K_MEM, c, p, 0, out))) {
        p->used -= n;
        p->idle += n;
    }
    return r;
}

static CUresult alloc_async(CUdeviceptr *out, uint64_t n, CUstream h)
{
    struct fg_ctx *c;
    CUresult r = fg_current(&c);
    if (r)
        return r;
    struct fg_pool *p = g_curpool[c->ord] ? g_curpool[c->ord] : default_pool_of(c->ord);
    return alloc_from(out, n, p, h, c);
}
FG_API CUresult cuMemAllocAsync(CUdeviceptr *p, size_t n, CUstream s) { LOCKED(alloc_async(p, n, s)); }
FG_API CUresult cuMemAllocAsync_ptsz(CUdeviceptr *p, size_t n, CUstream s) { LOCKED(alloc_async(p, n, s)); }

static CUresult alloc_pool(CUdeviceptr *out, uint64_t n, CUmemoryPool h, CUstream s)
{
    struct fg_ctx *c;
    CUresult r = fg_current(&c);
    if (r)
        return r;
    struct fg_pool *p = pool_of(h);
    if (!p)
        return CUDA_ERROR_INVALID_VALUE;
    return alloc_from(out, n, p, s, c);
}
FG_API CUresult cuMemAllocFromPoolAsync(CUdeviceptr *p, size_t n, CUmemoryPool pool, CUstream s)
{
    LOCKED(alloc_pool(p, n, pool, s));
}
FG_API CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *p, size_t n, CUmemoryPool pool, CUstream s)
{
    LOCKED(alloc_pool(p, n, pool, s));
}

static CUresult capture_free(struct fg_stream *s, CUdeviceptr p);

static CUresult free_async(CUdeviceptr p, CUstream h)
{
    struct fg_ctx *c;
    CUresult r = fg_current(&c);
    if (r)
        return r;
    if (p == 0)
        return CUDA_SUCCESS;
    struct fg_stream *s = stream_of(h);
    if (!s)
        return CUDA_ERROR_INVALID_HANDLE;
    if (s->capture)
        return capture_free(s, p);
    struct alloc *a = fg_unlink(p, K_MEM);
    if (!a)
        return CUDA_ERROR_INVALID_VALUE;
    if (a->pool) {
        fg_pool_return(a->pool, a->size, s);
        a->pool = NULL;
        a->kind = K_VA; /* its bytes went to the pool: forget the record only */
        fg_release_alloc(a);
        return CUDA_SUCCESS;
    }
    /* Not from a pool: the device has the bytes back once the stream reaches the free. */
    struct pend *e = calloc(1, sizeof *e);
    if (!e) {
        fg_release_alloc(a);
        return CUDA_SUCCESS;
    }
    *e = (struct pend){.stream = s, .a = a, .ctx = a->ctx, .seq = ++g_pend_seq, .next = g_pend};
    g_pend = e;
    return CUDA_SUCCESS;
}
FG_API CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s) { LOCKED(free_async(p, s)); }
FG_API CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream s) { LOCKED(free_async(p, s)); }

typedef struct { int allocType, handleTypes; struct { int type, id; } location; } POOL_PROPS;

static CUresult pool_create(CUmemoryPool *out, const POOL_PROPS *props)
{
    CUresult r = fg_check_live();
    if (r)
        return r;
    if (!out || !props || props->allocType != 1 || props->location.type != 1)
        return CUDA_ERROR_INVALID_VALUE;
    if (props->location.id < 0 || props->location.id >= g_nvis)
        return CUDA_ERROR_INVALID_DEVICE;
    struct fg_pool *p = calloc(1, sizeof *p);
    if (!p)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *p = (struct fg_pool){.magic = POOL_MAGIC, .ord = props->location.id, .next = g_pools};
    g_pools = p;
    *out = (CUmemoryPool)p;
    return CUDA_SUCCESS;
}
FG_API CUresult cuMemPoolCreate(CUmemoryPool *out, const POOL_PROPS *props) { LOCKED(pool_create(out, props)); }

/* Like the real driver: idle bytes go back at once, the rest as its allocations are freed. */
static CUresult pool_destroy(CUmemoryPool h)
{
    CUresult r = fg_check_live();
    if (r)
        return r;
    struct fg_pool *p = pool_of(h);
    if (!p || p == &g_defpool[p->ord])
        return CUDA_ERROR_INVALID_VALUE;
    p->dead = 1;
    for (int d = 0; d < g_nvis; d++)
        if (g_curpool[d] == p)
            g_curpool[d] = NULL;
    pool_shrink(p, 0);
    return CUDA_SUCCESS;
}
FG_API CUresult cuMemPoolDestroy(CUmemoryPool h) { LOCKED(pool_destroy(h)); }

static CUresult get_pool(CUmemoryPool *out, CUdevice d, int current)
{
    CUresult r = fg_check_live();
    if (r)
        return r;
    if (!out)
        return CUDA_ERROR_INVALID_VALUE;
    if (d < 0 || d >= g_nvis)
        return CUDA_ERROR_INVALID_DEVICE;
    *out = (CUmemoryPool)(current && g_curpool[d] ? g_curpool[d] : default_pool_of(d));
    return CUDA_SUCCESS;
}
FG_API CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *out, CUdevice d) { LOCKED(get_pool(out, d, 0)); }
FG_API CUresult cuDeviceGetMemPool(CUmemoryPool *out, CUdevice d) { LOCKED(get_pool(out, d, 1)); }

static CUresult set_pool(CUdevice d, CUmemoryPool h)
{
    CUresult r = fg_check_live();
    if (r)
        return r;
    struct fg_pool *p = pool_of(h);
    if (d < 0 || d >= g_nvis)
        return CUDA_ERROR_INVALID_DEVICE;
    if (!p || p->ord != d)
        return CUDA_ERROR_INVALID_VALUE;
    g_curpool[d] = p;
    return CUDA_SUCCESS;
}
FG_API CUresult cuDeviceSetMemPool(CUdevice d, CUmemoryPool h) { LOCKED(set_pool(d, h)); }

enum { ATTR_REUSE_FOLLOW = 1, ATTR_REUSE_OPPORTUNISTIC, ATTR_REUSE_INTERNAL, ATTR_RELEASE_THRESHOLD,
       ATTR_RESERVED_CURRENT, ATTR_RESERVED_HIGH, ATTR_USED_CURRENT, ATTR_USED_HIGH };

static CUresult pool_attr(CUmemoryPool h, int attr, void *value, int set)
{
    CUresult r = fg_check_live();
    if (r)
        return r;
    struct fg_pool *p = pool_of(h);
    if (!p || !value)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t *v = value;
    switch (attr) {
    case ATTR_REUSE_FOLLOW: case ATTR_REUSE_OPPORTUNISTIC: case ATTR_REUSE_INTERNAL:
        if (!set)
            *(int *)value = 1;
        return CUDA_SUCCESS;
    case ATTR_RELEASE_THRESHOLD:
        if (set)
            p->threshold = *v; /* takes effect at the next synchronisation */
        else
            *v = p->threshold;
        return CUDA_SUCCESS;
    case ATTR_RESERVED_CURRENT: case ATTR_USED_CURRENT:
        if (set)
            return CUDA_ERROR_INVALID_VALUE;
        *v = attr == ATTR_RESERVED_CURRENT ? p->reserved : p->used;
        return CUDA_SUCCESS;
    case ATTR_RESERVED_HIGH: case ATTR_USED_HIGH:
        if (set) { /* may only be reset to 0 */
            if (*v)
                return CUDA_ERROR_INVALID_VALUE;
            if (attr == ATTR_RESERVED_HIGH)
                p->res_high = p->reserved;
            else
                p->used_high = p->used;
        } else {
            *v = attr == ATTR_RESERVED_HIGH ? p->res_high : p->used_high;
        }
        return CUDA_SUCCESS;
    default:
        return CUDA_ERROR_INVALID_VALUE;
    }
}
FG_API CUresult cuMemPoolGetAttribute(CUmemoryPool h, int attr, void *value) { LOCKED(pool_attr(h, attr, value, 0)); }
FG_API CUresult cuMemPoolSetAttribute(CUmemoryPool h, int attr, void *value) { LOCKED(pool_attr(h, attr, value, 1)); }

static CUresult pool_trim(CUmemoryPool h, size_t keep)
{
    CUresult r = fg_check_live();
    if (r)
        return r;
    struct fg_pool *p = pool_of(h);
    if (!p)
        return CUDA_ERROR_INVALID_VALUE;
    g_trims++;
    pool_shrink(p, keep); /* frees the streams have not reached are not idle: they stay */
    return CUDA_SUCCESS;
}
FG_API CUresult cuMemPoolTrimTo(CUmemoryPool h, size_t keep) { LOCKED(pool_trim(h, keep)); }

/* ---- graphs ------------------------------------------------------------------------------- */

typedef void *CUgraph, *CUgraphExec, *CUgraphNode;
/* CUDA_MEM_ALLOC_NODE_PARAMS (v1 and v2 alike): CUmemPoolProps (88 bytes), access descriptors,
 * size, address. */
typedef struct {
    POOL_PROPS props;
    void *win32;
    unsigned char reserved[64];
    const void *accessDescs;
    size_t accessDescCount;
    size_t bytesize;
    CUdeviceptr dptr;
} MEM_ALLOC_NODE_PARAMS;
_Static_assert(sizeof(MEM_ALLOC_NODE_PARAMS) == 120, "CUDA_MEM_ALLOC_NODE_PARAMS_v1 layout");

/* CUgraphNodeParams (cuGraphAddNode, CUDA 12.2): the node type, then a union of 232 bytes. */
enum { CHILD_GRAPH_CLONE = 0, CHILD_GRAPH_MOVE = 1 };
typedef struct {
    int type;
    int reserved0[3];
    union {
        long long reserved1[29];
        MEM_ALLOC_NODE_PARAMS alloc;
        struct { CUgraph graph; int ownership; } child;
        struct { CUdeviceptr dptr; } free;
    } u;
    long long reserved2;
} GRAPH_NODE_PARAMS;
_Static_assert(sizeof(GRAPH_NODE_PARAMS) == 256, "CUgraphNodeParams layout");

/* CUDA_GRAPH_INSTANTIATE_PARAMS; flag CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD uploads on hUploadStream;
 * AUTO_FREE_ON_LAUNCH: a launch first frees what the previous one left allocated. */
enum { INSTANTIATE_AUTO_FREE = 1, INSTANTIATE_UPLOAD = 2 };
typedef struct {
    cuuint64_t flags;
    CUstream upload_stream;
    CUgraphNode err_node;
    int result;
} INSTANTIATE_PARAMS;

#define NODE_MAGIC 0x4e4f4445u

static struct fg_graph *find_in(struct fg_graph *list, void *h)
{
    for (struct fg_graph *g = list; g; g = g->next)
        if ((void *)g == h)
            return g;
    return NULL;
}

static struct fg_graph *graph_of(CUgraph h) { return find_in(g_graphs, h); }
static struct fg_graph *exec_of(CUgraphExec h) { return find_in(g_execs, h); }

static struct gnode *node_of(CUgraphNode h)
{
    struct gnode *n = h;
    return n && n->magic == NODE_MAGIC ? n : NULL;
}

/* Node h when it is of `type` and the caller gave somewhere to answer (out); else NULL. */
static struct gnode *node_as(CUgraphNode h, int type, const void *out)
{
    struct gnode *n = node_of(h);
    return n && n->type == type && out ? n : NULL;
}

/* Take graph h out of *list (NULL: not there). */
static struct fg_graph *unlink_from(struct fg_graph **list, void *h)
{
    for (struct fg_graph **pp = list; *pp; pp = &(*pp)->next)
        if ((void *)*pp == h) {
            struct fg_graph *g = *pp;
            *pp = g->next;
            g->next = NULL;
            return g;
        }
    return NULL;
}

static struct fg_graph *graph_new(uint32_t magic, struct fg_graph **list)
{
    struct fg_graph *g = calloc(1, sizeof *g);
    if (g) {
        *g = (struct fg_graph){.magic = magic};
        if (list) {
            g->next = *list;
            *list = g;
        }
    }
    return g;
}

static struct gnode *add_node(struct fg_graph *g, int type, int ord, uint64_t bytes, uint64_t dptr)
{
    struct gnode *n = calloc(1, sizeof *n), **end = &g->nodes;
    if (!n)
        return NULL;
    *n = (struct gnode){.magic = NODE_MAGIC, .type = type, .ord = ord, .bytes = bytes, .dptr = dptr};
    while (*end)
        end = &(*end)->next;
    *end = n;
    return n;
}

/* Append g's memory nodes to x, child graphs inlined (an instantiation, or a clone). -1: ENOMEM. */
static int flatten_into(struct fg_graph *x, const struct fg_graph *g)
{
    for (const struct gnode *n = g->nodes; n; n = n->next) {
        if (n->type == NODE_GRAPH) {
            if (flatten_into(x, n->child))
                return -1;
        } else if (!add_node(x, n->type, n->ord, n->bytes, n->dptr)) {
            return -1;
        }
    }
    return 0;
}

static int has_memory_nodes(const struct fg_graph *g)
{
    for (const struct gnode *n = g->nodes; n; n = n->next)
        if (n->type == NODE_ALLOC || n->type == NODE_FREE || (n->type == NODE_GRAPH && has_memory_nodes(n->child)))
            return 1;
    return 0;
}

/* A graph allocation's address is fixed when its node is made (as on the real driver). */
static uint64_t g_graph_va = 0x7e0000000000ull;
static uint64_t graph_va(uint64_t bytes)
{
    uint64_t p = g_graph_va;
    g_graph_va += (bytes + (4ull << 20)) & ~((2ull << 20) - 1);
    return p;
}

static CUresult capture_alloc(struct fg_stream *s, int ord, uint64_t bytes, CUdeviceptr *out)
{
    uint64_t va = graph_va(bytes);
    if (!add_node(s->capture, NODE_ALLOC, ord, bytes, va))
        return CUDA_ERROR_OUT_OF_MEMORY;
    *out = va;
    return CUDA_SUCCESS;
}

static CUresult capture_free(struct fg_stream *s, CUdeviceptr p)
{
    return add_node(s->capture, NODE_FREE, 0, 0, p) ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

static CUresult graph_create(CUgraph *out, unsigned flags)
{
    CUresult r = fg_check_live();
    if (r)
        return r;
    if (!out || flags)
        return CUDA_ERROR_INVALID_VALUE;
    struct fg_graph *g = graph_new(GRAPH_MAGIC, &g_graphs);
    if (!g)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *out = (CUgraph)g;
    return CUDA_SUCCESS;
}
FG_API CUresult cuGraphCreate(CUgraph *out, unsigned flags) { LOCKED(graph_create(out, flags)); }

static CUresult graph_destroy(struct fg_graph **list, void *h)
{
    CUresult r = fg_check_live();
    if (r)
        return r;
    struct fg_graph *g = unlink_from(list, h);
    if (!g)
        return CUDA_ERROR_INVALID_VALUE;
    free_graph(g);
    return CUDA_SUCCESS;
}
FG_API CUresult cuGraphDestroy(CUgraph h) { LOCKED(graph_destroy(&g_graphs, h)); }
FG_API CUresult cuGraphExecDestroy(CUgraphExec h) { LOCKED(graph_destroy(&g_execs, h)); }

static CUresult add_alloc_node(CUgraphNode *node, CUgraph h, MEM_ALLOC_NODE_PARAMS *p)
{
    CUresult r = fg_check_live();
    if (r)
        return r;
    struct fg_graph *g = graph_of(h);
    if (!node || !g || !p || !p->bytesize || p->props.allocType != 1 || p->props.location.type != 1)
        return CUDA_ERROR_INVALID_VALUE;
    if (p->props.location.id < 0 || p->props.location.id >= g_nvis)
        return CUDA_ERROR_INVALID_DEVICE;
    uint64_t va = graph_va(p->bytesize);
    struct gnode *n = add_node(g, NODE_ALLOC, p->props.location.id, p->bytesize, va);
    if (!n)
        return CUDA_ERROR_OUT_OF_MEMORY;
    p->dptr = va;
    *node = (CUgraphNode)n;
    return CUDA_SUCCESS;
}

static CUresult add_free_node(CUgraphNode *node, CUgraph h, CUdeviceptr dptr)
{
    CUresult r = fg_check_live();
    if (r)
        return r;
    struct fg_graph *g = graph_of(h);
    if (!node || !g || !dptr)
        return CUDA_ERROR_INVALID_VALUE;
    struct gnode *n = add_node(g, NODE_FREE, 0, 0, dptr);
    if (!n)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *node = (CUgraphNode)n;
    return CUDA_SUCCESS;
}

/* A child graph node: a clone of the child (refused for graphs with memory nodes, as on the real
 * driver), or the child itself when its ownership is moved to the parent. */
static CUresult add_child_node(CUgraphNode *node, CUgraph h, CUgraph child, int ownership)
{
    CUresult r = fg_check_live();
    if (r)
        return r;
    struct fg_graph *g = graph_of(h), *c = graph_of(child);
    if (!node || !g || !c || c == g || (ownership != CHILD_GRAPH_CLONE && ownership != CHILD_GRAPH_MOVE))
        return CUDA_ERROR_INVALID_VALUE;
    if (ownership == CHILD_GRAPH_CLONE && has_memory_nodes(c))
        return CUDA_ERROR_INVALID_VALUE;
    struct gnode *n = add_node(g, NODE_GRAPH, 0, 0, 0);
    if (!n)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (ownership == CHILD_GRAPH_MOVE) {
        n->child = unlink_from(&g_graphs, c);
    } else if (!(n->child = graph_new(GRAPH_MAGIC, NULL)) || flatten_into(n->child, c)) {
        n->type = NODE_EMPTY; /* no host memory: the node stays, empty */
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *node = (CUgraphNode)n;
    return CUDA_SUCCESS;
}

static CUresult add_any_node(CUgraphNode *node, CUgraph h, GRAPH_NODE_PARAMS *p)
{
    if (!p)
        return CUDA_ERROR_INVALID_VALUE;
    switch (p->type) {
    case NODE_ALLOC: return add_alloc_node(node, h, &p->u.alloc);
    case NODE_FREE: return add_free_node(node, h, p->u.free.dptr);
    case NODE_GRAPH: return add_child_node(node, h, p->u.child.graph, p->u.child.ownership);
    default: return CUDA_ERROR_NOT_SUPPORTED; /* node types the simulated driver has no use for */
    }
}

FG_API CUresult cuGraphAddMemAllocNode(CUgraphNode *node, CUgraph g, const CUgraphNode *deps, size_t ndeps,
                                       MEM_ALLOC_NODE_PARAMS *p)
{
    (void)deps;
    (void)ndeps;
    LOCKED(add_alloc_node(node, g, p));
}
FG_API CUresult cuGraphAddMemFreeNode(CUgraphNode *node, CUgraph g, const CUgraphNode *deps, size_t ndeps,
                                      CUdeviceptr dptr)
{
    (void)deps;
    (void)ndeps;
    LOCKED(add_free_node(node, g, dptr));
}
FG_API CUresult cuGraphAddChildGraphNode(CUgraphNode *node, CUgraph g, const CUgraphNode *deps, size_t ndeps,
                                         CUgraph child)
{
    (void)deps;
    (void)ndeps;
    LOCKED(add_child_node(node, g, child, CHILD_GRAPH_CLONE));
}
FG_API CUresult cuGraphAddNode(CUgraphNode *node, CUgraph g, const CUgraphNode *deps, size_t ndeps,
                               GRAPH_NODE_PARAMS *p)
{
    (void)deps;
    (void)ndeps;
    LOCKED(add_any_node(node, g, p));
}
FG_API CUresult cuGraphAddNode_v2(CUgraphNode *node, CUgraph g, const CUgraphNode *deps, const void *edges,
                                  size_t ndeps, GRAPH_NODE_PARAMS *p)
{
    (void)deps;
    (void)edges;
    (void)ndeps;
    LOCKED(add_any_node(node, g, p));
}

/* ---- what a graph holds, as the driver answers it --------------------------------------------- */

/* A graph, or a child graph a graph's node owns, at any depth. */
static struct fg_graph *graph_or_child_of(struct fg_graph *list, CUgraph h)
{
    for (struct fg_graph *g = list; g; g = g->next) {
        if ((CUgraph)g == h)
            return g;
        for (struct gnode *n = g->nodes; n; n = n->next) {
            struct fg_graph *c = n->child ? graph_or_child_of(n->child, h) : NULL;
            if (c)
                return c;
        }
    }
    return NULL;
}

static CUresult get_nodes(CUgraph h, CUgraphNode *out, size_t *num)
{
    CUresult r = fg_check_live();
    if (r)
        return r;
    struct fg_graph *g = graph_or_child_of(g_graphs, h);
    if (!g || !num)
        return CUDA_ERROR_INVALID_VALUE;
    size_t k = 0;
    for (struct gnode *n = g->nodes; n; n = n->next, k++)
        if (out && k < *num)
            out[k] = (CUgraphNode)n;
    if (out)
        for (size_t i = k; i < *num; i++)
            out[i] = NULL;
    if (!out || k < *num)
        *num = k;
    return CUDA_SUCCESS;
}
FG_API CUresult cuGraphGetNodes(CUgraph g, CUgraphNode *nodes, size_t *num) { LOCKED(get_nodes(g, nodes, num)); }

static CUresult node_type(CUgraphNode h, int *type)
{
    struct gnode *n = node_of(h);
    if (!n || !type)
        return CUDA_ERROR_INVALID_VALUE;
    *type = n->type;
    return CUDA_SUCCESS;
}
FG_API CUresult cuGraphNodeGetType(CUgraphNode n, int *type) { LOCKED(node_type(n, type)); }

static CUresult alloc_node_params(CUgraphNode h, MEM_ALLOC_NODE_PARAMS *p)
{
    struct gnode *n = node_as(h, NODE_ALLOC, p);
    if (!n)
        return CUDA_ERROR_INVALID_VALUE;
    memset(p, 0, sizeof *p);
    p->props.allocType = 1;
    p->props.location.type = 1;
    p->props.location.id = n->ord;
    p->bytesize = n->bytes;
    p->dptr = n->dptr;
    return CUDA_SUCCESS;
}
FG_API CUresult cuGraphMemAllocNodeGetParams(CUgraphNode n, MEM_ALLOC_NODE_PARAMS *p) { LOCKED(alloc_node_params(n, p)); }

static CUresult free_node_params(CUgraphNode h, CUdeviceptr *out)
{
    struct gnode *n = node_as(h, NODE_FREE, out);
    return n ? (*out = n->dptr, CUDA_SUCCESS) : CUDA_ERROR_INVALID_VALUE;
}
FG_API CUresult cuGraphMemFreeNodeGetParams(CUgraphNode n, CUdeviceptr *out) { LOCKED(free_node_params(n, out)); }

static CUresult child_of(CUgraphNode h, CUgraph *out)
{
    struct gnode *n = node_as(h, NODE_GRAPH, out);
    return n ? (*out = (CUgraph)n->child, CUDA_SUCCESS) : CUDA_ERROR_INVALID_VALUE;
}
FG_API CUresult cuGraphChildGraphNodeGetGraph(CUgraphNode n, CUgraph *out) { LOCKED(child_of(n, out)); }

/* ---- instantiated graphs ---------------------------------------------------------------------- */

static CUresult upload(struct fg_graph *x, CUstream hs);

static CUresult instantiate(CUgraphExec *out, CUgraph h, cuuint64_t flags, CUstream upload_stream)
{
    CUresult r = fg_check_live();
    if (r)
        return r;
    struct fg_graph *g = graph_of(h);
    if (!out || !g)
        return CUDA_ERROR_INVALID_VALUE;
    struct fg_graph *x = graph_new(EXEC_MAGIC, NULL);
    if (!x || flatten_into(x, g)) {
        if (x)
            free_graph(x);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    x->flags = flags & INSTANTIATE_AUTO_FREE;
    if ((flags & INSTANTIATE_UPLOAD) && (r = upload(x, upload_stream))) {
        free_graph(x);
        return r;
    }
    x->next = g_execs;
    g_execs = x;
    *out = (CUgraphExec)x;
    return CUDA_SUCCESS;
}
FG_API CUresult cuGraphInstantiateWithFlags(CUgraphExec *out, CUgraph g, unsigned long long flags)
{
    LOCKED(instantiate(out, g, flags & ~(unsigned long long)INSTANTIATE_UPLOAD, NULL));
}
/* The CUDA 10 / 11 ABIs (error node, log buffer). */
FG_API CUresult cuGraphInstantiate(CUgraphExec *out, CUgraph g, CUgraphNode *err, char *log, size_t n)
{
    (void)err;
    if (log && n)
        log[0] = 0;
    LOCKED(instantiate(out, g, 0, NULL));
}
FG_API CUresult cuGraphInstantiate_v2(CUgraphExec *out, CUgraph g, CUgraphNode *err, char *log, size_t n)
{
    return cuGraphInstantiate(out, g, err, log, n);
}

static CUresult instantiate_params(CUgraphExec *out, CUgraph g, INSTANTIATE_PARAMS *p)
{
    if (!p)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = instantiate(out, g, p->flags, p->upload_stream);
    p->err_node = NULL;
    p->result = r ? 1 /* CUDA_GRAPH_INSTANTIATE_ERROR */ : 0;
    return r;
}
FG_API CUresult cuGraphInstantiateWithParams(CUgraphExec *out, CUgraph g, INSTANTIATE_PARAMS *p)
{
    LOCKED(instantiate_params(out, g, p));
}
FG_API CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *out, CUgraph g, INSTANTIATE_PARAMS *p)
{
    LOCKED(instantiate_params(out, g, p));
}

/* An update takes the new graph's node parameters when its nodes match the old ones one to one. */
static CUresult exec_update(CUgraphExec hx, CUgraph hg)
{
    CUresult r = fg_check_live();
    if (r)
        return r;
    struct fg_graph *x = exec_of(hx), *g = graph_of(hg), *y;
    if (!x || !g)
        return CUDA_ERROR_INVALID_VALUE;
    if (!(y = graph_new(EXEC_MAGIC, NULL)) || flatten_into(y, g)) {
        if (y)
            free_graph(y);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    struct gnode *a = x->nodes, *b = y->nodes;
    for (; a && b && a->type == b->type; a = a->next, b = b->next) {}
    if (a || b) {
        free_graph(y);
        return 910; /* CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE */
    }
    for (a = x->nodes, b = y->nodes; a; a = a->next, b = b->next) {
        a->bytes = b->bytes;
        a->ord = b->ord;
    }
    free_graph(y);
    return CUDA_SUCCESS;
}
FG_API CUresult cuGraphExecUpdate(CUgraphExec x, CUgraph g, CUgraphNode *err, int *result)
{
    if (err)
        *err = NULL;
    pthread_mutex_lock(&g_mu);
    CUresult r = exec_update(x, g);
    pthread_mutex_unlock(&g_mu);
    if (result)
        *result = r ? 2 /* CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED */ : 0;
    return r;
}
FG_API CUresult cuGraphExecUpdate_v2(CUgraphExec x, CUgraph g, void *result_info)
{
    (void)result_info;
    LOCKED(exec_update(x, g));
}

/* The bytes x's alloc nodes take, per device. */
static void graph_need(const struct fg_graph *x, uint64_t need[FG_MAX_DEV])
{
    memset(need, 0, FG_MAX_DEV * sizeof need[0]);
    for (const struct gnode *n = x->nodes; n; n = n->next)
        if (n->type == NODE_ALLOC)
            need[n->ord] += n->bytes;
}

/* Bytes of frees pending in pool p (on stream s only, or NULL: on any stream). */
static uint64_t pending_in(const struct fg_pool *p, const struct fg_stream *s)
{
    uint64_t n = 0;
    for (const struct pend *e = g_pend; e; e = e->next)
        if (e->pool == p && (!s || e->stream == s))
            n += e->bytes;
    return n;
}

/* Back x's allocations, launched on stream s (NULL: an upload, which reuses nothing pending): each
 * device's graph pool holds at least that much idle, counting the frees pending on s, which the
 * launch reuses in stream order (all devices or none). */
static CUresult back(const uint64_t need[FG_MAX_DEV], struct fg_stream *s)
{
    uint64_t fresh[FG_MAX_DEV] = {0};
    for (int d = 0; d < g_nvis; d++) {
        struct fg_pool *gp = graph_pool_of(d);
        uint64_t have = gp->idle + (s ? pending_in(gp, s) : 0);
        fresh[d] = need[d] > have ? need[d] - have : 0;
        CUresult r = fresh[d] ? fg_dev_take(d, fresh[d]) : CUDA_SUCCESS;
        if (r) {
            for (int e = 0; e < d; e++)
                fg_dev_give(e, fresh[e]);
            return r;
        }
    }
    for (int d = 0; d < g_nvis; d++) {
        struct fg_pool *gp = graph_pool_of(d);
        gp->reserved += fresh[d];
        gp->idle += fresh[d];
        if (s) /* the pending frees on s it needs are reached now, in stream order */
            for (struct pend **pp = &g_pend; *pp && gp->idle < need[d];) {
                struct pend *e = *pp;
                if (e->pool != gp || e->stream != s) {
                    pp = &e->next;
                    continue;
                }
                *pp = e->next;
                gp->idle += e->bytes;
                free(e);
            }
        if (gp->reserved > gp->res_high)
            gp->res_high = gp->reserved;
    }
    return CUDA_SUCCESS;
}

/* cuGraphUpload: the graph's memory is backed now, so that its launch need not grow the pool. */
static CUresult upload(struct fg_graph *x, CUstream hs)
{
    if (!stream_of(hs))
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t need[FG_MAX_DEV];
    graph_need(x, need);
    return back(need, NULL);
}

static CUresult upload_h(CUgraphExec h, CUstream hs)
{
    CUresult r = fg_check_live();
    if (r)
        return r;
    struct fg_graph *x = exec_of(h);
    return x ? upload(x, hs) : CUDA_ERROR_INVALID_VALUE;
}
FG_API CUresult cuGraphUpload(CUgraphExec x, CUstream s) { LOCKED(upload_h(x, s)); }
FG_API CUresult cuGraphUpload_ptsz(CUgraphExec x, CUstream s) { LOCKED(upload_h(x, s)); }

/* Alloc nodes take their bytes from the device's graph pool (all or nothing), free nodes give
 * them back to it; what the graph does not free stays allocated after it. */
static CUresult launch(CUgraphExec h, CUstream hs)
{
    struct fg_ctx *c;
    CUresult r = fg_current(&c);
    if (r)
        return r;
    struct fg_graph *x = exec_of(h);
    struct fg_stream *s = stream_of(hs);
    if (!x || !s)
        return CUDA_ERROR_INVALID_VALUE;
    for (struct gnode *n = x->nodes; n; n = n->next) {
        struct alloc *a = n->type == NODE_ALLOC ? fg_find(n->dptr) : NULL;
        if (a && !(x->flags & INSTANTIATE_AUTO_FREE))
            return CUDA_ERROR_INVALID_VALUE; /* still allocated from its last launch */
    }
    for (struct gnode *n = x->nodes; n; n = n->next) /* AUTO_FREE_ON_LAUNCH: freed first */
        if (n->type == NODE_ALLOC && fg_find(n->dptr))
            fg_release_alloc(fg_unlink(n->dptr, K_MEM));
    uint64_t need[FG_MAX_DEV];
    graph_need(x, need);
    if ((r = back(need, s)))
        return r;
    for (int d = 0; d < g_nvis; d++) {
        struct fg_pool *gp = graph_pool_of(d);
        gp->idle -= need[d];
        gp->used += need[d];
        if (gp->used > gp->used_high)
            gp->used_high = gp->used;
    }
    for (struct gnode *n = x->nodes; n; n = n->next) {
        if (n->type == NODE_ALLOC) {
            unsigned long long at;
            if (fg_record(n->ord, n->bytes, K_MEM, c, graph_pool_of(n->ord), n->dptr, &at) == CUDA_SUCCESS)
                continue;
            graph_pool_of(n->ord)->used -= n->bytes; /* no host memory for the record */
            graph_pool_of(n->ord)->idle += n->bytes;
        } else if (n->type == NODE_FREE) {
            struct alloc *a = fg_unlink(n->dptr, K_MEM);
            if (a)
                fg_release_alloc(a);
        }
    }
    return CUDA_SUCCESS;
}
FG_API CUresult cuGraphLaunch(CUgraphExec x, CUstream s) { LOCKED(launch(x, s)); }
FG_API CUresult cuGraphLaunch_ptsz(CUgraphExec x, CUstream s) { LOCKED(launch(x, s)); }

static CUresult graph_trim(CUdevice d)
{
    CUresult r = fg_check_live();
    if (r)
        return r;
    if (d < 0 || d >= g_nvis)
        return CUDA_ERROR_INVALID_DEVICE;
    g_trims++;
    pool_shrink(graph_pool_of(d), 0);
    return CUDA_SUCCESS;
}
FG_API CUresult cuDeviceGraphMemTrim(CUdevice d) { LOCKED(graph_trim(d)); }

/* CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT 0, USED_MEM_HIGH 1, RESERVED_MEM_CURRENT 2, RESERVED_MEM_HIGH 3 */
static CUresult graph_attr(CUdevice d, int attr, void *value, int set)
{
    CUresult r = fg_check_live();
    if (r)
        return r;
    if (d < 0 || d >= g_nvis)
        return CUDA_ERROR_INVALID_DEVICE;
    if (!value || attr < 0 || attr > 3 || (set && (attr == 0 || attr == 2 || *(uint64_t *)value)))
        return CUDA_ERROR_INVALID_VALUE;
    struct fg_pool *gp = graph_pool_of(d);
    uint64_t *v = value;
    if (set) {
        if (attr == 1)
            gp->used_high = gp->used;
        else
            gp->res_high = gp->reserved;
        return CUDA_SUCCESS;
    }
    *v = attr == 0 ? gp->used + pending_in(gp, NULL) : attr == 1 ? gp->used_high : attr == 2 ? gp->reserved : gp->res_high;
    return CUDA_SUCCESS;
}
FG_API CUresult cuDeviceGetGraphMemAttribute(CUdevice d, int attr, void *value) { LOCKED(graph_attr(d, attr, value, 0)); }
FG_API CUresult cuDeviceSetGraphMemAttribute(CUdevice d, int attr, void *value) { LOCKED(graph_attr(d, attr, value, 1)); }

/* ---- stream capture ------------------------------------------------------------------------ */

static CUresult begin_capture(CUstream h, int mode)
{
    CUresult r = fg_check_live();
    if (r)
        return r;
    struct fg_stream *s = stream_of(h);
    if (!s || s == &g_null_stream || mode < 0 || mode > 2)
        return CUDA_ERROR_INVALID_VALUE; /* the legacy stream cannot be captured */
    if (s->capture)
        return CUDA_ERROR_INVALID_VALUE;
    if (!(s->capture = graph_new(GRAPH_MAGIC, &g_graphs)))
        return CUDA_ERROR_OUT_OF_MEMORY;
    return CUDA_SUCCESS;
}
FG_API CUresult cuStreamBeginCapture_v2(CUstream s, int mode) { LOCKED(begin_capture(s, mode)); }
FG_API CUresult cuStreamBeginCapture_v2_ptsz(CUstream s, int mode) { LOCKED(begin_capture(s, mode)); }

static CUresult end_capture(CUstream h, CUgraph *out)
{
    CUresult r = fg_check_live();
    if (r)
        return r;
    struct fg_stream *s = stream_of(h);
    if (!s || !out || !s->capture)
        return CUDA_ERROR_INVALID_VALUE;
    *out = (CUgraph)s->capture;
    s->capture = NULL;
    return CUDA_SUCCESS;
}
FG_API CUresult cuStreamEndCapture(CUstream s, CUgraph *g) { LOCKED(end_capture(s, g)); }
FG_API CUresult cuStreamEndCapture_ptsz(CUstream s, CUgraph *g) { LOCKED(end_capture(s, g)); }

/* CU_STREAM_CAPTURE_STATUS_NONE 0, ACTIVE 1; the capture id is the graph's address. */
static CUresult capture_info(CUstream h, int *status, cuuint64_t *id)
{
    CUresult r = fg_check_live();
    if (r)
        return r;
    struct fg_stream *s = stream_of(h);
    if (!s || !status)
        return CUDA_ERROR_INVALID_VALUE;
    *status = s->capture != NULL;
    if (id && s->capture)
        *id = (cuuint64_t)(uintptr_t)s->capture;
    return CUDA_SUCCESS;
}
FG_API CUresult cuStreamIsCapturing(CUstream s, int *status) { LOCKED(capture_info(s, status, NULL)); }
FG_API CUresult cuStreamIsCapturing_ptsz(CUstream s, int *status) { LOCKED(capture_info(s, status, NULL)); }
FG_API CUresult cuStreamGetCaptureInfo(CUstream s, int *status, cuuint64_t *id) { LOCKED(capture_info(s, status, id)); }
FG_API CUresult cuStreamGetCaptureInfo_ptsz(CUstream s, int *status, cuuint64_t *id)
{
    LOCKED(capture_info(s, status, id));
}
