/* Conformance tests of whole trainings (the test MLP, tests/support): equal
 * to one process, trains with a lossy codec, survives a killed stage. */
#define _GNU_SOURCE
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "conform.h"
#include "pipeline_host.h"

struct train_arg {
    struct host_config cfg;
    const mlp_layer *ref; /* the one-process result, or NULL */
    double ref_last;
    int victim;      /* the rank killed mid-training, or -1 */
    double min_fall; /* > 0: the last stage's loss must fall below this fraction */
};

static double rel_diff(float a, float b)
{
    double d = fabs((double)a - (double)b), m = fmax(fabs((double)a), fabs((double)b));
    return m > 1e-30 ? d / m : d;
}

/* This stage's parameters equal the reference's within 1e-6 relative. */
static int params_match(const struct host_result *res, unsigned s, const mlp_layer *ref)
{
    for (int l = res->l0; l < res->l1; l++) {
        const mlp_layer *a = &res->layers[l], *b = &ref[l];
        for (int i = 0; i < a->in * a->out; i++)
            if (rel_diff(a->w[i], b->w[i]) > 1e-6) {
                fprintf(stderr, "FAIL: stage %u layer %d w[%d]: %.9g vs %.9g\n", s, l, i, a->w[i],
                        b->w[i]);
                return 0;
            }
        for (int o = 0; o < a->out; o++)
            if (rel_diff(a->b[o], b->b[o]) > 1e-6) {
                fprintf(stderr, "FAIL: stage %u layer %d b[%d]: %.9g vs %.9g\n", s, l, o, a->b[o],
                        b->b[o]);
                return 0;
            }
    }
    return 1;
}

static void *die_later(void *p)
{
    (void)p;
    struct timespec ts = {0, 400 * 1000000L};
    nanosleep(&ts, NULL);
    raise(SIGKILL); /* as kill -9 from outside: no cleanup, no goodbye */
    return NULL;
}

static int train_rank(epipe_comm *c, unsigned rank, unsigned size, void *p)
{
    const struct train_arg *a = p;
    if ((int)rank == a->victim) {
        pthread_t th;
        CHECK(pthread_create(&th, NULL, die_later, NULL) == 0);
    }
    struct host_result res;
    host_run(c, &a->cfg, &res); /* destroys c */
    int ok = 1;
    if (a->victim >= 0) {
        /* Every surviving stage stops with the dead peer's status, and
         * its error names the rank that died, not only a neighbour that
         * relayed the failure or aborted because of it. */
        char victim[32];
        snprintf(victim, sizeof victim, "rank %d", a->victim);
        ok = (res.rc == EPIPE_EPEER || res.rc == EPIPE_ETIMEDOUT) && strstr(res.error, victim);
        printf("rank %u: training %s: %s\n", rank, epipe_status_name(res.rc), res.error);
    } else if (res.rc != EPIPE_OK) {
        fprintf(stderr, "FAIL: stage %u: %s: %s\n", rank, epipe_status_name(res.rc), res.error);
        ok = 0;
    } else if (a->ref) {
        ok = params_match(&res, rank, a->ref);
        if (ok && rank + 1 == size && fabs(res.last_loss - a->ref_last) > 1e-6 * a->ref_last) {
            fprintf(stderr, "FAIL: last loss %.9g, reference %.9g\n", res.last_loss, a->ref_last);
            ok = 0;
        }
    } else if (rank + 1 == size && a->min_fall > 0) {
        printf("%s p=%u: loss %.5f -> %.5f\n", a->cfg.schedule, size, res.first_loss,
               res.last_loss);
        ok = res.last_loss < a->min_fall * res.first_loss;
    }
    host_result_free(&res);
    return ok ? CONF_PASS : CONF_FAIL;
}

/* Pipelined training over 2, 3 and 4 stages, both schedules, driven by
 * callbacks and by the op stream, 1, 4 and 8 micro-batches, codec none:
 * every stage's parameters equal those of one-process training. */
