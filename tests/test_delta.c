/* Activation deltas (spec key delta=1): error below plain mode on slowly
 * changing activations, first sightings, budget, resets and the wrapper. */
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

#include "../lib/codec/core.h"
#include "testutil.h"

/* A dense fp32 [rows, cols] view of x. */
typedef struct {
    int64_t shape[2];
    DLTensor t;
} mat;

static void mat_init(mat *m, float *x, int64_t rows, int64_t cols)
{
    memset(m, 0, sizeof *m);
    m->shape[0] = rows, m->shape[1] = cols;
    m->t.data = x;
    m->t.device.device_type = kDLCPU;
    m->t.ndim = 2;
    m->t.shape = m->shape;
    m->t.dtype.code = kDLFloat;
    m->t.dtype.bits = 32;
    m->t.dtype.lanes = 1;
}

/* Encodes rows x [rows, cols] of the samples ids (none: a codec without
 * delta) with c; the payload is malloc'd. Fails the test on error. */
static test_payload enc(epipe_codec *c, float *x, const uint64_t *ids, int64_t rows, int64_t cols)
{
    mat m;
    mat_init(&m, x, rows, cols);
    test_payload p;
    assert_int_equal(epipe_codec_max_encoded_size(c, &m.t, &p.len), EPIPE_OK);
    p.buf = malloc(p.len);
    size_t w = 0;
    if (ids)
        assert_int_equal(epipe_codec_set_samples(c, ids, (size_t)rows), EPIPE_OK);
    if (epipe_codec_encode(c, &m.t, p.buf, p.len, &w) != EPIPE_OK)
        fail_msg("encode '%s': %s", epipe_codec_spec(c), epipe_codec_last_error(c));
    assert_true(w <= p.len);
    p.len = w;
    return p;
}

static int dec(epipe_codec *d, const test_payload *p, float *y, int64_t rows, int64_t cols)
{
    mat m;
    mat_init(&m, y, rows, cols);
    return epipe_codec_decode(d, p->buf, p->len, &m.t);
}

static epipe_codec *mk(const char *spec)
{
    epipe_codec *c = NULL;
    if (epipe_codec_create(&c, spec) != EPIPE_OK)
        fail_msg("create '%s': %s", spec, epipe_last_error());
    return c;
}

/* Both sides hold the same row, bit for bit, for every id in ids. */
static void same_state(const epipe_codec *a, const epipe_codec *b, const uint64_t *ids, size_t n,
                       size_t cols)
{
    for (size_t i = 0; i < n; i++) {
        const float *x = epipe_codec_delta_row(a, ids[i]), *y = epipe_codec_delta_row(b, ids[i]);
        assert_true((x == NULL) == (y == NULL));
        if (x)
            assert_memory_equal(x, y, cols * sizeof *x);
    }
    epipe_codec_delta_info ia, ib;
    assert_int_equal(epipe_codec_delta_stats(a, &ia), EPIPE_OK);
    assert_int_equal(epipe_codec_delta_stats(b, &ib), EPIPE_OK);
    assert_memory_equal(&ia, &ib, sizeof ia);
}

