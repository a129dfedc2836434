/* sortquant mode=fit: MSE against quant on fixed-seed data, chunks by value,
 * fast path byte-identical to the reference, hostile payloads, specs. */
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
#include "bitpack.h"
#include "tensor.h"
#include "testutil.h"

#define HDR 16

/* A decoded fit body: its split, level bits and chunk table. */
struct fit_body {
    unsigned S, q, k;
    const uint8_t *table, *codes;
};

static struct fit_body parse_body(const test_payload *p, unsigned bits)
{
    struct fit_body b;
    b.S = p->buf[HDR];
    b.q = bits - b.S;
    b.k = 1u << b.S;
    b.table = p->buf + HDR + 4;
    b.codes = b.table + 8 * b.k;
    return b;
}

static double mse_of(const char *spec, const float *x, size_t n)
{
    test_payload p = test_encode(spec, (float *)x, n, 2, 0);
    float *y = malloc(sizeof *y * (n + 1));
    test_decode(spec, &p, y, n, 2, 0);
    double m = test_mse(x, y, n);
    free(y);
    free(p.buf);
    return m;
}

/* The claims of docs/codecs.md at equal total bits, on 2^20 values with
 * fixed seeds: never above quant (2% for sampling noise) at 4 and 8 bits,
 * and at 8 bits well below it (0.6x on light tails; on heavy ones the
 * issue's 0.15x, and 0.03x since the tensor's min and max join the
 * sample's histogram: 0.048x without; at 4 bits 0.2x on heavy tails). The
 * split is chosen per tensor. */
static void mse_against_quant(void **state)
{
    (void)state;
    const size_t n = (size_t)1 << 20;
    float *x = malloc(sizeof *x * n);
    const enum test_dist dists[] = {DIST_NORMAL, DIST_RELU, DIST_LOGNORMAL};
    const char *names[] = {"normal", "relu", "lognormal"};
    const double limit8[] = {0.6, 0.6, 0.03}, limit4[] = {1.02, 1.02, 0.2};
    for (size_t d = 0; d < 3; d++) {
        test_fill(x, n, dists[d], 1234 + d);
        double f8 = mse_of("sortquant:bits=8,mode=fit", x, n), q8 = mse_of("quant:bits=8", x, n);
        double f4 = mse_of("sortquant:bits=4,mode=fit", x, n), q4 = mse_of("quant:bits=4", x, n);
        print_message("%-9s fit/quant: 8 bits %.3f, 4 bits %.3f\n", names[d], f8 / q8, f4 / q4);
        if (!(f8 <= limit8[d] * q8))
            fail_msg("%s 8 bits: fit mse %g > %.2f x quant %g", names[d], f8, limit8[d], q8);
        if (!(f4 <= limit4[d] * q4))
            fail_msg("%s 4 bits: fit mse %g > %.2f x quant %g", names[d], f4, limit4[d], q4);
        /* a fixed split is never better than the chosen one by much */
        double f8s2 = mse_of("sortquant:bits=8,mode=fit,split=2", x, n);
        if (!(f8 <= 1.02 * f8s2))
            fail_msg("%s: chosen split mse %g vs split=2 %g", names[d], f8, f8s2);
        /* and split=0 is quant over the same range */
        double f8s0 = mse_of("sortquant:bits=8,mode=fit,split=0", x, n);
        if (fabs(f8s0 - q8) > 1e-9 * q8)
            fail_msg("%s: split=0 mse %g differs from quant's %g", names[d], f8s0, q8);
    }
    free(x);
}

/* Every value is within half a step of its chunk's grid, chunks follow the
 * value order (assigned by boundaries, not by rank), and chunk mins
 * increase. */
