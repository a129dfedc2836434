/* kmeans's per-element arithmetic (the code of a value, the sample's
 * positions), shared by the C codec and the CUDA kernels so that both
 * compute the same codes from the same values. */
#ifndef EPIPE_CODECS_INLINE_KMEANS_H
#define EPIPE_CODECS_INLINE_KMEANS_H

#include <stddef.h>
#include <stdint.h>

#include "hd.h"

/* Branchless binary search over the k (a power of two) sorted midpoints
 * mid[] (mid[k-1] = +inf): the number of midpoints below v, which is the
 * code of v's nearest centroid, ties going to the lower one. */
EPIPE_HD unsigned epipe_hd_km_code(const double *mid, size_t k, float v)
{
    size_t base = 0;
    double x = v;
    for (size_t half = k >> 1; half; half >>= 1)
        base += mid[base + half - 1] < x ? half : 0;
    return (unsigned)base;
}

EPIPE_HD uint64_t epipe_hd_km_hash(uint64_t i)
{
    i ^= i >> 33;
    i *= 0xff51afd7ed558ccdull;
    i ^= i >> 33;
    i *= 0xc4ceb9fe1a85ec53ull;
    return i ^ (i >> 33);
}

/* The index of sample value i of m < n: a hashed position inside the i-th
 * of m equal strides of the n values (floor(i*n/m) = i*q + i*r/m, without
 * overflow). */
EPIPE_HD uint64_t epipe_hd_km_sample_at(uint64_t i, uint64_t n, uint64_t m)
{
    uint64_t q = n / m, r = n % m;
    uint64_t b = i * q + i * r / m, e = (i + 1) * q + (i + 1) * r / m;
    return b + epipe_hd_km_hash(i) % (e - b);
}

#endif
