/* Error feedback (spec key ef=1): the running sum of what a receiver
 * decodes tracks the sum of the inputs; slots, resets and the wire format. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <epipe/epipe.h>

#include "testutil.h"

#define N 1000

/* A view of x with an explicit shape (ndim values in shape). */
static DLTensor view(float *x, int64_t *shape, int ndim)
{
    DLTensor t;
    memset(&t, 0, sizeof t);
    t.data = x;
    t.device.device_type = kDLCPU;
    t.ndim = ndim;
    t.shape = shape;
    t.dtype.code = kDLFloat;
    t.dtype.bits = 32;
    t.dtype.lanes = 1;
    return t;
}

/* Encodes t with c (micro-batch mb) into a fresh payload. */
static test_payload enc(epipe_codec *c, const DLTensor *t, int64_t mb)
{
    test_payload p;
    assert_int_equal(epipe_codec_set_param(c, EPIPE_CODEC_MICROBATCH, mb), EPIPE_OK);
    assert_int_equal(epipe_codec_max_encoded_size(c, t, &p.len), EPIPE_OK);
    p.buf = malloc(p.len);
    size_t w;
    if (epipe_codec_encode(c, t, p.buf, p.len, &w) != EPIPE_OK)
        fail_msg("encode '%s': %s", epipe_codec_spec(c), epipe_codec_last_error(c));
    assert_int_equal(w, p.len);
    return p;
}

static int same(const test_payload *a, const test_payload *b)
{
    return a->len == b->len && memcmp(a->buf, b->buf, a->len) == 0;
}

/* The largest |sum of T decoded steps - T*g| when the same gradient g is
 * encoded T times with spec (on a shape of ndim dims). */
static double sum_error(const char *spec, const float *g, int64_t *shape, int ndim, size_t n,
                        int steps)
{
    epipe_codec *c = test_codec(spec, 1, 0), *d = test_codec(spec, 1, 0);
    float *x = malloc(n * sizeof *x), *y = malloc(n * sizeof *y);
    double *sum = calloc(n, sizeof *sum);
    memcpy(x, g, n * sizeof *x);
    DLTensor tx = view(x, shape, ndim), ty = view(y, shape, ndim);
    for (int s = 0; s < steps; s++) {
        test_payload p = enc(c, &tx, 0);
        assert_memory_equal(x, g, n * sizeof *x); /* src is only read */
        assert_int_equal(epipe_codec_decode(d, p.buf, p.len, &ty), EPIPE_OK);
        for (size_t i = 0; i < n; i++)
            sum[i] += y[i];
        free(p.buf);
    }
    double worst = 0;
    for (size_t i = 0; i < n; i++)
        worst = fmax(worst, fabs(sum[i] - (double)steps * g[i]));
    free(x), free(y), free(sum);
    epipe_codec_destroy(c), epipe_codec_destroy(d);
    return worst;
}

/* 2-bit quant: with ef the sum's error stays within one step's quantisation
 * error (a quarter of the range here); without, it grows with the steps. */
static void running_sum_tracks_input(void **state)
{
    (void)state;
    float g[N];
    test_fill(g, N, DIST_NORMAL, 7);
    float lo = g[0], hi = g[0];
    for (size_t i = 0; i < N; i++)
        lo = fminf(lo, g[i]), hi = fmaxf(hi, g[i]);
    int64_t shape[1] = {N};
    double range = hi - lo;
    for (int steps = 10; steps <= 400; steps *= 4) {
        double with = sum_error("quant:bits=2,ef=1", g, shape, 1, N, steps);
        double without = sum_error("quant:bits=2", g, shape, 1, N, steps);
        /* x + r stays within about one step of g's range, and r within
         * half a step of that range's 3 steps. */
        if (with > 0.5 * range)
            fail_msg("%d steps: sum error %g with ef over the bound %g", steps, with, 0.5 * range);
        if (steps >= 40 && without < 10 * with)
            fail_msg("%d steps: without ef %g, with %g: ef should win by 10x", steps, without,
                     with);
    }
}

