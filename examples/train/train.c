/* epipe-train: trains a dense network on Fashion-MNIST split into pipeline
 * stages with libepipe. Stages run as threads of this process, or as
 * separate processes over TCP when started by a launcher (epipe-run, mpirun,
 * srun, torchrun-style variables). */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <epipe/epipe.h>

#include "../common/idx.h"
#include "cli.h" /* tools/cli.h */
#include "model.h"
#include "options.h"
#include "plan_auto.h"
#include "plan_file.h"

struct dataset {
    float *train_x, *test_x;
    uint8_t *train_y, *test_y;
    uint32_t ntrain, ntest, pixels;
};

/* What one rank reports at the end. */
struct rank_result {
    int rc;
    char error[300];
    epipe_stage_stats stats;
    double accuracy, final_loss, seconds, samples_per_s;
    int holds_last; /* this rank holds the last pipeline stage (loss, accuracy) */
};

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---- one rank ------------------------------------------------------------ */

/* Fashion-MNIST's classes: the network's outputs, and the bound on a label. */
#define CLASSES 10

/* The network's widths dims[0..n] (input, hidden..., classes); returns its
 * layer count n. dims has room for MODEL_MAX_LAYERS + 2. */
static int model_widths(const struct options *o, const struct dataset *d, int *dims)
{
    dims[0] = (int)d->pixels;
    for (int i = 0; i < o->nhidden; i++)
        dims[i + 1] = o->hidden[i];
    dims[o->nhidden + 1] = CLASSES;
    return o->nhidden + 1;
}

#define MAX_CHUNKS 8

/* Weight versions a chunk can keep for 1f1b-async and 1f1b-2bw. A rank
 * keeps those of epipe_schedule_weight_versions() at once, a contiguous
 * run below the current one, so slot = version modulo that count. */
#define STASH 16

/* One of the rank's chunks: pipeline stage g, layers [l0, l1). */
struct chunk {
    unsigned g;
    int l0, l1, first, last;
    stage_model model;
    int64_t out_shape[2], dx_shape[2];
    DLTensor out, dx;
    /* Schedules without a flush: the weights' version (updates applied)
     * and the versions kept for in-flight micro-batches' backwards. */
    uint64_t version;
    weight_stash stash[STASH];
};

struct rank {
    const struct options *o;
    const struct dataset *d;
    epipe_stage *stage;
    int weights;     /* epipe_weight_mode of the schedule */
    unsigned nstash; /* weight versions kept at once (slots used) */
    unsigned s, p, P, nch;
    int dims[MODEL_MAX_LAYERS + 2], nlayers, rows;
    struct chunk ch[MAX_CHUNKS];
    int has_first, has_last;
    const float *x;        /* rows of the current batch (stage 0) */
    const uint8_t *y;      /* labels of the current batch (last stage) */
    const uint32_t *order; /* sample indices of the current epoch */
    long batch_start;
    float *xbuf;
    uint8_t ybuf[MODEL_MAX_MB * 1024];
    float *dlogits[MODEL_MAX_MB];
    double loss;
    int correct;
    char err[200]; /* this program's own error, if any */
};

/* The chunk of the op in progress. */
static struct chunk *current(struct rank *r)
{
    epipe_op op;
    if (epipe_stage_current_op(r->stage, &op) || op.chunk >= r->nch)
        return NULL;
    return &r->ch[op.chunk];
}

/* ---- weight stashing (1f1b-async, 1f1b-2bw) ------------------------------ */

/* A forward uses the current weights: they are kept as their version for
 * the micro-batch's backward. 0, or nonzero (r->err says why). */
static int stash_forward(struct rank *r, struct chunk *c)
{
    epipe_op op;
    if (!r->weights)
        return 0;
    if (epipe_stage_current_op(r->stage, &op) || op.weight_version != (uint32_t)c->version) {
        snprintf(r->err, sizeof r->err, "a forward wants weight version %u; the chunk has %llu",
                 op.weight_version, (unsigned long long)c->version);
        return 4;
    }
    weight_stash *st = &c->stash[c->version % r->nstash];
    if (st->set && st->version == c->version)
        return 0;
    if (model_stash_keep(&c->model, st, c->version)) {
        snprintf(r->err, sizeof r->err, "out of memory for a weight version");
        return 4;
    }
    return 0;
}

/* Swaps the chunk's weights with the stashed version of the backward in
 * progress, if it is not the current one (a second call swaps back). */
static int stash_swap(struct rank *r, struct chunk *c)
{
    epipe_op op;
    if (!r->weights)
        return 0;
    if (epipe_stage_current_op(r->stage, &op))
        return 4;
    if (op.weight_version == (uint32_t)c->version)
        return 0;
    weight_stash *st = &c->stash[op.weight_version % r->nstash];
    if (!st->set || (uint32_t)st->version != op.weight_version) {
        snprintf(r->err, sizeof r->err, "a backward wants weight version %u, which was not kept",
                 op.weight_version);
        return 4;
    }
    model_stash_swap(&c->model, st);
    return 0;
}