static void check_chunks(const char *spec, unsigned bits, const float *x, size_t n)
{
    test_payload p = test_encode(spec, (float *)x, n, 2, 0);
    struct fit_body b = parse_body(&p, bits);
    float *y = malloc(sizeof *y * (n + 1));
    uint16_t *codes = malloc(sizeof *codes * (n + 1));
    float *cmax = calloc(b.k, sizeof *cmax), *cmin = calloc(b.k, sizeof *cmin);
    test_decode(spec, &p, y, n, 1, 0);
    epipe_bitunpack_ref(b.codes, n, bits, codes);
    float amax = 0;
    for (size_t i = 0; i < n; i++)
        amax = fmaxf(amax, fabsf(x[i]));
    for (unsigned j = 0; j < b.k; j++) {
        cmin[j] = INFINITY;
        cmax[j] = -INFINITY;
    }
    for (size_t i = 0; i < n; i++) {
        unsigned ch = codes[i] >> b.q;
        float min = epipe_get_f32(b.table + 8 * ch), step = epipe_get_f32(b.table + 8 * ch + 4);
        double err = fabs((double)x[i] - (double)y[i]);
        if (err > step / 2 * (1 + 1e-6) + 16 * FLT_EPSILON * amax || x[i] < min)
            fail_msg("%s n=%zu: x[%zu]=%g decoded %g, chunk %u min %g step %g", spec, n, i,
                     (double)x[i], (double)y[i], ch, (double)min, (double)step);
        cmin[ch] = fminf(cmin[ch], x[i]);
        cmax[ch] = fmaxf(cmax[ch], x[i]);
    }
    for (unsigned j = 1; j < b.k; j++) {
        if (cmax[j] < cmin[j])
            continue; /* empty */
        for (unsigned i = 0; i < j; i++)
            if (cmax[i] >= cmin[j] && cmax[i] >= cmin[i])
                fail_msg("%s: chunk %u holds %g, not below chunk %u's %g", spec, i, (double)cmax[i],
                         j, (double)cmin[j]);
        if (!(epipe_get_f32(b.table + 8 * j) > epipe_get_f32(b.table + 8 * (j - 1))))
            fail_msg("%s: chunk %u's min is not above chunk %u's", spec, j, j - 1);
    }
    free(cmin);
    free(cmax);
    free(codes);
    free(y);
    free(p.buf);
}

static void chunks_by_value(void **state)
{
    (void)state;
    const struct {
        const char *spec;
        unsigned bits;
    } cs[] = {
        {"sortquant:bits=8,mode=fit", 8},         {"sortquant:bits=4,mode=fit", 4},
        {"sortquant:bits=2,mode=fit", 2},         {"sortquant:bits=16,mode=fit", 16},
        {"sortquant:bits=6,mode=fit,split=4", 6}, {"sortquant:bits=8,mode=fit,split=1", 8},
    };
    const size_t n = 100003;
    float *x = malloc(sizeof *x * n);
    for (int d = 0; d < 5; d++) {
        test_fill(x, n, (enum test_dist)(d % 4), 40 + (uint64_t)d);
        if (d == 4) /* few distinct values */
            for (size_t i = 0; i < n; i++)
                x[i] = roundf(x[i] * 3.0f) / 3.0f;
        for (size_t s = 0; s < sizeof cs / sizeof *cs; s++)
            check_chunks(cs[s].spec, cs[s].bits, x, n);
    }
    free(x);
}

/* One value far outside the rest, which the sample misses: the last chunk
 * reaches it (the tensor's max), so it decodes to itself, and the values
 * below keep chunks of their own instead of quant's 1e6/255 step. (The
 * chunk beside the gap spans it: about 10x the MSE without the outlier.) */
