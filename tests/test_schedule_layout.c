/* Schedules over any placement: every kind, p 1..8, m 1..32, chunks 1..4 and
 * the client-server map 0,1,0, checked op by op; layouts that are malformed. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <epipe/schedule.h>

#define MAXP 16
#define MAXM 32

struct costs {
    double f, b, w, comm;
};

/* Index of op (kind, mb) of pipeline stage s in rank r's list, or SIZE_MAX. */
static size_t find(const epipe_schedule *sc, unsigned s, uint32_t kind, unsigned mb)
{
    unsigned r, c;
    assert_int_equal(epipe_schedule_placement(sc, s, &r, &c), EPIPE_OK);
    const epipe_op *ops;
    size_t n;
    assert_int_equal(epipe_schedule_ops(sc, r, &ops, &n), EPIPE_OK);
    for (size_t k = 0; k < n; k++)
        if (ops[k].kind == kind && ops[k].microbatch == mb && ops[k].chunk == c)
            return k;
    return SIZE_MAX;
}

static void times(const epipe_sim *sim, const epipe_schedule *sc, unsigned s, size_t k, double *t0,
                  double *t1)
{
    unsigned r;
    assert_int_equal(epipe_schedule_placement(sc, s, &r, NULL), EPIPE_OK);
    assert_int_equal(epipe_sim_op_time(sim, r, k, t0, t1), EPIPE_OK);
}

static double link(const epipe_schedule *sc, unsigned a, unsigned b, double comm)
{
    unsigned ra, rb;
    epipe_schedule_placement(sc, a, &ra, NULL);
    epipe_schedule_placement(sc, b, &rb, NULL);
    return ra == rb ? 0 : comm;
}

/* Every dependency from the simulated times, independently of the
 * simulator's own rules, and the shape of the lists the contract fixes. */
