/* The stage runtime with the schedules without a flush: 1f1b-async and
 * 1f1b-2bw train the test MLP exactly as one process that uses the same
 * stale weights (weight stashing), by callbacks and by the op stream; the
 * drain; and the calls refused while micro-batches are in flight. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "pipeline_host.h"

#define STEPS 5
#define MAX_P 4

static void run_ranks(unsigned p, const struct host_config *cfg, struct host_rank *a)
{
    assert_int_equal(host_run_threads(p, cfg, a), 0);
}

/* The worst relative difference of the ranks' layers from ref. */
static double worst_diff(struct host_rank *a, unsigned p, const mlp_layer *ref, const char *what)
{
    double worst = 0;
    int held[HOST_MAX_LAYERS] = {0};
    for (unsigned r = 0; r < p; r++) {
        if (a[r].res.rc)
            fail_msg("%s: rank %u failed with %s: %s", what, r, epipe_status_name(a[r].res.rc),
                     a[r].res.error);
        for (int l = 0; l < host_nlayers; l++) {
            if (!a[r].res.owns[l])
                continue;
            held[l]++;
            const mlp_layer *x = &a[r].res.layers[l], *y = &ref[l];
            for (int i = 0; i < x->in * x->out; i++)
                worst = fmax(worst, host_rel_diff(x->w[i], y->w[i]));
            for (int o = 0; o < x->out; o++)
                worst = fmax(worst, host_rel_diff(x->b[o], y->b[o]));
        }
    }
    for (int l = 0; l < host_nlayers; l++)
        assert_int_equal(held[l], 1);
    return worst;
}

/* 2-4 ranks, m = p and more, both kinds, callbacks and op stream: the
 * weights equal the stale-weights reference within 1e-6, the loss of the
 * last step too; and they differ from the flush reference (the staleness
 * is real, so the first comparison can fail). */
static void equals_the_stale_weights_reference(void **state)
{
    (void)state;
    static const struct {
        unsigned p, m;
    } sizes[] = {{2, 2}, {2, 4}, {3, 4}, {4, 4}, {4, 8}};
    static const char *const kinds[] = {"1f1b-async", "1f1b-2bw"};
    for (int k = 0; k < 2; k++)
        for (size_t z = 0; z < sizeof sizes / sizeof sizes[0]; z++) {
            unsigned p = sizes[z].p, m = sizes[z].m;
            int weights = k ? EPIPE_WEIGHTS_DOUBLE : EPIPE_WEIGHTS_STASHED;
            mlp_layer ref[HOST_MAX_LAYERS], flush[HOST_MAX_LAYERS];
            double first, last, ffirst, flast;
            host_reference_async(weights, p, m, STEPS, ref, &first, &last);
            host_reference(m, STEPS, flush, &ffirst, &flast);
            for (int stream = 0; stream < 2; stream++) {
                struct host_config cfg = {.schedule = kinds[k],
                                          .microbatches = m,
                                          .steps = STEPS,
                                          .use_op_stream = stream};
                struct host_rank a[MAX_P];
                run_ranks(p, &cfg, a);
                char what[96];
                snprintf(what, sizeof what, "%s p=%u m=%u %s", kinds[k], p, m,
                         stream ? "op stream" : "callbacks");
                double d = worst_diff(a, p, ref, what);
                if (d > 1e-6)
                    fail_msg("%s: worst relative difference %.3g from the stale-weights "
                             "reference",
                             what, d);
                double df = worst_diff(a, p, flush, what);
                if (df < 1e-4)
                    fail_msg("%s: equals the flush reference (%.3g): no staleness?", what, df);
                for (unsigned r = 0; r < p; r++) {
                    if (a[r].res.holds_last)
                        assert_true(fabs(a[r].res.last_loss - last) <= 1e-6 * fabs(last));
                    host_result_free(&a[r].res);
                }
            }
            for (int l = 0; l < host_nlayers; l++)
                mlp_layer_free(&ref[l]), mlp_layer_free(&flush[l]);
        }
}

/* Two stages by hand with callbacks: after a step, micro-batches are in
 * flight, so forward-only steps are refused until epipe_stage_drain(); a
 * drain with nothing in flight, or on a schedule that flushes, is a no-op. */
struct manual {
    epipe_comm *comm;
    const char *kind;
    int rc[8];
    char err[8][256];
    int n;
};

static float buf[64];

static int fwd(void *user, unsigned mb, const DLTensor *in, const DLTensor **out)
{
    static int64_t shape[2] = {2, 4};
    static DLTensor t = {
        .data = buf, .device = {kDLCPU, 0}, .ndim = 2, .dtype = {kDLFloat, 32, 1}, .shape = shape};
    (void)user, (void)mb, (void)in;
    *out = &t;
    return 0;
}