static void test_spec_keys(void **st)
{
    (void)st;
    epipe_codec *c = mk("quant:bits=2,delta=1");
    assert_string_equal(epipe_codec_spec(c), "quant:bits=2,zero=1,delta=1"); /* zero implied */
    double v;
    assert_int_equal(epipe_codec_spec_param(c, "delta", &v), EPIPE_OK);
    assert_true(v == 1);
    assert_int_equal(epipe_codec_spec_param(c, "delta_mb", &v), EPIPE_OK);
    assert_true(v == 1024);
    epipe_codec_destroy(c);
    c = mk("sortquant:bits=2,delta=1,delta_mb=8,delta_strict=1");
    assert_non_null(strstr(epipe_codec_spec(c), ",delta=1,delta_mb=8,delta_strict=1"));
    epipe_codec_destroy(c);
    c = mk("quant:bits=2,delta_raw=0,delta=1");
    assert_string_equal(epipe_codec_spec(c), "quant:bits=2,zero=1,delta=1,delta_raw=0");
    assert_int_equal(epipe_codec_spec_param(c, "delta_raw", &v), EPIPE_OK);
    assert_true(v == 0);
    epipe_codec_destroy(c);
    c = mk("quant:bits=2,zero=0,delta=1"); /* unless the spec says otherwise, */
    /* and then the canonical spec says it too, so that it reads back the same */
    assert_string_equal(epipe_codec_spec(c), "quant:bits=2,zero=0,delta=1");
    epipe_codec *again = mk(epipe_codec_spec(c));
    assert_string_equal(epipe_codec_spec(again), epipe_codec_spec(c));
    epipe_codec_destroy(again);
    epipe_codec_destroy(c);
    c = mk("cast:dtype=fp16,delta=0");
    assert_string_equal(epipe_codec_spec(c), "cast:dtype=fp16");
    assert_int_equal(epipe_codec_set_samples(c, NULL, 0), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_codec_last_error(c), "no delta=1"));
    epipe_codec_destroy(c);
    double lo, hi;
    assert_int_equal(epipe_codec_param_bounds("topk", "delta_mb", &lo, &hi), EPIPE_OK);
    assert_true(lo == 1 && hi == 1048576);
    static const struct {
        const char *spec, *needle;
    } bad[] = {
        {"none:delta=1", "lossless"},
        {"quant:bits=2,delta=1,ef=1", "ef=1 together"},
        {"quant:bits=2,delta_mb=4", "need delta=1"},
        {"quant:bits=2,delta_raw=1", "need delta=1"},
        {"quant:bits=2,delta=1,delta_raw=2", "delta_raw"},
        {"quant:bits=2,delta=2", "not an integer in 0..1"},
        {"quant:bits=2,delta=1,delta=1", "given twice"},
        {"quant:bits=2,delta=1,delta_mb=0", "delta_mb"},
        {"quant:bits=2,delta=1,delta_mb=-3", "delta_mb"},
        {"quant:bits=2,delta=x", "delta"},
#ifdef EPIPE_HAVE_BLAS /* insert needs OpenBLAS/LAPACKE (-Dblas) */
        {"insert:kind=linear,out=2,delta=1", "trainable codec or a chain"},
        {"insert:kind=linear,out=2|quant:bits=5,delta=1", "inside a chain"},
#endif
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        c = NULL;
        assert_int_equal(epipe_codec_create(&c, bad[i].spec), EPIPE_EINVAL);
        assert_null(c);
        if (!strstr(epipe_last_error(), bad[i].needle))
            fail_msg("'%s': '%s' lacks '%s'", bad[i].spec, epipe_last_error(), bad[i].needle);
    }
}

/* Sample i's activation at epoch e: a fixed N(0,1) row plus a small drift. */
static void activation(float *row, size_t cols, uint64_t id, int epoch)
{
    test_rng r;
    test_rng_seed(&r, 1000 + id);
    for (size_t v = 0; v < cols; v++)
        row[v] = (float)test_rng_normal(&r);
    test_rng_seed(&r, 77 + id * 131 + (uint64_t)epoch * 7919);
    for (size_t v = 0; v < cols; v++)
        row[v] += (float)(0.02 * epoch * test_rng_normal(&r));
}

#define SAMPLES 64
#define BATCH 16
#define COLS 256
#define EPOCHS 5

/* Runs EPOCHS epochs of shuffled batches through an encoder and decoder of
 * spec; returns the MSE of the last epoch. With delta=1 it checks that
 * both sides stay identical and that the first epoch is sent in full. */
static double epochs_mse(const char *spec, int delta)
{
    epipe_codec *c = mk(spec), *d = mk(spec);
    uint64_t order[SAMPLES];
    for (size_t i = 0; i < SAMPLES; i++)
        order[i] = i * 1000003u; /* ids need not be small */
    float *x = malloc(BATCH * COLS * sizeof *x), *y = malloc(BATCH * COLS * sizeof *y);
    test_rng r;
    test_rng_seed(&r, 5);
    double mse = 0;
    for (int e = 0; e < EPOCHS; e++) {
        for (size_t i = SAMPLES - 1; i > 0; i--) { /* shuffle */
            size_t j = (size_t)(test_rng_next(&r) % (i + 1));
            uint64_t t = order[i];
            order[i] = order[j], order[j] = t;
        }
        mse = 0;
        for (size_t b = 0; b < SAMPLES; b += BATCH) {
            for (size_t i = 0; i < BATCH; i++)
                activation(x + i * COLS, COLS, order[b + i] / 1000003u, e);
            test_payload p = enc(c, x, delta ? order + b : NULL, BATCH, COLS);
            assert_int_equal(dec(d, &p, y, BATCH, COLS), EPIPE_OK);
            if (delta) {
                same_state(c, d, order + b, BATCH, COLS);
                for (size_t i = 0; i < BATCH; i++) /* what the decoder gave is what it kept */
                    assert_memory_equal(epipe_codec_delta_row(d, order[b + i]), y + i * COLS,
                                        COLS * sizeof *y);
            }
            free(p.buf);
            mse += test_mse(x, y, BATCH * COLS) / (SAMPLES / BATCH);
        }
        if (delta) {
            epipe_codec_delta_info info;
            assert_int_equal(epipe_codec_delta_stats(d, &info), EPIPE_OK);
            assert_int_equal(info.full_rows, SAMPLES); /* the first epoch, and only it */
            assert_int_equal(info.delta_rows, (uint64_t)e * SAMPLES);
            assert_int_equal(info.fallback_rows, 0);
            assert_int_equal(info.stored_samples, SAMPLES);
            assert_int_equal(info.stored_bytes, SAMPLES * COLS * sizeof(float));
        }
    }
    free(x), free(y);
    epipe_codec_destroy(c), epipe_codec_destroy(d);
    return mse;
}

