/* `kmeans:bits=B[,iters=K]`: a 1-D Lloyd-Max (k-means) codebook of 2^B
 * centroids fitted to the tensor; each value is sent as its centroid's code. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../lib/bitpack.h"
#include "../lib/codec/codec_impl.h"
#include "../lib/codec/cuda_api.h"
#include "../lib/parallel.h"
#include "../lib/tensor.h"
#include "inline/kmeans.h"
#include "kmeans_impl.h"

enum { KM_BITS, KM_ITERS };

/* Initial codebooks come from all values when there are at most
 * max(KM_SAMPLE, KM_SAMPLE_PER * 2^B) of them, else from a deterministic
 * sample of exactly that many. */
#define KM_SAMPLE ((size_t)1 << 16)
#define KM_SAMPLE_PER 64
/* Centroid sums are taken per fixed block of values, in value order, and
 * blocks are merged in block order: the result never depends on threads. */
#define KM_BLOCK ((size_t)1 << 16)
/* Blocks handled by one parallel round (bounds the partial-sum memory). */
#define KM_GROUP 16
/* Codes packed or unpacked at a time through a stack buffer (multiple of 8). */
#define KM_CHUNK 4096

static const epipe_param_desc kmeans_params[] = {
    {.key = "bits", .kind = EPIPE_PARAM_INT, .min = 1, .max = 12, .def = 8},
    {.key = "iters", .kind = EPIPE_PARAM_INT, .min = 1, .max = 100, .def = 20},
};

static unsigned km_bits(const epipe_codec *c)
{
    return (unsigned)c->p[KM_BITS];
}

/* Only the width matters to a decoder; iters changes the fit, not the format. */
static uint32_t kmeans_param_word(const epipe_codec *c)
{
    return km_bits(c);
}

static int kmeans_body_size(const epipe_codec *c, uint64_t n, size_t *bytes)
{
    unsigned b = km_bits(c);
    if (n >= (uint64_t)1 << 59)
        return EPIPE_EOVERFLOW;
    uint64_t total = ((uint64_t)4 << b) + (n * b + 7) / 8;
    if (total > SIZE_MAX)
        return EPIPE_EOVERFLOW;
    *bytes = (size_t)total;
    return EPIPE_OK;
}

/* ---- the codebook fit -------------------------------------------------- */

static int cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* Sorts s[0..m) ascending, stably, -0 and +0 equal: the order glibc's
 * qsort (a merge sort) gives with cmp_float, by an LSD radix sort on the
 * order-preserving key (three passes of 11 bits; a pass whose digit is
 * the same everywhere is skipped). Falls back to qsort without memory. */
static void km_sort(float *s, size_t m)
{
    enum { RB = 11, RN = 1 << RB };
    float *tmp = malloc(m * sizeof *tmp);
    size_t *cnt = malloc(RN * sizeof *cnt);
    if (!tmp || !cnt) {
        free(tmp);
        free(cnt);
        qsort(s, m, sizeof *s, cmp_float);
        return;
    }
    float *src = s, *dst = tmp;
    for (unsigned shift = 0; shift < 32; shift += RB) {
        memset(cnt, 0, RN * sizeof *cnt);
        for (size_t i = 0; i < m; i++)
            cnt[(epipe_km_key(src[i] + 0.0f) >> shift) & (RN - 1)]++;
        if (m && cnt[(epipe_km_key(src[0] + 0.0f) >> shift) & (RN - 1)] == m)
            continue; /* one digit everywhere: the order stands */
        size_t sum = 0;
        for (size_t d = 0; d < RN; d++) {
            size_t c = cnt[d];
            cnt[d] = sum;
            sum += c;
        }
        for (size_t i = 0; i < m; i++)
            dst[cnt[(epipe_km_key(src[i] + 0.0f) >> shift) & (RN - 1)]++] = src[i];
        float *t = src;
        src = dst, dst = t;
    }
    if (src != s)
        memcpy(s, src, m * sizeof *s);
    free(tmp);
    free(cnt);
}

/* The sample size: all n values up to M = max(KM_SAMPLE, KM_SAMPLE_PER * k). */
static size_t km_sample_size(size_t n, size_t k)
{
    size_t m = KM_SAMPLE_PER * k > KM_SAMPLE ? KM_SAMPLE_PER * k : KM_SAMPLE;
    return n < m ? n : m;
}

