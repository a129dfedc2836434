/* quant: the half-step error bound at every width, exact all-equal input,
 * fast path byte-identical to the reference on every thread count, and
 * NaN input, hostile payloads and bad specs rejected by name; zero=1;
 * rows=1. */
#include <float.h>
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

#include "../codecs/quantize_common.h"
#include "../lib/codec/codec_impl.h"
#include "tensor.h"
#include "testutil.h"

#define HDR 16

/* Every value within half a step (plus float rounding), at every width. */
static void half_step_bound(void **state)
{
    (void)state;
    const size_t n = 10007;
    float *x = malloc(sizeof *x * n), *y = malloc(sizeof *y * n);
    for (int d = 0; d < 4; d++) {
        test_fill(x, n, (enum test_dist)d, 31 + (uint64_t)d);
        float lo = x[0], hi = x[0], amax = 0;
        for (size_t i = 0; i < n; i++) {
            lo = fminf(lo, x[i]);
            hi = fmaxf(hi, x[i]);
            amax = fmaxf(amax, fabsf(x[i]));
        }
        for (unsigned bits = 1; bits <= 16; bits++) {
            char spec[32];
            snprintf(spec, sizeof spec, "quant:bits=%u", bits);
            test_payload p = test_encode(spec, x, n, 1, 0);
            assert_int_equal(p.len, HDR + 8 + (n * bits + 7) / 8);
            float min = epipe_get_f32(p.buf + HDR), step = epipe_get_f32(p.buf + HDR + 4);
            assert_true(min == lo);
            assert_true(fabs((double)step - ((double)hi - lo) / ((1u << bits) - 1)) <= 1e-6 * step);
            test_decode(spec, &p, y, n, 1, 0);
            for (size_t i = 0; i < n; i++) {
                double err = fabs((double)x[i] - y[i]);
                if (err > step / 2 * (1 + 1e-6) + 16 * FLT_EPSILON * amax)
                    fail_msg("%s dist %d: x[%zu]=%g decoded %g, step %g", spec, d, i, (double)x[i],
                             (double)y[i], (double)step);
            }
            free(p.buf);
        }
    }
    free(x);
    free(y);
}

static void all_equal_is_exact(void **state)
{
    (void)state;
    float x[300], y[300];
    for (int i = 0; i < 300; i++)
        x[i] = -7.25f;
    for (unsigned bits = 1; bits <= 16; bits += 5) {
        char spec[32];
        snprintf(spec, sizeof spec, "quant:bits=%u", bits);
        test_payload p = test_encode(spec, x, 300, 1, 0);
        assert_true(epipe_get_f32(p.buf + HDR + 4) == 0.0f);
        test_decode(spec, &p, y, 300, 1, 0);
        for (int i = 0; i < 300; i++)
            assert_true(y[i] == -7.25f);
        free(p.buf);
    }
    /* the full float range still decodes to finite values */
    float z[4] = {-FLT_MAX, FLT_MAX, 0.0f, 1.0f};
    test_payload p = test_encode("quant:bits=1", z, 4, 1, 0);
    test_decode("quant:bits=1", &p, y, 4, 1, 0);
    for (int i = 0; i < 4; i++)
        assert_true(isfinite(y[i]));
    free(p.buf);
}

static void check_same(const char *spec, float *x, size_t n)
{
    test_payload r = test_encode(spec, x, n, 1, 1);
    const int threads[] = {1, 2, 3, 7};
    float *y = malloc(sizeof *y * (n + 1)), *yr = malloc(sizeof *yr * (n + 1));
    test_decode(spec, &r, yr, n, 1, 1);
    for (size_t t = 0; t < 4; t++) {
        test_payload f = test_encode(spec, x, n, threads[t], 0);
        assert_int_equal(f.len, r.len);
        if (memcmp(f.buf, r.buf, r.len) != 0)
            fail_msg("%s n=%zu threads=%d: fast bytes differ from the reference", spec, n,
                     threads[t]);
        test_decode(spec, &f, y, n, threads[t], 0);
        if (n && memcmp(y, yr, n * sizeof *y) != 0)
            fail_msg("%s n=%zu threads=%d: decoders disagree", spec, n, threads[t]);
        free(f.buf);
    }
    free(y);
    free(yr);
    free(r.buf);
}

