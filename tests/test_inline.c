/* The per-element functions the CUDA kernels share with the CPU code
 * (codecs/inline/), checked here on the CPU: 8-code packing against
 * lib/bitpack's reference, the table check, the cast conversions. */
#include <epipe/epipe.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "../codecs/inline/half.h"
#include "../codecs/inline/quant.h"
#include "../codecs/sortquant/sortquant.h"
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

static int cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return x < y ? -1 : x > y;
}

/* The CUDA kernels' algorithm for quant and sortquant mode=sample, written
 * out on the CPU with the same shared functions (cuda/quant.cu,
 * cuda/sortquant.cu: sample by position, full sort, boundaries at the ranks,
 * per-chunk extents by chunk search, the table, 8-code packing). Its bytes
 * must be the CPU codec's: what the GPU would compute is checked here,
 * short of the CUDA-specific parts. */
static size_t gpu_algorithm(unsigned bits, unsigned split, uint64_t sample, const float *x,
                            size_t n, uint8_t *body)
{
    unsigned k = 1u << split, q = bits - split;
    float levels = (float)((1u << q) - 1u);
    uint64_t m = n < sample ? n : sample;
    float *smp = malloc(sizeof(float) * (m + 1)), bnd[4097], mn[4096], st[4096], iv[4096];
    float lo[4096], hi[4096];
    assert_non_null(smp);
    for (uint64_t j = 0; j < m; j++)
        smp[j] = x[epipe_hd_sq_sample_pos(j, n, m)];
    qsort(smp, m, sizeof(float), cmp_float);
    bnd[0] = -INFINITY;
    bnd[k] = INFINITY;
    for (unsigned j = 1; j < k; j++)
        bnd[j] = smp[epipe_hd_sq_rank(j, m, k)];
    for (unsigned j = 0; j < k; j++) {
        lo[j] = INFINITY;
        hi[j] = -INFINITY;
    }
    for (size_t i = 0; i < n; i++) {
        unsigned c = epipe_hd_q_chunk(bnd, k, x[i]);
        lo[c] = x[i] < lo[c] ? x[i] : lo[c];
        hi[c] = x[i] > hi[c] ? x[i] : hi[c];
    }
    for (unsigned j = 0; j < k; j++) {
        mn[j] = st[j] = iv[j] = 0.0f;
        if (lo[j] <= hi[j]) {
            mn[j] = lo[j] + 0.0f;
            st[j] = epipe_hd_q_step(mn[j], hi[j] + 0.0f, levels);
            iv[j] = st[j] > 0.0f ? 1.0f / st[j] : 0.0f;
        }
        memcpy(body + 8 * j, &mn[j], 4);
        memcpy(body + 8 * j + 4, &st[j], 4);
    }
    uint8_t *codes = body + 8 * k;
    size_t cb = epipe_bitpack_bytes(n, bits);
    for (size_t g = 0; g < (n + 7) / 8; g++) {
        uint32_t c[8];
        for (unsigned i = 0; i < 8; i++) {
            size_t j = g * 8 + i;
            unsigned ch = j < n ? epipe_hd_q_chunk(bnd, k, x[j]) : 0;
            c[i] = j < n ? ch << q | epipe_hd_q_level(x[j], mn[ch], iv[ch], levels) : 0;
        }
        uint8_t b[16];
        epipe_hd_pack8(c, bits, b);
        size_t at = g * bits, cnt = cb - at < bits ? cb - at : bits;
        memcpy(codes + at, b, cnt);
    }
    free(smp);
    return 8 * k + cb;
}

/* The CUDA kernels' algorithm for sortquant mode=exact (cuda/sortquant.cu):
 * a stable sort of (order key of x + 0, index) pairs, so that equal values
 * (both zeros one value) keep index order, as the CPU's ties by index; the
 * chunk of each sorted position; per-chunk extents from the sorted ends;
 * the table; 8-code packing. */
struct key_index {
    uint32_t key, index;
};

static int cmp_key_index(const void *a, const void *b)
{
    const struct key_index *x = a, *y = b;
    if (x->key != y->key)
        return x->key < y->key ? -1 : 1;
    return x->index < y->index ? -1 : x->index > y->index;
}

static uint32_t order_key(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u & 0x80000000u ? ~u : u | 0x80000000u;
}

