/* kmeans's fast assignment and extent: the 2^16-bucket table of code
 * bounds for the final pass, and the one-pass extremes of a tensor. */
#include "kmeans_impl.h"

#include <math.h>
#include <string.h>

/* The float whose order-preserving key is `key`. */
static inline float km_unkey(uint32_t key)
{
    uint32_t u = key >> 31 ? key & 0x7fffffffu : ~key;
    float v;
    memcpy(&v, &u, sizeof v);
    return v;
}

/* The final assignment's table: for each of the 2^16 buckets of the
 * order-preserving key's top 16 bits, the codes of the bucket's smallest
 * and largest float (lo | hi << 16). Codes grow with the value, so every
 * value of a bucket has a code in [lo, hi]; most buckets lie inside one
 * cell (lo == hi). Built by walking buckets and midpoints together. */
void epipe_km_build_table(const double *mid, size_t k, uint32_t *lut)
{
    /* Keys below 0x00800000 are -inf and negative NaNs, above 0xff7fffff
     * +inf and NaNs: no finite value falls there. */
    unsigned lo = 0, hi = 0;
    for (uint32_t b = 0; b < EPIPE_KM_TABLE; b++) {
        if (b < 0x0080u || b > 0xff7fu) {
            lut[b] = (uint32_t)(k - 1) << 16;
            continue;
        }
        double first = km_unkey(b << 16), last = km_unkey(b << 16 | 0xffffu);
        while (mid[lo] < first)
            lo++;
        if (hi < lo)
            hi = lo;
        while (mid[hi] < last)
            hi++;
        lut[b] = lo | (uint32_t)hi << 16;
    }
}

void epipe_km_table_codes(const uint32_t *lut, const double *mid, const float *x, size_t m,
                          uint16_t *codes)
{
    for (size_t i = 0; i < m; i++)
        codes[i] = (uint16_t)epipe_km_table_code(lut, mid, x[i]);
}

/* Extremes of x[0..n) (n > 0) in one vector pass; *bad becomes NaN when a
 * value is NaN or infinite. The result is the sequential scan's (the first
 * of equal extremes), so a zero extreme takes the sign of the first zero. */
typedef float km_v4 __attribute__((vector_size(16)));
typedef int32_t km_v4i __attribute__((vector_size(16)));
#define KM_SEL(m, a, b) ((km_v4)((((km_v4i)(a)) & (m)) | (((km_v4i)(b)) & ~(m))))

void epipe_km_extent(const float *restrict x, size_t n, float *lo_out, float *hi_out, float *bad)
{
    float lo = x[0], hi = x[0], acc = 0.0f;
    size_t i = 0;
    if (n >= 8) {
        km_v4 l0, l1, h0, h1, a0 = {0}, a1 = {0};
        memcpy(&l0, x, sizeof l0);
        l1 = h0 = h1 = l0;
        for (; i + 8 <= n; i += 8) {
            km_v4 u, v;
            memcpy(&u, x + i, sizeof u);
            memcpy(&v, x + i + 4, sizeof v);
            a0 += u * 0.0f;
            a1 += v * 0.0f;
            l0 = KM_SEL(u < l0, u, l0);
            l1 = KM_SEL(v < l1, v, l1);
            h0 = KM_SEL(u > h0, u, h0);
            h1 = KM_SEL(v > h1, v, h1);
        }
        for (unsigned e = 0; e < 4; e++) {
            lo = l0[e] < lo ? l0[e] : lo;
            lo = l1[e] < lo ? l1[e] : lo;
            hi = h0[e] > hi ? h0[e] : hi;
            hi = h1[e] > hi ? h1[e] : hi;
            acc += a0[e] + a1[e];
        }
    }
    for (; i < n; i++) {
        lo = x[i] < lo ? x[i] : lo;
        hi = x[i] > hi ? x[i] : hi;
        acc += x[i] * 0.0f;
    }
    if ((lo == 0.0f || hi == 0.0f) && !isnan(acc)) {
        for (i = 0; x[i] != 0.0f; i++)
            ;
        lo = lo == 0.0f ? x[i] : lo;
        hi = hi == 0.0f ? x[i] : hi;
    }
    *lo_out = lo;
    *hi_out = hi;
    *bad = acc;
}
