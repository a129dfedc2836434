/* sortquant mode=fit: the boundary fit (bins of a sample histogram, then a
 * dynamic programme over them), the fast encoder and the payload check. */
#include "fit.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../../lib/bitpack.h"
#include "../../lib/codec/cuda_api.h"
#include "sortquant.h"

/* Buckets are merged into bins of at most 1/BIN_DIV of the sample's count
 * and of its range, so the programme runs over at most about 3·BIN_DIV bins
 * whatever the distribution (a bucket alone may exceed the count limit:
 * the zeros after a ReLU are one bin of width ~0). */
#define BIN_DIV 256

struct dp {
    const double *edge; /* [B + 1]: bin i spans [edge[i], edge[i + 1]) */
    const double *cum;  /* [B + 1]: sample values before bin i */
    const double *prev;
    double *cur;
    uint32_t *opt; /* start bin of the last chunk, per end bin */
};

void epipe_sq_fit_free(sq_fit *f)
{
    free(f->hist);
    f->hist = NULL;
    free(f->sample);
    f->sample = NULL;
    f->sample_cap = 0;
    free(f->mem);
    f->mem = NULL;
    f->cap = 0;
}

/* Modelled squared error of bins a..b quantised as one chunk, times 12·L^2:
 * count × width^2, the width from the chunk's boundary to the next one's
 * (a chunk spans that whole interval), so a chunk of zero width costs
 * nothing. */
static inline double chunk_cost(const struct dp *d, size_t a, size_t b)
{
    double w = d->edge[b + 1] - d->edge[a];
    return (d->cum[b + 1] - d->cum[a]) * w * w;
}

/* Layer j >= 2 of the programme for end bins l..r, whose best start lies in
 * ol..orr (it moves right with the end bin): divide and conquer. */
static void dp_layer(const struct dp *d, size_t j, size_t l, size_t r, size_t ol, size_t orr)
{
    while (l <= r) {
        size_t mid = l + (r - l) / 2, lo = ol > j - 1 ? ol : j - 1, hi = orr < mid ? orr : mid;
        double best = INFINITY;
        size_t arg = lo;
        for (size_t a = lo; a <= hi; a++) {
            double v = d->prev[a - 1] + chunk_cost(d, a, mid);
            if (v < best) {
                best = v;
                arg = a;
            }
        }
        d->cur[mid] = best;
        d->opt[mid] = (uint32_t)arg;
        if (mid > l)
            dp_layer(d, j, l, mid - 1, ol, arg);
        l = mid + 1; /* the right half, iteratively */
        ol = arg;
    }
}