/* Every codec that takes ef: the sum's error after 200 steps is a small
 * fraction of the one without it. */
static void every_lossy_codec(void **state)
{
    (void)state;
    static const char *const specs[] = {
        "cast:dtype=bf16",
        "quant:bits=4",
        "sortquant:bits=4",
        "kmeans:bits=2",
        "topk:ratio=0.1",
#ifdef EPIPE_HAVE_BLAS               /* poweriter needs OpenBLAS/LAPACKE (-Dblas) */
        "poweriter:rank=2,shared=1", /* a [32,32] gradient: PowerSGD's case */
#endif
    };
    float g[1024];
    test_fill(g, 1024, DIST_NORMAL, 11);
    int64_t shape[2] = {32, 32};
    for (size_t s = 0; s < sizeof specs / sizeof specs[0]; s++) {
        char spec[64];
        snprintf(spec, sizeof spec, "%s,ef=1", specs[s]);
        epipe_codec *probe;
        assert_int_equal(epipe_codec_create(&probe, spec), EPIPE_OK);
        float y[1024];
        DLTensor t = view(y, shape, 2);
        size_t cap;
        assert_int_equal(epipe_codec_max_encoded_size(probe, &t, &cap), EPIPE_OK);
        epipe_codec_destroy(probe);
        double with = sum_error(spec, g, shape, 2, 1024, 200);
        double without = sum_error(specs[s], g, shape, 2, 1024, 200);
        if (!(with < 0.2 * without))
            fail_msg("%s: 200 steps: sum error %g with ef, %g without", specs[s], with, without);
    }
}

/* ef changes what is encoded, never the format: the first payload equals
 * the plain codec's, and a later one decodes the same with either handle. */
static void wire_format_unchanged(void **state)
{
    (void)state;
    float g[N], y1[N], y2[N];
    test_fill(g, N, DIST_NORMAL, 3);
    int64_t shape[1] = {N};
    DLTensor t = view(g, shape, 1);
    epipe_codec *ef = test_codec("sortquant:bits=4,ef=1", 1, 0);
    epipe_codec *plain = test_codec("sortquant:bits=4", 1, 0);
    test_payload a = enc(ef, &t, -1), b = enc(plain, &t, -1);
    assert_true(same(&a, &b));
    test_payload c = enc(ef, &t, -1); /* now with a residual */
    assert_false(same(&a, &c));
    DLTensor ty1 = view(y1, shape, 1), ty2 = view(y2, shape, 1);
    assert_int_equal(epipe_codec_decode(plain, c.buf, c.len, &ty1), EPIPE_OK);
    assert_int_equal(epipe_codec_decode(ef, c.buf, c.len, &ty2), EPIPE_OK);
    assert_memory_equal(y1, y2, sizeof y1);
    free(a.buf), free(b.buf), free(c.buf);
    epipe_codec_destroy(ef), epipe_codec_destroy(plain);
}

/* Micro-batch slots keep residuals of their own; -1 is one more slot. */
static void slots_are_independent(void **state)
{
    (void)state;
    float g[N];
    test_fill(g, N, DIST_NORMAL, 5);
    int64_t shape[1] = {N};
    DLTensor t = view(g, shape, 1);
    epipe_codec *c = test_codec("quant:bits=2,ef=1", 1, 0);
    test_payload p0 = enc(c, &t, 0), p1 = enc(c, &t, 1), q = enc(c, &t, -1);
    assert_true(same(&p0, &p1));
    assert_true(same(&p0, &q));
    test_payload p2 = enc(c, &t, 0), p3 = enc(c, &t, 1), p4 = enc(c, &t, 7);
    assert_false(same(&p0, &p2));
    assert_true(same(&p2, &p3));
    assert_true(same(&p0, &p4));
    free(p0.buf), free(p1.buf), free(q.buf), free(p2.buf), free(p3.buf), free(p4.buf);
    epipe_codec_destroy(c);
}

