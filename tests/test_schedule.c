/* Schedules and their simulator: gpipe and 1f1b for p in 1..6, m in 1..16
 * respect every dependency, hit the known bubble and memory bounds, and
 * broken op lists are caught (deadlock, dependency, FIFO order). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <epipe/schedule.h>

#include "schedule/schedule_impl.h"

static const char *const kinds[] = {"gpipe", "1f1b"};

static unsigned umin(unsigned a, unsigned b)
{
    return a < b ? a : b;
}

/* The compute ops (F = +mb+1, B = -(mb+1)) a stage must run, in order. */
static size_t expected_compute(const char *kind, unsigned p, unsigned m, unsigned s, int *seq)
{
    size_t n = 0;
    if (!strcmp(kind, "gpipe")) {
        for (unsigned i = 0; i < m; i++)
            seq[n++] = (int)i + 1;
        for (unsigned i = 0; i < m; i++)
            seq[n++] = -(int)i - 1;
        return n;
    }
    unsigned w = umin(p - s - 1, m);
    for (unsigned i = 0; i < w; i++)
        seq[n++] = (int)i + 1;
    for (unsigned i = 0; i + w < m; i++) {
        seq[n++] = (int)(i + w) + 1;
        seq[n++] = -(int)i - 1;
    }
    for (unsigned i = m - w; i < m; i++)
        seq[n++] = -(int)i - 1;
    return n;
}

/* Index of the op (kind, mb) in a stage's list, or SIZE_MAX. */
static size_t find_op(const epipe_op *ops, size_t n, uint32_t kind, unsigned mb)
{
    for (size_t k = 0; k < n; k++)
        if (ops[k].kind == kind && ops[k].microbatch == mb)
            return k;
    return SIZE_MAX;
}

static void op_times(const epipe_sim *sim, unsigned s, size_t k, double *t0, double *t1)
{
    assert_int_equal(epipe_sim_op_time(sim, s, k, t0, t1), EPIPE_OK);
}

/* Checks every dependency from the simulated times, independently of the
 * simulator's own rules: ops on a stage do not overlap and run in order;
 * F i on s starts after F i on s-1 ended plus the link; B i on s starts
 * after F i on s and after B i on s+1 plus the link; every receive sits
 * right before its compute op and every send right after it. */
static void check_dependencies(const epipe_schedule *sc, const epipe_sim *sim, double fwd,
                               double bwd, double comm)
{
    unsigned p = epipe_schedule_stages(sc), m = epipe_schedule_microbatches(sc);
    for (unsigned s = 0; s < p; s++) {
        const epipe_op *ops, *prev = NULL, *next = NULL;
        size_t n, np = 0, nn = 0;
        assert_int_equal(epipe_schedule_ops(sc, s, &ops, &n), EPIPE_OK);
        if (s > 0)
            assert_int_equal(epipe_schedule_ops(sc, s - 1, &prev, &np), EPIPE_OK);
        if (s + 1 < p)
            assert_int_equal(epipe_schedule_ops(sc, s + 1, &next, &nn), EPIPE_OK);
        double last_end = 0;
        for (size_t k = 0; k < n; k++) {
            double t0, t1;
            op_times(sim, s, k, &t0, &t1);
            assert_true(t0 >= last_end);
            assert_true(t1 >= t0);
            last_end = t1;
            if (ops[k].kind == EPIPE_OP_FORWARD)
                assert_true(fabs(t1 - t0 - fwd) < 1e-12);
            if (ops[k].kind == EPIPE_OP_BACKWARD)
                assert_true(fabs(t1 - t0 - bwd) < 1e-12);
        }
        for (unsigned i = 0; i < m; i++) {
            size_t f = find_op(ops, n, EPIPE_OP_FORWARD, i);
            size_t b = find_op(ops, n, EPIPE_OP_BACKWARD, i);
            assert_true(f != SIZE_MAX && b != SIZE_MAX && f < b);
            double f0, f1, b0, b1, u0, u1;
            op_times(sim, s, f, &f0, &f1);
            op_times(sim, s, b, &b0, &b1);
            assert_true(b0 >= f1);
            if (s > 0) {
                assert_true(f > 0 && ops[f - 1].kind == EPIPE_OP_RECV_ACT &&
                            ops[f - 1].microbatch == i);
                assert_true(b + 1 < n && ops[b + 1].kind == EPIPE_OP_SEND_GRAD &&
                            ops[b + 1].microbatch == i);
                op_times(sim, s - 1, find_op(prev, np, EPIPE_OP_FORWARD, i), &u0, &u1);
                assert_true(f0 >= u1 + comm - 1e-9);
            } else {
                assert_true(find_op(ops, n, EPIPE_OP_RECV_ACT, i) == SIZE_MAX);
            }
            if (s + 1 < p) {
                assert_true(f + 1 < n && ops[f + 1].kind == EPIPE_OP_SEND_ACT &&
                            ops[f + 1].microbatch == i);
                assert_true(b > 0 && ops[b - 1].kind == EPIPE_OP_RECV_GRAD &&
                            ops[b - 1].microbatch == i);
                op_times(sim, s + 1, find_op(next, nn, EPIPE_OP_BACKWARD, i), &u0, &u1);
                assert_true(b0 >= u1 + comm - 1e-9);
            } else {
                assert_true(find_op(ops, n, EPIPE_OP_SEND_ACT, i) == SIZE_MAX);
            }
        }
    }
}