/* Fast and reference agree byte for byte: odd sizes, every width, and
 * sizes that run on several threads. */
static void fast_matches_reference(void **state)
{
    (void)state;
    const size_t sizes[] = {0, 1, 2, 7, 8, 9, 63, 64, 65, 1000, 4097};
    float *x = malloc(sizeof *x * 600000);
    for (unsigned bits = 1; bits <= 16; bits++)
        for (size_t z = 0; z < sizeof sizes / sizeof *sizes; z++) {
            char spec[32];
            snprintf(spec, sizeof spec, "quant:bits=%u", bits);
            test_fill(x, sizes[z], (enum test_dist)(z % 4), bits * 100 + z);
            check_same(spec, x, sizes[z]);
        }
    const size_t big[] = {262151, 393219, 600000};
    for (size_t z = 0; z < 3; z++) {
        test_fill(x, big[z], (enum test_dist)z, 5 + z);
        check_same(z == 1 ? "quant:bits=7" : "quant:bits=8", x, big[z]);
    }
    /* signed zeros: the minimum is +0 whichever zero a thread saw first */
    for (size_t i = 0; i < 300000; i++)
        x[i] = (i % 2 ? 1.0f : -0.0f) * (float)(i % 5);
    check_same("quant:bits=4", x, 300000);
    free(x);
}

/* The generic vector kernels (no AVX2) give the reference's bytes too. */
static void generic_kernels_match_reference(void **state)
{
    (void)state;
    int was = epipe_q_set_simd(0);
    float *x = malloc(sizeof *x * 270001);
    const size_t sizes[] = {1, 9, 1001, 270001};
    for (unsigned bits = 1; bits <= 16; bits += 3)
        for (size_t z = 0; z < 4; z++) {
            char spec[32];
            snprintf(spec, sizeof spec, "quant:bits=%u", bits);
            test_fill(x, sizes[z], (enum test_dist)(z % 4), bits + 10 * z);
            check_same(spec, x, sizes[z]);
        }
    free(x);
    epipe_q_set_simd(was);
}

/* The shared finiteness scan: the largest finite values and denormals pass,
 * and the first NaN or infinity is found in any block. */
static void find_nonfinite_scan(void **state)
{
    (void)state;
    enum { N = 10000 };
    static float x[N];
    for (int i = 0; i < N; i++)
        x[i] = i % 3 == 0 ? FLT_MAX : i % 3 == 1 ? -FLT_MAX : 1e-42f;
    assert_int_equal(epipe_find_nonfinite(x, N), N);
    assert_int_equal(epipe_find_nonfinite(x, 0), 0);
    x[9000] = -INFINITY;
    x[8191] = NAN;
    assert_int_equal(epipe_find_nonfinite(x, N), 8191);
    assert_int_equal(epipe_find_nonfinite(x, 8191), 8191);
    x[8191] = 0;
    assert_int_equal(epipe_find_nonfinite(x, N), 9000);
    x[4095] = INFINITY;
    assert_int_equal(epipe_find_nonfinite(x, N), 4095);
}

static void nonfinite_rejected(void **state)
{
    (void)state;
    float x[3000];
    test_fill(x, 3000, DIST_UNIFORM, 2);
    const float bad[] = {NAN, INFINITY, -INFINITY};
    const size_t where[] = {2999, 0, 1234};
    uint8_t buf[8192];
    for (int ref = 0; ref < 2; ref++)
        for (size_t b = 0; b < 3; b++) {
            float keep = x[where[b]];
            x[where[b]] = bad[b];
            epipe_codec *c = test_codec("quant:bits=8", 1, ref);
            int64_t shape;
            DLTensor t = test_view_f32(x, &shape, 3000);
            size_t w;
            assert_int_equal(epipe_codec_encode(c, &t, buf, sizeof buf, &w), EPIPE_EINVAL);
            char idx[32];
            snprintf(idx, sizeof idx, "index %zu", where[b]);
            if (!strstr(epipe_codec_last_error(c), idx))
                fail_msg("message '%s' lacks '%s'", epipe_codec_last_error(c), idx);
            epipe_codec_destroy(c);
            x[where[b]] = keep;
        }
}

