/* `topk:ratio=r`: keep the ceil(r*n) entries of largest magnitude (ties to
 * the lower index) as sorted (index, value) lists; the rest decode as 0. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../lib/codec/codec_impl.h"
#include "../lib/parallel.h"
#include "../lib/tensor.h"
#include "quantize_common.h"
#include "topk_impl.h"

enum { TOPK_RATIO };

static const epipe_param_desc topk_params[] = {
    {.key = "ratio", .kind = EPIPE_PARAM_REAL, .min = 1e-6, .max = 1, .def = 0.1},
};

/* Entries kept out of n: ceil(r*n), at least 1 and at most n when n > 0. */
static uint64_t topk_count(const epipe_codec *c, uint64_t n)
{
    if (n == 0)
        return 0;
    double k = ceil(c->p[TOPK_RATIO] * (double)n);
    if (!(k < (double)n))
        return n;
    return k < 1 ? 1 : (uint64_t)k;
}

/* Index width: 4 bytes while every index fits in 32 bits, else 8. */
static unsigned topk_index_bytes(uint64_t n)
{
    return n <= (uint64_t)1 << 32 ? 4 : 8;
}

/* The decoder must derive the same k: the ratio's float32 bits. */
static uint32_t topk_param_word(const epipe_codec *c)
{
    union {
        float f;
        uint32_t u;
    } w = {.f = (float)c->p[TOPK_RATIO]};
    return w.u;
}

static int topk_body_size(const epipe_codec *c, uint64_t n, size_t *bytes)
{
    uint64_t k = topk_count(c, n), per = topk_index_bytes(n) + 4;
    if (k > SIZE_MAX / per)
        return EPIPE_EOVERFLOW;
    *bytes = (size_t)(k * per);
    return EPIPE_OK;
}

static void put_index(uint8_t *p, unsigned w, uint64_t i)
{
    if (w == 4)
        epipe_put_u32(p, (uint32_t)i);
    else
        epipe_put_u64(p, i);
}

static int check_finite(epipe_codec *c, const float *x, size_t n)
{
    size_t bad = epipe_find_nonfinite(x, n);
    if (bad < n)
        return epipe_codec_fail(c, EPIPE_EINVAL, "topk: value at index %zu is not finite (%g)", bad,
                                (double)x[bad]);
    return EPIPE_OK;
}

/* ---- fast path: a two-level radix select, then one ordered scan --------
 * Pass 1 histograms the top 16 bits of epipe_topk_mag() per thread range (a bin at or
 * above 0x7f80 is a NaN or infinity: the input is refused). The merged
 * histogram names the bin B holding the k-th largest; entries above B are
 * counted from the histograms. Pass 2 copies the low 16 bits of the
 * entries in bin B, per range in index order, to a candidate list (its
 * size per range is known from the histograms), and a histogram of the
 * candidates gives the threshold T and, per range, the entries above T
 * and equal to T. Pass 3 writes each range at its offset, keeping the
 * first entries equal to T by index, so the indices come out ascending
 * with no sort. All counts are integers: the bytes are the same for every
 * thread count. Three reads of x in all. */

static void topk_hist_task(void *ctx, unsigned t, unsigned nt)
{
    topk_job *j = ctx;
    size_t b, e;
    epipe_split_range(j->n, nt, t, 1, &b, &e);
    uint32_t *restrict h = j->hist + (size_t)t * TOPK_BINS;
    const float *restrict x = j->x;
    memset(h, 0, TOPK_BINS * sizeof *h);
    for (size_t i = b; i < e; i++)
        h[epipe_topk_mag(x[i]) >> 16]++;
}