/* The gathered sample sorted, its ends set to the extremes. */
static void km_sample_finish(float *s, size_t m, float lo, float hi)
{
    km_sort(s, m);
    s[0] = lo;
    s[m - 1] = hi;
}

/* The sample the initial codebooks are built from, sorted: all values for
 * n <= M, else one value at a hashed position inside each of M equal
 * strides (deterministic, and blind to periodic layouts such as channels),
 * with its ends replaced by the true minimum and maximum so that no
 * candidate leaves the tails uncovered. */
static float *km_sample(const float *x, size_t n, size_t k, float lo, float hi, size_t *m_out)
{
    size_t m = km_sample_size(n, k);
    float *s = malloc(m * sizeof *s);
    if (!s)
        return NULL;
    if (m == n)
        memcpy(s, x, n * sizeof *s);
    else
        for (size_t i = 0; i < m; i++)
            s[i] = x[epipe_hd_km_sample_at(i, n, m)];
    km_sample_finish(s, m, lo, hi);
    *m_out = m;
    return s;
}

static void km_make_sorted(float *cent, size_t k)
{
    for (size_t j = 1; j < k; j++)
        if (cent[j] < cent[j - 1])
            cent[j] = cent[j - 1];
}

/* Candidate 1, equal-count quantiles: centroid j is the mean of the j-th of
 * k equal chunks of the sorted sample (its middle value when the sample is
 * smaller than k). Exact for data with at most k distinct values. */
static void km_init_quantiles(const float *s, size_t m, float *cent, size_t k)
{
    for (size_t j = 0; j < k; j++) {
        size_t lo = j * m / k, hi = (j + 1) * m / k;
        if (lo == hi) {
            cent[j] = s[(2 * j + 1) * m / (2 * k)];
            continue;
        }
        double sum = 0;
        for (size_t i = lo; i < hi; i++)
            sum += s[i];
        float v = (float)(sum / (double)(hi - lo));
        cent[j] = v < s[lo] ? s[lo] : v > s[hi - 1] ? s[hi - 1] : v;
    }
    km_make_sorted(cent, k);
}

/* Candidate 2, the Panter-Dite point density: for many levels the optimal
 * centroids are equal-count quantiles of f^(1/3), f the density. Between
 * neighbouring sample values f is about 1/(m L), L their distance, so that
 * gap holds f^(1/3) mass proportional to L^(2/3). Single gaps fit the
 * tails better than wider segments (measured); their noise averages out
 * over the gaps of a cell (64 once n is sampled). Needs w[m] scratch;
 * returns 0 when the sample has no spread. */
static int km_init_panter_dite(const float *s, size_t m, float *cent, size_t k, double *w)
{
    if (m < 2 || s[m - 1] == s[0])
        return 0;
    double total = 0;
    for (size_t i = 0; i + 1 < m; i++) {
        double gap = (double)s[i + 1] - (double)s[i];
        w[i] = cbrt(gap * gap);
        total += w[i];
    }
    double acc = 0;
    size_t i = 0, j = 0;
    while (j < k) {
        double target = ((double)j + 0.5) / (double)k * total;
        if (acc + w[i] < target && i + 2 < m) {
            acc += w[i++];
            continue;
        }
        double f = w[i] > 0 ? (target - acc) / w[i] : 0;
        f = f < 0 ? 0 : f > 1 ? 1 : f;
        cent[j++] = (float)((double)s[i] + f * ((double)s[i + 1] - (double)s[i]));
    }
    km_make_sorted(cent, k);
    return 1;
}

/* Candidate 3, the uniform grid on [min, max] of all values: the levels of
 * `quant:bits=B`, so Lloyd's monotone descent from it never does worse. */
static void km_init_uniform(float lo, float hi, float *cent, size_t k)
{
    double step = ((double)hi - (double)lo) / (double)(k - 1);
    for (size_t j = 0; j < k; j++)
        cent[j] = j + 1 == k ? hi : (float)((double)lo + step * (double)j);
    km_make_sorted(cent, k);
}

