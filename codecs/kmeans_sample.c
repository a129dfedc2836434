/* kmeans above M values: the weighted fit set (the sorted sample's middle
 * plus every tail value of the tensor) and Lloyd passes over it. */
#include <stdlib.h>
#include <string.h>

#include "kmeans_impl.h"

static int cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* ---- the weighted fit set of a sampled tensor -------------------------
 * Above M values the fit runs on the sorted sample's middle, each value
 * standing for (n - T) / (M - 2R) values, plus the T values of the tensor
 * below the sample's R-th smallest or above its R-th largest, exactly and
 * with weight 1: a heavy tail's few large values, which the squared error
 * is most sensitive to, are all seen. */

/* Appends v to the growing array *buf (*len of *cap used); 0 without memory. */
static int km_push(float **buf, size_t *len, size_t *cap, float v)
{
    if (*len == *cap) {
        size_t c = *cap ? 2 * *cap : 4096;
        float *p = realloc(*buf, c * sizeof *p);
        if (!p)
            return 0;
        *buf = p;
        *cap = c;
    }
    (*buf)[(*len)++] = v;
    return 1;
}

/* The values of x[0..n) below a or above b, in index order, into a
 * malloc'ed *out (expected about 2R n/M of them; at most n); their count,
 * or SIZE_MAX without memory. */
static size_t km_tails(const float *restrict x, size_t n, float a, float b, float **out)
{
    size_t t = 0, cap = 0, i = 0;
    float *buf = NULL;
    for (; i < n; i += 16) {
        size_t e = n - i < 16 ? n : i + 16;
        if (e - i == 16) { /* most blocks hold no tail value */
            unsigned any = 0;
            for (unsigned l = 0; l < 16; l++)
                any |= (x[i + l] < a) | (x[i + l] > b);
            if (!any)
                continue;
        }
        for (size_t j = i; j < e; j++)
            if ((x[j] < a || x[j] > b) && !km_push(&buf, &t, &cap, x[j])) {
                free(buf);
                return SIZE_MAX;
            }
    }
    *out = buf;
    return t;
}

/* One weighted assignment pass over the ascending fit set (fx, fw): sums
 * and weights per centroid, and the weighted squared error. */
double epipe_km_wpass(const float *fx, const double *fw, size_t nf, const float *cent, double *mid,
                      size_t k, int ref, double *tsum, double *tw)
{
    epipe_km_midpoints(cent, k, mid);
    memset(tsum, 0, k * sizeof *tsum);
    memset(tw, 0, k * sizeof *tw);
    double sq = 0;
    unsigned walk = 0;
    for (size_t i = 0; i < nf; i++) {
        unsigned j;
        if (ref) {
            j = epipe_km_code_ref(mid, k, fx[i]);
        } else {
            while (mid[walk] < (double)fx[i])
                walk++;
            j = walk;
        }
        double d = (double)fx[i] - (double)cent[j];
        tsum[j] += fw[i] * fx[i];
        tw[j] += fw[i];
        sq += fw[i] * d * d;
    }
    return sq;
}

/* New centroid = weighted mean of its members (as kmeans.c's km_update). */
int epipe_km_wupdate(float *cent, size_t k, const double *tsum, const double *tw)
{
    int changed = 0;
    for (size_t j = 0; j < k; j++) {
        float v = tw[j] > 0 ? (float)(tsum[j] / tw[j]) : cent[j];
        if (j && v < cent[j - 1])
            v = cent[j - 1];
        changed |= memcmp(&v, &cent[j], sizeof v) != 0;
        cent[j] = v;
    }
    return changed;
}

/* The middle sample values in order, each of weight (n - T) / (m - 2R),
 * with the sorted low tail before them and the high tail after. */
size_t epipe_km_tails(const float *x, size_t n, const float *s, size_t m, float **out)
{
    size_t r = EPIPE_KM_TAIL_RANKS;
    return km_tails(x, n, s[r], s[m - 1 - r], out);
}

size_t epipe_km_fit_set(float *tails, size_t t, size_t n, const float *s, size_t m, float **fx_out,
                        double **fw_out)
{
    size_t r = EPIPE_KM_TAIL_RANKS;
    float a = s[r];
    if (t)
        qsort(tails, t, sizeof *tails, cmp_float);
    size_t mid_n = m - 2 * r, nf = t + mid_n;
    float *fx = malloc(nf * sizeof *fx);
    double *fw = malloc(nf * sizeof *fw);
    if (!fx || !fw) {
        free(fx);
        free(fw);
        return SIZE_MAX;
    }
    double w = (double)(n - t) / (double)mid_n;
    size_t lo_t = 0, o = 0;
    while (lo_t < t && tails[lo_t] < a) { /* the low tail, then the middle, then the high tail */
        fx[o] = tails[lo_t++];
        fw[o++] = 1.0;
    }
    for (size_t i = r; i < m - r; i++) {
        fx[o] = s[i];
        fw[o++] = w;
    }
    for (; lo_t < t; lo_t++) {
        fx[o] = tails[lo_t];
        fw[o++] = 1.0;
    }
    *fx_out = fx;
    *fw_out = fw;
    return nf;
}
