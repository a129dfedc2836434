/* Dense bit packing. The fast path moves whole 8-code groups (exactly w
 * bytes each) through a 64-bit accumulator; widths 8 and 16 are copies. */
#include "bitpack.h"

#include <string.h>

void epipe_bitpack_ref(const uint16_t *codes, size_t n, unsigned w, uint8_t *out)
{
    memset(out, 0, epipe_bitpack_bytes(n, w));
    for (size_t i = 0; i < n; i++)
        for (unsigned b = 0; b < w; b++)
            if (codes[i] >> b & 1u) {
                size_t bit = i * w + b;
                out[bit / 8] |= (uint8_t)(1u << (bit % 8));
            }
}

void epipe_bitunpack_ref(const uint8_t *in, size_t n, unsigned w, uint16_t *codes)
{
    for (size_t i = 0; i < n; i++) {
        uint16_t c = 0;
        for (unsigned b = 0; b < w; b++) {
            size_t bit = i * w + b;
            c |= (uint16_t)((in[bit / 8] >> (bit % 8) & 1u) << b);
        }
        codes[i] = c;
    }
}

void epipe_bitpack(const uint16_t *codes, size_t n, unsigned w, uint8_t *out)
{
    if (w == 8) {
        for (size_t i = 0; i < n; i++)
            out[i] = (uint8_t)codes[i];
        return;
    }
    if (w == 16) {
        for (size_t i = 0; i < n; i++) {
            out[2 * i] = (uint8_t)codes[i];
            out[2 * i + 1] = (uint8_t)(codes[i] >> 8);
        }
        return;
    }
    uint64_t acc = 0;
    unsigned have = 0; /* bits in acc */
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        acc |= (uint64_t)codes[i] << have;
        have += w;
        while (have >= 8) {
            out[o++] = (uint8_t)acc;
            acc >>= 8;
            have -= 8;
        }
    }
    if (have)
        out[o] = (uint8_t)acc;
}

void epipe_bitunpack(const uint8_t *in, size_t n, unsigned w, uint16_t *codes)
{
    if (w == 8) {
        for (size_t i = 0; i < n; i++)
            codes[i] = in[i];
        return;
    }
    if (w == 16) {
        for (size_t i = 0; i < n; i++)
            codes[i] = (uint16_t)(in[2 * i] | in[2 * i + 1] << 8);
        return;
    }
    uint64_t acc = 0, mask = (1u << w) - 1u;
    unsigned have = 0;
    size_t o = 0, nbytes = epipe_bitpack_bytes(n, w);
    for (size_t i = 0; i < n; i++) {
        while (have < w && o < nbytes) {
            acc |= (uint64_t)in[o++] << have;
            have += 8;
        }
        codes[i] = (uint16_t)(acc & mask);
        acc >>= w;
        have -= w;
    }
}

int epipe_bitpack_tail_clean(const uint8_t *in, size_t n, unsigned w)
{
    size_t bits = (size_t)n * w;
    if (bits % 8 == 0)
        return 1;
    return (in[bits / 8] >> (bits % 8)) == 0;
}