static void chunk_sgd(struct rank *r, struct chunk *c)
{
    model_sgd(&c->model, r->o->lr, r->o->momentum);
    c->version++;
}

static int cb_forward(void *user, unsigned mb, const DLTensor *in, const DLTensor **out)
{
    struct rank *r = user;
    struct chunk *c = current(r);
    if (!c)
        return 3;
    if (stash_forward(r, c))
        return 4;
    int rows = r->rows, in_dim = r->dims[c->l0];
    const float *x;
    if (c->first) {
        x = r->xbuf + (size_t)mb * rows * in_dim;
    } else {
        if (in->ndim != 2 || in->shape[0] != rows || in->shape[1] != in_dim)
            return 1;
        x = in->data;
    }
    const float *y = model_forward(&c->model, (int)mb, x, rows);
    int out_dim = r->dims[c->l1];
    if (c->last) {
        r->loss += softmax_xent(y, r->ybuf + (size_t)mb * rows, rows, out_dim, r->o->batch,
                                r->dlogits[mb], &r->correct);
        return 0;
    }
    c->out_shape[0] = rows, c->out_shape[1] = out_dim;
    c->out = (DLTensor){.data = (void *)y,
                        .device = {kDLCPU, 0},
                        .ndim = 2,
                        .dtype = {kDLFloat, 32, 1},
                        .shape = c->out_shape};
    *out = &c->out;
    return 0;
}

/* The whole backward, or (split) its input-gradient part. */
static int backward_common(struct rank *r, unsigned mb, const DLTensor *gout, const DLTensor **gin,
                           int split)
{
    struct chunk *c = current(r);
    if (!c)
        return 3;
    const float *dy = c->last ? r->dlogits[mb] : gout->data;
    const float *dx = split ? model_backward_input(&c->model, (int)mb, dy, r->rows, !c->first)
                            : model_backward(&c->model, (int)mb, dy, r->rows, !c->first);
    if (!c->first) {
        c->dx_shape[0] = r->rows, c->dx_shape[1] = r->dims[c->l0];
        c->dx = (DLTensor){.data = (void *)dx,
                           .device = {kDLCPU, 0},
                           .ndim = 2,
                           .dtype = {kDLFloat, 32, 1},
                           .shape = c->dx_shape};
        *gin = &c->dx;
    }
    return 0;
}

static int cb_backward(void *user, unsigned mb, const DLTensor *gout, const DLTensor **gin)
{
    struct rank *r = user;
    struct chunk *c = current(r);
    if (!c || stash_swap(r, c))
        return 4;
    int rc = backward_common(user, mb, gout, gin, 0);
    stash_swap(r, c);
    /* 1f1b-async: PipeDream's update after every backward */
    if (rc == 0 && r->weights == EPIPE_WEIGHTS_STASHED)
        chunk_sgd(r, c);
    return rc;
}

static int cb_backward_input(void *user, unsigned mb, const DLTensor *gout, const DLTensor **gin)
{
    return backward_common(user, mb, gout, gin, 1);
}

static int cb_backward_weight(void *user, unsigned mb)
{
    struct rank *r = user;
    struct chunk *c = current(r);
    if (!c)
        return 3;
    model_backward_weight(&c->model, (int)mb, r->rows);
    return 0;
}

/* Creates the stage with the schedule, chunks and placement of the options. */
static int create_stage(struct rank *r, epipe_comm *comm)
{
    const struct options *o = r->o;
    epipe_schedule_layout layout = EPIPE_SCHEDULE_LAYOUT_INIT;
    layout.chunks = o->chunks;
    if (o->nplace) {
        layout.placement = o->placement;
        layout.placement_len = o->nplace;
    }
    int rc = epipe_stage_create_layout(&r->stage, comm, o->schedule, o->microbatches, &layout);
    if (rc)
        return rc;
    const epipe_schedule *sc = epipe_stage_schedule(r->stage);
    r->P = epipe_schedule_pipeline_stages(sc);
    r->nch = epipe_schedule_chunks(sc, r->s);
    if ((int)r->P > r->nlayers || r->nch > MAX_CHUNKS) {
        snprintf(r->err, sizeof r->err,
                 "%u pipeline stages need at least as many layers; the model has %d (widen "
                 "--hidden)%s",
                 r->P, r->nlayers,
                 r->nch > MAX_CHUNKS ? ", and a rank holds at most 8 chunks" : "");
        return EPIPE_EINVAL;
    }
    int split = epipe_schedule_splits_backward(sc) == 1;
    for (unsigned k = 0; k < r->nch; k++) {
        struct chunk *c = &r->ch[k];
        if ((rc = epipe_schedule_stage_of(sc, r->s, k, &c->g)))
            return rc;
        if (o->layout) { /* the plan's split (main checked its counts) */
            c->l0 = (int)o->layout->first[c->g];
            c->l1 = (int)o->layout->first[c->g + 1];
        } else { /* layers shared out evenly */
            c->l0 = (int)(c->g * (unsigned)r->nlayers / r->P);
            c->l1 = (int)((c->g + 1) * (unsigned)r->nlayers / r->P);
        }
        c->first = c->g == 0;
        c->last = c->g + 1 == r->P;
        r->has_first |= c->first;
        r->has_last |= c->last;
        if (model_init(&c->model, r->dims, r->nlayers, c->l0, c->l1, r->rows, (int)o->microbatches,
                       o->seed) ||
            (split && model_enable_split(&c->model))) {
            snprintf(r->err, sizeof r->err, "out of memory for layers %d to %d of the model",
                     c->l0 + 1, c->l1);
            return EPIPE_ENOMEM;
        }
    }
    return EPIPE_OK;
}