/* Starting codebook `which` (0: quantiles, 1: Panter-Dite, 2: uniform)
 * into cand; 0 when it does not apply (Panter-Dite on a sample with no
 * spread). */
static int km_start(int which, const float *s, size_t m, float lo, float hi, float *cand, size_t k,
                    double *w)
{
    if (which == 1)
        return km_init_panter_dite(s, m, cand, k, w);
    if (which == 0)
        km_init_quantiles(s, m, cand, k);
    else
        km_init_uniform(lo, hi, cand, k);
    return 1;
}

/* One block's member sums and counts per centroid and its squared error,
 * accumulated in value order. */
static double km_block_sums(const float *x, size_t b, size_t e, const float *cent,
                            const double *mid, size_t k, int ref, double *sum, uint32_t *cnt)
{
    double sq = 0;
    memset(sum, 0, k * sizeof *sum);
    memset(cnt, 0, k * sizeof *cnt);
    for (size_t i = b; i < e; i++) {
        unsigned j = ref ? epipe_km_code_ref(mid, k, x[i]) : epipe_hd_km_code(mid, k, x[i]);
        double d = (double)x[i] - (double)cent[j];
        sum[j] += x[i];
        cnt[j]++;
        sq += d * d;
    }
    return sq;
}

/* New centroid = mean of its members; an empty cluster keeps its value. */
static int km_update(float *cent, size_t k, const double *tsum, const uint64_t *tcnt)
{
    int changed = 0;
    for (size_t j = 0; j < k; j++) {
        float v = tcnt[j] ? (float)(tsum[j] / (double)tcnt[j]) : cent[j];
        if (j && v < cent[j - 1])
            v = cent[j - 1]; /* keeps the table sorted against rounding */
        changed |= memcmp(&v, &cent[j], sizeof v) != 0;
        cent[j] = v;
    }
    return changed;
}

typedef struct km_job {
    const float *x;
    size_t n, k;
    unsigned bits;
    const float *cent;
    const double *mid;
    const uint32_t *lut;    /* final pass: code bounds per key bucket, or NULL */
    size_t block0, nblocks; /* this round's blocks */
    double *psum;           /* [KM_GROUP][k] */
    uint32_t *pcnt;         /* [KM_GROUP][k] */
    double *psq;            /* [KM_GROUP] */
    uint8_t *codes_out;     /* final pass: the packed codes */
    const uint8_t *codes_in;
    float *y;
} km_job;

static void km_sums_task(void *ctx, unsigned t, unsigned nt)
{
    km_job *j = ctx;
    size_t lo, hi;
    epipe_split_range(j->nblocks, nt, t, 1, &lo, &hi);
    for (size_t bl = lo; bl < hi; bl++) {
        size_t b = (j->block0 + bl) * KM_BLOCK, e = b + KM_BLOCK < j->n ? b + KM_BLOCK : j->n;
        j->psq[bl] = km_block_sums(j->x, b, e, j->cent, j->mid, j->k, 0, j->psum + bl * j->k,
                                   j->pcnt + bl * j->k);
    }
}

static void km_pack_range(const float *x, size_t b, size_t e, const double *mid, size_t k,
                          const uint32_t *lut, unsigned bits, int ref, uint8_t *out)
{
    uint16_t codes[KM_CHUNK];
    for (size_t s = b; s < e; s += KM_CHUNK) {
        size_t m = e - s < KM_CHUNK ? e - s : KM_CHUNK;
        if (ref)
            for (size_t i = 0; i < m; i++)
                codes[i] = (uint16_t)epipe_km_code_ref(mid, k, x[s + i]);
        else if (lut)
            epipe_km_table_codes(lut, mid, x + s, m, codes);
        else
            for (size_t i = 0; i < m; i++)
                codes[i] = (uint16_t)epipe_hd_km_code(mid, k, x[s + i]);
        if (ref)
            epipe_bitpack_ref(codes, m, bits, out + s / 8 * bits);
        else
            epipe_bitpack(codes, m, bits, out + s / 8 * bits);
    }
}

static void km_pack_task(void *ctx, unsigned t, unsigned nt)
{
    km_job *j = ctx;
    size_t b, e;
    epipe_split_range(j->n, nt, t, KM_CHUNK, &b, &e);
    km_pack_range(j->x, b, e, j->mid, j->k, j->lut, j->bits, 0, j->codes_out);
}

