/* `sortquant:bits=B,split=S,mode=exact|sample|fit,sample=N`: sort quantization,
 * the fast path (radix select or a sample, then vector kernels on threads). */
#include "sortquant.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../../lib/bitpack.h"
#include "../../lib/parallel.h"

static const char *const sq_modes[] = {"exact", "sample", "fit", NULL};

static const epipe_param_desc sq_params[] = {
    {.key = "bits", .kind = EPIPE_PARAM_INT, .min = 2, .max = 16, .def = 8},
    {.key = "split", .kind = EPIPE_PARAM_INT, .min = 0, .max = 12, .def = NAN},
    {.key = "mode", .kind = EPIPE_PARAM_CHOICE, .def = SQ_MODE_FIT, .choices = sq_modes},
    {.key = "sample", .kind = EPIPE_PARAM_INT, .min = 1024, .max = 16777216, .def = 65536},
    /* Encoder only (the payload is the same format): 0 is a level of the
     * chunk that spans it. */
    {.key = "zero",
     .kind = EPIPE_PARAM_CHOICE,
     .def = 0,
     .choices = epipe_param_bool,
     .quiet_default = 1},
};

static void sq_release(epipe_codec *c)
{
    sq_state *st = c->state;
    if (!st)
        return;
    epipe_qtab_free(&st->tab);
    for (unsigned S = 0; S <= SQ_FIT_SMAX; S++)
        epipe_qtab_free(&st->ftab[S]);
    epipe_sq_fit_free(&st->fit);
    epipe_sq_select_free(&st->sel);
    free(st->lut);
    free(st->work);
    free(st);
    c->state = NULL;
}

/* mode=fit: split given (fixed S, 0..SQ_FIT_SMAX) or left NAN (chosen per
 * tensor up to min(SQ_FIT_SMAX, bits - 1); the canonical spec omits it). */
static int fit_configure(epipe_codec *c, sq_state *st, unsigned bits)
{
    if (isnan(c->p[SQ_SPLIT])) {
        st->fit_fixed = -1;
        st->fit_smax = bits - 1 < SQ_FIT_SMAX ? bits - 1 : SQ_FIT_SMAX;
    } else {
        unsigned split = (unsigned)c->p[SQ_SPLIT];
        if (split > SQ_FIT_SMAX || split >= bits)
            return epipe_fail(EPIPE_EINVAL,
                              "sortquant: key 'split' = %u with mode=fit must be at most %u and "
                              "below bits = %u (or left out, to be chosen per tensor)",
                              split, SQ_FIT_SMAX, bits);
        st->fit_fixed = (int)split;
        st->fit_smax = split;
    }
    for (unsigned S = 0; S <= st->fit_smax; S++) /* S = 0: the tensor's extent */
        if (st->fit_fixed < 0 || S == st->fit_smax || S == 0) {
            if (epipe_qtab_init(&st->ftab[S], bits, S))
                return epipe_fail(EPIPE_ENOMEM, "sortquant: out of memory");
            st->ftab[S].zero = (int)c->p[SQ_ZERO];
        }
    if (!(st->lut = malloc(sizeof(float) << bits)))
        return epipe_fail(EPIPE_ENOMEM, "sortquant: out of memory");
    return EPIPE_OK;
}

static int sq_configure(epipe_codec *c)
{
    unsigned bits = (unsigned)c->p[SQ_BITS];
    if ((int)c->p[SQ_MODE] == SQ_MODE_FIT) {
        sq_state *st = calloc(1, sizeof *st);
        if (!st)
            return epipe_fail(EPIPE_ENOMEM, "sortquant: out of memory");
        c->state = st;
        return fit_configure(c, st, bits);
    }
    if (isnan(c->p[SQ_SPLIT]))
        c->p[SQ_SPLIT] = bits / 4 > 1 ? bits / 4 : 1; /* the 3:1 rule */
    unsigned split = (unsigned)c->p[SQ_SPLIT];
    if (split >= bits)
        return epipe_fail(
            EPIPE_EINVAL,
            "sortquant: key 'split' = %u must be below bits = %u (a chunk needs a level bit)",
            split, bits);
    sq_state *st = calloc(1, sizeof *st);
    if (!st)
        return epipe_fail(EPIPE_ENOMEM, "sortquant: out of memory");
    c->state = st;
    if (epipe_qtab_init(&st->tab, bits, split) || !(st->lut = malloc(sizeof(float) << bits)))
        return epipe_fail(EPIPE_ENOMEM, "sortquant: out of memory");
    st->tab.zero = (int)c->p[SQ_ZERO];
    return EPIPE_OK;
}