/* Gathers the batch's inputs (stage 0) and labels (last stage). */
static void load_batch(struct rank *r, const float *xs, const uint8_t *ys, const uint32_t *order,
                       long start)
{
    int in_dim = r->dims[0], n = r->o->batch;
    for (int i = 0; i < n; i++) {
        uint32_t k = order ? order[start + i] : (uint32_t)(start + i);
        if (r->has_first)
            memcpy(r->xbuf + (size_t)i * in_dim, xs + (size_t)k * in_dim, sizeof(float) * in_dim);
        r->ybuf[i] = ys[k];
    }
}

static void shuffle(uint32_t *order, uint32_t n, uint64_t seed)
{
    uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
    for (uint32_t i = 0; i < n; i++)
        order[i] = i;
    for (uint32_t i = n - 1; i > 0; i--) {
        s ^= s >> 12, s ^= s << 25, s ^= s >> 27;
        uint32_t j = (uint32_t)((s * 0x2545f4914f6cdd1dull) % (i + 1));
        uint32_t t = order[i];
        order[i] = order[j], order[j] = t;
    }
}

/* Activation deltas (delta=1): the first stage names each micro-batch's
 * rows by their data set indices. */
static int pass_sample_ids(struct rank *r, const uint32_t *order, long start)
{
    uint64_t ids[1024]; /* rows: at most 1024 (options.c) */
    int rc = EPIPE_OK;
    for (unsigned mb = 0; !rc && mb < r->o->microbatches; mb++) {
        for (int k = 0; k < r->rows; k++)
            ids[k] = order[start + (long)mb * r->rows + k];
        rc = epipe_stage_set_samples(r->stage, mb, ids, (size_t)r->rows);
    }
    return rc;
}

static int spec_has_delta(const char *spec)
{
    double v = 0;
    epipe_codec *c = NULL;
    if (epipe_codec_create(&c, spec) || epipe_codec_spec_param(c, "delta", &v))
        v = 0; /* a bad spec: set_codec says so */
    epipe_codec_destroy(c);
    return v == 1;
}

/* Whether any activation codec of the run has delta=1. */
static int any_delta(const struct options *o)
{
    if (!o->layout)
        return spec_has_delta(o->act_codec);
    for (unsigned b = 0; b + 1 < o->layout->stages; b++)
        if (spec_has_delta(o->layout->act[b]))
            return 1;
    return 0;
}

static void progress(const struct rank *r, int epoch, long done, long total, double t0, double loss,
                     int final)
{
    static int last_tenth = -1;
    int tty = isatty(STDOUT_FILENO);
    int tenth = (int)(10 * done / total);
    if (!final && !tty && tenth == last_tenth)
        return;
    last_tenth = final ? -1 : tenth;
    double el = now() - t0, eta = done ? el * (double)(total - done) / (double)done : 0;
    char bar[31];
    int fill = (int)(30 * done / total);
    for (int i = 0; i < 30; i++)
        bar[i] = i < fill ? '#' : '.';
    bar[30] = '\0';
    /* The stage's live statistics: this rank's view (its steps and its
     * boundaries to other ranks), the research's bandwidth log in a line. */
    epipe_stage_stats s = {.struct_size = sizeof s};
    char live[256] = "";
    if (epipe_stage_get_stats(r->stage, &s) == EPIPE_OK) {
        int n = snprintf(live, sizeof live,
                         " | %.0f samples/s, bubble %.2f, step p50 %.1f ms p99 %.1f ms",
                         s.samples_per_second, s.bubble_fraction, 1e3 * s.step_p50_seconds,
                         1e3 * s.step_p99_seconds);
        for (uint32_t i = 0; i < s.boundaries && n > 0 && (size_t)n < sizeof live; i++) {
            epipe_boundary_stats b = {.struct_size = sizeof b};
            if (epipe_stage_get_boundary_stats(r->stage, i, &b) == EPIPE_OK)
                n += snprintf(live + n, sizeof live - (size_t)n,
                              " | %u->%u MB/s act %.1f (peak %.1f) grad %.1f (peak %.1f)",
                              b.boundary, b.boundary + 1, b.act_mbps, b.act_peak_mbps, b.grad_mbps,
                              b.grad_peak_mbps);
        }
    }
    printf("%sepoch %d/%d [%s] %3d%% %ld/%ld  loss %.4f  %s %.0fs%s%s", tty ? "\r" : "", epoch + 1,
           r->o->epochs, bar, (int)(100 * done / total), done, total, loss, final ? "took" : "ETA",
           final ? el : eta, live, tty && !final ? "" : "\n");
    fflush(stdout);
}