static void outlier_far_from_the_sample(void **state)
{
    (void)state;
    const size_t n = 300007, at = 123457;
    float *x = malloc(sizeof *x * n), *y = malloc(sizeof *y * n);
    test_fill(x, n, DIST_NORMAL, 77);
    x[at] = 1e6f;
    const char *spec = "sortquant:bits=8,mode=fit";
    for (int ref = 0; ref < 2; ref++) {
        test_payload p = test_encode(spec, x, n, 2, ref);
        test_decode(spec, &p, y, n, 2, ref);
        double m = test_mse(x, y, n);
        if (!(m < 1e-3) || !(fabsf(y[at] - 1e6f) < 1e3f))
            fail_msg("ref %d: mse %g, outlier decoded as %g", ref, m, (double)y[at]);
        free(p.buf);
    }
    double q = mse_of("quant:bits=8", x, n);
    assert_true(q > 10.0); /* quant: levels 1e6/255 apart, the rest decode to the min */
    free(x);
    free(y);
}

/* Which split the encoder picked for x. */
static unsigned chosen_split(const char *spec, float *x, size_t n)
{
    test_payload p = test_encode(spec, x, n, 1, 0);
    unsigned S = p.buf[HDR];
    free(p.buf);
    return S;
}

static void split_choice(void **state)
{
    (void)state;
    const size_t n = 200000;
    float *x = malloc(sizeof *x * n), *y = malloc(sizeof *y * n);
    /* ReLU at 8 bits: the zeros get a chunk of their own */
    test_fill(x, n, DIST_RELU, 8);
    assert_true(chosen_split("sortquant:bits=8,mode=fit", x, n) >= 1);
    /* at most min(4, bits - 1); a fixed split is kept */
    assert_true(chosen_split("sortquant:bits=2,mode=fit", x, n) <= 1);
    assert_int_equal(chosen_split("sortquant:bits=8,mode=fit,split=3", x, n), 3);
    /* uniform data gains nothing from chunks */
    test_fill(x, n, DIST_UNIFORM, 9);
    assert_int_equal(chosen_split("sortquant:bits=8,mode=fit", x, n), 0);
    /* constant input: one chunk, decoded exactly, with or without a fixed split */
    for (size_t i = 0; i < n; i++)
        x[i] = -2.75f;
    assert_int_equal(chosen_split("sortquant:bits=8,mode=fit", x, n), 0);
    const char *specs[] = {"sortquant:bits=8,mode=fit", "sortquant:bits=8,mode=fit,split=4"};
    for (int s = 0; s < 2; s++) {
        test_payload p = test_encode(specs[s], x, n, 2, 0);
        test_decode(specs[s], &p, y, n, 2, 0);
        for (size_t i = 0; i < n; i++)
            assert_true(y[i] == -2.75f);
        free(p.buf);
    }
    /* three values, four fixed chunks: the last chunk is empty */
    for (size_t i = 0; i < n; i++)
        x[i] = (float)(i % 3) - 1.0f;
    test_payload p = test_encode(specs[1], x, n, 2, 0);
    test_decode(specs[1], &p, y, n, 2, 0);
    assert_memory_equal(x, y, n * sizeof *y);
    free(p.buf);
    free(x);
    free(y);
}

/* The fast path on any thread count writes the reference's bytes, and both
 * decoders agree. */
static void check_same(const char *spec, float *x, size_t n)
{
    test_payload r = test_encode(spec, x, n, 1, 1);
    const int threads[] = {1, 2, 3, 7};
    float *y = malloc(sizeof *y * (n + 1)), *yr = malloc(sizeof *yr * (n + 1));
    test_decode(spec, &r, yr, n, 1, 1);
    for (size_t t = 0; t < 4; t++) {
        test_payload f = test_encode(spec, x, n, threads[t], 0);
        assert_int_equal(f.len, r.len);
        if (memcmp(f.buf, r.buf, r.len) != 0) {
            size_t i = 0;
            while (f.buf[i] == r.buf[i])
                i++;
            fail_msg("%s n=%zu threads=%d: byte %zu is %u, reference %u", spec, n, threads[t], i,
                     f.buf[i], r.buf[i]);
        }
        test_decode(spec, &f, y, n, threads[t], 0);
        if (n && memcmp(y, yr, n * sizeof *y) != 0)
            fail_msg("%s n=%zu threads=%d: decoders disagree", spec, n, threads[t]);
        free(f.buf);
    }
    free(y);
    free(yr);
    free(r.buf);
}