static void test_premise(void **st)
{
    (void)st;
    /* The bound on delta MSE / plain MSE: low-rank poweriter only gains a
     * rank of the residual per epoch on these full-rank rows. */
    static const struct {
        const char *spec;
        double bound;
    } specs[] = {
        {"quant:bits=2", 0.25},
        {"sortquant:bits=2", 0.25},
        {"quant:bits=4", 0.25},
        {"topk:ratio=0.25", 0.25},
        {"kmeans:bits=2", 0.25},
#ifdef EPIPE_HAVE_BLAS /* poweriter needs OpenBLAS/LAPACKE (-Dblas) */
        {"poweriter:rank=4,shared=1", 0.5},
#endif
    };
    for (size_t i = 0; i < sizeof specs / sizeof specs[0]; i++) {
        char ds[96];
        snprintf(ds, sizeof ds, "%s,delta=1", specs[i].spec);
        double plain = epochs_mse(specs[i].spec, 0), delta = epochs_mse(ds, 1);
        print_message("%-18s last-epoch MSE plain %.3g, delta %.3g (%.3gx)\n", specs[i].spec, plain,
                      delta, delta / plain);
        if (!(delta < specs[i].bound * plain))
            fail_msg("%s: delta MSE %g is not below %g x plain %g", specs[i].spec, delta,
                     specs[i].bound, plain);
    }
}

/* With delta_raw=1 (the default) first sightings travel as raw fp32 and
 * decode exactly; the changes after them are coded; rows past the budget
 * and untracked rows go through the codec, not raw. */
static void test_first_sightings_raw(void **st)
{
    (void)st;
    enum { R = 8, C = 32 };
    float x[R * C], y[R * C];
    test_fill(x, R * C, DIST_NORMAL, 3);
    uint64_t ids[R] = {9, 3, 7, 1, 0, 2, 4, 5};
    epipe_codec *c = mk("quant:bits=3,delta=1"), *d = mk("quant:bits=3,delta=1");
    test_payload p = enc(c, x, ids, R, C);
    assert_int_equal(p.buf[16 + 3], 1); /* the raw flag */
    assert_int_equal(p.len, 16 + 12 + R * 4 + 2 + R * C * 4);
    assert_int_equal(dec(d, &p, y, R, C), EPIPE_OK);
    assert_memory_equal(y, x, sizeof x); /* exact */
    free(p.buf);
    for (int i = 0; i < R * C; i++)
        x[i] += 0.05f * (float)(i % 7);
    p = enc(c, x, ids, R, C); /* all deltas now: coded, small */
    assert_true(p.len < 16 + 12 + R * 4 + 2 + R * C);
    assert_int_equal(dec(d, &p, y, R, C), EPIPE_OK);
    for (int i = 0; i < R * C; i++)
        assert_true(fabsf(y[i] - x[i]) <= 0.3f / 7 / 2 + 1e-6f);
    same_state(c, d, ids, R, C);
    free(p.buf);
    /* untracked rows: through the codec, no flag */
    assert_int_equal(epipe_codec_set_samples(c, NULL, R), EPIPE_OK);
    mat m;
    mat_init(&m, x, R, C);
    size_t cap, w;
    assert_int_equal(epipe_codec_max_encoded_size(c, &m.t, &cap), EPIPE_OK);
    uint8_t *buf = malloc(cap);
    assert_int_equal(epipe_codec_encode(c, &m.t, buf, cap, &w), EPIPE_OK);
    assert_int_equal(buf[16 + 3], 0);
    assert_true(w < 16 + 12 + 2 + R * C);
    free(buf);
    epipe_codec_destroy(c), epipe_codec_destroy(d);
    /* past the budget (delta_mb=1 holds 4 rows of 64K values): only the
     * kept rows go raw, the others are coded */
    enum { BIG = 65536 };
    float *bx = malloc(sizeof *bx * 6 * BIG), *by = malloc(sizeof *by * 6 * BIG);
    test_fill(bx, 6 * BIG, DIST_UNIFORM, 5);
    uint64_t bids[6] = {1, 2, 3, 4, 5, 6};
    c = mk("quant:bits=4,delta=1,delta_mb=1"), d = mk("quant:bits=4,delta=1,delta_mb=1");
    p = enc(c, bx, bids, 6, BIG);
    assert_int_equal(p.len, 16 + 12 + 6 * 4 + 2 + 4 * BIG * 4 + 8 + 2 * BIG / 2);
    assert_int_equal(dec(d, &p, by, 6, BIG), EPIPE_OK);
    assert_memory_equal(by, bx, 4 * BIG * sizeof *bx);
    same_state(c, d, bids, 6, BIG);
    free(p.buf), free(bx), free(by);
    epipe_codec_destroy(c), epipe_codec_destroy(d);
}

