/* The topk codec: keeps exactly the k largest magnitudes (ties to the lower
 * index), reconstructs them exactly and zeroes the rest, equals its sorting
 * reference for any thread count, and rejects hostile indices. */
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

static uint8_t *tk_encode(const char *spec, int threads, int ref, float *x, size_t n, float *y,
                          size_t *len)
{
    epipe_codec *c;
    int64_t sx, sy;
    DLTensor tx = test_view_f32(x, &sx, n);
    assert_int_equal(epipe_codec_create(&c, spec), EPIPE_OK);
    assert_int_equal(epipe_codec_set_param(c, EPIPE_CODEC_THREADS, threads), EPIPE_OK);
    assert_true(epipe_codec_use_reference(c, ref));
    size_t cap;
    assert_int_equal(epipe_codec_max_encoded_size(c, &tx, &cap), EPIPE_OK);
    uint8_t *buf = malloc(cap ? cap : 1);
    assert_non_null(buf);
    assert_int_equal(epipe_codec_encode(c, &tx, buf, cap, len), EPIPE_OK);
    assert_int_equal(*len, cap);
    if (y) {
        DLTensor ty = test_view_f32(y, &sy, n);
        assert_int_equal(epipe_codec_decode(c, buf, *len, &ty), EPIPE_OK);
    }
    epipe_codec_destroy(c);
    return buf;
}

typedef struct {
    float m;
    size_t i;
} entry;

static int by_mag_then_index(const void *a, const void *b)
{
    const entry *p = a, *q = b;
    if (p->m != q->m)
        return p->m < q->m ? 1 : -1;
    return (p->i > q->i) - (p->i < q->i);
}

/* The decoded tensor equals x on the k entries a full sort picks and is
 * zero everywhere else; the body lists them with ascending indices. */
static void check_selection(const float *x, size_t n, size_t k, const uint8_t *p, const float *y)
{
    entry *e = malloc((n ? n : 1) * sizeof *e);
    char *keep = calloc(n ? n : 1, 1);
    for (size_t i = 0; i < n; i++)
        e[i] = (entry){fabsf(x[i]), i};
    qsort(e, n, sizeof *e, by_mag_then_index);
    for (size_t r = 0; r < k; r++)
        keep[e[r].i] = 1;
    size_t r = 0;
    for (size_t i = 0; i < n; i++) {
        if (keep[i]) {
            assert_memory_equal(&y[i], &x[i], sizeof *y); /* bit-exact, -0 too */
            assert_int_equal(epipe_get_u32(p + 16 + 4 * r), i);
            r++;
        } else {
            assert_true(y[i] == 0.0f);
        }
    }
    assert_int_equal(r, k);
    free(e);
    free(keep);
}

static void keeps_exactly_the_k_largest_magnitudes(void **state)
{
    (void)state;
    const size_t N = 20000;
    float *x = malloc(N * sizeof *x), *y = malloc(N * sizeof *y);
    const double ratios[] = {1e-6, 0.001, 0.01, 0.25, 0.5, 0.999, 1};
    for (int d = 0; d < 4; d++) {
        test_fill(x, N, (enum test_dist)d, 20 + (uint64_t)d);
        for (size_t q = 0; q < 7; q++) {
            char spec[64];
            snprintf(spec, sizeof spec, "topk:ratio=%g", ratios[q]);
            size_t len, k = (size_t)ceil(ratios[q] * (double)N);
            k = k < 1 ? 1 : k;
            uint8_t *p = tk_encode(spec, 1, 0, x, N, y, &len);
            assert_int_equal(len, 16 + 8 * k);
            check_selection(x, N, k, p, y);
            free(p);
        }
    }
    free(x);
    free(y);
}

/* Equal magnitudes (including +x/-x and +0/-0) go to the lower index. */
static void ties_go_to_the_lower_index(void **state)
{
    (void)state;
    float x[12] = {1, -3, 3, 0.0f, 2, -3, 3, -0.0f, 1, 2, -2, 0};
    float y[12];
    for (size_t k = 1; k <= 12; k++) {
        char spec[64];
        snprintf(spec, sizeof spec, "topk:ratio=%.17g", ((double)k - 0.5) / 12);
        size_t len;
        uint8_t *p = tk_encode(spec, 1, 0, x, 12, y, &len);
        assert_int_equal(len, 16 + 8 * k);
        check_selection(x, 12, k, p, y);
        free(p);
    }
    /* k = 3 of the four 3s: indices 1, 2, 5 */
    size_t len;
    uint8_t *p = tk_encode("topk:ratio=0.25", 1, 0, x, 12, y, &len);
    assert_int_equal(epipe_get_u32(p + 16), 1);
    assert_int_equal(epipe_get_u32(p + 20), 2);
    assert_int_equal(epipe_get_u32(p + 24), 5);
    free(p);
    float zeros[7] = {0, -0.0f, 0, 0, 0, 0, 0}, back[7];
    p = tk_encode("topk:ratio=0.3", 1, 0, zeros, 7, back, &len);
    assert_int_equal(len, 16 + 8 * 3);
    assert_int_equal(epipe_get_u32(p + 16 + 4), 1);
    free(p);
}

