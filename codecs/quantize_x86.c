/* AVX2 versions of the two hot quantizer kernels (per-chunk extent; classify
 * + code), picked at run time; they compute exactly what the generic ones do. */
#include "quantize_common.h"

#if EPIPE_Q_X86

#include <immintrin.h>
#include <math.h>
#include <string.h>

#define AVX2_INLINE static inline __attribute__((always_inline, target("avx2")))
#define XB 2048 /* values per L1 block, as in quantize_common.c */

int epipe_q_avx2_usable(void)
{
    return __builtin_cpu_supports("avx2");
}

AVX2_INLINE void extent_k(const float *restrict x, size_t n, const float *restrict bnd, unsigned k,
                          float *restrict lo, float *restrict hi, float *bad)
{
    const __m256 inf = _mm256_set1_ps(INFINITY), ninf = _mm256_set1_ps(-INFINITY);
    const __m256 zero = _mm256_setzero_ps();
    __m256 l[16], h[16], acc = zero;
    for (unsigned j = 0; j < k; j++) {
        l[j] = inf;
        h[j] = ninf;
    }
    size_t n8 = n / 8 * 8;
    for (size_t b = 0; b < n8; b += XB) {
        size_t m = n8 - b < XB ? n8 - b : XB;
        const float *xb = x + b;
        __m256 a = acc, l0 = l[0], hk = h[k - 1];
        for (size_t i = 0; i < m; i += 8) {
            __m256 v = _mm256_loadu_ps(xb + i);
            a = _mm256_add_ps(a, _mm256_mul_ps(v, zero)); /* NaN for NaN or inf */
            l0 = _mm256_min_ps(l0, v);
            hk = _mm256_max_ps(hk, v);
        }
        acc = a;
        l[0] = l0;
        h[k - 1] = hk;
        /* Boundary j: the smallest value >= bnd[j] (chunk j's low end) and
         * the largest below it (chunk j-1's high end), 4 boundaries a sweep. */
        for (unsigned j0 = 1; j0 < k; j0 += 4) {
            unsigned cnt = k - j0 < 4 ? k - j0 : 4;
            __m256 bb[4], ll[4], hh[4];
            for (unsigned t = 0; t < 4; t++) {
                bb[t] = t < cnt ? _mm256_set1_ps(bnd[j0 + t]) : zero;
                ll[t] = t < cnt ? l[j0 + t] : zero;
                hh[t] = t < cnt ? h[j0 + t - 1] : zero;
            }
            for (size_t i = 0; i < m; i += 8) {
                __m256 v = _mm256_loadu_ps(xb + i);
                for (unsigned t = 0; t < cnt; t++) {
                    __m256 ge = _mm256_cmp_ps(v, bb[t], _CMP_GE_OQ);
                    ll[t] = _mm256_min_ps(ll[t], _mm256_blendv_ps(inf, v, ge));
                    hh[t] = _mm256_max_ps(hh[t], _mm256_blendv_ps(v, ninf, ge));
                }
            }
            for (unsigned t = 0; t < cnt; t++) {
                l[j0 + t] = ll[t];
                h[j0 + t - 1] = hh[t];
            }
        }
    }
    float tmp[8];
    for (unsigned j = 0; j < k; j++) {
        _mm256_storeu_ps(tmp, l[j]);
        for (unsigned e = 0; e < 8; e++)
            lo[j] = tmp[e] < lo[j] ? tmp[e] : lo[j];
        _mm256_storeu_ps(tmp, h[j]);
        for (unsigned e = 0; e < 8; e++)
            hi[j] = tmp[e] > hi[j] ? tmp[e] : hi[j];
    }
    _mm256_storeu_ps(tmp, acc);
    for (unsigned e = 0; e < 8; e++)
        *bad += tmp[e];
    for (size_t i = n8; i < n; i++) {
        float v = x[i];
        *bad += v * 0.0f;
        unsigned c = 0;
        for (unsigned j = 1; j < k; j++)
            c += v >= bnd[j];
        lo[c] = v < lo[c] ? v : lo[c];
        hi[c] = v > hi[c] ? v : hi[c];
    }
}

__attribute__((target("avx2"))) int epipe_q_extent_avx2(const float *x, size_t n, const float *bnd,
                                                        unsigned k, float *lo, float *hi,
                                                        float *bad)
{
    switch (k) {
    case 1: extent_k(x, n, bnd, 1, lo, hi, bad); return 1;
    case 2: extent_k(x, n, bnd, 2, lo, hi, bad); return 1;
    case 4: extent_k(x, n, bnd, 4, lo, hi, bad); return 1;
    case 8: extent_k(x, n, bnd, 8, lo, hi, bad); return 1;
    case 16: extent_k(x, n, bnd, 16, lo, hi, bad); return 1;
    }
    return 0;
}

