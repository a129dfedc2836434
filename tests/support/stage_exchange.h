/* The exchange the CUDA-tensor stage tests run, on real device memory
 * (tests/gpu/test_gpu_stage.cu, nvcc) or on the test CUDA module's
 * (tests/fakecuda/test_stage_staged.c): two ranks (threads) run GPipe and
 * 1F1B over inproc and over TCP on loopback; rank 0 sends CUDA activations,
 * rank 1 receives them in device memory (or in host memory when
 * EPIPE_STAGE_CUDA_DEVICE stays -1) and sends back a gradient made from
 * each. Every tensor received must be, byte for byte, what the CPU codecs
 * make of what was sent. Then ZB-V, whose V puts two neighbouring stages
 * on one rank: a CUDA tensor handed over in memory. Written in the subset of C that C++ compiles; the
 * device memory comes from the caller. */
#ifndef EPIPE_TESTS_STAGE_EXCHANGE_H
#define EPIPE_TESTS_STAGE_EXCHANGE_H

#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <epipe/epipe.h>

/* Device memory: alloc (NULL on failure), free, and a copy in any
 * direction (0 on success). */
typedef struct sx_memory {
    void *(*alloc)(size_t bytes);
    void (*free)(void *p);
    int (*copy)(void *dst, const void *src, size_t bytes);
    /* Optional (NULL: none), for the stream-ordered runs: a stream of the
     * host's own that does not wait for others, and its end; work that
     * holds a stream up a while; a wait for a stream (NULL: the one
     * `copy` uses); a copy and a byte fill queued on a stream (0 on
     * success). */
    void *(*stream_new)(void);
    void (*stream_free)(void *s);
    void (*delay)(void *s);
    int (*sync)(void *s);
    int (*copy_on)(void *s, void *dst, const void *src, size_t bytes);
    int (*fill_on)(void *s, void *dst, int byte, size_t bytes);
    /* Optional: selects the device the calling thread's alloc uses (0 on
     * success), for runs with ranks on two devices. */
    int (*use_device)(int device);
    /* Optional: a count of copies from one device's memory into another's
     * (the CUDA emulator's), which says whether payloads between ranks on
     * two devices crossed device to device. */
    unsigned long (*peer_copies)(void);
} sx_memory;

enum { SX_M = 4, SX_ROWS = 8, SX_COLS = 1000, SX_N = SX_ROWS * SX_COLS };

static int sx_failures;
#define SX_CHECK(cond, ...)                                                                        \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);                        \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fprintf(stderr, "\n");                                                                 \
            __atomic_add_fetch(&sx_failures, 1, __ATOMIC_RELAXED);                                 \
        }                                                                                          \
    } while (0)

static int64_t sx_shape[2] = {SX_ROWS, SX_COLS};

static DLTensor sx_view(int type, void *data)
{
    DLTensor t;
    memset(&t, 0, sizeof t);
    t.data = data;
    t.device.device_type = (DLDeviceType)type;
    t.ndim = 2;
    t.shape = sx_shape;
    t.dtype.code = kDLFloat;
    t.dtype.bits = 32;
    t.dtype.lanes = 1;
    return t;
}

/* What the CPU codec spec makes of x (a fresh handle): y. */
static void sx_through_cpu(const char *spec, const float *x, float *y)
{
    DLTensor tx = sx_view(kDLCPU, (void *)x), ty = sx_view(kDLCPU, y);
    epipe_codec *c = NULL;
    size_t cap = 0, w = 0;
    SX_CHECK(epipe_codec_create(&c, spec) == EPIPE_OK, "%s", epipe_last_error());
    epipe_codec_max_encoded_size(c, &tx, &cap);
    uint8_t *p = (uint8_t *)malloc(cap ? cap : 1);
    SX_CHECK(epipe_codec_encode(c, &tx, p, cap, &w) == EPIPE_OK, "%s", epipe_codec_last_error(c));
    SX_CHECK(epipe_codec_decode(c, p, w, &ty) == EPIPE_OK, "%s", epipe_codec_last_error(c));
    free(p);
    epipe_codec_destroy(c);
}

