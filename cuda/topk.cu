/* `topk` on CUDA, byte-identical to the CPU (codecs/topk.c): the k entries
 * of largest magnitude, ties to the lower index, as index-ascending lists
 * of 32-bit indices and then values.
 *
 * x is read once. Its first design read it three times (a histogram of the
 * magnitudes, a pass collecting the candidates, a pass writing the kept
 * entries): 0.149 ms for 12.8M values on an H100, 0.25x a device copy.
 *
 * 1. A sample of x (sortquant's strata, TK_SAMPLE values) and a radix select
 *    on it give a magnitude `lo` that the k-th largest magnitude T reaches
 *    but for a four-standard-deviation chance: about 1.1k entries are at or
 *    above it. Where x is no longer than the sample, the sample is x and lo
 *    is T.
 * 2. One pass over x stages, per block range, the entries whose magnitude
 *    is at least lo (index and value, in index order, in the range's own
 *    part of a scratch as long as x) and histograms their magnitudes' top
 *    11 bits.
 * 3. If fewer than k were staged (the sample misled), a second pass stages
 *    every entry; otherwise it returns at once.
 * 4. On the staged entries (in L2): two more histograms give T exactly
 *    (bits 19..8, then 7..0); each range counts its entries above T and
 *    equal to T; each range then writes its kept entries (those above T
 *    and, in range order, as many equal to T as are still needed) from its
 *    offset. These four phases are one cooperative launch with grid-wide
 *    barriers between them, or four launches where a cooperative launch is
 *    not possible or not worth it (small x). */
#include <math.h>

#include <cooperative_groups.h>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "cuda_impl.h"
#include "select.cuh"

namespace cg = cooperative_groups;

enum {
    TK_THREADS = 256,
    TK_TILE = 8 * TK_THREADS, /* values a stage block reads per round */
    TK_BINS1 = 2048,          /* magnitude bits 30..20 */
    TK_BINS2 = 4096,          /* bits 19..8 */
    TK_BINS3 = 256,           /* bits 7..0 */
    TK_MAX_RANGES = 1024,     /* 4 per thread in the emit's offset scans */
    TK_SAMPLE = 16384,        /* tests/gpu's topk_sample_misses() is built on it */
};

/* From this many values on, the phases take one cooperative launch. */
#define TK_COOP_MIN (1u << 16)

/* The selection's state on the device, between its kernels. */
struct tk_state {
    uint32_t lo;     /* magnitudes at or above it are staged (the first pass) */
    uint32_t staged; /* entries the first pass staged */
    uint32_t bin1, need1, bin2, need2, thr, need3;
};

/* What the phases share (one argument, for the cooperative launch). */
struct tk_job {
    uint64_t n, R, k;
    unsigned ranges;
    tk_state *st;
    const uint32_t *cnt, *sidx; /* staged per range; staged indices */
    const float *sval;          /* staged values */
    const uint32_t *h1;
    uint32_t *h2, *h3, *gt, *eq;
    uint8_t *body;
};

__device__ static inline uint32_t tk_mag(float v)
{
    return __float_as_uint(v) & 0x7fffffffu;
}

/* Range r's values: [r R, min(r R + R, n)) (R a multiple of 8). */
__device__ static inline void tk_range(unsigned r, uint64_t n, uint64_t R, uint64_t *b,
                                       uint64_t *e)
{
    *b = r * R < n ? r * R : n;
    *e = *b + R < n ? *b + R : n;
}

/* Magnitudes in descending order: the select's ascending keys. */
struct tk_sel_key {
    __device__ uint32_t operator()(float v) const
    {
        return ~tk_mag(v);
    }
};

/* lo: the magnitude of rank r (from 0, descending) in the sample of m, or 0
 * (stage everything) where r >= m. One block of EPIPE_CUDA_SEL_THREADS. */
__global__ void __launch_bounds__(EPIPE_CUDA_SEL_THREADS)
    tk_pick(const float *smp, uint64_t m, int vec, uint64_t r, tk_state *st)
{
    uint32_t lo = 0;
    if (r < m)
        lo = ~epipe_cuda_select(smp, m, vec, (uint32_t)r, tk_sel_key()) & 0x7fffffffu;
    if (threadIdx.x == 0)
        st->lo = lo;
}

