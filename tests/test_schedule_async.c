/* The schedules without a flush (1f1b-async, 1f1b-2bw): their three lists,
 * the versions the ops carry and the versions a rank holds, the proof of a
 * run of several steps, and the refusals. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include <epipe/epipe.h>

static const char *const kinds[] = {"1f1b-async", "1f1b-2bw"};

static size_t count(const epipe_op *ops, size_t n, uint32_t kind)
{
    size_t c = 0;
    for (size_t i = 0; i < n; i++)
        c += ops[i].kind == kind;
    return c;
}

/* For p 1..8 and m p..32: stage s runs w = p-s-1 warm-up forwards, so its
 * first list has m forwards and m-w backwards, every later one m of each,
 * the drain w backwards; the run of EPIPE_SIM_ASYNC_STEPS steps is proven
 * at creation; rank s holds p-s weight versions with per-backward updates
 * and at most two with per-step ones. */
static void lists_and_versions(void **state)
{
    (void)state;
    for (int k = 0; k < 2; k++)
        for (unsigned p = 1; p <= 8; p++)
            for (unsigned m = p; m <= 32; m++) {
                epipe_schedule *sc;
                if (epipe_schedule_create(&sc, kinds[k], p, m) != EPIPE_OK)
                    fail_msg("%s p=%u m=%u: %s", kinds[k], p, m, epipe_last_error());
                assert_int_equal(epipe_schedule_weights(sc),
                                 k ? EPIPE_WEIGHTS_DOUBLE : EPIPE_WEIGHTS_STASHED);
                for (unsigned s = 0; s < p; s++) {
                    unsigned w = p - s - 1;
                    const epipe_op *ops;
                    size_t n;
                    size_t want_b[3] = {m - w, m, w};
                    for (int ph = 0; ph < 3; ph++) {
                        assert_int_equal(epipe_schedule_phase_ops(sc, s, ph, &ops, &n), EPIPE_OK);
                        assert_int_equal(count(ops, n, EPIPE_OP_FORWARD), ph == 2 ? 0 : m);
                        assert_int_equal(count(ops, n, EPIPE_OP_BACKWARD), want_b[ph]);
                        assert_int_equal(count(ops, n, EPIPE_OP_RECV_ACT),
                                         s ? count(ops, n, EPIPE_OP_FORWARD) : 0);
                        assert_int_equal(count(ops, n, EPIPE_OP_SEND_GRAD),
                                         s ? count(ops, n, EPIPE_OP_BACKWARD) : 0);
                    }
                    const epipe_op *first;
                    size_t nf;
                    assert_int_equal(epipe_schedule_ops(sc, s, &first, &nf), EPIPE_OK);
                    assert_int_equal(epipe_schedule_phase_ops(sc, s, EPIPE_PHASE_FIRST, &ops, &n),
                                     EPIPE_OK);
                    assert_true(first == ops && nf == n);
                    unsigned held = epipe_schedule_weight_versions(sc, s);
                    if (k == 0)
                        assert_int_equal(held, p - s);
                    else
                        assert_int_equal(held, w ? 2u : 1u);
                }
                epipe_schedule_destroy(sc);
            }
}

/* At the limits: 100 stages, where rank s still holds p - s versions (a
 * count that stopped at 65 once), and 65536 micro-batches on two stages
 * (their replay at creation took O(m^2): 38 s on this VM, now 0.07 s). */
static void versions_of_long_pipelines(void **state)
{
    (void)state;
    epipe_schedule *sc;
    assert_int_equal(epipe_schedule_create(&sc, "1f1b-async", 100, 128), EPIPE_OK);
    for (unsigned s = 0; s < 100; s++)
        assert_int_equal(epipe_schedule_weight_versions(sc, s), 100 - s);
    epipe_schedule_destroy(sc);
    for (int k = 0; k < 2; k++) {
        assert_int_equal(epipe_schedule_create(&sc, kinds[k], 2, 65536), EPIPE_OK);
        assert_int_equal(epipe_schedule_weight_versions(sc, 0), 2);
        assert_int_equal(epipe_schedule_weight_versions(sc, 1), 1);
        epipe_schedule_destroy(sc);
    }
}

/* The steady list of the first of 4 stages (w = 3), m = 5: pairs "forward
 * j, backward j-3", the first three backwards of the previous step, with
 * the version offsets the header gives. */
static void steady_list_and_its_versions(void **state)
{
    (void)state;
    for (int k = 0; k < 2; k++) {
        epipe_schedule *sc;
        assert_int_equal(epipe_schedule_create(&sc, kinds[k], 4, 5), EPIPE_OK);
        const epipe_op *ops;
        size_t n;
        assert_int_equal(epipe_schedule_phase_ops(sc, 0, EPIPE_PHASE_STEADY, &ops, &n), EPIPE_OK);
        unsigned j = 0, b = 0;
        for (size_t i = 0; i < n; i++) {
            if (ops[i].kind == EPIPE_OP_FORWARD) {
                assert_int_equal(ops[i].microbatch, j);
                assert_int_equal(ops[i].weight_version, k ? 0u : j);
                j++;
            } else if (ops[i].kind == EPIPE_OP_BACKWARD) {
                assert_int_equal(b + 1, j); /* right after its pair's forward */
                assert_int_equal(ops[i].microbatch, (b + 5 - 3) % 5);
                uint32_t want = k ? (b < 3 ? UINT32_MAX : 0u) : (uint32_t)(b - 3);
                assert_int_equal(ops[i].weight_version, want);
                b++;
            }
        }
        assert_int_equal(j, 5);
        assert_int_equal(b, 5);
        assert_int_equal(epipe_schedule_phase_ops(sc, 0, EPIPE_PHASE_DRAIN, &ops, &n), EPIPE_OK);
        for (size_t i = 0, d = 0; i < n; i++)
            if (ops[i].kind == EPIPE_OP_BACKWARD) {
                assert_int_equal(ops[i].microbatch, 2 + d);
                d++;
            }
        epipe_schedule_destroy(sc);
    }
}