static int evaluate(struct rank *r, double *accuracy)
{
    const struct dataset *d = r->d;
    int rc = epipe_stage_set_param(r->stage, EPIPE_STAGE_TRAINING, 0);
    long batches = d->ntest / (uint32_t)r->o->batch;
    r->correct = 0;
    for (long b = 0; rc == EPIPE_OK && b < batches; b++) {
        load_batch(r, d->test_x, d->test_y, NULL, b * r->o->batch);
        rc = epipe_stage_step(r->stage);
    }
    if (rc == EPIPE_OK)
        rc = epipe_stage_set_param(r->stage, EPIPE_STAGE_TRAINING, 1);
    *accuracy = batches ? (double)r->correct / (double)(batches * r->o->batch) : 0;
    return rc;
}

static void run_rank(epipe_comm *comm, const struct options *o, const struct dataset *d,
                     struct rank_result *res)
{
    struct rank r = {.o = o, .d = d};
    memset(res, 0, sizeof *res);
    r.s = epipe_comm_rank(comm);
    r.p = epipe_comm_size(comm);
    r.rows = o->batch / (int)o->microbatches;
    r.nlayers = model_widths(o, d, r.dims);
    uint32_t *order = malloc(sizeof *order * d->ntrain);
    r.xbuf = malloc(sizeof(float) * (size_t)o->batch * d->pixels);
    int rc = order && r.xbuf ? EPIPE_OK : EPIPE_ENOMEM;
    for (unsigned mb = 0; !rc && mb < o->microbatches; mb++)
        if (!(r.dlogits[mb] = malloc(sizeof(float) * (size_t)r.rows * 10)))
            rc = EPIPE_ENOMEM;
    if (rc)
        snprintf(r.err, sizeof r.err, "out of memory for the batch buffers (%d images)", o->batch);
    if (!rc)
        rc = create_stage(&r, comm);
    res->holds_last = r.has_last;
    if (!rc && !o->layout)
        rc = epipe_stage_set_codec(r.stage, EPIPE_DIR_ACTIVATION, EPIPE_ALL_BOUNDARIES,
                                   o->act_codec);
    if (!rc && !o->layout)
        rc = epipe_stage_set_codec(r.stage, EPIPE_DIR_GRADIENT, EPIPE_ALL_BOUNDARIES,
                                   o->grad_codec);
    for (unsigned b = 0; !rc && o->layout && b + 1 < o->layout->stages; b++)
        if (!(rc = epipe_stage_set_codec(r.stage, EPIPE_DIR_ACTIVATION, b, o->layout->act[b])))
            rc = epipe_stage_set_codec(r.stage, EPIPE_DIR_GRADIENT, b, o->layout->grad[b]);
    if (!rc)
        rc = epipe_stage_set_param(r.stage, EPIPE_STAGE_BATCH_SIZE, o->batch);
    epipe_stage_callbacks cb = EPIPE_STAGE_CALLBACKS_INIT;
    cb.user = &r;
    cb.forward = cb_forward;
    if (r.stage && epipe_schedule_splits_backward(epipe_stage_schedule(r.stage)) == 1) {
        cb.backward_input = cb_backward_input;
        cb.backward_weight = cb_backward_weight;
    } else {
        cb.backward = cb_backward;
    }
    if (!rc)
        rc = epipe_stage_set_callbacks(r.stage, &cb);
    if (!rc) {
        const epipe_schedule *sc = epipe_stage_schedule(r.stage);
        r.weights = epipe_schedule_weights(sc);
        r.nstash = epipe_schedule_weight_versions(sc, r.s);
        if (r.nstash > STASH) {
            snprintf(r.err, sizeof r.err,
                     "%s keeps %u weight versions on rank %u; this trainer keeps at most %d",
                     o->schedule, r.nstash, r.s, STASH);
            rc = EPIPE_ENOTSUP;
        }
    }
    long ntrain = o->train_limit > 0 && o->train_limit < (long)d->ntrain ? o->train_limit
                                                                         : (long)d->ntrain;
    long steps = ntrain / o->batch;
    int last = r.has_last && !o->quiet;
    /* an activation codec has delta=1: the first stage names the samples */
    int deltas = r.has_first && any_delta(o);
    double t_start = now();
    for (int e = 0; !rc && e < o->epochs; e++) {
        shuffle(order, d->ntrain, o->seed + (uint64_t)e);
        double t0 = now(), run_loss = 0;
        for (long b = 0; !rc && b < steps; b++) {
            load_batch(&r, d->train_x, d->train_y, order, b * o->batch);
            r.loss = 0;
            if (deltas && (rc = pass_sample_ids(&r, order, b * o->batch)))
                break;
            if ((rc = epipe_stage_step(r.stage)))
                break;
            for (unsigned k = 0; k < r.nch && r.weights != EPIPE_WEIGHTS_STASHED; k++)
                chunk_sgd(&r, &r.ch[k]);
            /* Trainable codecs (insert) learn with the model: the built-in
             * SGD steps this stage's compress and restore parameters. */
            if ((rc = epipe_stage_codec_sgd_step(r.stage, o->codec_lr, o->momentum)))
                break;
            run_loss = b ? 0.98 * run_loss + 0.02 * (r.loss / o->batch) : r.loss / o->batch;
            if (last)
                progress(&r, e, b + 1, steps, t0, run_loss, b + 1 == steps);
        }
        res->final_loss = run_loss;
    }
    /* The backwards still in flight (1f1b-async, 1f1b-2bw), before the
     * statistics and the evaluation; 1f1b-2bw updates after them. */
    if (!rc && r.weights) {
        rc = epipe_stage_drain(r.stage);
        for (unsigned k = 0; !rc && k < r.nch && r.weights == EPIPE_WEIGHTS_DOUBLE; k++)
            chunk_sgd(&r, &r.ch[k]);
    }
    res->seconds = now() - t_start;
    res->samples_per_s = res->seconds > 0 ? (double)(steps * o->batch * o->epochs) / res->seconds
                                          : 0;
    /* The statistics cover training only: evaluation steps run forwards. */
    res->stats.struct_size = sizeof res->stats;
    if (r.stage)
        epipe_stage_get_stats(r.stage, &res->stats);
    if (!rc)
        rc = evaluate(&r, &res->accuracy);
    res->rc = rc;
    if (rc) {
        snprintf(res->error, sizeof res->error, "%s",
                 r.err[0]  ? r.err
                 : r.stage ? epipe_stage_last_error(r.stage)
                           : epipe_last_error());
        if (!res->error[0]) /* a failure that left no sentence: at least its status */
            snprintf(res->error, sizeof res->error, "%s", epipe_strerror(rc));
        epipe_comm_abort(comm);
    }
    epipe_stage_destroy(r.stage);
    for (unsigned k = 0; k < r.nch; k++) {
        model_free(&r.ch[k].model);
        for (int i = 0; i < STASH; i++)
            model_stash_free(&r.ch[k].stash[i]);
    }
    for (unsigned mb = 0; mb < o->microbatches; mb++)
        free(r.dlogits[mb]);
    free(order);
    free(r.xbuf);
}

