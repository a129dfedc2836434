/* The gpu suite: stages with CUDA tensors on a GPU, the exchange of
 * tests/support/stage_exchange.h (GPipe and 1F1B over inproc and TCP,
 * received tensors in device or host memory, each equal byte for byte to
 * what the CPU codecs make of what was sent) with codecs that have CUDA
 * kernels. tests/fakecuda/test_stage_staged.c runs the same on any machine
 * through host staging. Exit 77 without a device. */
#include <cuda_runtime.h>
#include <math.h>

#include "gpu_test.h"
#include "stage_exchange.h"

/* The CUDA emulator's count of copies between two devices' memory
 * (tests/cudaemu/); NULL on a GPU, where nothing here tells them apart. */
extern "C" __attribute__((weak)) unsigned long cudaemu_peer_copies(void);

static void *dev_alloc(size_t bytes)
{
    void *p = NULL;
    return cudaMalloc(&p, bytes) == cudaSuccess ? p : NULL;
}

static void dev_free(void *p)
{
    cudaFree(p);
}

static int dev_copy(void *dst, const void *src, size_t bytes)
{
    return cudaMemcpy(dst, src, bytes, cudaMemcpyDefault) == cudaSuccess ? 0 : -1;
}

/* A stream-ordered send of a NaN through quant from the first of three
 * ranks: the send returns at once, and the end of the step reports the
 * value by name on every rank (the second through the fence's verdict on
 * the encode, the third through what the second passed on, though what
 * the second sent it was encoded well): none may finish its step with
 * what the refused encode wrote, or with what was made of it. */
enum { NAN_RANKS = 3 };

typedef struct nan_rank {
    epipe_comm *comm;
    pthread_barrier_t *ready; /* all on the device: the payloads stay there */
    int end_rc;               /* the first step's end */
    char end_msg[768];
} nan_rank;

static void *nan_rank_main(void *p)
{
    nan_rank *a = (nan_rank *)p;
    unsigned r = epipe_comm_rank(a->comm);
    epipe_stage *st = NULL;
    float *dev = (float *)dev_alloc(SX_N * sizeof(float));
    float *host = (float *)malloc(SX_N * sizeof(float));
    SX_CHECK(dev && host && epipe_stage_create(&st, a->comm, "gpipe", 1) == EPIPE_OK, "set-up: %s",
             epipe_last_error());
    if (!st || !dev || !host) {
        pthread_barrier_wait(a->ready);
        epipe_comm_abort(a->comm);
        dev_free(dev);
        free(host);
        return NULL;
    }
    SX_CHECK(epipe_stage_set_codec(st, EPIPE_DIR_ACTIVATION, EPIPE_ALL_BOUNDARIES,
                                   "quant:bits=8") == EPIPE_OK &&
                 epipe_stage_set_param(st, EPIPE_STAGE_CUDA_DEVICE, 0) == EPIPE_OK &&
                 epipe_stage_set_param(st, EPIPE_STAGE_CUDA_STREAM_ORDERED, 1) == EPIPE_OK &&
                 epipe_stage_set_param(st, EPIPE_STAGE_TIMEOUT_MS, 20000) == EPIPE_OK,
             "knobs: %s", epipe_stage_last_error(st));
    pthread_barrier_wait(a->ready);
    sx_input(0, host);
    if (r == 0)
        host[SX_N / 3] = NAN;
    SX_CHECK(dev_copy(dev, host, SX_N * sizeof(float)) == 0, "copy");
    DLTensor t = sx_view(kDLCUDA, dev);
    epipe_op op;
    int rc;
    while ((rc = epipe_stage_next_op(st, &op)) == EPIPE_OK && op.kind != EPIPE_OP_NONE) {
        const DLTensor *in;
        if ((rc = sx_chain_op(st, r, NAN_RANKS, &op, &t, &in)))
            break; /* every call of the step returns at once, but its end */
    }
    a->end_rc = rc;
    snprintf(a->end_msg, sizeof a->end_msg, "%s", epipe_stage_last_error(st));
    /* the failure stays: the next op-stream call reports it again; the
     * step is over, so the knobs that change between steps can */
    SX_CHECK(epipe_stage_next_op(st, &op) == rc, "rank %u: a second end", r);
    SX_CHECK(epipe_stage_set_param(st, EPIPE_STAGE_CUDA_STREAM_ORDERED, 0) == EPIPE_OK,
             "rank %u: between steps: %s", r, epipe_stage_last_error(st));
    epipe_stage_destroy(st);
    dev_free(dev);
    free(host);
    return NULL;
}

