/* Shared core of quant and sortquant: table handling and the fast kernels
 * (per-chunk extent, classify + code + pack, LUT decode), SIMD and threaded. */
#include "quantize_common.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../lib/bitpack.h"
#include "../lib/parallel.h"
#include "../lib/tensor.h"

/* The small-k kernels keep one vector per chunk in registers. */
#define SMALL_K 16

/* The one process-wide switch of the codecs, for tests and epipe-bench
 * only (quantize_common.h); atomic, so setting it races with nothing. */
static int use_simd = 1;

int epipe_q_set_simd(int on)
{
    epipe_bitpack_set_simd(on);
    return __atomic_exchange_n(&use_simd, on ? 1 : 0, __ATOMIC_RELAXED);
}

int epipe_q_simd_enabled(void)
{
    return __atomic_load_n(&use_simd, __ATOMIC_RELAXED);
}

static int avx2(void)
{
#if EPIPE_Q_X86
    return __atomic_load_n(&use_simd, __ATOMIC_RELAXED) && epipe_q_avx2_usable();
#else
    return 0;
#endif
}

/* ---- tables ------------------------------------------------------------ */

int epipe_qtab_init(epipe_qtab *t, unsigned bits, unsigned split)
{
    memset(t, 0, sizeof *t);
    t->bits = bits;
    t->q = bits - split;
    t->k = 1u << split;
    t->levels = (float)((1u << t->q) - 1u);
    float *p = malloc(sizeof(float) * (4 * (size_t)t->k + 1));
    if (!p)
        return EPIPE_ENOMEM;
    t->bnd = p;
    t->min = p + t->k + 1;
    t->step = t->min + t->k;
    t->inv = t->step + t->k;
    t->bnd[0] = -INFINITY;
    for (unsigned j = 1; j <= t->k; j++)
        t->bnd[j] = INFINITY;
    for (unsigned j = 0; j < t->k; j++)
        epipe_q_set_empty(t, j);
    return EPIPE_OK;
}

void epipe_qtab_free(epipe_qtab *t)
{
    free(t->bnd);
    t->bnd = t->min = t->step = t->inv = NULL;
}

void epipe_q_set_chunk(epipe_qtab *t, unsigned j, float min, float max)
{
    min += 0.0f; /* -0 becomes +0: the bytes do not depend on which zero won */
    max += 0.0f;
    float step = epipe_q_step(min, max, t->levels);
    if (t->zero) /* a value the moved grid leaves outside clamps, within step/2 */
        min = epipe_hd_q_zero_min(min, max, step, t->levels);
    t->min[j] = min;
    t->step[j] = step;
    t->inv[j] = step > 0.0f ? 1.0f / step : 0.0f;
}

void epipe_q_set_empty(epipe_qtab *t, unsigned j)
{
    t->min[j] = t->step[j] = t->inv[j] = 0.0f;
}

void epipe_q_write_table(const epipe_qtab *t, uint8_t *body)
{
    for (unsigned j = 0; j < t->k; j++) {
        epipe_put_f32(body + 8 * j, t->min[j]);
        epipe_put_f32(body + 8 * j + 4, t->step[j]);
    }
}

int epipe_q_read_table(epipe_codec *c, epipe_qtab *t, const uint8_t *body, size_t n)
{
    const char *name = c->ops->name;
    for (unsigned j = 0; j < t->k; j++) {
        float min = epipe_get_f32(body + 8 * j), step = epipe_get_f32(body + 8 * j + 4);
        switch (epipe_hd_q_pair_check(min, step, t->levels)) {
        case 1:
            return epipe_codec_fail(c, EPIPE_EPROTO,
                                    "%s: chunk %u of %u has min %g; it must be finite", name, j,
                                    t->k, (double)min);
        case 2:
            return epipe_codec_fail(c, EPIPE_EPROTO,
                                    "%s: chunk %u of %u has step %g; it must be finite and >= 0",
                                    name, j, t->k, (double)step);
        case 3:
            return epipe_codec_fail(
                c, EPIPE_EPROTO,
                "%s: chunk %u of %u (min %g, step %g) decodes past the float range", name, j, t->k,
                (double)min, (double)step);
        }
        t->min[j] = min;
        t->step[j] = step;
        t->inv[j] = step > 0.0f ? 1.0f / step : 0.0f;
    }
    if (!epipe_bitpack_tail_clean(body + epipe_q_table_bytes(t), n, t->bits))
        return epipe_codec_fail(c, EPIPE_EPROTO,
                                "%s: padding bits after the last code are not zero", name);
    return EPIPE_OK;
}

