/* `topk:ratio=r`: keep the ceil(r*n) entries of largest magnitude (ties to
 * the lower index) as sorted (index, value) lists; the rest decode as 0. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../lib/codec/codec_impl.h"
#include "../lib/parallel.h"
#include "../lib/tensor.h"

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

/* Magnitude as an integer: for finite floats, clearing the sign bit gives
 * bits whose unsigned order is the order of |x| (+0 and -0 are equal). */
static inline uint32_t mag(float v)
{
    union {
        float f;
        uint32_t u;
    } b = {.f = v};
    return b.u & 0x7fffffffu;
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
 * Pass 1 histograms the top 16 bits of mag(), pass 2 the low 16 bits
 * inside the bin holding the k-th largest; that gives the threshold T and
 * how many entries equal to T are kept (the first ones by index). Pass 3
 * counts per thread range, pass 4 writes each range at its offset, so the
 * indices come out ascending with no sort. All counts are integers: the
 * bytes are the same for every thread count. */

#define TOPK_BINS 65536

typedef struct topk_job {
    const float *x;
    size_t n;
    unsigned nt;
    uint64_t *hist;        /* [nt][TOPK_BINS] */
    uint32_t hi;           /* pass 2: the top-16-bit bin being refined */
    uint32_t thr;          /* passes 3-4: the threshold T */
    uint64_t *gt, *eq;     /* pass 3: per range counts of > T and == T */
    uint64_t *off, *quota; /* pass 4: per range output offset and == T to keep */
    uint8_t *idx, *val;
    unsigned w;
} topk_job;

static void topk_hist_task(void *ctx, unsigned t, unsigned nt, int level)
{
    topk_job *j = ctx;
    size_t b, e;
    epipe_split_range(j->n, nt, t, 1, &b, &e);
    uint64_t *h = j->hist + (size_t)t * TOPK_BINS;
    memset(h, 0, TOPK_BINS * sizeof *h);
    if (level == 1) {
        for (size_t i = b; i < e; i++)
            h[mag(j->x[i]) >> 16]++;
    } else {
        for (size_t i = b; i < e; i++) {
            uint32_t m = mag(j->x[i]);
            if (m >> 16 == j->hi)
                h[m & 0xffffu]++;
        }
    }
}

static void topk_hist1_task(void *ctx, unsigned t, unsigned nt)
{
    topk_hist_task(ctx, t, nt, 1);
}

static void topk_hist2_task(void *ctx, unsigned t, unsigned nt)
{
    topk_hist_task(ctx, t, nt, 2);
}

static void topk_count_task(void *ctx, unsigned t, unsigned nt)
{
    topk_job *j = ctx;
    size_t b, e;
    epipe_split_range(j->n, nt, t, 1, &b, &e);
    uint64_t gt = 0, eq = 0;
    for (size_t i = b; i < e; i++) {
        uint32_t m = mag(j->x[i]);
        gt += m > j->thr;
        eq += m == j->thr;
    }
    j->gt[t] = gt;
    j->eq[t] = eq;
}

static void topk_emit_task(void *ctx, unsigned t, unsigned nt)
{
    topk_job *j = ctx;
    size_t b, e;
    epipe_split_range(j->n, nt, t, 1, &b, &e);
    uint64_t o = j->off[t], quota = j->quota[t];
    for (size_t i = b; i < e; i++) {
        uint32_t m = mag(j->x[i]);
        if (m > j->thr || (m == j->thr && quota)) {
            quota -= m == j->thr;
            put_index(j->idx + o * j->w, j->w, i);
            epipe_put_f32(j->val + o * 4, j->x[i]);
            o++;
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

/* Merges the per-thread histograms and finds the bin holding the need-th
 * largest; *need becomes its rank inside that bin. */
static uint32_t topk_pick_bin(const topk_job *j, uint64_t *need)
{
    uint64_t above = 0;
    for (uint32_t bin = TOPK_BINS; bin-- > 0;) {
        uint64_t cnt = 0;
        for (unsigned t = 0; t < j->nt; t++)
            cnt += j->hist[(size_t)t * TOPK_BINS + bin];
        if (above + cnt >= *need) {
            *need -= above;
            return bin;
        }
        above += cnt;
    }
    return 0; /* unreachable: need <= n */
}

static int topk_encode(epipe_codec *c, const float *x, size_t n, uint8_t *body)
{
    int rc = check_finite(c, x, n);
    if (rc || n == 0)
        return rc;
    uint64_t k = topk_count(c, n);
    unsigned w = topk_index_bytes(n), nt = epipe_codec_workers(c, n);
    topk_job j = {.x = x, .n = n, .nt = nt, .idx = body, .val = body + k * w, .w = w};
    uint64_t small[4][4];
    if (k == n) {
        j.thr = 0; /* everything is >= 0: keep all */
    } else {
        j.hist = malloc((size_t)nt * TOPK_BINS * sizeof *j.hist);
        if (!j.hist)
            return epipe_codec_fail(c, EPIPE_ENOMEM, "topk: out of memory for histograms");
        uint64_t need = k;
        run(nt, topk_hist1_task, &j);
        j.hi = topk_pick_bin(&j, &need);
        run(nt, topk_hist2_task, &j);
        j.thr = j.hi << 16 | topk_pick_bin(&j, &need);
        free(j.hist);
    }
    uint64_t *cnt = nt <= 4 ? &small[0][0] : malloc((size_t)nt * 4 * sizeof *cnt);
    if (!cnt)
        return epipe_codec_fail(c, EPIPE_ENOMEM, "topk: out of memory");
    j.gt = cnt;
    j.eq = cnt + nt;
    j.off = cnt + 2 * (size_t)nt;
    j.quota = cnt + 3 * (size_t)nt;
    run(nt, topk_count_task, &j);
    uint64_t gt_all = 0, o = 0;
    for (unsigned t = 0; t < nt; t++)
        gt_all += j.gt[t];
    uint64_t eq_left = k - gt_all; /* entries equal to T still to keep, by index */
    for (unsigned t = 0; t < nt; t++) {
        j.off[t] = o;
        j.quota[t] = j.eq[t] < eq_left ? j.eq[t] : eq_left;
        eq_left -= j.quota[t];
        o += j.gt[t] + j.quota[t];
    }
    run(nt, topk_emit_task, &j);
    if (cnt != &small[0][0])
        free(cnt);
    return EPIPE_OK;
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
