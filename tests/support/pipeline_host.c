/* A pipeline host for the tests: one stage of the test MLP, driven by
 * callbacks or by the op stream, plus the single-process reference. */
#include "pipeline_host.h"

#include <math.h>
#include <pthread.h>
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

int host_create_stage(epipe_stage **out, epipe_comm *comm, const struct host_config *cfg)
{
    if (cfg->create)
        return cfg->create(out, comm, cfg);
    epipe_schedule_layout layout = EPIPE_SCHEDULE_LAYOUT_INIT;
    layout.chunks = cfg->chunks;
    layout.placement = cfg->placement;
    layout.placement_len = cfg->placement ? cfg->placement_len : 0;
    return epipe_stage_create_layout(out, comm, cfg->schedule, cfg->microbatches, &layout);
}

static void init_layers(mlp_layer *layers, int l0, int l1)
{
    for (int l = l0; l < l1; l++)
        mlp_layer_init(&layers[l], host_dims[l], host_dims[l + 1], l + 1 < host_nlayers,
                       (uint64_t)l + 1);
}

/* One of the rank's chunks: pipeline stage g, layers [l0, l1). */
struct hchunk {
    unsigned g;
    int l0, l1, first, last;
    /* acts[mb][k]: input of layer l0+k (k = 0) or output of layer l0+k-1 */
    float *acts[HOST_MAX_MB][HOST_MAX_LAYERS + 1];
    /* split backward: dys[mb][k], the gradient of the output of layer l0+k,
     * kept from the input-gradient op for the weight-gradient op */
    float *dys[HOST_MAX_MB][HOST_MAX_LAYERS];
    float *dy[HOST_MAX_MB]; /* last stage: gradient of the loss */
    double loss[HOST_MAX_MB];
    float *dx; /* gradient sent upstream */
    int64_t out_shape[2], dx_shape[2];
    DLTensor out, dxt;
};

#define HOST_MAX_CHUNKS 4
/* Weight versions kept for 1f1b-async and 1f1b-2bw (by version % this). */
#define HOST_STASH 16

/* One stashed version of this rank's weights (the owned layers'). */
struct stash {
    int set;
    uint64_t version;
    float *w[HOST_MAX_LAYERS], *b[HOST_MAX_LAYERS];
};

struct host {
    epipe_stage *stage;
    struct host_result *res;
    int nsteps;
    unsigned s, p, m, P, nch;
    int rows, step;
    mlp_layer *layers;
    struct hchunk ch[HOST_MAX_CHUNKS];
    float *gbuf[2]; /* backward scratch */
    double step_loss;
    /* Schedules without a flush: the weights' version (updates applied)
     * and the versions in-flight micro-batches still use. */
    int weights;
    uint64_t version;
    struct stash stash[HOST_STASH];
    /* host_config.before_call */
    const struct host_config *cfg;
    int in_step, started, hook_failed;
    uint64_t hook_serial;
    char hook_error[512];
};

static DLTensor view2d(float *data, int64_t *shape, int rows, int cols)
{
    shape[0] = rows, shape[1] = cols;
    DLTensor t = {
        .data = data, .device = {kDLCPU, 0}, .ndim = 2, .dtype = {kDLFloat, 32, 1}, .shape = shape};
    return t;
}

/* The chunk of the op in progress (callbacks and the op stream alike). */
static struct hchunk *current(struct host *h)
{
    epipe_op op;
    if (epipe_stage_current_op(h->stage, &op) || op.chunk >= h->nch)
        return NULL;
    return &h->ch[op.chunk];
}

/* ---- weight stashing (1f1b-async, 1f1b-2bw) ------------------------------ */

static int stash_copy(struct host *h, struct stash *st)
{
    for (int l = 0; l < host_nlayers; l++) {
        if (!h->res->owns[l])
            continue;
        mlp_layer *L = &h->layers[l];
        size_t nw = sizeof(float) * (size_t)(L->in * L->out), nb = sizeof(float) * (size_t)L->out;
        if (!st->w[l])
            st->w[l] = malloc(nw), st->b[l] = malloc(nb);
        if (!st->w[l] || !st->b[l])
            return -1;
        memcpy(st->w[l], L->w, nw);
        memcpy(st->b[l], L->b, nb);
    }
    return 0;
}

