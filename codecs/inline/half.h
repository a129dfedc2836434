/* fp16 and bf16 conversions, round to nearest even, and cast's saturating
 * encode of one value: one definition for the C code and the CUDA kernels. */
#ifndef EPIPE_CODECS_INLINE_HALF_H
#define EPIPE_CODECS_INLINE_HALF_H

#include <math.h>

#include "hd.h"

/* NaN stays a quiet NaN with its top mantissa bits; |f| that rounds to
 * 65520 or more becomes infinity; subnormals round to nearest even. */
EPIPE_HD uint16_t epipe_hd_f32_to_f16(float f)
{
    uint32_t x = epipe_hd_f2u(f), sign = (x >> 16) & 0x8000u, absx = x & 0x7fffffffu;
    if (absx > 0x7f800000u) /* NaN: keep it quiet and a NaN */
        return (uint16_t)(sign | 0x7e00u | ((absx >> 13) & 0x3ffu));
    if (absx >= 0x477ff000u) /* rounds to >= 65520: infinity */
        return (uint16_t)(sign | 0x7c00u);
    if (absx < 0x38800000u) { /* below the smallest normal: subnormal or zero */
        /* Scale so the subnormal's integer mantissa appears, rounding RNE;
         * the product is exact (a power of two). */
        float a = epipe_hd_u2f(absx) * 16777216.0f; /* 2^24 = 1 / smallest subnormal */
#ifdef __CUDA_ARCH__
        return (uint16_t)(sign | (uint16_t)__float2int_rn(a));
#else
        return (uint16_t)(sign | (uint16_t)lrintf(a));
#endif
    }
    uint32_t mant_odd = (absx >> 13) & 1u;
    absx += 0xc8000fffu + mant_odd; /* rebias exponent (-112 << 23) and round */
    return (uint16_t)(sign | (absx >> 13));
}

EPIPE_HD float epipe_hd_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    float mag;
    if (exp == 0)
        mag = (float)mant / 16777216.0f;
    else if (exp == 31)
        mag = epipe_hd_u2f(0x7f800000u | (mant << 13));
    else
        mag = epipe_hd_u2f(((exp + 112u) << 23) | (mant << 13));
    return epipe_hd_u2f(epipe_hd_f2u(mag) | sign);
}

EPIPE_HD uint16_t epipe_hd_f32_to_bf16(float f)
{
    uint32_t u = epipe_hd_f2u(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

EPIPE_HD float epipe_hd_bf16_to_f32(uint16_t h)
{
    return epipe_hd_u2f((uint32_t)h << 16);
}

/* cast's encode of one value: as above, but a finite value that rounded
 * past the type's range saturates to its largest finite value (fp16 0x7bff,
 * bf16 0x7f7f) with its sign; infinities and NaN stay what they are. */
EPIPE_HD uint16_t epipe_hd_cast_encode(int bf16, float x)
{
    uint16_t inf = bf16 ? 0x7f80u : 0x7c00u, max = bf16 ? 0x7f7fu : 0x7bffu;
    uint16_t h = bf16 ? epipe_hd_f32_to_bf16(x) : epipe_hd_f32_to_f16(x);
    if ((h & 0x7fffu) == inf && epipe_hd_finite(x)) /* rounded past the range */
        h = (uint16_t)((h & 0x8000u) | max);
    return h;
}

EPIPE_HD float epipe_hd_cast_decode(int bf16, uint16_t h)
{
    return bf16 ? epipe_hd_bf16_to_f32(h) : epipe_hd_f16_to_f32(h);
}

#endif
