/* The compression-aware planner: splits that follow the link and the
 * codecs, error budgets and memory limits honoured, the compression-blind
 * plan beside it, and bad input refused by name. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include <epipe/epipe.h>

static epipe_plan_layer layer(double fb, double out)
{
    epipe_plan_layer l = {fb / 3, 2 * fb / 3, 0, out, 1e6, 1e5, 0};
    return l;
}

static epipe_plan_options opts(unsigned stages, unsigned m, double bw)
{
    epipe_plan_options o = EPIPE_PLAN_OPTIONS_INIT;
    o.stages = stages;
    o.microbatches = m;
    o.bandwidth = bw;
    return o;
}

static epipe_plan *plan_ok(const epipe_plan_layer *l, size_t n, const epipe_plan_codec *c,
                           size_t nc, const epipe_plan_options *o)
{
    epipe_plan *p = NULL;
    int rc = epipe_plan_create(&p, l, n, c, nc, o);
    if (rc)
        fail_msg("epipe_plan_create: %s", epipe_last_error());
    return p;
}

/* One stage holds every layer; the step is the micro-batches' compute. */
static void one_stage_holds_everything(void **state)
{
    (void)state;
    epipe_plan_layer l[3] = {layer(1, 10), layer(2, 10), layer(3, 10)};
    epipe_plan_options o = opts(1, 4, 1e9);
    epipe_plan *p = plan_ok(l, 3, NULL, 0, &o);
    assert_int_equal(epipe_plan_first_layer(p, 0), 0);
    assert_int_equal(epipe_plan_first_layer(p, 1), 3);
    assert_true(fabs(epipe_plan_step_seconds(p) - 4 * 6.0) < 1e-9);
    assert_null(epipe_plan_codec_spec(p, 0, 0));
    epipe_plan_destroy(p);
    /* the optimiser's step comes once a training step, after the pipeline */
    l[1].update_s = 0.5;
    p = plan_ok(l, 3, NULL, 0, &o);
    assert_true(fabs(epipe_plan_step_seconds(p) - (4 * 6.0 + 0.5)) < 1e-9);
    epipe_plan_destroy(p);
}

/* A free link: the split balances compute, as the blind one does. */
static void fast_link_balances_compute(void **state)
{
    (void)state;
    epipe_plan_layer l[4] = {layer(1, 1e3), layer(1, 1e3), layer(1, 1e3), layer(1, 1e3)};
    epipe_plan_options o = opts(2, 8, 1e15);
    epipe_plan *p = plan_ok(l, 4, NULL, 0, &o);
    assert_int_equal(epipe_plan_first_layer(p, 1), 2);
    assert_string_equal(epipe_plan_codec_spec(p, 0, 0), "none");
    assert_true(fabs(epipe_plan_step_seconds(p) - epipe_plan_blind_step_seconds(p)) < 1e-6);
    epipe_plan_destroy(p);
}

/* A slow link: the cut goes where the activation is small, though compute
 * is then uneven; the blind split (by compute) pays the link. */
static void slow_link_cuts_where_the_activation_is_small(void **state)
{
    (void)state;
    epipe_plan_layer l[4] = {layer(1, 1e3), layer(1, 1e7), layer(1, 1e7), layer(1, 1e7)};
    epipe_plan_options o = opts(2, 8, 1e6); /* 10 s for a large activation */
    epipe_plan *p = plan_ok(l, 4, NULL, 0, &o);
    assert_int_equal(epipe_plan_first_layer(p, 1), 1);
    assert_true(epipe_plan_blind_step_seconds(p) > 3 * epipe_plan_step_seconds(p));
    char text[4096];
    size_t n = epipe_plan_explain(p, text, sizeof text);
    assert_true(n > 0 && n < sizeof text);
    assert_non_null(strstr(text, "stage 0: layers 0..0"));
    assert_non_null(strstr(text, "bottleneck: stage 1"));
    assert_non_null(strstr(text, "compression-blind"));
    assert_non_null(strstr(text, "bottleneck: the link of boundary 0"));
    /* explain with a small buffer: truncated, NUL-terminated, full length */
    char small[16];
    assert_int_equal(epipe_plan_explain(p, small, sizeof small), n);
    assert_int_equal(strlen(small), sizeof small - 1);
    epipe_plan_destroy(p);
}

