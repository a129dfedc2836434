/* Selection on a sample, shared by sortquant (its boundaries) and topk (its
 * staging threshold): the sample drawn as sortquant's CPU code draws it, a
 * warp-aggregated histogram count, a radix select by one block (topk: one
 * rank of a small sample), and a radix select of many ranks at once by the
 * whole GPU (sortquant). */
#ifndef EPIPE_CUDA_SELECT_CUH
#define EPIPE_CUDA_SELECT_CUH

#include <cub/block/block_scan.cuh>

#include "../codecs/inline/sortquant.h"
#include "cuda_impl.h"

/* out[j] = x[epipe_hd_sq_sample_pos(j, n, m)], j < m: one value from each of
 * m strata of x, at a hashed place in its stratum. */
__global__ static void epipe_cuda_sample(const float *x, uint64_t n, uint64_t m, float *out)
{
    for (uint64_t k = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; k < m;
         k += (uint64_t)gridDim.x * blockDim.x)
        out[k] = x[epipe_hd_sq_sample_pos(k, n, m)];
}

/* hist[bin] += 1 for each lane whose `on` is set. Where more than 8 lanes
 * of the warp are on, one shared atomic per distinct bin among them (a ReLU
 * tensor puts half its keys in one bin, and conflicting atomics take turns);
 * where fewer, a plain atomic each, which costs less than the match. Every
 * lane of the warp must call it. */
__device__ static inline void epipe_cuda_hist_add(uint32_t *hist, unsigned bin, bool on)
{
    unsigned lanes = __ballot_sync(0xffffffffu, on);
    if (__popc(lanes) <= 8) {
        if (on)
            atomicAdd(&hist[bin], 1u);
        return;
    }
    unsigned peers = __match_any_sync(0xffffffffu, on ? bin : 0xffffffffu);
    if (on && (threadIdx.x & 31) == (unsigned)(__ffs(peers) - 1))
        atomicAdd(&hist[bin], (uint32_t)__popc(peers));
}

enum { EPIPE_CUDA_SEL_THREADS = 1024, EPIPE_CUDA_SEL_BINS = 2048, EPIPE_CUDA_SEL_UNROLL = 4 };

/* Bits each radix pass fixes (11, 11, then 10): its shift and its bins. */
__host__ __device__ static inline unsigned epipe_cuda_sel_shift(int pass)
{
    return pass == 0 ? 21u : pass == 1 ? 10u : 0u;
}
__host__ __device__ static inline unsigned epipe_cuda_sel_bins(int pass)
{
    return pass < 2 ? 2048u : 1024u;
}

/* The bin of the histogram hist (bins <= EPIPE_CUDA_SEL_BINS, two a
 * thread) that holds the candidate of rank `rank`, and that candidate's
 * rank within it, in every thread. Called by all EPIPE_CUDA_SEL_THREADS
 * threads of the block, with rank below the histogram's total. */
__device__ static inline void epipe_cuda_sel_bin(const uint32_t *hist, unsigned bins, uint32_t rank,
                                                 uint32_t *bin, uint32_t *rank_in)
{
    typedef cub::BlockScan<uint32_t, EPIPE_CUDA_SEL_THREADS> scan_t;
    __shared__ typename scan_t::TempStorage tmp;
    __shared__ uint32_t found_bin, found_rank;
    const unsigned b0 = 2 * threadIdx.x, b1 = b0 + 1;
    uint32_t c0 = b0 < bins ? hist[b0] : 0u, c1 = b1 < bins ? hist[b1] : 0u, before;
    scan_t(tmp).ExclusiveSum(c0 + c1, before);
    if (before <= rank && rank < before + c0) {
        found_bin = b0;
        found_rank = rank - before;
    } else if (before + c0 <= rank && rank < before + c0 + c1) {
        found_bin = b1;
        found_rank = rank - before - c0;
    }
    __syncthreads();
    *bin = found_bin;
    *rank_in = found_rank;
    __syncthreads(); /* all have read found_* and tmp before a next call */
}