/* ---- reporting ----------------------------------------------------------- */

static void print_table(const struct options *o, const struct rank_result *res, unsigned first,
                        unsigned count, unsigned p)
{
    const struct rank_result *lastr = &res[count - 1];
    int have_last = 0;
    for (unsigned i = 0; i < count; i++)
        if (res[i].holds_last)
            lastr = &res[i], have_last = 1;
    /* one chunk a rank in pipeline order: each rank's row is its boundary */
    int plain = o->chunks <= 1 && !o->nplace;
    if (have_last)
        printf("\ntest accuracy %.2f%%  (%u stages, %s, %u micro-batches, batch %d, %d epoch%s)\n"
               "throughput    %.0f samples/s\n",
               100 * lastr->accuracy, p, o->schedule, o->microbatches, o->batch, o->epochs,
               o->epochs == 1 ? "" : "s", lastr->samples_per_s);
    printf("\n%-9s %13s %13s %8s | %8s %8s %8s %8s\n", "boundary", "raw MB", "wire MB", "ratio",
           "compute", "codec", "wait", "other");
    for (unsigned i = 0; i < count; i++) {
        const epipe_stage_stats *s = &res[i].stats;
        unsigned st = first + i;
        double other = s->step_seconds - s->compute_seconds - s->encode_seconds -
                       s->decode_seconds - s->wait_seconds;
        double raw = (double)(s->act_sent_raw + s->grad_recv_raw);
        double wire = (double)(s->act_sent_wire + s->grad_recv_wire);
        char name[16];
        if (!plain)
            snprintf(name, sizeof name, "rank %u", st);
        else if (st + 1 < p)
            snprintf(name, sizeof name, "%u->%u", st, st + 1);
        else
            snprintf(name, sizeof name, "(stage %u)", st);
        if (!plain || st + 1 < p)
            printf("%-9s %13.2f %13.2f %8.4f |", name, raw / 1e6, wire / 1e6, raw ? wire / raw : 0);
        else
            printf("%-9s %13s %13s %8s |", name, "", "", "");
        double tot = s->step_seconds > 0 ? s->step_seconds : 1;
        printf(" %7.1f%% %7.1f%% %7.1f%% %7.1f%%   stage %u\n", 100 * s->compute_seconds / tot,
               100 * (s->encode_seconds + s->decode_seconds) / tot, 100 * s->wait_seconds / tot,
               100 * other / tot, st);
    }
    printf("\nraw = activations sent plus gradients received on the boundary, as fp32;\n"
           "wire = the messages that carried them; time split per stage over its steps.\n");
    if (!plain)
        printf("With chunks or a placement, a rank's row sums the boundaries where its\n"
               "chunks send activations to another rank.\n");
}