static void sx_input(unsigned mb, float *x)
{
    for (size_t i = 0; i < SX_N; i++)
        x[i] = (float)((i * 2654435761u + mb * 977u) % 2001) / 1000.0f - 1.0f + 0.01f * (float)mb;
}

typedef struct sx_rank {
    const sx_memory *mem;
    epipe_comm *comm;
    const char *schedule, *act_spec, *grad_spec;
    int rank, cuda_recv; /* rank 1: receive into device memory */
    void *stream;        /* the stage's CUDA stream, when set */
    int ordered;         /* EPIPE_STAGE_CUDA_STREAM_ORDERED */
    int device;          /* its CUDA device (its tensors', its stage's) */
    /* Optional: both ranks meet here once their stages are set up, so
     * that no message goes before its receiver named its device */
    pthread_barrier_t *ready;
} sx_rank;

/* A stream-ordered rank on a stream of its own (sx_memory's): each send
 * and receive comes after a delay on that stream, a sent activation is
 * overwritten and restored on it right after the send, a received tensor
 * is read after a wait for it, and the tensors sent are written on it. A
 * payload decoded before its encode ran, a message freed before its
 * decode ran, or an encode not ordered on the stage's stream, would give
 * other bytes than the CPU's. */
static int sx_own_stream(const sx_rank *a)
{
    return a->ordered && a->stream && a->mem->sync;
}

/* A received tensor's values, wherever it is. */
static void sx_to_host(const sx_memory *mem, const DLTensor *t, float *h)
{
    if (t->device.device_type == kDLCUDA)
        SX_CHECK(mem->copy(h, t->data, SX_N * sizeof *h) == 0, "copy from the device");
    else
        memcpy(h, t->data, SX_N * sizeof *h);
}

/* A stage call's status, and on success no error text left behind: the
 * thread's message belongs to the latest call, and a call that succeeds
 * leaves it empty. */
static int sx_clean(int rc)
{
    if (rc || !*epipe_last_error())
        return rc;
    fprintf(stderr, "a call that succeeded left error text: %s\n", epipe_last_error());
    return EPIPE_EINTERNAL;
}

/* The op `op` of rank `rank` in a chain of `ranks`: a forward receives
 * the activation into *in (but on rank 0), then sends t as its own (but
 * on the last rank); a backward the reverse, with gradients. */
static int sx_chain_op(epipe_stage *st, unsigned rank, unsigned ranks, const epipe_op *op,
                       const DLTensor *t, const DLTensor **in)
{
    unsigned mb = op->microbatch;
    int rc = EPIPE_OK, fwd = op->kind == EPIPE_OP_FORWARD;
    if (fwd ? rank > 0 : rank + 1 < ranks)
        rc = sx_clean(fwd ? epipe_stage_recv_activation(st, mb, in)
                          : epipe_stage_recv_gradient(st, mb, in));
    if (!rc && (fwd ? rank + 1 < ranks : rank > 0))
        rc = sx_clean(fwd ? epipe_stage_send_activation(st, mb, t)
                          : epipe_stage_send_gradient(st, mb, t));
    return rc;
}