static uint32_t sq_param_word(const epipe_codec *c)
{
    const sq_state *st = c->state;
    if ((int)c->p[SQ_MODE] == SQ_MODE_FIT)
        return (uint32_t)c->p[SQ_BITS] | st->fit_smax << 8 | SQ_WORD_FIT |
               (st->fit_fixed < 0 ? SQ_WORD_CHOSEN : 0);
    return (uint32_t)c->p[SQ_BITS] | (uint32_t)c->p[SQ_SPLIT] << 8;
}

static int sq_body_size(const epipe_codec *c, uint64_t n, size_t *bytes)
{
    const sq_state *st = c->state;
    /* mode=fit: the fit word, and a table as long as the largest S needs */
    uint64_t table = (int)c->p[SQ_MODE] == SQ_MODE_FIT
                         ? 4 + (8ull << sq_fit_smax_for(st, (unsigned)c->p[SQ_BITS], n))
                         : 8ull << (unsigned)c->p[SQ_SPLIT];
    if (n >= 1ull << 59)
        return EPIPE_EOVERFLOW;
    uint64_t codes = epipe_bitpack_bytes(n, (unsigned)c->p[SQ_BITS]);
    if (codes > SIZE_MAX - table)
        return EPIPE_EOVERFLOW;
    *bytes = (size_t)(codes + table);
    return EPIPE_OK;
}

static void *work(sq_state *st, size_t bytes)
{
    if (st->work_cap < bytes) {
        free(st->work);
        st->work_cap = 0;
        if (!(st->work = malloc(bytes)))
            return NULL;
        st->work_cap = bytes;
    }
    return st->work;
}

static int no_memory(epipe_codec *c)
{
    return epipe_codec_fail(c, EPIPE_ENOMEM, "sortquant: out of memory for scratch");
}

/* ---- exact mode: boundaries by radix select, ties by index -------------- */

/* A run of equal boundary values bnd[a..b] = v that cuts through the values
 * equal to v: which chunk such a value joins depends on how many equal
 * values come before it (its tie index t): chunk a - 1 + #{j in [a, b] :
 * t >= rank[j] - lt}. */
struct tie_group {
    unsigned a, b;
    uint64_t lt;
    float v;
};

struct tie_ctx {
    const epipe_qtab *t;
    const float *x;
    size_t n;
    const uint64_t *rank; /* [k + 1] chunk starts */
    const struct tie_group *g;
    const int32_t *gid; /* [k]: group whose last boundary is j, else -1 */
    unsigned ng;
    const float *sv; /* [ng]: the groups' values */
    uint64_t *ties;  /* [task][ng]: tie index of the next equal value */
    uint32_t *cur;   /* [task][ng]: chunk of the next equal value */
};

static size_t count_equal(const float *x, size_t n, float v);

static void tie_count_task(void *p, unsigned task, unsigned ntasks)
{
    struct tie_ctx *tc = p;
    uint64_t *cnt = tc->ties + (size_t)task * tc->ng;
    size_t b, e;
    epipe_q_task_range(tc->n, ntasks, task, &b, &e);
    memset(cnt, 0, sizeof *cnt * tc->ng);
    if (tc->ng <= 16) { /* block by block, so the groups after the first read L1 */
        for (size_t i = b; i < e; i += EPIPE_Q_BLOCK)
            for (unsigned g = 0; g < tc->ng; g++)
                cnt[g] += count_equal(tc->x + i, e - i < EPIPE_Q_BLOCK ? e - i : EPIPE_Q_BLOCK,
                                      tc->g[g].v);
        return;
    }
    for (size_t i = b; i < e; i++) {
        float v = tc->x[i];
        unsigned lo = 0, hi = tc->ng; /* first group with value >= v */
        while (lo < hi) {
            unsigned mid = (lo + hi) / 2;
            if (tc->g[mid].v < v)
                lo = mid + 1;
            else
                hi = mid;
        }
        if (lo < tc->ng && tc->g[lo].v == v)
            cnt[lo]++;
    }
}

EPIPE_CLONES static size_t count_equal(const float *x, size_t n, float v)
{
    size_t m = 0;
    for (size_t i = 0; i < n; i++)
        m += x[i] == v;
    return m;
}

EPIPE_CLONES static void replace_equal(const float *x, size_t n, float v, uint16_t *codes,
                                       uint16_t code)
{
    for (size_t i = 0; i < n; i++)
        codes[i] = x[i] == v ? code : codes[i];
}

/* The chunk of the value with tie index `tie` in group g, from c on. */
static uint32_t tie_chunk(const struct tie_ctx *tc, const struct tie_group *g, uint32_t c,
                          uint64_t tie)
{
    while (c < g->b && tie >= tc->rank[c + 1] - g->lt)
        c++;
    return c;
}