/* The chunk is the count of boundaries <= x; its min and 1/step come from
 * a lane permute of one (k <= 8) or two (k = 16) table registers. Clamping
 * with max/min is the scalar `t > 0 ? t : 0`, `t < L ? t : L` exactly. */
AVX2_INLINE void code_k(const float *restrict x, size_t n, const epipe_qtab *t, unsigned k,
                        uint16_t *restrict code)
{
    __m256 b[16];
    float mt[16] = {0}, it[16] = {0};
    for (unsigned j = 0; j < k; j++) {
        b[j] = _mm256_set1_ps(t->bnd[j]);
        mt[j] = t->min[j];
        it[j] = t->inv[j];
    }
    const __m256 mlo = _mm256_loadu_ps(mt), mhi = _mm256_loadu_ps(mt + 8);
    const __m256 ilo = _mm256_loadu_ps(it), ihi = _mm256_loadu_ps(it + 8);
    const __m256 zero = _mm256_setzero_ps(), half = _mm256_set1_ps(0.5f);
    const __m256 lv = _mm256_set1_ps(t->levels);
    const __m256i seven = _mm256_set1_epi32(7);
    const __m128i q = _mm_cvtsi32_si128((int)t->q);
    /* k = 16 in two levels (boundaries are sorted): the quarter from
     * bnd[4], bnd[8], bnd[12], then the three boundaries inside it, picked
     * by a lane permute of wq[u][quarter] = bnd[4·quarter + u]. */
    __m256 wq[4];
    if (k == 16)
        for (unsigned u = 1; u < 4; u++)
            wq[u] = _mm256_setr_ps(t->bnd[u], t->bnd[4 + u], t->bnd[8 + u], t->bnd[12 + u], 0, 0, 0,
                                   0);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        __m256i c = _mm256_setzero_si256();
        if (k == 16) {
            __m256i qt = c, in = c;
            for (unsigned j = 4; j < 16; j += 4)
                qt = _mm256_sub_epi32(qt, _mm256_castps_si256(_mm256_cmp_ps(v, b[j], _CMP_GE_OQ)));
            for (unsigned u = 1; u < 4; u++)
                in = _mm256_sub_epi32(in, _mm256_castps_si256(_mm256_cmp_ps(
                                              v, _mm256_permutevar8x32_ps(wq[u], qt), _CMP_GE_OQ)));
            c = _mm256_add_epi32(_mm256_slli_epi32(qt, 2), in);
        } else {
            for (unsigned j = 1; j < k; j++)
                c = _mm256_sub_epi32(c, _mm256_castps_si256(_mm256_cmp_ps(v, b[j], _CMP_GE_OQ)));
        }
        __m256 mn = _mm256_permutevar8x32_ps(mlo, c), iv = _mm256_permutevar8x32_ps(ilo, c);
        if (k > 8) {
            __m256 up = _mm256_castsi256_ps(_mm256_cmpgt_epi32(c, seven));
            mn = _mm256_blendv_ps(mn, _mm256_permutevar8x32_ps(mhi, c), up);
            iv = _mm256_blendv_ps(iv, _mm256_permutevar8x32_ps(ihi, c), up);
        }
        __m256 u = _mm256_mul_ps(_mm256_sub_ps(v, mn), iv);
        u = _mm256_min_ps(_mm256_max_ps(u, zero), lv);
        __m256i level = _mm256_cvttps_epi32(_mm256_add_ps(u, half));
        __m256i cd = _mm256_or_si256(_mm256_sll_epi32(c, q), level);
        __m128i p = _mm_packus_epi32(_mm256_castsi256_si128(cd), _mm256_extracti128_si256(cd, 1));
        _mm_storeu_si128((__m128i *)(code + i), p);
    }
    for (; i < n; i++) {
        unsigned c = 0;
        for (unsigned j = 1; j < k; j++)
            c += x[i] >= t->bnd[j];
        code[i] = epipe_q_code(t, x[i], c);
    }
}

__attribute__((target("avx2"))) int epipe_q_code_avx2(const float *x, size_t n, const epipe_qtab *t,
                                                      uint16_t *code)
{
    switch (t->k) {
    case 1: code_k(x, n, t, 1, code); return 1;
    case 2: code_k(x, n, t, 2, code); return 1;
    case 4: code_k(x, n, t, 4, code); return 1;
    case 8: code_k(x, n, t, 8, code); return 1;
    case 16: code_k(x, n, t, 16, code); return 1;
    }
    return 0;
}

#endif