static void every_size_holds(void **state)
{
    (void)state;
    int seq[64];
    for (size_t ki = 0; ki < 2; ki++)
        for (unsigned p = 1; p <= 6; p++)
            for (unsigned m = 1; m <= 16; m++) {
                const char *kind = kinds[ki];
                epipe_schedule *sc;
                assert_int_equal(epipe_schedule_create(&sc, kind, p, m), EPIPE_OK);
                assert_string_equal(epipe_schedule_kind(sc), kind);
                assert_int_equal(epipe_schedule_stages(sc), p);
                assert_int_equal(epipe_schedule_microbatches(sc), m);
                for (unsigned s = 0; s < p; s++) {
                    const epipe_op *ops;
                    size_t n, nc = 0;
                    assert_int_equal(epipe_schedule_ops(sc, s, &ops, &n), EPIPE_OK);
                    assert_int_equal(n, 2 * m + (s > 0) * 2 * m + (s + 1 < p) * 2 * m);
                    size_t ne = expected_compute(kind, p, m, s, seq);
                    for (size_t k = 0; k < n; k++) {
                        assert_int_equal(ops[k].chunk, 0);
                        assert_int_equal(ops[k].weight_version, 0);
                        if (ops[k].kind == EPIPE_OP_FORWARD)
                            assert_int_equal(seq[nc++], (int)ops[k].microbatch + 1);
                        else if (ops[k].kind == EPIPE_OP_BACKWARD)
                            assert_int_equal(seq[nc++], -(int)ops[k].microbatch - 1);
                    }
                    assert_int_equal(nc, ne);
                }

                epipe_sim *sim;
                assert_int_equal(epipe_sim_create(&sim, sc), EPIPE_OK);
                assert_true(epipe_sim_makespan(sim) == 2.0 * (m + p - 1));
                double want = (double)(p - 1) / (double)(m + p - 1);
                assert_true(fabs(epipe_sim_bubble_fraction(sim) - want) < 1e-12);
                for (unsigned s = 0; s < p; s++) {
                    unsigned peak;
                    assert_int_equal(epipe_sim_peak_live(sim, s, &peak), EPIPE_OK);
                    assert_int_equal(peak, ki == 0 ? m : umin(p - s, m));
                }
                check_dependencies(sc, sim, 1, 1, 0);

                /* Backward twice the forward: same bubble, same bounds. */
                assert_int_equal(
                    epipe_sim_set_cost(sim, EPIPE_SIM_BACKWARD, EPIPE_SIM_ALL_STAGES, 2), EPIPE_OK);
                assert_int_equal(epipe_sim_run(sim), EPIPE_OK);
                assert_true(epipe_sim_makespan(sim) == 3.0 * (m + p - 1));
                assert_true(fabs(epipe_sim_bubble_fraction(sim) - want) < 1e-12);
                check_dependencies(sc, sim, 1, 2, 0);

                /* Links that cost time: still every dependency, plus the link. */
                assert_int_equal(
                    epipe_sim_set_cost(sim, EPIPE_SIM_SEND_ACT, EPIPE_SIM_ALL_STAGES, 0.25),
                    EPIPE_OK);
                assert_int_equal(
                    epipe_sim_set_cost(sim, EPIPE_SIM_SEND_GRAD, EPIPE_SIM_ALL_STAGES, 0.25),
                    EPIPE_OK);
                assert_int_equal(epipe_sim_run(sim), EPIPE_OK);
                assert_true(epipe_sim_makespan(sim) >= 3.0 * (m + p - 1));
                check_dependencies(sc, sim, 1, 2, 0.25);

                epipe_sim_destroy(sim);
                epipe_schedule_destroy(sc);
            }
}