/* The first i < n with a[i] >= v (a ascending), or n. */
__device__ static inline unsigned epipe_cuda_lower_bound(const uint32_t *a, unsigned n, uint32_t v)
{
    unsigned lo = 0;
    while (lo < n) {
        unsigned mid = (lo + n) / 2;
        if (a[mid] < v)
            lo = mid + 1;
        else
            n = mid;
    }
    return lo;
}

/* The key of rank `rank` (from 0, ascending) among key(smp[i]), i < m, by
 * radix select: 11, 11 and 10 bits a pass over the sample (4m bytes, which
 * stay in L2 for the samples used here). Called by all
 * EPIPE_CUDA_SEL_THREADS threads of the block, with rank < m <= 2^32; each
 * gets the key. smp is read as float4 where `vec` says it is aligned. */
template <class Key>
__device__ static uint32_t epipe_cuda_select(const float *smp, uint64_t m, int vec, uint32_t rank,
                                             Key key)
{
    __shared__ uint32_t hist[EPIPE_CUDA_SEL_BINS];
    enum { T = EPIPE_CUDA_SEL_THREADS, U = EPIPE_CUDA_SEL_UNROLL };
    uint32_t prefix = 0, mask = 0;
    const float4 *s4 = (const float4 *)smp;
    uint64_t quads = (m + 3) / 4, per_round = (uint64_t)T * U;
    for (unsigned pass = 0; pass < 3; pass++) {
        unsigned shift = epipe_cuda_sel_shift(pass), bins = epipe_cuda_sel_bins(pass);
        for (unsigned b = threadIdx.x; b < EPIPE_CUDA_SEL_BINS; b += blockDim.x)
            hist[b] = 0;
        __syncthreads();
        /* every thread runs the same rounds (epipe_cuda_hist_add needs the
         * whole warp); a round's loads are issued before any is used */
        for (uint64_t r = 0; r < quads; r += per_round) {
            float v[U][4];
#pragma unroll
            for (unsigned u = 0; u < U; u++) {
                uint64_t g = r + threadIdx.x + (uint64_t)u * T;
                if (vec && (g + 1 < quads || (g + 1 == quads && m % 4 == 0))) {
                    float4 f = s4[g];
                    v[u][0] = f.x;
                    v[u][1] = f.y;
                    v[u][2] = f.z;
                    v[u][3] = f.w;
                } else {
                    for (unsigned i = 0; i < 4; i++)
                        v[u][i] = g * 4 + i < m ? smp[g * 4 + i] : 0.0f;
                }
            }
#pragma unroll
            for (unsigned u = 0; u < U; u++)
#pragma unroll
                for (unsigned i = 0; i < 4; i++) {
                    uint64_t at = (r + threadIdx.x + (uint64_t)u * T) * 4 + i;
                    uint32_t k = key(v[u][i]);
                    epipe_cuda_hist_add(hist, k >> shift & (bins - 1),
                                        at < m && (k & mask) == prefix);
                }
        }
        __syncthreads();
        /* the bin holding the rank-th candidate, and its rank there */
        uint32_t bin;
        epipe_cuda_sel_bin(hist, bins, rank, &bin, &rank);
        prefix |= bin << shift;
        mask |= (bins - 1) << shift;
    }
    return prefix;
}

/* ---- many ranks at once, by the whole GPU ------------------------------------
 *
 * The same three radix passes (11, 11 and 10 bits) for `count` ranks, each
 * pass two launches: a histogram of the sample by many blocks, then one
 * block a rank finding the bin that holds it. Ranks whose keys share the
 * bits fixed so far share a histogram: a value counts in the one of its
 * prefix, found by a binary search of the ranks' prefixes (ascending,
 * since the ranks are). sortquant's one-block-a-rank select read its
 * 65,536-value sample three times in each of its blocks: 94 us for three
 * ranks on an H200 (ncu), nearly the time of the pass over the tensor. */

enum { EPIPE_CUDA_MSEL_THREADS = 256, EPIPE_CUDA_MSEL_MAX = 256 };

/* Pass `pass`'s histograms: pass 0 one (every rank's prefix is empty);
 * later passes one per distinct prefix, at the index of the first rank
 * that has it (2048 or 1024 bins apart). */
