/* Stages with CUDA tensors on any machine, through the test CUDA module
 * (fakecuda.c: no kernels, device memory the host cannot touch). Two ranks
 * (threads) run GPipe and 1F1B over inproc and TCP on loopback: rank 0
 * sends CUDA activations, rank 1 receives them in device memory (or host
 * memory when EPIPE_STAGE_CUDA_DEVICE stays -1) and sends back a gradient
 * made from each. Every tensor received must be, byte for byte, what the
 * CPU codecs make of what was sent, for codecs that go through host
 * staging: the stage runtime's device buffers, lent tensors and copies are
 * what this checks, beside tests/gpu/test_gpu_stage.cu on a real GPU. */
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <epipe/epipe.h>

enum { M = 4, ROWS = 8, COLS = 64, N = ROWS * COLS };

static void *(*dev_alloc)(size_t);
static void (*dev_free)(void *);
static int (*dev_copy)(void *, const void *, size_t);
static void *(*last_stream)(unsigned long *);
/* Stateless codecs, so that a fresh CPU handle is the reference at every
 * step; the test module stages them all. */
static const char *act_spec = "quant:bits=2,rows=1", *grad_spec = "sortquant:bits=8,mode=sample";
static int failures;

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);                        \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fprintf(stderr, "\n");                                                                 \
            __atomic_add_fetch(&failures, 1, __ATOMIC_RELAXED);                                    \
        }                                                                                          \
    } while (0)

static int64_t shape[3] = {ROWS, 4, COLS / 4};

static DLTensor view(int type, void *data)
{
    DLTensor t;
    memset(&t, 0, sizeof t);
    t.data = data;
    t.device.device_type = (DLDeviceType)type;
    t.ndim = 3;
    t.shape = shape;
    t.dtype.code = kDLFloat;
    t.dtype.bits = 32;
    t.dtype.lanes = 1;
    return t;
}

/* What the CPU codec spec makes of x (a fresh handle: first call). */
static void through_cpu(const char *spec, const float *x, float *y)
{
    DLTensor tx = view(kDLCPU, (void *)x), ty = view(kDLCPU, y);
    epipe_codec *c;
    static _Thread_local uint8_t p[16 * N];
    size_t w = 0;
    CHECK(epipe_codec_create(&c, spec) == EPIPE_OK, "%s", epipe_last_error());
    CHECK(epipe_codec_encode(c, &tx, p, sizeof p, &w) == EPIPE_OK, "%s", epipe_codec_last_error(c));
    CHECK(epipe_codec_decode(c, p, w, &ty) == EPIPE_OK, "%s", epipe_codec_last_error(c));
    epipe_codec_destroy(c);
}

static void input(unsigned mb, float *x)
{
    for (size_t i = 0; i < N; i++)
        x[i] = (float)((i * 2654435761u + mb * 977u) % 2001) / 1000.0f - 1.0f + 0.01f * (float)mb;
}

/* A received tensor's values, wherever it is. */
static void to_host(const DLTensor *t, float *h)
{
    if (t->device.device_type == kDLCUDA)
        CHECK(dev_copy(h, t->data, N * sizeof *h) == 0, "copy from the device");
    else
        memcpy(h, t->data, N * sizeof *h);
}

struct rank_args {
    epipe_comm *comm;
    const char *schedule;
    int rank, cuda_recv; /* rank 1: receive into device memory */
    void *stream;        /* the stage's CUDA stream (NULL: not set) */
};