static void check(const epipe_schedule *sc, const epipe_sim *sim, struct costs c)
{
    unsigned R = epipe_schedule_stages(sc), P = epipe_schedule_pipeline_stages(sc);
    unsigned m = epipe_schedule_microbatches(sc);
    int split = epipe_schedule_splits_backward(sc);
    uint32_t bk = split ? EPIPE_OP_BACKWARD_INPUT : EPIPE_OP_BACKWARD;
    const double eps = 1e-9;
    for (unsigned r = 0; r < R; r++) {
        const epipe_op *ops;
        size_t n, want = 0;
        assert_int_equal(epipe_schedule_ops(sc, r, &ops, &n), EPIPE_OK);
        double last = 0;
        for (size_t k = 0; k < n; k++) {
            double t0, t1;
            assert_int_equal(epipe_sim_op_time(sim, r, k, &t0, &t1), EPIPE_OK);
            assert_true(t0 >= last - eps && t1 >= t0);
            last = t1;
            assert_true(ops[k].chunk < epipe_schedule_chunks(sc, r));
            assert_int_equal(ops[k].weight_version, 0);
            double d = t1 - t0;
            switch (ops[k].kind) {
            case EPIPE_OP_FORWARD: assert_true(fabs(d - c.f) < eps); break;
            case EPIPE_OP_BACKWARD:
                assert_false(split), assert_true(fabs(d - c.b - c.w) < eps);
                break;
            case EPIPE_OP_BACKWARD_INPUT:
                assert_true(split), assert_true(fabs(d - c.b) < eps);
                break;
            case EPIPE_OP_BACKWARD_WEIGHT:
                assert_true(split), assert_true(fabs(d - c.w) < eps);
                break;
            default: break;
            }
        }
        for (unsigned ch = 0; ch < epipe_schedule_chunks(sc, r); ch++) {
            unsigned s;
            assert_int_equal(epipe_schedule_stage_of(sc, r, ch, &s), EPIPE_OK);
            want += (size_t)m * (2 + split + (s > 0) * 2 + (s + 1 < P) * 2);
        }
        assert_int_equal(n, want);
    }
    for (unsigned s = 0; s < P; s++) {
        unsigned r, ch;
        assert_int_equal(epipe_schedule_placement(sc, s, &r, &ch), EPIPE_OK);
        const epipe_op *ops;
        size_t n;
        assert_int_equal(epipe_schedule_ops(sc, r, &ops, &n), EPIPE_OK);
        size_t prev_f = 0, prev_b = 0;
        for (unsigned i = 0; i < m; i++) {
            size_t f = find(sc, s, EPIPE_OP_FORWARD, i), b = find(sc, s, bk, i);
            assert_true(f != SIZE_MAX && b != SIZE_MAX && f < b);
            /* Each chunk runs its forwards and backwards in micro-batch order. */
            if (i)
                assert_true(f > prev_f && b > prev_b);
            prev_f = f, prev_b = b;
            double f0, f1, b0, b1, u0, u1;
            times(sim, sc, s, f, &f0, &f1);
            times(sim, sc, s, b, &b0, &b1);
            assert_true(b0 >= f1 - eps);
            if (split) {
                size_t w = find(sc, s, EPIPE_OP_BACKWARD_WEIGHT, i);
                assert_true(w != SIZE_MAX && w > b);
                times(sim, sc, s, w, &u0, &u1);
                assert_true(u0 >= b1 - eps);
            } else {
                assert_true(find(sc, s, EPIPE_OP_BACKWARD_WEIGHT, i) == SIZE_MAX);
            }
            if (s > 0) {
                assert_true(f > 0 && ops[f - 1].kind == EPIPE_OP_RECV_ACT &&
                            ops[f - 1].microbatch == i && ops[f - 1].chunk == ch);
                assert_true(ops[b + 1].kind == EPIPE_OP_SEND_GRAD && ops[b + 1].microbatch == i &&
                            ops[b + 1].chunk == ch);
                times(sim, sc, s - 1, find(sc, s - 1, EPIPE_OP_FORWARD, i), &u0, &u1);
                assert_true(f0 >= u1 + link(sc, s - 1, s, c.comm) - eps);
            } else {
                assert_true(find(sc, s, EPIPE_OP_RECV_ACT, i) == SIZE_MAX);
                assert_true(find(sc, s, EPIPE_OP_SEND_GRAD, i) == SIZE_MAX);
            }
            if (s + 1 < P) {
                assert_true(ops[f + 1].kind == EPIPE_OP_SEND_ACT && ops[f + 1].microbatch == i &&
                            ops[f + 1].chunk == ch);
                assert_true(b > 0 && ops[b - 1].kind == EPIPE_OP_RECV_GRAD &&
                            ops[b - 1].microbatch == i && ops[b - 1].chunk == ch);
                times(sim, sc, s + 1, find(sc, s + 1, bk, i), &u0, &u1);
                assert_true(b0 >= u1 + link(sc, s, s + 1, c.comm) - eps);
            } else {
                assert_true(find(sc, s, EPIPE_OP_SEND_ACT, i) == SIZE_MAX);
                assert_true(find(sc, s, EPIPE_OP_RECV_GRAD, i) == SIZE_MAX);
            }
        }
    }
}

static void run_costs(epipe_sim *sim, struct costs c)
{
    assert_int_equal(epipe_sim_set_cost(sim, EPIPE_SIM_FORWARD, EPIPE_SIM_ALL_STAGES, c.f), 0);
    assert_int_equal(epipe_sim_set_cost(sim, EPIPE_SIM_BACKWARD, EPIPE_SIM_ALL_STAGES, c.b), 0);
    assert_int_equal(epipe_sim_set_cost(sim, EPIPE_SIM_WEIGHT, EPIPE_SIM_ALL_STAGES, c.w), 0);
    assert_int_equal(epipe_sim_set_cost(sim, EPIPE_SIM_SEND_ACT, EPIPE_SIM_ALL_STAGES, c.comm), 0);
    assert_int_equal(epipe_sim_set_cost(sim, EPIPE_SIM_SEND_GRAD, EPIPE_SIM_ALL_STAGES, c.comm), 0);
    assert_int_equal(epipe_sim_run(sim), EPIPE_OK);
}

/* Checks one schedule under three sets of costs. */
static void prove(const epipe_schedule *sc)
{
    static const struct costs cs[] = {{1, 1, 1, 0}, {1, 2, 0.5, 0}, {1, 1.5, 1, 0.25}};
    epipe_sim *sim;
    assert_int_equal(epipe_sim_create(&sim, sc), EPIPE_OK);
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
        run_costs(sim, cs[i]);
        check(sc, sim, cs[i]);
    }
    epipe_sim_destroy(sim);
}

