/* Selection on a sample, shared by sortquant (its boundaries) and topk (its
 * staging threshold): the sample drawn as sortquant's CPU code draws it, a
 * warp-aggregated histogram count, and a radix select by one block. */
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

/* The key of rank `rank` (from 0, ascending) among key(smp[i]), i < m, by
 * radix select: 11, 11 and 10 bits a pass over the sample (4m bytes, which
 * stay in L2 for the samples used here). Called by all
 * EPIPE_CUDA_SEL_THREADS threads of the block, with rank < m <= 2^32; each
 * gets the key. smp is read as float4 where `vec` says it is aligned. */
template <class Key>
__device__ static uint32_t epipe_cuda_select(const float *smp, uint64_t m, int vec, uint32_t rank,
                                             Key key)
{
    typedef cub::BlockScan<uint32_t, EPIPE_CUDA_SEL_THREADS> scan_t;
    __shared__ typename scan_t::TempStorage tmp;
    __shared__ uint32_t hist[EPIPE_CUDA_SEL_BINS];
    __shared__ uint32_t found_bin, found_rank;
    enum { T = EPIPE_CUDA_SEL_THREADS, U = EPIPE_CUDA_SEL_UNROLL };
    uint32_t prefix = 0, mask = 0;
    const float4 *s4 = (const float4 *)smp;
    uint64_t quads = (m + 3) / 4, per_round = (uint64_t)T * U;
    for (unsigned pass = 0; pass < 3; pass++) {
        unsigned shift = pass == 0 ? 21 : pass == 1 ? 10 : 0;
        uint32_t bins = pass < 2 ? 2048u : 1024u;
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
        uint32_t c0 = hist[2 * threadIdx.x], c1 = hist[2 * threadIdx.x + 1], before;
        scan_t(tmp).ExclusiveSum(c0 + c1, before);
        if (before <= rank && rank < before + c0) {
            found_bin = 2 * threadIdx.x;
            found_rank = rank - before;
        } else if (before + c0 <= rank && rank < before + c0 + c1) {
            found_bin = 2 * threadIdx.x + 1;
            found_rank = rank - before - c0;
        }
        __syncthreads();
        prefix |= found_bin << shift;
        mask |= (bins - 1) << shift;
        rank = found_rank;
        __syncthreads(); /* all have read found_* before the next pass writes them */
    }
    return prefix;
}

#endif
