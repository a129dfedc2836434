/* `topk` on CUDA, byte-identical to the CPU (codecs/topk.c): the k entries
 * of largest magnitude, ties to the lower index, as index-ascending lists
 * of 32-bit indices and then values. The threshold T (the k-th largest
 * magnitude) is found exactly: a histogram of the magnitudes' top 11 bits
 * names the bin holding T, one pass counts per block the entries above
 * that bin and collects the indices in it, and two histograms of the
 * candidates resolve T's low 20 bits. Per block, the entries above T and
 * the first entries equal to T (as many as the quota the block gets, in
 * block order) are kept, so each block knows where its entries go and
 * writes them in index order with block-wide scans: three reads of x. */
#include <math.h>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "cuda_impl.h"

enum {
    TK_THREADS = 256,
    TK_BINS1 = 2048, /* magnitude bits 30..20 */
    TK_BINS2 = 4096, /* bits 19..8 */
    TK_BINS3 = 256,  /* bits 7..0 */
    TK_MAX_BLOCKS = 1024,
};

/* The selection's state on the device, between its kernels. */
struct tk_state {
    unsigned long long need; /* rank of T among what is left to resolve */
    unsigned bin1, bin2, thr;
    unsigned ncand;
};

__device__ static inline uint32_t tk_mag(float v)
{
    return __float_as_uint(v) & 0x7fffffffu;
}

/* The block's index range: nb contiguous ranges of R values (R a
 * multiple of 8), the last one short. */
__device__ static inline void tk_range(uint64_t n, uint64_t R, uint64_t *b, uint64_t *e)
{
    *b = blockIdx.x * R;
    *e = *b + R < n ? *b + R : n;
    if (*b > n)
        *b = n;
}

/* Pass 1: the histogram of the top 11 magnitude bits; non-finite values
 * go to the status word (the CPU refuses them: here the error is
 * deferred, and the counts stay consistent so nothing overflows). */
__global__ void tk_hist1(const float *x, uint64_t n, uint64_t R, unsigned *hist,
                         epipe_cuda_status *st)
{
    __shared__ unsigned h[TK_BINS1];
    for (unsigned i = threadIdx.x; i < TK_BINS1; i += blockDim.x)
        h[i] = 0;
    __syncthreads();
    uint64_t b, e;
    tk_range(n, R, &b, &e);
    /* eight values per thread and load (b is a multiple of 8), so that the
     * loads of a thread are in flight together */
    int vec = epipe_cuda_aligned16(x);
    for (uint64_t g = b / 8 + threadIdx.x; g * 8 < e; g += blockDim.x) {
        float v[8];
        epipe_cuda_load8f(x, e, g, vec, v);
        for (unsigned j = 0; j < 8 && g * 8 + j < e; j++) {
            uint32_t m = tk_mag(v[j]);
            if (m >= 0x7f800000u)
                epipe_cuda_note_nonfinite(st, v[j], g * 8 + j);
            atomicAdd(&h[m >> 20], 1u);
        }
    }
    __syncthreads();
    for (unsigned i = threadIdx.x; i < TK_BINS1; i += blockDim.x)
        if (h[i])
            atomicAdd(&hist[i], h[i]);
}

/* One block: the bin of hist[0..bins) holding the need-th largest (from
 * the top), and need's rank within it. */
template <unsigned BINS> __global__ void tk_select(const unsigned *hist, tk_state *s, int level)
{
    typedef cub::BlockScan<unsigned long long, TK_THREADS> scan_t;
    __shared__ typename scan_t::TempStorage tmp;
    enum { PER = BINS / TK_THREADS > 0 ? BINS / TK_THREADS : 1 };
    /* thread t holds bins counted from the top: t*PER .. t*PER+PER-1 */
    unsigned long long c[PER], sum = 0, before;
    unsigned long long need = s->need; /* read by all before the one write */
    for (unsigned j = 0; j < PER; j++) {
        unsigned top = threadIdx.x * PER + j;
        c[j] = top < BINS ? hist[BINS - 1 - top] : 0;
        sum += c[j];
    }
    scan_t(tmp).ExclusiveSum(sum, before);
    __syncthreads();
    for (unsigned j = 0; j < PER; j++) {
        unsigned top = threadIdx.x * PER + j;
        if (top < BINS && before < need && before + c[j] >= need) {
            unsigned bin = BINS - 1 - top;
            s->need = need - before;
            if (level == 1)
                s->bin1 = bin;
            else if (level == 2)
                s->bin2 = bin;
            else
                s->thr = s->bin1 << 20 | s->bin2 << 8 | bin;
        }
        before += c[j];
    }
}

