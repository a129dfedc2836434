/* CUDA errors mid-step in the stage runtime, under the emulator
 * (tests/cudaemu/): two ranks (threads, inproc) run 1F1B with CUDA
 * activations and gradients through quant:bits=8, receiving into device
 * memory or into host memory (host staging), while the k-th CUDA call that
 * can fail fails, for every k the clean run makes. A rank whose call fails
 * aborts its communicator, as a host should, so the other wakes. Neither
 * may crash or hang; the failure must reach a rank as an error naming the
 * CUDA error (never lost), or, for a failed allocation of a buffer the
 * library can do without (a pinned or a device message buffer: a host
 * one serves), the step must end as the clean one; and a clean run after
 * each must be right again. The payloads (4,400 values) are big enough to
 * stay on the device between the ranks (EPIPE_CUDA_DEVICE_MESSAGES).
 * With two devices (CUDAEMU_DEVICES=2) the second rank also runs on the
 * second device, as it is and stream-ordered: its payloads copied from
 * the other device's memory. Exit 77 without the emulator's device. */
#include <cuda_runtime.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <epipe/epipe.h>

#include "gpu_test.h"

enum { M = 3, ROWS = 4, COLS = 1100, N = ROWS * COLS };
static int64_t shape[2] = {ROWS, COLS};

static DLTensor view(int type, void *data)
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

struct rank_run {
    epipe_comm *comm;
    int rank, device_recv;
    int device;    /* its CUDA device */
    int ordered;   /* EPIPE_STAGE_CUDA_STREAM_ORDERED */
    pthread_barrier_t *ready; /* both set up: no message before its receiver named its device */
    int rc;        /* the first failure, or EPIPE_OK */
    char msg[512]; /* and its message */
    char left[512];  /* the error text the first call that succeeded left, if any */
    float sum;     /* rank 0: the sum of every gradient received */
};

static void *run_rank(void *p)
{
    rank_run *a = (rank_run *)p;
    epipe_stage *st = NULL;
    float *dx = NULL, *dg = NULL, h[N];
    int rc = a->device && cudaSetDevice(a->device) ? EPIPE_EIO : EPIPE_OK;
    if (rc)
        snprintf(a->msg, sizeof a->msg, "the test's cudaSetDevice failed (CUDA error while testing)");
    if (!rc)
        rc = epipe_stage_create(&st, a->comm, "1f1b", M);
    if (!rc)
        rc = epipe_stage_set_codec(st, EPIPE_DIR_ACTIVATION, EPIPE_ALL_BOUNDARIES, "quant:bits=8");
    if (!rc)
        rc = epipe_stage_set_codec(st, EPIPE_DIR_GRADIENT, EPIPE_ALL_BOUNDARIES, "quant:bits=8");
    if (!rc && (a->rank == 0 || a->device_recv))
        rc = epipe_stage_set_param(st, EPIPE_STAGE_CUDA_DEVICE, a->device);
    if (!rc && a->ordered)
        rc = epipe_stage_set_param(st, EPIPE_STAGE_CUDA_STREAM_ORDERED, 1);
    if (!rc && (cudaMalloc((void **)&dx, N * 4) || cudaMalloc((void **)&dg, N * 4))) {
        rc = EPIPE_ENOMEM; /* the test's own allocation */
        snprintf(a->msg, sizeof a->msg, "the test's cudaMalloc failed (CUDA error while testing)");
    }
    for (size_t i = 0; i < N && !rc; i++)
        h[i] = (float)((i * 2654435761u) % 1000) / 500.0f - 1.0f;
    if (!rc && cudaMemcpy(dx, h, N * 4, cudaMemcpyHostToDevice)) {
        rc = EPIPE_EIO;
        snprintf(a->msg, sizeof a->msg, "the test's cudaMemcpy failed (CUDA error while testing)");
    }
    a->sum = 0.0f;
    pthread_barrier_wait(a->ready);
    while (!rc) {
        epipe_op op;
        if ((rc = epipe_stage_next_op(st, &op)) || op.kind == EPIPE_OP_NONE)
            break;
        const DLTensor *r = NULL;
        if (a->rank == 0 && op.kind == EPIPE_OP_FORWARD) {
            DLTensor t = view(kDLCUDA, dx);
            rc = epipe_stage_send_activation(st, op.microbatch, &t);
        } else if (a->rank == 0) {
            if (!(rc = epipe_stage_recv_gradient(st, op.microbatch, &r))) {
                float g[N];
                if (cudaMemcpy(g, r->data, N * 4, cudaMemcpyDeviceToHost)) {
                    rc = EPIPE_EIO;
                    snprintf(a->msg, sizeof a->msg, "the test's copy failed (CUDA error while)");
                }
                for (size_t i = 0; i < N && !rc; i++)
                    a->sum += g[i];
            }
        } else if (op.kind == EPIPE_OP_FORWARD) {
            rc = epipe_stage_recv_activation(st, op.microbatch, &r);
        } else {
            DLTensor t = a->device_recv ? view(kDLCUDA, dx) : view(kDLCPU, h);
            t.device.device_id = a->device_recv ? a->device : 0;
            rc = epipe_stage_send_gradient(st, op.microbatch, &t);
        }
        if (!rc && *epipe_last_error() && !a->left[0]) /* what it did without is no failure */
            snprintf(a->left, sizeof a->left, "%s", epipe_last_error());
    }
    if (rc) {
        if (!a->msg[0])
            snprintf(a->msg, sizeof a->msg, "%s",
                     st ? epipe_stage_last_error(st) : epipe_last_error());
        epipe_comm_abort(a->comm); /* wakes the other rank */
    }
    a->rc = rc;
    epipe_stage_destroy(st);
    cudaFree(dx);
    cudaFree(dg);
    return NULL;
}

