/* Activation deltas (delta=1) in the stage runtime: the first stage's sample ids
 * travel with the activations to every later boundary, in training and evaluation. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <epipe/epipe.h>

#include "mlp.h"
#include "testutil.h"

/* 32 samples, 4 steps an epoch of 2 micro-batches of 4 rows, reshuffled
 * every epoch; the last evaluation step runs forwards only. */
enum { N = 32, R = 4, M = 2, SPE = N / (R * M), EPOCHS = 6, STEPS = SPE * EPOCHS };
enum { IN = 8, W = 16, OUT = 4, MAX_P = 4, MAX_RANKS = 3 };

struct run {
    const char *spec;          /* the activation codec on every boundary */
    int delta;                 /* spec has delta=1: the host passes ids on stage 0 */
    unsigned ranks, P;         /* P pipeline stages on `ranks` ranks */
    const unsigned *placement; /* NULL: one stage per rank */
    int boundary;              /* the coded boundary, or -1: all of them */
    /* ids[step][mb][row]: the samples of each micro-batch, known to all */
    uint64_t ids[STEPS + 1][M][R];
    /* Boundary b (stage b to b+1), per step and micro-batch: the activation
     * the host sent (truth), what a codec pair of the test reconstructs from
     * it with the same ids (shadow), and what the receiver got. */
    float truth[MAX_P][STEPS + 1][M][R * W];
    float shadow[MAX_P][STEPS + 1][M][R * W];
    float recv[MAX_P][STEPS + 1][M][R * W];
    epipe_codec_delta_info enc_info[MAX_P], dec_info[MAX_P], eval_enc[MAX_P];
    int rc[MAX_RANKS];
    char err[MAX_RANKS][256];
    epipe_comm *comm[MAX_RANKS];
};

static void sample_x(uint64_t id, float *x)
{
    test_fill(x, IN, DIST_NORMAL, 1000 + id);
}

static void sample_t(uint64_t id, float *t)
{
    test_fill(t, OUT, DIST_UNIFORM, 5000 + id);
}

static void make_ids(struct run *r)
{
    uint64_t perm[N];
    test_rng g;
    test_rng_seed(&g, 42);
    for (int s = 0; s <= STEPS; s++) {
        if (s % SPE == 0) { /* a new epoch: shuffle */
            for (int i = 0; i < N; i++)
                perm[i] = (uint64_t)i;
            for (int i = N - 1; i > 0; i--) {
                int j = (int)(test_rng_next(&g) % (uint64_t)(i + 1));
                uint64_t tmp = perm[i];
                perm[i] = perm[j], perm[j] = tmp;
            }
        }
        for (int m = 0; m < M; m++)
            for (int k = 0; k < R; k++)
                r->ids[s][m][k] = perm[(s % SPE) * R * M + m * R + k];
    }
}

struct rank_arg {
    struct run *run;
    unsigned rank;
};

static const char *err_text(const epipe_stage *st)
{
    const char *m = st ? epipe_stage_last_error(st) : NULL;
    return m && *m ? m : epipe_last_error();
}