static void *sx_run_rank(void *p)
{
    sx_rank *a = (sx_rank *)p;
    const sx_memory *mem = a->mem;
    epipe_stage *st = NULL;
    SX_CHECK(epipe_stage_create(&st, a->comm, a->schedule, SX_M) == EPIPE_OK, "%s",
             epipe_last_error());
    if (!st) {
        if (a->ready)
            pthread_barrier_wait(a->ready);
        return NULL;
    }
    SX_CHECK(epipe_stage_set_codec(st, EPIPE_DIR_ACTIVATION, EPIPE_ALL_BOUNDARIES, a->act_spec) ==
                 0,
             "act codec");
    SX_CHECK(epipe_stage_set_codec(st, EPIPE_DIR_GRADIENT, EPIPE_ALL_BOUNDARIES, a->grad_spec) == 0,
             "grad codec");
    if (a->device)
        SX_CHECK(mem->use_device && mem->use_device(a->device) == 0, "device %d", a->device);
    if (a->rank == 0 || a->cuda_recv)
        SX_CHECK(epipe_stage_set_param(st, EPIPE_STAGE_CUDA_DEVICE, a->device) == EPIPE_OK, "%s",
                 epipe_stage_last_error(st));
    if (a->stream)
        SX_CHECK(epipe_stage_set_cuda_stream(st, a->stream) == EPIPE_OK, "%s",
                 epipe_stage_last_error(st));
    if (a->ordered)
        SX_CHECK(epipe_stage_set_param(st, EPIPE_STAGE_CUDA_STREAM_ORDERED, 1) == EPIPE_OK, "%s",
                 epipe_stage_last_error(st));
    if (a->ready)
        pthread_barrier_wait(a->ready);
    int own = sx_own_stream(a);
    /* per rank: x, act, got, want, then SX_M gradients on the host */
    float *buf = (float *)malloc(sizeof(float) * SX_N * (4 + SX_M));
    float *x = buf, *act = x + SX_N, *got = act + SX_N, *want = got + SX_N, *hg = want + SX_N;
    float *dx[SX_M], *dg[SX_M];
    for (unsigned mb = 0; mb < SX_M; mb++) {
        dx[mb] = (float *)mem->alloc(SX_N * sizeof(float));
        dg[mb] = (float *)mem->alloc(SX_N * sizeof(float));
        sx_input(mb, x);
        SX_CHECK(dx[mb] && dg[mb] && mem->copy(dx[mb], x, SX_N * sizeof *x) == 0, "device memory");
    }
    if (own) /* a copy from pageable memory may land after it returns; the
                own stream does not wait for the one it went on */
        SX_CHECK(mem->sync(NULL) == 0, "the tensors' first copies");
    for (int step = 0; step < 2; step++) {
        epipe_op op;
        for (;;) {
            if (epipe_stage_next_op(st, &op) != EPIPE_OK) {
                SX_CHECK(0, "rank %d next_op: %s", a->rank, epipe_stage_last_error(st));
                goto out;
            }
            if (op.kind == EPIPE_OP_NONE)
                break;
            if (a->stream && !a->ordered) /* mid-step too (it waits for the stream) */
                SX_CHECK(epipe_stage_set_cuda_stream(st, a->stream) == EPIPE_OK, "stream mid-step");
            unsigned mb = op.microbatch;
            float *g = hg + (size_t)mb * SX_N;
            sx_input(mb, x);
            sx_through_cpu(a->act_spec, x, act);
            if (own)
                mem->delay(a->stream);
            if (a->rank == 0 && op.kind == EPIPE_OP_FORWARD) {
                DLTensor t = sx_view(kDLCUDA, dx[mb]);
                t.device.device_id = a->device;
                SX_CHECK(sx_clean(epipe_stage_send_activation(st, mb, &t)) == EPIPE_OK,
                         "send act: %s", epipe_stage_last_error(st));
                if (own) /* the encode reads it before, in the stream's order */
                    SX_CHECK(mem->fill_on(a->stream, dx[mb], 0xff, SX_N * sizeof(float)) == 0 &&
                                 mem->copy_on(a->stream, dx[mb], x, SX_N * sizeof *x) == 0,
                             "overwrite and restore");
            } else if (a->rank == 0) { /* backward: the gradient of what was sent */
                const DLTensor *r;
                SX_CHECK(sx_clean(epipe_stage_recv_gradient(st, mb, &r)) == EPIPE_OK,
                         "recv grad: %s", epipe_stage_last_error(st));
                if (own)
                    SX_CHECK(mem->sync(a->stream) == 0, "stream");
                SX_CHECK(r->device.device_type == kDLCUDA && r->device.device_id == a->device,
                         "gradient on device type %d, %d", (int)r->device.device_type,
                         (int)r->device.device_id);
                for (size_t i = 0; i < SX_N; i++)
                    x[i] = act[i] * 0.5f - 1.0f;
                sx_through_cpu(a->grad_spec, x, want);
                sx_to_host(mem, r, got);
                SX_CHECK(memcmp(got, want, SX_N * sizeof *got) == 0,
                         "rank 0 step %d mb %u: gradient differs from the CPU's", step, mb);
            } else if (op.kind == EPIPE_OP_FORWARD) {
                const DLTensor *r;
                SX_CHECK(sx_clean(epipe_stage_recv_activation(st, mb, &r)) == EPIPE_OK,
                         "recv act: %s", epipe_stage_last_error(st));
                if (own)
                    SX_CHECK(mem->sync(a->stream) == 0, "stream");
                SX_CHECK(r->device.device_type == (a->cuda_recv ? kDLCUDA : kDLCPU) &&
                             (!a->cuda_recv || r->device.device_id == a->device),
                         "activation on device type %d, %d", (int)r->device.device_type,
                         (int)r->device.device_id);
                sx_to_host(mem, r, got);
                SX_CHECK(memcmp(got, act, SX_N * sizeof *got) == 0,
                         "rank 1 step %d mb %u: activation differs from the CPU's", step, mb);
                for (size_t i = 0; i < SX_N; i++)
                    g[i] = got[i] * 0.5f - 1.0f;
                if (a->cuda_recv) /* on the stream: its last encode may still read it */
                    SX_CHECK((own ? mem->copy_on(a->stream, dg[mb], g, SX_N * sizeof *g)
                                  : mem->copy(dg[mb], g, SX_N * sizeof *g)) == 0,
                             "gradient up");
            } else {
                /* a CUDA gradient when it came to the device, else a CPU one */
                DLTensor t = a->cuda_recv ? sx_view(kDLCUDA, dg[mb]) : sx_view(kDLCPU, g);
                if (a->cuda_recv)
                    t.device.device_id = a->device;
                SX_CHECK(sx_clean(epipe_stage_send_gradient(st, mb, &t)) == EPIPE_OK,
                         "send grad: %s", epipe_stage_last_error(st));
            }
        }
    }
out:
    for (unsigned mb = 0; mb < SX_M; mb++) {
        mem->free(dx[mb]);
        mem->free(dg[mb]);
    }
    free(buf);
    epipe_stage_destroy(st);
    return NULL;
}

