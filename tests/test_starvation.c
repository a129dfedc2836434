/* Starved of memory and of file descriptors.
 *
 * Memory: every allocation libepipe makes during a codec's
 * round trip, and during a few steps of a pipeline of threads (over
 * inproc, TCP with its rendezvous, encrypted TCP, and rdma over the test
 * verbs provider where the environment names it), fails in turn, once (the
 * k-th fails, the rest succeed) and for good (the k-th and every later one
 * fail). Each time the call that met the failure returns EPIPE_ENOMEM with
 * a message (its pipeline peers EPIPE_EPEER), nothing crashes or hangs,
 * nothing leaks (the blocks live after the handles are destroyed are those
 * live before), and the same work run again afterwards gives the
 * reference run's bytes: a failure leaves no state behind. Work that
 * recovers from a failed allocation by itself must still give the
 * reference's bytes.
 *
 * The program defines malloc and its relatives over glibc's __libc_*
 * functions, and fails and counts only allocations asked for by
 * libepipe.so or by libc on its behalf (strdup, stdio, the resolver): this
 * program's own (the pipeline host's model), OpenBLAS's, the verbs
 * provider's and the dynamic loader's are left alone. Where
 * libepipe is linked statically (a static build) the codec half fails this
 * executable's allocations instead, and the pipeline half is skipped.
 * Under AddressSanitizer, which owns malloc, it reports a skip (exit 77).
 *
 * Threads: every thread libepipe starts in those pipelines fails to start
 * in turn (pthread_create, defined here too, returns EAGAIN): a failure is
 * EPIPE_EIO naming the thread, or the run goes on without it unchanged.
 *
 * Descriptors: the pipelines over TCP and rdma run under every
 * RLIMIT_NOFILE from the descriptors already open up to the first that
 * lets them succeed twice: each run that fails names the cause ("Too many
 * open files") on some rank, and none leaves a descriptor open. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <link.h>
#include <malloc.h>
#include <math.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fcntl.h>
#include <pthread.h>
#include <sys/resource.h>
#include <unistd.h>

#include <epipe/epipe.h>

#include "loopback.h"
#include "pipeline_host.h"

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define NO_INTERPOSE 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) ||                         \
    __has_feature(memory_sanitizer)
#define NO_INTERPOSE 1
#endif
#endif

#ifndef NO_INTERPOSE

/* ---- the allocator ------------------------------------------------------- */

extern void *__libc_malloc(size_t);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void __libc_free(void *);
extern void *__libc_memalign(size_t, size_t);

static atomic_int armed;         /* count and fail candidates */
static atomic_long seen;         /* candidates met while armed */
static atomic_long fail_at;      /* the candidate that fails (1-based); 0: none */
static atomic_int fail_for_good; /* and every one after it */

/* The blocks libepipe and libc asked for and have not freed: a set of
 * addresses (open addressing, linear probing, rebuilt when tombstones
 * pile up), so that what the dynamic loader keeps (dlopen's tables, a
 * thread's TLS) is not taken for a leak. */
#define LIVE_SLOTS (1u << 16)
#define TOMB ((uintptr_t)1)
static uintptr_t live_set[LIVE_SLOTS], live_tmp[LIVE_SLOTS];
static unsigned live_count, live_used; /* entries, and entries plus tombstones */
static pthread_mutex_t live_lock = PTHREAD_MUTEX_INITIALIZER;

static unsigned slot_of(uintptr_t p)
{
    return (unsigned)((p >> 4) * 0x9e3779b97f4a7c15ull >> 48) & (LIVE_SLOTS - 1);
}

static void live_insert(uintptr_t p)
{
    unsigned i = slot_of(p);
    while (live_set[i] > TOMB)
        i = (i + 1) & (LIVE_SLOTS - 1);
    live_used += live_set[i] == 0;
    live_set[i] = p;
    live_count++;
}

static void live_add(const void *p)
{
    if (!p)
        return;
    pthread_mutex_lock(&live_lock);
    if (live_used + 1 > LIVE_SLOTS / 4 * 3) { /* drop the tombstones */
        memcpy(live_tmp, live_set, sizeof live_set);
        memset(live_set, 0, sizeof live_set);
        live_count = live_used = 0;
        for (unsigned i = 0; i < LIVE_SLOTS; i++)
            if (live_tmp[i] > TOMB)
                live_insert(live_tmp[i]);
        if (live_used + 1 > LIVE_SLOTS / 4 * 3)
            abort(); /* more live blocks than the test can follow */
    }
    live_insert((uintptr_t)p);
    pthread_mutex_unlock(&live_lock);
}

static void live_del(const void *p)
{
    if (!p)
        return;
    pthread_mutex_lock(&live_lock);
    for (unsigned i = slot_of((uintptr_t)p); live_set[i]; i = (i + 1) & (LIVE_SLOTS - 1))
        if (live_set[i] == (uintptr_t)p) {
            live_set[i] = TOMB;
            live_count--;
            break;
        }
    pthread_mutex_unlock(&live_lock);
}

static long live_blocks(void)
{
    pthread_mutex_lock(&live_lock);
    long n = live_count;
    pthread_mutex_unlock(&live_lock);
    return n;
}

/* The code whose allocations are candidates: libepipe (or this
 * executable, where it holds libepipe) and libc. */
static struct {
    uintptr_t lo, hi;
} ranges[16];
static int nranges, shared_lib;

static int is_candidate(const void *caller)
{
    uintptr_t a = (uintptr_t)caller;
    for (int i = 0; i < nranges; i++)
        if (a >= ranges[i].lo && a < ranges[i].hi)
            return 1;
    return 0;
}

static int should_fail(const void *caller)
{
    if (!atomic_load(&armed) || !is_candidate(caller))
        return 0;
    long n = atomic_fetch_add(&seen, 1) + 1, k = atomic_load(&fail_at);
    return k && (n == k || (atomic_load(&fail_for_good) && n > k));
}