/* A codec that shrinks a slow link's message is chosen, each way; an
 * error budget it exceeds, or a cost above what it saves, rules it out. */
static void codecs_are_chosen_when_they_pay(void **state)
{
    (void)state;
    epipe_plan_layer l[2] = {layer(0.3, 1e7), layer(0.3, 1e7)};
    epipe_plan_codec c[4] = {
        {"sortquant:bits=8", 0, 0, 0.01, 0.01, 0.25, 1e-4},
        {"sortquant:bits=8", 0, 1, 0.01, 0.01, 0.25, 1e-3},
        {"quant:bits=4", 0, 0, 0.01, 0.01, 0.125, 5e-2},
        {"topk:ratio=0.01", 0, 1, 0.02, 0.01, 0.02, 0.5},
    };
    epipe_plan_options o = opts(2, 8, 1e7); /* 1 s a raw message */
    o.act_error_budget = 1e-3;
    o.grad_error_budget = 1e-2;
    epipe_plan *p = plan_ok(l, 2, c, 4, &o);
    assert_string_equal(epipe_plan_codec_spec(p, 0, 0), "sortquant:bits=8");
    assert_string_equal(epipe_plan_codec_spec(p, 0, 1), "sortquant:bits=8");
    if (!(epipe_plan_blind_step_seconds(p) > 2 * epipe_plan_step_seconds(p)))
        fail_msg("blind %g, plan %g", epipe_plan_blind_step_seconds(p), epipe_plan_step_seconds(p));
    epipe_plan_destroy(p);
    /* no budgets: the smallest messages win */
    o.act_error_budget = o.grad_error_budget = -1;
    p = plan_ok(l, 2, c, 4, &o);
    assert_string_equal(epipe_plan_codec_spec(p, 0, 0), "quant:bits=4");
    assert_string_equal(epipe_plan_codec_spec(p, 0, 1), "topk:ratio=0.01");
    epipe_plan_destroy(p);
    /* a free link: no codec pays for its time */
    o.bandwidth = 1e15;
    p = plan_ok(l, 2, c, 4, &o);
    assert_string_equal(epipe_plan_codec_spec(p, 0, 0), "none");
    assert_string_equal(epipe_plan_codec_spec(p, 0, 1), "none");
    epipe_plan_destroy(p);
}

/* The memory limit moves the split; nothing fitting is refused by name. */
static void memory_limit_moves_the_split(void **state)
{
    (void)state;
    epipe_plan_layer l[4] = {layer(1, 1e3), layer(1, 1e3), layer(1, 1e3), layer(1, 1e3)};
    l[0].param_bytes = 30e6; /* 90 MB with gradients and optimiser state */
    l[1].param_bytes = 5e6;  /* with layer 0: 105 MB */
    epipe_plan_options o = opts(2, 4, 1e15);
    o.memory_bytes = 100e6;
    epipe_plan *p = plan_ok(l, 4, NULL, 0, &o);
    assert_int_equal(epipe_plan_first_layer(p, 1), 1); /* layer 0 alone fits */
    epipe_plan_destroy(p);
    o.memory_bytes = 50e6;
    p = (epipe_plan *)1;
    assert_int_equal(epipe_plan_create(&p, l, 4, NULL, 0, &o), EPIPE_ENOTSUP);
    assert_null(p);
    assert_non_null(strstr(epipe_last_error(), "fits 5e+07 bytes per device"));
}

/* The candidate schedules are honoured; with split backwards zb-h1 fills
 * bubbles the others leave. */
static void schedules_are_candidates(void **state)
{
    (void)state;
    epipe_plan_layer l[4] = {layer(3, 1e3), layer(3, 1e3), layer(3, 1e3), layer(3, 1e3)};
    for (int i = 0; i < 4; i++)
        l[i].weight_s = l[i].backward_s / 2;
    epipe_plan_options o = opts(4, 4, 1e15);
    o.schedules = "1f1b";
    epipe_plan *p = plan_ok(l, 4, NULL, 0, &o);
    assert_string_equal(epipe_plan_schedule(p), "1f1b");
    double t1 = epipe_plan_step_seconds(p);
    epipe_plan_destroy(p);
    o.schedules = NULL;
    p = plan_ok(l, 4, NULL, 0, &o);
    assert_string_equal(epipe_plan_schedule(p), "zb-h1");
    assert_true(epipe_plan_step_seconds(p) < t1);
    epipe_plan_destroy(p);
}