/* Pass 2: per block, the entries above bin1 (into gt[block]), and the
 * indices of the entries in bin1 (the candidates), placed by a block scan
 * per tile of TK_TILE values and one atomic per tile. */
enum { TK_PER_THREAD = 16, TK_TILE = TK_THREADS * TK_PER_THREAD };

__global__ void __launch_bounds__(TK_THREADS)
    tk_collect(const float *x, uint64_t n, uint64_t R, tk_state *s, unsigned long long *gt,
               uint32_t *cand, uint32_t *cmag)
{
    typedef cub::BlockScan<unsigned, TK_THREADS> scan_t;
    typedef cub::BlockReduce<unsigned long long, TK_THREADS> red_t;
    __shared__ union {
        typename scan_t::TempStorage scan;
        typename red_t::TempStorage red;
    } tmp;
    __shared__ unsigned base;
    uint32_t bin = s->bin1;
    uint64_t b, e;
    tk_range(n, R, &b, &e);
    unsigned long long above = 0;
    for (uint64_t t0 = b; t0 < e; t0 += TK_TILE) {
        /* thread t reads values t, t + 256, ...: coalesced */
        unsigned in = 0;
        uint32_t mine[TK_PER_THREAD];
        for (unsigned j = 0; j < TK_PER_THREAD; j++) {
            uint64_t i = t0 + threadIdx.x + (uint64_t)j * TK_THREADS;
            uint32_t m = i < e ? tk_mag(x[i]) : 0;
            int c = i < e && m >> 20 == bin;
            above += i < e && m >> 20 > bin;
            mine[j] = c ? (uint32_t)i : 0xffffffffu;
            in += c;
        }
        unsigned at, total;
        scan_t(tmp.scan).ExclusiveSum(in, at, total);
        if (threadIdx.x == 0 && total)
            base = atomicAdd(&s->ncand, total);
        __syncthreads();
        for (unsigned j = 0; j < TK_PER_THREAD; j++)
            if (mine[j] != 0xffffffffu) {
                cmag[base + at] = tk_mag(x[mine[j]]); /* a cached re-read, for the few */
                cand[base + at++] = mine[j];
            }
        __syncthreads();
    }
    unsigned long long tot = red_t(tmp.red).Sum(above);
    if (threadIdx.x == 0)
        gt[blockIdx.x] = tot;
}

/* Histograms of the candidates' magnitudes: bits 19..8 (level 2), then
 * bits 7..0 of those in bin2 (level 3), privatised per block. */
__global__ void tk_hist_cand(const uint32_t *cmag, const tk_state *s, int level, unsigned *hist)
{
    __shared__ unsigned h[TK_BINS2];
    unsigned bins = level == 2 ? TK_BINS2 : TK_BINS3;
    for (unsigned i = threadIdx.x; i < bins; i += blockDim.x)
        h[i] = 0;
    __syncthreads();
    unsigned nc = s->ncand, bin2 = s->bin2;
    for (unsigned r = blockIdx.x * blockDim.x + threadIdx.x; r < nc; r += gridDim.x * blockDim.x) {
        uint32_t m = cmag[r];
        if (level == 2)
            atomicAdd(&h[(m >> 8) & 0xfffu], 1u);
        else if (((m >> 8) & 0xfffu) == bin2)
            atomicAdd(&h[m & 0xffu], 1u);
    }
    __syncthreads();
    for (unsigned i = threadIdx.x; i < bins; i += blockDim.x)
        if (h[i])
            atomicAdd(&hist[i], h[i]);
}

/* Per block: candidates above T join gt, those equal to T count in eq.
 * Neighbouring candidates mostly come from one block: a warp whose lanes
 * all do adds its counts with one atomic each. */