/* p, entered in the live set when the caller is a candidate. */
static void *counted(void *p, const void *caller)
{
    if (p && is_candidate(caller))
        live_add(p);
    return p;
}

void *malloc(size_t n)
{
    const void *caller = __builtin_return_address(0);
    if (should_fail(caller)) {
        errno = ENOMEM;
        return NULL;
    }
    return counted(__libc_malloc(n), caller);
}

void *calloc(size_t n, size_t size)
{
    const void *caller = __builtin_return_address(0);
    if (should_fail(caller)) {
        errno = ENOMEM;
        return NULL;
    }
    return counted(__libc_calloc(n, size), caller);
}

void *realloc(void *p, size_t n)
{
    const void *caller = __builtin_return_address(0);
    if (should_fail(caller)) {
        errno = ENOMEM;
        return NULL;
    }
    void *q = __libc_realloc(p, n);
    if (q || !n) { /* moved, or freed (glibc: realloc(p, 0)) */
        live_del(p);
        counted(q, caller);
    }
    return q;
}

void free(void *p)
{
    live_del(p);
    __libc_free(p);
}

static void *aligned(size_t align, size_t n, const void *caller)
{
    if (should_fail(caller)) {
        errno = ENOMEM;
        return NULL;
    }
    return counted(__libc_memalign(align, n), caller);
}

int posix_memalign(void **out, size_t align, size_t n)
{
    if (align < sizeof(void *) || (align & (align - 1)))
        return EINVAL;
    void *p = aligned(align, n, __builtin_return_address(0));
    if (!p)
        return ENOMEM;
    *out = p;
    return 0;
}

void *aligned_alloc(size_t align, size_t n)
{
    return aligned(align, n, __builtin_return_address(0));
}

void *memalign(size_t align, size_t n)
{
    return aligned(align, n, __builtin_return_address(0));
}

/* ctx: 1 to take this executable, 0 for libepipe.so and libc. */
/* Threads: pthread_create asked for by libepipe fails as allocations do,
 * when thread_fail_at is set (EAGAIN, as when a process is at its task
 * limit). */
static atomic_long thread_seen, thread_fail_at;
static atomic_int thread_fail_for_good;

int pthread_create(pthread_t *th, const pthread_attr_t *attr, void *(*fn)(void *), void *arg)
{
    static int (*real)(pthread_t *, const pthread_attr_t *, void *(*)(void *), void *);
    if (!real)
        *(void **)&real = dlsym(RTLD_NEXT, "pthread_create");
    if (is_candidate(__builtin_return_address(0))) {
        long n = atomic_fetch_add(&thread_seen, 1) + 1, k = atomic_load(&thread_fail_at);
        if (k && (n == k || (atomic_load(&thread_fail_for_good) && n > k)))
            return EAGAIN;
    }
    return real(th, attr, fn, arg);
}

static int find_ranges(struct dl_phdr_info *info, size_t size, void *ctx)
{
    (void)size;
    const char *name = info->dlpi_name;
    int exe = !name || !name[0], lib = !exe && strstr(name, "/libepipe.so");
    if (!(exe ? *(int *)ctx : lib || strstr(name, "/libc.so")))
        return 0;
    shared_lib |= lib;
    for (int i = 0; i < info->dlpi_phnum && nranges < 16; i++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        if (ph->p_type == PT_LOAD && (ph->p_flags & PF_X)) {
            ranges[nranges].lo = info->dlpi_addr + ph->p_vaddr;
            ranges[nranges].hi = ranges[nranges].lo + ph->p_memsz;
            nranges++;
        }
    }
    return 0;
}

/* ---- the round trips ----------------------------------------------------- */

#define N 8192
#define CAP (N * 8 + 4096)

/* What a round trip produced, compared with the reference's. */
struct trip {
    int rc;
    const char *call;
    char msg[512];
    size_t len[2];
    uint8_t pay[2][CAP];
    float y[N], gx[N];
};

static float x[N], gy[N];
static struct trip ref, got;
static int64_t shape[4] = {8, 4, 16, 16};

static DLTensor view(float *data)
{
    return (DLTensor){
        .data = data, .device = {kDLCPU, 0}, .ndim = 4, .dtype = {kDLFloat, 32, 1}, .shape = shape};
}

static int failed(struct trip *t, int rc, const char *call, const char *msg)
{
    t->rc = rc;
    t->call = call;
    snprintf(t->msg, sizeof t->msg, "%s", msg ? msg : "(null)");
    return rc;
}

/* A workload of plain calls on fresh handles, freed before it returns:
 * 0 with what it computed in t (compared with the reference's by same()),
 * or the status of the call that failed, named in t with its message. */
typedef int (*work_fn)(const void *arg, struct trip *t);

/* Codec `arg` (a spec): encode (twice: error feedback carries state),
 * decode, and for a trainable codec both backwards. */