static void *run_rank(void *p)
{
    struct rank_args *a = p;
    epipe_stage *st = NULL;
    CHECK(epipe_stage_create(&st, a->comm, a->schedule, M) == EPIPE_OK, "%s", epipe_last_error());
    if (!st)
        return NULL;
    CHECK(epipe_stage_set_codec(st, EPIPE_DIR_ACTIVATION, EPIPE_ALL_BOUNDARIES, act_spec) == 0,
          "act codec");
    CHECK(epipe_stage_set_codec(st, EPIPE_DIR_GRADIENT, EPIPE_ALL_BOUNDARIES, grad_spec) == 0,
          "grad codec");
    if (a->rank == 0 || a->cuda_recv)
        CHECK(epipe_stage_set_param(st, EPIPE_STAGE_CUDA_DEVICE, 0) == EPIPE_OK, "%s",
              epipe_stage_last_error(st));
    if (a->stream)
        CHECK(epipe_stage_set_cuda_stream(st, a->stream) == EPIPE_OK, "%s",
              epipe_stage_last_error(st));
    float *dx[M], *dg[M];
    static _Thread_local float x[N], act[N], got[N], want[N], hg[M][N];
    for (unsigned mb = 0; mb < M; mb++) {
        dx[mb] = dev_alloc(N * sizeof(float));
        dg[mb] = dev_alloc(N * sizeof(float));
        input(mb, x);
        dev_copy(dx[mb], x, sizeof x);
    }
    for (int step = 0; step < 2; step++) {
        epipe_op op;
        for (;;) {
            if (epipe_stage_next_op(st, &op) != EPIPE_OK) {
                CHECK(0, "rank %d next_op: %s", a->rank, epipe_stage_last_error(st));
                goto out;
            }
            if (op.kind == EPIPE_OP_NONE)
                break;
            if (a->stream) /* mid-step too */
                CHECK(epipe_stage_set_cuda_stream(st, a->stream) == EPIPE_OK, "stream mid-step");
            unsigned mb = op.microbatch;
            input(mb, x);
            through_cpu(act_spec, x, act);
            if (a->rank == 0 && op.kind == EPIPE_OP_FORWARD) {
                DLTensor t = view(kDLCUDA, dx[mb]);
                CHECK(epipe_stage_send_activation(st, mb, &t) == EPIPE_OK, "send act: %s",
                      epipe_stage_last_error(st));
            } else if (a->rank == 0) { /* backward: the gradient of what was sent */
                const DLTensor *g;
                CHECK(epipe_stage_recv_gradient(st, mb, &g) == EPIPE_OK, "recv grad: %s",
                      epipe_stage_last_error(st));
                CHECK(g->device.device_type == kDLCUDA, "gradient on device type %d",
                      (int)g->device.device_type);
                for (size_t i = 0; i < N; i++)
                    x[i] = act[i] * 0.5f - 1.0f;
                through_cpu(grad_spec, x, want);
                to_host(g, got);
                CHECK(memcmp(got, want, sizeof got) == 0,
                      "rank 0 step %d mb %u: gradient differs from the CPU's", step, mb);
            } else if (op.kind == EPIPE_OP_FORWARD) {
                const DLTensor *r;
                CHECK(epipe_stage_recv_activation(st, mb, &r) == EPIPE_OK, "recv act: %s",
                      epipe_stage_last_error(st));
                CHECK(r->device.device_type == (a->cuda_recv ? kDLCUDA : kDLCPU),
                      "activation on device type %d", (int)r->device.device_type);
                to_host(r, got);
                CHECK(memcmp(got, act, sizeof got) == 0,
                      "rank 1 step %d mb %u: activation differs from the CPU's", step, mb);
                for (size_t i = 0; i < N; i++)
                    hg[mb][i] = got[i] * 0.5f - 1.0f;
                if (a->cuda_recv)
                    dev_copy(dg[mb], hg[mb], sizeof hg[mb]);
            } else {
                /* a CUDA gradient when it came to the device, else a CPU one */
                DLTensor t = a->cuda_recv ? view(kDLCUDA, dg[mb]) : view(kDLCPU, hg[mb]);
                CHECK(epipe_stage_send_gradient(st, mb, &t) == EPIPE_OK, "send grad: %s",
                      epipe_stage_last_error(st));
            }
        }
    }
out:
    for (unsigned mb = 0; mb < M; mb++) {
        dev_free(dx[mb]);
        dev_free(dg[mb]);
    }
    epipe_stage_destroy(st);
    return NULL;
}