/* One 1F1B step on fresh communicators; fills r[2]. */
static void run_pair(int device_recv, int ordered, int two_devices, rank_run r[2])
{
    epipe_comm *c[2];
    if (epipe_comm_create_inproc(c, 2) != EPIPE_OK) {
        fprintf(stderr, "FAIL: inproc: %s\n", epipe_last_error());
        exit(1);
    }
    pthread_t t[2];
    pthread_barrier_t ready;
    pthread_barrier_init(&ready, NULL, 2);
    for (int i = 0; i < 2; i++) {
        memset(&r[i], 0, sizeof r[i]);
        r[i].ready = &ready;
        r[i].comm = c[i];
        r[i].rank = i;
        r[i].device_recv = device_recv;
        r[i].device = two_devices ? i : 0;
        r[i].ordered = ordered;
        pthread_create(&t[i], NULL, run_rank, &r[i]);
    }
    for (int i = 0; i < 2; i++)
        pthread_join(t[i], NULL);
    pthread_barrier_destroy(&ready);
    epipe_comm_destroy(c[0]);
    epipe_comm_destroy(c[1]);
}

int main(void)
{
    int devices = gpu_test_devices_or_skip();
    /* receiving on the device, on the host, and on the device with both
     * stages stream-ordered (fences, held messages, one wait a step); then
     * on a second device, as it is and stream-ordered */
    for (int mode = 0; mode < 5; mode++) {
        int device_recv = mode != 1, ordered = mode == 2 || mode == 4, two = mode >= 3;
        const char *where = mode == 0   ? "on the device"
                            : mode == 1 ? "on the host"
                            : mode == 2 ? "on the device, stream-ordered"
                            : mode == 3 ? "on another device"
                                        : "on another device, stream-ordered";
        if (two && devices < 2) {
            printf("receive %s: skipped, %d device(s)\n", where, devices);
            continue;
        }
        rank_run r[2];
        cudaemu_fail_at(0, 0);
        run_pair(device_recv, ordered, two, r);
        long calls = cudaemu_fallible_calls(), done_without = 0;
        float clean = r[0].sum;
        CHECK(r[0].rc == EPIPE_OK && r[1].rc == EPIPE_OK, "clean run: %s / %s", r[0].msg, r[1].msg);
        for (long k = 1; k <= calls; k++) {
            cudaemu_fail_at(k, 0);
            run_pair(device_recv, ordered, two, r);
            CHECK(!r[0].left[0] && !r[1].left[0],
                  "receive %s, CUDA call %ld failed: a call that succeeded left '%s%s'", where, k,
                  r[0].left, r[1].left);
            long made = cudaemu_fallible_calls();
            int alloc = cudaemu_injected_error() == cudaErrorMemoryAllocation;
            cudaemu_fail_at(0, 0);
            int named = strstr(r[0].msg, "CUDA") || strstr(r[1].msg, "CUDA");
            int failed = r[0].rc || r[1].rc;
            if (!failed && alloc && r[0].sum == clean)
                done_without++;
            else if (made >= k)
                CHECK(failed && named,
                      "receive %s, CUDA call %ld of %ld failed: ranks returned %d (%s) and %d "
                      "(%s)",
                      where, k, calls, r[0].rc, r[0].msg, r[1].rc, r[1].msg);
            run_pair(device_recv, ordered, two, r);
            CHECK(r[0].rc == EPIPE_OK && r[1].rc == EPIPE_OK && r[0].sum == clean,
                  "the clean run after call %ld failed: %s / %s (sum %g, clean %g)", k, r[0].msg,
                  r[1].msg, (double)r[0].sum, (double)clean);
        }
        printf("receive %s: %ld CUDA calls failed in turn, %ld allocations done without\n", where,
               calls, done_without);
    }
    return gpu_test_result();
}
