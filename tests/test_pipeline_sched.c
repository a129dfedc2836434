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

struct rank_arg {
    epipe_comm *comm;
    struct host_config cfg;
    struct host_result res;
};

static void *rank_thread(void *p)
{
    struct rank_arg *a = p;
    host_run(a->comm, &a->cfg, &a->res);
    return NULL;
}

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
        struct rank_arg a[2];
        pthread_t tid[2];
        assert_int_equal(epipe_comm_create_inproc(c, 2), EPIPE_OK);
        for (int r = 0; r < 2; r++) {
            memset(&a[r], 0, sizeof a[r]);
            a[r].comm = c[r];
            a[r].cfg.schedule = r ? cases[k].k1 : cases[k].k0;
            a[r].cfg.microbatches = r ? cases[k].m1 : cases[k].m0;
            a[r].cfg.steps = 2;
            assert_int_equal(pthread_create(&tid[r], NULL, rank_thread, &a[r]), 0);
        }
        for (int r = 0; r < 2; r++)
            pthread_join(tid[r], NULL);
        expect_error(a[1].res.error, a[1].res.rc, EPIPE_EPROTO, cases[k].needle);
        assert_int_not_equal(a[0].res.rc, EPIPE_OK);
        for (int r = 0; r < 2; r++)
            host_result_free(&a[r].res);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(each_microbatch_has_its_shape),
        cmocka_unit_test(mismatched_schedules_fail_at_the_first_message),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
