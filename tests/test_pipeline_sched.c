/* The stage runtime with the schedules of issue 13: a shape per micro-batch,
 * the schedule fingerprint check, split backward, and chunks (virtual stages). */
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

#include "pipeline_host.h"
#include "stage/stage_raw.h"

#define STEPS 4
#define MAX_P 4

static float data[256];

static DLTensor tensor2d(int64_t *shape, int64_t rows, int64_t cols)
{
    shape[0] = rows, shape[1] = cols;
    DLTensor t = {
        .data = data, .device = {kDLCPU, 0}, .ndim = 2, .dtype = {kDLFloat, 32, 1}, .shape = shape};
    return t;
}

static void expect_error(const char *msg, int rc, int want, const char *needle)
{
    if (rc != want || !strstr(msg, needle))
        fail_msg("got %s '%s', wanted %s mentioning '%s'", epipe_status_name(rc), msg,
                 epipe_status_name(want), needle);
}

static void next_is(epipe_stage *st, uint32_t kind, unsigned mb)
{
    epipe_op op;
    assert_int_equal(epipe_stage_next_op(st, &op), EPIPE_OK);
    if (op.kind != kind || op.microbatch != mb)
        fail_msg("next op is %s %u, wanted %s %u", epipe_op_kind_name(op.kind), op.microbatch,
                 epipe_op_kind_name(kind), mb);
}

/* ---- a shape per micro-batch -------------------------------------------- */

/* Micro-batch i sends [2, 3+i] on the same boundary; the receiver learns
 * each shape from its message, the gradients go back in the same shapes,
 * and a gradient in another micro-batch's shape is refused with both shapes
 * in the message. */
static void each_microbatch_has_its_shape(void **state)
{
    (void)state;
    enum { M = 3 };
    epipe_comm *c[2];
    epipe_stage *s0, *s1;
    int64_t shape[M][2];
    const DLTensor *in;
    for (int i = 0; i < 256; i++)
        data[i] = (float)i;
    assert_int_equal(epipe_comm_create_inproc(c, 2), EPIPE_OK);
    assert_int_equal(epipe_stage_create(&s0, c[0], "gpipe", M), EPIPE_OK);
    assert_int_equal(epipe_stage_create(&s1, c[1], "gpipe", M), EPIPE_OK);
    for (unsigned i = 0; i < M; i++) {
        DLTensor t = tensor2d(shape[i], 2, 3 + i);
        next_is(s0, EPIPE_OP_FORWARD, i);
        assert_int_equal(epipe_stage_send_activation(s0, i, &t), EPIPE_OK);
    }
    for (unsigned i = 0; i < M; i++) {
        next_is(s1, EPIPE_OP_FORWARD, i);
        assert_int_equal(epipe_stage_recv_activation(s1, i, &in), EPIPE_OK);
        assert_int_equal(in->ndim, 2);
        assert_int_equal(in->shape[0], 2);
        assert_int_equal(in->shape[1], 3 + i);
        assert_true(((const float *)in->data)[2 * (3 + i) - 1] == (float)(2 * (3 + i) - 1));
    }
    for (unsigned i = 0; i < M; i++) {
        next_is(s1, EPIPE_OP_BACKWARD, i);
        int64_t other[2];
        DLTensor wrong = tensor2d(other, 2, 3 + (i + 1) % M);
        expect_error(epipe_stage_last_error(s1), epipe_stage_send_gradient(s1, i, &wrong),
                     EPIPE_EINVAL, "");
        char want[64];
        snprintf(want, sizeof want, "[2,%u] f32 vs [2,%u] f32", 3 + (i + 1) % M, 3 + i);
        expect_error(epipe_stage_last_error(s1), EPIPE_EINVAL, EPIPE_EINVAL, want);
        DLTensor g = tensor2d(shape[i], 2, 3 + i);
        assert_int_equal(epipe_stage_send_gradient(s1, i, &g), EPIPE_OK);
    }
    next_is(s1, EPIPE_OP_NONE, 0);
    for (unsigned i = 0; i < M; i++) {
        next_is(s0, EPIPE_OP_BACKWARD, i);
        assert_int_equal(epipe_stage_recv_gradient(s0, i, &in), EPIPE_OK);
        assert_int_equal(in->shape[1], 3 + i);
    }
    next_is(s0, EPIPE_OP_NONE, 0);
    epipe_stage_destroy(s0);
    epipe_stage_destroy(s1);
    epipe_comm_destroy(c[0]);
    epipe_comm_destroy(c[1]);
}