/* fn(a0) and fn(a1) on two threads, to their end. */
static void sx_threads(void *(*fn)(void *), sx_rank *a0, sx_rank *a1)
{
    pthread_t t0, t1;
    pthread_create(&t0, NULL, fn, a0);
    pthread_create(&t1, NULL, fn, a1);
    pthread_join(t0, NULL);
    pthread_join(t1, NULL);
}

/* The same over a fresh pair of inproc communicators, a0's and a1's. */
static void sx_inproc_threads(void *(*fn)(void *), sx_rank *a0, sx_rank *a1)
{
    epipe_comm *c[2];
    if (epipe_comm_create_inproc(c, 2) != EPIPE_OK) {
        SX_CHECK(0, "inproc: %s", epipe_last_error());
        return;
    }
    a0->comm = c[0];
    a1->comm = c[1];
    sx_threads(fn, a0, a1);
    epipe_comm_destroy(c[0]);
    epipe_comm_destroy(c[1]);
}

/* ordered: both stages stream-ordered, each on a stream of its own where
 * the memory gives one (sx_own_stream), else on `stream` */
static void sx_run_pair(const sx_memory *mem, epipe_comm *c0, epipe_comm *c1, const char *schedule,
                        const char *act_spec, const char *grad_spec, int cuda_recv, void *stream,
                        int ordered)
{
    int own = ordered && mem->stream_new && mem->sync;
    void *s0 = own ? mem->stream_new() : stream, *s1 = own ? mem->stream_new() : stream;
    sx_rank a0 = {mem, c0, schedule, act_spec, grad_spec, 0, 1, s0, ordered, 0, NULL};
    sx_rank a1 = {mem, c1, schedule, act_spec, grad_spec, 1, cuda_recv, s1, ordered, 0, NULL};
    sx_threads(sx_run_rank, &a0, &a1);
    if (own) {
        mem->stream_free(s0);
        mem->stream_free(s1);
    }
}