static void hostile_payloads(void **state)
{
    (void)state;
    float x[13];
    test_fill(x, 13, DIST_NORMAL, 8);
    const char *spec = "quant:bits=7";
    test_payload p = test_encode(spec, x, 13, 1, 0);
    uint8_t orig[256];
    memcpy(orig, p.buf, p.len);
    epipe_put_f32(p.buf + HDR, NAN);
    test_expect_proto(spec, &p, 13, "min");
    memcpy(p.buf, orig, p.len);
    epipe_put_f32(p.buf + HDR, -INFINITY);
    test_expect_proto(spec, &p, 13, "min");
    memcpy(p.buf, orig, p.len);
    epipe_put_f32(p.buf + HDR + 4, -1.0f);
    test_expect_proto(spec, &p, 13, "step");
    memcpy(p.buf, orig, p.len);
    epipe_put_f32(p.buf + HDR + 4, NAN);
    test_expect_proto(spec, &p, 13, "step");
    memcpy(p.buf, orig, p.len);
    epipe_put_f32(p.buf + HDR + 4, 1e37f); /* 127 steps overflow */
    test_expect_proto(spec, &p, 13, "float range");
    memcpy(p.buf, orig, p.len);
    p.buf[p.len - 1] |= 0x80; /* 13 * 7 = 91 bits: 5 bits of padding */
    test_expect_proto(spec, &p, 13, "padding");
    free(p.buf);
}

/* zero=1: every 0 decodes to exactly 0, the half-step bound still holds,
 * fast and reference agree, input without 0 inside its range is coded as
 * without the key, and the payload is the plain format (a decoder without
 * the key reads it). */
static void zero_is_a_level(void **state)
{
    (void)state;
    const size_t n = 20011;
    float *x = malloc(sizeof *x * n), *y = malloc(sizeof *y * n), *y0 = malloc(sizeof *y0 * n);
    for (int d = 0; d < 4; d++) {
        test_fill(x, n, (enum test_dist)d, 77 + (uint64_t)d);
        for (size_t i = 0; i < n; i += 3) /* a masked gradient: a third exact zeros */
            x[i] = i % 2 ? 0.0f : -0.0f;
        if (d == 3) /* and once with 0 as the largest value */
            for (size_t i = 0; i < n; i++)
                x[i] = -fabsf(x[i]);
        float amax = 0;
        for (size_t i = 0; i < n; i++)
            amax = fmaxf(amax, fabsf(x[i]));
        for (unsigned bits = 1; bits <= 16; bits++) {
            char spec[40], plain[40];
            snprintf(spec, sizeof spec, "quant:bits=%u,zero=1", bits);
            snprintf(plain, sizeof plain, "quant:bits=%u", bits);
            check_same(spec, x, n);
            test_payload p = test_encode(spec, x, n, 2, 0);
            float min = epipe_get_f32(p.buf + HDR), step = epipe_get_f32(p.buf + HDR + 4);
            test_decode(spec, &p, y, n, 1, 0);
            test_decode(plain, &p, y0, n, 1, 0);
            assert_memory_equal(y, y0, n * sizeof *y);
            for (size_t i = 0; i < n; i++) {
                if (x[i] == 0.0f && y[i] != 0.0f)
                    fail_msg("%s dist %d: x[%zu] = 0 decoded %g (min %g, step %g)", spec, d, i,
                             (double)y[i], (double)min, (double)step);
                double err = fabs((double)x[i] - y[i]);
                if (err > step / 2 * (1 + 1e-6) + 16 * FLT_EPSILON * amax)
                    fail_msg("%s dist %d: x[%zu]=%g decoded %g, step %g", spec, d, i, (double)x[i],
                             (double)y[i], (double)step);
            }
            free(p.buf);
        }
    }
    /* all positive: the key changes nothing */
    for (size_t i = 0; i < n; i++)
        x[i] = 1.0f + (float)(i % 97);
    test_payload a = test_encode("quant:bits=4,zero=1", x, n, 1, 0);
    test_payload b = test_encode("quant:bits=4", x, n, 1, 0);
    assert_int_equal(a.len, b.len);
    assert_memory_equal(a.buf, b.buf, a.len);
    free(a.buf);
    free(b.buf);
    free(x);
    free(y);
    free(y0);
}