/* ---- the schedule fingerprint ------------------------------------------- */

/* Ranks that run different schedules (or the same kind with another
 * micro-batch count) fail at the first message, naming both, and nobody
 * hangs: the failing rank aborts its communicator. */
static void mismatched_schedules_fail_at_the_first_message(void **state)
{
    (void)state;
    static const struct {
        const char *k0, *k1;
        unsigned m0, m1;
        const char *needle;
    } cases[] = {
        {"gpipe", "1f1b", 4, 4, "rank 0 runs schedule 'gpipe' but this rank runs '1f1b'"},
        {"1f1b", "gpipe", 4, 4, "rank 0 runs schedule '1f1b' but this rank runs 'gpipe'"},
        {"1f1b", "1f1b", 4, 2, "rank 0 runs schedule '1f1b' and so does this rank, but"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        epipe_comm *c[2];
        struct host_rank a[2];
        pthread_t tid[2];
        assert_int_equal(epipe_comm_create_inproc(c, 2), EPIPE_OK);
        for (int r = 0; r < 2; r++) {
            memset(&a[r], 0, sizeof a[r]);
            a[r].comm = c[r];
            a[r].cfg.schedule = r ? cases[k].k1 : cases[k].k0;
            a[r].cfg.microbatches = r ? cases[k].m1 : cases[k].m0;
            a[r].cfg.steps = 2;
            assert_int_equal(pthread_create(&tid[r], NULL, host_rank_thread, &a[r]), 0);
        }
        for (int r = 0; r < 2; r++)
            pthread_join(tid[r], NULL);
        expect_error(a[1].res.error, a[1].res.rc, EPIPE_EPROTO, cases[k].needle);
        assert_int_not_equal(a[0].res.rc, EPIPE_OK);
        for (int r = 0; r < 2; r++)
            host_result_free(&a[r].res);
    }
}

/* ---- chunks and split backward on raw op lists ---------------------------- */

static void run_ranks(unsigned p, const struct host_config *cfg, struct host_rank *a)
{
    assert_int_equal(host_run_threads(p, cfg, a), 0);
}

/* Every layer is held by exactly one rank and equals the reference's. */
static void assert_equal_to_reference(struct host_rank *a, unsigned p, const mlp_layer *ref,
                                      double ref_last, const char *what)
{
    int held[HOST_MAX_LAYERS] = {0};
    int losses = 0;
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
                if (host_rel_diff(x->w[i], y->w[i]) > 1e-6)
                    fail_msg("%s: rank %u layer %d w[%d]: %.9g vs %.9g", what, r, l, i, x->w[i],
                             y->w[i]);
            for (int o = 0; o < x->out; o++)
                if (host_rel_diff(x->b[o], y->b[o]) > 1e-6)
                    fail_msg("%s: rank %u layer %d b[%d]", what, r, l, o);
        }
        if (a[r].res.holds_last) {
            losses++;
            assert_true(fabs(a[r].res.last_loss - ref_last) <= 1e-6 * ref_last);
        }
    }
    for (int l = 0; l < host_nlayers; l++)
        assert_int_equal(held[l], 1);
    assert_int_equal(losses, 1);
}

/* Chunks on any placement (client-server 0,1,0; a local boundary 0,0,1;
 * round-robin; a V with an empty stage), with and without split backward,
 * by callbacks and by the op stream: the parameters equal single-process
 * training within 1e-6 relative. */
