/* The cast codec's fast path (F16C/AVX2 kernels on threads, and the
 * portable loop) gives the bytes and floats of its scalar reference. */
#include <float.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <epipe/epipe.h>

#include "../codecs/quantize_common.h"
#include "testutil.h"

static float from_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Every sign and exponent with random mantissas, the rounding ties of both
 * types and their neighbours, NaN payloads (quiet and signalling),
 * infinities, zeros and the saturation edges; then random bit patterns. */
static size_t fill_hard(float *x, size_t cap, uint64_t seed)
{
    test_rng r;
    test_rng_seed(&r, seed);
    size_t n = 0;
    const uint32_t lows[] = {0,      1,      0xfff,   0x1000, 0x1001,   0x2fff,   0x3000,  0x7fff,
                             0x8000, 0x8001, 0x18000, 0x1fff, 0x3fffff, 0x400000, 0x7fffff};
    for (uint32_t se = 0; se < 512; se++) {
        for (size_t l = 0; l < sizeof lows / sizeof lows[0]; l++)
            x[n++] = from_bits(se << 23 | lows[l]);
        for (int k = 0; k < 24; k++) {
            uint32_t m = (uint32_t)test_rng_next(&r) & 0x7fffffu;
            x[n++] = from_bits(se << 23 | m);
            x[n++] = from_bits(se << 23 | (m & ~0x1fffu) | 0x1000u); /* fp16 tie */
            x[n++] = from_bits(se << 23 | (m & ~0xffffu) | 0x8000u); /* bf16 tie */
        }
    }
    const float edges[] = {65504.0f,      65519.996f,    65520.0f,      65536.0f,
                           FLT_MAX,       -FLT_MAX,      INFINITY,      -INFINITY,
                           0.0f,          -0.0f,         5.9604645e-8f, 2.9802322e-8f,
                           2.9802326e-8f, 6.1035156e-5f, 6.1028e-5f,    3.3895314e38f};
    for (size_t e = 0; e < sizeof edges / sizeof edges[0]; e++)
        x[n++] = edges[e];
    while (n < cap)
        x[n++] = from_bits((uint32_t)test_rng_next(&r));
    return n;
}

static void check_encode(const char *spec, float *x, size_t n, int threads)
{
    test_payload ref = test_encode(spec, x, n, 1, 1);
    for (int simd = 0; simd < 2; simd++) {
        int was = epipe_q_set_simd(simd);
        test_payload fast = test_encode(spec, x, n, threads, 0);
        epipe_q_set_simd(was);
        assert_int_equal(fast.len, ref.len);
        assert_memory_equal(fast.buf, ref.buf, ref.len);
        free(fast.buf);
    }
    free(ref.buf);
}

static void encode_matches_reference(void **state)
{
    (void)state;
    const size_t big = 300000; /* above the size where two threads run */
    float *x = malloc(big * sizeof *x);
    assert_non_null(x);
    size_t hard = fill_hard(x, big, 42);
    assert_true(hard <= big);
    const char *specs[] = {"cast:dtype=fp16", "cast:dtype=bf16"};
    const size_t sizes[] = {0, 1, 7, 8, 15, 16, 17, 33, 1000, 4099, big};
    for (size_t s = 0; s < 2; s++)
        for (size_t z = 0; z < sizeof sizes / sizeof sizes[0]; z++)
            for (int threads = 1; threads <= 2; threads++)
                check_encode(specs[s], x + (big - sizes[z]) / 3, sizes[z], threads);
    free(x);
}

/* Every 16-bit pattern, NaNs of both kinds included, decodes to the
 * reference's float bits. */
static void decode_matches_reference(void **state)
{
    (void)state;
    const size_t n = 65536 * 5 + 3;
    uint8_t *body = malloc(16 + 2 * n);
    float *ref = malloc(n * sizeof *ref), *fast = malloc(n * sizeof *fast);
    assert_true(body && ref && fast);
    const char *specs[] = {"cast:dtype=fp16", "cast:dtype=bf16"};
    for (size_t s = 0; s < 2; s++) {
        float z = 0.0f;
        test_payload p = test_encode(specs[s], &z, 1, 1, 1); /* a header to copy */
        memcpy(body, p.buf, 16);
        free(p.buf);
        body[8] = (uint8_t)n, body[9] = (uint8_t)(n >> 8), body[10] = (uint8_t)(n >> 16);
        for (size_t i = 0; i < n; i++) {
            uint16_t h = (uint16_t)(i * 40503u); /* every pattern, shuffled */
            body[16 + 2 * i] = (uint8_t)h;
            body[16 + 2 * i + 1] = (uint8_t)(h >> 8);
        }
        test_payload q = {body, 16 + 2 * n};
        test_decode(specs[s], &q, ref, n, 1, 1);
        for (int simd = 0; simd < 2; simd++)
            for (int threads = 1; threads <= 2; threads++) {
                int was = epipe_q_set_simd(simd);
                memset(fast, 0xee, n * sizeof *fast);
                test_decode(specs[s], &q, fast, n, threads, 0);
                epipe_q_set_simd(was);
                assert_memory_equal(fast, ref, n * sizeof *ref);
            }
    }
    free(body), free(ref), free(fast);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(encode_matches_reference),
        cmocka_unit_test(decode_matches_reference),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