/* The kinds that flush each step; 1f1b-async and 1f1b-2bw have their own
 * proof (test_schedule_async.c). */
static int flushes(const char *kind)
{
    epipe_schedule *sc;
    if (epipe_schedule_create(&sc, kind, 1, 1) != EPIPE_OK)
        fail_msg("%s p=1 m=1: %s", kind, epipe_last_error());
    int w = epipe_schedule_weights(sc);
    epipe_schedule_destroy(sc);
    return w == EPIPE_WEIGHTS_FLUSH;
}

/* Every kind, every size, every chunk count the kind accepts. */
static void every_kind_every_size(void **state)
{
    (void)state;
    for (size_t ki = 0; epipe_schedule_kind_name(ki); ki++) {
        const char *kind = epipe_schedule_kind_name(ki);
        if (!flushes(kind))
            continue;
        for (unsigned chunks = 1; chunks <= 4; chunks++)
            for (unsigned p = 1; p <= 8; p++)
                for (unsigned m = 1; m <= MAXM; m++) {
                    epipe_schedule_layout lay = EPIPE_SCHEDULE_LAYOUT_INIT;
                    lay.chunks = chunks;
                    epipe_schedule *sc;
                    int rc = epipe_schedule_create_layout(&sc, kind, p, m, &lay);
                    if (!strcmp(kind, "zb-v") && chunks != 2) {
                        assert_int_equal(rc, EPIPE_EINVAL);
                        continue;
                    }
                    if (rc != EPIPE_OK)
                        fail_msg("%s p=%u m=%u chunks=%u: %s", kind, p, m, chunks,
                                 epipe_last_error());
                    assert_int_equal(epipe_schedule_pipeline_stages(sc), p * chunks);
                    prove(sc);
                    epipe_schedule_destroy(sc);
                }
    }
}

/* The client-server split: the client (rank 0) holds the first and last
 * stage, the server (rank 1) the middle. */
static void client_server_map(void **state)
{
    (void)state;
    static const unsigned map[] = {0, 1, 0};
    for (size_t ki = 0; epipe_schedule_kind_name(ki); ki++) {
        const char *kind = epipe_schedule_kind_name(ki);
        if (!strcmp(kind, "zb-v") || !flushes(kind))
            continue;
        for (unsigned m = 1; m <= 12; m++) {
            epipe_schedule_layout lay = EPIPE_SCHEDULE_LAYOUT_INIT;
            lay.placement = map;
            lay.placement_len = 3;
            epipe_schedule *sc;
            if (epipe_schedule_create_layout(&sc, kind, 2, m, &lay) != EPIPE_OK)
                fail_msg("%s m=%u: %s", kind, m, epipe_last_error());
            assert_int_equal(epipe_schedule_stages(sc), 2);
            assert_int_equal(epipe_schedule_pipeline_stages(sc), 3);
            assert_int_equal(epipe_schedule_chunks(sc, 0), 2);
            assert_int_equal(epipe_schedule_chunks(sc, 1), 1);
            unsigned st, r, c;
            assert_int_equal(epipe_schedule_stage_of(sc, 0, 1, &st), EPIPE_OK);
            assert_int_equal(st, 2);
            assert_int_equal(epipe_schedule_placement(sc, 1, &r, &c), EPIPE_OK);
            assert_true(r == 1 && c == 0);
            prove(sc);
            if (!strcmp(kind, "1f1b") || !strcmp(kind, "gpipe")) {
                /* F = B = 1: three stages of a balanced pipeline, two of them
                 * on one rank: the client runs 4m ops, the server 2m. */
                epipe_sim *sim;
                assert_int_equal(epipe_sim_create(&sim, sc), EPIPE_OK);
                assert_true(epipe_sim_makespan(sim) >= 4.0 * m);
                assert_true(epipe_sim_makespan(sim) <= 4.0 * m + 4);
                unsigned peak;
                assert_int_equal(epipe_sim_peak_live(sim, 1, &peak), EPIPE_OK);
                if (!strcmp(kind, "1f1b"))
                    assert_true(peak <= 2);
                /* B = 2F (W = 1): the client's 6m of work, and at most the
                 * critical path of one micro-batch (9) more. */
                run_costs(sim, (struct costs){1, 1, 1, 0});
                assert_true(epipe_sim_makespan(sim) <= 6.0 * m + 3);
                epipe_sim_destroy(sim);
            }
            epipe_schedule_destroy(sc);
        }
    }
}