/* Swaps the current weights with stashed version v (twice: back again). */
static void stash_swap(struct host *h, struct stash *st)
{
    for (int l = 0; l < host_nlayers; l++) {
        if (!h->res->owns[l])
            continue;
        float *w = h->layers[l].w, *b = h->layers[l].b;
        h->layers[l].w = st->w[l], h->layers[l].b = st->b[l];
        st->w[l] = w, st->b[l] = b;
    }
}

/* The forward of a schedule without a flush must use the current weights;
 * they are kept as that version for its backward. 0, or 4. */
static int stash_forward(struct host *h)
{
    epipe_op op;
    if (!h->weights)
        return 0;
    if (epipe_stage_current_op(h->stage, &op) || op.weight_version != (uint32_t)h->version)
        return 4;
    struct stash *st = &h->stash[h->version % HOST_STASH];
    if (!st->set || st->version != h->version) {
        if (stash_copy(h, st))
            return 4;
        st->set = 1, st->version = h->version;
    }
    return 0;
}

/* The stashed version a backward must use, or NULL for the current
 * weights; *bad when the version is unknown. */
static struct stash *stash_backward(struct host *h, int *bad)
{
    epipe_op op;
    *bad = 0;
    if (!h->weights)
        return NULL;
    if (epipe_stage_current_op(h->stage, &op)) {
        *bad = 1;
        return NULL;
    }
    if (op.weight_version == (uint32_t)h->version)
        return NULL;
    struct stash *st = &h->stash[op.weight_version % HOST_STASH];
    *bad = !st->set || (uint32_t)st->version != op.weight_version;
    return *bad ? NULL : st;
}

static void host_sgd(struct host *h)
{
    for (int l = 0; l < host_nlayers; l++)
        if (h->res->owns[l])
            mlp_layer_sgd(&h->layers[l], HOST_LR);
    h->version++;
}

static int forward(void *user, unsigned mb, const DLTensor *in, const DLTensor **out)
{
    struct host *h = user;
    struct hchunk *c = current(h);
    if (!c)
        return 3;
    if (stash_forward(h))
        return 4;
    int in_dim = host_dims[c->l0];
    float *x = c->acts[mb][0];
    if (c->first) {
        float t[16];
        for (int r = 0; r < h->rows; r++)
            mlp_data(h->step, (int)mb * h->rows + r, in_dim, host_dims[host_nlayers],
                     x + r * in_dim, t);
    } else {
        if (!in || in->ndim != 2 || in->shape[0] != h->rows || in->shape[1] != in_dim)
            return 1;
        memcpy(x, in->data, sizeof(float) * (size_t)(h->rows * in_dim));
        for (int k = 0; k < 2 && h->nch == 1; k++)
            if (h->step == (k ? h->nsteps - 1 : 0))
                memcpy(h->res->act_recv[k] + (size_t)mb * (size_t)(h->rows * in_dim), x,
                       sizeof(float) * (size_t)(h->rows * in_dim));
    }
    for (int l = c->l0; l < c->l1; l++)
        mlp_layer_forward(&h->layers[l], c->acts[mb][l - c->l0], h->rows,
                          c->acts[mb][l - c->l0 + 1]);
    int out_dim = host_dims[c->l1];
    float *y = c->acts[mb][c->l1 - c->l0];
    if (c->last) {
        float x0[16], t[16 * 8];
        for (int r = 0; r < h->rows; r++)
            mlp_data(h->step, (int)mb * h->rows + r, host_dims[0], out_dim, x0, t + r * out_dim);
        c->loss[mb] = mlp_mse_loss(y, t, h->rows, out_dim, HOST_BATCH, c->dy[mb]);
    } else {
        for (int k = 0; k < 2 && h->nch == 1; k++)
            if (h->step == (k ? h->nsteps - 1 : 0))
                memcpy(h->res->act_sent[k] + (size_t)mb * (size_t)(h->rows * out_dim), y,
                       sizeof(float) * (size_t)(h->rows * out_dim));
        c->out = view2d(y, c->out_shape, h->rows, out_dim);
        *out = &c->out;
    }
    return 0;
}

static int loss(void *user, unsigned mb, double *value)
{
    struct host *h = user;
    struct hchunk *c = current(h);
    if (!c || !c->last)
        return 3;
    *value = c->loss[mb];
    h->step_loss += c->loss[mb];
    return 0;
}