static void refused(const epipe_plan_layer *l, size_t n, const epipe_plan_codec *c, size_t nc,
                    const epipe_plan_options *o, int status, const char *needle)
{
    epipe_plan *p = NULL;
    assert_int_equal(epipe_plan_create(&p, l, n, c, nc, o), status);
    assert_null(p);
    if (!strstr(epipe_last_error(), needle))
        fail_msg("'%s' not in '%s'", needle, epipe_last_error());
}

static void bad_input_is_refused(void **state)
{
    (void)state;
    epipe_plan_layer l[3] = {layer(1, 1e3), layer(1, 1e3), layer(1, 1e3)};
    epipe_plan_options o = opts(2, 4, 1e9);
    epipe_plan_layer bad[3] = {l[0], l[1], l[2]};
    bad[1].forward_s = NAN;
    refused(bad, 3, NULL, 0, &o, EPIPE_EINVAL, "layer 1 has forward_s = nan");
    bad[1] = l[1];
    bad[2].weight_s = 5;
    refused(bad, 3, NULL, 0, &o, EPIPE_EINVAL, "layer 2 has weight_s 5 > backward_s");
    epipe_plan_codec c = {"quant:bits=8", 2, 0, 0, 0, 0.25, 0};
    refused(l, 3, &c, 1, &o, EPIPE_EINVAL, "boundary after layer 2; the 3 layers have");
    c.layer = 0;
    c.wire_ratio = 0;
    refused(l, 3, &c, 1, &o, EPIPE_EINVAL, "the ratio finite and > 0");
    c.wire_ratio = 0.25;
    c.dir = 2;
    refused(l, 3, &c, 1, &o, EPIPE_EINVAL, "direction 2");
    c.dir = 0;
    c.spec = NULL;
    refused(l, 3, &c, 1, &o, EPIPE_EINVAL, "has no spec");
    epipe_plan_options b = o;
    b.stages = 4;
    refused(l, 3, NULL, 0, &b, EPIPE_EINVAL, "4 stages for 3 layers");
    b = o;
    b.schedules = "1f1b,zbv";
    refused(l, 3, NULL, 0, &b, EPIPE_EINVAL, "schedule 'zbv' in '1f1b,zbv'");
    b = o;
    b.bandwidth = 0;
    refused(l, 3, NULL, 0, &b, EPIPE_EINVAL, "from device 0 to 1 has bandwidth 0");
    b = o;
    b.struct_size = 8;
    refused(l, 3, NULL, 0, &b, EPIPE_EINVAL, "EPIPE_PLAN_OPTIONS_INIT");
    b = o;
    b.microbatches = 0;
    refused(l, 3, NULL, 0, &b, EPIPE_EINVAL, "0 micro-batches");
    refused(NULL, 3, NULL, 0, &o, EPIPE_EINVAL, "must be given");
    {
        /* a problem too large to tabulate is refused, not attempted: from
         * its size alone (stages x layers), before anything is built, or
         * once the codec options a boundary are known */
        static epipe_plan_layer many[200000];
        for (size_t i = 0; i < 200000; i++)
            many[i] = layer(1, 1);
        b = o;
        b.stages = 1000;
        refused(many, 200000, NULL, 0, &b, EPIPE_EINVAL, "make at least 200201001 cells; at most");
        epipe_plan_codec one = {"quant:bits=8", 7, 0, 0.01, 0.01, 0.25, 0}; /* not dominated */
        refused(many, 20000, &one, 1, &b, EPIPE_EINVAL, "x 2 codec options a boundary make");
    }
    assert_int_equal(epipe_plan_create(NULL, l, 3, NULL, 0, &o), EPIPE_EINVAL);
    /* results of NULL */
    assert_int_equal(epipe_plan_first_layer(NULL, 0), (unsigned)-1);
    assert_null(epipe_plan_schedule(NULL));
    assert_true(isnan(epipe_plan_step_seconds(NULL)));
    epipe_plan_destroy(NULL);
}