/* Everything one fit needs, allocated once per encode. */
typedef struct km_fit {
    const float *x;
    size_t n, k;
    int ref;
    unsigned workers;
    size_t group;
    double *mid, *tsum, *psum, *psq;
    uint64_t *tcnt;
    uint32_t *pcnt;
} km_fit;

/* One assignment pass over all values for the codebook cent: the members'
 * sums and counts per centroid into f->tsum/tcnt, and the total squared
 * error returned. Per-block partials are merged in block order, so the
 * result is the same for every thread count and for the reference. */
static double km_pass(km_fit *f, const float *cent)
{
    size_t n = f->n, k = f->k, nblocks = (n + KM_BLOCK - 1) / KM_BLOCK;
    double sq = 0;
    epipe_km_midpoints(cent, k, f->mid);
    memset(f->tsum, 0, k * sizeof *f->tsum);
    memset(f->tcnt, 0, k * sizeof *f->tcnt);
    for (size_t g = 0; g < nblocks; g += f->group) {
        size_t nb = nblocks - g < f->group ? nblocks - g : f->group;
        if (f->ref) {
            size_t b = g * KM_BLOCK, e = b + KM_BLOCK < n ? b + KM_BLOCK : n;
            f->psq[0] = km_block_sums(f->x, b, e, cent, f->mid, k, 1, f->psum, f->pcnt);
        } else {
            km_job job = {.x = f->x,
                          .n = n,
                          .k = k,
                          .cent = cent,
                          .mid = f->mid,
                          .block0 = g,
                          .nblocks = nb,
                          .psum = f->psum,
                          .pcnt = f->pcnt,
                          .psq = f->psq};
            unsigned nt = f->workers < nb ? f->workers : (unsigned)nb;
            if (nt > 1)
                epipe_parallel_run(nt, km_sums_task, &job);
            else
                km_sums_task(&job, 0, 1);
        }
        for (size_t bl = 0; bl < nb; bl++) { /* block order, always */
            for (size_t j = 0; j < k; j++) {
                f->tsum[j] += f->psum[bl * k + j];
                f->tcnt[j] += f->pcnt[bl * k + j];
            }
            sq += f->psq[bl];
        }
    }
    return sq;
}

/* The sampled fit (n > M, so m >= 65536): the starts scored and Lloyd
 * iterated on the weighted fit set of the sample and the t tails. */
static int km_fit_weighted(km_fit *f, unsigned iters, const float *s, size_t m, float *tails,
                           size_t t, double *w, float lo, float hi, float *cand, float *cent)
{
    size_t k = f->k;
    float *fx = NULL;
    double *fw = NULL;
    size_t nf = epipe_km_fit_set(tails, t, f->n, s, m, &fx, &fw);
    if (nf == SIZE_MAX)
        return EPIPE_ENOMEM;
    double *tw = malloc(k * sizeof *tw), *bsum = malloc(k * sizeof *bsum);
    double *bw = malloc(k * sizeof *bw);
    int rc = EPIPE_OK;
    if (!tw || !bsum || !bw) {
        rc = EPIPE_ENOMEM;
    } else {
        double best = INFINITY;
        for (int which = 0; which < 3; which++) {
            if (!km_start(which, s, m, lo, hi, cand, k, w))
                continue;
            double sq = epipe_km_wpass(fx, fw, nf, cand, f->mid, k, f->ref, f->tsum, tw);
            if (sq < best) {
                best = sq;
                memcpy(cent, cand, k * sizeof *cent);
                memcpy(bsum, f->tsum, k * sizeof *bsum);
                memcpy(bw, tw, k * sizeof *bw);
            }
        }
        for (unsigned it = 0; it < iters; it++) {
            if (!epipe_km_wupdate(cent, k, bsum, bw))
                break;
            if (it + 1 < iters)
                epipe_km_wpass(fx, fw, nf, cent, f->mid, k, f->ref, bsum, bw);
        }
    }
    free(fx);
    free(fw);
    free(tw);
    free(bsum);
    free(bw);
    return rc;
}