static void ordered_nan_case(void)
{
    int before = sx_failures;
    epipe_comm *c[NAN_RANKS];
    if (epipe_comm_create_inproc(c, NAN_RANKS) != EPIPE_OK) {
        SX_CHECK(0, "inproc: %s", epipe_last_error());
        return;
    }
    pthread_barrier_t ready;
    pthread_barrier_init(&ready, NULL, NAN_RANKS);
    nan_rank a[NAN_RANKS];
    pthread_t th[NAN_RANKS];
    for (int i = 0; i < NAN_RANKS; i++) {
        a[i] = nan_rank{c[i], &ready, 0, ""};
        pthread_create(&th[i], NULL, nan_rank_main, &a[i]);
    }
    for (int i = 0; i < NAN_RANKS; i++)
        pthread_join(th[i], NULL);
    pthread_barrier_destroy(&ready);
    const char *says[NAN_RANKS] = {"stream-ordered", "its encode (quant) failed",
                                   "an earlier stage's encode failed"};
    for (int i = 0; i < NAN_RANKS; i++)
        SX_CHECK(a[i].end_rc == EPIPE_EINVAL && strstr(a[i].end_msg, "NaN") &&
                     strstr(a[i].end_msg, says[i]),
                 "rank %d's step: %d %s", i, a[i].end_rc, a[i].end_msg);
    for (int i = 0; i < NAN_RANKS; i++)
        epipe_comm_destroy(c[i]);
    printf("a stream-ordered send of a NaN, reported at the step's end on every rank: %s\n",
           sx_failures == before ? "ok" : "FAILED");
}

/* The stream-ordered runs' streams: non-blocking (no implicit wait on the
 * legacy default stream, which the copies above use), each held up for
 * about a millisecond before every send and receive, so that on a GPU a
 * missing fence or an early free changes the bytes received. The
 * emulator runs streams in call order: there the delay is nothing. */
#ifndef EPIPE_TESTS_CUDAEMU_H
__global__ void spin_kernel(long long cycles)
{
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {
    }
}
#endif

static void *stream_new(void)
{
    cudaStream_t s = NULL;
    return cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess ? (void *)s : NULL;
}

static void stream_free(void *s)
{
    cudaStreamDestroy((cudaStream_t)s);
}

static void delay(void *s)
{
#ifndef EPIPE_TESTS_CUDAEMU_H
    spin_kernel<<<1, 1, 0, (cudaStream_t)s>>>(2000000); /* about 1 ms at 2 GHz */
#else
    (void)s;
#endif
}

static int stream_sync(void *s)
{
    return cudaStreamSynchronize((cudaStream_t)s) == cudaSuccess ? 0 : -1;
}

static int copy_on(void *s, void *dst, const void *src, size_t bytes)
{
    return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, (cudaStream_t)s) == cudaSuccess ? 0
                                                                                               : -1;
}

static int fill_on(void *s, void *dst, int byte, size_t bytes)
{
    return cudaMemsetAsync(dst, byte, bytes, (cudaStream_t)s) == cudaSuccess ? 0 : -1;
}

static int use_device(int device)
{
    return cudaSetDevice(device) == cudaSuccess ? 0 : -1;
}

/* A handle whose stream belongs to another device than its tensor's is
 * refused by name before any work is queued; the same tensor goes on a
 * stream of its own device. Needs two devices (the emulator's, in CI:
 * gpu-stage-2dev-emu). */