static int load_data(const struct options *o, struct dataset *d)
{
    char path[4][1024];
    const char *names[4] = {"train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
                            "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"};
    for (int i = 0; i < 4; i++)
        snprintf(path[i], sizeof path[i], "%s/%s", o->data_dir, names[i]);
    /* Fashion-MNIST's pixel mean and standard deviation (bytes 0..255). */
    uint32_t n1, n2, px2;
    char why[1200];
    d->train_x = idx_load_images(path[0], 72.94, 90.02, &d->ntrain, &d->pixels, why, sizeof why);
    d->train_y = d->train_x ? idx_load_labels(path[1], CLASSES, &n1, why, sizeof why) : NULL;
    d->test_x = d->train_y
                    ? idx_load_images(path[2], 72.94, 90.02, &d->ntest, &px2, why, sizeof why)
                    : NULL;
    d->test_y = d->test_x ? idx_load_labels(path[3], CLASSES, &n2, why, sizeof why) : NULL;
    if (!d->test_y) {
        fprintf(stderr, "epipe-train: %s\n", why);
        return -1;
    }
    if (n1 != d->ntrain || n2 != d->ntest || px2 != d->pixels) {
        fprintf(stderr,
                "epipe-train: the image and label files of %s disagree: %u and %u training, "
                "%u and %u test items, %u and %u pixels\n",
                o->data_dir, d->ntrain, n1, d->ntest, n2, d->pixels, px2);
        return -1;
    }
    /* A step takes one batch, and so does the evaluation: fewer images
     * would train or test nothing and print a meaningless accuracy. */
    long ntrain = o->train_limit > 0 && o->train_limit < (long)d->ntrain ? o->train_limit
                                                                         : (long)d->ntrain;
    if (ntrain < o->batch || d->ntest < (uint32_t)o->batch) {
        fprintf(stderr,
                "epipe-train: %ld training and %u test images in %s: each must be at least "
                "one batch (--batch %d)\n",
                ntrain, d->ntest, o->data_dir, o->batch);
        return -1;
    }
    return 0;
}

struct thread_arg {
    epipe_comm *comm;
    const struct options *o;
    const struct dataset *d;
    struct rank_result *res;
};

static void *rank_thread(void *p)
{
    struct thread_arg *a = p;
    run_rank(a->comm, a->o, a->d, a->res);
    epipe_comm_destroy(a->comm);
    return NULL;
}

/* True when a launcher (epipe-run, mpirun, srun, torchrun) started this
 * process as one rank of several: the variables epipe_comm_create_from_env
 * reads. */
static int launched_as_rank(void)
{
    static const char *const vars[] = {"EPIPE_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK",
                                       "SLURM_PROCID"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++)
        if (getenv(vars[i]))
            return 1;
    return 0;
}

/* --plan: the plan from the planner (auto) or from a file, checked
 * against the model and the options, printed, and written to --plan-out.
 * 0, or 1 after a message. */