__global__ void tk_count(const uint32_t *cand, const uint32_t *cmag, const tk_state *s, uint64_t R,
                         unsigned long long *gt, unsigned long long *eq)
{
    unsigned nc = s->ncand, lane = threadIdx.x & 31u;
    uint32_t thr = s->thr;
    unsigned stride = gridDim.x * blockDim.x;
    for (unsigned base = blockIdx.x * blockDim.x + (threadIdx.x & ~31u); base < nc;
         base += stride) {
        unsigned r = base + lane;
        int valid = r < nc;
        uint32_t m = valid ? cmag[r] : 0;
        unsigned blk = valid ? (unsigned)(cand[r] / R) : ~0u;
        unsigned g = valid && m > thr, q = valid && m == thr;
        unsigned blk0 = __shfl_sync(0xffffffffu, blk, 0);
        if (__all_sync(0xffffffffu, !valid || blk == blk0)) {
            unsigned gs = __popc(__ballot_sync(0xffffffffu, g)),
                     qs = __popc(__ballot_sync(0xffffffffu, q));
            if (lane == 0 && gs)
                atomicAdd(&gt[blk0], (unsigned long long)gs);
            if (lane == 0 && qs)
                atomicAdd(&eq[blk0], (unsigned long long)qs);
        } else {
            if (g)
                atomicAdd(&gt[blk], 1ull);
            if (q)
                atomicAdd(&eq[blk], 1ull);
        }
    }
}

/* One block: each block's quota of entries equal to T (in block order,
 * as many as are still needed) and its output offset. */
__global__ void __launch_bounds__(TK_MAX_BLOCKS)
    tk_offsets(unsigned nb, const tk_state *s, const unsigned long long *gt,
               const unsigned long long *eq, unsigned long long *quota, unsigned long long *off)
{
    typedef cub::BlockScan<unsigned long long, TK_MAX_BLOCKS> scan_t;
    __shared__ typename scan_t::TempStorage tmp;
    unsigned b = threadIdx.x;
    unsigned long long e = b < nb ? eq[b] : 0, before;
    scan_t(tmp).ExclusiveSum(e, before);
    unsigned long long need = s->need; /* entries equal to T to keep */
    unsigned long long q = before >= need ? 0 : (need - before < e ? need - before : e);
    unsigned long long mine = b < nb ? gt[b] + q : 0, at;
    __syncthreads();
    scan_t(tmp).ExclusiveSum(mine, at);
    if (b < nb) {
        quota[b] = q;
        off[b] = at;
    }
}

/* Pass 3: each block writes its kept entries in index order from its
 * offset: per tile, a block scan of the entries equal to T (against the
 * quota) and one of the kept ones (for the positions). */
__global__ void tk_emit(const float *x, uint64_t n, uint64_t R, uint64_t k, const tk_state *s,
                        const unsigned long long *quota, const unsigned long long *off,
                        uint8_t *body)
{
    typedef cub::BlockScan<unsigned, TK_THREADS> scan_t;
    __shared__ typename scan_t::TempStorage tmp;
    __shared__ unsigned long long carry_eq, carry_out;
    uint32_t thr = s->thr;
    unsigned long long q = quota[blockIdx.x];
    uint64_t b, e;
    tk_range(n, R, &b, &e);
    if (threadIdx.x == 0)
        carry_eq = 0, carry_out = off[blockIdx.x];
    __syncthreads();
    uint8_t *idx = body, *val = body + k * 4;
    int aligned = ((uintptr_t)body & 3u) == 0; /* little-endian words */
    for (uint64_t t0 = b; t0 < e; t0 += 8ull * blockDim.x) {
        uint64_t i0 = t0 + 8ull * threadIdx.x;
        float v[8];
        uint32_t m[8];
        unsigned neq = 0;
        for (unsigned j = 0; j < 8; j++) {
            v[j] = i0 + j < e ? x[i0 + j] : 0.0f;
            m[j] = tk_mag(v[j]);
            neq += i0 + j < e && m[j] == thr;
        }
        unsigned eq_before, tile_eq;
        scan_t(tmp).ExclusiveSum(neq, eq_before, tile_eq);
        __syncthreads();
        unsigned long long rank = carry_eq + eq_before; /* of this thread's first == T */
        unsigned keep = 0;
        unsigned char kept[8];
        for (unsigned j = 0; j < 8; j++) {
            int in = i0 + j < e;
            int eqt = in && m[j] == thr;
            kept[j] = in && (m[j] > thr || (eqt && rank < q));
            rank += eqt;
            keep += kept[j];
        }
        unsigned out_before, tile_out;
        scan_t(tmp).ExclusiveSum(keep, out_before, tile_out);
        unsigned long long pos = carry_out + out_before;
        for (unsigned j = 0; j < 8; j++)
            if (kept[j]) {
                uint32_t i = (uint32_t)(i0 + j), u = __float_as_uint(v[j]);
                if (aligned) {
                    ((uint32_t *)idx)[pos] = i;
                    ((uint32_t *)val)[pos] = u;
                } else {
                    for (unsigned y = 0; y < 4; y++) {
                        idx[pos * 4 + y] = (uint8_t)(i >> (8 * y));
                        val[pos * 4 + y] = (uint8_t)(u >> (8 * y));
                    }
                }
                pos++;
            }
        __syncthreads();
        if (threadIdx.x == 0)
            carry_eq += tile_eq, carry_out += tile_out;
        __syncthreads();
    }
}