static void stream_of_another_device(int count)
{
    if (count < 2) {
        printf("a stream of another device: skipped (one device)\n");
        return;
    }
    int before = sx_failures;
    cudaStream_t s0 = NULL, s1 = NULL;
    float *d = NULL;
    CUDA_OK(cudaSetDevice(1));
    CUDA_OK(cudaStreamCreate(&s1));
    CUDA_OK(cudaSetDevice(0));
    CUDA_OK(cudaStreamCreate(&s0));
    CUDA_OK(cudaMalloc((void **)&d, SX_N * sizeof *d));
    CUDA_OK(cudaMemset(d, 0, SX_N * sizeof *d));
    epipe_codec *c;
    SX_CHECK(epipe_codec_create(&c, "quant:bits=8") == EPIPE_OK, "%s", epipe_last_error());
    DLTensor t = sx_view(kDLCUDA, d);
    static uint8_t p[SX_N * 4 + 64];
    size_t w = 0;
    SX_CHECK(epipe_codec_set_stream(c, s1) == EPIPE_OK, "set the stream");
    int rc = epipe_codec_encode(c, &t, p, sizeof p, &w);
    SX_CHECK(
        rc == EPIPE_EINVAL &&
            strstr(epipe_codec_last_error(c), "src is on CUDA device 0, but the handle's stream") &&
            strstr(epipe_codec_last_error(c), "is on device 1"),
        "a stream of device 1: %d %s", rc, epipe_codec_last_error(c));
    SX_CHECK(epipe_codec_set_stream(c, s0) == EPIPE_OK, "set the stream");
    SX_CHECK(epipe_codec_encode(c, &t, p, sizeof p, &w) == EPIPE_OK &&
                 epipe_codec_synchronize(c) == EPIPE_OK,
             "a stream of device 0: %s", epipe_codec_last_error(c));
    /* decodes of a device payload, deferred (its own length) or read
     * first (a longer one): refused by name too */
    uint8_t *dp = NULL;
    CUDA_OK(cudaMalloc((void **)&dp, w + 4));
    CUDA_OK(cudaMemcpy(dp, p, w, cudaMemcpyHostToDevice));
    SX_CHECK(epipe_codec_set_stream(c, s1) == EPIPE_OK, "set the stream");
    for (size_t len = w; len <= w + 4; len += 4) {
        rc = epipe_codec_decode(c, dp, len, &t);
        SX_CHECK(rc == EPIPE_EINVAL && strstr(epipe_codec_last_error(c),
                                              "dst is on CUDA device 0, but the handle's stream"),
                 "a decode of %zu bytes on a stream of device 1: %d %s", len, rc,
                 epipe_codec_last_error(c));
    }
    cudaFree(dp);
    epipe_codec_destroy(c);
    cudaFree(d);
    cudaStreamDestroy(s0);
    cudaStreamDestroy(s1);
    printf("a stream of another device refused by name: %s\n",
           sx_failures == before ? "ok" : "FAILED");
}

/* A stage that named device 1, with a stream there, and then went back to
 * the host, before any receive: its communicator keeps to device 1, so a
 * rank on device 0 sends it device payloads, which it copies to the host
 * on device 0, not on its stream of device 1 (which would be refused).
 * Each activation it receives must be the CPU's. Needs two devices. */
typedef struct host_after_device {
    sx_rank r;
    pthread_barrier_t *ready;
    int rc;
    char why[512];
} host_after_device;

