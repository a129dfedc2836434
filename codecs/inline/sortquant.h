/* sortquant's sample positions and ranks, shared by the C code and the CUDA
 * kernels so that both draw the same sample (docs/codecs.md, "sortquant"). */
#ifndef EPIPE_CODECS_INLINE_SORTQUANT_H
#define EPIPE_CODECS_INLINE_SORTQUANT_H

#include "hd.h"

/* sortquant's parameter indices in epipe_codec.p[] and its modes, for the C
 * codec and the CUDA kernels alike. */
enum { SQ_BITS, SQ_SPLIT, SQ_MODE, SQ_SAMPLE, SQ_ZERO };
enum { SQ_MODE_EXACT, SQ_MODE_SAMPLE, SQ_MODE_FIT };

/* floor(j * n / k) without overflow, for j <= k <= 2^24. */
EPIPE_HD uint64_t epipe_hd_sq_rank(uint64_t j, uint64_t n, uint64_t k)
{
    return n / k * j + n % k * j / k;
}

EPIPE_HD uint64_t epipe_hd_sq_mix(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Exact mode: the chunk of sorted position p < n, the largest j < k with
 * rank(j) <= p (chunks are [rank(j), rank(j + 1)); with n < k some are
 * empty). */
EPIPE_HD unsigned epipe_hd_sq_chunk_at(uint64_t p, uint64_t n, unsigned k)
{
    unsigned lo = 0, hi = k - 1;
    while (lo < hi) {
        unsigned mid = lo + (hi - lo + 1) / 2;
        if (epipe_hd_sq_rank(mid, n, k) <= p)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* Sample k of m drawn from n values: a pseudo-random position in stratum
 * k, [floor(k n / m), floor((k+1) n / m)), at ((mix(k) >> 32) * len) >> 32
 * for a stratum of len values (mix(k) % len past 2^32). */
EPIPE_HD uint64_t epipe_hd_sq_sample_pos(uint64_t k, uint64_t n, uint64_t m)
{
    uint64_t lo = epipe_hd_sq_rank(k, n, m), len = epipe_hd_sq_rank(k + 1, n, m) - lo;
    uint64_t z = epipe_hd_sq_mix(k);
    return lo + (len <= 0xffffffffu ? ((z >> 32) * len) >> 32 : z % len);
}

#endif