int epipe_q_reject_nonfinite(epipe_codec *c, const float *x, size_t n, size_t bad)
{
    (void)n;
    return epipe_codec_fail(c, EPIPE_EINVAL,
                            "%s: input value at index %zu is %s; quantizers need finite values",
                            c->ops->name, bad,
                            isnan(x[bad]) ? "NaN"
                            : x[bad] > 0  ? "+inf"
                                          : "-inf");
}

void epipe_q_task_range(size_t n, unsigned threads, unsigned task, size_t *begin, size_t *end)
{
    epipe_split_range(n, threads, task, 64, begin, end);
}

/* Chunk of x for any k: binary search for the count of bnd[1..k) <= x. */
Q_INLINE unsigned classify_bsearch(const float *bnd, unsigned k, float x)
{
    return epipe_hd_q_chunk(bnd, k, x);
}

/* ---- extent ------------------------------------------------------------ */

/* Values per sweep: a block stays in L1 while each group of boundaries
 * sweeps over it, so the accumulators of a group fit in registers. */
#define XB 2048

Q_INLINE void sweep_global(const float *restrict x, size_t n, vf *l0, vf *hk, vf *acc)
{
    const vf zero = vsplat(0.0f);
    vf a = *acc, l = *l0, h = *hk;
    for (size_t i = 0; i < n; i += VL) {
        vf v;
        memcpy(&v, x + i, sizeof v);
        a += v * zero;
        l = vsel(v < l, v, l);
        h = vsel(v > h, v, h);
    }
    *acc = a;
    *l0 = l;
    *hk = h;
}

/* Boundaries j0 .. j0+cnt-1 (j0 >= 1, cnt <= 4): the smallest value at or
 * above each (chunk j's low end) and the largest below it (chunk j-1's). */
Q_INLINE void sweep_bounds(const float *restrict x, size_t n, const float *restrict bnd, vf *l,
                           vf *h, unsigned j0, unsigned cnt)
{
    vf ll[4], hh[4];
    float bv[4];
    for (unsigned t = 0; t < cnt; t++) {
        bv[t] = bnd[j0 + t];
        ll[t] = l[j0 + t];
        hh[t] = h[j0 + t - 1];
    }
    for (size_t i = 0; i < n; i += VL) {
        vf v;
        memcpy(&v, x + i, sizeof v);
        for (unsigned t = 0; t < cnt; t++) {
            vi ge = v >= vsplat(bv[t]);
            ll[t] = vsel(ge & (v < ll[t]), v, ll[t]);
            hh[t] = vsel(~ge & (v > hh[t]), v, hh[t]);
        }
    }
    for (unsigned t = 0; t < cnt; t++) {
        l[j0 + t] = ll[t];
        h[j0 + t - 1] = hh[t];
    }
}