/* Stages range blockIdx.x's entries of magnitude >= lo: through shared
 * memory a round at a time, so that the writes are whole lines. The first
 * pass (again = 0) uses the sample's lo and notes non-finite values (the
 * CPU refuses them: here the error is deferred, and the counts stay
 * consistent so nothing overflows). The second (again = 1) runs only if
 * the first staged fewer than k: it stages every entry, and adds to h1
 * only those the first pass left out. */
__global__ void __launch_bounds__(TK_THREADS, 8)
    tk_stage(const float *x, uint64_t n, uint64_t R, uint64_t k, int vec, tk_state *st,
             uint32_t *cnt, uint32_t *h1, uint32_t *sidx, float *sval, epipe_cuda_status *status,
             int again)
{
    typedef cub::BlockScan<unsigned, TK_THREADS> scan_t;
    __shared__ typename scan_t::TempStorage tmp;
    __shared__ uint32_t hist[TK_BINS1];
    __shared__ uint32_t tile_idx[TK_TILE];
    __shared__ float tile_val[TK_TILE];
    if (again && st->staged >= k)
        return;
    uint32_t first = st->lo, lo = again ? 0 : first;
    for (unsigned i = threadIdx.x; i < TK_BINS1; i += blockDim.x)
        hist[i] = 0;
    __syncthreads();
    uint64_t b, e;
    tk_range(blockIdx.x, n, R, &b, &e);
    uint32_t staged = 0; /* the same in every thread */
    for (uint64_t t0 = b; t0 < e; t0 += TK_TILE) {
        uint64_t g = t0 / 8 + threadIdx.x; /* eight values a thread, two loads */
        float v[8];
        epipe_cuda_load8f(x, e, g, vec, v);
        unsigned mine = 0;
        bool keep[8];
        for (unsigned j = 0; j < 8; j++) {
            uint64_t i = g * 8 + j;
            uint32_t m = tk_mag(v[j]);
            keep[j] = i < e && m >= lo;
            if (!again && i < e && m >= 0x7f800000u)
                epipe_cuda_note_nonfinite(status, v[j], i);
            epipe_cuda_hist_add(hist, m >> 20, keep[j] && (!again || m < first));
            mine += keep[j];
        }
        unsigned at, total;
        scan_t(tmp).ExclusiveSum(mine, at, total);
        for (unsigned j = 0; j < 8; j++)
            if (keep[j]) {
                tile_idx[at] = (uint32_t)(g * 8 + j);
                tile_val[at++] = v[j];
            }
        __syncthreads();
        for (unsigned u = threadIdx.x; u < total; u += blockDim.x) {
            sidx[b + staged + u] = tile_idx[u];
            sval[b + staged + u] = tile_val[u];
        }
        staged += total;
        __syncthreads(); /* the tile and the scan's storage are reused */
    }
    for (unsigned i = threadIdx.x; i < TK_BINS1; i += blockDim.x)
        if (hist[i])
            atomicAdd(&h1[i], hist[i]);
    if (threadIdx.x == 0) {
        cnt[blockIdx.x] = staged;
        if (!again)
            atomicAdd(&st->staged, staged);
    }
}

/* By the whole block: the bin of hist[0..BINS) holding the need-th largest
 * (counted from the top bin) and need's rank within it (from 1). */
template <unsigned BINS>
__device__ static void tk_find(const uint32_t *hist, uint32_t need, uint32_t *bin, uint32_t *rest)
{
    typedef cub::BlockScan<uint32_t, TK_THREADS> scan_t;
    __shared__ typename scan_t::TempStorage tmp;
    __shared__ uint32_t found_bin, found_rest;
    enum { PER = BINS / TK_THREADS > 0 ? BINS / TK_THREADS : 1 };
    /* thread t holds the bins t*PER .. t*PER+PER-1 counted from the top */
    uint32_t c[PER], sum = 0, before;
    if (threadIdx.x == 0)
        found_bin = 0, found_rest = 1; /* counts that cannot hold need: any bin */
    for (unsigned j = 0; j < PER; j++) {
        unsigned top = threadIdx.x * PER + j;
        c[j] = top < BINS ? hist[BINS - 1 - top] : 0;
        sum += c[j];
    }
    scan_t(tmp).ExclusiveSum(sum, before);
    __syncthreads();
    for (unsigned j = 0; j < PER; j++) {
        unsigned top = threadIdx.x * PER + j;
        if (top < BINS && before < need && need - before <= c[j]) {
            found_bin = BINS - 1 - top;
            found_rest = need - before;
        }
        before += c[j];
    }
    __syncthreads();
    *bin = found_bin;
    *rest = found_rest;
    __syncthreads(); /* all have read found_* before a next call writes them */
}