/* Decodes p into the tensor t with a fresh codec; the status, and the
 * codec's message in why. */
static int decode_into(const char *spec, const test_payload *p, DLTensor *t, char *why, size_t cap)
{
    epipe_codec *c = test_codec(spec, 2, 0);
    int rc = epipe_codec_decode(c, p->buf, p->len, t);
    snprintf(why, cap, "%s", epipe_codec_last_error(c));
    epipe_codec_destroy(c);
    return rc;
}

/* spec's payload of t, checked equal from the fast path on one and three
 * threads and from the reference. */
static test_payload encode_three_ways(const char *spec, const DLTensor *t)
{
    test_payload p = test_encode_view(spec, t, 1, 0);
    test_payload pr = test_encode_view(spec, t, 1, 1);
    test_payload p3 = test_encode_view(spec, t, 3, 0);
    assert_int_equal(p.len, pr.len);
    assert_int_equal(p.len, p3.len);
    assert_memory_equal(p.buf, pr.buf, p.len);
    assert_memory_equal(p.buf, p3.buf, p.len);
    free(pr.buf);
    free(p3.buf);
    return p;
}

/* rows=1: the body is each row's quant body in turn (so each sample keeps
 * its own range), fast and reference agree, the parameter word tells the
 * two formats apart, and a bad value is named by its index in the tensor. */
static void rows_each_have_their_range(void **state)
{
    (void)state;
    enum { R = 6, C = 37 };
    float x[R * C], y[R * C];
    int64_t shape[2] = {R, C};
    DLTensor tx = test_view_f32_nd(x, shape, 2), ty = test_view_f32_nd(y, shape, 2);
    char why[256];
    for (unsigned bits = 1; bits <= 16; bits += 5) {
        test_fill(x, R * C, DIST_NORMAL, 40 + bits);
        for (int r = 0; r < R; r++) /* rows six orders of magnitude apart */
            for (int i = 0; i < C; i++)
                x[r * C + i] *= powf(10.0f, (float)-r);
        char spec[48], plain[32];
        snprintf(spec, sizeof spec, "quant:bits=%u,zero=1,rows=1", bits);
        snprintf(plain, sizeof plain, "quant:bits=%u,zero=1", bits);
        test_payload p = encode_three_ways(spec, &tx);
        assert_int_equal(epipe_get_u32(p.buf + 4), bits | 0x100); /* the parameter word */
        size_t at = HDR;
        for (int r = 0; r < R; r++) {
            test_payload one = test_encode(plain, x + r * C, C, 1, 0);
            assert_memory_equal(p.buf + at, one.buf + HDR, one.len - HDR);
            at += one.len - HDR;
            free(one.buf);
        }
        assert_int_equal(at, p.len);
        assert_int_equal(decode_into(spec, &p, &ty, why, sizeof why), EPIPE_OK);
        for (int r = 0; r < R; r++) /* every row within half its own step */
            for (int i = 0; i < C; i++) {
                float step = epipe_get_f32(p.buf + HDR + (size_t)r * (p.len - HDR) / R + 4);
                assert_true(fabsf(y[r * C + i] - x[r * C + i]) <=
                            step / 2 * 1.0001f + 1e-6f * powf(10.0f, (float)-r));
            }
        /* a decoder without the key refuses the other format, and back */
        assert_int_equal(decode_into(plain, &p, &ty, why, sizeof why), EPIPE_EPROTO);
        assert_non_null(strstr(why, "parameter word"));
        test_payload q = test_encode_view(plain, &tx, 1, 0);
        assert_int_equal(decode_into(spec, &q, &ty, why, sizeof why), EPIPE_EPROTO);
        free(q.buf);
        free(p.buf);
    }
    /* a 1-D tensor is one row: the bytes of quant without the key, but for the word */
    test_fill(x, C, DIST_UNIFORM, 3);
    test_payload a = test_encode("quant:bits=4,rows=1", x, C, 1, 0);
    test_payload b = test_encode("quant:bits=4", x, C, 1, 0);
    assert_int_equal(a.len, b.len);
    assert_memory_equal(a.buf + HDR, b.buf + HDR, a.len - HDR);
    free(a.buf);
    free(b.buf);
    /* truncated, padded and corrupt row tables are refused by name */
    test_fill(x, R * C, DIST_NORMAL, 9);
    test_payload p = test_encode_view("quant:bits=3,rows=1", &tx, 1, 0);
    p.len--;
    assert_int_equal(decode_into("quant:bits=3,rows=1", &p, &ty, why, sizeof why), EPIPE_ETRUNC);
    p.len++;
    size_t row = (p.len - HDR) / R;
    epipe_put_f32(p.buf + HDR + 4 * row + 4, -1.0f); /* row 4's step */
    assert_int_equal(decode_into("quant:bits=3,rows=1", &p, &ty, why, sizeof why), EPIPE_EPROTO);
    assert_non_null(strstr(why, "step"));
    free(p.buf);
    /* a NaN in row 3 is named by its index in the tensor */
    x[3 * C + 5] = NAN;
    epipe_codec *c = test_codec("quant:bits=3,rows=1", 1, 0);
    uint8_t buf[4096];
    size_t w;
    assert_int_equal(epipe_codec_encode(c, &tx, buf, sizeof buf, &w), EPIPE_EINVAL);
    char idx[32];
    snprintf(idx, sizeof idx, "index %d", 3 * C + 5);
    if (!strstr(epipe_codec_last_error(c), idx))
        fail_msg("message '%s' lacks '%s'", epipe_codec_last_error(c), idx);
    epipe_codec_destroy(c);
}