static size_t gpu_exact_algorithm(unsigned bits, unsigned split, const float *x, size_t n,
                                  uint8_t *body)
{
    unsigned k = 1u << split, q = bits - split;
    float levels = (float)((1u << q) - 1u), mn[4096], iv[4096];
    struct key_index *s = malloc(sizeof *s * (n + 1));
    uint16_t *chunk = malloc(sizeof *chunk * (n + 1));
    assert_true(s && chunk);
    for (size_t i = 0; i < n; i++)
        s[i] = (struct key_index){order_key(x[i] + 0.0f), (uint32_t)i};
    qsort(s, n, sizeof *s, cmp_key_index);
    for (size_t p = 0; p < n; p++)
        chunk[s[p].index] = (uint16_t)epipe_hd_sq_chunk_at(p, n, k);
    for (unsigned j = 0; j < k; j++) {
        uint64_t a = epipe_hd_sq_rank(j, n, k), b = epipe_hd_sq_rank(j + 1, n, k);
        float st = 0.0f;
        mn[j] = iv[j] = 0.0f;
        if (a < b) {
            mn[j] = x[s[a].index] + 0.0f;
            st = epipe_hd_q_step(mn[j], x[s[b - 1].index] + 0.0f, levels);
            iv[j] = st > 0.0f ? 1.0f / st : 0.0f;
        }
        memcpy(body + 8 * j, &mn[j], 4);
        memcpy(body + 8 * j + 4, &st, 4);
    }
    uint8_t *codes = body + 8 * k;
    size_t cb = epipe_bitpack_bytes(n, bits);
    for (size_t g = 0; g < (n + 7) / 8; g++) {
        uint32_t c[8];
        for (unsigned i = 0; i < 8; i++) {
            size_t j = g * 8 + i;
            c[i] = j < n ? (uint32_t)chunk[j] << q |
                               epipe_hd_q_level(x[j], mn[chunk[j]], iv[chunk[j]], levels)
                         : 0;
        }
        uint8_t b[16];
        epipe_hd_pack8(c, bits, b);
        size_t at = g * bits, cnt = cb - at < bits ? cb - at : bits;
        memcpy(codes + at, b, cnt);
    }
    free(s);
    free(chunk);
    return 8 * k + cb;
}

/* The CPU codec's body for x[0..n) (after its 16-byte payload header) must
 * be the body the written-out algorithm made, mine[0..body). */
static void body_is_the_cpus(const char *spec, const float *x, size_t n, const uint8_t *mine,
                             size_t body, uint8_t *cpu)
{
    epipe_codec *c;
    assert_int_equal(epipe_codec_create(&c, spec), EPIPE_OK);
    int64_t shape[1] = {(int64_t)n};
    DLTensor t = {.data = (void *)x,
                  .device = {kDLCPU, 0},
                  .ndim = 1,
                  .shape = shape,
                  .dtype = {kDLFloat, 32, 1}};
    size_t w;
    assert_int_equal(epipe_codec_encode(c, &t, cpu, 300000, &w), EPIPE_OK);
    assert_int_equal(body + 16, w);
    if (memcmp(cpu + 16, mine, body) != 0)
        fail_msg("%s n=%zu: bytes differ", spec, n);
    epipe_codec_destroy(c);
}

static void gpu_exact_algorithm_matches_cpu(void **state)
{
    (void)state;
    static const struct {
        const char *spec;
        unsigned bits, split;
    } cases[] = {
        {"sortquant:bits=8,mode=exact", 8, 2},
        {"sortquant:bits=4,split=1,mode=exact", 4, 1},
        {"sortquant:bits=12,split=8,mode=exact", 12, 8},
        {"sortquant:bits=16,split=12,mode=exact", 16, 12},
    };
    const size_t sizes[] = {1, 3, 9, 4097, 100003};
    float *x = malloc(sizeof(float) * 100003);
    uint8_t *cpu = malloc(300000), *mine = malloc(300000);
    assert_true(x && cpu && mine);
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++)
        for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++)
            for (int ties = 0; ties < 2; ties++) {
                size_t n = sizes[si];
                test_fill(x, n, si % 2 ? DIST_RELU : DIST_NORMAL, 7 + si);
                /* ties: few distinct values, so boundaries cut through runs of
                 * equal values; -0 among the zeros */
                for (size_t i = 0; ties && i < n; i++)
                    x[i] = x[i] == 0.0f ? (i % 3 ? 0.0f : -0.0f) : (float)(int)(x[i] * 2.0f);
                size_t body = gpu_exact_algorithm(cases[ci].bits, cases[ci].split, x, n, mine);
                body_is_the_cpus(cases[ci].spec, x, n, mine, body, cpu);
            }
    free(x);
    free(cpu);
    free(mine);
}

static void gpu_algorithm_matches_cpu(void **state)
{
    (void)state;
    static const struct {
        const char *spec;
        unsigned bits, split;
        uint64_t sample;
    } cases[] = {
        {"quant:bits=8", 8, 0, 1}, /* one chunk: the sample is never read */
        {"quant:bits=1", 1, 0, 1},
        {"quant:bits=13", 13, 0, 1},
        {"sortquant:bits=8,mode=sample", 8, 2, 65536},
        {"sortquant:bits=4,split=1,mode=sample", 4, 1, 65536},
        {"sortquant:bits=12,split=8,mode=sample,sample=1024", 12, 8, 1024},
        {"sortquant:bits=16,split=12,mode=sample", 16, 12, 65536},
    };
    const size_t sizes[] = {1, 9, 4097, 100003};
    float *x = malloc(sizeof(float) * 100003);
    uint8_t *cpu = malloc(300000), *mine = malloc(300000);
    assert_true(x && cpu && mine);
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++)
        for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
            size_t n = sizes[si];
            test_fill(x, n, si % 2 ? DIST_RELU : DIST_NORMAL, 5 + si);
            size_t body = gpu_algorithm(cases[ci].bits, cases[ci].split, cases[ci].sample, x, n,
                                        mine);
            body_is_the_cpus(cases[ci].spec, x, n, mine, body, cpu);
        }
    free(x);
    free(cpu);
    free(mine);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(pack8_matches_bitpack),
        cmocka_unit_test(pair_check_rules),
        cmocka_unit_test(half_conversions),
        cmocka_unit_test(sample_positions_agree),
        cmocka_unit_test(gpu_algorithm_matches_cpu),
        cmocka_unit_test(gpu_exact_algorithm_matches_cpu),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