static void chunks_and_split_backward_equal_one_process(void **state)
{
    (void)state;
    static const struct {
        unsigned ranks, P, placement[HOST_RAW_MAX_STAGES];
    } layouts[] = {
        {2, 3, {0, 1, 0}},
        {2, 3, {0, 0, 1}},
        {2, 4, {0, 1, 0, 1}},
        {3, 6, {0, 1, 2, 2, 1, 0}},
        {4, 8, {0, 1, 2, 3, 0, 1, 2, 3}},
    };
    enum { M = 4 };
    mlp_layer ref[HOST_MAX_LAYERS];
    double ref_first, ref_last;
    host_reference(M, STEPS, ref, &ref_first, &ref_last);
    static struct host_raw_layout L;
    for (size_t k = 0; k < sizeof layouts / sizeof layouts[0]; k++)
        for (int split = 0; split < 2; split++)
            for (int stream = 0; stream < 2; stream++) {
                L.P = layouts[k].P;
                L.ranks = layouts[k].ranks;
                L.m = M;
                L.split = split;
                memcpy(L.placement, layouts[k].placement, sizeof L.placement);
                assert_int_equal(host_build_raw(&L), 0);
                struct host_config cfg = {.microbatches = M,
                                          .steps = STEPS,
                                          .use_op_stream = stream,
                                          .split = split,
                                          .create = host_create_raw,
                                          .create_arg = &L};
                struct host_rank a[MAX_P];
                run_ranks(L.ranks, &cfg, a);
                char what[96];
                snprintf(what, sizeof what, "layout %zu, split %d, %s", k, split,
                         stream ? "op stream" : "callbacks");
                assert_equal_to_reference(a, L.ranks, ref, ref_last, what);
                for (unsigned r = 0; r < L.ranks; r++)
                    host_result_free(&a[r].res);
            }
    for (int l = 0; l < host_nlayers; l++)
        mlp_layer_free(&ref[l]);
}

/* Every schedule kind of the library, on every layout here that it takes
 * (the client-server split 0,1,0, an out-and-back 0,1,2,1,0, round-robin
 * chunks, the kind's defaults on 2 and 4 ranks), trains exactly as one
 * process, by callbacks and by the op stream. Kinds that split the backward
 * run with the split callbacks. */
static void schedule_layouts_equal_one_process(void **state)
{
    (void)state;
    static const unsigned cs[] = {0, 1, 0}, oab[] = {0, 1, 2, 1, 0};
    static const struct {
        unsigned ranks, chunks;
        const unsigned *placement;
        unsigned len;
    } layouts[] = {{2, 0, cs, 3},   {3, 0, oab, 5},  {2, 2, NULL, 0}, {3, 2, NULL, 0},
                   {2, 0, NULL, 0}, {4, 0, NULL, 0}, {4, 2, NULL, 0}};
    enum { M = 4 };
    mlp_layer ref[HOST_MAX_LAYERS];
    double first, last;
    host_reference(M, STEPS, ref, &first, &last);
    int ran = 0;
    for (size_t k = 0; epipe_schedule_kind_name(k); k++) {
        const char *kind = epipe_schedule_kind_name(k);
        for (size_t l = 0; l < sizeof layouts / sizeof layouts[0]; l++) {
            epipe_schedule *sc;
            epipe_schedule_layout lay = EPIPE_SCHEDULE_LAYOUT_INIT;
            lay.chunks = layouts[l].chunks;
            lay.placement = layouts[l].placement;
            lay.placement_len = layouts[l].len;
            if (epipe_schedule_create_layout(&sc, kind, layouts[l].ranks, M, &lay) != EPIPE_OK)
                continue; /* a layout this kind does not take */
            int split = epipe_schedule_splits_backward(sc);
            int flush = epipe_schedule_weights(sc) == EPIPE_WEIGHTS_FLUSH;
            epipe_schedule_destroy(sc);
            if (!flush)
                continue; /* stale weights by design: test_pipeline_async.c */
            for (int stream = 0; stream < 2; stream++) {
                struct host_config cfg = {.schedule = kind,
                                          .microbatches = M,
                                          .steps = STEPS,
                                          .use_op_stream = stream,
                                          .split = split,
                                          .chunks = layouts[l].chunks,
                                          .placement = layouts[l].placement,
                                          .placement_len = layouts[l].len};
                struct host_rank a[MAX_P];
                run_ranks(layouts[l].ranks, &cfg, a);
                char what[96];
                snprintf(what, sizeof what, "%s, layout %zu, %s", kind, l,
                         stream ? "op stream" : "callbacks");
                assert_equal_to_reference(a, layouts[l].ranks, ref, last, what);
                for (unsigned r = 0; r < layouts[l].ranks; r++)
                    host_result_free(&a[r].res);
                ran++;
            }
        }
    }
    print_message("%d runs of the library's kinds on other layouts\n", ran);
    assert_true(ran >= 4); /* gpipe and 1f1b on the client-server split at least */
    for (int l = 0; l < host_nlayers; l++)
        mlp_layer_free(&ref[l]);
}

