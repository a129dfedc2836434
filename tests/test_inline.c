/* The per-element functions the CUDA kernels share with the CPU code
 * (codecs/inline/), checked here on the CPU: 8-code packing against
 * lib/bitpack's reference, the table check, the cast conversions. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "../codecs/inline/half.h"
#include "../codecs/sortquant/sortquant.h"
#include "../codecs/inline/quant.h"
#include "../lib/bitpack.h"
#include "../lib/tensor.h"
#include "testutil.h"

/* Groups of 8 codes packed with epipe_hd_pack8 are the bytes of
 * epipe_bitpack_ref, and unpack back, for every width 1..16. */
static void pack8_matches_bitpack(void **state)
{
    (void)state;
    test_rng r;
    test_rng_seed(&r, 11);
    enum { N = 8 * 37 };
    uint16_t codes[N];
    uint8_t ref[2 * N], mine[2 * N + 16];
    for (unsigned w = 1; w <= 16; w++) {
        for (size_t i = 0; i < N; i++)
            codes[i] = (uint16_t)(test_rng_next(&r) & ((1u << w) - 1u));
        codes[0] = (uint16_t)((1u << w) - 1u); /* all ones */
        epipe_bitpack_ref(codes, N, w, ref);
        for (size_t g = 0; g < N / 8; g++) {
            uint32_t c[8], back[8];
            for (int i = 0; i < 8; i++)
                c[i] = codes[g * 8 + i];
            epipe_hd_pack8(c, w, mine + g * w);
            epipe_hd_unpack8(ref + g * w, w, back);
            for (int i = 0; i < 8; i++)
                assert_int_equal(back[i], c[i]);
        }
        assert_memory_equal(ref, mine, epipe_bitpack_bytes(N, w));
    }
}

static void pair_check_rules(void **state)
{
    (void)state;
    assert_int_equal(epipe_hd_q_pair_check(1.0f, 0.5f, 255.0f), 0);
    assert_int_equal(epipe_hd_q_pair_check(NAN, 0.5f, 255.0f), 1);
    assert_int_equal(epipe_hd_q_pair_check(INFINITY, 0.5f, 255.0f), 1);
    assert_int_equal(epipe_hd_q_pair_check(1.0f, -0.0f, 255.0f), 2);
    assert_int_equal(epipe_hd_q_pair_check(1.0f, NAN, 255.0f), 2);
    assert_int_equal(epipe_hd_q_pair_check(3e38f, 3e38f, 255.0f), 3);
    /* the step never lets min + levels * step overflow */
    float s = epipe_hd_q_step(-3e38f, 3e38f, 65535.0f);
    assert_int_equal(epipe_hd_q_pair_check(-3e38f, s, 65535.0f), 0);
    assert_true(epipe_hd_q_step(2.0f, 2.0f, 255.0f) == 0.0f);
}

/* The shared conversions are the library's (lib/tensor.c wraps them) and
 * cast's saturation keeps infinities and NaN. */
static void half_conversions(void **state)
{
    (void)state;
    for (uint32_t h = 0; h < 0x10000u; h++) {
        float f = epipe_hd_f16_to_f32((uint16_t)h);
        if (!isnan(f))
            assert_int_equal(epipe_hd_f32_to_f16(f), h);
        float b = epipe_hd_bf16_to_f32((uint16_t)h);
        if (!isnan(b))
            assert_int_equal(epipe_hd_f32_to_bf16(b), h);
        assert_int_equal(epipe_f32_to_f16(f), epipe_hd_f32_to_f16(f));
    }
    assert_int_equal(epipe_hd_cast_encode(0, 70000.0f), 0x7bffu);
    assert_int_equal(epipe_hd_cast_encode(0, -70000.0f), 0xfbffu);
    assert_int_equal(epipe_hd_cast_encode(0, INFINITY), 0x7c00u);
    assert_int_equal(epipe_hd_cast_encode(1, 3.4e38f), 0x7f7fu);
    assert_int_equal(epipe_hd_cast_encode(0, 1e-8f), epipe_f32_to_f16(1e-8f)); /* subnormal */
}

/* The CUDA kernel draws sortquant's sample position by position; the CPU
 * walks the strata incrementally. Both must read the same values. */
static void sample_positions_agree(void **state)
{
    (void)state;
    enum { N = 300007 };
    static float x[N], a[N], b[N];
    for (size_t i = 0; i < N; i++)
        x[i] = (float)i;
    const uint64_t ns[] = {1, 1024, 1025, 65536, 65537, 100000, N};
    const uint64_t ms[] = {1, 1024, 4097, 65536};
    for (size_t i = 0; i < sizeof ns / sizeof ns[0]; i++)
        for (size_t j = 0; j < sizeof ms / sizeof ms[0]; j++) {
            uint64_t n = ns[i], m = ms[j] < n ? ms[j] : n;
            sq_sample_gather(x, n, m, a);
            for (uint64_t k = 0; k < m; k++)
                b[k] = x[epipe_hd_sq_sample_pos(k, n, m)];
            assert_memory_equal(a, b, m * sizeof(float));
        }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(pack8_matches_bitpack),
        cmocka_unit_test(pair_check_rules),
        cmocka_unit_test(half_conversions),
        cmocka_unit_test(sample_positions_agree),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