/* group=K: the body is each run of K values' quant body in turn (the runs of
 * a [R, G, K] tensor, G of them a row, each on its own range), fast,
 * reference and threaded agree, the word carries K, a decoder of another K
 * refuses, and a K that does not divide the rows is refused by name. */
static void groups_each_have_their_range(void **state)
{
    (void)state;
    enum { R = 3, G = 4, K = 29 };
    float x[R * G * K], y[R * G * K];
    int64_t shape[3] = {R, G, K};
    DLTensor tx = test_view_f32_nd(x, shape, 3), ty = test_view_f32_nd(y, shape, 3);
    char why[256];
    test_fill(x, R * G * K, DIST_NORMAL, 77);
    for (int g = 0; g < R * G; g++) /* runs four orders of magnitude apart */
        for (int i = 0; i < K; i++)
            x[g * K + i] *= powf(10.0f, (float)-(g % 5));
    const char *spec = "quant:bits=3,zero=1,group=29";
    test_payload p = encode_three_ways(spec, &tx);
    assert_int_equal(epipe_get_u32(p.buf + 4), 3 | 29u << 9); /* the parameter word */
    size_t at = HDR;
    for (int g = 0; g < R * G; g++) {
        test_payload one = test_encode("quant:bits=3,zero=1", x + g * K, K, 1, 0);
        assert_memory_equal(p.buf + at, one.buf + HDR, one.len - HDR);
        at += one.len - HDR;
        free(one.buf);
    }
    assert_int_equal(at, p.len);
    assert_int_equal(decode_into(spec, &p, &ty, why, sizeof why), EPIPE_OK);
    size_t one = (p.len - HDR) / (R * G);
    for (int g = 0; g < R * G; g++) /* every value within half its own run's step */
        for (int i = 0; i < K; i++) {
            float step = epipe_get_f32(p.buf + HDR + (size_t)g * one + 4);
            assert_true(fabsf(y[g * K + i] - x[g * K + i]) <= step / 2 * 1.0001f);
        }
    /* a decoder of another K, or of one range a row, refuses the format */
    assert_int_equal(decode_into("quant:bits=3,zero=1,group=58", &p, &ty, why, sizeof why),
                     EPIPE_EPROTO);
    assert_non_null(strstr(why, "parameter word"));
    assert_int_equal(decode_into("quant:bits=3,zero=1,rows=1", &p, &ty, why, sizeof why),
                     EPIPE_EPROTO);
    /* a run table made bad is refused, as a row's is */
    epipe_put_f32(p.buf + HDR + 5 * one + 4, -1.0f);
    assert_int_equal(decode_into(spec, &p, &ty, why, sizeof why), EPIPE_EPROTO);
    assert_non_null(strstr(why, "step"));
    free(p.buf);
    /* a K that does not divide a row (G*K = 116 values) is refused, naming both */
    epipe_codec *c = test_codec("quant:bits=3,group=24", 1, 0);
    uint8_t buf[4096];
    size_t w;
    assert_int_equal(epipe_codec_encode(c, &tx, buf, sizeof buf, &w), EPIPE_EINVAL);
    if (!strstr(epipe_codec_last_error(c), "group=24") ||
        !strstr(epipe_codec_last_error(c), "116 values"))
        fail_msg("message '%s' lacks group=24 or the row's 116 values", epipe_codec_last_error(c));
    epipe_codec_destroy(c);
    /* K = a whole row is rows=1's body (the word aside); a 1-D tensor is one row */
    test_payload a = test_encode_view("quant:bits=3,group=116", &tx, 1, 0);
    test_payload b = test_encode_view("quant:bits=3,rows=1", &tx, 1, 0);
    assert_int_equal(a.len, b.len);
    assert_memory_equal(a.buf + HDR, b.buf + HDR, a.len - HDR);
    free(a.buf);
    free(b.buf);
    a = test_encode("quant:bits=3,group=12", x, 48, 1, 0);
    assert_int_equal(a.len, HDR + 4 * (8 + 5)); /* four runs of 12 codes, 36 bits */
    free(a.buf);
}