/* The gradient of the chunk's output for mb: the loss's on the last stage. */
static const float *output_gradient(struct host *h, struct hchunk *c, unsigned mb,
                                    const DLTensor *gout)
{
    if (c->last)
        return c->dy[mb];
    if (!gout || gout->ndim != 2 || gout->shape[0] != h->rows || gout->shape[1] != host_dims[c->l1])
        return NULL;
    return gout->data;
}

/* Whole backward (split = 0), or the input-gradient part only (split = 1:
 * each layer's output gradient is kept for backward_weight). */
static int backward_common(struct host *h, unsigned mb, const DLTensor *gout, const DLTensor **gin,
                           int split)
{
    struct hchunk *c = current(h);
    if (!c)
        return 3;
    const float *dy = output_gradient(h, c, mb, gout);
    if (!dy)
        return 2;
    for (int l = c->l1 - 1; l >= c->l0; l--) {
        size_t n = (size_t)(h->rows * host_dims[l + 1]);
        float *dx = l == c->l0 ? (c->first ? NULL : c->dx) : h->gbuf[l % 2];
        const float *x = c->acts[mb][l - c->l0], *y = c->acts[mb][l - c->l0 + 1];
        if (split) {
            memcpy(c->dys[mb][l - c->l0], dy, sizeof(float) * n);
            if (dx)
                mlp_layer_backward_input(&h->layers[l], y, dy, h->rows, dx);
        } else {
            mlp_layer_backward(&h->layers[l], x, y, dy, h->rows, dx);
        }
        dy = dx;
    }
    if (!c->first) {
        if (c->l0 == c->l1) /* a chunk without layers passes the gradient on */
            memcpy(c->dx, dy, sizeof(float) * (size_t)(h->rows * host_dims[c->l0]));
        c->dxt = view2d(c->dx, c->dx_shape, h->rows, host_dims[c->l0]);
        *gin = &c->dxt;
    }
    return 0;
}

static int backward(void *user, unsigned mb, const DLTensor *gout, const DLTensor **gin)
{
    struct host *h = user;
    int bad;
    struct stash *st = stash_backward(h, &bad);
    if (bad)
        return 5;
    if (st)
        stash_swap(h, st);
    int rc = backward_common(user, mb, gout, gin, 0);
    if (st)
        stash_swap(h, st);
    /* 1f1b-async: PipeDream's update after every backward */
    if (rc == 0 && h->weights == EPIPE_WEIGHTS_STASHED)
        host_sgd(h);
    return rc;
}

static int backward_input(void *user, unsigned mb, const DLTensor *gout, const DLTensor **gin)
{
    return backward_common(user, mb, gout, gin, 1);
}

static int backward_weight(void *user, unsigned mb)
{
    struct host *h = user;
    struct hchunk *c = current(h);
    if (!c)
        return 3;
    for (int l = c->l0; l < c->l1; l++)
        mlp_layer_backward_weight(&h->layers[l], c->acts[mb][l - c->l0], c->acts[mb][l - c->l0 + 1],
                                  c->dys[mb][l - c->l0], h->rows);
    return 0;
}

/* Runs host_config.before_call, if any, before a call on the stage. */
static int hook(struct host *h, enum host_call_kind kind, unsigned mb, const DLTensor *t)
{
    if (!h->cfg->before_call)
        return 0;
    struct host_call call = {.stage = h->stage,
                             .kind = kind,
                             .microbatch = mb,
                             .tensor = t,
                             .microbatches = h->m,
                             .rank = h->s,
                             .in_step = h->in_step,
                             .started = h->started,
                             .serial = h->hook_serial++,
                             .arg = h->cfg->hook_arg};
    if (!h->cfg->before_call(&call))
        return 0;
    h->hook_failed = 1;
    snprintf(h->hook_error, sizeof h->hook_error, "%s", call.error);
    return EPIPE_EINTERNAL;
}

/* The callbacks as the stage sees them when a hook is set: the hook runs
 * inside each, before the host's own. */
static int hooked_forward(void *user, unsigned mb, const DLTensor *in, const DLTensor **out)
{
    return hook(user, HOST_IN_CALLBACK, mb, NULL) ? 9 : forward(user, mb, in, out);
}

static int hooked_loss(void *user, unsigned mb, double *value)
{
    return hook(user, HOST_IN_CALLBACK, mb, NULL) ? 9 : loss(user, mb, value);
}