static const char *const same_specs[] = {
    "sortquant:bits=8,mode=fit",         "sortquant:bits=4,mode=fit",
    "sortquant:bits=2,mode=fit",         "sortquant:bits=3,mode=fit,split=2",
    "sortquant:bits=16,mode=fit",        "sortquant:bits=12,mode=fit,split=4",
    "sortquant:bits=7,mode=fit,split=0", "sortquant:bits=8,mode=fit,sample=1024",
};
#define NSAME (sizeof same_specs / sizeof *same_specs)

static void fast_matches_reference(void **state)
{
    (void)state;
    const size_t sizes[] = {0, 1, 2, 3, 7, 8, 9, 17, 64, 65, 1000, 4097, 70001};
    float *x = malloc(sizeof *x * 70001);
    for (size_t s = 0; s < NSAME; s++)
        for (size_t z = 0; z < sizeof sizes / sizeof *sizes; z++)
            for (int d = 0; d < 4; d++) {
                test_fill(x, sizes[z], (enum test_dist)d, 500 * s + 10 * z + (size_t)d);
                check_same(same_specs[s], x, sizes[z]);
            }
    free(x);
}

/* Past the sizes where encoding goes parallel, with -0 among ReLU zeros,
 * extreme magnitudes, and the generic (non-AVX2) kernels. */
static void threads_and_kernels_match(void **state)
{
    (void)state;
    const size_t n = 393227;
    float *x = malloc(sizeof *x * n);
    test_fill(x, n, DIST_RELU, 5);
    for (size_t i = 0; i < n; i += 3)
        if (x[i] == 0.0f)
            x[i] = -0.0f;
    check_same("sortquant:bits=8,mode=fit", x, n);
    test_fill(x, n, DIST_LOGNORMAL, 6);
    x[17] = FLT_MAX;
    x[99] = -FLT_MAX;
    x[1000] = 1e-45f;
    check_same("sortquant:bits=8,mode=fit", x, n);
    check_same("sortquant:bits=5,mode=fit,split=3", x, n);
    int was = epipe_q_set_simd(0);
    for (size_t s = 0; s < NSAME; s++) {
        test_fill(x, 270001, (enum test_dist)(s % 4), 60 + s);
        check_same(same_specs[s], x, 270001);
    }
    epipe_q_set_simd(was);
    free(x);
}

static void nonfinite_rejected(void **state)
{
    (void)state;
    float x[5000];
    test_fill(x, 5000, DIST_NORMAL, 9);
    const float bad[] = {NAN, INFINITY, -INFINITY};
    const size_t where[] = {0, 4321, 4999};
    for (int ref = 0; ref < 2; ref++)
        for (size_t b = 0; b < 3; b++) {
            float keep = x[where[b]];
            x[where[b]] = bad[b];
            epipe_codec *c = test_codec("sortquant:bits=8,mode=fit", 1, ref);
            int64_t shape;
            DLTensor t = test_view_f32(x, &shape, 5000);
            uint8_t *buf = malloc(8192);
            size_t w;
            assert_int_equal(epipe_codec_encode(c, &t, buf, 8192, &w), EPIPE_EINVAL);
            char idx[32];
            snprintf(idx, sizeof idx, "index %zu", where[b]);
            if (!strstr(epipe_codec_last_error(c), idx))
                fail_msg("message '%s' lacks '%s'", epipe_codec_last_error(c), idx);
            free(buf);
            epipe_codec_destroy(c);
            x[where[b]] = keep;
        }
}

