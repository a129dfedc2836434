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

/* A stream-ordered send of a NaN through quant: the send returns at once,
 * the step's end reports the value by name and aborts the communicator,
 * and the peer's next receive fails instead of waiting. */
typedef struct nan_rank {
    epipe_comm *comm;
    pthread_barrier_t *ready; /* both on the device: the payload stays there */
    int end_rc, peer_rc;      /* rank 0: the step's end; rank 1: its second step */
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
    for (int step = 0; step < 2; step++) {
        epipe_op op;
        int rc;
        while ((rc = epipe_stage_next_op(st, &op)) == EPIPE_OK && op.kind != EPIPE_OP_NONE) {
            const DLTensor *in;
            if ((rc = sx_pair_op(st, r, op.kind, &t, &in)))
                break;
        }
        if (r == 0) { /* every call of the step returned at once, but its end */
            a->end_rc = rc;
            snprintf(a->end_msg, sizeof a->end_msg, "%s", epipe_stage_last_error(st));
            break;
        }
        if (step == 1 || rc) {
            a->peer_rc = rc;
            break;
        }
    }
    epipe_stage_destroy(st);
    dev_free(dev);
    free(host);
    return NULL;
}

static void ordered_nan_case(void)
{
    int before = sx_failures;
    epipe_comm *c[2];
    if (epipe_comm_create_inproc(c, 2) != EPIPE_OK) {
        SX_CHECK(0, "inproc: %s", epipe_last_error());
        return;
    }
    pthread_barrier_t ready;
    pthread_barrier_init(&ready, NULL, 2);
    nan_rank a[2] = {{c[0], &ready, 0, 0, ""}, {c[1], &ready, 0, 0, ""}};
    pthread_t th[2];
    for (int i = 0; i < 2; i++)
        pthread_create(&th[i], NULL, nan_rank_main, &a[i]);
    for (int i = 0; i < 2; i++)
        pthread_join(th[i], NULL);
    pthread_barrier_destroy(&ready);
    SX_CHECK(a[0].end_rc == EPIPE_EINVAL && strstr(a[0].end_msg, "NaN") &&
                 strstr(a[0].end_msg, "EPIPE_STAGE_CUDA_STREAM_ORDERED"),
             "the step's end: %d %s", a[0].end_rc, a[0].end_msg);
    SX_CHECK(a[1].peer_rc == EPIPE_EPEER, "the peer's next step: %d", a[1].peer_rc);
    epipe_comm_destroy(c[0]);
    epipe_comm_destroy(c[1]);
    printf("a stream-ordered send of a NaN, reported at the step's end: %s\n",
           sx_failures == before ? "ok" : "FAILED");
}

int main(void)
{
    int count = gpu_test_devices_or_skip();
    sx_memory mem = {dev_alloc, dev_free, dev_copy};
    sx_run_all(&mem, "quant:bits=8", "sortquant:bits=8,mode=sample", count);
    ordered_nan_case();
    if (sx_failures)
        return fprintf(stderr, "%d failures\n", sx_failures), 1;
    return gpu_test_result();
}