/* epipe_codec_reset_feedback() clears every slot; a shape or dtype change
 * clears the slot it happens in. */
static void resets(void **state)
{
    (void)state;
    float g[N];
    uint16_t h[N];
    test_fill(g, N, DIST_NORMAL, 9);
    int64_t shape1[1] = {N}, shape2[2] = {10, N / 10};
    DLTensor t1 = view(g, shape1, 1), t2 = view(g, shape2, 2);
    epipe_codec *c = test_codec("quant:bits=2,ef=1", 1, 0);
    test_payload first = enc(c, &t1, 0), p;
    free(enc(c, &t1, 0).buf);
    free(enc(c, &t1, 1).buf);
    assert_int_equal(epipe_codec_reset_feedback(c), EPIPE_OK);
    p = enc(c, &t1, 0);
    assert_true(same(&first, &p));
    free(p.buf);
    p = enc(c, &t1, 1);
    assert_true(same(&first, &p));
    free(p.buf);
    /* same values, another shape: slot 0 starts over */
    p = enc(c, &t2, 0);
    assert_true(same(&first, &p));
    free(p.buf);
    p = enc(c, &t2, 0);
    assert_false(same(&first, &p));
    free(p.buf);
    /* another dtype (bf16 of the same values): starts over too */
    for (size_t i = 0; i < N; i++) {
        uint32_t u;
        memcpy(&u, &g[i], 4);
        h[i] = (uint16_t)(u >> 16);
    }
    DLTensor tb = view((float *)h, shape1, 1);
    tb.dtype.code = kDLBfloat;
    tb.dtype.bits = 16;
    epipe_codec *plain = test_codec("quant:bits=2", 1, 0);
    test_payload a = enc(plain, &tb, -1), b = enc(c, &tb, 0);
    assert_true(same(&a, &b));
    free(a.buf), free(b.buf), free(first.buf);
    /* a codec without ef: a no-op; NULL: an error */
    assert_int_equal(epipe_codec_reset_feedback(plain), EPIPE_OK);
    assert_int_equal(epipe_codec_reset_feedback(NULL), EPIPE_EINVAL);
    epipe_codec_destroy(c), epipe_codec_destroy(plain);
}

/* A non-finite value is refused by name, by every codec with ef (cast
 * would pass it otherwise), and leaves the residual as it was. */
static void nonfinite_refused(void **state)
{
    (void)state;
    float g[N], bad[N];
    test_fill(g, N, DIST_NORMAL, 13);
    memcpy(bad, g, sizeof g);
    bad[7] = NAN;
    int64_t shape[1] = {N};
    DLTensor t = view(g, shape, 1), tb = view(bad, shape, 1);
    static const char *const specs[] = {"quant:bits=2,ef=1", "cast:dtype=fp16,ef=1"};
    for (int s = 0; s < 2; s++) {
        epipe_codec *c = test_codec(specs[s], 1, 0), *ref = test_codec(specs[s], 1, 0);
        free(enc(c, &t, 0).buf);
        free(enc(ref, &t, 0).buf);
        uint8_t buf[8192];
        size_t w = 1;
        assert_int_equal(epipe_codec_encode(c, &tb, buf, sizeof buf, &w), EPIPE_EINVAL);
        assert_int_equal(w, 0);
        assert_non_null(strstr(epipe_codec_last_error(c), "index 7 is NaN"));
        test_payload p = enc(c, &t, 0), q = enc(ref, &t, 0);
        assert_true(same(&p, &q));
        free(p.buf), free(q.buf);
        epipe_codec_destroy(c), epipe_codec_destroy(ref);
    }
}

/* Every codec with ef, on a tensor large enough for four workers: a
 * non-finite value at the start, the middle or the end of what one worker
 * reads, and a buffer one byte short, are refused and leave the residual
 * as it was: the next payload equals that of a handle that never saw them. */