#define CHECK(call)                                                                                \
    do {                                                                                           \
        if ((rc = (call)) != EPIPE_OK) {                                                           \
            snprintf(r->err[a->rank], sizeof r->err[0], "%s: %s", #call, err_text(st));            \
            goto out;                                                                              \
        }                                                                                          \
    } while (0)

static void *rank_main(void *p)
{
    struct rank_arg *a = p;
    struct run *r = a->run;
    epipe_stage *st = NULL;
    epipe_codec *senc[MAX_P] = {0}, *sdec[MAX_P] = {0};
    mlp_layer layer[MAX_P];
    memset(layer, 0, sizeof layer);
    /* per pipeline stage and micro-batch: input, output (kept for backward) */
    static __thread float xin[MAX_P][M][R * W], yout[MAX_P][M][R * W], dy[R * W], dx[R * W];
    uint8_t payload[4096];
    int rc = EPIPE_OK;
    epipe_schedule_layout lay = EPIPE_SCHEDULE_LAYOUT_INIT;
    lay.placement = r->placement;
    lay.placement_len = r->placement ? r->P : 0;
    CHECK(epipe_stage_create_layout(&st, r->comm[a->rank], "gpipe", M, &lay));
    CHECK(epipe_stage_set_codec(st, EPIPE_DIR_ACTIVATION,
                                r->boundary < 0 ? EPIPE_ALL_BOUNDARIES : (unsigned)r->boundary,
                                r->spec));
    CHECK(epipe_stage_set_param(st, EPIPE_STAGE_TIMEOUT_MS, 20000));
    for (unsigned g = 0; g < r->P; g++) {
        int in = g == 0 ? IN : W, out = g + 1 == r->P ? OUT : W;
        if ((rc = mlp_layer_init(&layer[g], in, out, g + 1 < r->P, 77 + g)) != 0) {
            snprintf(r->err[a->rank], sizeof r->err[0], "mlp_layer_init failed");
            goto out;
        }
        if (g + 1 < r->P && (r->boundary < 0 || (unsigned)r->boundary == g)) {
            CHECK(epipe_codec_create(&senc[g], r->spec));
            CHECK(epipe_codec_create(&sdec[g], r->spec));
        }
    }
    for (int s = 0; s <= STEPS; s++) {
        int eval = s == STEPS;
        if (eval)
            CHECK(epipe_stage_set_param(st, EPIPE_STAGE_TRAINING, 0));
        epipe_op op;
        for (;;) {
            CHECK(epipe_stage_next_op(st, &op));
            if (op.kind == EPIPE_OP_NONE)
                break;
            unsigned g, mb = op.microbatch;
            CHECK(epipe_stage_chunk_stage(st, op.chunk, &g, NULL));
            const uint64_t *ids = r->ids[s][mb];
            int first = g == 0, last = g + 1 == r->P;
            if (op.kind == EPIPE_OP_FORWARD) {
                if (first) {
                    for (int k = 0; k < R; k++)
                        sample_x(ids[k], &xin[g][mb][k * IN]);
                    if (r->delta)
                        CHECK(epipe_stage_set_samples(st, mb, ids, R));
                } else {
                    const DLTensor *t;
                    CHECK(epipe_stage_recv_activation(st, mb, &t));
                    memcpy(xin[g][mb], t->data, sizeof(float) * R * W);
                    memcpy(r->recv[g - 1][s][mb], t->data, sizeof(float) * R * W);
                }
                mlp_layer_forward(&layer[g], xin[g][mb], R, yout[g][mb]);
                if (last) {
                    float tg[R * OUT];
                    for (int k = 0; k < R; k++)
                        sample_t(ids[k], &tg[k * OUT]);
                    mlp_mse_loss(yout[g][mb], tg, R, OUT, R * M, dy);
                    continue;
                }
                /* the shadow: the same codec, fed the same ids */
                int64_t shape[2] = {R, W};
                DLTensor t = {.data = yout[g][mb],
                              .device = {kDLCPU, 0},
                              .ndim = 2,
                              .dtype = {kDLFloat, 32, 1},
                              .shape = shape};
                DLTensor o = t;
                o.data = r->shadow[g][s][mb];
                size_t len;
                memcpy(r->truth[g][s][mb], yout[g][mb], sizeof(float) * R * W);
                if (!senc[g]) { /* an uncoded boundary copies */
                    memcpy(o.data, yout[g][mb], sizeof(float) * R * W);
                } else {
                    if (r->delta)
                        CHECK(epipe_codec_set_samples(senc[g], eval ? NULL : ids, R));
                    CHECK(epipe_codec_encode(senc[g], &t, payload, sizeof payload, &len));
                    CHECK(epipe_codec_decode(sdec[g], payload, len, &o));
                }
                CHECK(epipe_stage_send_activation(st, mb, &t));
            } else {
                const float *gy = dy;
                if (!last) {
                    const DLTensor *t;
                    CHECK(epipe_stage_recv_gradient(st, mb, &t));
                    gy = t->data;
                    memcpy(dy, gy, sizeof(float) * R * W);
                } else { /* recompute the loss gradient of this micro-batch */
                    float tg[R * OUT];
                    for (int k = 0; k < R; k++)
                        sample_t(ids[k], &tg[k * OUT]);
                    mlp_mse_loss(yout[g][mb], tg, R, OUT, R * M, dy);
                }
                mlp_layer_backward(&layer[g], xin[g][mb], yout[g][mb], dy, R, first ? NULL : dx);
                if (!first) {
                    int64_t shape[2] = {R, W};
                    DLTensor t = {.data = dx,
                                  .device = {kDLCPU, 0},
                                  .ndim = 2,
                                  .dtype = {kDLFloat, 32, 1},
                                  .shape = shape};
                    CHECK(epipe_stage_send_gradient(st, mb, &t));
                }
            }
        }
        if (!eval)
            for (unsigned k = 0; k < epipe_stage_chunks(st); k++) {
                unsigned g;
                CHECK(epipe_stage_chunk_stage(st, k, &g, NULL));
                mlp_layer_sgd(&layer[g], 0.05f);
            }
        else if (r->delta) { /* the evaluation step's rows, seen by chunk 0's encoder */
            unsigned g;
            CHECK(epipe_stage_chunk_stage(st, 0, &g, NULL));
            epipe_codec *e = epipe_stage_codec(st, EPIPE_DIR_ACTIVATION, EPIPE_SIDE_DOWN);
            if (e)
                CHECK(epipe_codec_delta_stats(e, &r->eval_enc[g]));
        }
        if (s == STEPS - 1 && r->delta) { /* counters after training, chunk 0 */
            unsigned g;
            CHECK(epipe_stage_chunk_stage(st, 0, &g, NULL));
            epipe_codec *e = epipe_stage_codec(st, EPIPE_DIR_ACTIVATION, EPIPE_SIDE_DOWN);
            epipe_codec *d = epipe_stage_codec(st, EPIPE_DIR_ACTIVATION, EPIPE_SIDE_UP);
            if (e)
                CHECK(epipe_codec_delta_stats(e, &r->enc_info[g]));
            if (d)
                CHECK(epipe_codec_delta_stats(d, &r->dec_info[g - 1]));
        }
    }
out:
    r->rc[a->rank] = rc;
    if (rc)
        epipe_comm_abort(r->comm[a->rank]);
    for (unsigned g = 0; g < MAX_P; g++) {
        epipe_codec_destroy(senc[g]);
        epipe_codec_destroy(sdec[g]);
        mlp_layer_free(&layer[g]);
    }
    epipe_stage_destroy(st);
    return NULL;
}

static void run_pipeline(struct run *r)
{
    pthread_t th[MAX_RANKS];
    struct rank_arg args[MAX_RANKS];
    make_ids(r);
    assert_int_equal(epipe_comm_create_inproc(r->comm, r->ranks), EPIPE_OK);
    for (unsigned k = 0; k < r->ranks; k++) {
        args[k] = (struct rank_arg){r, k};
        r->rc[k] = -1;
        assert_int_equal(pthread_create(&th[k], NULL, rank_main, &args[k]), 0);
    }
    for (unsigned k = 0; k < r->ranks; k++)
        pthread_join(th[k], NULL);
    for (unsigned k = 0; k < r->ranks; k++)
        epipe_comm_destroy(r->comm[k]);
    for (unsigned k = 0; k < r->ranks; k++)
        if (r->rc[k])
            fail_msg("rank %u: %s", k, r->err[k]);
}

/* Mean squared error of what boundary b delivered against what was sent,
 * over the steps of one epoch. */
static double epoch_mse(const struct run *r, unsigned b, int epoch)
{
    double sum = 0;
    for (int s = epoch * SPE; s < (epoch + 1) * SPE; s++)
        for (int m = 0; m < M; m++)
            sum += test_mse(r->recv[b][s][m], r->truth[b][s][m], R * W);
    return sum / (SPE * M);
}

/* 2-bit activations on every boundary of a 3-stage pipeline (and of 4
 * stages on 2 ranks, two of whose boundaries join chunks of one rank): the
 * receiver gets, bit for bit, what a codec pair fed the same ids
 * reconstructs; every sample crosses every boundary once in full and then
 * as deltas; and the last epoch's activations are far more accurate than
 * the same training's without delta=1. */
static void check_pipeline(unsigned ranks, unsigned P, const unsigned *placement)
{
    static struct run with, without;
    memset(&with, 0, sizeof with);
    memset(&without, 0, sizeof without);
    /* first sightings coded too (delta_raw=0), so the first epoch's error
     * is the plain codec's and the last must be far below it */
    with.spec = "quant:bits=2,delta=1,delta_raw=0", with.delta = 1;
    without.spec = "quant:bits=2";
    with.ranks = without.ranks = ranks;
    with.P = without.P = P;
    with.placement = without.placement = placement;
    with.boundary = without.boundary = -1;
    run_pipeline(&with);
    run_pipeline(&without);
    for (unsigned b = 0; b + 1 < P; b++) {
        for (int s = 0; s <= STEPS; s++)
            for (int m = 0; m < M; m++)
                if (memcmp(with.recv[b][s][m], with.shadow[b][s][m], sizeof(float) * R * W))
                    fail_msg("boundary %u, step %d, micro-batch %d: the receiver's activation "
                             "differs from the shadow codec's",
                             b, s, m);
        double first = epoch_mse(&with, b, 0), last = epoch_mse(&with, b, EPOCHS - 1);
        double plain = epoch_mse(&without, b, EPOCHS - 1);
        print_message("boundary %u: MSE first epoch %.3g, last %.3g; without delta %.3g\n", b,
                      first, last, plain);
        assert_true(last < 0.25 * plain);
        assert_true(last < 0.25 * first);
    }
    /* counters of chunk 0 of each rank (one stage per rank: every boundary) */
    for (unsigned k = 0; k < ranks; k++) {
        unsigned g = placement ? 0 : k;
        if (placement) /* chunk 0 of rank k: its first pipeline stage */
            for (g = 0; placement[g] != k; g++)
                ;
        if (g + 1 < P) {
            assert_int_equal(with.enc_info[g].full_rows, N);
            assert_int_equal(with.enc_info[g].delta_rows, N * (EPOCHS - 1));
            assert_int_equal(with.enc_info[g].untracked_rows, 0);
            assert_int_equal(with.eval_enc[g].untracked_rows, R * M);
        }
        if (g > 0) {
            assert_int_equal(with.dec_info[g - 1].full_rows, N);
            assert_int_equal(with.dec_info[g - 1].delta_rows, N * (EPOCHS - 1));
        }
    }
}

static void three_ranks_train_with_deltas(void **state)
{
    (void)state;
    check_pipeline(3, 3, NULL);
}

static void local_boundaries_pass_the_ids_on(void **state)
{
    (void)state;
    static const unsigned placement[4] = {0, 0, 1, 1};
    check_pipeline(2, 4, placement);
}

/* Only the boundary between the ranks has delta=1; the ids cross the
 * uncoded boundary between chunks 0 and 1 of rank 0 with the tensor. */
static void local_copies_pass_the_ids_on(void **state)
{
    (void)state;
    static const unsigned placement[4] = {0, 0, 1, 1};
    static struct run r;
    memset(&r, 0, sizeof r);
    r.spec = "quant:bits=2,delta=1", r.delta = 1, r.ranks = 2, r.P = 4;
    r.placement = placement, r.boundary = 1;
    run_pipeline(&r);
    for (unsigned b = 0; b < 3; b++)
        for (int s = 0; s <= STEPS; s++)
            for (int m = 0; m < M; m++)
                if (memcmp(r.recv[b][s][m], r.shadow[b][s][m], sizeof(float) * R * W))
                    fail_msg("boundary %u, step %d, micro-batch %d differs", b, s, m);
    assert_int_equal(r.dec_info[1].full_rows, N); /* rank 1's chunk 0 is stage 2 */
    assert_int_equal(r.dec_info[1].delta_rows, N * (EPOCHS - 1));
}

static void expect_error(const char *msg, int rc, int want, const char *needle)
{
    if (rc != want || !strstr(msg, needle))
        fail_msg("got %s '%s', wanted %s mentioning '%s'", epipe_status_name(rc), msg,
                 epipe_status_name(want), needle);
}

/* delta=1 is refused on gradients; wrong id counts, missing ids and ids
 * on a later stage are refused with messages that say what is wrong. */
static void bad_use_is_refused(void **state)
{
    (void)state;
    epipe_comm *c[2];
    epipe_stage *s0, *s1;
    epipe_op op;
    float x[5 * W] = {0};
    uint64_t ids[5] = {1, 2, 3, 4, 5};
    int64_t shape[2] = {4, W};
    DLTensor t = {
        .data = x, .device = {kDLCPU, 0}, .ndim = 2, .dtype = {kDLFloat, 32, 1}, .shape = shape};
    assert_int_equal(epipe_comm_create_inproc(c, 2), EPIPE_OK);
    assert_int_equal(epipe_stage_create(&s0, c[0], "gpipe", 1), EPIPE_OK);
    assert_int_equal(epipe_stage_create(&s1, c[1], "gpipe", 1), EPIPE_OK);
    int rc = epipe_stage_set_codec(s0, EPIPE_DIR_GRADIENT, 0, "quant:bits=2,delta=1");
    expect_error(epipe_stage_last_error(s0), rc, EPIPE_EINVAL, "delta=1");
    assert_int_equal(epipe_stage_set_codec(s0, EPIPE_DIR_ACTIVATION, 0, "quant:bits=2,delta=1"),
                     EPIPE_OK);
    assert_int_equal(epipe_stage_set_codec(s1, EPIPE_DIR_ACTIVATION, 0, "quant:bits=2,delta=1"),
                     EPIPE_OK);
    rc = epipe_stage_set_samples(s1, 0, ids, 4);
    expect_error(epipe_stage_last_error(s1), rc, EPIPE_EINVAL, "first pipeline stage");
    rc = epipe_stage_set_samples(s0, 1, ids, 4);
    expect_error(epipe_stage_last_error(s0), rc, EPIPE_EINVAL, "micro-batch 1 of 1");
    assert_int_equal(epipe_stage_next_op(s0, &op), EPIPE_OK);
    assert_int_equal(op.kind, EPIPE_OP_FORWARD);
    rc = epipe_stage_send_activation(s0, 0, &t);
    expect_error(epipe_stage_last_error(s0), rc, EPIPE_EINVAL,
                 "epipe_stage_set_samples(0, ids, 4)");
    assert_int_equal(epipe_stage_set_samples(s0, 0, ids, 5), EPIPE_OK);
    rc = epipe_stage_send_activation(s0, 0, &t);
    expect_error(epipe_stage_last_error(s0), rc, EPIPE_EINVAL, "has 4 rows (dimension 0), but 5");
    ids[3] = 1; /* duplicate ids: the codec's refusal comes through */
    assert_int_equal(epipe_stage_set_samples(s0, 0, ids, 4), EPIPE_OK);
    rc = epipe_stage_send_activation(s0, 0, &t);
    assert_int_equal(rc, EPIPE_EINVAL);
    ids[3] = 4;
    assert_int_equal(epipe_stage_set_samples(s0, 0, ids, 4), EPIPE_OK);
    ids[0] = 99; /* copied at the call */
    assert_int_equal(epipe_stage_send_activation(s0, 0, &t), EPIPE_OK);
    const DLTensor *in;
    const uint64_t *got;
    size_t n;
    assert_int_equal(epipe_stage_next_op(s1, &op), EPIPE_OK);
    assert_int_equal(epipe_stage_recv_activation(s1, 0, &in), EPIPE_OK);
    epipe_codec *d = epipe_stage_codec(s1, EPIPE_DIR_ACTIVATION, EPIPE_SIDE_UP);
    assert_int_equal(epipe_codec_decoded_samples(d, &got, &n), EPIPE_OK);
    assert_int_equal(n, 4);
    assert_int_equal(got[0], 1);
    assert_int_equal(got[3], 4);
    epipe_stage_destroy(s0);
    epipe_stage_destroy(s1);
    epipe_comm_destroy(c[0]);
    epipe_comm_destroy(c[1]);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(three_ranks_train_with_deltas),
        cmocka_unit_test(local_boundaries_pass_the_ids_on),
        cmocka_unit_test(local_copies_pass_the_ids_on),
        cmocka_unit_test(bad_use_is_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