static void topk_collect_task(void *ctx, unsigned t, unsigned nt)
{
    topk_job *j = ctx;
    size_t b, e;
    epipe_split_range(j->n, nt, t, 1, &b, &e);
    const float *restrict x = j->x;
    uint16_t *restrict c = j->cand + j->coff[t];
    const uint32_t bin = j->bin;
    size_t i = b;
    for (; i + 16 <= e; i += 16) { /* most blocks hold no candidate: test 16 at once */
        unsigned any = 0;
        for (unsigned l = 0; l < 16; l++)
            any |= epipe_topk_mag(x[i + l]) >> 16 == bin;
        if (!any)
            continue;
        for (unsigned l = 0; l < 16; l++) {
            uint32_t m = epipe_topk_mag(x[i + l]);
            if (m >> 16 == bin)
                *c++ = (uint16_t)m;
        }
    }
    for (; i < e; i++) {
        uint32_t m = epipe_topk_mag(x[i]);
        if (m >> 16 == bin)
            *c++ = (uint16_t)m;
    }
}

/* Writes the kept entries of a range from its output offset on, without a
 * branch per entry: each entry goes to a local buffer with room to spare
 * and the fill advances by whether it is kept. */
static void topk_emit_task(void *ctx, unsigned t, unsigned nt)
{
    topk_job *j = ctx;
    size_t b, e;
    epipe_split_range(j->n, nt, t, 1, &b, &e);
    const float *restrict x = j->x;
    const uint32_t thr = j->thr;
    const unsigned w = j->w;
    uint64_t o = j->off[t], quota = j->quota[t];
#if TOPK_X86
    if (j->x86 && w == 4) {
        epipe_topk_emit_avx2(j, b, e, o, quota);
        return;
    }
#endif
    uint64_t ib[2 * TOPK_RUN];
    float vb[2 * TOPK_RUN];
    unsigned cnt = 0;
    for (size_t i0 = b; i0 < e; i0 += TOPK_RUN) {
        size_t i1 = e - i0 < TOPK_RUN ? e : i0 + TOPK_RUN;
        for (size_t i = i0; i < i1; i++) {
            uint32_t m = epipe_topk_mag(x[i]);
            unsigned eq = m == thr && quota != 0;
            ib[cnt] = i;
            vb[cnt] = x[i];
            quota -= eq;
            cnt += (m > thr) | eq;
        }
        if (cnt >= TOPK_RUN || i1 == e) {
            for (unsigned r = 0; r < cnt; r++) {
                put_index(j->idx + (o + r) * w, w, ib[r]);
                epipe_put_f32(j->val + (o + r) * 4, vb[r]);
            }
            o += cnt;
            cnt = 0;
        }
    }
}

static void run(unsigned nt, epipe_task_fn fn, topk_job *j)
{
    if (nt > 1)
        epipe_parallel_run(nt, fn, j);
    else
        fn(j, 0, 1);
}

/* The bin of h[0..TOPK_BINS) holding the need-th largest entry, counting
 * from the top; *need becomes its rank inside that bin. */
static uint32_t topk_pick_bin(const uint64_t *h, uint64_t *need)
{
    uint64_t above = 0;
    for (uint32_t bin = TOPK_BINS; bin-- > 0;) {
        if (above + h[bin] >= *need) {
            *need -= above;
            return bin;
        }
        above += h[bin];
    }
    return 0; /* unreachable: need <= n */
}

/* ---- the window pass: one read instead of histogram + collect ----------
 * From n >= TOPK_WINDOW_MIN a strided sample of TOPK_SAMPLE magnitudes,
 * sorted, gives a window [wlo, whi] that holds the k-th largest with
 * overwhelming probability (its sample rank +- 4 standard deviations + 64).
 * One pass per range counts the entries above the window and copies the
 * window's magnitudes in index order. When the k-th largest is not in the
 * window, or a range's copy would overflow, the histogram passes run
 * instead; both find the same T exactly, so the bytes never depend on it. */

#define TOPK_WINDOW_MIN ((size_t)1 << 18)
#define TOPK_SAMPLE 65536

