/* The uniform quantizers' per-element arithmetic (quant, sortquant): step,
 * level, chunk search, table checks and 8-code packing, shared by the C
 * code and the CUDA kernels so that both compute the same bits. */
#ifndef EPIPE_CODECS_INLINE_QUANT_H
#define EPIPE_CODECS_INLINE_QUANT_H

#include <float.h>
#include <math.h>

#include "hd.h"

/* quant's parameter indices in epipe_codec.p[], for the C codec and the
 * CUDA kernels alike. */
enum { QUANT_BITS, QUANT_ZERO, QUANT_ROWS, QUANT_GROUP };

/* The level of x in a chunk: round((x - min) * inv), clamped to [0, levels]
 * (halves round up). The CPU's vector kernels compute exactly this. */
EPIPE_HD uint32_t epipe_hd_q_level(float x, float min, float inv, float levels)
{
    float t = (x - min) * inv;
    t = t > 0.0f ? t : 0.0f;
    t = t < levels ? t : levels;
    return (uint32_t)(int32_t)(t + 0.5f);
}

/* The step for a chunk spanning [min, max] with `levels` steps: 0 when
 * max == min, otherwise (max - min) / levels rounded to float, at least
 * FLT_MIN (so 1/step is finite) and small enough that min + levels * step
 * is finite. 0 too when min or max is not finite: the CPU never asks, but
 * a CUDA encode builds its tables before its deferred check refuses the
 * input, and with min = -inf the search below would never end (a hung
 * kernel, found by tests/cudaemu's hostile-emu). */
EPIPE_HD float epipe_hd_q_step(float min, float max, float levels)
{
    if (!(max > min) || !epipe_hd_finite(min) || !epipe_hd_finite(max))
        return 0.0f;
    double s = ((double)max - (double)min) / (double)levels;
    float f = s < (double)FLT_MAX ? (float)s : FLT_MAX;
    if (f < FLT_MIN)
        f = FLT_MIN;
    while (!epipe_hd_finite(min + levels * f))
        f = nextafterf(f, 0.0f);
    return f;
}

/* zero=1: the chunk's min moved by at most half a step (plus rounding) so
 * that level z = round(-min / step) decodes, as min + (float)z * step, to
 * exactly 0; min unchanged unless min < 0 <= max and step > 0, or when the
 * moved grid would leave the float range. */
EPIPE_HD float epipe_hd_q_zero_min(float min, float max, float step, float levels)
{
    if (!(min < 0.0f && max >= 0.0f && step > 0.0f))
        return min;
    double z = floor(-(double)min / (double)step + 0.5);
    if (z > (double)levels)
        z = (double)levels;
    float zmin = -((float)z * step) + 0.0f;
    return epipe_hd_finite(zmin + levels * step) ? zmin : min;
}

/* The chunk of x among k (a power of two): the count of bnd[1..k) <= x. */
EPIPE_HD unsigned epipe_hd_q_chunk(const float *bnd, unsigned k, float x)
{
    unsigned pos = 0;
    for (unsigned h = k / 2; h; h /= 2)
        pos += bnd[pos + h] <= x ? h : 0;
    return pos;
}

/* A table pair read from a body: 0 if usable, else which rule it breaks
 * (1: min not finite, 2: step not finite or negative, 3: min + levels *
 * step not finite). */
EPIPE_HD int epipe_hd_q_pair_check(float min, float step, float levels)
{
    if (!epipe_hd_finite(min))
        return 1;
    if (!epipe_hd_finite(step) || (epipe_hd_f2u(step) >> 31))
        return 2;
    if (!epipe_hd_finite(min + levels * step))
        return 3;
    return 0;
}

/* The value a code decodes to. */
EPIPE_HD float epipe_hd_q_value(float min, float step, uint32_t level)
{
    return min + (float)level * step;
}

/* Eight codes of w bits (1..16) packed into exactly w bytes, code i at bits
 * [i*w, (i+1)*w) little-endian: the layout of lib/bitpack.h. */
/* Eight w-bit codes (w <= 16) as 8w bits, little-endian: bits 0..63 in
 * *lo, 64..127 in *hi; byte j of the packed group is byte j of lo, hi. */
EPIPE_HD void epipe_hd_pack8_words(const uint32_t code[8], unsigned w, uint64_t *lo, uint64_t *hi)
{
    uint64_t a = 0, b = 0;
    for (unsigned i = 0; i < 8; i++) {
        unsigned at = i * w;
        uint64_t v = code[i];
        if (at < 64) {
            a |= v << at;
            if (at + w > 64)
                b |= v >> (64 - at);
        } else {
            b |= v << (at - 64);
        }
    }
    *lo = a;
    *hi = b;
}

EPIPE_HD void epipe_hd_unpack8_words(uint64_t lo, uint64_t hi, unsigned w, uint32_t code[8])
{
    uint64_t mask = (1ull << w) - 1;
    for (unsigned i = 0; i < 8; i++) {
        unsigned at = i * w;
        uint64_t v = at < 64 ? lo >> at : hi >> (at - 64);
        if (at < 64 && at + w > 64)
            v |= hi << (64 - at);
        code[i] = (uint32_t)(v & mask);
    }
}

EPIPE_HD void epipe_hd_pack8(const uint32_t code[8], unsigned w, uint8_t *out)
{
    uint64_t lo, hi;
    epipe_hd_pack8_words(code, w, &lo, &hi);
    for (unsigned j = 0; j < w; j++)
        out[j] = (uint8_t)(j < 8 ? lo >> (8 * j) : hi >> (8 * (j - 8)));
}

EPIPE_HD void epipe_hd_unpack8(const uint8_t *in, unsigned w, uint32_t code[8])
{
    uint64_t lo = 0, hi = 0;
    for (unsigned j = 0; j < w; j++) {
        if (j < 8)
            lo |= (uint64_t)in[j] << (8 * j);
        else
            hi |= (uint64_t)in[j] << (8 * (j - 8));
    }
    epipe_hd_unpack8_words(lo, hi, w, code);
}

#endif