/* Fits the codebook into cent[0..k) from the sorted sample s[0..m) of the
 * n values (ends set to lo and hi, the extremes of all values): the best of
 * the candidate starts (by squared error; the first wins a tie), then
 * Lloyd iterations, stopping early at a fixed point. Up to M values
 * (m == n) the fit runs on all of them (f->x); above, on the weighted fit
 * set of the sample and the t tails, which makes the fit's cost
 * independent of n. */
static int km_fit_sample(km_fit *f, unsigned iters, float lo, float hi, const float *s, size_t m,
                         float *tails, size_t t, float *cent)
{
    size_t k = f->k;
    double *w = malloc((m ? m : 1) * sizeof *w);
    float *cand = malloc(k * sizeof *cand);
    double *bsum = malloc(k * sizeof *bsum);
    uint64_t *bcnt = malloc(k * sizeof *bcnt);
    int rc = EPIPE_OK;
    if (!w || !cand || !bsum || !bcnt) {
        rc = EPIPE_ENOMEM;
    } else if (m < f->n) {
        rc = km_fit_weighted(f, iters, s, m, tails, t, w, lo, hi, cand, cent);
    } else {
        double best = INFINITY;
        for (int which = 0; which < 3; which++) {
            if (!km_start(which, s, m, lo, hi, cand, k, w))
                continue;
            double sq = km_pass(f, cand);
            if (sq < best) {
                best = sq;
                memcpy(cent, cand, k * sizeof *cent);
                memcpy(bsum, f->tsum, k * sizeof *bsum);
                memcpy(bcnt, f->tcnt, k * sizeof *bcnt);
            }
        }
        memcpy(f->tsum, bsum, k * sizeof *bsum);
        memcpy(f->tcnt, bcnt, k * sizeof *bcnt);
        for (unsigned it = 0; it < iters; it++) {
            if (!km_update(cent, k, f->tsum, f->tcnt))
                break; /* a fixed point: further iterations change nothing */
            if (it + 1 < iters)
                km_pass(f, cent);
        }
    }
    free(w);
    free(cand);
    free(bsum);
    free(bcnt);
    return rc;
}

/* The CPU's own sample and tails of f->x, then the fit. */
static int km_fit_codebook(km_fit *f, unsigned iters, float lo, float hi, float *cent)
{
    size_t m = 0, t = 0;
    float *s = km_sample(f->x, f->n, f->k, lo, hi, &m), *tails = NULL;
    if (!s)
        return EPIPE_ENOMEM;
    int rc = EPIPE_OK;
    if (m < f->n && (t = epipe_km_tails(f->x, f->n, s, m, &tails)) == SIZE_MAX)
        rc = EPIPE_ENOMEM;
    else
        rc = km_fit_sample(f, iters, lo, hi, s, m, tails, t, cent);
    free(s);
    free(tails);
    return rc;
}

/* The codebook of an encode of n values into cent[k] (zeros for n = 0)
 * and its midpoints into mid[k]: from x itself (s NULL), or, for the CUDA
 * module, from the sorted sample s[0..m) and the t tails it gathered on
 * the device (m < n; x NULL). */
static int km_codebook(epipe_codec *c, const float *x, size_t n, float lo, float hi, const float *s,
                       size_t m, float *tails, size_t t, int ref, float *cent, double *mid)
{
    size_t k = (size_t)1 << km_bits(c);
    km_fit f = {.x = x,
                .n = n,
                .k = k,
                .ref = ref,
                .workers = ref ? 1 : epipe_codec_workers(c, n),
                .group = ref ? 1 : KM_GROUP,
                .mid = mid};
    f.tsum = malloc(k * sizeof *f.tsum);
    f.tcnt = malloc(k * sizeof *f.tcnt);
    f.psum = malloc(f.group * k * sizeof *f.psum);
    f.pcnt = malloc(f.group * k * sizeof *f.pcnt);
    f.psq = malloc(f.group * sizeof *f.psq);
    int rc = EPIPE_ENOMEM;
    memset(cent, 0, k * sizeof *cent);
    if (f.tsum && f.tcnt && f.psum && f.pcnt && f.psq) {
        unsigned iters = (unsigned)c->p[KM_ITERS];
        rc = !n  ? EPIPE_OK
             : s ? km_fit_sample(&f, iters, lo, hi, s, m, tails, t, cent)
                 : km_fit_codebook(&f, iters, lo, hi, cent);
    }
    free(f.tsum);
    free(f.tcnt);
    free(f.psum);
    free(f.pcnt);
    free(f.psq);
    if (rc == EPIPE_ENOMEM)
        return epipe_codec_fail(c, rc, "kmeans: out of memory for a %zu-entry codebook", k);
    epipe_km_midpoints(cent, k, mid);
    return rc;
}