static void topk_window_task(void *ctx, unsigned t, unsigned nt)
{
    topk_job *j = ctx;
    size_t b, e;
    epipe_split_range(j->n, nt, t, 1, &b, &e);
#if TOPK_X86
    if (j->x86) {
        epipe_topk_window_avx2(j, b, e, t);
        return;
    }
#endif
    const float *restrict x = j->x;
    const uint32_t lo = j->wlo, hi = j->whi;
    uint32_t *restrict c = j->wcand + (size_t)t * (j->wcap + 8);
    size_t cnt = 0, cap = j->wcap;
    uint64_t above = 0, bad = 0;
    size_t i = b;
    for (; i < e; i += 16) {
        size_t end = e - i < 16 ? e : i + 16;
        unsigned any = 0, ab = 0, nf = 0;
        for (size_t l = i; l < end; l++) {
            uint32_t m = epipe_topk_mag(x[l]);
            ab += m > hi;
            nf += m >= 0x7f800000u;
            any |= (m >= lo) & (m <= hi);
        }
        above += ab;
        bad += nf;
        if (!any)
            continue;
        for (size_t l = i; l < end; l++) {
            uint32_t m = epipe_topk_mag(x[l]);
            if (m >= lo && m <= hi) {
                if (cnt == cap) { /* overflow: the caller falls back */
                    j->wcount[t] = SIZE_MAX;
                    j->wabove[t] = above;
                    j->wbad[t] = bad;
                    return;
                }
                c[cnt++] = m;
            }
        }
    }
    j->wcount[t] = cnt;
    j->wabove[t] = above;
    j->wbad[t] = bad;
}

/* Sorts a[0..n) ascending (two 16-bit LSD passes; cnt has 65536 slots). */
static void topk_sort_u32(uint32_t *a, uint32_t *tmp, size_t n, uint32_t *cnt)
{
    for (unsigned sh = 0; sh < 32; sh += 16) {
        memset(cnt, 0, TOPK_BINS * sizeof *cnt);
        for (size_t i = 0; i < n; i++)
            cnt[a[i] >> sh & 0xffffu]++;
        uint32_t sum = 0;
        for (size_t b = 0; b < TOPK_BINS; b++) {
            uint32_t v = cnt[b];
            cnt[b] = sum;
            sum += v;
        }
        for (size_t i = 0; i < n; i++)
            tmp[cnt[a[i] >> sh & 0xffffu]++] = a[i];
        memcpy(a, tmp, n * sizeof *a);
    }
}

/* Finds T and the per-range counts through the window; 1 when it did,
 * 0 when the caller must use the histograms, -1 on a non-finite value
 * (reported), -2 without memory. gt, eq: per range > T and == T. */