Q_INLINE void extent_small(const float *restrict x, size_t n, const float *restrict bnd, unsigned k,
                           float *restrict lo, float *restrict hi, float *bad)
{
    vf l[SMALL_K], h[SMALL_K], acc = vsplat(0.0f);
    for (unsigned j = 0; j < k; j++) {
        l[j] = vsplat(INFINITY);
        h[j] = vsplat(-INFINITY);
    }
    size_t n8 = n / VL * VL;
    for (size_t b = 0; b < n8; b += XB) {
        size_t m = n8 - b < XB ? n8 - b : XB;
        sweep_global(x + b, m, &l[0], &h[k - 1], &acc);
        for (unsigned j0 = 1; j0 < k; j0 += 4)
            sweep_bounds(x + b, m, bnd, l, h, j0, k - j0 < 4 ? k - j0 : 4);
    }
    for (unsigned j = 0; j < k; j++)
        for (unsigned e = 0; e < VL; e++) {
            lo[j] = l[j][e] < lo[j] ? l[j][e] : lo[j];
            hi[j] = h[j][e] > hi[j] ? h[j][e] : hi[j];
        }
    for (unsigned e = 0; e < VL; e++)
        *bad += acc[e];
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

static void extent_block(const float *x, size_t n, const float *bnd, unsigned k, float *lo,
                         float *hi, float *bad)
{
#if EPIPE_Q_X86
    if (avx2() && epipe_q_extent_avx2(x, n, bnd, k, lo, hi, bad))
        return;
#endif
    switch (k) {
    case 1: extent_small(x, n, bnd, 1, lo, hi, bad); return;
    case 2: extent_small(x, n, bnd, 2, lo, hi, bad); return;
    case 4: extent_small(x, n, bnd, 4, lo, hi, bad); return;
    case 8: extent_small(x, n, bnd, 8, lo, hi, bad); return;
    case 16: extent_small(x, n, bnd, 16, lo, hi, bad); return;
    }
    float acc = 0.0f;
    for (size_t i = 0; i < n; i++) {
        float v = x[i];
        acc += v * 0.0f;
        unsigned c = classify_bsearch(bnd, k, v);
        lo[c] = v < lo[c] ? v : lo[c];
        hi[c] = v > hi[c] ? v : hi[c];
    }
    *bad += acc;
}

struct extent_ctx {
    const epipe_qtab *t;
    const float *x;
    size_t n;
    float *lo, *hi, *bad; /* [threads][k], [threads][k], [threads] */
};

static void extent_task(void *p, unsigned task, unsigned ntasks)
{
    struct extent_ctx *e = p;
    unsigned k = e->t->k;
    float *lo = e->lo + (size_t)task * k, *hi = e->hi + (size_t)task * k;
    for (unsigned j = 0; j < k; j++) {
        lo[j] = INFINITY;
        hi[j] = -INFINITY;
    }
    e->bad[task] = 0.0f;
    size_t b, end;
    epipe_q_task_range(e->n, ntasks, task, &b, &end);
    for (size_t i = b; i < end; i += EPIPE_Q_BLOCK * 8) {
        size_t cnt = end - i < EPIPE_Q_BLOCK * 8 ? end - i : EPIPE_Q_BLOCK * 8;
        extent_block(e->x + i, cnt, e->t->bnd, k, lo, hi, &e->bad[task]);
    }
}

size_t epipe_q_extent(const epipe_qtab *t, const float *x, size_t n, float *lo, float *hi,
                      unsigned threads)
{
    unsigned k = t->k;
    float bad1 = 0.0f, *buf = NULL;
    struct extent_ctx e = {t, x, n, lo, hi, &bad1};
    if (threads > 1 && !(buf = malloc(sizeof(float) * (2 * (size_t)k + 1) * threads)))
        threads = 1; /* no memory for per-thread extents: one thread needs none */
    if (threads <= 1) {
        extent_task(&e, 0, 1);
        return isnan(bad1) ? epipe_find_nonfinite(x, n) : n;
    }
    e.lo = buf;
    e.hi = buf + (size_t)k * threads;
    e.bad = buf + (size_t)2 * k * threads;
    epipe_parallel_run(threads, extent_task, &e);
    int bad = 0;
    for (unsigned j = 0; j < k; j++) {
        lo[j] = INFINITY;
        hi[j] = -INFINITY;
    }
    for (unsigned th = 0; th < threads; th++) {
        bad |= isnan(e.bad[th]);
        for (unsigned j = 0; j < k; j++) {
            float a = e.lo[(size_t)th * k + j], b = e.hi[(size_t)th * k + j];
            lo[j] = a < lo[j] ? a : lo[j];
            hi[j] = b > hi[j] ? b : hi[j];
        }
    }
    free(buf);
    return bad ? epipe_find_nonfinite(x, n) : n;
}

void epipe_q_set_from_extent(epipe_qtab *t, const float *lo, const float *hi)
{
    for (unsigned j = 0; j < t->k; j++) {
        if (lo[j] < t->bnd[j + 1] && lo[j] <= hi[j])
            epipe_q_set_chunk(t, j, lo[j], hi[j]);
        else
            epipe_q_set_empty(t, j);
    }
}

/* ---- classify, code and pack ------------------------------------------- */

/* Chunk by counting boundaries <= x; its min and 1/step by one select per
 * boundary (boundaries are sorted, so the last that holds wins). */
Q_INLINE void code_small(const float *restrict x, size_t n, const epipe_qtab *t, unsigned k,
                         uint16_t *restrict code)
{
    float bv[SMALL_K], mv[SMALL_K], iv[SMALL_K];
    for (unsigned j = 0; j < k; j++) {
        bv[j] = t->bnd[j];
        mv[j] = t->min[j];
        iv[j] = t->inv[j];
    }
    const vf zero = vsplat(0.0f), half = vsplat(0.5f), lv = vsplat(t->levels);
    const unsigned q = t->q;
    size_t i = 0;
    for (; i + VL <= n; i += VL) {
        vf v, mn = vsplat(mv[0]), in = vsplat(iv[0]);
        memcpy(&v, x + i, sizeof v);
        vi c = vsplati(0);
        for (unsigned j = 1; j < k; j++) {
            vi ge = v >= vsplat(bv[j]);
            mn = vsel(ge, vsplat(mv[j]), mn);
            in = vsel(ge, vsplat(iv[j]), in);
            c -= ge;
        }
        vf u = (v - mn) * in;
        u = vsel(u > zero, u, zero);
        u = vsel(u < lv, u, lv);
        vi level = __builtin_convertvector(u + half, vi);
        vi cd = (c << q) | level;
        for (unsigned e = 0; e < VL; e++)
            code[i + e] = (uint16_t)cd[e];
    }
    for (; i < n; i++) {
        unsigned c = 0;
        for (unsigned j = 1; j < k; j++)
            c += x[i] >= t->bnd[j];
        code[i] = epipe_q_code(t, x[i], c);
    }
}

static void code_block(const float *x, size_t n, const epipe_qtab *t, uint16_t *code)
{
#if EPIPE_Q_X86
    if (avx2() && epipe_q_code_avx2(x, n, t, code))
        return;
#endif
    switch (t->k) {
    case 1: code_small(x, n, t, 1, code); return;
    case 2: code_small(x, n, t, 2, code); return;
    case 4: code_small(x, n, t, 4, code); return;
    case 8: code_small(x, n, t, 8, code); return;
    case 16: code_small(x, n, t, 16, code); return;
    }
    for (size_t i = 0; i < n; i++)
        code[i] = epipe_q_code(t, x[i], classify_bsearch(t->bnd, t->k, x[i]));
}

struct encode_ctx {
    const epipe_qtab *t;
    const float *x;
    size_t n;
    uint8_t *out;
    epipe_q_fixup_fn fixup;
    void *fixup_ctx;
};

static void encode_task(void *p, unsigned task, unsigned ntasks)
{
    const struct encode_ctx *e = p;
    uint16_t codes[EPIPE_Q_BLOCK];
    size_t b, end;
    epipe_q_task_range(e->n, ntasks, task, &b, &end);
    unsigned w = e->t->bits;
    for (size_t i = b; i < end; i += EPIPE_Q_BLOCK) {
        size_t cnt = end - i < EPIPE_Q_BLOCK ? end - i : EPIPE_Q_BLOCK;
        code_block(e->x + i, cnt, e->t, codes);
        if (e->fixup)
            e->fixup(e->fixup_ctx, task, e->x + i, i, cnt, codes);
        epipe_bitpack(codes, cnt, w, e->out + i / 8 * w); /* i is a multiple of 8 */
    }
}

void epipe_q_encode(const epipe_qtab *t, const float *x, size_t n, uint8_t *out, unsigned threads,
                    epipe_q_fixup_fn fixup, void *fixup_ctx)
{
    struct encode_ctx e = {t, x, n, out, fixup, fixup_ctx};
    epipe_parallel_run(threads ? threads : 1, encode_task, &e);
}

/* ---- decode ------------------------------------------------------------ */

static float decode_one(const epipe_qtab *t, uint32_t code)
{
    unsigned c = code >> t->q;
    return epipe_hd_q_value(t->min[c], t->step[c], code & ((1u << t->q) - 1u));
}

void epipe_q_decode_ref(const epipe_qtab *t, const uint8_t *codes, size_t n, float *y)
{
    for (size_t i = 0; i < n; i++) {
        uint32_t code = 0;
        for (unsigned b = 0; b < t->bits; b++) {
            size_t bit = i * t->bits + b;
            code |= (uint32_t)(codes[bit / 8] >> (bit % 8) & 1u) << b;
        }
        y[i] = decode_one(t, code);
    }
}

static void lut_block(const uint8_t *in, size_t n, unsigned w, const float *lut, float *y)
{
    epipe_bitunpack_lut(in, n, w, lut, y);
}

struct decode_ctx {
    const epipe_qtab *t;
    const uint8_t *in;
    size_t n;
    float *y;
    const float *lut;
};

static void decode_task(void *p, unsigned task, unsigned ntasks)
{
    const struct decode_ctx *d = p;
    size_t b, end;
    epipe_q_task_range(d->n, ntasks, task, &b, &end);
    unsigned w = d->t->bits;
    for (size_t i = b; i < end; i += EPIPE_Q_BLOCK) {
        size_t cnt = end - i < EPIPE_Q_BLOCK ? end - i : EPIPE_Q_BLOCK;
        if (d->lut) {
            lut_block(d->in + i / 8 * w, cnt, w, d->lut, d->y + i);
        } else {
            uint16_t codes[EPIPE_Q_BLOCK];
            epipe_bitunpack(d->in + i / 8 * w, cnt, w, codes);
            for (size_t k = 0; k < cnt; k++)
                d->y[i + k] = decode_one(d->t, codes[k]);
        }
    }
}

void epipe_q_decode(const epipe_qtab *t, const uint8_t *codes, size_t n, float *y, float *lut,
                    unsigned threads)
{
    size_t ncodes = (size_t)1 << t->bits;
    struct decode_ctx d = {t, codes, n, y, NULL};
    if (lut && n >= ncodes / 4) { /* the table pays for itself */
        for (size_t code = 0; code < ncodes; code++)
            lut[code] = decode_one(t, (uint32_t)code);
        d.lut = lut;
    }
    epipe_parallel_run(threads ? threads : 1, decode_task, &d);
}