/* The quickselect path equals the sort reference, for every thread count
 * (N is large enough for epipe_codec_workers to use 3 threads), also on
 * data with many ties. */
static void fast_equals_reference_for_any_thread_count(void **state)
{
    (void)state;
    const size_t N = 400000;
    float *x = malloc(N * sizeof *x), *y = malloc(N * sizeof *y), *z = malloc(N * sizeof *z);
    for (int data = 0; data < 2; data++) {
        test_fill(x, N, DIST_RELU, 31);
        if (data == 1)
            for (size_t i = 0; i < N; i++)
                x[i] = roundf(x[i] * 4.0f) * ((i & 1) ? -1.0f : 1.0f); /* heavy ties */
        size_t lref, len;
        uint8_t *ref = tk_encode("topk:ratio=0.03", 1, 1, x, N, y, &lref);
        for (int t = 1; t <= 3; t++) {
            uint8_t *p = tk_encode("topk:ratio=0.03", t, 0, x, N, z, &len);
            assert_int_equal(len, lref);
            assert_memory_equal(p, ref, len);
            assert_memory_equal(y, z, N * sizeof *y);
            free(p);
        }
        free(ref);
    }
    /* empty and tiny tensors */
    for (size_t n = 0; n < 5; n++) {
        size_t lr, lf;
        test_fill(x, n, DIST_NORMAL, n);
        uint8_t *r = tk_encode("topk:ratio=0.5", 1, 1, x, n, y, &lr);
        uint8_t *p = tk_encode("topk:ratio=0.5", 0, 0, x, n, z, &lf);
        assert_int_equal(lr, lf);
        assert_memory_equal(r, p, lr);
        assert_int_equal(lr, 16 + 8 * ((n + 1) / 2));
        free(r);
        free(p);
    }
    free(x);
    free(y);
    free(z);
}

/* The fast path (AVX2 and portable loops) equals the reference on data
 * that stresses the selection: all values equal (every entry is in the
 * sampled window: it overflows), zeros of both signs, a threshold tie
 * spread over the thread ranges, ratios up to 1 (everything kept), and a
 * sample that misjudges the threshold. */
static void fast_equals_reference_on_hard_data(void **state)
{
    (void)state;
    const size_t N = 300000;
    float *x = malloc(N * sizeof *x);
    const char *specs[] = {"topk:ratio=0.1", "topk:ratio=0.5", "topk:ratio=1", "topk:ratio=1e-6"};
    for (int data = 0; data < 4; data++) {
        test_fill(x, N, DIST_NORMAL, 77 + (unsigned)data);
        for (size_t i = 0; i < N; i++) {
            if (data == 0)
                x[i] = (i & 1) ? -2.5f : 2.5f;
            else if (data == 1)
                x[i] = (i % 3 == 0) ? 0.0f : (i % 3 == 1) ? -0.0f : x[i];
            else if (data == 2)
                x[i] = (i % 7 == 0) ? 1.0f : x[i] * 0.1f; /* a big tie at the cut */
        }
        for (size_t s = 0; s < sizeof specs / sizeof specs[0]; s++) {
            size_t lref, len;
            uint8_t *ref = tk_encode(specs[s], 1, 1, x, N, NULL, &lref);
            for (int simd = 0; simd < 2; simd++)
                for (int t = 1; t <= 2; t++) {
                    int was = epipe_q_set_simd(simd);
                    uint8_t *p = tk_encode(specs[s], t, 0, x, N, NULL, &len);
                    epipe_q_set_simd(was);
                    assert_int_equal(len, lref);
                    assert_memory_equal(p, ref, len);
                    free(p);
                }
            free(ref);
        }
    }
    /* Data that fools the selection's sample (every sampled position holds
     * the smallest value), so the exact histogram passes must take over. */
    for (size_t i = 0; i < N; i++)
        x[i] = 2.0f + (float)(i % 1000) * 1e-3f;
    for (size_t i = 0; i < 65536; i++)
        x[(size_t)((uint64_t)i * N / 65536)] = 1.0f;
    for (size_t s = 0; s < 2; s++) {
        size_t lref, len;
        uint8_t *ref = tk_encode(specs[s], 1, 1, x, N, NULL, &lref);
        for (int t = 1; t <= 2; t++) {
            uint8_t *p = tk_encode(specs[s], t, 0, x, N, NULL, &len);
            assert_int_equal(len, lref);
            assert_memory_equal(p, ref, len);
            free(p);
        }
        free(ref);
    }
    /* A NaN deep in a threaded tensor is named by its index. */
    x[N - 5] = NAN;
    epipe_codec *c = test_codec("topk:ratio=0.1", 2, 0);
    int64_t sx;
    DLTensor tx = test_view_f32(x, &sx, N);
    size_t cap, len;
    assert_int_equal(epipe_codec_max_encoded_size(c, &tx, &cap), EPIPE_OK);
    uint8_t *buf = malloc(cap);
    assert_int_equal(epipe_codec_encode(c, &tx, buf, cap, &len), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_codec_last_error(c), "index 299995"));
    epipe_codec_destroy(c);
    free(buf);
    free(x);
}