/* Per-pair links: a slow pair moves the cut off it. */
static void pair_links(void **state)
{
    (void)state;
    epipe_plan_layer l[6];
    for (int i = 0; i < 6; i++)
        l[i] = layer(1, 1e7);
    double bw[9], lat[9];
    for (int i = 0; i < 9; i++)
        bw[i] = 1e15, lat[i] = 0;
    bw[1 * 3 + 2] = bw[2 * 3 + 1] = 1e6; /* devices 1 and 2: 10 s a message */
    epipe_plan_options o = opts(3, 4, 1e15);
    o.pair_bandwidth = bw;
    o.pair_latency_s = lat;
    epipe_plan *p = plan_ok(l, 6, NULL, 0, &o);
    /* the boundary between stages 1 and 2 costs 10 s whatever the cut: the
     * plan still balances compute, and the step pays that link */
    assert_true(epipe_plan_step_seconds(p) > 40);
    epipe_plan_destroy(p);
}

/* ---- against exhaustive search --------------------------------------------
 * Small random chains: every split, every codec each way on every
 * boundary, every schedule, timed by the simulator as the planner times
 * them. The planner's programme proposes and the simulator judges, so its
 * plan may miss the optimum; it must stay close. */

static uint64_t rng = 88172645463325252ull;
static double urand(void)
{
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (double)(rng >> 11) * 0x1p-53;
}

struct brute {
    const epipe_plan_layer *l;
    unsigned L, P, M;
    const epipe_plan_codec *c;
    unsigned nc;
    double bw;
    unsigned first[8];
    int act[8], grad[8]; /* codec entry per boundary, -1: none */
    double best;
};

static double sim_time(struct brute *b, const char *kind)
{
    epipe_schedule *s;
    epipe_sim *sim;
    assert_int_equal(epipe_schedule_create(&s, kind, b->P, b->M), EPIPE_OK);
    assert_int_equal(epipe_sim_create(&sim, s), EPIPE_OK);
    int split = epipe_schedule_splits_backward(s) == 1;
    for (unsigned st = 0; st < b->P; st++) {
        double f = 0, bw = 0, w = 0;
        for (unsigned i = b->first[st]; i < b->first[st + 1]; i++)
            f += b->l[i].forward_s, bw += b->l[i].backward_s, w += b->l[i].weight_s;
        epipe_sim_set_cost(sim, EPIPE_SIM_FORWARD, st, f);
        epipe_sim_set_cost(sim, EPIPE_SIM_BACKWARD, st, split ? bw - w : bw);
        epipe_sim_set_cost(sim, EPIPE_SIM_WEIGHT, st, split ? w : 0);
        if (st + 1 < b->P) {
            double bytes = b->l[b->first[st + 1] - 1].out_bytes;
            const epipe_plan_codec *a = b->act[st] >= 0 ? &b->c[b->act[st]] : NULL,
                                   *g = b->grad[st] >= 0 ? &b->c[b->grad[st]] : NULL;
            epipe_sim_set_cost(sim, EPIPE_SIM_SEND_ACT, st,
                               (bytes * (a ? a->wire_ratio : 1) + 208) / b->bw);
            epipe_sim_set_cost(sim, EPIPE_SIM_SEND_GRAD, st + 1,
                               (bytes * (g ? g->wire_ratio : 1) + 208) / b->bw);
            epipe_sim_set_cost(sim, EPIPE_SIM_ENCODE_ACT, st, a ? a->encode_s : 0);
            epipe_sim_set_cost(sim, EPIPE_SIM_DECODE_ACT, st, a ? a->decode_s : 0);
            epipe_sim_set_cost(sim, EPIPE_SIM_ENCODE_GRAD, st + 1, g ? g->encode_s : 0);
            epipe_sim_set_cost(sim, EPIPE_SIM_DECODE_GRAD, st + 1, g ? g->decode_s : 0);
        }
    }
    assert_int_equal(epipe_sim_run(sim), EPIPE_OK);
    double t = epipe_sim_makespan(sim);
    epipe_sim_destroy(sim);
    epipe_schedule_destroy(s);
    return t;
}