static int setup_plan(struct options *o, const struct dataset *d, struct train_plan *plan,
                      int launched)
{
    if (!o->plan)
        return 0;
    static char why[16384];
    char err[600];
    int dims[MODEL_MAX_LAYERS + 2];
    unsigned layers = (unsigned)model_widths(o, d, dims);
    if (strcmp(o->plan, "auto") == 0) {
        if (launched) {
            fprintf(stderr, "epipe-train: --plan auto profiles in one process (each rank would "
                            "time its own and plan differently): run it once without a launcher "
                            "with --plan-out FILE, then launch the ranks with --plan FILE\n");
            return 1;
        }
        int rows = o->batch / (int)o->microbatches;
        printf("epipe-train: profiling %u layers, and the codecs %s, on micro-batches of %d "
               "rows\n",
               layers, o->plan_codecs ? o->plan_codecs : TRAIN_PLAN_CODECS, rows);
        fflush(stdout);
        if (train_plan_auto(o, dims, layers, d->train_x, d->train_y, rows, plan, why, sizeof why,
                            err, sizeof err)) {
            fprintf(stderr, "epipe-train: %s\n", err);
            return 1;
        }
        printf("%s", why);
    } else {
        if (train_plan_load(o->plan, plan, err, sizeof err)) {
            fprintf(stderr, "epipe-train: %s\n", err);
            return 1;
        }
        if (plan->layers != layers) {
            fprintf(stderr, "epipe-train: plan %s is for %u layers; --hidden makes %u\n", o->plan,
                    plan->layers, layers);
            return 1;
        }
        if (!launched && o->stages_set && plan->stages != o->stages) {
            fprintf(stderr, "epipe-train: plan %s has %u stages; --stages says %u\n", o->plan,
                    plan->stages, o->stages);
            return 1;
        }
        if (o->schedule_set && strcmp(o->schedule, plan->schedule) != 0) {
            fprintf(stderr, "epipe-train: plan %s sets schedule %s; leave out --schedule\n",
                    o->plan, plan->schedule);
            return 1;
        }
        if (!launched)
            o->stages = plan->stages;
    }
    o->schedule = plan->schedule;
    o->layout = plan;
    if (o->plan_out) {
        int werr = train_plan_save(o->plan_out, plan);
        if (werr) {
            fprintf(stderr, "epipe-train: cannot write the plan to %s: %s\n", o->plan_out,
                    strerror(werr));
            return 1;
        }
        printf("epipe-train: plan written to %s\n", o->plan_out);
    }
    printf("plan: %u stages, schedule %s; layers", plan->stages, plan->schedule);
    for (unsigned s = 0; s < plan->stages; s++)
        printf(" [%u,%u)", plan->first[s], plan->first[s + 1]);
    printf("\n");
    for (unsigned b = 0; b + 1 < plan->stages; b++)
        printf("plan: boundary %u->%u act %s grad %s\n", b, b + 1, plan->act[b], plan->grad[b]);
    fflush(stdout);
    return 0;
}

/* One rank of a multi-process run: joins the others (over TCP, or the
 * transport EPIPE_TRANSPORT names), trains its stage, and prints its own
 * row of the table (the last stage adds the accuracy). Rows of different ranks arrive in any order, each prefixed by
 * the launcher. */
static int main_rank(struct options *o, const struct dataset *d)
{
    epipe_comm *comm;
    /* "auto": tcp unless EPIPE_TRANSPORT names another (docs/transport.md) */
    if (epipe_comm_create(&comm, "auto", EPIPE_COMM_FROM_ENV, EPIPE_COMM_FROM_ENV, NULL, 0, NULL)) {
        fprintf(stderr, "epipe-train: %s\n", epipe_last_error());
        return 1;
    }
    unsigned s = epipe_comm_rank(comm), p = epipe_comm_size(comm);
    if (o->layout && o->layout->stages != p) {
        fprintf(stderr, "epipe-train: plan %s has %u stages; the launcher started %u ranks\n",
                o->plan, o->layout->stages, p);
        epipe_comm_destroy(comm);
        return 2;
    }
    o->stages = p;
    if (p > (unsigned)o->nhidden + 1) {
        fprintf(stderr,
                "epipe-train: %u ranks but the model has only %d layers (one layer a "
                "stage at least; widen --hidden)\n",
                p, o->nhidden + 1);
        epipe_comm_destroy(comm);
        return 2;
    }
    if (s == 0)
        printf("libepipe %s: %u stages as processes over %s, %s, %u micro-batches, act %s, "
               "grad %s\n",
               epipe_version_string(), p, epipe_comm_transport(comm), o->schedule, o->microbatches,
               o->layout ? "(the plan's)" : o->act_codec,
               o->layout ? "(the plan's)" : o->grad_codec);
    fflush(stdout);
    struct rank_result res;
    run_rank(comm, o, d, &res);
    epipe_comm_destroy(comm);
    if (res.rc) {
        fprintf(stderr, "epipe-train: rank %u: %s\n", s, res.error);
        return 1;
    }
    const epipe_stage_stats *st = &res.stats;
    double tot = st->step_seconds > 0 ? st->step_seconds : 1;
    double other = st->step_seconds - st->compute_seconds - st->encode_seconds -
                   st->decode_seconds - st->wait_seconds;
    char wire[128] = "last stage, sends no activations";
    if (o->chunks > 1 || o->nplace) {
        double raw = (double)(st->act_sent_raw + st->grad_recv_raw);
        double w = (double)(st->act_sent_wire + st->grad_recv_wire);
        snprintf(wire, sizeof wire, "its boundaries to other ranks raw %.2f MB wire %.2f MB",
                 raw / 1e6, w / 1e6);
    } else if (s + 1 < p) {
        double raw = (double)(st->act_sent_raw + st->grad_recv_raw);
        double w = (double)(st->act_sent_wire + st->grad_recv_wire);
        snprintf(wire, sizeof wire, "boundary %u->%u raw %.2f MB wire %.2f MB ratio %.4f", s, s + 1,
                 raw / 1e6, w / 1e6, raw ? w / raw : 0);
    }
    double steps = st->steps ? (double)st->steps : 1;
    printf("stage %u: %s | compute %.1f%% codec %.1f%% wait %.1f%% other %.1f%% | "
           "step %.3f ms, compute %.3f ms a step\n",
           s, wire, 100 * st->compute_seconds / tot,
           100 * (st->encode_seconds + st->decode_seconds) / tot, 100 * st->wait_seconds / tot,
           100 * other / tot, 1e3 * st->step_seconds / steps, 1e3 * st->compute_seconds / steps);
    if (res.holds_last)
        printf("test accuracy %.2f%%  (%u stages, %s, %u micro-batches, batch %d, %d epoch%s), "
               "%.0f samples/s\n",
               100 * res.accuracy, p, o->schedule, o->microbatches, o->batch, o->epochs,
               o->epochs == 1 ? "" : "s", res.samples_per_s);
    return 0;
}