static void *host_after_device_main(void *p)
{
    host_after_device *a = (host_after_device *)p;
    unsigned rank = (unsigned)a->r.rank;
    epipe_stage *st = NULL;
    cudaStream_t s = NULL;
    float *d = NULL;
    static float x[2][SX_N], want[SX_N];
    int rc = cudaSetDevice((int)rank) == cudaSuccess ? EPIPE_OK : EPIPE_EIO;
    if (!rc)
        rc = epipe_stage_create(&st, a->r.comm, "gpipe", SX_M);
    if (!rc)
        rc = epipe_stage_set_codec(st, EPIPE_DIR_ACTIVATION, EPIPE_ALL_BOUNDARIES, a->r.act_spec);
    if (!rc)
        rc = epipe_stage_set_codec(st, EPIPE_DIR_GRADIENT, EPIPE_ALL_BOUNDARIES, "none");
    if (!rc)
        rc = epipe_stage_set_param(st, EPIPE_STAGE_CUDA_DEVICE, (int)rank);
    if (!rc && rank == 1 && cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess)
        rc = EPIPE_EIO;
    if (!rc && rank == 1 && !(rc = epipe_stage_set_cuda_stream(st, s)))
        rc = epipe_stage_set_param(st, EPIPE_STAGE_CUDA_DEVICE, -1);
    if (!rc && rank == 0 && cudaMalloc((void **)&d, SX_N * sizeof *d) != cudaSuccess)
        rc = EPIPE_EIO;
    pthread_barrier_wait(a->ready);
    epipe_op op;
    while (!rc && !(rc = epipe_stage_next_op(st, &op)) && op.kind != EPIPE_OP_NONE) {
        unsigned mb = op.microbatch;
        const DLTensor *in = NULL;
        sx_input(mb, x[rank]);
        if (rank == 0 && op.kind == EPIPE_OP_FORWARD) {
            DLTensor t = sx_view(kDLCUDA, d);
            rc = cudaMemcpy(d, x[0], sizeof x[0], cudaMemcpyHostToDevice) ? EPIPE_EIO : EPIPE_OK;
            if (!rc)
                rc = sx_clean(epipe_stage_send_activation(st, mb, &t));
        } else if (rank == 0) {
            rc = sx_clean(epipe_stage_recv_gradient(st, mb, &in));
        } else if (op.kind == EPIPE_OP_FORWARD) {
            rc = sx_clean(epipe_stage_recv_activation(st, mb, &in));
            sx_through_cpu(a->r.act_spec, x[1], want);
            SX_CHECK(rc || (in->device.device_type == kDLCPU &&
                            memcmp(in->data, want, sizeof want) == 0),
                     "micro-batch %u: the activation on the host differs from the CPU's", mb);
        } else {
            DLTensor t = sx_view(kDLCPU, x[1]);
            rc = sx_clean(epipe_stage_send_gradient(st, mb, &t));
        }
    }
    a->rc = rc;
    snprintf(a->why, sizeof a->why, "%s", st ? epipe_stage_last_error(st) : epipe_last_error());
    if (rc)
        epipe_comm_abort(a->r.comm);
    epipe_stage_destroy(st);
    cudaFree(d);
    if (s)
        cudaStreamDestroy(s);
    return NULL;
}

static void host_after_a_device(int count)
{
    if (count < 2) {
        printf("a stage back on the host after a device: skipped (one device)\n");
        return;
    }
    int before = sx_failures;
    pthread_barrier_t ready;
    pthread_barrier_init(&ready, NULL, 2);
    host_after_device a[2];
    memset(a, 0, sizeof a);
    for (int i = 0; i < 2; i++) {
        a[i].r.rank = i;
        a[i].r.act_spec = "quant:bits=8";
        a[i].ready = &ready;
    }
    epipe_comm *c[2];
    SX_CHECK(epipe_comm_create_inproc(c, 2) == EPIPE_OK, "%s", epipe_last_error());
    a[0].r.comm = c[0];
    a[1].r.comm = c[1];
    pthread_t t[2];
    for (int i = 0; i < 2; i++)
        pthread_create(&t[i], NULL, host_after_device_main, &a[i]);
    for (int i = 0; i < 2; i++)
        pthread_join(t[i], NULL);
    pthread_barrier_destroy(&ready);
    for (int i = 0; i < 2; i++) {
        SX_CHECK(a[i].rc == EPIPE_OK, "rank %d: %s", i, a[i].why);
        epipe_comm_destroy(c[i]);
    }
    CUDA_OK(cudaSetDevice(0));
    printf("a stage back on the host after a device: %s\n",
           sx_failures == before ? "ok" : "FAILED");
}

int main(void)
{
    int count = gpu_test_devices_or_skip();
    sx_memory mem = {dev_alloc,   dev_free, dev_copy, stream_new, stream_free,        delay,
                     stream_sync, copy_on,  fill_on,  use_device, cudaemu_peer_copies};
    sx_run_all(&mem, "quant:bits=8", "sortquant:bits=8,mode=sample", count);
    ordered_nan_case();
    stream_of_another_device(count);
    host_after_a_device(count);
    if (sx_failures)
        return fprintf(stderr, "%d failures\n", sx_failures), 1;
    return gpu_test_result();
}