static int hooked_backward(void *user, unsigned mb, const DLTensor *gout, const DLTensor **gin)
{
    return hook(user, HOST_IN_CALLBACK, mb, NULL) ? 9 : backward(user, mb, gout, gin);
}

static int hooked_backward_input(void *user, unsigned mb, const DLTensor *gout,
                                 const DLTensor **gin)
{
    return hook(user, HOST_IN_CALLBACK, mb, NULL) ? 9 : backward_input(user, mb, gout, gin);
}

static int hooked_backward_weight(void *user, unsigned mb)
{
    return hook(user, HOST_IN_CALLBACK, mb, NULL) ? 9 : backward_weight(user, mb);
}

/* The op stream, driven the way a host with its own control flow would. */
static int step_op_stream(struct host *h, int split)
{
    epipe_op op;
    int rc;
    for (;;) {
        if ((rc = hook(h, HOST_NEXT_OP, 0, NULL)) || (rc = epipe_stage_next_op(h->stage, &op)))
            return rc;
        h->started = 1;
        h->in_step = op.kind != EPIPE_OP_NONE;
        if (op.kind == EPIPE_OP_NONE)
            return EPIPE_OK;
        unsigned mb = op.microbatch;
        const struct hchunk *c = &h->ch[op.chunk];
        const DLTensor *in = NULL, *out = NULL;
        if (op.kind == EPIPE_OP_FORWARD) {
            if (!c->first && ((rc = hook(h, HOST_RECV_ACTIVATION, mb, NULL)) ||
                              (rc = epipe_stage_recv_activation(h->stage, mb, &in))))
                return rc;
            if (forward(h, mb, in, &out))
                return EPIPE_ECALLBACK;
            if (c->last) {
                double v;
                loss(h, mb, &v);
            } else if ((rc = hook(h, HOST_SEND_ACTIVATION, mb, out)) ||
                       (rc = epipe_stage_send_activation(h->stage, mb, out))) {
                return rc;
            }
        } else if (op.kind == EPIPE_OP_BACKWARD_WEIGHT) {
            if (split && backward_weight(h, mb))
                return EPIPE_ECALLBACK;
        } else {
            if (!c->last && ((rc = hook(h, HOST_RECV_GRADIENT, mb, NULL)) ||
                             (rc = epipe_stage_recv_gradient(h->stage, mb, &in))))
                return rc;
            int input_only = split && op.kind == EPIPE_OP_BACKWARD_INPUT;
            if (input_only ? backward_common(h, mb, in, &out, 1) : backward(h, mb, in, &out))
                return EPIPE_ECALLBACK;
            if (!c->first && ((rc = hook(h, HOST_SEND_GRADIENT, mb, out)) ||
                              (rc = epipe_stage_send_gradient(h->stage, mb, out))))
                return rc;
        }
    }
}

static int setup_chunks(struct host *h)
{
    h->nch = epipe_stage_chunks(h->stage);
    if (h->nch > HOST_MAX_CHUNKS)
        return EPIPE_EINVAL;
    for (unsigned k = 0; k < h->nch; k++) {
        struct hchunk *c = &h->ch[k];
        int rc = epipe_stage_chunk_stage(h->stage, k, &c->g, &h->P);
        if (rc)
            return rc;
        host_partition(c->g, h->P, &c->l0, &c->l1);
        c->first = c->g == 0;
        c->last = c->g + 1 == h->P;
        h->res->holds_last |= c->last;
        init_layers(h->layers, c->l0, c->l1);
        for (int l = c->l0; l < c->l1; l++)
            h->res->owns[l] = 1;
        size_t n = (size_t)(h->rows * 16);
        for (unsigned mb = 0; mb < h->m; mb++) {
            for (int i = 0; i <= c->l1 - c->l0; i++)
                c->acts[mb][i] = calloc(n, sizeof(float));
            for (int i = 0; i < c->l1 - c->l0; i++)
                c->dys[mb][i] = calloc(n, sizeof(float));
            c->dy[mb] = calloc(n, sizeof(float));
        }
        c->dx = calloc(n, sizeof(float));
    }
    h->res->l0 = h->ch[0].l0, h->res->l1 = h->ch[0].l1;
    return EPIPE_OK;
}

