/* The plain scalar reference of sortquant: a full stable sort (exact mode),
 * a sorted sample (sample mode) or sorted sample keys (fit mode), then one
 * value at a time. */
#include <stdlib.h>
#include <string.h>

#include "../../lib/bitpack.h"
#include "sortquant.h"

struct pair {
    float v;
    size_t i;
};

static int cmp_pair(const void *pa, const void *pb)
{
    const struct pair *a = pa, *b = pb;
    if (a->v != b->v)
        return a->v < b->v ? -1 : 1;
    return (a->i > b->i) - (a->i < b->i); /* -0 == +0: ties keep index order */
}

static int cmp_float(const void *pa, const void *pb)
{
    float a = *(const float *)pa, b = *(const float *)pb;
    return (a > b) - (a < b);
}

/* Sort, cut into k equal pieces in sorted order, quantize each piece. */
static int ref_exact(epipe_qtab *t, const float *x, size_t n, uint16_t *codes)
{
    struct pair *p = malloc(sizeof *p * n);
    if (!p)
        return EPIPE_ENOMEM;
    for (size_t i = 0; i < n; i++)
        p[i] = (struct pair){x[i], i};
    qsort(p, n, sizeof *p, cmp_pair);
    for (unsigned j = 0; j < t->k; j++) {
        uint64_t r0 = sq_rank(j, n, t->k), r1 = sq_rank(j + 1, n, t->k);
        if (r1 == r0) {
            epipe_q_set_empty(t, j);
            continue;
        }
        epipe_q_set_chunk(t, j, p[r0].v, p[r1 - 1].v);
        for (uint64_t r = r0; r < r1; r++)
            codes[p[r].i] = epipe_q_code(t, p[r].v, j);
    }
    free(p);
    return EPIPE_OK;
}

/* Classify each value against the boundaries t->bnd, then quantize each
 * chunk over its own extent. */
static int ref_classify(epipe_qtab *t, const float *x, size_t n, uint16_t *codes)
{
    unsigned k = t->k;
    float *mn = malloc(sizeof(float) * 2 * k);
    unsigned *chunk = malloc(sizeof *chunk * n);
    if (!mn || !chunk) {
        free(mn);
        free(chunk);
        return EPIPE_ENOMEM;
    }
    float *mx = mn + k;
    for (unsigned j = 0; j < k; j++) {
        mn[j] = 1.0f; /* max < min marks an empty chunk */
        mx[j] = 0.0f;
    }
    for (size_t i = 0; i < n; i++) {
        unsigned c = 0;
        for (unsigned j = 1; j < k; j++)
            if (t->bnd[j] <= x[i])
                c++;
        chunk[i] = c;
        if (mx[c] < mn[c]) {
            mn[c] = mx[c] = x[i];
        } else {
            if (x[i] < mn[c])
                mn[c] = x[i];
            if (x[i] > mx[c])
                mx[c] = x[i];
        }
    }
    for (unsigned j = 0; j < k; j++) {
        if (mx[j] < mn[j])
            epipe_q_set_empty(t, j);
        else
            epipe_q_set_chunk(t, j, mn[j], mx[j]);
    }
    for (size_t i = 0; i < n; i++)
        codes[i] = epipe_q_code(t, x[i], chunk[i]);
    free(mn);
    free(chunk);
    return EPIPE_OK;
}

/* Sort a sample, take its order statistics as boundaries, classify. */
static int ref_sample(epipe_qtab *t, const float *x, size_t n, double sample, uint16_t *codes)
{
    size_t m = (size_t)sq_sample_count(n, sample);
    unsigned k = t->k;
    float *s = malloc(sizeof *s * m);
    if (!s)
        return EPIPE_ENOMEM;
    sq_sample_gather(x, n, m, s);
    qsort(s, m, sizeof *s, cmp_float);
    for (unsigned j = 1; j < k; j++)
        t->bnd[j] = s[sq_rank(j, m, k)];
    free(s);
    return ref_classify(t, x, n, codes);
}

static int cmp_u32(const void *pa, const void *pb)
{
    uint32_t a = *(const uint32_t *)pa, b = *(const uint32_t *)pb;
    return (a > b) - (a < b);
}

/* mode=fit: the tensor's extent, the sample's keys and its two ends sorted
 * and counted per top-16-bit bucket (the fast path uses a histogram), the
 * shared plan, then each value classified against the boundaries and coded. */