/* The first encode of fresh samples (delta_raw=0) is plain compression of
 * the tensor. */
static void test_first_epoch_full(void **st)
{
    (void)st;
    float x[8 * 32], y[8 * 32], z[8 * 32];
    test_fill(x, 8 * 32, DIST_NORMAL, 3);
    uint64_t ids[8] = {9, 3, 7, 1, 0, 2, 4, 5};
    epipe_codec *c = mk("quant:bits=3,delta=1,delta_raw=0"),
                *d = mk("quant:bits=3,delta=1,delta_raw=0");
    test_payload p = enc(c, x, ids, 8, 32);
    assert_int_equal(dec(d, &p, y, 8, 32), EPIPE_OK);
    test_payload q = test_encode("quant:bits=3,zero=1", x, 8 * 32, 1, 0);
    test_decode("quant:bits=3", &q, z, 8 * 32, 1, 0);
    assert_memory_equal(y, z, sizeof y);
    /* The inner body is the plain one, after 16 + 12 + 8*4 + 2 bytes. */
    assert_int_equal(p.len, q.len + 12 + 32 + 2);
    assert_memory_equal(p.buf + 16 + 46, q.buf + 16, q.len - 16);
    assert_memory_equal(p.buf, q.buf, 16); /* the same payload header */
    free(p.buf), free(q.buf);
    epipe_codec_destroy(c), epipe_codec_destroy(d);
}

/* A sample sent again unchanged: its change is what the stored row still
 * misses, and on the grid delta=1 implies (zero=1) rounding never moves a
 * value further than itself from 0, so no element of the stored row gets
 * further from the sample on a resend. With zero=0 the grid of the signed
 * changes misses 0, and values with nothing left to send take the level
 * next to 0 on every resend: the stored rows wander off (returns the worst
 * increase of an element's error over the sends). */
static double resend_growth(const char *spec, int sends)
{
    enum { R = 8, C = 64 };
    float x[R * C], y[R * C], err[R * C];
    test_fill(x, R * C, DIST_NORMAL, 11);
    x[C + 5] = 40.0f; /* a wide change in a changing row: a coarse grid */
    uint64_t ids[R] = {1, 2, 3, 4, 5, 6, 7, 8};
    epipe_codec *c = mk(spec), *d = mk(spec);
    double growth = 0;
    for (int s = 0; s < sends; s++) {
        float z[R * C]; /* odd rows change on every send, even rows never */
        memcpy(z, x, sizeof z);
        for (int i = 0; i < R * C; i++)
            if (i / C % 2)
                z[i] += (float)(s % 2 ? -1 : 1) * (i == C + 5 ? 40.0f : 0.5f);
        test_payload p = enc(c, z, ids, R, C);
        assert_int_equal(dec(d, &p, y, R, C), EPIPE_OK);
        free(p.buf);
        same_state(c, d, ids, R, C);
        for (int i = 0; i < R * C; i++) {
            if (i / C % 2)
                continue;
            float e = fabsf(y[i] - x[i]);
            if (s)
                growth = fmax(growth, (double)e - err[i]);
            err[i] = e;
        }
    }
    epipe_codec_destroy(c), epipe_codec_destroy(d);
    return growth;
}

static void test_zero_implied(void **st)
{
    (void)st;
    const char *specs[] = {"quant:bits=2,delta=1,delta_raw=0",
                           "sortquant:bits=2,delta=1,delta_raw=0",
                           "sortquant:bits=4,mode=sample,delta=1,delta_raw=0"};
    for (size_t i = 0; i < 3; i++) {
        double growth = resend_growth(specs[i], 6);
        if (growth > 1e-6)
            fail_msg("%s: an unchanged sample's stored value got %g further from it", specs[i],
                     growth);
    }
    double growth = resend_growth("quant:bits=2,zero=0,delta=1,delta_raw=0", 6);
    print_message(
        "quant:bits=2,zero=0,delta=1,delta_raw=0: an unchanged sample's stored value got %g "
        "further from it\n",
        growth);
    assert_true(growth > 1.0);
}

