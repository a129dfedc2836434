/* Dense bit packing: every width 1..16 agrees with the bit-at-a-time
 * reference, round-trips, and packs 8-aligned ranges independently. */
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
    const size_t sizes[] = {0, 1, 7, 8, 9, 63, 1000, 4099};
    for (unsigned w = 1; w <= 16; w++)
        for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
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
        cmocka_unit_test(dirty_tail_is_detected),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