static void free_chunks(struct host *h)
{
    for (unsigned k = 0; k < h->nch; k++) {
        struct hchunk *c = &h->ch[k];
        for (unsigned mb = 0; mb < h->m; mb++) {
            for (int i = 0; i <= c->l1 - c->l0; i++)
                free(c->acts[mb][i]);
            for (int i = 0; i < c->l1 - c->l0; i++)
                free(c->dys[mb][i]);
            free(c->dy[mb]);
        }
        free(c->dx);
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
    h.layers = res->layers;
    h.cfg = cfg;
    h.gbuf[0] = calloc((size_t)(h.rows * 16), sizeof(float));
    h.gbuf[1] = calloc((size_t)(h.rows * 16), sizeof(float));

    int rc = host_create_stage(&h.stage, comm, cfg);
    if (rc == EPIPE_OK)
        rc = setup_chunks(&h);
    unsigned boundary = cfg->one_boundary ? cfg->boundary : EPIPE_ALL_BOUNDARIES;
    if (rc == EPIPE_OK && cfg->act_codec)
        rc = epipe_stage_set_codec(h.stage, EPIPE_DIR_ACTIVATION, boundary, cfg->act_codec);
    if (rc == EPIPE_OK && cfg->grad_codec)
        rc = epipe_stage_set_codec(h.stage, EPIPE_DIR_GRADIENT, boundary, cfg->grad_codec);
    if (rc == EPIPE_OK)
        rc = epipe_stage_set_param(h.stage, EPIPE_STAGE_BATCH_SIZE, HOST_BATCH);
    epipe_stage_callbacks cb = EPIPE_STAGE_CALLBACKS_INIT;
    cb.user = &h;
    int hooked = cfg->before_call != NULL;
    cb.forward = hooked ? hooked_forward : forward;
    cb.loss = hooked ? hooked_loss : loss;
    if (cfg->split) {
        cb.backward_input = hooked ? hooked_backward_input : backward_input;
        cb.backward_weight = hooked ? hooked_backward_weight : backward_weight;
    } else {
        cb.backward = hooked ? hooked_backward : backward;
    }
    /* the op-stream host calls its functions itself (and so runs the drain
     * through the op stream too) */
    if (rc == EPIPE_OK && !cfg->use_op_stream)
        rc = epipe_stage_set_callbacks(h.stage, &cb);
    if (rc == EPIPE_OK)
        h.weights = epipe_schedule_weights(epipe_stage_schedule(h.stage));
    for (int step = 0; rc == EPIPE_OK && step < cfg->steps; step++) {
        h.step = step;
        h.step_loss = 0;
        if (!cfg->use_op_stream)
            h.started = h.in_step = 1; /* for the hook, inside the callbacks */
        rc = cfg->use_op_stream ? step_op_stream(&h, cfg->split) : epipe_stage_step(h.stage);
        if (rc == EPIPE_OK && cfg->codec_lr > 0)
            rc = epipe_stage_codec_sgd_step(h.stage, cfg->codec_lr, cfg->codec_momentum);
        if (rc == EPIPE_OK) {
            /* 1f1b-async updated after each backward already */
            if (h.weights != EPIPE_WEIGHTS_STASHED)
                host_sgd(&h);
            if (step == 0)
                res->first_loss = h.step_loss;
            res->last_loss = h.step_loss;
        }
    }
    /* The backwards still in flight (schedules without a flush), and for
     * 1f1b-2bw the update after them. */
    if (rc == EPIPE_OK && h.weights) {
        rc = epipe_stage_drain(h.stage);
        if (rc == EPIPE_OK && cfg->use_op_stream)
            rc = step_op_stream(&h, cfg->split);
        if (rc == EPIPE_OK && h.weights == EPIPE_WEIGHTS_DOUBLE)
            host_sgd(&h);
    }
    res->rc = rc;
    if (rc) {
        snprintf(res->error, sizeof res->error, "%s",
                 h.hook_failed ? h.hook_error
                 : h.stage     ? epipe_stage_last_error(h.stage)
                               : epipe_last_error());
        epipe_comm_abort(comm);
    }
    res->stats.struct_size = sizeof res->stats;
    if (h.stage)
        epipe_stage_get_stats(h.stage, &res->stats);
    epipe_stage_destroy(h.stage);
    epipe_comm_destroy(comm);
    free_chunks(&h);
    free(h.gbuf[0]), free(h.gbuf[1]);
    for (int i = 0; i < HOST_STASH; i++)
        for (int l = 0; l < HOST_MAX_LAYERS; l++)
            free(h.stash[i].w[l]), free(h.stash[i].b[l]);
}

void *host_rank_thread(void *p)
{
    struct host_rank *a = p;
    host_run(a->comm, &a->cfg, &a->res);
    return NULL;
}

int host_run_threads(unsigned p, const struct host_config *cfg, struct host_rank *a)
{
    epipe_comm *c[HOST_RAW_MAX_RANKS];
    pthread_t tid[HOST_RAW_MAX_RANKS];
    if (p > HOST_RAW_MAX_RANKS || epipe_comm_create_inproc(c, p) != EPIPE_OK)
        return -1;
    unsigned made = 0;
    for (; made < p; made++) {
        memset(&a[made], 0, sizeof a[made]);
        a[made].comm = c[made];
        a[made].cfg = *cfg;
        if (pthread_create(&tid[made], NULL, host_rank_thread, &a[made]))
            break;
    }
    if (made < p) /* the ranks that run give up at their first receive */
        for (unsigned r = made; r < p; r++)
            epipe_comm_abort(c[r]), epipe_comm_destroy(c[r]);
    for (unsigned r = 0; r < made; r++)
        pthread_join(tid[r], NULL);
    return made == p ? 0 : -1;
}

double host_rel_diff(float a, float b)
{
    double d = fabs((double)a - (double)b), m = fmax(fabs((double)a), fabs((double)b));
    return m > 1e-30 ? d / m : d;
}

void host_result_free(struct host_result *res)
{
    for (int l = 0; l < host_nlayers; l++)
        if (res->owns[l])
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

/* Layers [l0, l1) of a stage as weight version v of a small ring. */
#define REF_RING 8
struct ref_stage {
    int l0, l1, w; /* layers, warm-up forwards (stages - s - 1) */
    uint64_t version;
    float *ring_w[REF_RING][HOST_MAX_LAYERS], *ring_b[REF_RING][HOST_MAX_LAYERS];
    float *acc_w[2][HOST_MAX_LAYERS], *acc_b[2][HOST_MAX_LAYERS]; /* 2bw: per list */
};

static void ref_keep(struct ref_stage *rs, const mlp_layer *layers)
{
    unsigned k = (unsigned)(rs->version % REF_RING);
    for (int l = rs->l0; l < rs->l1; l++) {
        memcpy(rs->ring_w[k][l], layers[l].w,
               sizeof(float) * (size_t)(layers[l].in * layers[l].out));
        memcpy(rs->ring_b[k][l], layers[l].b, sizeof(float) * (size_t)layers[l].out);
    }
}

/* Points the stage's layers at version v's weights (or back at the
 * current ones, with cur): a swap of pointers, undone by a second call. */
static void ref_swap(struct ref_stage *rs, mlp_layer *layers, uint64_t v)
{
    if (v == rs->version)
        return;
    unsigned k = (unsigned)(v % REF_RING);
    for (int l = rs->l0; l < rs->l1; l++) {
        float *w = layers[l].w, *b = layers[l].b;
        layers[l].w = rs->ring_w[k][l], layers[l].b = rs->ring_b[k][l];
        rs->ring_w[k][l] = w, rs->ring_b[k][l] = b;
    }
}

static void ref_update(struct ref_stage *rs, mlp_layer *layers)
{
    for (int l = rs->l0; l < rs->l1; l++)
        mlp_layer_sgd(&layers[l], HOST_LR);
    rs->version++;
    ref_keep(rs, layers);
}

/* 2bw: exchanges the layers' gradient buffers with list k's accumulators
 * (a second call exchanges them back). */
static void ref_swap_acc(struct ref_stage *q, mlp_layer *layers, unsigned k)
{
    for (int l = q->l0; l < q->l1; l++) {
        float *w = layers[l].gw, *b = layers[l].gb;
        layers[l].gw = q->acc_w[k % 2][l], layers[l].gb = q->acc_b[k % 2][l];
        q->acc_w[k % 2][l] = w, q->acc_b[k % 2][l] = b;
    }
}

/* 2bw: list k's update, from its accumulated gradients. */
static void ref_update_list(struct ref_stage *q, mlp_layer *layers, unsigned k)
{
    ref_swap_acc(q, layers, k);
    ref_update(q, layers);
    ref_swap_acc(q, layers, k);
}

void host_reference_async(int weights, unsigned stages, unsigned microbatches, int steps,
                          mlp_layer *layers, double *first_loss, double *last_loss)
{
    int rows = HOST_BATCH / (int)microbatches, out_dim = host_dims[host_nlayers];
    unsigned m = microbatches, P = stages;
    init_layers(layers, 0, host_nlayers);
    struct ref_stage rs[HOST_RAW_MAX_STAGES];
    memset(rs, 0, sizeof rs);
    for (unsigned s = 0; s < P; s++) {
        host_partition(s, P, &rs[s].l0, &rs[s].l1);
        rs[s].w = (int)(P - s - 1);
        for (int l = rs[s].l0; l < rs[s].l1; l++) {
            size_t nw = (size_t)(layers[l].in * layers[l].out), nb = (size_t)layers[l].out;
            for (int k = 0; k < REF_RING; k++)
                rs[s].ring_w[k][l] = malloc(sizeof(float) * nw),
                rs[s].ring_b[k][l] = malloc(sizeof(float) * nb);
            for (int k = 0; k < 2; k++)
                rs[s].acc_w[k][l] = calloc(nw, sizeof(float)),
                rs[s].acc_b[k][l] = calloc(nb, sizeof(float));
        }
        ref_keep(&rs[s], layers);
    }
    float act[HOST_MAX_LAYERS + 1][16 * 16], g[2][16 * 16], t[16 * 8], dy[16 * 8];
    uint64_t fv[HOST_RAW_MAX_STAGES];
    double total = 0;
    for (uint64_t gm = 0; gm < (uint64_t)steps * m; gm++) {
        int step = (int)(gm / m);
        unsigned j = (unsigned)(gm % m);
        for (int r = 0; r < rows; r++)
            mlp_data(step, (int)j * rows + r, host_dims[0], out_dim, act[0] + r * host_dims[0],
                     t + r * out_dim);
        for (unsigned s = 0; s < P; s++) {
            /* async: one update per backward before this forward in the
             * stage's stream; 2bw: one per earlier step */
            uint64_t v = weights == EPIPE_WEIGHTS_STASHED
                             ? (gm >= (uint64_t)rs[s].w ? gm - (uint64_t)rs[s].w : 0)
                             : (uint64_t)step;
            fv[s] = v;
            ref_swap(&rs[s], layers, v);
            for (int l = rs[s].l0; l < rs[s].l1; l++)
                mlp_layer_forward(&layers[l], act[l], rows, act[l + 1]);
            ref_swap(&rs[s], layers, v);
        }
        total += mlp_mse_loss(act[host_nlayers], t, rows, out_dim, HOST_BATCH, dy);
        const float *d = dy;
        for (unsigned s = P; s-- > 0;) {
            struct ref_stage *q = &rs[s];
            /* 2bw: the list this backward runs in, and its accumulator */
            unsigned list = (unsigned)step + (j >= m - (unsigned)q->w);
            if (weights == EPIPE_WEIGHTS_DOUBLE)
                ref_swap_acc(q, layers, list);
            ref_swap(q, layers, fv[s]);
            for (int l = q->l1 - 1; l >= q->l0; l--) {
                float *dx = l ? g[l % 2] : NULL;
                mlp_layer_backward(&layers[l], act[l], act[l + 1], d, rows, dx);
                d = dx;
            }
            ref_swap(q, layers, fv[s]);
            if (weights == EPIPE_WEIGHTS_DOUBLE)
                ref_swap_acc(q, layers, list); /* the accumulators back */
            if (weights == EPIPE_WEIGHTS_STASHED)
                ref_update(q, layers);
            else if (j == m - (unsigned)q->w - 1) /* the last backward of list `step` */
                ref_update_list(q, layers, (unsigned)step);
        }
        if (j == m - 1) {
            if (step == 0)
                *first_loss = total;
            *last_loss = total;
            total = 0;
        }
    }
    /* 2bw: the update after the drain (the last step's tail) */
    for (unsigned s = 0; weights == EPIPE_WEIGHTS_DOUBLE && s < P; s++)
        ref_update_list(&rs[s], layers, (unsigned)steps);
    for (unsigned s = 0; s < P; s++)
        for (int l = rs[s].l0; l < rs[s].l1; l++) {
            for (int k = 0; k < REF_RING; k++)
                free(rs[s].ring_w[k][l]), free(rs[s].ring_b[k][l]);
            for (int k = 0; k < 2; k++)
                free(rs[s].acc_w[k][l]), free(rs[s].acc_b[k][l]);
        }
}