/* sx_run_pair over a fresh pair of inproc communicators. */
static void sx_inproc_pair(const sx_memory *mem, const char *schedule, const char *act_spec,
                           const char *grad_spec, int cuda_recv, int ordered)
{
    epipe_comm *c[2];
    if (epipe_comm_create_inproc(c, 2) != EPIPE_OK) {
        SX_CHECK(0, "inproc: %s", epipe_last_error());
        return;
    }
    sx_run_pair(mem, c[0], c[1], schedule, act_spec, grad_spec, cuda_recv, NULL, ordered);
    epipe_comm_destroy(c[0]);
    epipe_comm_destroy(c[1]);
}

static unsigned sx_free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    bind(fd, (struct sockaddr *)&a, sizeof a);
    getsockname(fd, (struct sockaddr *)&a, &len);
    close(fd);
    return ntohs(a.sin_port);
}

typedef struct sx_tcp {
    epipe_comm **out;
    unsigned rank, port;
} sx_tcp;

static void *sx_tcp_create(void *p)
{
    sx_tcp *a = (sx_tcp *)p;
    if (epipe_comm_create_tcp(a->out, a->rank, 2, "127.0.0.1", a->port, NULL) != EPIPE_OK)
        SX_CHECK(0, "tcp rank %u: %s", a->rank, epipe_last_error());
    return NULL;
}

/* ZB-V on two ranks: four pipeline stages, rank 1 holding stages 1 and 2,
 * so boundary 1-2 is handed over in memory (a copy of the CUDA tensor on
 * the stage's stream) and the others cross with `none`. Each forward
 * adds 1 to what it received, each input backward subtracts 1, in fp32 on
 * the host (copied down and up), so every value received is known
 * exactly. */
enum { SX_V_STAGES = 4 };

static void sx_v_expected(unsigned mb, unsigned s, int grad, float *e)
{
    sx_input(mb, e);
    if (grad) { /* the last stage's gradient: 2x + 3, then -1 a stage back */
        for (size_t i = 0; i < SX_N; i++) {
            for (unsigned k = 0; k < SX_V_STAGES - 1; k++)
                e[i] = e[i] + 1.0f;
            e[i] = e[i] * 2.0f + 3.0f;
            for (unsigned k = SX_V_STAGES - 1; k > s; k--)
                e[i] = e[i] - 1.0f;
        }
        return;
    }
    for (size_t i = 0; i < SX_N; i++)
        for (unsigned k = 0; k < s; k++)
            e[i] = e[i] + 1.0f;
}