static void hostile_payloads(void **state)
{
    (void)state;
    const size_t n = 3001;
    float x[3001], y[3001];
    test_fill(x, n, DIST_LOGNORMAL, 4);
    const char *spec = "sortquant:bits=8,mode=fit";
    test_payload p = test_encode(spec, x, n, 1, 0);
    struct fit_body b = parse_body(&p, 8);
    assert_true(b.S >= 2); /* heavy tails: several chunks */
    size_t T = HDR + 4;    /* the table */
    uint8_t *orig = malloc(p.len);
    memcpy(orig, p.buf, p.len);
#define RESET() memcpy(p.buf, orig, p.len)
    p.buf[HDR] = 5; /* S above 4 */
    test_expect_proto(spec, &p, n, "split S = 5");
    RESET();
    p.buf[HDR] = 200;
    test_expect_proto(spec, &p, n, "split S = 200");
    RESET();
    p.buf[HDR + 2] = 1;
    test_expect_proto(spec, &p, n, "reserved");
    RESET();
    epipe_put_f32(p.buf + T + 8, NAN); /* chunk 1 min */
    test_expect_proto(spec, &p, n, "min");
    RESET();
    epipe_put_f32(p.buf + T + 4, INFINITY); /* chunk 0 step */
    test_expect_proto(spec, &p, n, "step");
    RESET();
    epipe_put_f32(p.buf + T + 12, -INFINITY);
    test_expect_proto(spec, &p, n, "step");
    RESET();
    /* boundaries that do not increase: chunk 1's min below chunk 0's */
    epipe_put_f32(p.buf + T + 8, epipe_get_f32(p.buf + T) - 1.0f);
    test_expect_proto(spec, &p, n, "boundaries must increase");
    RESET();
    /* two chunks swapped */
    uint8_t tmp[8];
    memcpy(tmp, p.buf + T + 8, 8);
    memcpy(p.buf + T + 8, p.buf + T + 16, 8);
    memcpy(p.buf + T + 16, tmp, 8);
    test_expect_proto(spec, &p, n, "boundaries must increase");
    RESET();
    /* padding bits after the last code, and the unused table bytes */
    free(p.buf);
    for (size_t i = 0; i < n; i++) /* two values: S = 1 at most, in a table for 4 */
        x[i] = i % 2 ? 1.0f : -1.0f;
    p = test_encode(spec, x, n, 1, 0);
    b = parse_body(&p, 8);
    assert_true(b.S <= 1);
    p.buf[p.len - 1] = 1;
    test_expect_proto(spec, &p, n, "non-zero bytes after its codes");
    p.buf[p.len - 1] = 0;
    test_decode(spec, &p, y, n, 1, 0);
    assert_memory_equal(x, y, n * sizeof *y);
    free(p.buf);
    p = test_encode("sortquant:bits=5,mode=fit,split=2", x, 7, 1, 0); /* 35 bits of codes */
    p.buf[p.len - 1] |= 0x80;
    test_expect_proto("sortquant:bits=5,mode=fit,split=2", &p, 7, "padding");
    p.buf[p.len - 1] &= 0x7f;
    p.buf[HDR] = 1; /* a fixed split must match */
    test_expect_proto("sortquant:bits=5,mode=fit,split=2", &p, 7, "split S = 1");
    free(p.buf);
    free(orig);
#undef RESET
}

static void expect_spec_error(const char *spec, const char *needle)
{
    epipe_codec *c = (epipe_codec *)1;
    int rc = epipe_codec_create(&c, spec);
    if (rc != EPIPE_EINVAL || c != NULL || !strstr(epipe_last_error(), needle))
        fail_msg("spec '%s': rc %d, message '%s', expected EINVAL naming '%s'", spec, rc,
                 epipe_last_error(), needle);
}