/* Range r's staged entries: [r R, r R + count), count no more than the
 * range holds (so that even garbage counts stay in bounds). */
__device__ static inline uint32_t tk_staged(const tk_job &a, unsigned r, uint64_t *base)
{
    uint64_t b, e;
    tk_range(r, a.n, a.R, &b, &e);
    *base = b;
    return a.cnt[r] < e - b ? a.cnt[r] : (uint32_t)(e - b);
}

/* Phase 0 and 1: the histogram of bits 19..8 of the staged magnitudes in
 * bin1, then that of bits 7..0 of those also in bin2. */
__device__ static void tk_hist_staged(const tk_job &a, int level)
{
    __shared__ uint32_t h[TK_BINS2];
    uint32_t bin1, need1, bin2 = 0, need2;
    if (level == 2) {
        tk_find<TK_BINS1>(a.h1, (uint32_t)a.k, &bin1, &need1);
        if (blockIdx.x == 0 && threadIdx.x == 0)
            a.st->bin1 = bin1, a.st->need1 = need1;
    } else {
        bin1 = a.st->bin1;
        tk_find<TK_BINS2>(a.h2, a.st->need1, &bin2, &need2);
        if (blockIdx.x == 0 && threadIdx.x == 0)
            a.st->bin2 = bin2, a.st->need2 = need2;
    }
    unsigned bins = level == 2 ? TK_BINS2 : TK_BINS3;
    uint32_t prefix = level == 2 ? bin1 : bin1 << 12 | bin2, shift = level == 2 ? 20 : 8;
    for (unsigned i = threadIdx.x; i < bins; i += blockDim.x)
        h[i] = 0;
    __syncthreads();
    for (unsigned r = blockIdx.x; r < a.ranges; r += gridDim.x) {
        uint64_t base;
        uint32_t c = tk_staged(a, r, &base);
        for (uint32_t u0 = 0; u0 < c; u0 += blockDim.x) { /* whole warps */
            uint32_t u = u0 + threadIdx.x;
            uint32_t m = u < c ? tk_mag(a.sval[base + u]) : 0;
            unsigned bin = level == 2 ? m >> 8 & 0xfffu : m & 0xffu;
            epipe_cuda_hist_add(h, bin, u < c && m >> shift == prefix);
        }
    }
    __syncthreads();
    uint32_t *out = level == 2 ? a.h2 : a.h3;
    for (unsigned i = threadIdx.x; i < bins; i += blockDim.x)
        if (h[i])
            atomicAdd(&out[i], h[i]);
}

/* Phase 2: T, and per range the staged entries above T and equal to T. */
__device__ static void tk_count(const tk_job &a)
{
    typedef cub::BlockReduce<unsigned long long, TK_THREADS> red_t;
    __shared__ typename red_t::TempStorage tmp;
    uint32_t bin3, need3;
    tk_find<TK_BINS3>(a.h3, a.st->need2, &bin3, &need3);
    uint32_t thr = a.st->bin1 << 20 | a.st->bin2 << 8 | bin3;
    if (blockIdx.x == 0 && threadIdx.x == 0)
        a.st->thr = thr, a.st->need3 = need3;
    for (unsigned r = blockIdx.x; r < a.ranges; r += gridDim.x) {
        uint64_t base;
        uint32_t c = tk_staged(a, r, &base);
        unsigned long long both = 0; /* above T << 32 | equal to T */
        for (uint32_t u = threadIdx.x; u < c; u += blockDim.x) {
            uint32_t m = tk_mag(a.sval[base + u]);
            both += m > thr ? 1ull << 32 : m == thr;
        }
        both = red_t(tmp).Sum(both);
        if (threadIdx.x == 0) {
            a.gt[r] = (uint32_t)(both >> 32);
            a.eq[r] = (uint32_t)both;
        }
        __syncthreads(); /* the reduction's storage is reused */
    }
}

