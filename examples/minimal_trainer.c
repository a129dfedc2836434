/* minimal_trainer: the smallest complete libepipe host. A chain of linear
 * layers, one per stage, learns a fixed linear map with the callback API.
 * Stages run as threads (inproc) or, when started by a launcher such as
 * epipe-run, one per process over TCP. docs/api-guide.md walks through it. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <epipe/epipe.h>

enum { DIM = 16, ROWS = 8, MICRO = 4, STEPS = 100 };
static const float LR = 0.05f;

/* One stage's layer y = W x, with what its backward needs. */
struct layer {
    unsigned stage, stages;
    float w[DIM * DIM], grad[DIM * DIM];
    float x[MICRO][ROWS * DIM]; /* each micro-batch's input, kept for backward */
    float y[ROWS * DIM], dx[ROWS * DIM];
    int64_t shape[2];
    DLTensor out, dout; /* views of y and dx handed to the stage */
    double loss;
};

static void view(DLTensor *t, float *data, int64_t *shape)
{
    memset(t, 0, sizeof *t);
    t->data = data;
    t->device.device_type = kDLCPU;
    t->ndim = 2;
    t->dtype.code = kDLFloat, t->dtype.bits = 32, t->dtype.lanes = 1;
    t->shape = shape;
}

/* The data: micro-batch mb's input rows, and the target the last stage
 * compares with (2x the input: the chain must learn to double). */
static float sample(unsigned mb, int i)
{
    return (float)((int)((mb * 131u + (unsigned)i * 17u) % 23u) - 11) / 11.0f;
}

static int forward(void *user, unsigned mb, const DLTensor *input, const DLTensor **output)
{
    struct layer *l = user;
    for (int i = 0; i < ROWS * DIM; i++) /* the first stage reads its own data */
        l->x[mb][i] = input ? ((const float *)input->data)[i] : sample(mb, i);
    for (int r = 0; r < ROWS; r++)
        for (int o = 0; o < DIM; o++) {
            float acc = 0;
            for (int k = 0; k < DIM; k++)
                acc += l->w[o * DIM + k] * l->x[mb][r * DIM + k];
            l->y[r * DIM + o] = acc;
        }
    view(&l->out, l->y, l->shape);
    *output = &l->out; /* encoded and sent before forward's caller returns */
    return 0;
}

static int backward(void *user, unsigned mb, const DLTensor *grad_output,
                    const DLTensor **grad_input)
{
    struct layer *l = user;
    float dy[ROWS * DIM];
    if (grad_output) {
        memcpy(dy, grad_output->data, sizeof dy);
    } else { /* last stage: start from the loss 0.5*|y - 2*x0|^2 / rows */
        for (int r = 0; r < ROWS; r++)
            for (int o = 0; o < DIM; o++) {
                float yv = 0;
                for (int k = 0; k < DIM; k++)
                    yv += l->w[o * DIM + k] * l->x[mb][r * DIM + k];
                float d = yv - 2.0f * sample(mb, r * DIM + o);
                dy[r * DIM + o] = d / (ROWS * MICRO);
                l->loss += 0.5 * d * d / (ROWS * MICRO);
            }
    }
    for (int o = 0; o < DIM; o++) /* dW += dy^T x, dx = dy W */
        for (int k = 0; k < DIM; k++) {
            float acc = 0;
            for (int r = 0; r < ROWS; r++)
                acc += dy[r * DIM + o] * l->x[mb][r * DIM + k];
            l->grad[o * DIM + k] += acc;
        }
    for (int r = 0; r < ROWS; r++)
        for (int k = 0; k < DIM; k++) {
            float acc = 0;
            for (int o = 0; o < DIM; o++)
                acc += dy[r * DIM + o] * l->w[o * DIM + k];
            l->dx[r * DIM + k] = acc;
        }
    view(&l->dout, l->dx, l->shape);
    *grad_input = &l->dout;
    return 0;
}