/* delta_mb=1 holds 4 rows of 64K values: the others go in full, unkept. */
static void test_budget(void **st)
{
    (void)st;
    const int64_t rows = 6, cols = 65536;
    float *x = malloc((size_t)(rows * cols) * sizeof *x), *y = malloc((size_t)(rows * cols) * 4);
    test_fill(x, (size_t)(rows * cols), DIST_NORMAL, 4);
    uint64_t ids[6] = {10, 11, 12, 13, 14, 15};
    epipe_codec *c = mk("quant:bits=4,delta=1,delta_mb=1"),
                *d = mk("quant:bits=4,delta=1,delta_mb=1");
    for (int e = 0; e < 2; e++) {
        test_payload p = enc(c, x, ids, rows, cols);
        assert_int_equal(dec(d, &p, y, rows, cols), EPIPE_OK);
        free(p.buf);
    }
    epipe_codec_delta_info info;
    assert_int_equal(epipe_codec_delta_stats(c, &info), EPIPE_OK);
    assert_int_equal(info.stored_samples, 4);
    assert_int_equal(info.stored_bytes, 1 << 20);
    assert_int_equal(info.full_rows, 4);
    assert_int_equal(info.delta_rows, 4);
    assert_int_equal(info.fallback_rows, 4);
    same_state(c, d, ids, 6, (size_t)cols);
    assert_null(epipe_codec_delta_row(c, 14));
    /* A decoder with a smaller budget than the encoder's refuses. */
    epipe_codec *big = mk("quant:bits=4,delta=1,delta_mb=2"),
                *small = mk("quant:bits=4,delta=1,delta_mb=1");
    test_payload p = enc(big, x, ids, rows, cols);
    assert_int_equal(dec(small, &p, y, rows, cols), EPIPE_EPROTO);
    assert_non_null(strstr(epipe_codec_last_error(small), "delta_mb"));
    free(p.buf);
    /* Strict: the encode that would pass the budget fails, naming it. */
    epipe_codec *s = mk("quant:bits=4,delta=1,delta_mb=1,delta_strict=1");
    mat m;
    mat_init(&m, x, rows, cols);
    size_t cap, w;
    assert_int_equal(epipe_codec_max_encoded_size(s, &m.t, &cap), EPIPE_OK);
    uint8_t *buf = malloc(cap);
    assert_int_equal(epipe_codec_set_samples(s, ids, 6), EPIPE_OK);
    assert_int_equal(epipe_codec_encode(s, &m.t, buf, cap, &w), EPIPE_ENOMEM);
    assert_non_null(strstr(epipe_codec_last_error(s), "sample id 14"));
    assert_non_null(strstr(epipe_codec_last_error(s), "delta_mb=1"));
    assert_int_equal(epipe_codec_delta_stats(s, &info), EPIPE_OK);
    assert_int_equal(info.stored_samples, 0); /* a failed encode keeps nothing */
    free(buf), free(x), free(y);
    epipe_codec_destroy(c), epipe_codec_destroy(d), epipe_codec_destroy(s);
    epipe_codec_destroy(big), epipe_codec_destroy(small);
}

static void expect_encode_fails(epipe_codec *c, DLTensor *t, int set, const uint64_t *ids, size_t n,
                                int status, const char *needle)
{
    size_t cap = 0, w;
    assert_int_equal(epipe_codec_max_encoded_size(c, t, &cap), EPIPE_OK);
    uint8_t *buf = malloc(cap);
    if (set)
        assert_int_equal(epipe_codec_set_samples(c, ids, n), EPIPE_OK);
    assert_int_equal(epipe_codec_encode(c, t, buf, cap, &w), status);
    if (!strstr(epipe_codec_last_error(c), needle))
        fail_msg("'%s' lacks '%s'", epipe_codec_last_error(c), needle);
    free(buf);
}

static void test_bad_calls(void **st)
{
    (void)st;
    float x[4 * 8];
    test_fill(x, 32, DIST_NORMAL, 5);
    mat m;
    mat_init(&m, x, 4, 8);
    uint64_t ids[4] = {1, 2, 3, 4}, dup[4] = {1, 2, 3, 2};
    epipe_codec *c = mk("quant:bits=2,delta=1");
    expect_encode_fails(c, &m.t, 0, NULL, 0, EPIPE_EINVAL, "epipe_codec_set_samples()");
    expect_encode_fails(c, &m.t, 1, ids, 3, EPIPE_EINVAL, "3 sample ids");
    expect_encode_fails(c, &m.t, 1, dup, 4, EPIPE_EINVAL, "sample id 2 occurs twice");
    test_payload p = enc(c, x, ids, 4, 8); /* ids set again: accepted */
    free(p.buf);
    /* The ids were consumed: the next encode needs them again. */
    expect_encode_fails(c, &m.t, 0, NULL, 0, EPIPE_EINVAL, "before every encode");
    x[9] = NAN;
    expect_encode_fails(c, &m.t, 1, ids, 4, EPIPE_EINVAL, "index 9 is NaN");
    int64_t n0 = 5;
    DLTensor scalar = m.t;
    scalar.ndim = 0;
    scalar.shape = &n0;
    size_t cap;
    assert_int_equal(epipe_codec_max_encoded_size(c, &scalar, &cap), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_codec_last_error(c), "dimension 0 is the samples"));
    epipe_codec_destroy(c);
}