int epipe_sq_fit_plan(sq_fit *f, const sq_bucket *b, size_t nb, unsigned bits, int fixed,
                      unsigned smax, sq_plan *out)
{
    memset(out, 0, sizeof *out);
    out->S = fixed >= 0 ? (unsigned)fixed : 0;
    out->used = 1;
    if (nb == 0 || b[0].key16 < 0x0080 || b[nb - 1].key16 > 0xff7f) /* none, NaN or inf */
        return 0;
    unsigned kmax = 1u << (fixed >= 0 ? (unsigned)fixed : smax);
    size_t need = sizeof(double) * (4 * nb + 2) + sizeof(uint32_t) * nb * (kmax + 1);
    if (f->cap < need) {
        free(f->mem);
        f->cap = 0;
        if (!(f->mem = malloc(need)))
            return EPIPE_ENOMEM;
        f->cap = need;
    }
    double *edge = f->mem, *cum = edge + nb + 1, *F0 = cum + nb + 1, *F1 = F0 + nb;
    uint32_t *key16 = (uint32_t *)(F1 + nb), *opt = key16 + nb;

    /* Bins: runs of buckets, as fractions of the sample's range. */
    uint64_t m = 0;
    for (size_t i = 0; i < nb; i++)
        m += b[i].count;
    double first = sq_unkey(b[0].key16 << 16);
    double range = (double)sq_unkey(b[nb - 1].key16 << 16 | 0xffffu) - first;
    double wl = 1.0 / BIN_DIV, cl = (double)m / BIN_DIV, run = 0.0, top = 0.0;
    size_t B = 0;
    for (size_t i = 0; i < nb; i++) {
        double lo = ((double)sq_unkey(b[i].key16 << 16) - first) / range;
        if (B && run + b[i].count <= cl && lo - edge[B - 1] <= wl) {
            run += b[i].count;
        } else {
            cum[B] = B ? cum[B - 1] + run : 0.0;
            edge[B] = lo;
            key16[B++] = b[i].key16;
            run = b[i].count;
        }
        top = ((double)sq_unkey(b[i].key16 << 16 | 0xffffu) - first) / range;
    }
    cum[B] = cum[B - 1] + run;
    edge[B] = top;

    unsigned K = kmax < B ? kmax : (unsigned)B;
    double fin[(1u << SQ_FIT_SMAX) + 1];
    struct dp d = {edge, cum, F0, F1, NULL};
    for (size_t e = 0; e < B; e++)
        F0[e] = chunk_cost(&d, 0, e);
    fin[1] = F0[B - 1];
    for (unsigned j = 2; j <= K; j++) {
        d.opt = opt + (size_t)(j - 1) * B;
        dp_layer(&d, j, j - 1, B - 1, j - 1, B - 1);
        fin[j] = d.cur[B - 1];
        double *t = (double *)d.prev;
        d.prev = d.cur;
        d.cur = t;
    }
    if (fixed < 0) {
        double best = INFINITY;
        for (unsigned S = 0; S <= smax && (1u << S) <= K; S++) {
            double L = (double)((1u << (bits - S)) - 1u);
            double cost = fin[1u << S] / (L * L);
            if (S == 0 || cost < best) {
                best = cost;
                out->S = S;
            }
        }
        K = 1u << out->S;
    }
    out->used = K;
    size_t e = B - 1;
    for (unsigned j = K; j >= 2; j--) {
        size_t a = opt[(size_t)(j - 1) * B + e];
        out->bnd[j - 1] = sq_unkey(key16[a] << 16);
        out->top[j - 2] = sq_unkey((key16[a] << 16) - 1u);
        e = a - 1;
    }
    return 0;
}

/* ---- the fast encoder ---------------------------------------------------- */

static void *grow(void **p, size_t *cap, size_t need)
{
    if (*cap < need) {
        free(*p);
        *cap = 0;
        if (!(*p = malloc(need)))
            return NULL;
        *cap = need;
    }
    return *p;
}

/* The non-empty top-16-bit key buckets of s[0..m) and the two values
 * ends[], ascending. hist (65536 counts) is all zero on entry and again on
 * return; only the 256-bucket blocks that coarse[] marks are scanned and
 * cleared. */
static size_t hist_buckets(uint32_t *hist, const float *s, size_t m, const float ends[2],
                           sq_bucket *out)
{
    uint32_t coarse[256] = {0};
    for (size_t i = 0; i < m + 2; i++) {
        uint32_t k = sq_key(i < m ? s[i] : ends[i - m]) >> 16;
        hist[k]++;
        coarse[k >> 8] = 1;
    }
    size_t nb = 0;
    for (uint32_t blk = 0; blk < 256; blk++) {
        if (!coarse[blk])
            continue;
        for (uint32_t k = blk << 8; k < (blk + 1) << 8; k++)
            if (hist[k]) {
                out[nb++] = (sq_bucket){k, hist[k]};
                hist[k] = 0;
            }
    }
    return nb;
}