/* Ranks that agree on the kind but not on the placement fail at the first
 * message too. */
static void mismatched_placement_fails_at_the_first_message(void **state)
{
    (void)state;
    static const unsigned cs[] = {0, 1, 0}, other[] = {0, 1, 1};
    epipe_comm *c[2];
    struct host_rank a[2];
    pthread_t tid[2];
    assert_int_equal(epipe_comm_create_inproc(c, 2), EPIPE_OK);
    for (int r = 0; r < 2; r++) {
        memset(&a[r], 0, sizeof a[r]);
        a[r].comm = c[r];
        a[r].cfg = (struct host_config){.schedule = "1f1b",
                                        .microbatches = 4,
                                        .steps = 2,
                                        .placement = r ? other : cs,
                                        .placement_len = 3};
        assert_int_equal(pthread_create(&tid[r], NULL, host_rank_thread, &a[r]), 0);
    }
    for (int r = 0; r < 2; r++)
        pthread_join(tid[r], NULL);
    expect_error(a[1].res.error, a[1].res.rc, EPIPE_EPROTO,
                 "rank 0 runs schedule '1f1b' and so does this rank, but");
    for (int r = 0; r < 2; r++)
        host_result_free(&a[r].res);
}

/* A host without split callbacks runs a splitting list with its plain
 * backward (at the input-gradient op) and still trains exactly. */
static void plain_backward_runs_a_split_list(void **state)
{
    (void)state;
    enum { M = 4 };
    mlp_layer ref[HOST_MAX_LAYERS];
    double f, last;
    host_reference(M, STEPS, ref, &f, &last);
    static struct host_raw_layout L = {
        .P = 3, .ranks = 2, .m = M, .split = 1, .placement = {0, 1, 0}};
    assert_int_equal(host_build_raw(&L), 0);
    struct host_config cfg = {
        .microbatches = M, .steps = STEPS, .split = 0, .create = host_create_raw, .create_arg = &L};
    struct host_rank a[2];
    run_ranks(2, &cfg, a);
    assert_equal_to_reference(a, 2, ref, last, "plain backward on a split list");
    for (unsigned r = 0; r < 2; r++)
        host_result_free(&a[r].res);
    for (int l = 0; l < host_nlayers; l++)
        mlp_layer_free(&ref[l]);
}

static double max_rel_diff(struct host_rank *a, unsigned p, const mlp_layer *ref)
{
    double worst = 0;
    for (unsigned r = 0; r < p; r++)
        for (int l = 0; l < host_nlayers; l++)
            for (int i = 0; a[r].res.owns[l] && i < ref[l].in * ref[l].out; i++)
                worst = fmax(worst, host_rel_diff(a[r].res.layers[l].w[i], ref[l].w[i]));
    return worst;
}

/* A boundary between two chunks of one rank copies its tensors unless the
 * host set a codec on it: bf16 activations there change the result a
 * little (and training still works); and a trainable codec cannot go
 * there. */