static int topk_by_window(topk_job *j, uint64_t k, uint64_t *gt, uint64_t *eq, uint64_t *scratch)
{
    size_t n = j->n, S = TOPK_SAMPLE;
    unsigned nt = j->nt;
    uint32_t *smp = malloc(2 * S * sizeof *smp);
    if (!smp)
        return -2;
    for (size_t i = 0; i < S; i++)
        smp[i] = epipe_topk_mag(j->x[(size_t)((uint64_t)i * n / S)]);
    topk_sort_u32(smp, smp + S, S, (uint32_t *)scratch);
    double p = (double)k / (double)n, sd = sqrt((double)S * p * (1 - p));
    double r = p * (double)S, margin = 4 * sd + 64;         /* descending rank of T in the sample */
    size_t top = r - margin < 1 ? 1 : (size_t)(r - margin); /* rank of whi */
    size_t bot = r + margin > (double)S ? S : (size_t)(r + margin) + 1; /* rank of wlo */
    j->whi = top <= 1 ? 0x7fffffffu : smp[S - top]; /* no bound: every magnitude */
    j->wlo = smp[S - bot];
    free(smp);
    double frac = (double)(bot - top + 1) / (double)S;
    j->wcap = (size_t)(2 * frac * (double)n / nt) + 4096;
    if (j->wcap > n / nt + 1)
        j->wcap = n / nt + 1;
    j->wcand = malloc((size_t)nt * (j->wcap + 8) * sizeof *j->wcand);
    uint64_t *cnts = malloc(3 * (size_t)nt * sizeof *cnts);
    if (!j->wcand || !cnts) {
        free(j->wcand);
        free(cnts);
        return -2;
    }
    j->wabove = cnts;
    j->wcount = cnts + nt;
    j->wbad = cnts + 2 * (size_t)nt;
    run(nt, topk_window_task, j);
    uint64_t above = 0, ncand = 0, bad = 0;
    int fits = 1;
    for (unsigned t = 0; t < nt; t++) {
        bad += j->wbad[t];
        above += j->wabove[t];
        if (j->wcount[t] == SIZE_MAX)
            fits = 0;
        else
            ncand += j->wcount[t];
    }
    int rc = 1;
    if (bad) {
        rc = -1;
    } else if (!fits || !(above < k && k <= above + ncand)) {
        rc = 0;
    } else {
        /* The (k - above)-th largest of the candidates, by 16-bit halves. */
        uint64_t need = k - above;
        memset(scratch, 0, TOPK_BINS * sizeof *scratch);
        for (unsigned t = 0; t < nt; t++)
            for (size_t i = 0; i < j->wcount[t]; i++)
                scratch[j->wcand[(size_t)t * (j->wcap + 8) + i] >> 16]++;
        uint32_t hi16 = topk_pick_bin(scratch, &need);
        memset(scratch, 0, TOPK_BINS * sizeof *scratch);
        for (unsigned t = 0; t < nt; t++)
            for (size_t i = 0; i < j->wcount[t]; i++) {
                uint32_t m = j->wcand[(size_t)t * (j->wcap + 8) + i];
                if (m >> 16 == hi16)
                    scratch[m & 0xffffu]++;
            }
        j->thr = hi16 << 16 | topk_pick_bin(scratch, &need);
        for (unsigned t = 0; t < nt; t++) {
            gt[t] = j->wabove[t];
            eq[t] = 0;
            for (size_t i = 0; i < j->wcount[t]; i++) {
                uint32_t m = j->wcand[(size_t)t * (j->wcap + 8) + i];
                gt[t] += m > j->thr;
                eq[t] += m == j->thr;
            }
        }
    }
    free(j->wcand);
    free(cnts);
    return rc;
}

/* The histogram path's second half: from the merged histogram of all
 * magnitudes, T and the per-range counts gt (> T) and eq (== T). */
static int topk_by_histograms(epipe_codec *c, topk_job *j, uint64_t k, uint64_t *merged,
                              uint64_t *gt, uint64_t *eq)
{
    unsigned nt = j->nt;
    uint64_t need = k;
    j->bin = topk_pick_bin(merged, &need);
    /* Above bin B, per range: from the histograms. */
    uint64_t ncand = merged[j->bin];
    for (unsigned t = 0; t < nt; t++) {
        const uint32_t *h = j->hist + (size_t)t * TOPK_BINS;
        gt[t] = 0;
        for (uint32_t bin = j->bin + 1; bin < TOPK_BINS; bin++)
            gt[t] += h[bin];
    }
    j->coff = j->off; /* reused: pass 2 runs before the offsets are set */
    uint64_t co = 0;
    for (unsigned t = 0; t < nt; t++) {
        j->coff[t] = co;
        co += j->hist[(size_t)t * TOPK_BINS + j->bin];
    }
    j->cand = malloc((size_t)ncand * sizeof *j->cand);
    if (!j->cand)
        return epipe_codec_fail(c, EPIPE_ENOMEM, "topk: out of memory for %llu candidates",
                                (unsigned long long)ncand);
    run(nt, topk_collect_task, j);
    memset(merged, 0, TOPK_BINS * sizeof *merged);
    for (uint64_t i = 0; i < ncand; i++)
        merged[j->cand[i]]++;
    uint32_t low = topk_pick_bin(merged, &need);
    j->thr = j->bin << 16 | low;
    for (unsigned t = 0; t < nt; t++) {
        uint64_t cb = j->coff[t], ce = t + 1 < nt ? j->coff[t + 1] : ncand;
        eq[t] = 0;
        for (uint64_t i = cb; i < ce; i++) {
            gt[t] += j->cand[i] > low;
            eq[t] += j->cand[i] == low;
        }
    }
    free(j->cand);
    return EPIPE_OK;
}