void epipe_sq_fit_set_chunks(epipe_qtab *t, const sq_plan *pl, size_t n, float min, float max)
{
    for (unsigned j = 0; j < t->k; j++) {
        t->bnd[j + 1] = j + 1 < pl->used ? pl->bnd[j + 1] : INFINITY;
        if (n && j < pl->used)
            epipe_q_set_chunk(t, j, j ? pl->bnd[j] : min, j + 1 < pl->used ? pl->top[j] : max);
        else
            epipe_q_set_empty(t, j);
    }
    t->bnd[t->k] = INFINITY;
}

void epipe_sq_fit_finish(const sq_state *st, unsigned S, size_t n, uint8_t *body)
{
    const epipe_qtab *t = &st->ftab[S];
    body[0] = (uint8_t)S;
    body[1] = body[2] = body[3] = 0;
    epipe_q_write_table(t, body + 4);
    size_t pad = (size_t)8 * ((1u << sq_fit_smax_for(st, t->bits, n)) - t->k);
    memset(body + 4 + epipe_q_table_bytes(t) + epipe_bitpack_bytes(n, t->bits), 0, pad);
}

int epipe_sq_fit_host(epipe_codec *c, const float *s, size_t m, size_t n, float lo, float hi,
                      uint8_t *body, epipe_qtab **tp)
{
    sq_state *st = c->state;
    sq_plan pl = {.S = st->fit_fixed >= 0 ? (unsigned)st->fit_fixed : 0, .used = 1};
    /* -0 and +0 are one end: which of them an extent pass met first (it
     * depends on the thread count, or on a GPU's atomics) must not move the
     * histogram's first bucket. */
    const float ends[2] = {lo + 0.0f, hi + 0.0f};
    if (n) {
        size_t nbk = m + 2 < 65536 ? m + 2 : 65536;
        sq_bucket *bk = grow(&st->work, &st->work_cap, sizeof(sq_bucket) * nbk);
        if (!st->fit.hist)
            st->fit.hist = calloc(65536, sizeof(uint32_t));
        if (!bk || !st->fit.hist)
            return epipe_codec_fail(c, EPIPE_ENOMEM, "sortquant: out of memory for scratch");
        size_t nb = hist_buckets(st->fit.hist, s, m, ends, bk);
        unsigned bits = (unsigned)c->p[SQ_BITS];
        if (epipe_sq_fit_plan(&st->fit, bk, nb, bits, st->fit_fixed, sq_fit_smax_for(st, bits, n),
                              &pl))
            return epipe_codec_fail(c, EPIPE_ENOMEM, "sortquant: out of memory for scratch");
    }
    epipe_qtab *t = &st->ftab[pl.S];
    epipe_sq_fit_set_chunks(t, &pl, n, ends[0], ends[1]);
    epipe_sq_fit_finish(st, pl.S, n, body);
    *tp = t;
    return EPIPE_OK;
}

int epipe_sq_encode_fit(epipe_codec *c, const float *x, size_t n, uint8_t *body)
{
    sq_state *st = c->state;
    epipe_qtab *t;
    if (!n)
        return epipe_sq_fit_host(c, x, 0, 0, 0.0f, 0.0f, body, &t);
    size_t m = (size_t)sq_sample_count(n, c->p[SQ_SAMPLE]);
    float *smp = m < n ? epipe_sq_fit_sample_buf(st, m) : NULL;
    if (m < n && !smp)
        return epipe_codec_fail(c, EPIPE_ENOMEM, "sortquant: out of memory for scratch");
    /* The tensor's extent first (and its finiteness): the outer chunks'
     * ends, and two more points for the histogram, so that the fit sees
     * the tails the sample missed. */
    float lo[1u << SQ_FIT_SMAX], hi[1u << SQ_FIT_SMAX];
    unsigned threads = epipe_codec_workers(c, n);
    size_t bad = epipe_q_extent(&st->ftab[0], x, n, lo, hi, threads);
    if (bad < n)
        return epipe_q_reject_nonfinite(c, x, n, bad);
    const float *s = x;
    if (m < n) {
        sq_sample_gather(x, n, m, smp);
        s = smp;
    }
    int rc = epipe_sq_fit_host(c, s, m, n, lo[0], hi[0], body, &t);
    if (rc)
        return rc;
    epipe_q_encode(t, x, n, body + 4 + epipe_q_table_bytes(t), threads, NULL, NULL);
    return EPIPE_OK;
}

