/* The gpu suite: stages with CUDA tensors. Two ranks (threads) run GPipe
 * and 1F1B over inproc and over TCP on loopback: rank 0 sends CUDA
 * activations, rank 1 receives them (in device memory, or in host memory
 * when EPIPE_STAGE_CUDA_DEVICE stays -1) and sends back a gradient made
 * from each. Every tensor received must be, byte for byte, what the CPU
 * codecs make of what was sent: the codecs are byte-identical on both
 * sides. Exit 77 without a device. */
#include <arpa/inet.h>
#include <cuda_runtime.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include <vector>

#include <epipe/epipe.h>

#include "gpu_test.h"

enum { M = 4, ROWS = 8, COLS = 1000 };
static const char *ACT_SPEC = "quant:bits=8", *GRAD_SPEC = "sortquant:bits=8,mode=sample";

static DLTensor view(int type, void *data, int64_t *shape)
{
    DLTensor t;
    memset(&t, 0, sizeof t);
    t.data = data;
    t.device.device_type = (DLDeviceType)type;
    t.ndim = 2;
    t.shape = shape;
    t.dtype.code = kDLFloat;
    t.dtype.bits = 32;
    t.dtype.lanes = 1;
    return t;
}

/* What the CPU codec spec makes of x: encode, then decode. */
static std::vector<float> through_cpu(const char *spec, const std::vector<float> &x)
{
    int64_t shape[2] = {ROWS, COLS};
    std::vector<float> y(x.size());
    DLTensor tx = view(kDLCPU, (void *)x.data(), shape), ty = view(kDLCPU, y.data(), shape);
    epipe_codec *c;
    epipe_codec_create(&c, spec);
    size_t cap = 0, w = 0;
    epipe_codec_max_encoded_size(c, &tx, &cap);
    std::vector<uint8_t> p(cap);
    CHECK(epipe_codec_encode(c, &tx, p.data(), cap, &w) == EPIPE_OK, "%s",
          epipe_codec_last_error(c));
    CHECK(epipe_codec_decode(c, p.data(), w, &ty) == EPIPE_OK, "%s", epipe_codec_last_error(c));
    epipe_codec_destroy(c);
    return y;
}

static std::vector<float> input(unsigned mb)
{
    std::vector<float> x((size_t)ROWS * COLS);
    for (size_t i = 0; i < x.size(); i++)
        x[i] = (float)((i * 2654435761u + mb * 977u) % 2001) / 1000.0f - 1.0f + 0.01f * (float)mb;
    return x;
}

/* The gradient rank 1 sends for the activation it received: a * 0.5 - 1. */
__global__ void make_grad(const float *a, size_t n, float *g)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        g[i] = a[i] * 0.5f - 1.0f;
}

struct rank_args {
    epipe_comm *comm;
    const char *schedule;
    int rank, cuda_recv; /* rank 1: receive into device memory */
    int steps;
};

/* A received tensor copied to the host, wherever it is. */
static std::vector<float> to_host(const DLTensor *t)
{
    std::vector<float> h((size_t)ROWS * COLS);
    if (t->device.device_type == kDLCUDA)
        cudaMemcpy(h.data(), t->data, h.size() * 4, cudaMemcpyDeviceToHost);
    else
        memcpy(h.data(), t->data, h.size() * 4);
    return h;
}