/* The vector kernel put every value equal to a group's value in chunk b;
 * here they move to the chunk their tie index gives. A block whose ties
 * of a group all land in one chunk is done with one vector pass. */
static void tie_fixup(void *p, unsigned task, const float *x, size_t i0, size_t cnt,
                      uint16_t *codes)
{
    (void)i0;
    struct tie_ctx *tc = p;
    const epipe_qtab *t = tc->t;
    uint64_t *ties = tc->ties + (size_t)task * tc->ng;
    uint32_t *cur = tc->cur + (size_t)task * tc->ng;
    if (tc->ng <= 16) {
        for (unsigned g = 0; g < tc->ng; g++) {
            const struct tie_group *gr = &tc->g[g];
            size_t m = count_equal(x, cnt, gr->v);
            if (!m)
                continue;
            uint32_t c0 = tie_chunk(tc, gr, cur[g], ties[g]);
            if (tie_chunk(tc, gr, c0, ties[g] + m - 1) == c0) {
                replace_equal(x, cnt, gr->v, codes, epipe_q_code(t, gr->v, c0));
                ties[g] += m;
                cur[g] = c0;
                continue;
            }
            for (size_t i = 0; i < cnt; i++)
                if (x[i] == gr->v) {
                    cur[g] = tie_chunk(tc, gr, cur[g], ties[g]++);
                    codes[i] = epipe_q_code(t, x[i], cur[g]);
                }
        }
        return;
    }
    for (size_t i = 0; i < cnt; i++) {
        unsigned ch = codes[i] >> t->q;
        int32_t g = tc->gid[ch];
        if (g < 0 || x[i] != t->bnd[ch])
            continue;
        cur[g] = tie_chunk(tc, &tc->g[g], cur[g], ties[g]++);
        codes[i] = epipe_q_code(t, x[i], cur[g]);
    }
}

static int encode_exact(epipe_codec *c, sq_state *st, const float *x, size_t n, uint8_t *codes,
                        unsigned threads)
{
    epipe_qtab *t = &st->tab;
    unsigned k = t->k;
    /* rank[k+1], req[2k], lt[2k], val[2k], imin[k], imax[k], gid[k],
     * groups[k], sv[k], ties and cur [threads][k] */
    size_t need = sizeof(uint64_t) * (k + 1) + (sizeof(uint64_t) * 2 + sizeof(float)) * 2 * k +
                  sizeof(uint32_t) * 4 * k + sizeof(struct tie_group) * k +
                  (sizeof(uint64_t) + sizeof(uint32_t)) * (size_t)threads * k;
    uint8_t *w = work(st, need);
    if (!w)
        return no_memory(c);
    uint64_t *rank = (uint64_t *)w, *req = rank + k + 1, *lt = req + 2 * k;
    uint64_t *ties = lt + 2 * k;
    struct tie_group *grp = (struct tie_group *)(ties + (size_t)threads * k);
    float *val = (float *)(grp + k);
    uint32_t *imin = (uint32_t *)(val + 2 * k), *imax = imin + k, *cur = imax + k;
    int32_t *gid = (int32_t *)(cur + (size_t)threads * k);
    float *sv = (float *)(gid + k);

    for (unsigned j = 0; j <= k; j++)
        rank[j] = sq_rank(j, n, k);
    size_t R = 0;
    for (unsigned j = 0; j < k; j++) {
        imin[j] = (uint32_t)R;
        req[R++] = rank[j]; /* < n for j < k, as n >= 1 */
        if (rank[j + 1] > rank[j]) {
            imax[j] = (uint32_t)R;
            req[R++] = rank[j + 1] - 1;
        }
    }
    int nonfinite;
    if (epipe_sq_select_ranks(&st->sel, x, n, req, R, val, lt, threads, &nonfinite))
        return no_memory(c);
    if (nonfinite)
        return epipe_q_reject_nonfinite(c, x, n, epipe_find_nonfinite(x, n));
    for (unsigned j = 0; j < k; j++) {
        if (rank[j + 1] > rank[j])
            epipe_q_set_chunk(t, j, val[imin[j]], val[imax[j]]);
        else
            epipe_q_set_empty(t, j);
        if (j)
            t->bnd[j] = val[imin[j]];
        gid[j] = -1;
    }
    unsigned ng = 0;
    for (unsigned j = 1; j < k; j++) {
        unsigned a = j;
        while (j + 1 < k && t->bnd[j + 1] == t->bnd[a])
            j++;
        if (rank[j] > lt[imin[j]]) { /* values equal to bnd[j] straddle a cut */
            grp[ng] = (struct tie_group){a, j, lt[imin[j]], t->bnd[j]};
            sv[ng] = t->bnd[j];
            gid[j] = (int32_t)ng++;
        }
    }
    struct tie_ctx tc = {t, x, n, rank, grp, gid, ng, sv, ties, cur};
    if (ng) {
        if (threads > 1) {
            epipe_parallel_run(threads, tie_count_task, &tc);
            for (unsigned g = 0; g < ng; g++) /* counts become each task's start */
                for (uint64_t run = 0, th = 0; th < threads; th++) {
                    uint64_t m = ties[th * ng + g];
                    ties[th * ng + g] = run;
                    run += m;
                }
        } else {
            memset(ties, 0, sizeof *ties * ng);
        }
        for (unsigned th = 0; th < threads; th++)
            for (unsigned g = 0; g < ng; g++) {
                uint32_t ch = grp[g].a - 1;
                while (ch < grp[g].b && ties[th * ng + g] >= rank[ch + 1] - grp[g].lt)
                    ch++;
                cur[th * ng + g] = ch;
            }
    }
    epipe_q_encode(t, x, n, codes, threads, ng ? tie_fixup : NULL, &tc);
    return EPIPE_OK;
}