/* Random placements (every rank holds a stage): all kinds but zb-v hold. */
static void random_placements(void **state)
{
    (void)state;
    srand(13);
    for (int it = 0; it < 200; it++) {
        unsigned R = 1 + (unsigned)rand() % 4, P = R + (unsigned)rand() % 5, map[MAXP];
        for (unsigned s = 0; s < P; s++)
            map[s] = s < R ? s : (unsigned)rand() % R;
        for (unsigned s = P; s-- > 1;) { /* shuffle */
            unsigned j = (unsigned)rand() % (s + 1), t = map[s];
            map[s] = map[j], map[j] = t;
        }
        unsigned m = 1 + (unsigned)rand() % 12;
        for (size_t ki = 0; epipe_schedule_kind_name(ki); ki++) {
            const char *kind = epipe_schedule_kind_name(ki);
            if (!strcmp(kind, "zb-v") || !flushes(kind))
                continue;
            epipe_schedule_layout lay = EPIPE_SCHEDULE_LAYOUT_INIT;
            lay.placement = map;
            lay.placement_len = P;
            epipe_schedule *sc;
            int rc = epipe_schedule_create_layout(&sc, kind, R, m, &lay);
            if (!strcmp(kind, "interleaved") && P > R) {
                int rr = 1;
                for (unsigned s = 0; s < P; s++)
                    rr &= map[s] == s % R;
                if (!rr) {
                    assert_int_equal(rc, EPIPE_EINVAL);
                    assert_non_null(strstr(epipe_last_error(), "round-robin"));
                    continue;
                }
            }
            if (rc != EPIPE_OK)
                fail_msg("%s R=%u P=%u m=%u: %s", kind, R, P, m, epipe_last_error());
            prove(sc);
            epipe_schedule_destroy(sc);
        }
    }
}

/* Idle over ideal compute (the papers' bubble) at F = B = W = 1. */
static double paper_bubble(const char *kind, unsigned p, unsigned m, unsigned chunks,
                           unsigned *peaks)
{
    epipe_schedule_layout lay = EPIPE_SCHEDULE_LAYOUT_INIT;
    lay.chunks = chunks;
    epipe_schedule *sc;
    if (epipe_schedule_create_layout(&sc, kind, p, m, &lay) != EPIPE_OK)
        fail_msg("%s p=%u m=%u: %s", kind, p, m, epipe_last_error());
    epipe_sim *sim;
    assert_int_equal(epipe_sim_create(&sim, sc), EPIPE_OK);
    run_costs(sim, (struct costs){1, 1, 1, 0});
    double b = epipe_sim_bubble_fraction(sim);
    for (unsigned r = 0; r < p; r++)
        assert_int_equal(epipe_sim_peak_live(sim, r, &peaks[r]), EPIPE_OK);
    epipe_sim_destroy(sim);
    epipe_schedule_destroy(sc);
    return b / (1 - b);
}

static void near(double got, double want, const char *what, unsigned p, unsigned m, unsigned v)
{
    if (fabs(got - want) > 0.01 * want + 1e-12)
        fail_msg("%s p=%u m=%u v=%u: bubble %.6f, formula %.6f", what, p, m, v, got, want);
}

/* The published bubbles (idle over ideal compute) at equal costs, within
 * 1%: 1F1B (p-1)/m, interleaved (p-1)/(v m) for any m >= p, ZB-H1
 * (p-1)/(3m) for m >= p; and the memory each promises. */