static int topk_encode(epipe_codec *c, const float *x, size_t n, uint8_t *body)
{
    if (n == 0)
        return EPIPE_OK;
    uint64_t k = topk_count(c, n);
    unsigned w = topk_index_bytes(n), nt = epipe_codec_workers(c, n);
    while ((n + nt - 1) / nt > UINT32_MAX) /* histogram counts are 32-bit */
        nt++;
    topk_job j = {.x = x, .n = n, .nt = nt, .idx = body, .val = body + k * w, .w = w};
    uint64_t *merged = malloc((TOPK_BINS + 4 * (size_t)nt) * sizeof *merged);
    if (!merged)
        return epipe_codec_fail(c, EPIPE_ENOMEM, "topk: out of memory for histograms");
    uint64_t *gt = merged + TOPK_BINS, *eq = gt + nt;
    j.off = eq + nt;
    j.quota = j.off + nt;
    int rc = EPIPE_OK, via = 0;
#if TOPK_X86
    j.x86 = epipe_q_simd_enabled() && __builtin_cpu_supports("avx2") &&
            __builtin_cpu_supports("popcnt");
#endif
    if (k < n && n >= TOPK_WINDOW_MIN)
        via = topk_by_window(&j, k, gt, eq, merged);
    if (via == -1) {
        rc = check_finite(c, x, n);
        goto out;
    }
    if (via == -2) {
        rc = epipe_codec_fail(c, EPIPE_ENOMEM, "topk: out of memory for the selection");
        goto out;
    }
    if (!via) {
        j.hist = malloc((size_t)nt * TOPK_BINS * sizeof *j.hist);
        if (!j.hist) {
            rc = epipe_codec_fail(c, EPIPE_ENOMEM, "topk: out of memory for histograms");
            goto out;
        }
        run(nt, topk_hist_task, &j);
        memset(merged, 0, TOPK_BINS * sizeof *merged);
        for (unsigned t = 0; t < nt; t++)
            for (uint32_t bin = 0; bin < TOPK_BINS; bin++)
                merged[bin] += j.hist[(size_t)t * TOPK_BINS + bin];
        for (uint32_t bin = TOPK_BAD_BIN; bin < TOPK_BINS; bin++)
            if (merged[bin]) {
                rc = check_finite(c, x, n);
                goto out;
            }
        if (k == n) { /* everything is kept: T = 0 and no quota */
            j.thr = 0;
            for (unsigned t = 0; t < nt; t++) {
                size_t b, e;
                epipe_split_range(n, nt, t, 1, &b, &e);
                j.off[t] = b;
                j.quota[t] = UINT64_MAX;
            }
            goto emit;
        }
        if ((rc = topk_by_histograms(c, &j, k, merged, gt, eq)))
            goto out;
    }
    uint64_t gt_all = 0, o = 0;
    for (unsigned t = 0; t < nt; t++)
        gt_all += gt[t];
    uint64_t eq_left = k - gt_all; /* entries equal to T still to keep, by index */
    for (unsigned t = 0; t < nt; t++) {
        j.off[t] = o;
        j.quota[t] = eq[t] < eq_left ? eq[t] : eq_left;
        eq_left -= j.quota[t];
        o += gt[t] + j.quota[t];
    }
emit:
    run(nt, topk_emit_task, &j);
out:
    free(merged);
    free(j.hist);
    return rc;
}

/* ---- reference: a full sort -------------------------------------------- */

typedef struct {
    float m;
    size_t i;
} topk_entry;