/* ---- sample mode: boundaries from a sample, then two passes ------------- */

static int encode_sample(epipe_codec *c, sq_state *st, const float *x, size_t n, uint8_t *codes,
                         unsigned threads)
{
    epipe_qtab *t = &st->tab;
    unsigned k = t->k;
    size_t m = (size_t)sq_sample_count(n, c->p[SQ_SAMPLE]);
    size_t need = (sizeof(uint64_t) * 2 + sizeof(float)) * k + sizeof(float) * 2 * k +
                  (m < n ? sizeof(float) * m : 0);
    uint8_t *w = work(st, need);
    if (!w)
        return no_memory(c);
    uint64_t *req = (uint64_t *)w, *lt = req + k;
    float *val = (float *)(lt + k), *lo = val + k, *hi = lo + k, *smp = hi + k;
    const float *s = x;
    if (m < n) {
        sq_sample_gather(x, n, m, smp);
        s = smp;
    }
    for (unsigned j = 1; j < k; j++)
        req[j - 1] = sq_rank(j, m, k);
    /* A NaN in the sample gives garbage boundaries; the extent pass below
     * rejects the input before they are used. */
    if (epipe_sq_select_ranks(&st->sel, s, m, req, k - 1, val, lt, epipe_codec_workers(c, m), NULL))
        return no_memory(c);
    for (unsigned j = 1; j < k; j++)
        t->bnd[j] = val[j - 1];
    size_t bad = epipe_q_extent(t, x, n, lo, hi, threads);
    if (bad < n)
        return epipe_q_reject_nonfinite(c, x, n, bad);
    epipe_q_set_from_extent(t, lo, hi);
    epipe_q_encode(t, x, n, codes, threads, NULL, NULL);
    return EPIPE_OK;
}

static int sq_encode(epipe_codec *c, const float *x, size_t n, uint8_t *body)
{
    if ((int)c->p[SQ_MODE] == SQ_MODE_FIT)
        return epipe_sq_encode_fit(c, x, n, body);
    sq_state *st = c->state;
    epipe_qtab *t = &st->tab;
    for (unsigned j = 0; j < t->k; j++)
        epipe_q_set_empty(t, j);
    if (n) {
        unsigned threads = epipe_codec_workers(c, n);
        uint8_t *codes = body + epipe_q_table_bytes(t);
        int rc = (int)c->p[SQ_MODE] == SQ_MODE_EXACT ? encode_exact(c, st, x, n, codes, threads)
                                                     : encode_sample(c, st, x, n, codes, threads);
        if (rc)
            return rc;
    }
    epipe_q_write_table(t, body);
    return EPIPE_OK;
}

static int sq_decode(epipe_codec *c, const uint8_t *body, size_t n, float *y)
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
    epipe_q_decode(t, body + epipe_q_table_bytes(t), n, y, st->lut, epipe_codec_workers(c, n));
    return EPIPE_OK;
}

static const epipe_codec_backend sortquant_cpu = {
    .encode = sq_encode,
    .decode = sq_decode,
    .encode_ref = epipe_sq_encode_ref,
    .decode_ref = epipe_sq_decode_ref,
};

const epipe_codec_ops epipe_codec_sortquant = {
    .name = "sortquant",
    .id = EPIPE_CODEC_ID_SORTQUANT,
    .params = sq_params,
    .nparams = sizeof sq_params / sizeof sq_params[0],
    .configure = sq_configure,
    .param_word = sq_param_word,
    .body_size = sq_body_size,
    .release = sq_release,
    .cpu = &sortquant_cpu,
};