float *epipe_sq_fit_sample_buf(sq_state *st, size_t m)
{
    if (st->fit.sample_cap < m) {
        free(st->fit.sample);
        st->fit.sample_cap = 0;
        if (!(st->fit.sample = malloc(sizeof(float) * m)))
            return NULL;
        st->fit.sample_cap = m;
    }
    return st->fit.sample;
}

/* ---- reading a fit body ---------------------------------------------------- */

int epipe_sq_fit_read(epipe_codec *c, const uint8_t *body, size_t n, epipe_qtab **tp)
{
    sq_state *st = c->state;
    unsigned S = body[0];
    if (body[1] | body[2] | body[3])
        return epipe_codec_fail(
            c, EPIPE_EPROTO,
            "sortquant: fit word has reserved bytes %02x %02x %02x; they must be zero", body[1],
            body[2], body[3]);
    unsigned smax = sq_fit_smax_for(st, (unsigned)c->p[SQ_BITS], n);
    if (st->fit_fixed >= 0 ? S != smax : S > smax)
        return epipe_codec_fail(
            c, EPIPE_EPROTO,
            "sortquant: fit payload has split S = %u; for %zu values this codec "
            "takes %s%u",
            S, n, st->fit_fixed >= 0 ? "exactly " : "0..", smax);
    epipe_qtab *t = &st->ftab[S];
    int rc = epipe_q_read_table(c, t, body + 4, n);
    if (rc)
        return rc;
    /* Chunks hold increasing value ranges: their mins increase strictly, but
     * for trailing chunks with min = step = 0 (empty, or only zeros). */
    unsigned last = t->k;
    while (last > 1 && t->min[last - 1] == 0.0f && t->step[last - 1] == 0.0f)
        last--;
    for (unsigned j = 1; j < last; j++)
        if (!(t->min[j] > t->min[j - 1]))
            return epipe_codec_fail(c, EPIPE_EPROTO,
                                    "sortquant: fit chunk %u has min %g, not above chunk %u's %g; "
                                    "chunk boundaries must increase",
                                    j, (double)t->min[j], j - 1, (double)t->min[j - 1]);
    const uint8_t *pad = body + 4 + epipe_q_table_bytes(t) + epipe_bitpack_bytes(n, t->bits);
    for (size_t i = 0; i < (size_t)8 * ((1u << smax) - t->k); i++)
        if (pad[i])
            return epipe_codec_fail(c, EPIPE_EPROTO,
                                    "sortquant: fit payload has non-zero bytes after its codes");
    *tp = t;
    return EPIPE_OK;
}

/* ---- for the CUDA module ------------------------------------------------ */

static void cuda_table(const epipe_qtab *t, epipe_cuda_qtab *out)
{
    *out = (epipe_cuda_qtab){t->k, t->q, t->levels, t->bnd, t->min, t->step, t->inv};
}

int epipe_sq_fit_cuda_encode(epipe_codec *c, const float *s, size_t m, size_t n, float lo, float hi,
                             uint8_t *body, epipe_cuda_qtab *out)
{
    epipe_qtab *t;
    int rc = epipe_sq_fit_host(c, s, m, n, lo, hi, body, &t);
    if (rc == EPIPE_OK)
        cuda_table(t, out);
    return rc;
}

int epipe_sq_fit_cuda_decode(epipe_codec *c, const uint8_t *body, size_t n, epipe_cuda_qtab *out)
{
    epipe_qtab *t;
    int rc = epipe_sq_fit_read(c, body, n, &t);
    if (rc == EPIPE_OK)
        cuda_table(t, out);
    return rc;
}