static void local_boundary_uses_its_codec_only_when_set(void **state)
{
    (void)state;
    enum { M = 4 };
    mlp_layer ref[HOST_MAX_LAYERS];
    double first, last;
    host_reference(M, STEPS, ref, &first, &last);
    static struct host_raw_layout L = {.P = 3, .ranks = 2, .m = M, .placement = {0, 0, 1}};
    assert_int_equal(host_build_raw(&L), 0);
    struct host_config cfg = {.microbatches = M,
                              .steps = STEPS,
                              .create = host_create_raw,
                              .create_arg = &L,
                              .act_codec = "cast:dtype=bf16",
                              .one_boundary = 1,
                              .boundary = 1}; /* between the ranks: not the local one */
    struct host_rank a[2];
    run_ranks(2, &cfg, a);
    double remote = max_rel_diff(a, 2, ref);
    for (unsigned r = 0; r < 2; r++)
        assert_int_equal(a[r].res.rc, EPIPE_OK), host_result_free(&a[r].res);
    cfg.boundary = 0; /* the local boundary, between chunks 0 and 1 of rank 0 */
    run_ranks(2, &cfg, a);
    double local = max_rel_diff(a, 2, ref);
    for (unsigned r = 0; r < 2; r++)
        assert_int_equal(a[r].res.rc, EPIPE_OK);
    assert_true(a[0].res.stats.act_sent_wire == a[1].res.stats.act_recv_wire);
    assert_true(a[0].res.last_loss == 0 && a[1].res.last_loss < a[1].res.first_loss);
    for (unsigned r = 0; r < 2; r++)
        host_result_free(&a[r].res);
    cfg.act_codec = NULL; /* nothing set: copied, exact */
    run_ranks(2, &cfg, a);
    double none = max_rel_diff(a, 2, ref);
    for (unsigned r = 0; r < 2; r++)
        host_result_free(&a[r].res);
    print_message("worst relative difference: bf16 on the local boundary %.3g, on the remote "
                  "one %.3g, none %.3g\n",
                  local, remote, none);
    assert_true(none <= 1e-6);
    assert_true(local > 1e-5 && remote > 1e-5);

    epipe_comm *c[2];
    epipe_stage *st;
    assert_int_equal(epipe_comm_create_inproc(c, 2), EPIPE_OK);
    assert_int_equal(epipe_stage_create_raw(&st, c[0], M, L.P, L.placement, L.ops[0], L.n[0], 0),
                     EPIPE_OK);
#ifdef EPIPE_HAVE_BLAS /* without -Dblas, creating insert fails first (EPIPE_ENOTSUP) */
    expect_error(epipe_stage_last_error(st),
                 epipe_stage_set_codec(st, EPIPE_DIR_ACTIVATION, 0, "insert:kind=linear,out=8"),
                 EPIPE_ENOTSUP, "boundary 0 joins two chunks of rank 0");
#endif
    assert_int_equal(epipe_stage_chunks(st), 2);
    unsigned g, P;
    assert_int_equal(epipe_stage_chunk_stage(st, 1, &g, &P), EPIPE_OK);
    assert_int_equal(g, 1);
    assert_int_equal(P, 3);
    assert_int_equal(epipe_stage_chunk_stage(st, 2, &g, &P), EPIPE_EINVAL);
    epipe_stage_destroy(st);
    epipe_comm_destroy(c[0]);
    epipe_comm_destroy(c[1]);
    for (int l = 0; l < host_nlayers; l++)
        mlp_layer_free(&ref[l]);
}

static int nop_fwd(void *u, unsigned mb, const DLTensor *in, const DLTensor **out)
{
    (void)u, (void)mb, (void)in, (void)out;
    return 0;
}
static int nop_bwd_in(void *u, unsigned mb, const DLTensor *g, const DLTensor **gin)
{
    (void)u, (void)mb, (void)g, (void)gin;
    return 0;
}
static int nop_bwd_w(void *u, unsigned mb)
{
    (void)u, (void)mb;
    return 0;
}

/* Split callbacks on a schedule that does not split, half a pair, and a
 * send during a weight-gradient op: each a clear error. */