static void bubbles_match_the_papers(void **state)
{
    (void)state;
    unsigned peaks[8];
    for (unsigned p = 1; p <= 8; p++)
        for (unsigned m = 1; m <= MAXM; m++) {
            near(paper_bubble("1f1b", p, m, 1, peaks), (double)(p - 1) / m, "1f1b", p, m, 1);
            for (unsigned r = 0; r < p; r++)
                assert_int_equal(peaks[r], p - r < m ? p - r : m);
            if (m < p)
                continue;
            for (unsigned v = 1; v <= 4; v++) {
                near(paper_bubble("interleaved", p, m, v, peaks), (double)(p - 1) / (v * m),
                     "interleaved", p, m, v);
                /* Megatron's warm-up plus one, with groups of m/(m/p) rounded up. */
                unsigned g = (m + m / p - 1) / (m / p);
                for (unsigned r = 0; r < p; r++)
                    assert_true(peaks[r] <= (v == 1 ? p - r : 2 * (p - r - 1) + (v - 1) * g + 1));
            }
            double zbh1 = paper_bubble("zb-h1", p, m, 1, peaks);
            near(zbh1, (double)(p - 1) / (3 * m), "zb-h1", p, m, 1);
            for (unsigned r = 0; r < p; r++)
                assert_true(peaks[r] <= p); /* 1F1B's peak, on its first stage */
            /* ZB-V: at most ZB-H1's bubble, in 2p chunk activations (p whole
             * micro-batches, 1F1B's peak). */
            double zbv = paper_bubble("zb-v", p, m, 2, peaks);
            if (zbv > zbh1 + 1e-12)
                fail_msg("zb-v p=%u m=%u: bubble %.6f above zb-h1's %.6f", p, m, zbv, zbh1);
            /* Its makespan is within 4 of the lower bound 6m + p - 1 (the
             * last rank's 6m chunk ops cannot start before p - 1). */
            double makespan = (1 + zbv) * 6 * m;
            assert_true(makespan >= 6.0 * m + p - 1 - 1e-9);
            assert_true(makespan <= 6.0 * m + p - 1 + 4 + 1e-9);
            for (unsigned r = 0; r < p; r++)
                assert_true(peaks[r] <= 2 * p);
        }
}

/* ZB-H1 splits the backward and sends each gradient right after its
 * input-gradient op; the others do not split. */
static void split_backward_kinds(void **state)
{
    (void)state;
    static const char *const split[] = {"zb-h1", "zb-v"}, *const whole[] = {"gpipe", "1f1b",
                                                                            "interleaved"};
    epipe_schedule *sc;
    for (size_t i = 0; i < 2; i++) {
        assert_int_equal(epipe_schedule_create(&sc, split[i], 3, 6), EPIPE_OK);
        assert_int_equal(epipe_schedule_splits_backward(sc), 1);
        epipe_schedule_destroy(sc);
    }
    for (size_t i = 0; i < 3; i++) {
        assert_int_equal(epipe_schedule_create(&sc, whole[i], 3, 6), EPIPE_OK);
        assert_int_equal(epipe_schedule_splits_backward(sc), 0);
        epipe_schedule_destroy(sc);
    }
    assert_string_equal(epipe_op_kind_name(EPIPE_OP_BACKWARD_INPUT), "Bi");
    assert_string_equal(epipe_op_kind_name(EPIPE_OP_BACKWARD_WEIGHT), "W");
    /* zb-v defaults to two chunks in a V: stage s on rank s, then back. */
    assert_int_equal(epipe_schedule_create(&sc, "zb-v", 3, 6), EPIPE_OK);
    assert_int_equal(epipe_schedule_pipeline_stages(sc), 6);
    static const unsigned v[] = {0, 1, 2, 2, 1, 0};
    for (unsigned s = 0; s < 6; s++) {
        unsigned r;
        assert_int_equal(epipe_schedule_placement(sc, s, &r, NULL), EPIPE_OK);
        assert_int_equal(r, v[s]);
    }
    epipe_schedule_destroy(sc);
}

static void expect_einval(const char *kind, unsigned ranks, unsigned m,
                          const epipe_schedule_layout *lay, const char *needle)
{
    epipe_schedule *sc = (epipe_schedule *)&sc;
    assert_int_equal(epipe_schedule_create_layout(&sc, kind, ranks, m, lay), EPIPE_EINVAL);
    assert_null(sc);
    if (!strstr(epipe_last_error(), needle))
        fail_msg("'%s' does not say '%s'", epipe_last_error(), needle);
}