static int round_trip(const void *arg, struct trip *t)
{
    const char *spec = arg;
    epipe_codec *enc = NULL, *dec = NULL;
    DLTensor src = view(x), out = view(t->y), g = view(gy), gin = view(t->gx);
    float *code = NULL;
    int rc = epipe_codec_create(&enc, spec);
    if (rc) {
        failed(t, rc, "create", epipe_last_error());
        goto done;
    }
    rc = epipe_codec_create(&dec, spec);
    if (rc) {
        failed(t, rc, "create (decoder)", epipe_last_error());
        goto done;
    }
    int trainable = epipe_codec_trainable(enc);
    if (trainable && ((rc = epipe_codec_set_param(enc, EPIPE_CODEC_MICROBATCH, 0)) ||
                      (rc = epipe_codec_set_param(dec, EPIPE_CODEC_MICROBATCH, 0)))) {
        failed(t, rc, "set_param", epipe_codec_last_error(enc));
        goto done;
    }
    size_t cap;
    rc = epipe_codec_max_encoded_size(enc, &src, &cap);
    if (rc || cap > CAP) {
        failed(t, rc ? rc : EPIPE_ENOSPC, "max_encoded_size", epipe_codec_last_error(enc));
        goto done;
    }
    /* activation deltas: the rows are samples 0..7, sent whole the first
     * time and as deltas the second */
    static const uint64_t ids[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    int delta = strstr(spec, "delta=1") != NULL;
    for (int i = 0; i < 2; i++) {
        if (delta && (rc = epipe_codec_set_samples(enc, ids, 8))) {
            failed(t, rc, "set_samples", epipe_codec_last_error(enc));
            goto done;
        }
        rc = epipe_codec_encode(enc, &src, t->pay[i], CAP, &t->len[i]);
        if (rc) {
            failed(t, rc, "encode", epipe_codec_last_error(enc));
            goto done;
        }
    }
    /* both, in order: a delta needs the rows the first one stored */
    for (int i = 0; i < 2; i++) {
        rc = epipe_codec_decode(dec, t->pay[i], t->len[i], &out);
        if (rc) {
            failed(t, rc, "decode", epipe_codec_last_error(dec));
            goto done;
        }
    }
    if (trainable) {
        int cnd;
        int64_t cshape[EPIPE_CODEC_MAX_NDIM];
        rc = epipe_codec_code_shape(enc, &src, &cnd, cshape);
        size_t cn = 1;
        for (int i = 0; !rc && i < cnd; i++)
            cn *= (size_t)cshape[i];
        /* the test's own buffer: not a candidate */
        atomic_store(&armed, 0);
        code = calloc(cn, sizeof *code);
        atomic_store(&armed, 1);
        DLTensor gc = {.data = code,
                       .device = {kDLCPU, 0},
                       .ndim = cnd,
                       .dtype = {kDLFloat, 32, 1},
                       .shape = cshape};
        if (rc || !code) {
            failed(t, rc ? rc : EPIPE_ENOMEM, "code_shape", epipe_codec_last_error(enc));
            goto done;
        }
        /* the second encode replaced the first's kept input: a key of its
         * own for the backward */
        if ((rc = epipe_codec_decode_backward(dec, 0, &g, &gc))) {
            failed(t, rc, "decode_backward", epipe_codec_last_error(dec));
            goto done;
        }
        if ((rc = epipe_codec_encode_backward(enc, 0, &gc, &gin))) {
            failed(t, rc, "encode_backward", epipe_codec_last_error(enc));
            goto done;
        }
    }
    t->rc = 0;
done:
    epipe_codec_destroy(enc);
    epipe_codec_destroy(dec);
    free(code);
    return rc;
}

static int same(const struct trip *a, const struct trip *b)
{
    for (int i = 0; i < 2; i++)
        if (a->len[i] != b->len[i] || memcmp(a->pay[i], b->pay[i], a->len[i]))
            return 0;
    return !memcmp(a->y, b->y, sizeof a->y) && !memcmp(a->gx, b->gx, sizeof a->gx);
}

/* Every lossy codec and the library's allocation paths: handle and
 * spec, scratch, error feedback, sample/exact/fit sortquant, per-row and
 * per-group ranges, kmeans, topk, the BLAS codecs, a chain, and
 * activation deltas (stored rows on both sides). */
static const char *const specs[] = {
    "none",
    "cast:dtype=fp16",
    "quant:bits=8",
    "quant:bits=4,rows=1",
    "quant:bits=2,group=64,zero=1",
    "quant:bits=4,ef=1",
    "sortquant:bits=8",
    "sortquant:bits=8,mode=sample",
    "sortquant:bits=6,mode=exact",
    "sortquant:bits=4,zero=1,ef=1",
    "kmeans:bits=3",
    "topk:ratio=0.1",
    "topk:ratio=0.05,ef=1",
    "poweriter:rank=2",
    "insert:kind=conv,ratio=0.5,kernel=2",
    "insert:kind=linear,out=8|quant:bits=5",
    "quant:bits=2,delta=1",
    "sortquant:bits=4,delta=1,delta_raw=0",
};
#define NSPECS (sizeof specs / sizeof specs[0])

/* Every allocation of fn(arg) failed in turn, once and for good: the call
 * that met it returns EPIPE_ENOMEM with a message, or the work recovers
 * with the reference's result; nothing leaks; the next unstarved run gives
 * the reference's result again. */
static int check_work(const char *what, work_fn fn, const void *arg)
{
    int bad = 0;
    memset(&ref, 0, sizeof ref);
    atomic_store(&fail_at, 0);
    atomic_store(&armed, 1);
    int rc = fn(arg, &ref);
    atomic_store(&armed, 0);
    if (rc == EPIPE_ENOTSUP) { /* insert, poweriter without BLAS */
        printf("SKIP %s: %s\n", what, ref.msg);
        return 0;
    }
    if (ref.rc) {
        printf("FAIL %s: the reference run failed in %s: %s\n", what, ref.call, ref.msg);
        return 1;
    }
    /* count the candidates of one run */
    memset(&got, 0, sizeof got);
    atomic_store(&seen, 0);
    atomic_store(&armed, 1);
    fn(arg, &got);
    atomic_store(&armed, 0);
    long total = atomic_load(&seen);
    if (!same(&ref, &got)) {
        printf("FAIL %s: two unstarved runs differ\n", what);
        return 1;
    }
    long recovered = 0;
    for (int mode = 0; mode < 2; mode++)
        for (long k = 1; k <= total; k++) {
            long before = live_blocks();
            atomic_store(&seen, 0);
            atomic_store(&fail_for_good, mode);
            atomic_store(&fail_at, k);
            memset(&got, 0, sizeof got);
            atomic_store(&armed, 1);
            rc = fn(arg, &got);
            atomic_store(&armed, 0);
            atomic_store(&fail_at, 0);
            long after = live_blocks();
            const char *how = mode ? "from allocation" : "allocation";
            if (rc == EPIPE_OK) {
                recovered++;
                if (!same(&ref, &got)) {
                    printf("FAIL %s: %s %ld of %ld failed, and the call succeeded with another "
                           "result\n",
                           what, how, k, total);
                    bad = 1;
                }
            } else if (rc != EPIPE_ENOMEM || !got.msg[0]) {
                printf("FAIL %s: %s %ld of %ld failed: %s returned %d (%s), message \"%s\"\n", what,
                       how, k, total, got.call, rc, epipe_status_name(rc), got.msg);
                bad = 1;
            }
            if (after != before) {
                printf("FAIL %s: %s %ld of %ld failed in %s: %ld blocks leaked\n", what, how, k,
                       total, rc ? got.call : "(no call)", after - before);
                bad = 1;
            }
            /* the same work again, unstarved */
            memset(&got, 0, sizeof got);
            atomic_store(&armed, 1);
            rc = fn(arg, &got);
            atomic_store(&armed, 0);
            if (rc || !same(&ref, &got)) {
                printf("FAIL %s: after %s %ld of %ld failed, the next run %s\n", what, how, k,
                       total, got.rc ? got.msg : "gave another result");
                bad = 1;
            }
            if (bad)
                return 1;
        }
    printf("ok %s: %ld allocations, each failed once and for good; %ld runs recovered by "
           "themselves\n",
           what, total, recovered);
    return 0;
}

/* ---- the planner and the simulator ---------------------------------------- */

/* The planner's and the simulator's results as text, where same() looks:
 * payload 0. */
static void digest(struct trip *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void digest(struct trip *t, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    size_t n = t->len[0];
    int w = vsnprintf((char *)t->pay[0] + n, CAP - n, fmt, ap);
    va_end(ap);
    if (w > 0)
        t->len[0] = n + (size_t)w < CAP ? n + (size_t)w : CAP - 1;
}

/* A plan for a 6-layer chain on 3 stages with 2 codecs a boundary. */
static int plan_work(const void *arg, struct trip *t)
{
    (void)arg;
    epipe_plan_layer layers[6];
    epipe_plan_codec codecs[20];
    size_t nc = 0;
    for (int l = 0; l < 6; l++) {
        layers[l] = (epipe_plan_layer){.forward_s = 1e-3 * (l + 1),
                                       .backward_s = 2e-3 * (l + 1),
                                       .weight_s = 1e-3 * (l + 1),
                                       .out_bytes = 4e6 / (l + 1),
                                       .param_bytes = 1e5,
                                       .stash_bytes = 2e6};
        for (unsigned d = 0; l < 5 && d < 2; d++) {
            codecs[nc++] = (epipe_plan_codec){
                "sortquant:bits=8", (unsigned)l, d, 1e-4, 1e-4, 0.26, 1e-4};
            codecs[nc++] = (epipe_plan_codec){"quant:bits=4", (unsigned)l, d,   5e-5,
                                              5e-5,           0.13,        1e-2};
        }
    }
    epipe_plan_options o = EPIPE_PLAN_OPTIONS_INIT;
    o.stages = 3, o.microbatches = 8, o.bandwidth = 1.25e7;
    epipe_plan *plan = NULL;
    int rc = epipe_plan_create(&plan, layers, 6, codecs, nc, &o);
    if (rc)
        return failed(t, rc, "epipe_plan_create", epipe_last_error());
    digest(t, "%s %a %u %u |", epipe_plan_schedule(plan), epipe_plan_step_seconds(plan),
           epipe_plan_first_layer(plan, 1), epipe_plan_first_layer(plan, 2));
    for (unsigned b = 0; b < 2; b++)
        for (unsigned d = 0; d < 2; d++)
            digest(t, " %s", epipe_plan_codec_spec(plan, b, d));
    static char explained[32768];
    epipe_plan_explain(plan, explained, sizeof explained);
    digest(t, " %s", explained);
    epipe_plan_destroy(plan);
    return EPIPE_OK;
}

/* zb-h1 on 4 stages, 8 micro-batches, simulated with a cost per stage. */
static int sim_work(const void *arg, struct trip *t)
{
    (void)arg;
    epipe_schedule *sc = NULL;
    epipe_sim *sim = NULL;
    int rc = epipe_schedule_create(&sc, "zb-h1", 4, 8);
    if (!rc)
        rc = epipe_sim_create(&sim, sc);
    for (unsigned st = 0; !rc && st < 4; st++)
        rc = epipe_sim_set_cost(sim, EPIPE_SIM_FORWARD, st, 1.0 + st);
    if (!rc)
        rc = epipe_sim_run(sim);
    if (rc)
        failed(t, rc, "the simulation", epipe_last_error());
    else
        digest(t, "%a", epipe_sim_makespan(sim));
    epipe_sim_destroy(sim);
    epipe_schedule_destroy(sc);
    return rc;
}

/* ---- the pipelines ------------------------------------------------------- */

static atomic_long log_lines;

static atomic_int trace_warned; /* the trace said it is incomplete */

static void count_log(void *user, int level, const char *subsys, int rank, const char *message)
{
    (void)user, (void)level, (void)rank, (void)message;
    atomic_fetch_add(&log_lines, 1);
    if (!strcmp(subsys, "trace"))
        atomic_store(&trace_warned, 1);
}

#define MAX_RANKS 3

/* What a pipeline run produced: each rank's status and message, and the
 * trained layers and last loss, compared with the reference's. */
struct run {
    int comm_rc;
    char comm_msg[256];
    int rc[MAX_RANKS];
    char msg[MAX_RANKS][512]; /* the library's message (up to 255) and a prefix */
    double last_loss;
    long spans;       /* in the trace files, when traced */
    int trace_warned; /* and the library said some are missing */
    float w[HOST_MAX_LAYERS][16 * 16], b[HOST_MAX_LAYERS][16];
};

static struct run pref, pgot;

/* 1: starved runs get the long rendezvous timeout too. */
static int patient_rendezvous;
/* > 0: the ranks of the next pipeline run with at most this many open
 * descriptors in the process (RLIMIT_NOFILE). */
static rlim_t fd_limit;

/* A TCP rank: its communicator made in its own thread, then the host. */
struct tcp_rank {
    struct host_rank *a;
    unsigned rank, size, port;
    const char *transport, *options;
    int rc;
    char msg[256];
};

static void *tcp_rank_thread(void *p)
{
    struct tcp_rank *t = p;

    t->rc = epipe_comm_create(&t->a->comm, t->transport, t->rank, t->size, "127.0.0.1", t->port,
                              t->options);
    if (t->rc)
        snprintf(t->msg, sizeof t->msg, "%s", epipe_last_error());
    else
        host_rank_thread(t->a);
    return NULL;
}

static unsigned free_port(void)
{
    unsigned port = loopback_free_port();
    if (!port) {
        printf("FAIL: no free port\n");
        exit(1);
    }
    return port;
}

/* How the ranks of a pipeline meet: inproc where tcp_options is NULL,
 * else `transport` (tcp, rdma) on loopback with tcp_options, which end in
 * "init_timeout_ms=" (the value is added here). */
struct link {
    const char *transport, *tcp_options;
    const char *trace; /* the stem of the ranks' trace files, STEM-R.json (the
                          options name them too), or NULL */
};

/* The spans in the trace files of `stem` for p ranks (each span has one
 * "ph"), which it deletes; -1 for a file that is not there. */
static long count_spans(const char *stem, unsigned p)
{
    long n = 0;
    for (unsigned r = 0; r < p; r++) {
        char path[128], line[1024];
        snprintf(path, sizeof path, "%s-%u.json", stem, r);
        FILE *f = fopen(path, "r");
        if (!f)
            return -1;
        while (fgets(line, sizeof line, f))
            n += strstr(line, "\"ph\"") != NULL;
        fclose(f);
        unlink(path);
    }
    return n;
}

/* cfg on p ranks, threads of one process, joined as `how` says. */
static void pipeline(const struct host_config *cfg, unsigned p, const struct link *how,
                     struct run *out)
{
    const char *tcp_options = how->tcp_options;
    atomic_store(&trace_warned, 0);
    static struct host_rank a[MAX_RANKS];
    static struct tcp_rank t[MAX_RANKS];
    epipe_comm *c[MAX_RANKS];
    pthread_t tid[MAX_RANKS];
    memset(out, 0, sizeof *out);
    if (!tcp_options && (out->comm_rc = epipe_comm_create_inproc(c, p))) {
        snprintf(out->comm_msg, sizeof out->comm_msg, "%s", epipe_last_error());
        atomic_store(&armed, 0);
        return;
    }
    int armed_now = atomic_exchange(&armed, 0); /* the port is the test's */
    unsigned port = tcp_options ? free_port() : 0;
    /* A starved rank may fail before rank 0 listens, and then the others
     * wait out the rendezvous: a short one keeps the sweep short, a long
     * one keeps an unstarved run (or a starved one run again, see
     * check_pipeline) safe on a loaded machine. */
    char opts[400];
    int starved = atomic_load(&fail_at) || fd_limit;
    if (tcp_options)
        snprintf(opts, sizeof opts, "%s%d", tcp_options,
                 starved && !patient_rendezvous ? (fd_limit ? 1000 : 300) : 20000);
    atomic_store(&armed, armed_now);
    struct rlimit unlimited;
    getrlimit(RLIMIT_NOFILE, &unlimited);
    if (fd_limit) { /* from here to the end of the ranks */
        struct rlimit lim = unlimited;
        lim.rlim_cur = fd_limit;
        setrlimit(RLIMIT_NOFILE, &lim);
    }
    for (unsigned r = 0; r < p; r++) {
        memset(&a[r], 0, sizeof a[r]);
        a[r].comm = tcp_options ? NULL : c[r];
        a[r].cfg = *cfg;
        t[r] = (struct tcp_rank){.a = &a[r],
                                 .rank = r,
                                 .size = p,
                                 .port = port,
                                 .transport = how->transport,
                                 .options = opts};
        if (pthread_create(&tid[r], NULL, tcp_options ? tcp_rank_thread : host_rank_thread,
                           tcp_options ? (void *)&t[r] : (void *)&a[r])) {
            atomic_store(&armed, 0);
            printf("FAIL: no thread for rank %u\n", r);
            exit(1);
        }
    }
    for (unsigned r = 0; r < p; r++)
        pthread_join(tid[r], NULL);
    atomic_store(&armed, 0);
    if (fd_limit)
        setrlimit(RLIMIT_NOFILE, &unlimited);
    for (unsigned r = 0; r < p; r++) {
        struct host_result *res = &a[r].res;
        if (tcp_options && t[r].rc) {
            out->rc[r] = t[r].rc;
            snprintf(out->msg[r], sizeof out->msg[r], "epipe_comm_create: %s", t[r].msg);
            continue;
        }
        out->rc[r] = res->rc;
        snprintf(out->msg[r], sizeof out->msg[r], "%s", res->error);
        if (res->holds_last)
            out->last_loss = res->last_loss;
        for (int l = 0; l < host_nlayers; l++)
            if (res->owns[l]) {
                const mlp_layer *L = &res->layers[l];
                memcpy(out->w[l], L->w, sizeof(float) * (size_t)(L->in * L->out));
                memcpy(out->b[l], L->b, sizeof(float) * (size_t)L->out);
            }
        host_result_free(res);
    }
    if (how->trace) { /* written when the last stage of each file closed */
        out->spans = count_spans(how->trace, p);
        out->trace_warned = atomic_load(&trace_warned);
    }
}

static int same_run(const struct run *a, const struct run *b)
{
    return !memcmp(a->w, b->w, sizeof a->w) && !memcmp(a->b, b->b, sizeof a->b) &&
           a->last_loss == b->last_loss;
}

/* One starved run judged: 0 when it failed as it should or succeeded with
 * the reference's result. */
static int judge_run(const char *what, const char *how, long k, long total, unsigned p,
                     const struct run *r)
{
    if (r->comm_rc) {
        if (r->comm_rc == EPIPE_ENOMEM && r->comm_msg[0])
            return 0;
        printf("FAIL %s: %s %ld of %ld failed: epipe_comm_create_inproc returned %s (\"%s\")\n",
               what, how, k, total, epipe_status_name(r->comm_rc), r->comm_msg);
        return 1;
    }
    int nomem = 0, failed = 0, bad = 0;
    for (unsigned q = 0; q < p; q++) {
        int rc = r->rc[q];
        failed |= rc != 0;
        nomem |= rc == EPIPE_ENOMEM;
        /* A rank waiting in the TCP rendezvous for one that failed before
         * it could say so (a master that never listened) can only time
         * out. */
        int waited = rc == EPIPE_ETIMEDOUT && !strncmp(r->msg[q], "epipe_comm_create:", 18);
        if ((rc && rc != EPIPE_ENOMEM && rc != EPIPE_EPEER && !waited) || (rc && !r->msg[q][0]))
            bad = 1;
    }
    if (!failed && !same_run(&pref, r)) {
        printf("FAIL %s: %s %ld of %ld failed, and the run succeeded with other results\n", what,
               how, k, total);
        return 1;
    }
    if (!failed && r->spans != pref.spans && !r->trace_warned) {
        printf("FAIL %s: %s %ld of %ld failed, and the trace holds %ld spans, not %ld, without a "
               "word\n",
               what, how, k, total, r->spans, pref.spans);
        return 1;
    }
    if (bad || (failed && !nomem)) {
        printf("FAIL %s: %s %ld of %ld failed:", what, how, k, total);
        for (unsigned q = 0; q < p; q++)
            printf(" rank %u %s (\"%s\")", q, epipe_status_name(r->rc[q]), r->msg[q]);
        printf("\n");
        return 1;
    }
    return 0;
}

static int check_pipeline(const char *what, const struct host_config *cfg, unsigned p,
                          const struct link *tcp)
{
    atomic_store(&fail_at, 0);
    atomic_store(&seen, 0);
    atomic_store(&armed, 1);
    pipeline(cfg, p, tcp, &pref);
    long total = atomic_load(&seen);
    if (pref.rc[0] == EPIPE_ENOTSUP) { /* no libsodium, no verbs provider */
        printf("SKIP %s: %s\n", what, pref.msg[0]);
        return 0;
    }
    if (tcp->trace && pref.spans <= 0) {
        printf("FAIL %s: the reference run wrote no trace to %s-R.json\n", what, tcp->trace);
        return 1;
    }
    for (unsigned q = 0; q < p; q++)
        if (pref.comm_rc || pref.rc[q]) {
            printf("FAIL %s: the reference run failed: %s\n", what,
                   pref.comm_rc ? pref.comm_msg : pref.msg[q]);
            return 1;
        }
    long recovered = 0;
    for (int mode = 0; mode < 2; mode++)
        for (long k = 1; k <= total; k++) {
            const char *how = mode ? "from allocation" : "allocation";
            long before = live_blocks();
            for (int patience = 0; patience < 2; patience++) {
                atomic_store(&seen, 0);
                atomic_store(&fail_for_good, mode);
                atomic_store(&fail_at, k);
                patient_rendezvous = patience;
                atomic_store(&armed, 1);
                pipeline(cfg, p, tcp, &pgot);
                atomic_store(&fail_at, 0);
                /* Failed, but not with EPIPE_ENOMEM anywhere: a rendezvous
                 * too slow for the short timeout (a loaded machine), before
                 * allocation k or before a rank refused for want of memory
                 * had dialled again. Once more with the long one; a failure
                 * then is judged. */
                int failed = pgot.comm_rc, nomem = pgot.comm_rc == EPIPE_ENOMEM;
                for (unsigned q = 0; q < p; q++)
                    failed |= pgot.rc[q], nomem |= pgot.rc[q] == EPIPE_ENOMEM;
                if (!failed || nomem)
                    break;
            }
            long after = live_blocks();
            int bad = judge_run(what, how, k, total, p, &pgot);
            recovered += !pgot.comm_rc && !pgot.rc[0] && !pgot.rc[1] && !pgot.rc[p - 1];
            if (after != before) {
                printf("FAIL %s: %s %ld of %ld failed: %ld blocks leaked\n", what, how, k, total,
                       after - before);
                bad = 1;
            }
            atomic_store(&armed, 1);
            pipeline(cfg, p, tcp, &pgot);
            int again = pgot.comm_rc;
            for (unsigned q = 0; q < p; q++)
                again |= pgot.rc[q];
            if (again || !same_run(&pref, &pgot) || pgot.spans != pref.spans) {
                printf("FAIL %s: after %s %ld of %ld failed, the next run %s\n", what, how, k,
                       total, again ? "failed" : "gave other results");
                bad = 1;
            }
            if (bad)
                return 1;
        }
    printf("ok %s: about %ld allocations, each failed once and for good; %ld runs recovered "
           "by themselves\n",
           what, total, recovered);
    return 0;
}

/* ---- file descriptors ---------------------------------------------------- */

/* Descriptors open in this process. */
static long open_fds(void)
{
    long n = 0;
    for (int fd = 0; fd < 65536; fd++)
        n += fcntl(fd, F_GETFD) != -1;
    return n;
}

/* The pipeline with the process's descriptor limit at every value from
 * the descriptors already open up, until it succeeds twice in a row: each
 * failing run names the cause ("Too many open files") on at least one rank
 * and returns only descriptor-starvation statuses, a run that succeeds
 * equals the reference, and no descriptor is left open. */
static int check_fd_starvation(const char *what, const struct host_config *cfg, unsigned p,
                               const struct link *how)
{
    pipeline(cfg, p, how, &pref);
    for (unsigned q = 0; q < p; q++)
        if (pref.rc[q] == EPIPE_ENOTSUP) {
            printf("SKIP %s: %s\n", what, pref.msg[q]);
            return 0;
        } else if (pref.rc[q]) {
            printf("FAIL %s: the reference run failed: %s\n", what, pref.msg[q]);
            return 1;
        }
    const char *cause = strerror(EMFILE);
    long base = open_fds(), failed_runs = 0, lim = base;
    for (int in_row = 0; in_row < 2; lim++) {
        if (lim > base + 256) {
            printf("FAIL %s: still failing with %ld descriptors\n", what, lim);
            return 1;
        }
        int failed = 0, named = 0, odd = 0;
        for (int patience = 0; patience < 2; patience++) {
            fd_limit = (rlim_t)lim;
            patient_rendezvous = patience;
            pipeline(cfg, p, how, &pgot);
            fd_limit = 0;
            failed = named = odd = 0;
            for (unsigned q = 0; q < p; q++) {
                int rc = pgot.rc[q];
                failed |= rc != 0;
                named |= strstr(pgot.msg[q], cause) != NULL;
                odd |= rc && (!pgot.msg[q][0] ||
                              (rc != EPIPE_EIO && rc != EPIPE_ENOTSUP && rc != EPIPE_ETIMEDOUT &&
                               rc != EPIPE_EPEER && rc != EPIPE_ENOMEM));
            }
            if (!failed || named) /* else a slow rendezvous, perhaps: once more, patiently */
                break;
        }
        long left = open_fds();
        int bad = left != base || odd || (failed && !named) || (!failed && !same_run(&pref, &pgot));
        if (bad) {
            printf("FAIL %s, at most %ld descriptors (%ld open before):", what, lim, base);
            if (left != base)
                printf(" %ld left open;", left - base);
            if (!failed && !same_run(&pref, &pgot))
                printf(" it succeeded with other results;");
            for (unsigned q = 0; q < p; q++)
                printf(" rank %u %s (\"%s\")", q, epipe_status_name(pgot.rc[q]), pgot.msg[q]);
            printf("\n");
            return 1;
        }
        failed_runs += failed;
        in_row = failed ? 0 : in_row + 1;
    }
    printf("ok %s: %ld descriptor limits failed, each naming the cause, nothing left open; runs "
           "from %ld descriptors on\n",
           what, failed_runs, lim - 2);
    return 0;
}

/* ---- threads --------------------------------------------------------------- */

/* Every thread libepipe starts in the pipeline fails to start in turn, once
 * and from then on: a run that fails must say so (a message naming the
 * thread it could not start, on some rank) with EPIPE_EIO there and
 * EPIPE_EPEER or a rendezvous timeout elsewhere, a run that goes on
 * without the thread (a helper it can do without) must equal the
 * reference, and the next run must too. */
static int check_thread_starvation(const char *what, const struct host_config *cfg, unsigned p,
                                   const struct link *how)
{
    atomic_store(&thread_seen, 0);
    pipeline(cfg, p, how, &pref);
    long total = atomic_load(&thread_seen), recovered = 0;
    for (unsigned q = 0; q < p; q++)
        if (pref.rc[q] == EPIPE_ENOTSUP) {
            printf("SKIP %s: %s\n", what, pref.msg[q]);
            return 0;
        }
    for (int mode = 0; mode < 2; mode++)
        for (long k = 1; k <= total; k++) {
            long fds = open_fds(), blocks = live_blocks();
            atomic_store(&thread_seen, 0);
            atomic_store(&thread_fail_for_good, mode);
            atomic_store(&thread_fail_at, k);
            pipeline(cfg, p, how, &pgot);
            atomic_store(&thread_fail_at, 0);
            int failed = pgot.comm_rc, named = 0, odd = 0;
            for (unsigned q = 0; q < p; q++) {
                int rc = pgot.rc[q];
                failed |= rc;
                named |= rc == EPIPE_EIO && strstr(pgot.msg[q], "thread") != NULL;
                odd |= rc &&
                       (!pgot.msg[q][0] || (rc != EPIPE_EIO && rc != EPIPE_EPEER &&
                                            !(rc == EPIPE_ETIMEDOUT &&
                                              !strncmp(pgot.msg[q], "epipe_comm_create:", 18))));
            }
            int bad = odd || (failed && !named) || (!failed && !same_run(&pref, &pgot)) ||
                      open_fds() != fds || live_blocks() != blocks;
            recovered += !failed;
            if (!bad) { /* and the next run is whole again */
                pipeline(cfg, p, how, &pgot);
                for (unsigned q = 0; q < p; q++)
                    bad |= pgot.rc[q] != 0;
                bad |= pgot.comm_rc || !same_run(&pref, &pgot);
            }
            if (bad) {
                printf("FAIL %s: thread %ld of %ld %s:", what, k, total,
                       mode ? "and every later one failed to start" : "failed to start");
                for (unsigned q = 0; q < p; q++)
                    printf(" rank %u %s (\"%s\")", q, epipe_status_name(pgot.rc[q]), pgot.msg[q]);
                printf(" (%ld descriptors, %ld blocks more than before)\n", open_fds() - fds,
                       live_blocks() - blocks);
                return 1;
            }
        }
    printf("ok %s: %ld threads, each refused once and for good; %ld runs went on without "
           "it\n",
           what, total, recovered);
    return 0;
}

static int check_pipelines(const char *key_file, const char *trace_stem)
{
    static const unsigned client_server[] = {0, 1, 0};
    static const struct link inproc = {NULL, NULL, NULL}, rdma = {"rdma", "init_timeout_ms=", NULL};
    static char crypt_options[300], trace_options[300];
    snprintf(crypt_options, sizeof crypt_options,
             "key_file=%s,encrypt=1,init_timeout_ms=", key_file);
    /* the plain TCP pipeline also records a trace (written at destroy) */
    snprintf(trace_options, sizeof trace_options, "trace=%s-%%r.json,init_timeout_ms=", trace_stem);
    static const struct link tcp_mesh = {"tcp", "topology=mesh,streams=2,init_timeout_ms=", NULL};
    const struct link tcp_crypt = {"tcp", crypt_options, NULL},
                      tcp = {"tcp", trace_options, trace_stem};
    const struct {
        const char *what;
        unsigned p;
        struct host_config cfg;
        const struct link *how;
    } cases[] = {
        {"1f1b on 3 ranks, sortquant activations, quant gradients with error feedback",
         3,
         {.schedule = "1f1b",
          .microbatches = 4,
          .steps = 2,
          .act_codec = "sortquant:bits=8",
          .grad_codec = "quant:bits=8,ef=1"},
         &inproc},
        {"zb-h1 client-server (0,1,0) through the op stream, topk activations",
         2,
         {.schedule = "zb-h1",
          .microbatches = 4,
          .steps = 2,
          .act_codec = "topk:ratio=0.5",
          .use_op_stream = 1,
          .split = 1,
          .placement = client_server,
          .placement_len = 3},
         &inproc},
        {"interleaved, 2 chunks a rank on 2 ranks, uncompressed",
         2,
         {.schedule = "interleaved", .microbatches = 4, .steps = 2, .chunks = 2},
         &inproc},
        {"1f1b on 2 ranks over TCP, sortquant both ways, traced",
         2,
         {.schedule = "1f1b",
          .microbatches = 2,
          .steps = 2,
          .act_codec = "sortquant:bits=8",
          .grad_codec = "sortquant:bits=8,zero=1"},
         &tcp},
        {"gpipe on 2 ranks over TCP, authenticated and encrypted",
         2,
         {.schedule = "gpipe", .microbatches = 2, .steps = 2, .act_codec = "quant:bits=8"},
         &tcp_crypt},
        {"1f1b on 2 ranks over rdma (the test verbs provider)",
         2,
         {.schedule = "1f1b", .microbatches = 2, .steps = 2, .act_codec = "sortquant:bits=8"},
         &rdma},
        {"gpipe on 3 ranks over TCP, every pair joined by 2 streams",
         3,
         {.schedule = "gpipe", .microbatches = 2, .steps = 1, .act_codec = "quant:bits=8"},
         &tcp_mesh},
    };
    int bad = 0;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        bad |= check_pipeline(cases[i].what, &cases[i].cfg, cases[i].p, cases[i].how);
    /* the transports that start threads (progress, CRC helper), short of
     * them; inproc starts none */
    printf("starving them of threads\n");
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        if (cases[i].how->transport)
            bad |= check_thread_starvation(cases[i].what, &cases[i].cfg, cases[i].p, cases[i].how);
    /* the same pipelines over the transports that open descriptors,
     * short of them */
    printf("starving them of file descriptors\n");
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        if (cases[i].how->transport)
            bad |= check_fd_starvation(cases[i].what, &cases[i].cfg, cases[i].p, cases[i].how);
    return bad;
}

int main(void)
{
    int take_exe = 0;
    dl_iterate_phdr(find_ranges, &take_exe);
    if (!shared_lib) { /* a static build: libepipe is in this executable */
        take_exe = 1;
        nranges = 0;
        dl_iterate_phdr(find_ranges, &take_exe);
    }
    if (nranges < 2) {
        printf("FAIL: found %d code ranges (libepipe and libc expected)\n", nranges);
        return 1;
    }
    /* a run that hangs fails the test instead of waiting out 30 s */
    setenv("EPIPE_TIMEOUT_MS", "10000", 1);
    /* the library's warnings of the failures it meets would be thousands
     * of lines: counted, not printed */
    epipe_set_log_callback(count_log, NULL);
    uint64_t s = 0x9e3779b97f4a7c15ull;
    for (int i = 0; i < N; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        x[i] = (float)((double)(s >> 11) / 9007199254740992.0 * 4 - 2);
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        gy[i] = (float)((double)(s >> 11) / 9007199254740992.0 - 0.5);
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    printf("starving libepipe's allocations, codec by codec\n");
    int bad = 0;
    for (size_t i = 0; i < NSPECS; i++)
        bad |= check_work(specs[i], round_trip, specs[i]);
    bad |= check_work("the planner: 6 layers on 3 stages, 2 codecs a boundary", plan_work, NULL);
    bad |= check_work("the schedule simulator: zb-h1, 4 stages, 8 micro-batches", sim_work, NULL);
    if (shared_lib) {
        printf("starving libepipe's allocations in pipelines of threads\n");
        char key[] = "/tmp/epipe-alloc-faults-key-XXXXXX";
        int fd = mkstemp(key);
        const char *text = "the pre-shared key of the allocation-fault test";
        if (fd < 0 || write(fd, text, strlen(text)) != (ssize_t)strlen(text)) {
            printf("FAIL: cannot write a key file in /tmp\n");
            return 1;
        }
        close(fd);
        char stem[64];
        snprintf(stem, sizeof stem, "/tmp/epipe-alloc-faults-trace-%d", (int)getpid());
        bad |= check_pipelines(key, stem);
        unlink(key);
    } else {
        printf("SKIP pipelines: libepipe is linked statically, so its allocations cannot be "
               "told from the pipeline host's\n");
    }
    printf("%ld log lines from the library, not shown\n", atomic_load(&log_lines));
    return bad;
}

#else /* NO_INTERPOSE */

int main(void)
{
    printf("SKIP: built with a sanitizer that owns malloc; the allocation faults need "
           "glibc's\n");
    return 77;
}

#endif