int main(int argc, char **argv)
{
    struct options o = {.stages = 3,
                        .microbatches = 4,
                        .schedule = "1f1b",
                        .act_codec = "sortquant:bits=8",
                        /* zero=1: 0 on the grid, so gradients masked by a
                         * ReLU carry no bias (docs/codecs.md) */
                        .grad_codec = "sortquant:bits=8,zero=1",
                        .data_dir = IDX_FASHION_DIR,
                        .epochs = 3,
                        .batch = 64,
                        .hidden = {512, 256},
                        .nhidden = 2,
                        .lr = 0.05f,
                        .momentum = 0.9f,
                        .seed = 1,
                        .blas_threads = 1,
                        .codec_lr = -1,
                        .link_latency = 1e-4,
                        .plan_error = -1};
    if (train_parse_args(argc, argv, &o))
        return 2;
    model_set_blas_threads(o.blas_threads);
    if (o.codec_lr < 0)
        o.codec_lr = o.lr;
    struct dataset d = {0};
    if (load_data(&o, &d)) {
        free(d.train_x), free(d.train_y), free(d.test_x), free(d.test_y);
        return 1;
    }
    static struct train_plan plan;
    if (setup_plan(&o, &d, &plan, launched_as_rank())) {
        free(d.train_x), free(d.train_y), free(d.test_x), free(d.test_y);
        return 2;
    }
    if (launched_as_rank()) {
        int rc = main_rank(&o, &d);
        free(d.train_x), free(d.train_y), free(d.test_x), free(d.test_y);
        return rc;
    }
    unsigned p = o.stages;
    struct rank_result *res = calloc(p, sizeof *res);
    epipe_comm **comms = calloc(p, sizeof *comms);
    pthread_t *tid = calloc(p, sizeof *tid);
    struct thread_arg *args = calloc(p, sizeof *args);
    if (!res || !comms || !tid || !args || epipe_comm_create_inproc(comms, p)) {
        fprintf(stderr, "epipe-train: %s\n", epipe_last_error());
        return 1;
    }
    printf("libepipe %s: %u stages as threads, %s, %u micro-batches, ", epipe_version_string(), p,
           o.schedule, o.microbatches);
    if (o.layout)
        printf("codecs of the plan\n");
    else
        printf("act %s, grad %s\n", o.act_codec, o.grad_codec);
    for (unsigned s = 0; s < p; s++) {
        args[s] = (struct thread_arg){comms[s], &o, &d, &res[s]};
        pthread_create(&tid[s], NULL, rank_thread, &args[s]);
    }
    int failed = 0;
    for (unsigned s = 0; s < p; s++) {
        pthread_join(tid[s], NULL);
        if (res[s].rc) {
            fprintf(stderr, "epipe-train: rank %u: %s\n", s, res[s].error);
            failed = 1;
        }
    }
    if (!failed)
        print_table(&o, res, 0, p, p);
    free(d.train_x), free(d.train_y), free(d.test_x), free(d.test_y);
    free(res), free(comms), free(tid), free(args);
    return failed;
}