static void bad_arguments_are_named(void **state)
{
    (void)state;
    epipe_schedule *sc = (epipe_schedule *)&sc;
    assert_int_equal(epipe_schedule_create(&sc, "zerobubble", 4, 8), EPIPE_EINVAL);
    assert_null(sc);
    assert_non_null(strstr(epipe_last_error(), "'zerobubble'"));
    assert_non_null(strstr(epipe_last_error(), "gpipe"));
    assert_non_null(strstr(epipe_last_error(), "1f1b"));
    assert_int_equal(epipe_schedule_create(&sc, "1f1b", 0, 8), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "0 stages"));
    assert_int_equal(epipe_schedule_create(&sc, "1f1b", 4, 0), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "0 micro-batches"));
    assert_int_equal(epipe_schedule_create(&sc, "gpipe", 100000, 8), EPIPE_EINVAL);
    assert_int_equal(epipe_schedule_create(&sc, "gpipe", 4, 4000000000u), EPIPE_EINVAL);
    assert_int_equal(epipe_schedule_create(&sc, "gpipe", 1024, 65536), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "limit"));
    assert_int_equal(epipe_schedule_create(&sc, NULL, 4, 8), EPIPE_EINVAL);
    assert_int_equal(epipe_schedule_create(NULL, "gpipe", 4, 8), EPIPE_EINVAL);

    assert_string_equal(epipe_schedule_kind_name(0), "gpipe");
    assert_string_equal(epipe_schedule_kind_name(1), "1f1b");
    assert_string_equal(epipe_schedule_kind_name(2), "interleaved");
    assert_string_equal(epipe_schedule_kind_name(3), "zb-h1");
    assert_string_equal(epipe_schedule_kind_name(4), "zb-v");
    assert_string_equal(epipe_schedule_kind_name(5), "1f1b-async");
    assert_string_equal(epipe_schedule_kind_name(6), "1f1b-2bw");
    assert_null(epipe_schedule_kind_name(7));
    assert_string_equal(epipe_op_kind_name(EPIPE_OP_FORWARD), "F");
    assert_string_equal(epipe_op_kind_name(99), "?");

    assert_int_equal(epipe_schedule_create(&sc, "1f1b", 4, 8), EPIPE_OK);
    const epipe_op *ops;
    size_t n;
    assert_int_equal(epipe_schedule_ops(sc, 4, &ops, &n), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "stage 4 is out of range 0..3"));
    assert_int_equal(epipe_schedule_ops(sc, 0, NULL, &n), EPIPE_EINVAL);

    epipe_sim *sim;
    unsigned peak;
    double t;
    assert_int_equal(epipe_sim_create(&sim, NULL), EPIPE_EINVAL);
    assert_int_equal(epipe_sim_create(&sim, sc), EPIPE_OK);
    assert_int_equal(epipe_sim_peak_live(sim, 4, &peak), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "stage 4"));
    assert_int_equal(epipe_sim_op_time(sim, 0, 1000, &t, NULL), EPIPE_EINVAL);
    assert_int_equal(epipe_sim_set_cost(sim, EPIPE_SIM_FORWARD, 9, 1), EPIPE_EINVAL);
    assert_int_equal(epipe_sim_set_cost(sim, EPIPE_SIM_FORWARD, 0, -1), EPIPE_EINVAL);
    assert_int_equal(epipe_sim_set_cost(sim, EPIPE_SIM_FORWARD, 0, NAN), EPIPE_EINVAL);
    assert_int_equal(epipe_sim_set_cost(sim, EPIPE_SIM_FORWARD, 0, INFINITY), EPIPE_EINVAL);
    assert_int_equal(epipe_sim_set_cost(sim, (epipe_sim_cost)42, 0, 1), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "unknown cost 42"));

    /* A changed cost voids the results until the next run. */
    assert_int_equal(epipe_sim_set_cost(sim, EPIPE_SIM_FORWARD, 2, 3), EPIPE_OK);
    assert_true(isnan(epipe_sim_makespan(sim)));
    assert_int_equal(epipe_sim_peak_live(sim, 0, &peak), EPIPE_ESTATE);
    assert_int_equal(epipe_sim_run(sim), EPIPE_OK);
    assert_false(isnan(epipe_sim_makespan(sim)));
    /* The slowest stage sets the pace: 8 micro-batches through a stage that
     * takes 3+1 per micro-batch, plus the fill and drain of the others. */
    assert_true(epipe_sim_makespan(sim) > 8 * 4.0);
    epipe_sim_destroy(sim);
    epipe_schedule_destroy(sc);
    epipe_sim_destroy(NULL);
    epipe_schedule_destroy(NULL);
}

