/* --plan auto: the profile of epipe-train's model and its codec table,
 * measured here, then libepipe's planner. */
#define _POSIX_C_SOURCE 200809L
#include "plan_auto.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include <epipe/epipe.h>

#include "model.h"
#include "options.h"

#define REPS 8   /* timed repetitions of each measurement */
#define WARMUP 2 /* untimed runs before them */

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int train_parse_rate(const char *text, double *v)
{
    static const struct {
        const char *unit;
        double scale;
    } units[] = {{"", 1},           {"B", 1},        {"KB", 1e3},        {"MB", 1e6},
                 {"GB", 1e9},       {"bit", 1 / 8.}, {"Kbit", 1e3 / 8.}, {"Mbit", 1e6 / 8.},
                 {"Gbit", 1e9 / 8.}};
    char *end;
    double x = strtod(text, &end);
    if (end == text || !(x > 0) || !isfinite(x))
        return -1;
    for (size_t i = 0; i < sizeof units / sizeof units[0]; i++)
        if (strcasecmp(end, units[i].unit) == 0) {
            *v = x * units[i].scale;
            return isfinite(*v) && *v > 0 ? 0 : -1;
        }
    return -1;
}

/* The per-layer models, each with one micro-batch slot and the split
 * backward, and the tensors one pass leaves at each boundary. */
struct profile {
    unsigned layers;
    int rows;
    stage_model m[MODEL_MAX_LAYERS];
    float *act[MODEL_MAX_LAYERS], *grad[MODEL_MAX_LAYERS]; /* boundary l: layer l's output */
    float *dlogits;
    epipe_plan_layer cost[MODEL_MAX_LAYERS];
};

static void profile_free(struct profile *p)
{
    for (unsigned l = 0; l < p->layers; l++) {
        model_free(&p->m[l]);
        free(p->act[l]);
        free(p->grad[l]);
    }
    free(p->dlogits);
}

/* One training pass through the layers in order, timing each part into
 * cost[] when `timed`, and keeping the boundary tensors. */
static void one_pass(struct profile *p, const int *dims, const float *x, const uint8_t *labels,
                     int timed)
{
    const float *in = x;
    const float *out[MODEL_MAX_LAYERS];
    for (unsigned l = 0; l < p->layers; l++) {
        double t0 = now();
        out[l] = model_forward(&p->m[l], 0, in, p->rows);
        if (timed)
            p->cost[l].forward_s += now() - t0;
        in = out[l];
    }
    int correct = 0;
    softmax_xent(out[p->layers - 1], labels, p->rows, dims[p->layers], p->rows, p->dlogits,
                 &correct);
    const float *dy = p->dlogits;
    for (unsigned l = p->layers; l-- > 0;) {
        double t0 = now();
        const float *dx = model_backward_input(&p->m[l], 0, dy, p->rows, l > 0);
        double t1 = now();
        model_backward_weight(&p->m[l], 0, p->rows);
        double t2 = now();
        model_sgd(&p->m[l], 0.0f, 0.0f); /* zeroes the gradients; lr 0 keeps the weights */
        double t3 = now();
        if (timed) {
            p->cost[l].backward_s += t2 - t0;
            p->cost[l].weight_s += t2 - t1;
            p->cost[l].update_s += t3 - t2;
        }
        if (l + 1 < p->layers) {
            size_t n = (size_t)p->rows * (size_t)dims[l + 1];
            memcpy(p->act[l], out[l], n * sizeof(float));
        }
        if (l > 0)
            memcpy(p->grad[l - 1], dx, (size_t)p->rows * (size_t)dims[l] * sizeof(float));
        dy = dx;
    }
}