/* The extent of x[0..n) as the encoder takes it; EPIPE_EINVAL naming the
 * first value that is not finite. */
static int km_extent(epipe_codec *c, const float *x, size_t n, float *lo, float *hi)
{
    float bad = 0.0f;
    *lo = *hi = 0.0f;
    if (n)
        epipe_km_extent(x, n, lo, hi, &bad);
    if (isnan(bad)) {
        size_t at = epipe_find_nonfinite(x, n);
        return epipe_codec_fail(c, EPIPE_EINVAL, "kmeans: value at index %zu is not finite (%g)",
                                at, (double)x[at]);
    }
    return EPIPE_OK;
}

static int km_encode_impl(epipe_codec *c, const float *x, size_t n, uint8_t *body, int ref)
{
    unsigned bits = km_bits(c);
    size_t k = (size_t)1 << bits;
    float lo, hi;
    int rc = km_extent(c, x, n, &lo, &hi);
    if (rc)
        return rc;
    float *cent = malloc(k * sizeof *cent);
    double *mid = malloc(k * sizeof *mid);
    /* The table pays for itself from about 2^16 values; without memory for
     * it the binary search gives the same codes. */
    uint32_t *lut = !ref && n >= EPIPE_KM_TABLE ? malloc(EPIPE_KM_TABLE * sizeof *lut) : NULL;
    if (!cent || !mid) {
        rc = epipe_codec_fail(c, EPIPE_ENOMEM, "kmeans: out of memory for a %zu-entry codebook", k);
        goto out;
    }
    if ((rc = km_codebook(c, x, n, lo, hi, NULL, 0, NULL, 0, ref, cent, mid)))
        goto out;
    for (size_t j = 0; j < k; j++)
        epipe_put_f32(body + 4 * j, cent[j]);
    uint8_t *codes = body + 4 * k;
    if (ref) {
        km_pack_range(x, 0, n, mid, k, NULL, bits, 1, codes);
    } else {
        if (lut)
            epipe_km_build_table(mid, k, lut);
        km_job job = {
            .x = x, .n = n, .k = k, .bits = bits, .mid = mid, .lut = lut, .codes_out = codes};
        unsigned workers = epipe_codec_workers(c, n);
        if (workers > 1)
            epipe_parallel_run(workers, km_pack_task, &job);
        else
            km_pack_task(&job, 0, 1);
    }
out:
    free(cent);
    free(mid);
    free(lut);
    return rc;
}

static int kmeans_encode(epipe_codec *c, const float *x, size_t n, uint8_t *body)
{
    return km_encode_impl(c, x, n, body, 0);
}

static int kmeans_encode_ref(epipe_codec *c, const float *x, size_t n, uint8_t *body)
{
    return km_encode_impl(c, x, n, body, 1);
}

/* ---- decode ------------------------------------------------------------ */

static void km_unpack_range(const uint8_t *in, size_t b, size_t e, const float *cent, unsigned bits,
                            int ref, float *y)
{
    uint16_t codes[KM_CHUNK];
    for (size_t s = b; s < e; s += KM_CHUNK) {
        size_t m = e - s < KM_CHUNK ? e - s : KM_CHUNK;
        if (!ref) {
            epipe_bitunpack_lut(in + s / 8 * bits, m, bits, cent, y + s);
            continue;
        }
        epipe_bitunpack_ref(in + s / 8 * bits, m, bits, codes);
        for (size_t i = 0; i < m; i++)
            y[s + i] = cent[codes[i]]; /* codes < 2^bits by construction */
    }
}

static void km_unpack_task(void *ctx, unsigned t, unsigned nt)
{
    km_job *j = ctx;
    size_t b, e;
    epipe_split_range(j->n, nt, t, KM_CHUNK, &b, &e);
    km_unpack_range(j->codes_in, b, e, j->cent, j->bits, 0, j->y);
}