/* NULL ids: rows sent in full and kept by neither side, between tracked
 * encodes that go on as before. */
static void test_untracked(void **st)
{
    (void)st;
    float x[4 * 16], y[4 * 16], z[4 * 16];
    uint64_t ids[4] = {1, 2, 3, 4};
    test_fill(x, 64, DIST_NORMAL, 11);
    epipe_codec *c = mk("quant:bits=2,delta=1"), *d = mk("quant:bits=2,delta=1");
    test_payload p = enc(c, x, ids, 4, 16);
    assert_int_equal(dec(d, &p, y, 4, 16), EPIPE_OK);
    free(p.buf);
    mat m;
    mat_init(&m, x, 4, 16);
    size_t cap, w;
    assert_int_equal(epipe_codec_max_encoded_size(c, &m.t, &cap), EPIPE_OK);
    uint8_t *buf = malloc(cap);
    assert_int_equal(epipe_codec_set_samples(c, NULL, 4), EPIPE_OK);
    assert_int_equal(epipe_codec_encode(c, &m.t, buf, cap, &w), EPIPE_OK);
    assert_int_equal(w, 16 + 12 + 1 + (w - 29)); /* no ids on the wire */
    test_payload q = {buf, w};
    assert_int_equal(dec(d, &q, y, 4, 16), EPIPE_OK);
    /* the plain codec's values (with the zero=1 that delta=1 implies) */
    test_payload r = test_encode("quant:bits=2,zero=1", x, 64, 1, 0);
    test_decode("quant:bits=2", &r, z, 64, 1, 0);
    assert_memory_equal(y, z, sizeof y);
    assert_memory_equal(buf + 29, r.buf + 16, r.len - 16);
    free(r.buf), free(buf);
    epipe_codec_delta_info info;
    assert_int_equal(epipe_codec_delta_stats(d, &info), EPIPE_OK);
    assert_int_equal(info.untracked_rows, 4);
    const uint64_t *got;
    size_t ngot;
    assert_int_equal(epipe_codec_decoded_samples(d, &got, &ngot), EPIPE_OK);
    assert_null(got);
    assert_int_equal(ngot, 4);
    assert_int_equal(info.full_rows, 4);
    assert_int_equal(info.fallback_rows, 0);
    same_state(c, d, ids, 4, 16);
    p = enc(c, x, ids, 4, 16); /* tracked again: deltas */
    assert_int_equal(dec(d, &p, y, 4, 16), EPIPE_OK);
    assert_int_equal(epipe_codec_decoded_samples(d, &got, &ngot), EPIPE_OK);
    assert_int_equal(ngot, 4);
    assert_memory_equal(got, ids, sizeof ids);
    p.buf[16] ^= 1; /* a failed decode: no ids to pass on */
    assert_int_equal(dec(d, &p, y, 4, 16), EPIPE_EPROTO);
    assert_int_equal(epipe_codec_decoded_samples(d, &got, &ngot), EPIPE_ESTATE);
    assert_null(got);
    free(p.buf);
    assert_int_equal(epipe_codec_delta_stats(d, &info), EPIPE_OK);
    assert_int_equal(info.delta_rows, 4);
    same_state(c, d, ids, 4, 16);
    epipe_codec_destroy(c), epipe_codec_destroy(d);
}