/* At F = B = 1 and free links the run of K steps takes K*m*2 + 2(p-1):
 * one fill and one drain, no bubble between steps; 1f1b pays its bubble
 * every step. */
static void no_bubble_between_steps(void **state)
{
    (void)state;
    for (int k = 0; k < 2; k++)
        for (unsigned p = 2; p <= 6; p++)
            for (unsigned m = p; m <= 12; m += 3) {
                epipe_schedule *sc;
                epipe_sim *sim;
                assert_int_equal(epipe_schedule_create(&sc, kinds[k], p, m), EPIPE_OK);
                assert_int_equal(epipe_sim_create(&sim, sc), EPIPE_OK);
                double want = EPIPE_SIM_ASYNC_STEPS * m * 2.0 + 2.0 * (p - 1);
                if (epipe_sim_makespan(sim) != want)
                    fail_msg("%s p=%u m=%u: makespan %g, expected %g", kinds[k], p, m,
                             epipe_sim_makespan(sim), want);
                unsigned peak;
                assert_int_equal(epipe_sim_peak_live(sim, 0, &peak), EPIPE_OK);
                assert_int_equal(peak, p); /* 1f1b's memory */
                epipe_sim_destroy(sim);
                epipe_schedule_destroy(sc);
            }
}

static void refusals(void **state)
{
    (void)state;
    epipe_schedule *sc;
    for (int k = 0; k < 2; k++) {
        assert_int_equal(epipe_schedule_create(&sc, kinds[k], 4, 3), EPIPE_EINVAL);
        assert_non_null(strstr(epipe_last_error(), "needs m >= 4"));
        epipe_schedule_layout lay = EPIPE_SCHEDULE_LAYOUT_INIT;
        lay.chunks = 2;
        assert_int_equal(epipe_schedule_create_layout(&sc, kinds[k], 2, 4, &lay), EPIPE_EINVAL);
        assert_non_null(strstr(epipe_last_error(), "needs 1"));
        static const unsigned cs[] = {0, 1, 0};
        lay = (epipe_schedule_layout)EPIPE_SCHEDULE_LAYOUT_INIT;
        lay.placement = cs;
        lay.placement_len = 3;
        assert_int_equal(epipe_schedule_create_layout(&sc, kinds[k], 2, 4, &lay), EPIPE_EINVAL);
        /* a reversed placement, one stage per rank, is fine */
        static const unsigned rev[] = {1, 0};
        lay.placement = rev;
        lay.placement_len = 2;
        assert_int_equal(epipe_schedule_create_layout(&sc, kinds[k], 2, 4, &lay), EPIPE_OK);
        epipe_schedule_destroy(sc);
    }
    /* a schedule that flushes: FIRST = STEADY, an empty DRAIN */
    assert_int_equal(epipe_schedule_create(&sc, "1f1b", 3, 4), EPIPE_OK);
    const epipe_op *a, *b;
    size_t na, nb;
    assert_int_equal(epipe_schedule_phase_ops(sc, 1, EPIPE_PHASE_FIRST, &a, &na), EPIPE_OK);
    assert_int_equal(epipe_schedule_phase_ops(sc, 1, EPIPE_PHASE_STEADY, &b, &nb), EPIPE_OK);
    assert_true(a == b && na == nb && na > 0);
    assert_int_equal(epipe_schedule_phase_ops(sc, 1, EPIPE_PHASE_DRAIN, &b, &nb), EPIPE_OK);
    assert_int_equal(nb, 0);
    assert_int_equal(epipe_schedule_phase_ops(sc, 1, 3, &b, &nb), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "phase 3"));
    assert_int_equal(epipe_schedule_phase_ops(sc, 3, 0, &b, &nb), EPIPE_EINVAL);
    assert_int_equal(epipe_schedule_weights(sc), EPIPE_WEIGHTS_FLUSH);
    assert_int_equal(epipe_schedule_weight_versions(sc, 2), 1);
    assert_int_equal(epipe_schedule_weight_versions(sc, 3), 0);
    epipe_schedule_destroy(sc);
    assert_int_equal(epipe_schedule_weights(NULL), EPIPE_WEIGHTS_FLUSH);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(lists_and_versions),
        cmocka_unit_test(versions_of_long_pipelines),
        cmocka_unit_test(steady_list_and_its_versions),
        cmocka_unit_test(no_bubble_between_steps),
        cmocka_unit_test(refusals),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