/* Phase 3: each range's quota of entries equal to T (in range order, as
 * many as are still needed) and its offset, by every block for all
 * ranges (4 a thread); then the block's ranges written from their offsets,
 * 256 staged entries a round, placed by one scan of (above T, equal to T)
 * pairs. */
__device__ static void tk_emit(const tk_job &a)
{
    typedef cub::BlockScan<uint32_t, TK_THREADS> scan_t;
    __shared__ typename scan_t::TempStorage tmp;
    __shared__ uint32_t quota[TK_MAX_RANGES], off[TK_MAX_RANGES];
    uint32_t thr = a.st->thr, need = a.st->need3;
    uint32_t e4[4], g4[4], esum = 0, osum = 0, ebefore, obefore;
    for (unsigned j = 0; j < 4; j++) {
        unsigned r = threadIdx.x * 4 + j;
        e4[j] = r < a.ranges ? a.eq[r] : 0;
        g4[j] = r < a.ranges ? a.gt[r] : 0;
        esum += e4[j];
    }
    scan_t(tmp).ExclusiveSum(esum, ebefore);
    for (unsigned j = 0; j < 4; j++) {
        uint32_t q = ebefore >= need ? 0 : need - ebefore < e4[j] ? need - ebefore : e4[j];
        ebefore += e4[j];
        quota[threadIdx.x * 4 + j] = q;
        osum += g4[j] + q;
    }
    __syncthreads();
    scan_t(tmp).ExclusiveSum(osum, obefore);
    for (unsigned j = 0; j < 4; j++) {
        unsigned r = threadIdx.x * 4 + j;
        off[r] = obefore;
        obefore += g4[j] + quota[r];
    }
    __syncthreads();
    uint8_t *idx = a.body, *val = a.body + a.k * 4;
    int aligned = ((uintptr_t)a.body & 3u) == 0; /* little-endian words */
    for (unsigned r = blockIdx.x; r < a.ranges; r += gridDim.x) {
        uint64_t base;
        uint32_t c = tk_staged(a, r, &base);
        uint32_t eq_seen = 0, out = off[r], q = quota[r]; /* the same in every thread */
        for (uint32_t u0 = 0; u0 < c; u0 += blockDim.x) {
            uint32_t u = u0 + threadIdx.x;
            float v = u < c ? a.sval[base + u] : 0.0f;
            uint32_t i = u < c ? a.sidx[base + u] : 0, m = tk_mag(v);
            uint32_t gt = u < c && m > thr, eq = u < c && m == thr, before, round;
            scan_t(tmp).ExclusiveSum(gt << 16 | eq, before, round);
            /* the first q - eq_seen entries equal to T in this round are kept */
            uint32_t left = q > eq_seen ? q - eq_seen : 0, eq_before = before & 0xffffu;
            uint64_t pos = (uint64_t)out + (before >> 16) + (eq_before < left ? eq_before : left);
            if ((gt || (eq && eq_before < left)) && pos < a.k) {
                uint32_t word = __float_as_uint(v);
                if (aligned) {
                    ((uint32_t *)idx)[pos] = i;
                    ((uint32_t *)val)[pos] = word;
                } else {
                    for (unsigned y = 0; y < 4; y++) {
                        idx[pos * 4 + y] = (uint8_t)(i >> (8 * y));
                        val[pos * 4 + y] = (uint8_t)(word >> (8 * y));
                    }
                }
            }
            uint32_t round_eq = round & 0xffffu;
            out += (round >> 16) + (round_eq < left ? round_eq : left);
            eq_seen += round_eq;
            __syncthreads(); /* the scan's storage is reused */
        }
    }
}

__device__ static void tk_phase(const tk_job &a, int phase)
{
    if (phase == 0)
        tk_hist_staged(a, 2);
    else if (phase == 1)
        tk_hist_staged(a, 3);
    else if (phase == 2)
        tk_count(a);
    else
        tk_emit(a);
}

__global__ void __launch_bounds__(TK_THREADS) tk_phase_kernel(tk_job a, int phase)
{
    tk_phase(a, phase);
}