template <class Key>
__global__ static void __launch_bounds__(EPIPE_CUDA_MSEL_THREADS)
    epipe_cuda_msel_hist(const float *smp, uint64_t m, unsigned count, const uint32_t *prefix,
                         int pass, uint32_t *hist, Key key)
{
    __shared__ uint32_t pre[EPIPE_CUDA_MSEL_MAX];
    __shared__ uint32_t block_hist[EPIPE_CUDA_SEL_BINS];
    const unsigned shift = epipe_cuda_sel_shift(pass), bins = epipe_cuda_sel_bins(pass);
    const uint32_t mask = pass == 0 ? 0u : pass == 1 ? 0xffe00000u : 0xfffffc00u;
    for (unsigned i = threadIdx.x; pass && i < count; i += blockDim.x)
        pre[i] = prefix[i];
    for (unsigned i = threadIdx.x; !pass && i < EPIPE_CUDA_SEL_BINS; i += blockDim.x)
        block_hist[i] = 0;
    __syncthreads();
    /* every thread runs the same rounds: the counts are warp-aggregated */
    const uint64_t per = (uint64_t)gridDim.x * blockDim.x, rounds = (m + per - 1) / per;
    for (uint64_t r = 0; r < rounds; r++) {
        const uint64_t i = r * per + blockIdx.x * (uint64_t)blockDim.x + threadIdx.x;
        bool on = i < m;
        const uint32_t k = on ? key(smp[i]) : 0u;
        if (pass == 0) { /* one histogram: in shared memory, added to hist at the end */
            epipe_cuda_hist_add(block_hist, k >> shift, on);
            continue;
        }
        const uint32_t want = k & mask;
        const unsigned lo = epipe_cuda_lower_bound(pre, count, want); /* the first rank with it */
        on = on && lo < count && pre[lo] == want;
        const unsigned slot = on ? lo * bins + (k >> shift & (bins - 1)) : 0xffffffffu;
        const unsigned peers = __match_any_sync(0xffffffffu, slot);
        if (on && (threadIdx.x & 31) == (unsigned)(__ffs(peers) - 1))
            atomicAdd(&hist[slot], (uint32_t)__popc(peers));
    }
    if (pass == 0) {
        __syncthreads();
        for (unsigned i = threadIdx.x; i < EPIPE_CUDA_SEL_BINS; i += blockDim.x)
            if (block_hist[i])
                atomicAdd(&hist[i], block_hist[i]);
    }
}

/* Block j: rank j's bin in its prefix's histogram of pass `pass`; its
 * prefix and rank within the bin to pout, rout (pass 0 takes the rank from
 * rank_of(j) and the empty prefix; later passes from pin, rin). */
template <class Rank>
__global__ static void __launch_bounds__(EPIPE_CUDA_SEL_THREADS)
    epipe_cuda_msel_find(int pass, Rank rank_of, const uint32_t *pin, const uint32_t *rin,
                         const uint32_t *hist, uint32_t *pout, uint32_t *rout)
{
    const unsigned j = blockIdx.x, shift = epipe_cuda_sel_shift(pass),
                   bins = epipe_cuda_sel_bins(pass);
    const uint32_t pre = pass ? pin[j] : 0u, rank = pass ? rin[j] : rank_of(j);
    /* the first rank with this prefix (pin ascends) owns its histogram */
    const unsigned g = pass ? epipe_cuda_lower_bound(pin, j, pre) : 0u;
    uint32_t bin, rank_in;
    epipe_cuda_sel_bin(hist + (size_t)g * bins, bins, rank, &bin, &rank_in);
    if (threadIdx.x == 0) {
        pout[j] = pre | bin << shift;
        rout[j] = rank_in;
    }
}

/* Bytes of device scratch the select of count ranks takes (the launches
 * are in the .cu files that use it: the emulator's translation rewrites
 * the launches of the file it is given, not those of its headers). */
static inline size_t epipe_cuda_select_many_bytes(unsigned count)
{
    return sizeof(uint32_t) *
           ((size_t)EPIPE_CUDA_SEL_BINS + (size_t)count * (2048 + 1024) + 4 * (size_t)count);
}

#endif
