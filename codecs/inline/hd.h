/* The qualifiers of per-element functions shared by the C codecs and their
 * CUDA kernels: static inline in C, __host__ __device__ under nvcc. */
#ifndef EPIPE_CODECS_INLINE_HD_H
#define EPIPE_CODECS_INLINE_HD_H

#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define EPIPE_HD static inline __host__ __device__
#else
#define EPIPE_HD static inline
#endif

/* Bit casts that compile to moves on both sides. */
EPIPE_HD uint32_t epipe_hd_f2u(float f)
{
#ifdef __CUDA_ARCH__
    return __float_as_uint(f);
#else
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
#endif
}

EPIPE_HD float epipe_hd_u2f(uint32_t u)
{
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}

/* 1 when f is neither NaN nor infinite (its exponent bits not all ones). */
EPIPE_HD int epipe_hd_finite(float f)
{
    return (epipe_hd_f2u(f) & 0x7f800000u) != 0x7f800000u;
}

#endif