static void run_pair(epipe_comm *c0, epipe_comm *c1, const char *schedule, int cuda_recv,
                     void *stream)
{
    struct rank_args a0 = {c0, schedule, 0, 1, stream}, a1 = {c1, schedule, 1, cuda_recv, stream};
    pthread_t t0, t1;
    pthread_create(&t0, NULL, run_rank, &a0);
    pthread_create(&t1, NULL, run_rank, &a1);
    pthread_join(t0, NULL);
    pthread_join(t1, NULL);
}

static unsigned free_port(void)
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

struct tcp_args {
    epipe_comm **out;
    unsigned rank, port;
};

static void *tcp_create(void *p)
{
    struct tcp_args *a = p;
    if (epipe_comm_create_tcp(a->out, a->rank, 2, "127.0.0.1", a->port, NULL) != EPIPE_OK)
        CHECK(0, "tcp rank %u: %s", a->rank, epipe_last_error());
    return NULL;
}

int main(void)
{
    const char *path = getenv("EPIPE_CUDA_MODULE");
    void *so = path ? dlopen(path, RTLD_NOW | RTLD_LOCAL) : NULL;
    if (so) {
        *(void **)&dev_alloc = dlsym(so, "fakecuda_alloc");
        *(void **)&dev_free = dlsym(so, "fakecuda_free");
        *(void **)&dev_copy = dlsym(so, "fakecuda_copy");
        *(void **)&last_stream = dlsym(so, "fakecuda_last_stream");
    }
    if (!dev_alloc || !dev_free || !dev_copy || !last_stream) {
        fprintf(stderr, "EPIPE_CUDA_MODULE must name the test module (fakecuda)\n");
        return 1;
    }
    const char *schedules[] = {"gpipe", "1f1b"};
    for (int s = 0; s < 2; s++)
        for (int cuda_recv = 1; cuda_recv >= 0; cuda_recv--) {
            epipe_comm *c[2];
            if (epipe_comm_create_inproc(c, 2) != EPIPE_OK)
                return fprintf(stderr, "inproc: %s\n", epipe_last_error()), 1;
            run_pair(c[0], c[1], schedules[s], cuda_recv, NULL);
            epipe_comm_destroy(c[0]);
            epipe_comm_destroy(c[1]);
        }
    epipe_comm *c[2] = {NULL, NULL};
    unsigned port = free_port();
    struct tcp_args a0 = {&c[0], 0, port}, a1 = {&c[1], 1, port};
    pthread_t t0, t1;
    pthread_create(&t0, NULL, tcp_create, &a0);
    pthread_create(&t1, NULL, tcp_create, &a1);
    pthread_join(t0, NULL);
    pthread_join(t1, NULL);
    if (c[0] && c[1])
        run_pair(c[0], c[1], "1f1b", 1, NULL);
    epipe_comm_destroy(c[0]);
    epipe_comm_destroy(c[1]);

    /* the stage's stream reaches every copy of its codecs */
    void *stream = (void *)(uintptr_t)0xbeef;
    unsigned long before = 0, after = 0;
    CHECK(last_stream(&before) != stream, "the stream was not used yet");
    if (epipe_comm_create_inproc(c, 2) != EPIPE_OK)
        return fprintf(stderr, "inproc: %s\n", epipe_last_error()), 1;
    run_pair(c[0], c[1], "1f1b", 1, stream);
    CHECK(last_stream(&after) == stream, "the last staging copy was not on the stage's stream");
    CHECK(after > before, "no staging copies");
    epipe_comm_destroy(c[0]);
    epipe_comm_destroy(c[1]);
    if (failures)
        return fprintf(stderr, "%d failures (%s / %s)\n", failures, act_spec, grad_spec), 1;
    printf("ok (%s / %s)\n", act_spec, grad_spec);
    return 0;
}