static int profile_layers(struct profile *p, const struct options *o, const int *dims,
                          const float *x, const uint8_t *labels, char *err, size_t cap)
{
    for (unsigned l = 0; l < p->layers; l++) {
        size_t n = (size_t)p->rows * (size_t)dims[l + 1];
        if (model_init(&p->m[l], dims, (int)p->layers, (int)l, (int)l + 1, p->rows, 1, o->seed) ||
            model_enable_split(&p->m[l]) || !(p->act[l] = malloc(n * sizeof(float))) ||
            !(p->grad[l] = malloc(n * sizeof(float)))) {
            snprintf(err, cap, "--plan auto: out of memory for the profile");
            return -1;
        }
    }
    if (!(p->dlogits = malloc(sizeof(float) * (size_t)p->rows * (size_t)dims[p->layers]))) {
        snprintf(err, cap, "--plan auto: out of memory for the profile");
        return -1;
    }
    for (int r = 0; r < WARMUP; r++)
        one_pass(p, dims, x, labels, 0);
    for (int r = 0; r < REPS; r++)
        one_pass(p, dims, x, labels, 1);
    for (unsigned l = 0; l < p->layers; l++) {
        epipe_plan_layer *c = &p->cost[l];
        c->forward_s /= REPS, c->backward_s /= REPS, c->weight_s /= REPS, c->update_s /= REPS;
        c->out_bytes = 4.0 * p->rows * dims[l + 1];
        c->param_bytes = 4.0 * ((double)dims[l] * dims[l + 1] + dims[l + 1]);
        c->stash_bytes = 4.0 * p->rows * (dims[l] + dims[l + 1]); /* input and output */
    }
    return 0;
}

/* One candidate on one boundary tensor x [rows, width]: times, wire ratio
 * and error (relative MSE for activations, 1 - cosine for gradients). */
static int measure_codec(const char *spec, unsigned layer, unsigned dir, float *x, int rows,
                         int width, epipe_plan_codec *e, char *err, size_t cap)
{
    epipe_codec *c = NULL;
    int64_t shape[2] = {rows, width};
    DLTensor t = {
        .data = x, .device = {kDLCPU, 0}, .ndim = 2, .dtype = {kDLFloat, 32, 1}, .shape = shape};
    size_t n = (size_t)rows * (size_t)width, bound = 0, len = 0;
    float *y = malloc(n * sizeof *y);
    void *buf = NULL;
    double delta = 0;
    int rc = y ? epipe_codec_create(&c, spec) : EPIPE_ENOMEM;
    if (!rc && (epipe_codec_trainable(c) ||
                (epipe_codec_spec_param(c, "delta", &delta) == EPIPE_OK && delta == 1))) {
        snprintf(err, cap,
                 "--plan-codecs: '%s' cannot be profiled before training (a trainable codec "
                 "learns, delta=1 needs sample ids): leave it out",
                 spec);
        epipe_codec_destroy(c);
        free(y);
        return -1;
    }
    if (!rc)
        rc = epipe_codec_max_encoded_size(c, &t, &bound);
    if (!rc && !(buf = malloc(bound)))
        rc = EPIPE_ENOMEM;
    DLTensor out = t;
    out.data = y;
    double te = 0, td = 0;
    for (int r = 0; !rc && r < WARMUP + REPS; r++) {
        double t0 = now();
        rc = epipe_codec_encode(c, &t, buf, bound, &len);
        double t1 = now();
        if (!rc)
            rc = epipe_codec_decode(c, buf, len, &out);
        double t2 = now();
        if (r >= WARMUP)
            te += t1 - t0, td += t2 - t1;
    }
    if (rc) {
        snprintf(err, cap, "--plan-codecs: '%s' on boundary %u's %s: %s", spec, layer,
                 dir ? "gradient" : "activation",
                 c ? epipe_codec_last_error(c) : epipe_last_error());
    } else {
        double se = 0, sx = 0, sy = 0, sxy = 0;
        for (size_t i = 0; i < n; i++) {
            double a = x[i], b = y[i];
            se += (a - b) * (a - b), sx += a * a, sy += b * b, sxy += a * b;
        }
        double err_v = dir == 0 ? (sx > 0 ? se / sx : 0)
                                : (sx > 0 && sy > 0 ? 1 - sxy / sqrt(sx * sy) : (sx > 0 ? 1 : 0));
        *e = (epipe_plan_codec){.spec = spec,
                                .layer = layer,
                                .dir = dir,
                                .encode_s = te / REPS,
                                .decode_s = td / REPS,
                                .wire_ratio = (double)len / (4.0 * (double)n),
                                .error = err_v > 0 ? err_v : 0};
    }
    epipe_codec_destroy(c);
    free(buf);
    free(y);
    return rc ? -1 : 0;
}