static void refusals_keep_the_residual(void **state)
{
    (void)state;
    static const char *const specs[] = {
        "cast:dtype=bf16,ef=1",           "quant:bits=4,ef=1",  "quant:bits=4,rows=1,ef=1",
        "sortquant:bits=4,ef=1",          "kmeans:bits=2,ef=1", "topk:ratio=0.1,ef=1",
#ifdef EPIPE_HAVE_BLAS
        "poweriter:rank=2,shared=1,ef=1",
#endif
    };
    enum { ROWS = 512, COLS = 1024, NV = ROWS * COLS };
    float *x = malloc(sizeof(float) * NV), *bad = malloc(sizeof(float) * NV);
    assert_non_null(x), assert_non_null(bad);
    test_fill(x, NV, DIST_NORMAL, 17);
    int64_t shape[2] = {ROWS, COLS};
    DLTensor t = view(x, shape, 2), tb = view(bad, shape, 2);
    static const size_t at[] = {0, NV / 4 - 1, NV / 2 + 5, NV - 1};
    for (size_t s = 0; s < sizeof specs / sizeof specs[0]; s++) {
        epipe_codec *c = test_codec(specs[s], 4, 0), *ref = test_codec(specs[s], 4, 0);
        free(enc(c, &t, 0).buf); /* a residual to keep */
        free(enc(ref, &t, 0).buf);
        size_t cap, w;
        assert_int_equal(epipe_codec_max_encoded_size(c, &t, &cap), EPIPE_OK);
        uint8_t *buf = malloc(cap);
        for (size_t k = 0; k < sizeof at / sizeof at[0]; k++) {
            memcpy(bad, x, sizeof(float) * NV);
            bad[at[k]] = k % 2 ? NAN : -INFINITY;
            if (epipe_codec_encode(c, &tb, buf, cap, &w) != EPIPE_EINVAL)
                fail_msg("%s: a non-finite value at %zu was not refused", specs[s], at[k]);
        }
        assert_int_equal(epipe_codec_encode(c, &t, buf, cap - 1, &w), EPIPE_ENOSPC);
        test_payload p = enc(c, &t, 0), q = enc(ref, &t, 0);
        if (!same(&p, &q))
            fail_msg("%s: a refused encode changed the next payload", specs[s]);
        free(p.buf), free(q.buf), free(buf);
        epipe_codec_destroy(c), epipe_codec_destroy(ref);
    }
    free(x), free(bad);
}

/* x + r overflowing fp32 is refused by name (fp16 saturates 3e38 to 65504,
 * so the residual is about 3e38 after one step), and the residual kept. */
static void overflow_refused(void **state)
{
    (void)state;
    float g[4] = {3e38f, 1, 2, 3};
    int64_t shape[1] = {4};
    DLTensor t = view(g, shape, 1);
    epipe_codec *c = test_codec("cast:dtype=fp16,ef=1", 1, 0);
    free(enc(c, &t, 0).buf);
    uint8_t buf[64];
    size_t w;
    assert_int_equal(epipe_codec_encode(c, &t, buf, sizeof buf, &w), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_codec_last_error(c), "index 0 (3e+38) plus its residual"));
    g[0] = -3e38f; /* now x + r is about 0: accepted */
    free(enc(c, &t, 0).buf);
    epipe_codec_destroy(c);
}

/* Slots past the limit are refused, naming the micro-batch; a reset frees
 * them. The scalar reference and threads give the same bytes with ef. */