/* Shape and dtype changes start the store over on both sides; resets. */
static void test_shape_dtype_reset(void **st)
{
    (void)st;
    float x[4 * 16], y[4 * 16];
    uint64_t ids[4] = {7, 8, 9, 10};
    test_fill(x, 64, DIST_NORMAL, 6);
    epipe_codec *c = mk("quant:bits=2,delta=1"), *d = mk("quant:bits=2,delta=1");
    epipe_codec_delta_info info;
    test_payload p = enc(c, x, ids, 4, 16);
    assert_int_equal(dec(d, &p, y, 4, 16), EPIPE_OK);
    free(p.buf);
    p = enc(c, x, ids, 4, 8); /* another row shape: full again */
    assert_int_equal(dec(d, &p, y, 4, 8), EPIPE_OK);
    free(p.buf);
    assert_int_equal(epipe_codec_delta_stats(d, &info), EPIPE_OK);
    assert_int_equal(info.full_rows, 8);
    assert_int_equal(info.delta_rows, 0);
    assert_int_equal(info.stored_bytes, 4 * 8 * 4);
    same_state(c, d, ids, 4, 8);
    p = enc(c, x, ids, 4, 8);
    assert_int_equal(dec(d, &p, y, 4, 8), EPIPE_OK);
    free(p.buf);
    /* An fp16 tensor of the same shape: full again. */
    uint16_t h[4 * 8], hy[4 * 8];
    for (size_t i = 0; i < 32; i++)
        h[i] = 0x3c00; /* 1.0 */
    mat m, my;
    mat_init(&m, (float *)h, 4, 8);
    mat_init(&my, (float *)hy, 4, 8);
    m.t.dtype.bits = my.t.dtype.bits = 16;
    size_t cap, w;
    assert_int_equal(epipe_codec_max_encoded_size(c, &m.t, &cap), EPIPE_OK);
    uint8_t *buf = malloc(cap);
    assert_int_equal(epipe_codec_set_samples(c, ids, 4), EPIPE_OK);
    assert_int_equal(epipe_codec_encode(c, &m.t, buf, cap, &w), EPIPE_OK);
    assert_int_equal(epipe_codec_decode(d, buf, w, &my.t), EPIPE_OK);
    free(buf);
    assert_int_equal(epipe_codec_delta_stats(d, &info), EPIPE_OK);
    assert_int_equal(info.full_rows, 12);
    assert_int_equal(info.delta_rows, 4);
    /* Reset on the encoder only: it sends full rows the decoder takes over. */
    assert_int_equal(epipe_codec_reset_feedback(c), EPIPE_OK);
    assert_int_equal(epipe_codec_delta_stats(c, &info), EPIPE_OK);
    assert_int_equal(info.stored_samples, 0);
    p = enc(c, x, ids, 4, 16);
    assert_int_equal(dec(d, &p, y, 4, 16), EPIPE_OK);
    free(p.buf);
    same_state(c, d, ids, 4, 16);
    /* Reset on the decoder only: the next delta names its id. */
    assert_int_equal(epipe_codec_reset_feedback(d), EPIPE_OK);
    p = enc(c, x, ids, 4, 16);
    assert_int_equal(dec(d, &p, y, 4, 16), EPIPE_EPROTO);
    assert_non_null(strstr(epipe_codec_last_error(d), "sample id 7"));
    free(p.buf);
    epipe_codec_destroy(c), epipe_codec_destroy(d);
}

/* Mismatched streams: a decoder gets deltas for ids it never saw, or a
 * payload of the codec without delta=1, or the reverse. */
static void test_mismatch(void **st)
{
    (void)st;
    float x[4 * 16], y[4 * 16];
    uint64_t ids[4] = {1, 2, 3, 4}, other[4] = {1, 2, 3, 99};
    test_fill(x, 64, DIST_RELU, 7);
    epipe_codec *c = mk("sortquant:bits=2,delta=1"), *d = mk("sortquant:bits=2,delta=1");
    test_payload p = enc(c, x, ids, 4, 16);
    assert_int_equal(dec(d, &p, y, 4, 16), EPIPE_OK);
    free(p.buf);
    epipe_codec *c2 = mk("sortquant:bits=2,delta=1");
    p = enc(c2, x, other, 4, 16);              /* all full-keep */
    test_payload q = enc(c2, x, other, 4, 16); /* all deltas */
    epipe_codec *fresh = mk("sortquant:bits=2,delta=1");
    assert_int_equal(dec(fresh, &q, y, 4, 16), EPIPE_EPROTO);
    assert_non_null(strstr(epipe_codec_last_error(fresh), "sample id 1,"));
    assert_int_equal(dec(d, &p, y, 4, 16), EPIPE_OK);
    free(p.buf), free(q.buf);
    /* Plain payloads to a delta decoder and back. */
    p = test_encode("sortquant:bits=2", x, 64, 1, 0);
    assert_int_not_equal(dec(fresh, &p, y, 4, 16), EPIPE_OK);
    free(p.buf);
    p = enc(c, x, ids, 4, 16);
    epipe_codec *plain = mk("sortquant:bits=2");
    assert_int_not_equal(dec(plain, &p, y, 4, 16), EPIPE_OK);
    free(p.buf);
    epipe_codec_destroy(c), epipe_codec_destroy(d), epipe_codec_destroy(c2);
    epipe_codec_destroy(fresh), epipe_codec_destroy(plain);
}

/* A full row the encoder does not keep, for a sample the decoder holds:
 * the stores differ. And the wrapper's first bytes, by name. */