__global__ void __launch_bounds__(TK_THREADS) tk_finish(tk_job a)
{
    cg::grid_group grid = cg::this_grid();
    for (int phase = 0; phase < 4; phase++) {
        if (phase)
            grid.sync();
        tk_phase(a, phase);
    }
}

/* Blocks of tk_finish that a cooperative launch may have on `device`, and
 * its cache entry (epipe_cuda_coop_launch()). */
static int finish_blocks(int device, int **entry)
{
    static int cache[64];
    return epipe_cuda_coop_blocks((const void *)tk_finish, TK_THREADS, device, cache, entry);
}

static uint64_t topk_count(const epipe_codec *c, uint64_t n) /* as codecs/topk.c */
{
    if (n == 0)
        return 0;
    double k = ceil(c->p[0] * (double)n);
    if (!(k < (double)n))
        return n;
    return k < 1 ? 1 : (uint64_t)k;
}

/* The sample rank (from 0, descending) that stages about k entries and at
 * least k but for a four-standard-deviation chance: the expected count of
 * sample values above T, four of its standard deviations, and 8. Where the
 * sample is x, exactly k - 1: lo is T. */
static uint64_t sample_rank(uint64_t n, uint64_t k, uint64_t m)
{
    if (m == n)
        return k - 1;
    double p = (double)k / (double)n, mu = p * (double)m;
    double want = ceil(mu + 4.0 * sqrt(mu * (1.0 - p))) + 8.0;
    return want < (double)m ? (uint64_t)want : m;
}

static int topk_encode(epipe_codec *c, const float *x, size_t n, uint8_t *body)
{
    if (n > 0xffffffffull)
        return epipe_cuda_fail(c, EPIPE_ENOTSUP,
                               "topk: a CUDA tensor takes at most 2^32 - 1 values (this one has "
                               "%zu)",
                               n);
    if (!n)
        return EPIPE_OK;
    uint64_t k = topk_count(c, n), m = n < (uint64_t)TK_SAMPLE ? n : (uint64_t)TK_SAMPLE;
    unsigned nb = (unsigned)((n + 4095) / 4096);
    nb = nb > (unsigned)TK_MAX_RANGES ? (unsigned)TK_MAX_RANGES : nb;
    uint64_t R = ((n + nb - 1) / nb + 7) & ~7ull;
    nb = (unsigned)((n + R - 1) / R);
    cudaStream_t s = epipe_cuda_stream(c);
    epipe_cuda_handle *h = epipe_cuda_h(c);
    /* work[0]: the state, the histograms, the per-range counts (all
     * cleared), then the sample; work[1]: the staged entries */
    size_t hist_at = 64, cnt_at = hist_at + 4 * (TK_BINS1 + TK_BINS2 + TK_BINS3);
    size_t smp_at = (cnt_at + 4 * 3 * (size_t)TK_MAX_RANGES + 255) & ~(size_t)255;
    void *w, *sw, *d;
    int rc;
    if ((rc = epipe_cuda_grow(c, &h->work[0], smp_at + 4 * m, &w)) ||
        (rc = epipe_cuda_grow(c, &h->work[1], 8 * n, &sw)) ||
        (rc = epipe_cuda_body_out(c, 0, 8 * k, &d)))
        return rc;
    tk_job a;
    a.n = n, a.R = R, a.k = k, a.ranges = nb;
    a.st = (tk_state *)w;
    uint32_t *h1 = (uint32_t *)((char *)w + hist_at), *cnt = (uint32_t *)((char *)w + cnt_at);
    a.h1 = h1, a.h2 = h1 + TK_BINS1, a.h3 = a.h2 + TK_BINS2;
    a.cnt = cnt, a.gt = cnt + TK_MAX_RANGES, a.eq = a.gt + TK_MAX_RANGES;
    uint32_t *sidx = (uint32_t *)sw;
    float *sval = (float *)(sidx + n), *smp = (float *)((char *)w + smp_at);
    a.sidx = sidx, a.sval = sval, a.body = (uint8_t *)d;
    if ((rc = epipe_cuda_check(c, cudaMemsetAsync(w, 0, smp_at, s), "clearing the histograms")))
        return rc;
    int vec = epipe_cuda_aligned16(x);
    epipe_cuda_sample<<<epipe_cuda_blocks(m, 256), 256, 0, s>>>(x, n, m, smp);
    tk_pick<<<1, EPIPE_CUDA_SEL_THREADS, 0, s>>>(smp, m, epipe_cuda_aligned16(smp),
                                                 sample_rank(n, k, m), a.st);
    for (int again = 0; again < 2; again++)
        tk_stage<<<nb, TK_THREADS, 0, s>>>(x, n, R, k, vec, a.st, cnt, h1, sidx, sval, h->status,
                                           again);
    /* The emit writes where the counts say: after a failed launch before
     * it they are garbage (it keeps to the body, but writes nonsense), so
     * the launches' status (the runtime keeps the last failure until read)
     * is read first. */
    if ((rc = epipe_cuda_check(c, cudaGetLastError(), "launching the topk kernels")))
        return rc;
    int *coop, launched = 0;
    int blocks = finish_blocks(h->device, &coop);
    if (n >= TK_COOP_MIN && blocks > 0) {
        unsigned grid = nb < (unsigned)blocks ? nb : (unsigned)blocks;
        void *args[] = {(void *)&a};
        launched = epipe_cuda_coop_launch(c, (const void *)tk_finish, grid, TK_THREADS, args, s,
                                          coop, "launching the topk kernel");
        if (launched < 0)
            return launched;
    }
    if (!launched) { /* the same phases in four launches */
        for (int phase = 0; phase < 4; phase++) {
            if (phase == 3 &&
                (rc = epipe_cuda_check(c, cudaGetLastError(), "launching the topk kernels")))
                return rc;
            tk_phase_kernel<<<nb, TK_THREADS, 0, s>>>(a, phase);
        }
        if ((rc = epipe_cuda_check(c, cudaGetLastError(), "launching the topk kernels")))
            return rc;
    }
    return epipe_cuda_body_flush(c, body, 0, d, 8 * k);
}