/* Runs every step of one stage; returns 0 when the loss fell 10x. */
static int run_stage(epipe_comm *comm, const char *codec)
{
    struct layer *l = calloc(1, sizeof *l);
    epipe_stage *st = NULL;
    int rc = l ? EPIPE_OK : EPIPE_ENOMEM;
    if (rc)
        return 1;
    l->stage = epipe_comm_rank(comm), l->stages = epipe_comm_size(comm);
    l->shape[0] = ROWS, l->shape[1] = DIM;
    for (int i = 0; i < DIM; i++) /* identity start: the chain computes x */
        l->w[i * DIM + i] = 1.0f;
    if (!(rc = epipe_stage_create(&st, comm, "1f1b", MICRO)) &&
        !(rc = epipe_stage_set_codec(st, EPIPE_DIR_ACTIVATION, EPIPE_ALL_BOUNDARIES, codec)) &&
        !(rc = epipe_stage_set_codec(st, EPIPE_DIR_GRADIENT, EPIPE_ALL_BOUNDARIES, codec))) {
        epipe_stage_callbacks cb = EPIPE_STAGE_CALLBACKS_INIT;
        cb.user = l, cb.forward = forward, cb.backward = backward;
        rc = epipe_stage_set_callbacks(st, &cb);
    }
    double first = -1, last = -1;
    for (int step = 0; !rc && step < STEPS; step++) {
        memset(l->grad, 0, sizeof l->grad);
        l->loss = 0;
        if ((rc = epipe_stage_step(st)))
            break;
        for (int i = 0; i < DIM * DIM; i++) /* plain SGD: the host owns the optimizer */
            l->w[i] -= LR * l->grad[i];
        if (first < 0)
            first = l->loss;
        last = l->loss;
    }
    int bad = 0;
    if (rc) {
        fprintf(stderr, "stage %u: %s\n", l->stage,
                st ? epipe_stage_last_error(st) : epipe_last_error());
        epipe_comm_abort(comm); /* wake the other stages */
        bad = 1;
    } else if (l->stage + 1 == l->stages) {
        printf("loss %.6f -> %.6f after %d steps over %u stages (%s)\n", first, last, STEPS,
               l->stages, codec);
        bad = !(last < first / 10);
    }
    epipe_stage_destroy(st);
    free(l);
    return bad;
}

struct thread {
    epipe_comm *comm;
    const char *codec;
    int bad;
};

static void *thread_main(void *p)
{
    struct thread *t = p;
    t->bad = run_stage(t->comm, t->codec);
    epipe_comm_destroy(t->comm);
    return NULL;
}

int main(int argc, char **argv)
{
    const char *codec = argc > 1 ? argv[1] : "none";
    unsigned stages = argc > 2 ? (unsigned)atoi(argv[2]) : 3;
    if (getenv("EPIPE_RANK") || getenv("RANK") || getenv("OMPI_COMM_WORLD_RANK") ||
        getenv("PMI_RANK") || getenv("SLURM_PROCID")) { /* one rank of a launched job */
        epipe_comm *comm;
        if (epipe_comm_create_from_env(&comm, NULL)) {
            fprintf(stderr, "%s\n", epipe_last_error());
            return 1;
        }
        int bad = run_stage(comm, codec);
        epipe_comm_destroy(comm);
        return bad;
    }
    epipe_comm *comms[8];
    struct thread t[8];
    pthread_t tid[8];
    if (stages < 1 || stages > 8 || epipe_comm_create_inproc(comms, stages)) {
        fprintf(stderr, "usage: minimal_trainer [codec] [stages 1..8]: %s\n", epipe_last_error());
        return 2;
    }
    for (unsigned s = 0; s < stages; s++) {
        t[s] = (struct thread){comms[s], codec, 0};
        pthread_create(&tid[s], NULL, thread_main, &t[s]);
    }
    int bad = 0;
    for (unsigned s = 0; s < stages; s++) {
        pthread_join(tid[s], NULL);
        bad |= t[s].bad;
    }
    return bad;
}
