/* A pipeline host for the tests: one stage of the test MLP, driven by
 * callbacks or by the op stream, plus the single-process reference. */
#include "pipeline_host.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const int host_dims[] = {6, 12, 12, 12, 12, 3};
const int host_nlayers = 5;

void host_partition(unsigned s, unsigned p, int *l0, int *l1)
{
    *l0 = (int)(s * (unsigned)host_nlayers / p);
    *l1 = (int)((s + 1) * (unsigned)host_nlayers / p);
}

static void init_layers(mlp_layer *layers, int l0, int l1)
{
    for (int l = l0; l < l1; l++)
        mlp_layer_init(&layers[l], host_dims[l], host_dims[l + 1], l + 1 < host_nlayers,
                       (uint64_t)l + 1);
}

struct host {
    epipe_stage *stage;
    struct host_result *res;
    int nsteps;
    unsigned s, p, m;
    int l0, l1, rows, step;
    mlp_layer *layers;
    /* acts[mb][k]: input of layer l0+k (k = 0) or output of layer l0+k-1 */
    float *acts[HOST_MAX_MB][HOST_MAX_LAYERS + 1];
    float *dy[HOST_MAX_MB]; /* last stage: gradient of the loss */
    double loss[HOST_MAX_MB];
    float *gbuf[2]; /* backward scratch */
    float *dx;      /* gradient sent upstream */
    int64_t out_shape[2], dx_shape[2];
    DLTensor out, dxt;
    double step_loss;
};

static DLTensor view2d(float *data, int64_t *shape, int rows, int cols)
{
    shape[0] = rows, shape[1] = cols;
    DLTensor t = {
        .data = data, .device = {kDLCPU, 0}, .ndim = 2, .dtype = {kDLFloat, 32, 1}, .shape = shape};
    return t;
}

static int forward(void *user, unsigned mb, const DLTensor *in, const DLTensor **out)
{
    struct host *h = user;
    int in_dim = host_dims[h->l0];
    float *x = h->acts[mb][0];
    if (h->s == 0) {
        float t[16];
        for (int r = 0; r < h->rows; r++)
            mlp_data(h->step, (int)mb * h->rows + r, in_dim, host_dims[host_nlayers],
                     x + r * in_dim, t);
    } else {
        if (!in || in->ndim != 2 || in->shape[0] != h->rows || in->shape[1] != in_dim)
            return 1;
        memcpy(x, in->data, sizeof(float) * (size_t)(h->rows * in_dim));
        for (int k = 0; k < 2; k++)
            if (h->step == (k ? h->nsteps - 1 : 0))
                memcpy(h->res->act_recv[k] + (size_t)mb * (size_t)(h->rows * in_dim), x,
                       sizeof(float) * (size_t)(h->rows * in_dim));
    }
    for (int l = h->l0; l < h->l1; l++)
        mlp_layer_forward(&h->layers[l], h->acts[mb][l - h->l0], h->rows,
                          h->acts[mb][l - h->l0 + 1]);
    int out_dim = host_dims[h->l1];
    float *y = h->acts[mb][h->l1 - h->l0];
    if (h->s + 1 == h->p) {
        float x0[16], t[16 * 8];
        for (int r = 0; r < h->rows; r++)
            mlp_data(h->step, (int)mb * h->rows + r, host_dims[0], out_dim, x0, t + r * out_dim);
        h->loss[mb] = mlp_mse_loss(y, t, h->rows, out_dim, HOST_BATCH, h->dy[mb]);
    } else {
        for (int k = 0; k < 2; k++)
            if (h->step == (k ? h->nsteps - 1 : 0))
                memcpy(h->res->act_sent[k] + (size_t)mb * (size_t)(h->rows * out_dim), y,
                       sizeof(float) * (size_t)(h->rows * out_dim));
        h->out = view2d(y, h->out_shape, h->rows, out_dim);
        *out = &h->out;
    }
    return 0;
}