/* The scatter, checking every entry as the CPU does; a bad entry is
 * recorded (the smallest entry, with what is wrong) for synchronize. */
__global__ void tk_scatter(const uint8_t *body, uint64_t k, uint64_t n, float *y,
                           epipe_cuda_status *st)
{
    const uint8_t *vals = body + k * 4;
    for (uint64_t r = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; r < k;
         r += (uint64_t)gridDim.x * blockDim.x) {
        const uint8_t *p = body + 4 * r, *q = vals + 4 * r;
        uint32_t i = p[0] | p[1] << 8 | p[2] << 16 | (uint32_t)p[3] << 24;
        uint32_t u = q[0] | q[1] << 8 | q[2] << 16 | (uint32_t)q[3] << 24;
        uint32_t prev = r ? p[-4] | p[-3] << 8 | p[-2] << 16 | (uint32_t)p[-1] << 24 : 0;
        float v = __uint_as_float(u);
        unsigned kind = i >= n                ? EPIPE_CUDA_BAD_RANGE
                        : r && i <= prev      ? EPIPE_CUDA_BAD_ORDER
                        : !epipe_hd_finite(v) ? EPIPE_CUDA_BAD_VALUE
                                              : 0;
        if (kind)
            atomicMin(&st->bad, (unsigned long long)r << 2 | kind);
        else
            y[i] = v;
    }
}

static int topk_decode(epipe_codec *c, const uint8_t *body, size_t n, float *y)
{
    if (!n)
        return EPIPE_OK;
    uint64_t k = topk_count(c, n);
    cudaStream_t s = epipe_cuda_stream(c);
    const void *d;
    int rc;
    if ((rc = epipe_cuda_body_in(c, body, 0, 8 * k, &d)) ||
        (rc = epipe_cuda_check(c, cudaMemsetAsync(y, 0, n * sizeof(float), s), "clearing dst")))
        return rc;
    tk_scatter<<<epipe_cuda_blocks(k, 256), 256, 0, s>>>((const uint8_t *)d, k, n, y,
                                                         epipe_cuda_h(c)->status);
    return epipe_cuda_check(c, cudaGetLastError(), "launching the topk scatter");
}

const epipe_codec_backend epipe_cuda_topk = {topk_encode, topk_decode, NULL, NULL, 0, NULL};