#define OP(k, i)                                                                                   \
    {                                                                                              \
        .kind = EPIPE_OP_##k, .microbatch = (i)                                                    \
    }

static int run_raw(unsigned p, unsigned m, const epipe_op *const *ops, const size_t *counts)
{
    epipe_sim *sim = (epipe_sim *)&sim;
    int rc = epipe_sim_create_raw(&sim, p, m, ops, counts);
    if (rc == EPIPE_OK)
        epipe_sim_destroy(sim);
    else
        assert_null(sim);
    return rc;
}

static void broken_lists_are_caught(void **state)
{
    (void)state;
    /* Both stages receive before they send: neither can ever go on. */
    const epipe_op s0[] = {OP(RECV_GRAD, 0), OP(FORWARD, 0), OP(SEND_ACT, 0), OP(BACKWARD, 0)};
    const epipe_op s1[] = {OP(RECV_ACT, 0), OP(FORWARD, 0), OP(BACKWARD, 0), OP(SEND_GRAD, 0)};
    const epipe_op *lists[] = {s0, s1};
    size_t counts[] = {4, 4};
    assert_int_equal(run_raw(2, 1, lists, counts), EPIPE_ESTATE);
    const char *msg = epipe_last_error();
    assert_non_null(strstr(msg, "deadlock"));
    assert_non_null(strstr(msg, "rank 0 waits at op 0 (recv-grad 0, stage 0) for rank 1"));
    assert_non_null(strstr(msg, "rank 1 waits at op 0 (recv-act 0, stage 1) for rank 0"));

    /* The same with the receive moved after the send: it holds. */
    const epipe_op ok0[] = {OP(FORWARD, 0), OP(SEND_ACT, 0), OP(RECV_GRAD, 0), OP(BACKWARD, 0)};
    lists[0] = ok0;
    assert_int_equal(run_raw(2, 1, lists, counts), EPIPE_OK);

    /* A backward before its forward. */
    const epipe_op bf[] = {OP(BACKWARD, 0), OP(FORWARD, 0)};
    const epipe_op *one[] = {bf};
    size_t n2[] = {2};
    assert_int_equal(run_raw(1, 1, one, n2), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "backward before its forward"));

    /* A forward missing. */
    const epipe_op miss[] = {OP(FORWARD, 0), OP(BACKWARD, 0)};
    one[0] = miss;
    assert_int_equal(run_raw(1, 2, one, n2), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "never runs the forward of micro-batch 1"));

    /* A micro-batch out of range, an unknown kind, a send off the end. */
    const epipe_op oor[] = {OP(FORWARD, 5), OP(BACKWARD, 0)};
    one[0] = oor;
    assert_int_equal(run_raw(1, 1, one, n2), EPIPE_EINVAL);
    const epipe_op unk[] = {{.kind = 77}, OP(BACKWARD, 0)};
    one[0] = unk;
    assert_int_equal(run_raw(1, 1, one, n2), EPIPE_EINVAL);
    const epipe_op off[] = {OP(FORWARD, 0), OP(SEND_ACT, 0)};
    one[0] = off;
    assert_int_equal(run_raw(1, 1, one, n2), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "no next stage"));

    /* A forward on stage 1 before its activation arrives. */
    const epipe_op early[] = {OP(FORWARD, 0), OP(RECV_ACT, 0), OP(BACKWARD, 0), OP(SEND_GRAD, 0)};
    lists[0] = ok0, lists[1] = early;
    assert_int_equal(run_raw(2, 1, lists, counts), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "before its activation is received"));

    /* Receives in another order than the sends: links are FIFO. */
    const epipe_op a0[] = {OP(FORWARD, 0),   OP(SEND_ACT, 0), OP(FORWARD, 1),   OP(SEND_ACT, 1),
                           OP(RECV_GRAD, 0), OP(BACKWARD, 0), OP(RECV_GRAD, 1), OP(BACKWARD, 1)};
    const epipe_op a1[] = {OP(RECV_ACT, 1), OP(FORWARD, 1),   OP(RECV_ACT, 0), OP(FORWARD, 0),
                           OP(BACKWARD, 0), OP(SEND_GRAD, 0), OP(BACKWARD, 1), OP(SEND_GRAD, 1)};
    const epipe_op *fifo[] = {a0, a1};
    size_t n8[] = {8, 8};
    assert_int_equal(run_raw(2, 2, fifo, n8), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "FIFO"));

    /* A real 1f1b list with two ops of a middle stage swapped deadlocks. */
    epipe_schedule *sc;
    assert_int_equal(epipe_schedule_create(&sc, "1f1b", 3, 4), EPIPE_OK);
    const epipe_op *l[3];
    size_t c[3];
    epipe_op copy[64];
    for (unsigned s = 0; s < 3; s++)
        assert_int_equal(epipe_schedule_ops(sc, s, &l[s], &c[s]), EPIPE_OK);
    memcpy(copy, l[1], c[1] * sizeof *copy);
    /* Stage 1 starts: recv-act 0, F0, send-act 0, recv-act 1, F1, ... ;
     * waiting for gradient 0 before sending activation 0 cannot work. */
    assert_int_equal(copy[2].kind, EPIPE_OP_SEND_ACT);
    size_t rg = find_op(copy, c[1], EPIPE_OP_RECV_GRAD, 0);
    epipe_op tmp = copy[2];
    copy[2] = copy[rg], copy[rg] = tmp;
    l[1] = copy;
    assert_int_equal(run_raw(3, 4, l, c), EPIPE_ESTATE);
    assert_non_null(strstr(epipe_last_error(), "rank 1 waits at op 2 (recv-grad 0"));
    epipe_schedule_destroy(sc);
}