static int bwd(void *user, unsigned mb, const DLTensor *g, const DLTensor **gin)
{
    return fwd(user, mb, g, gin);
}

#define RECORD(m, st, call)                                                                        \
    do {                                                                                           \
        (m)->rc[(m)->n] = (call);                                                                  \
        snprintf((m)->err[(m)->n], sizeof(m)->err[0], "%s", epipe_stage_last_error(st));           \
        (m)->n++;                                                                                  \
    } while (0)

static void *manual_rank(void *p)
{
    struct manual *m = p;
    epipe_stage *st;
    if (epipe_stage_create(&st, m->comm, m->kind, 2) != EPIPE_OK) {
        m->rc[m->n++] = -1000;
        epipe_comm_abort(m->comm);
        return NULL;
    }
    epipe_stage_callbacks cb = EPIPE_STAGE_CALLBACKS_INIT;
    cb.forward = fwd;
    cb.backward = bwd;
    epipe_stage_set_callbacks(st, &cb);
    RECORD(m, st, epipe_stage_drain(st));                              /* 0: nothing yet */
    RECORD(m, st, epipe_stage_step(st));                               /* 1 */
    RECORD(m, st, epipe_stage_set_param(st, EPIPE_STAGE_TRAINING, 0)); /* 2 */
    RECORD(m, st, epipe_stage_step(st));                               /* 3: steady */
    RECORD(m, st, epipe_stage_drain(st));                              /* 4 */
    RECORD(m, st, epipe_stage_drain(st));                              /* 5: again: no-op */
    RECORD(m, st, epipe_stage_set_param(st, EPIPE_STAGE_TRAINING, 0)); /* 6 */
    RECORD(m, st, epipe_stage_step(st));                               /* 7: forward only */
    epipe_stage_destroy(st);
    epipe_comm_destroy(m->comm);
    return NULL;
}

static void drain_and_the_calls_it_guards(void **state)
{
    (void)state;
    static const char *const kinds[] = {"1f1b-async", "1f1b-2bw", "1f1b"};
    for (int k = 0; k < 3; k++) {
        epipe_comm *c[2];
        struct manual m[2];
        pthread_t tid[2];
        assert_int_equal(epipe_comm_create_inproc(c, 2), EPIPE_OK);
        for (int r = 0; r < 2; r++) {
            memset(&m[r], 0, sizeof m[r]);
            m[r].comm = c[r], m[r].kind = kinds[k];
            assert_int_equal(pthread_create(&tid[r], NULL, manual_rank, &m[r]), 0);
        }
        for (int r = 0; r < 2; r++)
            pthread_join(tid[r], NULL);
        int async = k < 2;
        for (int r = 0; r < 2; r++) {
            assert_int_equal(m[r].n, 8);
            for (int i = 0; i < 8; i++) {
                /* rank 1 is the last stage: nothing of its own stays in
                 * flight, but it still runs the stream's lists */
                int refused = async && i == 2;
                if (refused) {
                    assert_int_equal(m[r].rc[i], EPIPE_ESTATE);
                    assert_non_null(strstr(m[r].err[i], "epipe_stage_drain() first"));
                } else if (m[r].rc[i] != EPIPE_OK) {
                    fail_msg("%s rank %d call %d: %s", kinds[k], r, i, m[r].err[i]);
                }
            }
        }
    }
}

/* A rank that runs 1f1b-async against one that runs 1f1b fails at the
 * first message naming both. */
static void mismatched_with_a_flushing_kind(void **state)
{
    (void)state;
    epipe_comm *c[2];
    struct host_rank a[2];
    pthread_t tid[2];
    assert_int_equal(epipe_comm_create_inproc(c, 2), EPIPE_OK);
    static const char *const kinds[] = {"1f1b", "1f1b-async"};
    for (int r = 0; r < 2; r++) {
        memset(&a[r], 0, sizeof a[r]);
        a[r].comm = c[r];
        a[r].cfg = (struct host_config){.schedule = kinds[r], .microbatches = 2, .steps = 2};
        assert_int_equal(pthread_create(&tid[r], NULL, host_rank_thread, &a[r]), 0);
    }
    for (int r = 0; r < 2; r++)
        pthread_join(tid[r], NULL);
    assert_int_equal(a[1].res.rc, EPIPE_EPROTO);
    assert_non_null(strstr(a[1].res.error, "runs schedule '1f1b' but this rank runs '1f1b-async'"));
    assert_int_not_equal(a[0].res.rc, EPIPE_OK);
    for (int r = 0; r < 2; r++)
        host_result_free(&a[r].res);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(equals_the_stale_weights_reference),
        cmocka_unit_test(drain_and_the_calls_it_guards),
        cmocka_unit_test(mismatched_with_a_flushing_kind),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