__global__ void tk_init(tk_state *s, uint64_t k)
{
    s->need = k;
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

static int topk_encode(epipe_codec *c, const float *x, size_t n, uint8_t *body)
{
    if (n > 0xffffffffull)
        return epipe_cuda_fail(c, EPIPE_ENOTSUP,
                               "topk: a CUDA tensor takes at most 2^32 - 1 values (this one has "
                               "%zu)",
                               n);
    if (!n)
        return EPIPE_OK;
    uint64_t k = topk_count(c, n);
    unsigned nb = (unsigned)((n + 4095) / 4096);
    nb = nb > (unsigned)TK_MAX_BLOCKS ? (unsigned)TK_MAX_BLOCKS : nb;
    uint64_t R = ((n + nb - 1) / nb + 7) & ~7ull;
    nb = (unsigned)((n + R - 1) / R);
    cudaStream_t s = epipe_cuda_stream(c);
    epipe_cuda_handle *h = epipe_cuda_h(c);
    /* work[0]: state, histograms, per-block counters; work[1]: candidates */
    size_t hist_at = 64, cnt_at = hist_at + 4 * (TK_BINS1 + TK_BINS2 + TK_BINS3);
    size_t bytes = cnt_at + 8 * 4 * (size_t)TK_MAX_BLOCKS;
    void *w, *cw, *d;
    int rc;
    if ((rc = epipe_cuda_grow(c, &h->work[0], bytes, &w)) ||
        (rc = epipe_cuda_grow(c, &h->work[1], 8 * n, &cw)) ||
        (rc = epipe_cuda_body_out(c, 0, 8 * k, &d)))
        return rc;
    tk_state *st = (tk_state *)w;
    unsigned *h1 = (unsigned *)((char *)w + hist_at), *h2 = h1 + TK_BINS1, *h3 = h2 + TK_BINS2;
    unsigned long long *gt = (unsigned long long *)((char *)w + cnt_at), *eq = gt + TK_MAX_BLOCKS,
                       *quota = eq + TK_MAX_BLOCKS, *off = quota + TK_MAX_BLOCKS;
    if ((rc = epipe_cuda_check(c, cudaMemsetAsync(w, 0, bytes, s), "clearing the histograms")))
        return rc;
    tk_init<<<1, 1, 0, s>>>(st, k);
    unsigned cblocks = epipe_cuda_blocks(n / 64 + 1, 256);
    tk_hist1<<<nb, TK_THREADS, 0, s>>>(x, n, R, h1, h->status);
    tk_select<TK_BINS1><<<1, TK_THREADS, 0, s>>>(h1, st, 1);
    uint32_t *cand = (uint32_t *)cw, *cmag = cand + n;
    tk_collect<<<nb, TK_THREADS, 0, s>>>(x, n, R, st, gt, cand, cmag);
    tk_hist_cand<<<cblocks, 256, 0, s>>>(cmag, st, 2, h2);
    tk_select<TK_BINS2><<<1, TK_THREADS, 0, s>>>(h2, st, 2);
    tk_hist_cand<<<cblocks, 256, 0, s>>>(cmag, st, 3, h3);
    tk_select<TK_BINS3><<<1, TK_THREADS, 0, s>>>(h3, st, 3);
    tk_count<<<cblocks, 256, 0, s>>>(cand, cmag, st, R, gt, eq);
    tk_offsets<<<1, TK_MAX_BLOCKS, 0, s>>>(nb, st, gt, eq, quota, off);
    /* The emit writes where the offsets say: after a failed launch before
     * it they are garbage, so the launches' status (the runtime keeps the
     * last failure until read) is read first. */
    if ((rc = epipe_cuda_check(c, cudaGetLastError(), "launching the topk kernels")))
        return rc;
    tk_emit<<<nb, TK_THREADS, 0, s>>>(x, n, R, k, st, quota, off, (uint8_t *)d);
    if ((rc = epipe_cuda_check(c, cudaGetLastError(), "launching the topk kernels")))
        return rc;
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