static void split_backward_misuse_is_refused(void **state)
{
    (void)state;
    epipe_comm *c[2];
    epipe_stage *st;
    assert_int_equal(epipe_comm_create_inproc(c, 2), EPIPE_OK);
    assert_int_equal(epipe_stage_create(&st, c[1], "1f1b", 2), EPIPE_OK);
    epipe_stage_callbacks cb = EPIPE_STAGE_CALLBACKS_INIT;
    cb.forward = nop_fwd;
    cb.backward_input = nop_bwd_in;
    expect_error(epipe_stage_last_error(st), epipe_stage_set_callbacks(st, &cb), EPIPE_EINVAL,
                 "set both or neither");
    cb.backward_weight = nop_bwd_w;
    expect_error(epipe_stage_last_error(st), epipe_stage_set_callbacks(st, &cb), EPIPE_EINVAL,
                 "schedule '1f1b' does not split the backward");
    epipe_stage_destroy(st);

    /* rank 1 of a two-stage split list: F0, Bi0, W0 */
    epipe_op ops[] = {{EPIPE_OP_FORWARD, 0, 0, 0},
                      {EPIPE_OP_BACKWARD_INPUT, 0, 0, 0},
                      {EPIPE_OP_BACKWARD_WEIGHT, 0, 0, 0}};
    unsigned placement[2] = {0, 1};
    assert_int_equal(epipe_stage_create_raw(&st, c[1], 1, 2, placement, ops, 3, 1), EPIPE_OK);
    assert_int_equal(epipe_stage_set_callbacks(st, &cb), EPIPE_OK); /* it splits: accepted */
    epipe_op op;
    int64_t shape[2];
    DLTensor t = tensor2d(shape, 2, 4);
    const DLTensor *in;
    /* the activation of micro-batch 0 arrives from a stand-in rank 0 */
    epipe_stage *s0;
    epipe_op ops0[] = {{EPIPE_OP_FORWARD, 0, 0, 0}};
    assert_int_equal(epipe_stage_create_raw(&s0, c[0], 1, 2, placement, ops0, 1, 1), EPIPE_OK);
    next_is(s0, EPIPE_OP_FORWARD, 0);
    assert_int_equal(epipe_stage_send_activation(s0, 0, &t), EPIPE_OK);
    next_is(st, EPIPE_OP_FORWARD, 0);
    assert_int_equal(epipe_stage_current_op(st, &op), EPIPE_OK);
    assert_int_equal(op.kind, EPIPE_OP_FORWARD);
    assert_int_equal(epipe_stage_recv_activation(st, 0, &in), EPIPE_OK);
    next_is(st, EPIPE_OP_BACKWARD_INPUT, 0);
    expect_error(epipe_stage_last_error(st), epipe_stage_next_op(st, &op), EPIPE_ESTATE,
                 "input-gradient backward of micro-batch 0 ended without sending");
    assert_int_equal(epipe_stage_send_gradient(st, 0, &t), EPIPE_OK);
    next_is(st, EPIPE_OP_BACKWARD_WEIGHT, 0);
    assert_true(in->data != NULL); /* still lent: the weight-gradient op needs it */
    expect_error(epipe_stage_last_error(st), epipe_stage_send_gradient(st, 0, &t), EPIPE_ESTATE,
                 "during the weight-gradient backward of micro-batch 0 (which neither");
    next_is(st, EPIPE_OP_NONE, 0);
    expect_error(epipe_last_error(), epipe_stage_current_op(st, &op), EPIPE_ESTATE,
                 "no op is in progress");
    epipe_stage_destroy(st);
    epipe_stage_destroy(s0);
    epipe_comm_destroy(c[0]);
    epipe_comm_destroy(c[1]);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(each_microbatch_has_its_shape),
        cmocka_unit_test(mismatched_schedules_fail_at_the_first_message),
        cmocka_unit_test(chunks_and_split_backward_equal_one_process),
        cmocka_unit_test(plain_backward_runs_a_split_list),
        cmocka_unit_test(schedule_layouts_equal_one_process),
        cmocka_unit_test(mismatched_placement_fails_at_the_first_message),
        cmocka_unit_test(split_backward_misuse_is_refused),
        cmocka_unit_test(local_boundary_uses_its_codec_only_when_set),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
