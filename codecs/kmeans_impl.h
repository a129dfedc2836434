/* kmeans internals shared by its files: midpoints and the reference code,
 * the fast assignment table and extent (kmeans_table.c), the weighted fit
 * set of sampled tensors (kmeans_sample.c). */
#ifndef EPIPE_CODECS_KMEANS_IMPL_H
#define EPIPE_CODECS_KMEANS_IMPL_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* Decision boundaries: mid[j] is halfway between centroids j and j+1 (exact
 * in double); mid[k-1] = +inf. A value's code is the number of mid[] below
 * it: its nearest centroid, ties going to the lower one. */
static inline void epipe_km_midpoints(const float *cent, size_t k, double *mid)
{
    for (size_t j = 0; j + 1 < k; j++)
        mid[j] = ((double)cent[j] + (double)cent[j + 1]) * 0.5;
    mid[k - 1] = INFINITY;
}

/* The reference: count the boundaries below v one by one. */
static inline unsigned epipe_km_code_ref(const double *mid, size_t k, float v)
{
    unsigned code = 0;
    for (size_t j = 0; j < k; j++)
        code += mid[j] < (double)v;
    return code;
}

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

/* Sorted-sample ranks left out at each end of the fit set's middle. */
#define EPIPE_KM_TAIL_RANKS 64
/* The tails of x[0..n) for its sorted sample s[0..m) (m > 2 *
 * EPIPE_KM_TAIL_RANKS): the values below s[R] or above s[m-1-R], in index
 * order, into a malloc'ed *out; their count, or SIZE_MAX without memory. */
size_t epipe_km_tails(const float *x, size_t n, const float *s, size_t m, float **out);
/* The ascending fit set of n values from their sorted sample s[0..m) and
 * their t tails (index order; sorted here, in place), malloc'ed into *fx
 * and *fw; its size, or SIZE_MAX without memory. */
size_t epipe_km_fit_set(float *tails, size_t t, size_t n, const float *s, size_t m, float **fx,
                        double **fw);
/* One weighted pass over the fit set for the codebook cent: sums and
 * weights per centroid into tsum, tw; the weighted squared error. ref
 * finds codes by the linear count, else by a merge walk (same codes). */
double epipe_km_wpass(const float *fx, const double *fw, size_t nf, const float *cent, double *mid,
                      size_t k, int ref, double *tsum, double *tw);
/* Each centroid becomes its members' weighted mean; 1 if any changed. */
int epipe_km_wupdate(float *cent, size_t k, const double *tsum, const double *tw);

#endif