static void *run_rank(void *p)
{
    rank_args *a = (rank_args *)p;
    epipe_stage *st = NULL;
    CHECK(epipe_stage_create(&st, a->comm, a->schedule, M) == EPIPE_OK, "%s", epipe_last_error());
    if (!st)
        return NULL;
    CHECK(epipe_stage_set_codec(st, EPIPE_DIR_ACTIVATION, EPIPE_ALL_BOUNDARIES, ACT_SPEC) == 0,
          "act codec");
    CHECK(epipe_stage_set_codec(st, EPIPE_DIR_GRADIENT, EPIPE_ALL_BOUNDARIES, GRAD_SPEC) == 0,
          "grad codec");
    if (a->rank == 0 || a->cuda_recv)
        CHECK(epipe_stage_set_param(st, EPIPE_STAGE_CUDA_DEVICE, 0) == EPIPE_OK, "%s",
              epipe_stage_last_error(st));
    int64_t shape[2] = {ROWS, COLS};
    size_t n = (size_t)ROWS * COLS;
    std::vector<float *> dx(M), dg(M);
    std::vector<std::vector<float>> hg(M, std::vector<float>(n));
    for (unsigned mb = 0; mb < M; mb++) {
        cudaMalloc((void **)&dx[mb], n * 4);
        cudaMalloc((void **)&dg[mb], n * 4);
        std::vector<float> x = input(mb);
        cudaMemcpy(dx[mb], x.data(), n * 4, cudaMemcpyHostToDevice);
    }
    for (int step = 0; step < a->steps; step++) {
        epipe_op op;
        for (;;) {
            if (epipe_stage_next_op(st, &op) != EPIPE_OK) {
                CHECK(0, "rank %d next_op: %s", a->rank, epipe_stage_last_error(st));
                goto out;
            }
            if (op.kind == EPIPE_OP_NONE)
                break;
            unsigned mb = op.microbatch;
            std::vector<float> act = through_cpu(ACT_SPEC, input(mb));
            if (a->rank == 0 && op.kind == EPIPE_OP_FORWARD) {
                DLTensor t = view(kDLCUDA, dx[mb], shape);
                CHECK(epipe_stage_send_activation(st, mb, &t) == EPIPE_OK, "send act: %s",
                      epipe_stage_last_error(st));
            } else if (a->rank == 0) { /* backward: the gradient of what was sent */
                const DLTensor *g;
                CHECK(epipe_stage_recv_gradient(st, mb, &g) == EPIPE_OK, "recv grad: %s",
                      epipe_stage_last_error(st));
                CHECK(g->device.device_type == kDLCUDA, "gradient on device type %d",
                      (int)g->device.device_type);
                std::vector<float> want(n);
                for (size_t i = 0; i < n; i++)
                    want[i] = act[i] * 0.5f - 1.0f;
                want = through_cpu(GRAD_SPEC, want);
                CHECK(to_host(g) == want, "rank 0 step %d mb %u: gradient differs from the CPU's",
                      step, mb);
            } else if (op.kind == EPIPE_OP_FORWARD) {
                const DLTensor *x;
                CHECK(epipe_stage_recv_activation(st, mb, &x) == EPIPE_OK, "recv act: %s",
                      epipe_stage_last_error(st));
                CHECK(x->device.device_type == (a->cuda_recv ? kDLCUDA : kDLCPU),
                      "activation on device type %d", (int)x->device.device_type);
                CHECK(to_host(x) == act, "rank 1 step %d mb %u: activation differs from the CPU's",
                      step, mb);
                if (x->device.device_type == kDLCUDA) {
                    make_grad<<<64, 256>>>((const float *)x->data, n, dg[mb]);
                } else {
                    const float *h = (const float *)x->data;
                    for (size_t i = 0; i < n; i++)
                        hg[mb][i] = h[i] * 0.5f - 1.0f;
                }
            } else {
                /* a CUDA gradient when it came to the device, else a CPU one */
                DLTensor t = a->cuda_recv ? view(kDLCUDA, dg[mb], shape)
                                          : view(kDLCPU, hg[mb].data(), shape);
                CHECK(epipe_stage_send_gradient(st, mb, &t) == EPIPE_OK, "send grad: %s",
                      epipe_stage_last_error(st));
            }
        }
    }
out:
    for (unsigned mb = 0; mb < M; mb++) {
        cudaFree(dx[mb]);
        cudaFree(dg[mb]);
    }
    epipe_stage_destroy(st);
    return NULL;
}

static void run_pair(epipe_comm *c0, epipe_comm *c1, const char *schedule, int cuda_recv)
{
    rank_args a0 = {c0, schedule, 0, 1, 2}, a1 = {c1, schedule, 1, cuda_recv, 2};
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
    tcp_args *a = (tcp_args *)p;
    if (epipe_comm_create_tcp(a->out, a->rank, 2, "127.0.0.1", a->port, NULL) != EPIPE_OK)
        CHECK(0, "tcp rank %u: %s", a->rank, epipe_last_error());
    return NULL;
}

int main(void)
{
    int count = gpu_test_devices_or_skip();
    for (const char *schedule : {"gpipe", "1f1b"})
        for (int cuda_recv : {1, 0}) {
            epipe_comm *c[2];
            if (epipe_comm_create_inproc(c, 2) != EPIPE_OK)
                return fprintf(stderr, "inproc: %s\n", epipe_last_error()), 1;
            run_pair(c[0], c[1], schedule, cuda_recv);
            epipe_comm_destroy(c[0]);
            epipe_comm_destroy(c[1]);
        }
    {
        epipe_comm *c[2] = {NULL, NULL};
        unsigned port = free_port();
        tcp_args a0 = {&c[0], 0, port}, a1 = {&c[1], 1, port};
        pthread_t t0, t1;
        pthread_create(&t0, NULL, tcp_create, &a0);
        pthread_create(&t1, NULL, tcp_create, &a1);
        pthread_join(t0, NULL);
        pthread_join(t1, NULL);
        if (c[0] && c[1])
            run_pair(c[0], c[1], "1f1b", 1);
        epipe_comm_destroy(c[0]);
        epipe_comm_destroy(c[1]);
    }
    /* A device that does not exist is refused by name. */
    {
        epipe_comm *c[2];
        epipe_comm_create_inproc(c, 2);
        epipe_stage *st;
        epipe_stage_create(&st, c[0], "gpipe", 2);
        CHECK(epipe_stage_set_param(st, EPIPE_STAGE_CUDA_DEVICE, count) == EPIPE_EINVAL,
              "device %d", count);
        CHECK(strstr(epipe_stage_last_error(st), "does not exist") != NULL, "%s",
              epipe_stage_last_error(st));
        epipe_stage_destroy(st);
        epipe_comm_destroy(c[0]);
        epipe_comm_destroy(c[1]);
    }
    return gpu_test_result();
}