/* The specs of "A;B;C" (at most 16), copied into store. */
static int split_specs(const char *list, char store[][TRAIN_PLAN_SPEC], unsigned *count, char *err,
                       size_t cap)
{
    *count = 0;
    for (const char *s = list; *s;) {
        const char *e = strchr(s, ';');
        size_t n = e ? (size_t)(e - s) : strlen(s);
        if (n) {
            if (*count == 16 || n >= TRAIN_PLAN_SPEC) {
                snprintf(err, cap, "--plan-codecs: at most 16 specs of under %d characters",
                         TRAIN_PLAN_SPEC);
                return -1;
            }
            memcpy(store[*count], s, n);
            store[(*count)++][n] = '\0';
        }
        s = e ? e + 1 : s + n;
    }
    return 0;
}

int train_plan_auto(const struct options *o, const int *dims, unsigned layers, const float *x,
                    const uint8_t *labels, int rows, struct train_plan *plan, char *why,
                    size_t why_cap, char *err, size_t cap)
{
    char specs[16][TRAIN_PLAN_SPEC];
    unsigned ns;
    if (split_specs(o->plan_codecs ? o->plan_codecs : TRAIN_PLAN_CODECS, specs, &ns, err, cap))
        return -1;
    struct profile p;
    memset(&p, 0, sizeof p);
    p.layers = layers, p.rows = rows;
    epipe_plan_codec *table = calloc((size_t)ns * 2 * (layers ? layers : 1), sizeof *table);
    int rc = table ? profile_layers(&p, o, dims, x, labels, err, cap) : -1;
    if (!table)
        snprintf(err, cap, "--plan auto: out of memory");
    size_t nt = 0;
    for (unsigned l = 0; !rc && l + 1 < layers; l++)
        for (unsigned dir = 0; !rc && dir < 2; dir++)
            for (unsigned k = 0; !rc && k < ns; k++)
                rc = measure_codec(specs[k], l, dir, dir ? p.grad[l] : p.act[l], rows, dims[l + 1],
                                   &table[nt++], err, cap);
    epipe_plan *pl = NULL;
    if (!rc) {
        epipe_plan_options po = EPIPE_PLAN_OPTIONS_INIT;
        po.stages = o->stages;
        po.microbatches = o->microbatches;
        po.bandwidth = o->link_rate;
        po.latency_s = o->link_latency;
        po.act_error_budget = po.grad_error_budget = o->plan_error;
        po.schedules = o->schedule_set ? o->schedule : NULL;
        if (epipe_plan_create(&pl, p.cost, layers, table, nt, &po)) {
            snprintf(err, cap, "--plan auto: %s", epipe_last_error());
            rc = -1;
        }
    }
    if (!rc) {
        memset(plan, 0, sizeof *plan);
        plan->layers = layers, plan->stages = o->stages;
        for (unsigned s = 0; s <= o->stages; s++)
            plan->first[s] = epipe_plan_first_layer(pl, s);
        snprintf(plan->schedule, sizeof plan->schedule, "%s", epipe_plan_schedule(pl));
        for (unsigned b = 0; b + 1 < o->stages; b++) {
            snprintf(plan->act[b], TRAIN_PLAN_SPEC, "%s", epipe_plan_codec_spec(pl, b, 0));
            snprintf(plan->grad[b], TRAIN_PLAN_SPEC, "%s", epipe_plan_codec_spec(pl, b, 1));
        }
        epipe_plan_explain(pl, why, why_cap);
    }
    epipe_plan_destroy(pl);
    profile_free(&p);
    free(table);
    return rc;
}