static void spec_errors_and_bad_input_are_named(void **state)
{
    (void)state;
    epipe_codec *c = NULL;
    assert_int_equal(epipe_codec_create(&c, "topk:ratio=0"), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "'ratio'"));
    assert_int_equal(epipe_codec_create(&c, "topk:ratio=2"), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "'ratio'"));
    assert_int_equal(epipe_codec_create(&c, "topk:ratio=-0.5"), EPIPE_EINVAL);
    assert_int_equal(epipe_codec_create(&c, "topk:k=3"), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "'k'"));
    assert_int_equal(epipe_codec_create(&c, "topk:ratio=0.125"), EPIPE_OK);
    assert_string_equal(epipe_codec_spec(c), "topk:ratio=0.125");
    float x[5] = {1, 2, 3, 4, INFINITY};
    int64_t s;
    DLTensor t = test_view_f32(x, &s, 5);
    uint8_t buf[128];
    size_t n;
    assert_int_equal(epipe_codec_encode(c, &t, buf, sizeof buf, &n), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_codec_last_error(c), "index 4"));
    epipe_codec_destroy(c);
}

static void hostile_indices_rejected(void **state)
{
    (void)state;
    enum { N = 16 };
    float x[N], y[N];
    int64_t sx, sy;
    test_fill(x, N, DIST_NORMAL, 4);
    DLTensor tx = test_view_f32(x, &sx, N), ty = test_view_f32(y, &sy, N);
    epipe_codec *c;
    assert_int_equal(epipe_codec_create(&c, "topk:ratio=0.25"), EPIPE_OK);
    uint8_t buf[128], bad[128];
    size_t len;
    assert_int_equal(epipe_codec_encode(c, &tx, buf, sizeof buf, &len), EPIPE_OK);
    assert_int_equal(len, 16 + 4 * 8);
    const uint8_t *idx = buf + 16;
    memcpy(bad, buf, len);
    epipe_put_u32(bad + 16 + 12, N); /* last index = n */
    test_expect_rejected(c, bad, len, &ty, "out of range");
    memcpy(bad, buf, len);
    epipe_put_u32(bad + 16 + 12, 0xffffffffu);
    test_expect_rejected(c, bad, len, &ty, "out of range");
    memcpy(bad, buf, len);
    epipe_put_u32(bad + 16 + 4, epipe_get_u32(idx)); /* duplicate */
    test_expect_rejected(c, bad, len, &ty, "strictly increasing");
    memcpy(bad, buf, len);
    epipe_put_u32(bad + 16, epipe_get_u32(idx + 4)); /* swapped order */
    epipe_put_u32(bad + 20, epipe_get_u32(idx));
    test_expect_rejected(c, bad, len, &ty, "strictly increasing");
    memcpy(bad, buf, len);
    epipe_put_f32(bad + 16 + 16 + 8, NAN);
    test_expect_rejected(c, bad, len, &ty, "not finite");
    /* another ratio is refused by the header's parameter word */
    epipe_codec *c2;
    assert_int_equal(epipe_codec_create(&c2, "topk:ratio=0.5"), EPIPE_OK);
    assert_int_equal(epipe_codec_decode(c2, buf, len, &ty), EPIPE_EPROTO);
    epipe_codec_destroy(c2);
    assert_true(epipe_codec_use_reference(c, 0));
    assert_int_equal(epipe_codec_decode(c, buf, len - 1, &ty), EPIPE_ETRUNC);
    assert_int_equal(epipe_codec_decode(c, buf, len, &ty), EPIPE_OK);
    epipe_codec_destroy(c);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(keeps_exactly_the_k_largest_magnitudes),
        cmocka_unit_test(ties_go_to_the_lower_index),
        cmocka_unit_test(fast_equals_reference_for_any_thread_count),
        cmocka_unit_test(fast_equals_reference_on_hard_data),
        cmocka_unit_test(spec_errors_and_bad_input_are_named),
        cmocka_unit_test(hostile_indices_rejected),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
