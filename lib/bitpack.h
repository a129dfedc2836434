/* Dense bit packing of codes 1..16 bits wide: code i occupies bits
 * [i*w, (i+1)*w) of a little-endian bit stream (bit 0 = LSB of byte 0). */
#ifndef EPIPE_LIB_BITPACK_H
#define EPIPE_LIB_BITPACK_H

#include <stddef.h>
#include <stdint.h>

/* Bytes that n codes of width w take: ceil(n*w/8). n must be < 2^59. */
static inline size_t epipe_bitpack_bytes(uint64_t n, unsigned w)
{
    return (size_t)((n * w + 7) / 8);
}

/* Packs n codes (each < 2^w) into out[0..epipe_bitpack_bytes(n, w)).
 * Trailing bits of the last byte are zero. Packing a range that starts at
 * a multiple of 8 codes writes from byte start*w/8 and never past its last
 * byte, so threads can pack disjoint 8-aligned ranges into one buffer. */
void epipe_bitpack(const uint16_t *codes, size_t n, unsigned w, uint8_t *out);
/* The inverse: reads epipe_bitpack_bytes(n, w) bytes. */
void epipe_bitunpack(const uint8_t *in, size_t n, unsigned w, uint16_t *codes);

/* Unpacks n codes and writes y[i] = lut[code i] (lut has 2^w entries),
 * without storing the codes; widths 1..4 use AVX2 when the CPU has it. */
void epipe_bitunpack_lut(const uint8_t *in, size_t n, unsigned w, const float *lut, float *y);
void epipe_bitunpack_lut_ref(const uint8_t *in, size_t n, unsigned w, const float *lut, float *y);

/* Tests and epipe-bench: 0 makes epipe_bitpack (widths 2..6) and
 * epipe_bitunpack_lut (widths 1..4) use their portable loops instead of
 * AVX2, so both can be checked against the references on one machine;
 * returns the previous setting. Process-wide and atomic; both give the
 * same bytes and floats. epipe_q_set_simd() sets it too. */
int epipe_bitpack_set_simd(int on);

/* Bit-at-a-time references the fast versions are tested against. */
void epipe_bitpack_ref(const uint16_t *codes, size_t n, unsigned w, uint8_t *out);
void epipe_bitunpack_ref(const uint8_t *in, size_t n, unsigned w, uint16_t *codes);

/* True when the bits after the last code in its final byte are zero; a
 * strict decoder rejects anything else as corrupt. */
int epipe_bitpack_tail_clean(const uint8_t *in, size_t n, unsigned w);

#endif