static void *sx_run_v_rank(void *p)
{
    sx_rank *a = (sx_rank *)p;
    const sx_memory *mem = a->mem;
    epipe_stage *st = NULL;
    epipe_schedule_layout lay = EPIPE_SCHEDULE_LAYOUT_INIT;
    SX_CHECK(epipe_stage_create_layout(&st, a->comm, "zb-v", SX_M, &lay) == EPIPE_OK, "%s",
             epipe_last_error());
    if (!st)
        return NULL;
    SX_CHECK(epipe_stage_set_param(st, EPIPE_STAGE_CUDA_DEVICE, 0) == EPIPE_OK, "%s",
             epipe_stage_last_error(st));
    if (a->ordered)
        SX_CHECK(epipe_stage_set_param(st, EPIPE_STAGE_CUDA_STREAM_ORDERED, 1) == EPIPE_OK, "%s",
                 epipe_stage_last_error(st));
    if (a->stream)
        SX_CHECK(epipe_stage_set_cuda_stream(st, a->stream) == EPIPE_OK, "%s",
                 epipe_stage_last_error(st));
    float *buf = (float *)malloc(sizeof(float) * SX_N * 2);
    float *got = buf, *want = buf + SX_N;
    /* device tensors the host sends: one per chunk and micro-batch */
    float *out[2][SX_M];
    for (unsigned k = 0; k < 2; k++)
        for (unsigned mb = 0; mb < SX_M; mb++)
            out[k][mb] = (float *)mem->alloc(SX_N * sizeof(float));
    epipe_op op;
    for (;;) {
        if (epipe_stage_next_op(st, &op) != EPIPE_OK) {
            SX_CHECK(0, "zb-v rank %d next_op: %s", a->rank, epipe_stage_last_error(st));
            break;
        }
        if (op.kind == EPIPE_OP_NONE)
            break;
        unsigned mb = op.microbatch, s = 0, total = 0;
        SX_CHECK(epipe_stage_chunk_stage(st, op.chunk, &s, &total) == EPIPE_OK && total == 4,
                 "chunk stage");
        if (op.kind != EPIPE_OP_FORWARD && op.kind != EPIPE_OP_BACKWARD &&
            op.kind != EPIPE_OP_BACKWARD_INPUT)
            continue; /* the weight op: no tensor crosses */
        /* forward: from stage 0 up, +1 a stage; backward: from the last
         * stage down, -1 a stage */
        int grad = op.kind != EPIPE_OP_FORWARD;
        const char *what = grad ? "gradient" : "activation";
        float *dev = out[op.chunk][mb];
        DLTensor t = sx_view(kDLCUDA, dev);
        if (grad ? s + 1 == SX_V_STAGES : s == 0) {
            sx_v_expected(mb, s, grad, got);
        } else {
            const DLTensor *r;
            int rc = sx_clean(grad ? epipe_stage_recv_gradient(st, mb, &r)
                                   : epipe_stage_recv_activation(st, mb, &r));
            SX_CHECK(rc == EPIPE_OK, "zb-v recv %s: %s", what, epipe_stage_last_error(st));
            if (rc)
                continue;
            SX_CHECK(r->device.device_type == kDLCUDA, "%s not on the device", what);
            sx_to_host(mem, r, got);
            sx_v_expected(mb, s, grad, want);
            SX_CHECK(memcmp(got, want, SX_N * sizeof *got) == 0, "zb-v stage %u mb %u: %s differs",
                     s, mb, what);
        }
        if (grad ? s == 0 : s + 1 == SX_V_STAGES)
            continue; /* the end of the line */
        for (size_t i = 0; i < SX_N; i++)
            got[i] = grad ? got[i] - 1.0f : got[i] + 1.0f;
        SX_CHECK(mem->copy(dev, got, SX_N * sizeof *got) == 0, "%s up", what);
        int rc = grad ? epipe_stage_send_gradient(st, mb, &t)
                      : epipe_stage_send_activation(st, mb, &t);
        SX_CHECK(rc == EPIPE_OK, "zb-v send %s: %s", what, epipe_stage_last_error(st));
    }
    for (unsigned k = 0; k < 2; k++)
        for (unsigned mb = 0; mb < SX_M; mb++)
            mem->free(out[k][mb]);
    free(buf);
    epipe_stage_destroy(st);
    return NULL;
}

/* One step of ZB-V over inproc, on the stage's `stream` (NULL: unset),
 * stream-ordered or not. */
static void sx_run_v(const sx_memory *mem, void *stream, int ordered)
{
    sx_rank a0 = {mem, NULL, "zb-v", "none", "none", 0, 1, stream, ordered, 0, NULL};
    sx_rank a1 = {mem, NULL, "zb-v", "none", "none", 1, 1, stream, ordered, 0, NULL};
    sx_inproc_threads(sx_run_v_rank, &a0, &a1);
}

/* Ranks on two devices of one process (rank 0 on device 0, rank 1 on
 * device 1), over inproc, as they are and stream-ordered: each payload is
 * encoded into its sender's device memory and copied device to device by
 * its receiver (where the memory counts such copies: one a payload), each
 * tensor received on its rank's device equal to the CPU's. Nothing where
 * the memory has one device or cannot select another. */