static void bad_layouts_are_named(void **state)
{
    (void)state;
    epipe_schedule_layout lay = EPIPE_SCHEDULE_LAYOUT_INIT;
    static const unsigned oor[] = {0, 2, 1}, hole[] = {0, 0, 2}, cs[] = {0, 1, 0};
    lay.placement = oor, lay.placement_len = 3;
    expect_einval("1f1b", 2, 4, &lay, "placement[1] = 2: rank out of range 0..1");
    lay.placement = hole;
    expect_einval("gpipe", 3, 4, &lay, "rank 1 holds no pipeline stage");
    lay.placement_len = 0;
    expect_einval("1f1b", 3, 4, &lay, "length 0");
    lay.placement = NULL, lay.placement_len = 3;
    expect_einval("1f1b", 3, 4, &lay, "placement_len 3 without a placement");
    lay.placement = cs, lay.placement_len = 3, lay.chunks = 2;
    expect_einval("1f1b", 2, 4, &lay, "rank 1 holds 1 chunks");
    lay = (epipe_schedule_layout)EPIPE_SCHEDULE_LAYOUT_INIT;
    lay.struct_size = 4;
    expect_einval("1f1b", 2, 4, &lay, "struct_size");
    lay.struct_size = sizeof lay + 8;
    expect_einval("1f1b", 2, 4, &lay, "struct_size");
    lay = (epipe_schedule_layout)EPIPE_SCHEDULE_LAYOUT_INIT;
    lay.chunks = 600;
    expect_einval("1f1b", 2, 4, &lay, "limit");
    lay.chunks = 65;
    expect_einval("1f1b", 2, 4, &lay, "rank 0 holds 65 chunks, over the limit of 64");
    lay.chunks = 0;
    expect_einval("nope", 2, 4, &lay, "unknown schedule kind 'nope'");
    expect_einval("1f1b", 2, 0, &lay, "0 micro-batches");
    expect_einval("1f1b", 0, 4, &lay, "0 stages");
    expect_einval("zb-h2", 2, 4, &lay, "known: gpipe, 1f1b, interleaved, zb-h1, zb-v");
    lay.chunks = 3;
    expect_einval("zb-v", 2, 4, &lay, "rank 0 holds 3 chunks; zb-v needs 2");
    lay.chunks = 1;
    expect_einval("zb-v", 2, 4, &lay, "rank 0 holds 1 chunks; zb-v needs 2");
    lay.chunks = 0;
    lay.placement = cs, lay.placement_len = 3;
    expect_einval("zb-v", 2, 4, &lay, "rank 1 holds 1 chunks; zb-v needs 2");
    static const unsigned not_rr[] = {0, 1, 1, 0};
    lay.placement = not_rr, lay.placement_len = 4;
    expect_einval("interleaved", 2, 4, &lay, "pipeline stage 2 is on rank 1");
    lay.placement = NULL, lay.placement_len = 0;

    epipe_schedule *sc;
    assert_int_equal(epipe_schedule_create(&sc, "1f1b", 3, 4), EPIPE_OK);
    unsigned st;
    assert_int_equal(epipe_schedule_stage_of(sc, 3, 0, &st), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "rank 3 is out of range 0..2"));
    assert_int_equal(epipe_schedule_stage_of(sc, 1, 1, &st), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "chunk 1 of rank 1"));
    assert_int_equal(epipe_schedule_stage_of(sc, 1, 0, NULL), EPIPE_EINVAL);
    assert_int_equal(epipe_schedule_placement(sc, 3, NULL, NULL), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "pipeline stage 3 is out of range 0..2"));
    assert_int_equal(epipe_schedule_chunks(sc, 3), 0);
    assert_int_equal(epipe_schedule_chunks(NULL, 0), 0);
    assert_int_equal(epipe_schedule_pipeline_stages(NULL), 0);
    assert_int_equal(epipe_schedule_splits_backward(sc), 0);
    assert_int_equal(epipe_schedule_splits_backward(NULL), 0);
    epipe_schedule_destroy(sc);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(every_kind_every_size), cmocka_unit_test(client_server_map),
        cmocka_unit_test(random_placements),     cmocka_unit_test(bubbles_match_the_papers),
        cmocka_unit_test(split_backward_kinds),  cmocka_unit_test(bad_layouts_are_named),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