static int loss(void *user, unsigned mb, double *value)
{
    struct host *h = user;
    *value = h->loss[mb];
    h->step_loss += h->loss[mb];
    return 0;
}

static int backward(void *user, unsigned mb, const DLTensor *gout, const DLTensor **gin)
{
    struct host *h = user;
    const float *dy;
    if (h->s + 1 == h->p) {
        dy = h->dy[mb];
    } else {
        if (!gout || gout->ndim != 2 || gout->shape[0] != h->rows ||
            gout->shape[1] != host_dims[h->l1])
            return 2;
        dy = gout->data;
    }
    for (int l = h->l1 - 1; l >= h->l0; l--) {
        float *dx = l == h->l0 ? (h->s ? h->dx : NULL) : h->gbuf[l % 2];
        mlp_layer_backward(&h->layers[l], h->acts[mb][l - h->l0], h->acts[mb][l - h->l0 + 1], dy,
                           h->rows, dx);
        dy = dx;
    }
    if (h->s > 0) {
        h->dxt = view2d(h->dx, h->dx_shape, h->rows, host_dims[h->l0]);
        *gin = &h->dxt;
    }
    return 0;
}

/* The op stream, driven the way a host with its own control flow would. */
static int step_op_stream(struct host *h)
{
    epipe_op op;
    int rc;
    for (;;) {
        if ((rc = epipe_stage_next_op(h->stage, &op)))
            return rc;
        if (op.kind == EPIPE_OP_NONE)
            return EPIPE_OK;
        unsigned mb = op.microbatch;
        const DLTensor *in = NULL, *out = NULL;
        if (op.kind == EPIPE_OP_FORWARD) {
            if (h->s > 0 && (rc = epipe_stage_recv_activation(h->stage, mb, &in)))
                return rc;
            if (forward(h, mb, in, &out))
                return EPIPE_ECALLBACK;
            if (h->s + 1 == h->p) {
                double v;
                loss(h, mb, &v);
            } else if ((rc = epipe_stage_send_activation(h->stage, mb, out))) {
                return rc;
            }
        } else {
            if (h->s + 1 < h->p && (rc = epipe_stage_recv_gradient(h->stage, mb, &in)))
                return rc;
            if (backward(h, mb, in, &out))
                return EPIPE_ECALLBACK;
            if (h->s > 0 && (rc = epipe_stage_send_gradient(h->stage, mb, out)))
                return rc;
        }
    }
}