static void slot_limit_and_reference(void **state)
{
    (void)state;
    float g[4] = {1, -2, 3, 0.5f};
    int64_t shape[1] = {4};
    DLTensor t = view(g, shape, 1);
    epipe_codec *c = test_codec("quant:bits=2,ef=1", 1, 0);
    for (int64_t mb = 0; mb < 4096; mb++)
        free(enc(c, &t, mb).buf);
    uint8_t buf[64];
    size_t w;
    assert_int_equal(epipe_codec_set_param(c, EPIPE_CODEC_MICROBATCH, 5000), EPIPE_OK);
    assert_int_equal(epipe_codec_encode(c, &t, buf, sizeof buf, &w), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_codec_last_error(c), "micro-batch 5000"));
    assert_int_equal(epipe_codec_reset_feedback(c), EPIPE_OK);
    free(enc(c, &t, 5000).buf);
    epipe_codec_destroy(c);

    static float x[300000];
    test_fill(x, 300000, DIST_NORMAL, 17);
    int64_t big[1] = {300000};
    DLTensor tx = view(x, big, 1);
    epipe_codec *fast = test_codec("quant:bits=3,ef=1", 2, 0);
    epipe_codec *ref = test_codec("quant:bits=3,ef=1", 1, 1);
    for (int step = 0; step < 3; step++) {
        test_payload a = enc(fast, &tx, 0), b = enc(ref, &tx, 0);
        assert_true(same(&a, &b));
        free(a.buf), free(b.buf);
    }
    epipe_codec_destroy(fast), epipe_codec_destroy(ref);
}

static void expect_refused(const char *spec, const char *needle)
{
    epipe_codec *c = (epipe_codec *)1;
    int rc = epipe_codec_create(&c, spec);
    if (rc != EPIPE_EINVAL || !strstr(epipe_last_error(), needle))
        fail_msg("'%s': rc %d, message '%s', expected EINVAL mentioning '%s'", spec, rc,
                 epipe_last_error(), needle);
    assert_null(c);
}

/* The key in specs: canonical form, reading it back, and where it is refused. */
static void spec_key(void **state)
{
    (void)state;
    epipe_codec *c = test_codec("quant:ef=1,bits=3", 1, 0);
    assert_string_equal(epipe_codec_spec(c), "quant:bits=3,ef=1");
    double v = -1, lo = -1, hi = -1;
    assert_int_equal(epipe_codec_spec_param(c, "ef", &v), EPIPE_OK);
    assert_true(v == 1);
    epipe_codec *again = test_codec(epipe_codec_spec(c), 1, 0);
    assert_string_equal(epipe_codec_spec(again), epipe_codec_spec(c));
    epipe_codec_destroy(c), epipe_codec_destroy(again);
    c = test_codec("quant:bits=3,ef=0", 1, 0);
    assert_string_equal(epipe_codec_spec(c), "quant:bits=3");
    assert_int_equal(epipe_codec_spec_param(c, "ef", &v), EPIPE_OK);
    assert_true(v == 0);
    epipe_codec_destroy(c);
    c = test_codec("cast:ef=1", 1, 0);
    assert_non_null(strstr(epipe_codec_spec(c), ",ef=1"));
    epipe_codec_destroy(c);
    assert_int_equal(epipe_codec_param_bounds("topk", "ef", &lo, &hi), EPIPE_OK);
    assert_true(lo == 0 && hi == 1);
    assert_int_equal(epipe_codec_param_bounds("none", "ef", &lo, &hi), EPIPE_EINVAL);
    expect_refused("quant:bits=3,ef=2", "'ef' = '2' is not 0 or 1");
    expect_refused("quant:bits=3,ef=1,ef=1", "'ef' is given twice");
    expect_refused("none:ef=1", "lossless");
#ifdef EPIPE_HAVE_BLAS /* insert needs OpenBLAS/LAPACKE (-Dblas); without it, EPIPE_ENOTSUP */
    expect_refused("insert:kind=linear,out=8,ef=1", "trainable");
    expect_refused("insert:kind=linear,out=8|quant:bits=4,ef=1", "inside a chain");
#endif
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(running_sum_tracks_input),
        cmocka_unit_test(every_lossy_codec),
        cmocka_unit_test(wire_format_unchanged),
        cmocka_unit_test(slots_are_independent),
        cmocka_unit_test(resets),
        cmocka_unit_test(nonfinite_refused),
        cmocka_unit_test(refusals_keep_the_residual),
        cmocka_unit_test(spec_key),
        cmocka_unit_test(overflow_refused),
        cmocka_unit_test(slot_limit_and_reference),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