/* The decoder's checks of a body of n codes, with their messages: 2^bits
 * finite centroids in ascending order (into cent) and zero padding bits. */
int epipe_km_read_table(epipe_codec *c, const uint8_t *body, size_t n, float *cent)
{
    unsigned bits = km_bits(c);
    size_t k = (size_t)1 << bits;
    for (size_t j = 0; j < k; j++) {
        cent[j] = epipe_get_f32(body + 4 * j);
        if (!isfinite(cent[j]))
            return epipe_codec_fail(c, EPIPE_EPROTO, "kmeans: centroid %zu is not finite", j);
        if (j && cent[j] < cent[j - 1])
            return epipe_codec_fail(c, EPIPE_EPROTO,
                                    "kmeans: centroids are not sorted (%zu: %g < %g)", j,
                                    (double)cent[j], (double)cent[j - 1]);
    }
    if (!epipe_bitpack_tail_clean(body + 4 * k, n, bits))
        return epipe_codec_fail(c, EPIPE_EPROTO, "kmeans: padding bits after code %zu are not zero",
                                n ? n - 1 : 0);
    return EPIPE_OK;
}

static int km_decode_impl(epipe_codec *c, const uint8_t *body, size_t n, float *y, int ref)
{
    unsigned bits = km_bits(c);
    size_t k = (size_t)1 << bits;
    float cent[1u << 12];
    int rc = epipe_km_read_table(c, body, n, cent);
    if (rc)
        return rc;
    const uint8_t *codes = body + 4 * k;
    unsigned workers = ref ? 1 : epipe_codec_workers(c, n);
    if (workers > 1) {
        km_job job = {.n = n, .bits = bits, .cent = cent, .codes_in = codes, .y = y};
        epipe_parallel_run(workers, km_unpack_task, &job);
    } else {
        km_unpack_range(codes, 0, n, cent, bits, ref, y);
    }
    return EPIPE_OK;
}

static int kmeans_decode(epipe_codec *c, const uint8_t *body, size_t n, float *y)
{
    return km_decode_impl(c, body, n, y, 0);
}

static int kmeans_decode_ref(epipe_codec *c, const uint8_t *body, size_t n, float *y)
{
    return km_decode_impl(c, body, n, y, 1);
}

/* ---- the CUDA module's host part (cuda/kmeans.cu) ---------------------- */

size_t epipe_km_cuda_sample_size(const epipe_codec *c, size_t n)
{
    return km_sample_size(n, (size_t)1 << km_bits(c));
}

void epipe_km_cuda_sample_finish(float *s, size_t m, float lo, float hi, float *a, float *b)
{
    km_sample_finish(s, m, lo, hi);
    *a = s[EPIPE_KM_TAIL_RANKS];
    *b = s[m - 1 - EPIPE_KM_TAIL_RANKS];
}

int epipe_km_cuda_fit(epipe_codec *c, const float *x, size_t n, float lo, float hi, const float *s,
                      size_t m, float *tails, size_t t, uint8_t *body, double *mid)
{
    size_t k = (size_t)1 << km_bits(c);
    float cent[1u << 12];
    int rc = x ? km_extent(c, x, n, &lo, &hi) : EPIPE_OK;
    if (rc || (rc = km_codebook(c, x, n, lo, hi, x ? NULL : s, m, tails, t, 0, cent, mid)))
        return rc;
    for (size_t j = 0; j < k; j++)
        epipe_put_f32(body + 4 * j, cent[j]);
    return EPIPE_OK;
}

static const epipe_codec_backend kmeans_cpu = {
    .encode = kmeans_encode,
    .decode = kmeans_decode,
    .encode_ref = kmeans_encode_ref,
    .decode_ref = kmeans_decode_ref,
};

const epipe_codec_ops epipe_codec_kmeans = {
    .name = "kmeans",
    .id = EPIPE_CODEC_ID_KMEANS,
    .params = kmeans_params,
    .nparams = 2,
    .param_word = kmeans_param_word,
    .body_size = kmeans_body_size,
    .cpu = &kmeans_cpu,
};