static int ref_fit(sq_state *st, const float *x, size_t n, double sample, unsigned bits,
                   unsigned *S, uint16_t *codes)
{
    size_t m = (size_t)sq_sample_count(n, sample);
    float *s = malloc(sizeof *s * m);
    uint32_t *key = malloc(sizeof *key * (m + 2));
    sq_bucket *bk = malloc(sizeof *bk * (m + 2));
    int rc = EPIPE_ENOMEM;
    if (s && key && bk) {
        float min = x[0], max = x[0];
        for (size_t i = 1; i < n; i++) {
            min = x[i] < min ? x[i] : min;
            max = x[i] > max ? x[i] : max;
        }
        min += 0.0f; /* one zero, whichever the scan met first (as the fast path) */
        max += 0.0f;
        sq_sample_gather(x, n, m, s);
        for (size_t i = 0; i < m; i++)
            key[i] = sq_key(s[i]);
        key[m] = sq_key(min); /* the tensor's ends count as two more points */
        key[m + 1] = sq_key(max);
        qsort(key, m + 2, sizeof *key, cmp_u32);
        size_t nb = 0;
        for (size_t i = 0; i < m + 2; i++) {
            if (nb && bk[nb - 1].key16 == key[i] >> 16)
                bk[nb - 1].count++;
            else
                bk[nb++] = (sq_bucket){key[i] >> 16, 1};
        }
        sq_plan pl;
        rc = epipe_sq_fit_plan(&st->fit, bk, nb, bits, st->fit_fixed, sq_fit_smax_for(st, bits, n),
                               &pl);
        if (rc == EPIPE_OK) {
            epipe_qtab *t = &st->ftab[pl.S];
            epipe_sq_fit_set_chunks(t, &pl, n, min, max);
            for (size_t i = 0; i < n; i++) {
                unsigned ch = 0;
                for (unsigned j = 1; j < t->k; j++)
                    if (t->bnd[j] <= x[i])
                        ch++;
                codes[i] = epipe_q_code(t, x[i], ch);
            }
            *S = pl.S;
        }
    }
    free(s);
    free(key);
    free(bk);
    return rc;
}

int epipe_sq_encode_ref(epipe_codec *c, const float *x, size_t n, uint8_t *body)
{
    sq_state *st = c->state;
    epipe_qtab *t = &st->tab;
    size_t bad = epipe_find_nonfinite(x, n);
    if (bad < n)
        return epipe_q_reject_nonfinite(c, x, n, bad);
    int fit = (int)c->p[SQ_MODE] == SQ_MODE_FIT;
    unsigned S = fit && st->fit_fixed >= 0 ? (unsigned)st->fit_fixed : 0;
    if (fit)
        t = &st->ftab[S];
    for (unsigned j = 0; j < t->k; j++)
        epipe_q_set_empty(t, j);
    uint16_t *codes = malloc(sizeof *codes * (n + 1));
    if (!codes)
        return epipe_codec_fail(c, EPIPE_ENOMEM, "sortquant: out of memory");
    int rc = EPIPE_OK;
    if (n && fit)
        rc = ref_fit(st, x, n, c->p[SQ_SAMPLE], (unsigned)c->p[SQ_BITS], &S, codes);
    else if (n)
        rc = (int)c->p[SQ_MODE] == SQ_MODE_EXACT ? ref_exact(t, x, n, codes)
                                                 : ref_sample(t, x, n, c->p[SQ_SAMPLE], codes);
    if (rc == EPIPE_OK && fit) {
        t = &st->ftab[S];
        epipe_sq_fit_finish(st, S, n, body);
        epipe_bitpack_ref(codes, n, t->bits, body + 4 + epipe_q_table_bytes(t));
    } else if (rc == EPIPE_OK) {
        epipe_q_write_table(t, body);
        epipe_bitpack_ref(codes, n, t->bits, body + epipe_q_table_bytes(t));
    }
    free(codes);
    if (rc)
        return epipe_codec_fail(c, rc, "sortquant: out of memory");
    return EPIPE_OK;
}

int epipe_sq_decode_ref(epipe_codec *c, const uint8_t *body, size_t n, float *y)
{
    sq_state *st = c->state;
    epipe_qtab *t = &st->tab;
    int rc;
    if ((int)c->p[SQ_MODE] == SQ_MODE_FIT) {
        rc = epipe_sq_fit_read(c, body, n, &t);
        body += 4;
    } else {
        rc = epipe_q_read_table(c, t, body, n);
    }
    if (rc)
        return rc;
    epipe_q_decode_ref(t, body + epipe_q_table_bytes(t), n, y);
    return EPIPE_OK;
}