static int test_train_equal(void)
{
    static const char *kinds[] = {"gpipe", "1f1b"};
    static const unsigned mbs[] = {4, 1, 8};
    /* Slow tools (valgrind) check memory, not arithmetic: 4 micro-batches
     * only, a third of the runs. */
    unsigned nmb = conf_time_scale() > 1.0 ? 1 : 3;
    if (nmb < 3)
        printf("EPIPE_CONF_TIME_SCALE > 1: 4 micro-batches only\n");
    int result = CONF_PASS;
    for (unsigned mi = 0; mi < nmb && result == CONF_PASS; mi++) {
        struct train_arg a = {.cfg = {.microbatches = mbs[mi], .steps = 6}, .victim = -1};
        mlp_layer ref[HOST_MAX_LAYERS];
        double ref_first;
        host_reference(mbs[mi], 6, ref, &ref_first, &a.ref_last);
        a.ref = ref;
        if (!(a.ref_last < ref_first)) { /* the reference itself learns */
            fprintf(stderr, "FAIL: the reference's loss did not fall: %g -> %g\n", ref_first,
                    a.ref_last);
            result = CONF_FAIL;
        }
        for (unsigned p = 2; p <= 4 && result == CONF_PASS; p++)
            for (int k = 0; k < 2 && result == CONF_PASS; k++)
                for (int stream = 0; stream < 2 && result == CONF_PASS; stream++) {
                    a.cfg.schedule = kinds[k];
                    a.cfg.use_op_stream = stream;
                    result = conf_run(p, "timeout_ms=10000", train_rank, &a, 0, 60);
                    if (result != CONF_PASS)
                        fprintf(stderr, "  (p=%u %s, %u micro-batches, %s)\n", p, kinds[k], mbs[mi],
                                stream ? "op stream" : "callbacks");
                }
        for (int l = 0; l < host_nlayers; l++)
            mlp_layer_free(&ref[l]);
    }
    return result;
}

/* With sortquant:bits=8 on every boundary the loss falls (below 0.7x). */
static int test_train_codec(void)
{
    static const struct {
        unsigned p;
        const char *sched;
    } runs[] = {{2, "1f1b"}, {3, "gpipe"}, {4, "1f1b"}};
    for (int i = 0; i < 3; i++) {
        struct train_arg a = {.cfg = {.schedule = runs[i].sched,
                                      .microbatches = 4,
                                      .steps = 40,
                                      .act_codec = "sortquant:bits=8",
                                      .grad_codec = "sortquant:bits=8"},
                              .victim = -1,
                              .min_fall = 0.7};
        int rc = conf_run(runs[i].p, "timeout_ms=10000", train_rank, &a, 0, 60);
        if (rc != CONF_PASS)
            return rc;
    }
    return CONF_PASS;
}

/* kill -9 of a stage mid-step (the middle of 3, the last of 4): every
 * other stage stops with EPIPE_EPEER or EPIPE_ETIMEDOUT naming the dead
 * rank, well within the harness's limit. */
static int test_train_dead_peer(void)
{
    static const unsigned sizes[] = {3, 4}, victims[] = {1, 3};
    for (int i = 0; i < 2; i++) {
        struct train_arg a = {.cfg = {.schedule = "1f1b", .microbatches = 4, .steps = 1000000},
                              .victim = (int)victims[i]};
        int rc = conf_run(sizes[i], "timeout_ms=3000", train_rank, &a, 1u << victims[i], 15);
        if (rc != CONF_PASS)
            return rc;
    }
    return CONF_PASS;
}

const struct conf_test conf_training_tests[] = {
    {"train-equal", test_train_equal, NULL},
    {"train-codec", test_train_codec, NULL},
    {"train-dead-peer", test_train_dead_peer,
     "ranks of inproc are threads of one process: none can be killed alone"},
    {NULL, NULL, NULL},
};