/* Per-op costs: W, the codec on links between ranks only, one boundary's
 * link; makespans worked out by hand. */
static void costs_per_op_and_boundary(void **state)
{
    (void)state;
    epipe_schedule *sc;
    epipe_sim *sim;
    /* 1f1b p=2 m=1, codec 0.5: F 1, encode .5, decode .5, F 1, B 1, encode,
     * decode, B 1: 4 + 4 * 0.5, and both ranks busy half the time. */
    assert_int_equal(epipe_schedule_create(&sc, "1f1b", 2, 1), EPIPE_OK);
    assert_int_equal(epipe_sim_create(&sim, sc), EPIPE_OK);
    assert_int_equal(epipe_sim_set_cost(sim, EPIPE_SIM_CODEC, EPIPE_SIM_ALL_STAGES, 0.5), 0);
    assert_int_equal(epipe_sim_run(sim), EPIPE_OK);
    assert_true(fabs(epipe_sim_makespan(sim) - 6) < 1e-12);
    assert_true(fabs(epipe_sim_bubble_fraction(sim) - 0.5) < 1e-12);
    /* A weight cost makes the whole backward B + W. */
    assert_int_equal(epipe_sim_set_cost(sim, EPIPE_SIM_CODEC, EPIPE_SIM_ALL_STAGES, 0), 0);
    assert_int_equal(epipe_sim_set_cost(sim, EPIPE_SIM_WEIGHT, EPIPE_SIM_ALL_STAGES, 2), 0);
    assert_int_equal(epipe_sim_run(sim), EPIPE_OK);
    assert_true(fabs(epipe_sim_makespan(sim) - 8) < 1e-12);
    /* The activation link of boundary 0 only: +3 once; the gradient link
     * of stage 1 (to stage 0): +1 once. */
    assert_int_equal(epipe_sim_set_cost(sim, EPIPE_SIM_SEND_ACT, 0, 3), 0);
    assert_int_equal(epipe_sim_set_cost(sim, EPIPE_SIM_SEND_GRAD, 1, 1), 0);
    assert_int_equal(epipe_sim_run(sim), EPIPE_OK);
    assert_true(fabs(epipe_sim_makespan(sim) - 12) < 1e-12);
    /* Codec costs by direction, indexed by the sender: encoding the
     * activation on stage 0 (+0.25), decoding it on stage 1 (+0.5),
     * encoding the gradient on stage 1 (+1), decoding it on stage 0 (+2):
     * each on the one path, once. */
    assert_int_equal(epipe_sim_set_cost(sim, EPIPE_SIM_ENCODE_ACT, 0, 0.25), 0);
    assert_int_equal(epipe_sim_set_cost(sim, EPIPE_SIM_DECODE_ACT, 0, 0.5), 0);
    assert_int_equal(epipe_sim_set_cost(sim, EPIPE_SIM_ENCODE_GRAD, 1, 1), 0);
    assert_int_equal(epipe_sim_set_cost(sim, EPIPE_SIM_DECODE_GRAD, 1, 2), 0);
    assert_int_equal(epipe_sim_run(sim), EPIPE_OK);
    assert_true(fabs(epipe_sim_makespan(sim) - 15.75) < 1e-12);
    /* on the stages that do not send that way they count for nothing */
    assert_int_equal(epipe_sim_set_cost(sim, EPIPE_SIM_ENCODE_ACT, 1, 9), 0);
    assert_int_equal(epipe_sim_set_cost(sim, EPIPE_SIM_ENCODE_GRAD, 0, 9), 0);
    assert_int_equal(epipe_sim_run(sim), EPIPE_OK);
    assert_true(fabs(epipe_sim_makespan(sim) - 15.75) < 1e-12);
    assert_int_equal(epipe_sim_set_cost(sim, (epipe_sim_cost)11, 0, 1), EPIPE_EINVAL);
    epipe_sim_destroy(sim);
    epipe_schedule_destroy(sc);

    /* Client-server 0,1,0, gpipe, m=1: the client's two chunks hand over
     * locally, so a codec and link cost only the two crossings each way:
     * F0 | F1 | F2 B2 | B1 | B0, four crossings of link 1 + codec 2*0.5. */
    static const unsigned map[] = {0, 1, 0};
    epipe_schedule_layout lay = EPIPE_SCHEDULE_LAYOUT_INIT;
    lay.placement = map, lay.placement_len = 3;
    assert_int_equal(epipe_schedule_create_layout(&sc, "gpipe", 2, 1, &lay), EPIPE_OK);
    assert_int_equal(epipe_sim_create(&sim, sc), EPIPE_OK);
    assert_true(fabs(epipe_sim_makespan(sim) - 6) < 1e-12);
    assert_int_equal(epipe_sim_set_cost(sim, EPIPE_SIM_CODEC, EPIPE_SIM_ALL_STAGES, 0.5), 0);
    assert_int_equal(epipe_sim_set_cost(sim, EPIPE_SIM_SEND_ACT, EPIPE_SIM_ALL_STAGES, 1), 0);
    assert_int_equal(epipe_sim_set_cost(sim, EPIPE_SIM_SEND_GRAD, EPIPE_SIM_ALL_STAGES, 1), 0);
    assert_int_equal(epipe_sim_run(sim), EPIPE_OK);
    assert_true(fabs(epipe_sim_makespan(sim) - (6 + 4 * 1 + 4 * 2 * 0.5)) < 1e-12);
    unsigned peak;
    assert_int_equal(epipe_sim_peak_live(sim, 0, &peak), EPIPE_OK);
    assert_int_equal(peak, 2); /* both client chunks hold micro-batch 0 */
    epipe_sim_destroy(sim);
    epipe_schedule_destroy(sc);
}

