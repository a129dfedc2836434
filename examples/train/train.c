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

struct options {
    unsigned stages, microbatches;
    const char *schedule, *act_codec, *grad_codec, *data_dir;
    int epochs, batch, hidden[MODEL_MAX_LAYERS], nhidden;
    float lr, momentum, codec_lr;
    uint64_t seed;
    long train_limit;
    int quiet, blas_threads;
};

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
};

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---- one rank ------------------------------------------------------------ */

struct rank {
    const struct options *o;
    const struct dataset *d;
    epipe_stage *stage;
    unsigned s, p;
    int dims[MODEL_MAX_LAYERS + 2], nlayers, l0, l1, rows;
    stage_model model;
    const float *x;        /* rows of the current batch (stage 0) */
    const uint8_t *y;      /* labels of the current batch (last stage) */
    const uint32_t *order; /* sample indices of the current epoch */
    long batch_start;
    float *xbuf;
    uint8_t ybuf[MODEL_MAX_MB * 1024];
    float *dlogits[MODEL_MAX_MB];
    double loss;
    int correct;
    int64_t out_shape[2], dx_shape[2];
    DLTensor out, dx;
};

static int cb_forward(void *user, unsigned mb, const DLTensor *in, const DLTensor **out)
{
    struct rank *r = user;
    int rows = r->rows, in_dim = r->dims[r->l0];
    const float *x;
    if (r->s == 0) {
        x = r->xbuf + (size_t)mb * rows * in_dim;
    } else {
        if (in->ndim != 2 || in->shape[0] != rows || in->shape[1] != in_dim)
            return 1;
        x = in->data;
    }
    const float *y = model_forward(&r->model, (int)mb, x, rows);
    int out_dim = r->dims[r->l1];
    if (r->s + 1 == r->p) {
        r->loss += softmax_xent(y, r->ybuf + (size_t)mb * rows, rows, out_dim, r->o->batch,
                                r->dlogits[mb], &r->correct);
        return 0;
    }
    r->out_shape[0] = rows, r->out_shape[1] = out_dim;
    r->out = (DLTensor){.data = (void *)y,
                        .device = {kDLCPU, 0},
                        .ndim = 2,
                        .dtype = {kDLFloat, 32, 1},
                        .shape = r->out_shape};
    *out = &r->out;
    return 0;
}

static int cb_backward(void *user, unsigned mb, const DLTensor *gout, const DLTensor **gin)
{
    struct rank *r = user;
    const float *dy = r->s + 1 == r->p ? r->dlogits[mb] : gout->data;
    const float *dx = model_backward(&r->model, (int)mb, dy, r->rows, r->s > 0);
    if (r->s > 0) {
        r->dx_shape[0] = r->rows, r->dx_shape[1] = r->dims[r->l0];
        r->dx = (DLTensor){.data = (void *)dx,
                           .device = {kDLCPU, 0},
                           .ndim = 2,
                           .dtype = {kDLFloat, 32, 1},
                           .shape = r->dx_shape};
        *gin = &r->dx;
    }
    return 0;
}

