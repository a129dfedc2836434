/* Dense bit packing: every width 1..16 agrees with the bit-at-a-time
 * reference, round-trips, packs 8-aligned ranges independently, and the
 * table decode (SIMD and portable) matches its reference. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "bitpack.h"
#include "testutil.h"

static void fill_codes(uint16_t *c, size_t n, unsigned w, uint64_t seed)
{
    test_rng r;
    test_rng_seed(&r, seed);
    for (size_t i = 0; i < n; i++)
        c[i] = (uint16_t)(test_rng_next(&r) & ((1u << w) - 1u));
}

static void every_width_matches_reference(void **state)
{
    (void)state;
    const size_t sizes[] = {0, 1, 7, 8, 9, 63, 64, 65, 95, 96, 97, 127, 128, 129, 1000, 4099};
    for (int simd = 0; simd < 2; simd++)
        for (unsigned w = 1; w <= 16; w++)
            for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
                int was = epipe_bitpack_set_simd(simd);
                size_t n = sizes[s], nb = epipe_bitpack_bytes(n, w);
                uint16_t *codes = calloc(n + 1, 2), *back = calloc(n + 1, 2),
                         *back_ref = calloc(n + 1, 2);
                uint8_t *fast = calloc(nb + 1, 1), *ref = calloc(nb + 1, 1);
                fill_codes(codes, n, w, w * 131 + n);
                epipe_bitpack(codes, n, w, fast);
                epipe_bitpack_ref(codes, n, w, ref);
                assert_memory_equal(fast, ref, nb + 1);
                assert_int_equal(nb, (n * w + 7) / 8);
                assert_true(epipe_bitpack_tail_clean(fast, n, w));
                epipe_bitunpack(fast, n, w, back);
                epipe_bitunpack_ref(fast, n, w, back_ref);
                assert_memory_equal(back, codes, n * 2);
                assert_memory_equal(back_ref, codes, n * 2);
                free(codes), free(back), free(back_ref), free(fast), free(ref);
                epipe_bitpack_set_simd(was);
            }
}

static void a_six_bit_code_takes_six_bits(void **state)
{
    (void)state;
    uint16_t codes[4] = {0x3f, 0, 0x3f, 0};
    uint8_t out[3];
    assert_int_equal(epipe_bitpack_bytes(4, 6), 3);
    epipe_bitpack(codes, 4, 6, out);
    assert_int_equal(out[0], 0x3f);
    assert_int_equal(out[1], 0xf0);
    assert_int_equal(out[2], 0x03);
}

static void aligned_ranges_pack_independently(void **state)
{
    (void)state;
    for (unsigned w = 1; w <= 16; w++) {
        size_t n = 1003, nb = epipe_bitpack_bytes(n, w);
        uint16_t codes[1003];
        uint8_t whole[2100], parts[2100];
        fill_codes(codes, n, w, 7 + w);
        epipe_bitpack(codes, n, w, whole);
        memset(parts, 0xaa, sizeof parts);
        epipe_bitpack(codes, 504, w, parts);
        epipe_bitpack(codes + 504, n - 504, w, parts + 504 * w / 8);
        assert_memory_equal(whole, parts, nb);
    }
}

/* Threads pack neighbouring ranges in any order: packing the later range
 * first, and writing nothing past a range, must give the same bytes. */
static void ranges_pack_in_any_order_without_spilling(void **state)
{
    (void)state;
    for (unsigned sw = 0; sw < 32; sw++) {
        unsigned w = sw % 16 + 1;
        int was = epipe_bitpack_set_simd(sw < 16);
        size_t n = 1003, nb = epipe_bitpack_bytes(n, w);
        uint16_t codes[1003];
        uint8_t whole[2100], parts[2100];
        fill_codes(codes, n, w, 11 + w);
        epipe_bitpack(codes, n, w, whole);
        memset(parts, 0xaa, sizeof parts);
        epipe_bitpack(codes + 504, n - 504, w, parts + 504 * w / 8);
        epipe_bitpack(codes, 504, w, parts);
        assert_memory_equal(whole, parts, nb);
        assert_int_equal(parts[nb], 0xaa);
        memset(parts, 0xaa, sizeof parts);
        epipe_bitpack(codes, 64, w, parts); /* whole groups only */
        assert_memory_equal(whole, parts, 8 * w);
        assert_int_equal(parts[8 * w], 0xaa);
        memset(parts, 0xaa, sizeof parts);
        epipe_bitpack(codes, 512, w, parts); /* many vector steps, then the edge */
        assert_memory_equal(whole, parts, 64 * w);
        assert_int_equal(parts[64 * w], 0xaa);
        epipe_bitpack_set_simd(was);
    }
}

/* The table decode gives lut[code] for every code, with and without the
 * AVX2 kernels, and reads no byte past the codes. */
static void table_unpack_matches_reference(void **state)
{
    (void)state;
    const size_t sizes[] = {0, 1, 7, 8, 9, 15, 16, 17, 63, 1000, 4099};
    float lut[65536];
    for (size_t i = 0; i < 65536; i++)
        lut[i] = (float)i * 0.5f - 7.0f;
    for (int simd = 0; simd < 2; simd++) {
        int was = epipe_bitpack_set_simd(simd);
        for (unsigned w = 1; w <= 16; w++)
            for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
                size_t n = sizes[s], nb = epipe_bitpack_bytes(n, w);
                uint16_t *codes = calloc(n + 1, 2);
                uint8_t *packed = malloc(nb ? nb : 1); /* exact: ASan sees over-reads */
                float *fast = calloc(n + 1, 4), *ref = calloc(n + 1, 4);
                fill_codes(codes, n, w, w * 17 + n);
                epipe_bitpack(codes, n, w, packed);
                epipe_bitunpack_lut(packed, n, w, lut, fast);
                epipe_bitunpack_lut_ref(packed, n, w, lut, ref);
                assert_memory_equal(fast, ref, (n + 1) * 4);
                for (size_t i = 0; i < n; i++)
                    assert_true(fast[i] == lut[codes[i]]);
                free(codes), free(packed), free(fast), free(ref);
            }
        epipe_bitpack_set_simd(was);
    }
}

static void dirty_tail_is_detected(void **state)
{
    (void)state;
    uint8_t b[2] = {0x07, 0x00};
    assert_true(epipe_bitpack_tail_clean(b, 1, 3));
    b[0] = 0x0f;
    assert_false(epipe_bitpack_tail_clean(b, 1, 3));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(every_width_matches_reference),
        cmocka_unit_test(a_six_bit_code_takes_six_bits),
        cmocka_unit_test(aligned_ranges_pack_independently),
        cmocka_unit_test(ranges_pack_in_any_order_without_spilling),
        cmocka_unit_test(table_unpack_matches_reference),
        cmocka_unit_test(dirty_tail_is_detected),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