static void brute_codecs(struct brute *b, unsigned bd)
{
    if (bd + 1 == b->P) {
        static const char *const kinds[3] = {"gpipe", "1f1b", "zb-h1"};
        for (int k = 0; k < 3; k++) {
            double t = sim_time(b, kinds[k]);
            b->best = t < b->best ? t : b->best;
        }
        return;
    }
    unsigned layer = b->first[bd + 1] - 1;
    for (int a = -1; a < (int)b->nc; a++) {
        if (a >= 0 && (b->c[a].layer != layer || b->c[a].dir != 0))
            continue;
        for (int g = -1; g < (int)b->nc; g++) {
            if (g >= 0 && (b->c[g].layer != layer || b->c[g].dir != 1))
                continue;
            b->act[bd] = a, b->grad[bd] = g;
            brute_codecs(b, bd + 1);
        }
    }
}

static void brute_splits(struct brute *b, unsigned st)
{
    if (st == b->P) {
        brute_codecs(b, 0);
        return;
    }
    unsigned lo = b->first[st - 1] + 1, hi = b->L - (b->P - st);
    for (unsigned j = lo; j <= hi; j++) {
        b->first[st] = j;
        brute_splits(b, st + 1);
    }
}

/* The sanitizer build checks memory, the plain build the plans' quality:
 * under ASan a third of the trials (they took two minutes of CI). */
#if defined(__SANITIZE_ADDRESS__)
#define PLAN_TRIALS 10
#else
#define PLAN_TRIALS 30
#endif

static void close_to_exhaustive_search(void **state)
{
    (void)state;
    double worst = 1;
    for (int trial = 0; trial < PLAN_TRIALS; trial++) {
        unsigned L = 4 + trial % 3, P = 2 + trial % 2, M = 2 + trial % 5;
        epipe_plan_layer l[6];
        for (unsigned i = 0; i < L; i++) {
            double f = 0.2 + urand();
            l[i] = (epipe_plan_layer){f, 2 * f, urand() * f, 1e5 + urand() * 2e6, 0, 0, 0};
        }
        epipe_plan_codec c[20];
        unsigned nc = 0;
        for (unsigned k = 0; k + 1 < L; k++)
            for (unsigned d = 0; d < 2; d++)
                for (int v = 0; v < 2; v++)
                    c[nc++] = (epipe_plan_codec){
                        v ? "cheap" : "small",          k, d, urand() * 0.3, urand() * 0.3,
                        v ? 0.5 : 0.05 + 0.1 * urand(), 0};
        double bw = 1e6 * (0.5 + 2 * urand());
        epipe_plan_options o = opts(P, M, bw);
        epipe_plan *p = plan_ok(l, L, c, nc, &o);
        struct brute b = {l, L, P, M, c, nc, bw, {0}, {0}, {0}, INFINITY};
        b.first[0] = 0;
        b.first[P] = L;
        brute_splits(&b, 1);
        double t = epipe_plan_step_seconds(p), r = t / b.best;
        if (r < 1 - 1e-9)
            fail_msg("trial %d: the plan (%g s) beats exhaustive search (%g s)", trial, t, b.best);
        worst = r > worst ? r : worst;
        epipe_plan_destroy(p);
    }
    printf("worst plan over the exhaustive optimum in %d trials: %.4f\n", PLAN_TRIALS, worst);
    assert_true(worst < 1.10);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(one_stage_holds_everything),
        cmocka_unit_test(fast_link_balances_compute),
        cmocka_unit_test(slow_link_cuts_where_the_activation_is_small),
        cmocka_unit_test(codecs_are_chosen_when_they_pay),
        cmocka_unit_test(memory_limit_moves_the_split),
        cmocka_unit_test(schedules_are_candidates),
        cmocka_unit_test(bad_input_is_refused),
        cmocka_unit_test(pair_links),
        cmocka_unit_test(close_to_exhaustive_search),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