static int by_magnitude(const void *a, const void *b)
{
    const topk_entry *p = a, *q = b;
    if (p->m != q->m)
        return p->m < q->m ? 1 : -1;
    return (p->i > q->i) - (p->i < q->i);
}

static int by_index(const void *a, const void *b)
{
    const topk_entry *p = a, *q = b;
    return (p->i > q->i) - (p->i < q->i);
}

static int topk_encode_ref(epipe_codec *c, const float *x, size_t n, uint8_t *body)
{
    int rc = check_finite(c, x, n);
    if (rc || n == 0)
        return rc;
    uint64_t k = topk_count(c, n);
    unsigned w = topk_index_bytes(n);
    topk_entry *e = malloc(n * sizeof *e);
    if (!e)
        return epipe_codec_fail(c, EPIPE_ENOMEM, "topk: out of memory for %zu entries", n);
    for (size_t i = 0; i < n; i++)
        e[i] = (topk_entry){fabsf(x[i]), i};
    qsort(e, n, sizeof *e, by_magnitude);
    qsort(e, (size_t)k, sizeof *e, by_index);
    for (size_t r = 0; r < k; r++) {
        put_index(body + r * w, w, e[r].i);
        epipe_put_f32(body + k * w + 4 * r, x[e[r].i]);
    }
    free(e);
    return EPIPE_OK;
}

/* ---- decode ------------------------------------------------------------ */

static int topk_decode_impl(epipe_codec *c, const uint8_t *body, size_t n, float *y, int ref)
{
    uint64_t k = topk_count(c, n);
    unsigned w = topk_index_bytes(n);
    const uint8_t *vals = body + k * w;
    /* The reference validates everything before it writes; the fast path
     * validates and scatters in one pass. */
    if (n == 0)
        return EPIPE_OK;
    if (!ref)
        memset(y, 0, n * sizeof *y);
    for (int pass = ref ? 0 : 1; pass < 2; pass++) {
        uint64_t prev = 0;
        for (uint64_t r = 0; r < k; r++) {
            uint64_t i = w == 4 ? epipe_get_u32(body + r * w) : epipe_get_u64(body + r * w);
            float v = epipe_get_f32(vals + 4 * r);
            if (i >= n)
                return epipe_codec_fail(c, EPIPE_EPROTO,
                                        "topk: index %llu of entry %llu is out of range (n = %zu)",
                                        (unsigned long long)i, (unsigned long long)r, n);
            if (r && i <= prev)
                return epipe_codec_fail(c, EPIPE_EPROTO,
                                        "topk: indices not strictly increasing at entry %llu "
                                        "(%llu after %llu)",
                                        (unsigned long long)r, (unsigned long long)i,
                                        (unsigned long long)prev);
            if (!isfinite(v))
                return epipe_codec_fail(c, EPIPE_EPROTO, "topk: value of entry %llu is not finite",
                                        (unsigned long long)r);
            prev = i;
            if (pass == 1)
                y[i] = v;
        }
        if (pass == 0)
            memset(y, 0, n * sizeof *y);
    }
    return EPIPE_OK;
}

static int topk_decode(epipe_codec *c, const uint8_t *body, size_t n, float *y)
{
    return topk_decode_impl(c, body, n, y, 0);
}

static int topk_decode_ref(epipe_codec *c, const uint8_t *body, size_t n, float *y)
{
    return topk_decode_impl(c, body, n, y, 1);
}

static const epipe_codec_backend topk_cpu = {
    .encode = topk_encode,
    .decode = topk_decode,
    .encode_ref = topk_encode_ref,
    .decode_ref = topk_decode_ref,
};

const epipe_codec_ops epipe_codec_topk = {
    .name = "topk",
    .id = EPIPE_CODEC_ID_TOPK,
    .params = topk_params,
    .nparams = 1,
    .param_word = topk_param_word,
    .body_size = topk_body_size,
    .cpu = &topk_cpu,
};