void host_run(epipe_comm *comm, const struct host_config *cfg, struct host_result *res)
{
    struct host h = {0};
    memset(res, 0, sizeof *res);
    h.s = epipe_comm_rank(comm);
    h.p = epipe_comm_size(comm);
    h.m = cfg->microbatches;
    h.res = res;
    h.nsteps = cfg->steps;
    h.rows = HOST_BATCH / (int)h.m;
    host_partition(h.s, h.p, &h.l0, &h.l1);
    res->l0 = h.l0, res->l1 = h.l1;
    h.layers = res->layers;
    init_layers(h.layers, h.l0, h.l1);
    for (unsigned mb = 0; mb < h.m; mb++) {
        for (int k = 0; k <= h.l1 - h.l0; k++)
            h.acts[mb][k] = calloc((size_t)(h.rows * 16), sizeof(float));
        h.dy[mb] = calloc((size_t)(h.rows * 16), sizeof(float));
    }
    h.gbuf[0] = calloc((size_t)(h.rows * 16), sizeof(float));
    h.gbuf[1] = calloc((size_t)(h.rows * 16), sizeof(float));
    h.dx = calloc((size_t)(h.rows * 16), sizeof(float));

    int rc = epipe_stage_create(&h.stage, comm, cfg->schedule, h.m);
    if (rc == EPIPE_OK && cfg->act_codec)
        rc = epipe_stage_set_codec(h.stage, EPIPE_DIR_ACTIVATION, EPIPE_ALL_BOUNDARIES,
                                   cfg->act_codec);
    if (rc == EPIPE_OK && cfg->grad_codec)
        rc = epipe_stage_set_codec(h.stage, EPIPE_DIR_GRADIENT, EPIPE_ALL_BOUNDARIES,
                                   cfg->grad_codec);
    if (rc == EPIPE_OK)
        rc = epipe_stage_set_param(h.stage, EPIPE_STAGE_BATCH_SIZE, HOST_BATCH);
    epipe_stage_callbacks cb = EPIPE_STAGE_CALLBACKS_INIT;
    cb.user = &h;
    cb.forward = forward;
    cb.backward = backward;
    cb.loss = loss;
    if (rc == EPIPE_OK)
        rc = epipe_stage_set_callbacks(h.stage, &cb);
    for (int step = 0; rc == EPIPE_OK && step < cfg->steps; step++) {
        h.step = step;
        h.step_loss = 0;
        rc = cfg->use_op_stream ? step_op_stream(&h) : epipe_stage_step(h.stage);
        if (rc == EPIPE_OK && cfg->codec_lr > 0)
            rc = epipe_stage_codec_sgd_step(h.stage, cfg->codec_lr, cfg->codec_momentum);
        if (rc == EPIPE_OK) {
            for (int l = h.l0; l < h.l1; l++)
                mlp_layer_sgd(&h.layers[l], HOST_LR);
            if (step == 0)
                res->first_loss = h.step_loss;
            res->last_loss = h.step_loss;
        }
    }
    res->rc = rc;
    if (rc) {
        snprintf(res->error, sizeof res->error, "%s",
                 h.stage ? epipe_stage_last_error(h.stage) : epipe_last_error());
        epipe_comm_abort(comm);
    }
    res->stats.struct_size = sizeof res->stats;
    if (h.stage)
        epipe_stage_get_stats(h.stage, &res->stats);
    epipe_stage_destroy(h.stage);
    epipe_comm_destroy(comm);
    for (unsigned mb = 0; mb < h.m; mb++) {
        for (int k = 0; k <= h.l1 - h.l0; k++)
            free(h.acts[mb][k]);
        free(h.dy[mb]);
    }
    free(h.gbuf[0]), free(h.gbuf[1]), free(h.dx);
}

void host_result_free(struct host_result *res)
{
    for (int l = res->l0; l < res->l1; l++)
        mlp_layer_free(&res->layers[l]);
}

void host_reference(unsigned microbatches, int steps, mlp_layer *layers, double *first_loss,
                    double *last_loss)
{
    int rows = HOST_BATCH / (int)microbatches, out_dim = host_dims[host_nlayers];
    init_layers(layers, 0, host_nlayers);
    float act[HOST_MAX_LAYERS + 1][16 * 16], g[2][16 * 16], t[16 * 8], dy[16 * 8];
    for (int step = 0; step < steps; step++) {
        double total = 0;
        for (unsigned mb = 0; mb < microbatches; mb++) {
            for (int r = 0; r < rows; r++)
                mlp_data(step, (int)mb * rows + r, host_dims[0], out_dim, act[0] + r * host_dims[0],
                         t + r * out_dim);
            for (int l = 0; l < host_nlayers; l++)
                mlp_layer_forward(&layers[l], act[l], rows, act[l + 1]);
            total += mlp_mse_loss(act[host_nlayers], t, rows, out_dim, HOST_BATCH, dy);
            const float *d = dy;
            for (int l = host_nlayers - 1; l >= 0; l--) {
                float *dx = l ? g[l % 2] : NULL;
                mlp_layer_backward(&layers[l], act[l], act[l + 1], d, rows, dx);
                d = dx;
            }
        }
        for (int l = 0; l < host_nlayers; l++)
            mlp_layer_sgd(&layers[l], HOST_LR);
        if (step == 0)
            *first_loss = total;
        *last_loss = total;
    }
}