static void specs_and_words(void **state)
{
    (void)state;
    expect_spec_error("sortquant:bits=8,mode=fit,split=5", "'split'");
    expect_spec_error("sortquant:bits=3,mode=fit,split=3", "'split'");
    const struct {
        const char *in, *out;
    } canon[] = {
        {"sortquant:mode=fit", "sortquant:bits=8,mode=fit,sample=65536"},
        {"sortquant:bits=4,mode=fit,split=2", "sortquant:bits=4,split=2,mode=fit,sample=65536"},
        {"sortquant:bits=2,mode=fit,sample=2048", "sortquant:bits=2,mode=fit,sample=2048"},
    };
    for (size_t i = 0; i < sizeof canon / sizeof *canon; i++) {
        epipe_codec *c = test_codec(canon[i].in, 1, 0);
        assert_string_equal(epipe_codec_spec(c), canon[i].out);
        epipe_codec *again = test_codec(epipe_codec_spec(c), 1, 0); /* round trip */
        assert_string_equal(epipe_codec_spec(again), canon[i].out);
        epipe_codec_destroy(again);
        epipe_codec_destroy(c);
    }
    epipe_codec *c = test_codec("sortquant:bits=8,mode=fit", 1, 0);
    double v;
    assert_int_equal(epipe_codec_spec_param(c, "split", &v), EPIPE_OK);
    assert_true(isnan(v)); /* chosen per tensor */
    assert_int_equal(epipe_codec_spec_param(c, "mode", &v), EPIPE_OK);
    assert_true(v == 2);
    epipe_codec_destroy(c);
    /* the parameter word: B | Smax << 8 | fit | chosen */
    float x[100], y[100];
    test_fill(x, 100, DIST_NORMAL, 1);
    float big[1024];
    test_fill(big, 1024, DIST_LOGNORMAL, 2);
    /* a chosen split's table is at most an eighth of the codes */
    const struct {
        const char *spec;
        size_t n;
        uint32_t word;
        size_t len;
    } words[] = {
        {"sortquant:bits=8,mode=fit", 100, 8u | 4u << 8 | 1u << 16 | 1u << 17, 4 + 8 + 100},
        {"sortquant:bits=8,mode=fit", 256, 8u | 4u << 8 | 1u << 16 | 1u << 17, 4 + 32 + 256},
        {"sortquant:bits=8,mode=fit", 1024, 8u | 4u << 8 | 1u << 16 | 1u << 17, 4 + 128 + 1024},
        {"sortquant:bits=2,mode=fit", 1024, 2u | 1u << 8 | 1u << 16 | 1u << 17, 4 + 16 + 256},
        {"sortquant:bits=6,mode=fit,split=3", 100, 6u | 3u << 8 | 1u << 16, 4 + 64 + 75},
    };
    for (size_t i = 0; i < sizeof words / sizeof *words; i++) {
        test_payload p = test_encode(words[i].spec, big, words[i].n, 1, 0);
        assert_int_equal(epipe_get_u32(p.buf + 4), words[i].word);
        assert_int_equal(p.len, HDR + words[i].len);
        free(p.buf);
    }
    /* fit and sample payloads are not each other's */
    test_payload p = test_encode("sortquant:bits=8,mode=fit", x, 100, 1, 0);
    test_expect_proto("sortquant:bits=8,mode=sample", &p, 100, "parameter word");
    test_decode("sortquant:bits=8,mode=fit,sample=4096", &p, y, 100, 1, 0);
    free(p.buf);
    p = test_encode("sortquant:bits=8,mode=sample", x, 100, 1, 0);
    test_expect_proto("sortquant:bits=8,mode=fit", &p, 100, "parameter word");
    free(p.buf);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(mse_against_quant),      cmocka_unit_test(chunks_by_value),
        cmocka_unit_test(split_choice),           cmocka_unit_test(outlier_far_from_the_sample),
        cmocka_unit_test(fast_matches_reference), cmocka_unit_test(threads_and_kernels_match),
        cmocka_unit_test(nonfinite_rejected),     cmocka_unit_test(hostile_payloads),
        cmocka_unit_test(specs_and_words),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