/* Gathers the batch's inputs (stage 0) and labels (last stage). */
static void load_batch(struct rank *r, const float *xs, const uint8_t *ys, const uint32_t *order,
                       long start)
{
    int in_dim = r->dims[0], n = r->o->batch;
    for (int i = 0; i < n; i++) {
        uint32_t k = order ? order[start + i] : (uint32_t)(start + i);
        if (r->s == 0)
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
    printf("%sepoch %d/%d [%s] %3d%% %ld/%ld  loss %.4f  %s %.0fs%s", tty ? "\r" : "", epoch + 1,
           r->o->epochs, bar, (int)(100 * done / total), done, total, loss, final ? "took" : "ETA",
           final ? el : eta, tty && !final ? "" : "\n");
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
    r.dims[0] = (int)d->pixels;
    for (int i = 0; i < o->nhidden; i++)
        r.dims[i + 1] = o->hidden[i];
    r.dims[o->nhidden + 1] = 10;
    r.nlayers = o->nhidden + 1;
    r.l0 = (int)(r.s * (unsigned)r.nlayers / r.p);
    r.l1 = (int)((r.s + 1) * (unsigned)r.nlayers / r.p);
    uint32_t *order = malloc(sizeof *order * d->ntrain);
    r.xbuf = malloc(sizeof(float) * (size_t)o->batch * d->pixels);
    int rc = order && r.xbuf ? EPIPE_OK : EPIPE_ENOMEM;
    if (!rc &&
        model_init(&r.model, r.dims, r.nlayers, r.l0, r.l1, r.rows, (int)o->microbatches, o->seed))
        rc = EPIPE_ENOMEM;
    for (unsigned mb = 0; !rc && mb < o->microbatches; mb++)
        if (!(r.dlogits[mb] = malloc(sizeof(float) * (size_t)r.rows * 10)))
            rc = EPIPE_ENOMEM;
    if (!rc)
        rc = epipe_stage_create(&r.stage, comm, o->schedule, o->microbatches);
    if (!rc)
        rc = epipe_stage_set_codec(r.stage, EPIPE_DIR_ACTIVATION, EPIPE_ALL_BOUNDARIES,
                                   o->act_codec);
    if (!rc)
        rc = epipe_stage_set_codec(r.stage, EPIPE_DIR_GRADIENT, EPIPE_ALL_BOUNDARIES,
                                   o->grad_codec);
    if (!rc)
        rc = epipe_stage_set_param(r.stage, EPIPE_STAGE_BATCH_SIZE, o->batch);
    epipe_stage_callbacks cb = EPIPE_STAGE_CALLBACKS_INIT;
    cb.user = &r;
    cb.forward = cb_forward;
    cb.backward = cb_backward;
    if (!rc)
        rc = epipe_stage_set_callbacks(r.stage, &cb);
    long ntrain = o->train_limit > 0 && o->train_limit < (long)d->ntrain ? o->train_limit
                                                                         : (long)d->ntrain;
    long steps = ntrain / o->batch;
    int last = r.s + 1 == r.p && !o->quiet;
    double t_start = now();
    for (int e = 0; !rc && e < o->epochs; e++) {
        shuffle(order, d->ntrain, o->seed + (uint64_t)e);
        double t0 = now(), run_loss = 0;
        for (long b = 0; !rc && b < steps; b++) {
            load_batch(&r, d->train_x, d->train_y, order, b * o->batch);
            r.loss = 0;
            if ((rc = epipe_stage_step(r.stage)))
                break;
            model_sgd(&r.model, o->lr, o->momentum);
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
                 r.stage ? epipe_stage_last_error(r.stage) : "out of memory");
        epipe_comm_abort(comm);
    }
    epipe_stage_destroy(r.stage);
    model_free(&r.model);
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
    if (first + count == p)
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
        if (st + 1 < p)
            snprintf(name, sizeof name, "%u->%u", st, st + 1);
        else
            snprintf(name, sizeof name, "(stage %u)", st);
        if (st + 1 < p)
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
}

/* ---- command line ---------------------------------------------------------- */

static void usage(FILE *f)
{
    fprintf(f,
            "usage: epipe-train [options]\n"
            "  --stages N          pipeline stages (default 3); threads of this process unless\n"
            "                      started by a launcher (then the launcher's world size)\n"
            "  --microbatches M    micro-batches a step (default 4)\n"
            "  --schedule KIND     gpipe or 1f1b (default 1f1b)\n"
            "  --act-codec SPEC    codec for activations (default sortquant:bits=8)\n"
            "  --grad-codec SPEC   codec for gradients (default sortquant:bits=8)\n"
            "  --epochs E          (default 3)   --batch B (default 64)\n"
            "  --lr LR             (default 0.05) --momentum MU (default 0.9)\n"
            "  --codec-lr LR       learning rate of trainable codecs (insert; default --lr)\n"
            "  --hidden W,W,...    hidden layer widths (default 512,256)\n"
            "  --seed S            (default 1)\n"
            "  --train-limit N     use only the first N training images\n"
            "  --data DIR          Fashion-MNIST IDX files (default %s)\n"
            "  --blas-threads N    threads a BLAS call may use (default 1: the stages\n"
            "                      already keep the cores busy; libepipe's codecs share it)\n"
            "  --quiet             no progress bar\n",
            IDX_FASHION_DIR);
}

static int parse_args(int argc, char **argv, struct options *o)
{
    enum {
        O_QUIET = 256,
        O_STAGES,
        O_MB,
        O_SCHEDULE,
        O_ACT,
        O_GRAD,
        O_EPOCHS,
        O_BATCH,
        O_LR,
        O_MOMENTUM,
        O_CODEC_LR,
        O_SEED,
        O_TRAIN_LIMIT,
        O_DATA,
        O_BLAS_THREADS,
        O_HIDDEN
    };
    static const struct option longopts[] = {
        {"help", no_argument, NULL, 'h'},
        {"quiet", no_argument, NULL, O_QUIET},
        {"stages", required_argument, NULL, O_STAGES},
        {"microbatches", required_argument, NULL, O_MB},
        {"schedule", required_argument, NULL, O_SCHEDULE},
        {"act-codec", required_argument, NULL, O_ACT},
        {"grad-codec", required_argument, NULL, O_GRAD},
        {"epochs", required_argument, NULL, O_EPOCHS},
        {"batch", required_argument, NULL, O_BATCH},
        {"lr", required_argument, NULL, O_LR},
        {"momentum", required_argument, NULL, O_MOMENTUM},
        {"codec-lr", required_argument, NULL, O_CODEC_LR},
        {"seed", required_argument, NULL, O_SEED},
        {"train-limit", required_argument, NULL, O_TRAIN_LIMIT},
        {"data", required_argument, NULL, O_DATA},
        {"blas-threads", required_argument, NULL, O_BLAS_THREADS},
        {"hidden", required_argument, NULL, O_HIDDEN},
        {NULL, 0, NULL, 0},
    };
    opterr = 0;
    int opt;
    while ((opt = getopt_long(argc, argv, ":h", longopts, NULL)) != -1) {
        const char *v = optarg;
        switch (opt) {
        case 'h': usage(stdout); exit(0);
        case O_QUIET: o->quiet = 1; break;
        case O_STAGES: o->stages = (unsigned)atoi(v); break;
        case O_MB: o->microbatches = (unsigned)atoi(v); break;
        case O_SCHEDULE: o->schedule = v; break;
        case O_ACT: o->act_codec = v; break;
        case O_GRAD: o->grad_codec = v; break;
        case O_EPOCHS: o->epochs = atoi(v); break;
        case O_BATCH: o->batch = atoi(v); break;
        case O_LR: o->lr = (float)atof(v); break;
        case O_MOMENTUM: o->momentum = (float)atof(v); break;
        case O_CODEC_LR: o->codec_lr = (float)atof(v); break;
        case O_SEED: o->seed = strtoull(v, NULL, 10); break;
        case O_TRAIN_LIMIT: o->train_limit = atol(v); break;
        case O_DATA: o->data_dir = v; break;
        case O_BLAS_THREADS: o->blas_threads = atoi(v); break;
        case O_HIDDEN:
            o->nhidden = 0;
            for (const char *p = v; *p && o->nhidden < MODEL_MAX_LAYERS - 1;) {
                char *end;
                long w = strtol(p, &end, 10);
                if (end == p || w < 1 || w > 65536) {
                    fprintf(stderr, "epipe-train: bad --hidden '%s'\n", v);
                    return -1;
                }
                o->hidden[o->nhidden++] = (int)w;
                p = *end == ',' ? end + 1 : end;
            }
            break;
        default: /* ':' or '?' */ epipe_cli_bad_option("epipe-train", argv, opt); return -1;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "epipe-train: unexpected argument '%s' (options start with --)\n",
                argv[optind]);
        return -1;
    }
    if (o->microbatches < 1 || o->microbatches > MODEL_MAX_MB || o->batch < 1 ||
        o->batch % (int)o->microbatches || o->batch / (int)o->microbatches > 1024) {
        fprintf(stderr,
                "epipe-train: --batch %d must divide into --microbatches %u (at most %d, "
                "and at most 1024 rows each)\n",
                o->batch, o->microbatches, MODEL_MAX_MB);
        return -1;
    }
    if (o->epochs < 1 || o->stages < 1 || o->stages > (unsigned)o->nhidden + 1) {
        fprintf(stderr,
                "epipe-train: need --epochs >= 1 and 1 <= --stages <= %d (one layer a "
                "stage at least)\n",
                o->nhidden + 1);
        return -1;
    }
    if (o->blas_threads < 1 || o->blas_threads > 256) {
        fprintf(stderr, "epipe-train: --blas-threads %d is not in 1..256\n", o->blas_threads);
        return -1;
    }
    return 0;
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
    d->train_x = idx_load_images(path[0], 72.94, 90.02, &d->ntrain, &d->pixels);
    d->train_y = d->train_x ? idx_load_labels(path[1], &n1) : NULL;
    d->test_x = d->train_y ? idx_load_images(path[2], 72.94, 90.02, &d->ntest, &px2) : NULL;
    d->test_y = d->test_x ? idx_load_labels(path[3], &n2) : NULL;
    if (!d->test_y)
        return -1;
    if (n1 != d->ntrain || n2 != d->ntest || px2 != d->pixels) {
        fprintf(stderr, "epipe-train: image and label files of %s disagree\n", o->data_dir);
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
               o->act_codec, o->grad_codec);
    fflush(stdout);
    struct rank_result res;
    run_rank(comm, o, d, &res);
    epipe_comm_destroy(comm);
    if (res.rc) {
        fprintf(stderr, "epipe-train: stage %u: %s\n", s, res.error);
        return 1;
    }
    const epipe_stage_stats *st = &res.stats;
    double tot = st->step_seconds > 0 ? st->step_seconds : 1;
    double other = st->step_seconds - st->compute_seconds - st->encode_seconds -
                   st->decode_seconds - st->wait_seconds;
    char wire[128] = "last stage, sends no activations";
    if (s + 1 < p) {
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
    if (s + 1 == p)
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
                        .grad_codec = "sortquant:bits=8",
                        .data_dir = IDX_FASHION_DIR,
                        .epochs = 3,
                        .batch = 64,
                        .hidden = {512, 256},
                        .nhidden = 2,
                        .lr = 0.05f,
                        .momentum = 0.9f,
                        .seed = 1,
                        .blas_threads = 1,
                        .codec_lr = -1};
    if (parse_args(argc, argv, &o))
        return 2;
    model_set_blas_threads(o.blas_threads);
    if (o.codec_lr < 0)
        o.codec_lr = o.lr;
    struct dataset d = {0};
    if (load_data(&o, &d))
        return 1;
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
    printf("libepipe %s: %u stages as threads, %s, %u micro-batches, act %s, grad %s\n",
           epipe_version_string(), p, o.schedule, o.microbatches, o.act_codec, o.grad_codec);
    for (unsigned s = 0; s < p; s++) {
        args[s] = (struct thread_arg){comms[s], &o, &d, &res[s]};
        pthread_create(&tid[s], NULL, rank_thread, &args[s]);
    }
    int failed = 0;
    for (unsigned s = 0; s < p; s++) {
        pthread_join(tid[s], NULL);
        if (res[s].rc) {
            fprintf(stderr, "epipe-train: stage %u: %s\n", s, res[s].error);
            failed = 1;
        }
    }
    if (!failed)
        print_table(&o, res, 0, p, p);
    free(d.train_x), free(d.train_y), free(d.test_x), free(d.test_y);
    free(res), free(comms), free(tid), free(args);
    return failed;
}