/* Split-backward rules: W before Bi, two Ws, BACKWARD after Bi. */
static void split_backward_rules(void **state)
{
    (void)state;
    const epipe_op *one[1];
    size_t n[1] = {3};
    const epipe_op w_first[] = {OP(FORWARD, 0), OP(BACKWARD_WEIGHT, 0), OP(BACKWARD_INPUT, 0)};
    one[0] = w_first;
    assert_int_equal(run_raw(1, 1, one, n), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "weight backward before its input backward"));
    const epipe_op both[] = {OP(FORWARD, 0), OP(BACKWARD_INPUT, 0), OP(BACKWARD, 0)};
    one[0] = both;
    assert_int_equal(run_raw(1, 1, one, n), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "second backward"));
    const epipe_op no_w[] = {OP(FORWARD, 0), OP(BACKWARD_INPUT, 0)};
    one[0] = no_w;
    n[0] = 2;
    assert_int_equal(run_raw(1, 1, one, n), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "never runs the weight backward of micro-batch 0"));
    const epipe_op ok[] = {OP(FORWARD, 0), OP(BACKWARD_INPUT, 0), OP(BACKWARD_WEIGHT, 0)};
    one[0] = ok;
    n[0] = 3;
    assert_int_equal(run_raw(1, 1, one, n), EPIPE_OK);
    const epipe_op bad_chunk[] = {{.kind = EPIPE_OP_FORWARD, .chunk = 1}, OP(BACKWARD, 0)};
    one[0] = bad_chunk;
    n[0] = 2;
    assert_int_equal(run_raw(1, 1, one, n), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "chunk out of range"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(every_size_holds),        cmocka_unit_test(bad_arguments_are_named),
        cmocka_unit_test(broken_lists_are_caught), cmocka_unit_test(costs_per_op_and_boundary),
        cmocka_unit_test(split_backward_rules),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