static void sx_run_two_devices(const sx_memory *mem, const char *act_spec, const char *grad_spec,
                               int devices)
{
    if (devices < 2 || !mem->use_device) {
        printf("ranks on two devices: skipped, %d device(s)\n", devices);
        return;
    }
    int before = sx_failures;
    pthread_barrier_t ready;
    pthread_barrier_init(&ready, NULL, 2);
    for (int ordered = 0; ordered < 2; ordered++) {
        sx_rank a0 = {mem, NULL, "1f1b", act_spec, grad_spec, 0, 1, NULL, ordered, 0, &ready};
        sx_rank a1 = {mem, NULL, "1f1b", act_spec, grad_spec, 1, 1, NULL, ordered, 1, &ready};
        unsigned long copies = mem->peer_copies ? mem->peer_copies() : 0;
        sx_inproc_threads(sx_run_rank, &a0, &a1);
        /* 2 steps of SX_M micro-batches, an activation and a gradient each */
        if (mem->peer_copies)
            SX_CHECK(mem->peer_copies() - copies == 2 * SX_M * 2,
                     "ordered %d: %lu payloads copied device to device, of %d", ordered,
                     mem->peer_copies() - copies, 2 * SX_M * 2);
    }
    pthread_barrier_destroy(&ready);
    printf("ranks on two devices, as they are and stream-ordered: %s\n",
           sx_failures == before ? "ok" : "FAILED");
}

/* The whole exchange: both schedules over inproc, receiving on the device
 * and on the host, 1F1B over TCP, ZB-V over inproc, and the refusal of a device index past
 * the last (`devices`: how many there are). Returns the failures. */
static int sx_run_all(const sx_memory *mem, const char *act_spec, const char *grad_spec,
                      int devices)
{
    const char *schedules[] = {"gpipe", "1f1b"};
    for (int s = 0; s < 2; s++)
        for (int cuda_recv = 1; cuda_recv >= 0; cuda_recv--)
            sx_inproc_pair(mem, schedules[s], act_spec, grad_spec, cuda_recv, 0);
    /* 1F1B stream-ordered: payloads on the device, fenced, none waited for
     * but once a step */
    sx_inproc_pair(mem, "1f1b", act_spec, grad_spec, 1, 1);
    /* over TCP as it was, then stream-ordered (held host messages) */
    epipe_comm *c[2] = {NULL, NULL};
    for (int ordered = 0; ordered < 2; ordered++) {
        unsigned port = sx_free_port();
        sx_tcp a0 = {&c[0], 0, port}, a1 = {&c[1], 1, port};
        pthread_t t0, t1;
        pthread_create(&t0, NULL, sx_tcp_create, &a0);
        pthread_create(&t1, NULL, sx_tcp_create, &a1);
        pthread_join(t0, NULL);
        pthread_join(t1, NULL);
        if (c[0] && c[1])
            sx_run_pair(mem, c[0], c[1], "1f1b", act_spec, grad_spec, 1, NULL, ordered);
        epipe_comm_destroy(c[0]);
        epipe_comm_destroy(c[1]);
        c[0] = c[1] = NULL;
    }

    sx_run_v(mem, NULL, 0);
    sx_run_v(mem, NULL, 1);
    sx_run_two_devices(mem, act_spec, grad_spec, devices);

    /* A device that does not exist is refused by name. */
    epipe_stage *st = NULL;
    if (epipe_comm_create_inproc(c, 2) == EPIPE_OK &&
        epipe_stage_create(&st, c[0], "gpipe", 2) == EPIPE_OK) {
        SX_CHECK(epipe_stage_set_param(st, EPIPE_STAGE_CUDA_DEVICE, devices) == EPIPE_EINVAL,
                 "device %d", devices);
        SX_CHECK(strstr(epipe_stage_last_error(st), "does not exist") != NULL, "%s",
                 epipe_stage_last_error(st));
        epipe_stage_destroy(st);
        epipe_comm_destroy(c[0]);
        epipe_comm_destroy(c[1]);
    }
    return sx_failures;
}

#endif