static void expect_spec_error(const char *spec, const char *needle)
{
    epipe_codec *c = (epipe_codec *)1;
    int rc = epipe_codec_create(&c, spec);
    if (rc != EPIPE_EINVAL || c != NULL || !strstr(epipe_last_error(), needle))
        fail_msg("spec '%s': rc %d, message '%s', expected EINVAL naming '%s'", spec, rc,
                 epipe_last_error(), needle);
}

static void specs(void **state)
{
    (void)state;
    expect_spec_error("quant:bits=40", "'bits'");
    expect_spec_error("quant:bits=0", "'bits'");
    expect_spec_error("quant:bits=2.5", "'bits'");
    expect_spec_error("quant:split=2", "unknown key 'split'");
    epipe_codec *c = test_codec("quant", 1, 0);
    assert_string_equal(epipe_codec_spec(c), "quant:bits=8");
    epipe_codec_destroy(c);
    /* zero=0 and rows=0, the defaults, stay out of the canonical spec */
    const char *const canon[][2] = {{"quant:zero=0,bits=3", "quant:bits=3"},
                                    {"quant:zero=1", "quant:bits=8,zero=1"},
                                    {"quant:rows=0,bits=2", "quant:bits=2"},
                                    {"quant:rows=1,bits=2,zero=1", "quant:bits=2,zero=1,rows=1"},
                                    {"quant:group=0,bits=2", "quant:bits=2"},
                                    {"quant:group=196,bits=2", "quant:bits=2,group=196"}};
    for (size_t i = 0; i < sizeof canon / sizeof canon[0]; i++) {
        c = test_codec(canon[i][0], 1, 0);
        assert_string_equal(epipe_codec_spec(c), canon[i][1]);
        epipe_codec_destroy(c);
    }
    expect_spec_error("quant:zero=2", "'zero'");
    expect_spec_error("quant:rows=2", "'rows'");
    expect_spec_error("quant:group=-1", "'group'");
    expect_spec_error("quant:group=1048577", "'group'");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(half_step_bound),
        cmocka_unit_test(all_equal_is_exact),
        cmocka_unit_test(fast_matches_reference),
        cmocka_unit_test(generic_kernels_match_reference),
        cmocka_unit_test(nonfinite_rejected),
        cmocka_unit_test(find_nonfinite_scan),
        cmocka_unit_test(hostile_payloads),
        cmocka_unit_test(specs),
        cmocka_unit_test(zero_is_a_level),
        cmocka_unit_test(rows_each_have_their_range),
        cmocka_unit_test(groups_each_have_their_range),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
