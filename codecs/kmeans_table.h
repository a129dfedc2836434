/* kmeans's fast assignment and extent (codecs/kmeans_table.c); the codes
 * are exactly the reference's count of midpoints below each value. */
#ifndef EPIPE_CODECS_KMEANS_TABLE_H
#define EPIPE_CODECS_KMEANS_TABLE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* Buckets of the table: the order-preserving key's top 16 bits. */
#define EPIPE_KM_TABLE 65536

/* Fills lut[EPIPE_KM_TABLE] from the k sorted midpoints mid[] (mid[k-1] =
 * +inf): the codes of each bucket's smallest and largest float,
 * lo | hi << 16. */
void epipe_km_build_table(const double *mid, size_t k, uint32_t *lut);
/* The order-preserving key of a float: unsigned order = float order. */
static inline uint32_t epipe_km_key(float v)
{
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    return u >> 31 ? ~u : u | 0x80000000u;
}

/* v's code from the table: the count of midpoints below v, exactly. A
 * bucket holding at most one midpoint (nearly all) needs one comparison
 * and no branch on the value; the others search [lo, hi]. */
static inline unsigned epipe_km_table_code(const uint32_t *lut, const double *mid, float v)
{
    uint32_t e = lut[epipe_km_key(v) >> 16];
    unsigned lo = e & 0xffffu, hi = e >> 16;
    double x = v;
    if (hi - lo < 2)
        return lo + (mid[lo] < x);
    while (lo < hi) { /* the first of mid[lo..hi] that is >= x */
        unsigned m = lo + (hi - lo) / 2;
        if (mid[m] < x)
            lo = m + 1;
        else
            hi = m;
    }
    return lo;
}

/* codes[i] = the number of mid[] below x[i], for finite x[0..m). */
void epipe_km_table_codes(const uint32_t *lut, const double *mid, const float *x, size_t m,
                          uint16_t *codes);
/* The smallest and largest of x[0..n) (n > 0), equal to a sequential scan's
 * (a zero extreme is the first zero seen); *bad becomes NaN when a value is
 * NaN or infinite. */
void epipe_km_extent(const float *restrict x, size_t n, float *lo_out, float *hi_out, float *bad);

#endif