static void test_stores_differ(void **st)
{
    (void)st;
    const int64_t cols = 65536;
    float *x = malloc(4 * (size_t)cols * sizeof *x), *y = malloc(4 * (size_t)cols * sizeof *y);
    test_fill(x, 4 * (size_t)cols, DIST_NORMAL, 10);
    uint64_t one = 1, four[4] = {10, 11, 12, 13};
    epipe_codec *e1 = mk("quant:bits=4,delta=1"), *e2 = mk("quant:bits=4,delta=1,delta_mb=1");
    epipe_codec *d = mk("quant:bits=4,delta=1,delta_mb=2");
    test_payload p = enc(e1, x, &one, 1, cols);
    assert_int_equal(dec(d, &p, y, 1, cols), EPIPE_OK);
    free(p.buf);
    p = enc(e2, x, four, 4, cols); /* fills e2's MiB */
    assert_int_equal(dec(d, &p, y, 4, cols), EPIPE_OK);
    free(p.buf);
    p = enc(e2, x, &one, 1, cols); /* sample 1 in full, unkept */
    assert_int_equal(dec(d, &p, y, 1, cols), EPIPE_EPROTO);
    assert_non_null(strstr(epipe_codec_last_error(d), "stores differ"));
    assert_non_null(strstr(epipe_codec_last_error(d), "sample id 1 "));
    p.buf[16] = 0x45;
    assert_int_equal(dec(d, &p, y, 1, cols), EPIPE_EPROTO);
    assert_non_null(strstr(epipe_codec_last_error(d), "made with delta=1"));
    p.buf[16] = 0x44, p.buf[17] = 2;
    assert_int_equal(dec(d, &p, y, 1, cols), EPIPE_EVERSION);
    assert_non_null(strstr(epipe_codec_last_error(d), "version 2"));
    free(p.buf), free(x), free(y);
    epipe_codec_destroy(e1), epipe_codec_destroy(e2), epipe_codec_destroy(d);
}

/* Every truncation and every single-byte change of a payload with full,
 * kept and delta rows: an error with a message, or a valid decode. */
static void test_hostile(void **st)
{
    (void)st;
    static const char *const specs[] = {"quant:bits=2,delta=1", "sortquant:bits=2,delta=1",
                                        "topk:ratio=0.5,delta=1", "cast:dtype=fp16,delta=1"};
    enum { R = 6, C = 16 };
    float x[R * C], y[R * C];
    uint64_t first[R] = {1, 2, 3, 4, 5, 6}, second[R] = {3, 1, 70, 5, 1ull << 40, 2};
    for (size_t s = 0; s < sizeof specs / sizeof specs[0]; s++) {
        epipe_codec *c = mk(specs[s]);
        test_fill(x, R * C, DIST_NORMAL, 8);
        test_payload p0 = enc(c, x, first, R, C);
        test_fill(x, R * C, DIST_NORMAL, 9);
        /* Odd specs: an untracked payload (NULL ids) instead. */
        test_payload p = {NULL, 0};
        if (s % 2 == 0) {
            p = enc(c, x, second, R, C);
        } else {
            mat m;
            mat_init(&m, x, R, C);
            assert_int_equal(epipe_codec_max_encoded_size(c, &m.t, &p.len), EPIPE_OK);
            p.buf = malloc(p.len);
            assert_int_equal(epipe_codec_set_samples(c, NULL, R), EPIPE_OK);
            assert_int_equal(epipe_codec_encode(c, &m.t, p.buf, p.len, &p.len), EPIPE_OK);
        }
        unsigned ok = 0, bad = 0;
        /* Trials: every length short of the whole, then four changes of
         * every byte after the core's header (tested elsewhere). */
        size_t trials = p.len + 4 * (p.len - 16);
        for (size_t t = 0; t < trials; t++) {
            static const uint8_t xors[4] = {0x01, 0x80, 0xff, 0x10};
            uint8_t *h = malloc(p.len);
            memcpy(h, p.buf, p.len);
            test_payload hp = {h, p.len};
            if (t < p.len)
                hp.len = t;
            else
                h[16 + (t - p.len) / 4] ^= xors[(t - p.len) % 4];
            epipe_codec *d = mk(specs[s]);
            assert_int_equal(dec(d, &p0, y, R, C), EPIPE_OK);
            int rc = dec(d, &hp, y, R, C);
            if (rc == EPIPE_OK) {
                ok++;
            } else {
                bad++;
                assert_true(epipe_codec_last_error(d)[0] != '\0');
                assert_true(rc == EPIPE_EPROTO || rc == EPIPE_ETRUNC || rc == EPIPE_EVERSION ||
                            rc == EPIPE_EINVAL);
            }
            epipe_codec_destroy(d);
            free(h);
        }
        assert_true(bad > 0);
        assert_true(ok > 0); /* flips inside the values decode */
        free(p0.buf), free(p.buf);
        epipe_codec_destroy(c);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_spec_keys),        cmocka_unit_test(test_premise),
        cmocka_unit_test(test_first_epoch_full), cmocka_unit_test(test_budget),
        cmocka_unit_test(test_bad_calls),        cmocka_unit_test(test_shape_dtype_reset),
        cmocka_unit_test(test_mismatch),         cmocka_unit_test(test_stores_differ),
        cmocka_unit_test(test_hostile),          cmocka_unit_test(test_untracked),
        cmocka_unit_test(test_zero_implied),     cmocka_unit_test(test_first_sightings_raw),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
