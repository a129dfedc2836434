/* Dense bit packing. Widths below 8 move whole 8-code groups (exactly w
 * bytes each) through one 64-bit word with the width a compile-time
 * constant (packing at widths 2..6 and table decoding at 1..4 have AVX2
 * paths); other widths use a 64-bit accumulator; 8 and 16 are copies. */
#include "bitpack.h"
#include "clones.h"

#include <string.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define BP_LE 1
#else
#define BP_LE 0
#endif

/* The two entry points are built for AVX2 and for the baseline and picked
 * at load time (EPIPE_CLONES, lib/clones.h); both give the same bits. */
#define BP_INLINE static inline __attribute__((always_inline))

#if defined(__x86_64__) && defined(__GNUC__) && BP_LE
#include <immintrin.h>
#define BP_X86 1
#else
#define BP_X86 0
#endif

static int use_simd = 1;

int epipe_bitpack_set_simd(int on)
{
    return __atomic_exchange_n(&use_simd, on ? 1 : 0, __ATOMIC_RELAXED);
}

static int simd_avx2(void)
{
#if BP_X86
    return __atomic_load_n(&use_simd, __ATOMIC_RELAXED) && __builtin_cpu_supports("avx2");
#else
    return 0;
#endif
}

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

/* The accumulator loops: any width, any count; used for the widths the
 * group kernels do not cover and for the last n % 8 codes. */
static void pack_acc(const uint16_t *codes, size_t n, unsigned w, uint8_t *out)
{
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

static void unpack_acc(const uint8_t *in, size_t n, unsigned w, uint16_t *codes)
{
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

BP_INLINE uint64_t load_le(const uint8_t *p, unsigned len)
{
    uint64_t v = 0;
    if (BP_LE && len == 8) {
        memcpy(&v, p, 8);
        return v;
    }
    for (unsigned b = 0; b < len; b++)
        v |= (uint64_t)p[b] << (8 * b);
    return v;
}

BP_INLINE void store_le(uint8_t *p, uint64_t v, unsigned len)
{
    if (BP_LE && len == 8) {
        memcpy(p, &v, 8);
        return;
    }
    for (unsigned b = 0; b < len; b++)
        p[b] = (uint8_t)(v >> (8 * b));
}

/* Groups j < wide_groups(g, W) may move 8 bytes at byte j*W and stay
 * inside the g*W bytes of the range; the others move exactly W. */
BP_INLINE size_t wide_groups(size_t g, unsigned W)
{
    return g * W >= 8 ? (g * W - 8) / W + 1 : 0;
}

/* g groups of 8 codes at width W < 8: group j is one 8W-bit word at byte
 * j*W. A wide store also writes bytes of the next groups, rewritten right
 * after; nothing past the range is touched, so threads may pack
 * neighbouring ranges. */
BP_INLINE void pack_groups(const uint16_t *restrict c, size_t g, unsigned W, uint8_t *restrict out)
{
    size_t wide = wide_groups(g, W);
    for (size_t j = 0; j < g; j++) {
        uint64_t v = 0;
        for (unsigned i = 0; i < 8; i++)
            v |= (uint64_t)c[8 * j + i] << (i * W);
        if (j < wide)
            store_le(out + j * W, v, 8);
        else
            store_le(out + j * W, v, W);
    }
}

/* The inverse; reads nothing past the g*W bytes. */
BP_INLINE void unpack_groups(const uint8_t *restrict in, size_t g, unsigned W, uint16_t *restrict c)
{
    const uint64_t mask = (1u << W) - 1u;
    size_t wide = wide_groups(g, W);
    for (size_t j = 0; j < g; j++) {
        uint64_t v = j < wide ? load_le(in + j * W, 8) : load_le(in + j * W, W);
        for (unsigned i = 0; i < 8; i++)
            c[8 * j + i] = (uint16_t)(v >> (i * W) & mask);
    }
}

#if BP_X86
/* Widths 2..6 with AVX2, 32 codes (4W bytes) a step: codes to bytes, then
 * neighbours merged by multiply-adds (pairs: c0 + c1 * 2^W, quads: p0 + p1
 * * 2^2W, then two quads per 64-bit lane), then each lane's W low bytes
 * moved together by a byte shuffle. A step stores 16 bytes at 2W past its
 * start, so steps run while that stays inside the g*W bytes of the range;
 * the rest is left to the caller. Returns the groups of 8 done. */
static inline __attribute__((always_inline, target("avx2"))) size_t
pack_avx2_w(const uint16_t *restrict c, size_t g, unsigned W, uint8_t *restrict out)
{
    const __m256i m1 = _mm256_set1_epi16((short)(1 | 1 << (W + 8)));
    const __m256i m2 = _mm256_set1_epi32(1 | 1 << (2 * W + 16));
    const __m256i lo32 = _mm256_set1_epi64x(0xffffffffll);
    const __m128i up = _mm_cvtsi32_si128(32 - 4 * (int)W);
    const __m256i keep = _mm256_set1_epi64x(~((1ll << (4 * W)) - 1));
    uint8_t ctl[16];
    for (unsigned i = 0; i < 16; i++)
        ctl[i] = i < W ? (uint8_t)i : i < 2 * W ? (uint8_t)(8 + i - W) : 0x80;
    const __m256i shuf = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)ctl));
    size_t bytes = g * W, t = 0;
    for (; t * 4 * W + 2 * W + 16 <= bytes; t++) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(c + 32 * t));
        __m256i b = _mm256_loadu_si256((const __m256i *)(c + 32 * t + 16));
        __m256i v = _mm256_permute4x64_epi64(_mm256_packus_epi16(a, b), 0xd8);
        v = _mm256_madd_epi16(_mm256_maddubs_epi16(v, m1), m2);
        v = _mm256_or_si256(_mm256_and_si256(v, lo32),
                            _mm256_and_si256(_mm256_srl_epi64(v, up), keep));
        v = _mm256_shuffle_epi8(v, shuf);
        _mm_storeu_si128((__m128i *)(out + 4 * W * t), _mm256_castsi256_si128(v));
        _mm_storeu_si128((__m128i *)(out + 4 * W * t + 2 * W), _mm256_extracti128_si256(v, 1));
    }
    return 4 * t;
}

static __attribute__((target("avx2"))) size_t pack_avx2(const uint16_t *c, size_t g, unsigned w,
                                                        uint8_t *out)
{
    switch (w) {
    case 2: return pack_avx2_w(c, g, 2, out);
    case 3: return pack_avx2_w(c, g, 3, out);
    case 4: return pack_avx2_w(c, g, 4, out);
    case 5: return pack_avx2_w(c, g, 5, out);
    case 6: return pack_avx2_w(c, g, 6, out);
    }
    return 0;
}
#endif

EPIPE_CLONES void epipe_bitpack(const uint16_t *codes, size_t n, unsigned w, uint8_t *out)
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
    size_t g = w < 8 ? n / 8 : 0, done = 0;
#if BP_X86
    if (g >= 8 && simd_avx2()) {
        done = pack_avx2(codes, g, w, out);
        codes += 8 * done;
        out += w * done;
        n -= 8 * done;
        g -= done;
    }
#endif
    switch (g ? w : 0) {
    case 1: pack_groups(codes, g, 1, out); break;
    case 2: pack_groups(codes, g, 2, out); break;
    case 3: pack_groups(codes, g, 3, out); break;
    case 4: pack_groups(codes, g, 4, out); break;
    case 5: pack_groups(codes, g, 5, out); break;
    case 6: pack_groups(codes, g, 6, out); break;
    case 7: pack_groups(codes, g, 7, out); break;
    }
    pack_acc(codes + 8 * g, n - 8 * g, w, out + g * w);
}

EPIPE_CLONES void epipe_bitunpack(const uint8_t *in, size_t n, unsigned w, uint16_t *codes)
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
    size_t g = w < 8 ? n / 8 : 0;
    switch (g ? w : 0) {
    case 1: unpack_groups(in, g, 1, codes); break;
    case 2: unpack_groups(in, g, 2, codes); break;
    case 3: unpack_groups(in, g, 3, codes); break;
    case 4: unpack_groups(in, g, 4, codes); break;
    case 5: unpack_groups(in, g, 5, codes); break;
    case 6: unpack_groups(in, g, 6, codes); break;
    case 7: unpack_groups(in, g, 7, codes); break;
    }
    unpack_acc(in + g * w, n - 8 * g, w, codes + 8 * g);
}

/* ---- unpack through a table of floats ---------------------------------- */

void epipe_bitunpack_lut_ref(const uint8_t *in, size_t n, unsigned w, const float *lut, float *y)
{
    for (size_t i = 0; i < n; i++) {
        uint32_t c = 0;
        for (unsigned b = 0; b < w; b++) {
            size_t bit = i * w + b;
            c |= (uint32_t)(in[bit / 8] >> (bit % 8) & 1u) << b;
        }
        y[i] = lut[c];
    }
}

/* g groups of 8 codes at width W < 8, looked up as they are cut out. */
BP_INLINE void lut_groups(const uint8_t *restrict in, size_t g, unsigned W,
                          const float *restrict lut, float *restrict y)
{
    const uint64_t mask = (1u << W) - 1u;
    size_t wide = wide_groups(g, W);
    for (size_t j = 0; j < g; j++) {
        uint64_t v = j < wide ? load_le(in + j * W, 8) : load_le(in + j * W, W);
        for (unsigned i = 0; i < 8; i++)
            y[8 * j + i] = lut[v >> (i * W) & mask];
    }
}

#if BP_X86

/* Widths 1..4: the table (at most 16 floats) lives in two registers; the
 * 8 codes of a group (at most 4 bytes) are shifted into 8 lanes and looked
 * up by lane permutes. Exactly the floats the scalar loop picks. */
static inline __attribute__((always_inline, target("avx2"))) void
lut_groups_avx2(const uint8_t *restrict in, size_t g, unsigned W, const float *restrict lut,
                float *restrict y)
{
    float t[16] = {0};
    memcpy(t, lut, sizeof(float) << W);
    const __m256 lo = _mm256_loadu_ps(t), hi = _mm256_loadu_ps(t + 8);
    const __m256i sh = _mm256_setr_epi32(0, (int)W, 2 * (int)W, 3 * (int)W, 4 * (int)W, 5 * (int)W,
                                         6 * (int)W, 7 * (int)W);
    const __m256i mask = _mm256_set1_epi32((1 << W) - 1);
    size_t bytes = g * W;
    for (size_t j = 0; j < g; j++) {
        uint32_t v;
        if (j * W + 4 <= bytes)
            memcpy(&v, in + j * W, 4);
        else
            v = (uint32_t)load_le(in + j * W, W);
        __m256i idx = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)v), sh), mask);
        __m256 r = _mm256_permutevar8x32_ps(lo, idx);
        if (W == 4)
            r = _mm256_blendv_ps(r, _mm256_permutevar8x32_ps(hi, idx),
                                 _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
        _mm256_storeu_ps(y + 8 * j, r);
    }
}

static __attribute__((target("avx2"))) int lut_avx2(const uint8_t *in, size_t g, unsigned w,
                                                    const float *lut, float *y)
{
    switch (w) {
    case 1: lut_groups_avx2(in, g, 1, lut, y); return 1;
    case 2: lut_groups_avx2(in, g, 2, lut, y); return 1;
    case 3: lut_groups_avx2(in, g, 3, lut, y); return 1;
    case 4: lut_groups_avx2(in, g, 4, lut, y); return 1;
    }
    return 0;
}
#endif

void epipe_bitunpack_lut(const uint8_t *in, size_t n, unsigned w, const float *lut, float *y)
{
    if (w == 8) {
        /* Eight codes from one load: the one-byte loop ran at 1.8-2.9 Gvals/s
         * depending on where the linker placed it; this one does not. */
        size_t i = 0;
        for (; i + 8 <= n; i += 8) {
            uint64_t v = load_le(in + i, 8);
            for (unsigned k = 0; k < 8; k++)
                y[i + k] = lut[v >> (8 * k) & 0xff];
        }
        for (; i < n; i++)
            y[i] = lut[in[i]];
        return;
    }
    if (w == 16) {
        for (size_t i = 0; i < n; i++)
            y[i] = lut[in[2 * i] | in[2 * i + 1] << 8];
        return;
    }
    size_t g = w < 8 ? n / 8 : 0, done = 0;
#if BP_X86
    if (g && simd_avx2() && lut_avx2(in, g, w, lut, y))
        done = g;
#endif
    if (!done) {
        switch (g ? w : 0) {
        case 1: lut_groups(in, g, 1, lut, y); break;
        case 2: lut_groups(in, g, 2, lut, y); break;
        case 3: lut_groups(in, g, 3, lut, y); break;
        case 4: lut_groups(in, g, 4, lut, y); break;
        case 5: lut_groups(in, g, 5, lut, y); break;
        case 6: lut_groups(in, g, 6, lut, y); break;
        case 7: lut_groups(in, g, 7, lut, y); break;
        }
    }
    /* The rest (widths 9..15, the last n % 8 codes) a block at a time. */
    uint16_t codes[256];
    for (size_t i = 8 * g; i < n;) {
        size_t m = n - i < 256 ? n - i : 256; /* i stays a multiple of 8 */
        epipe_bitunpack(in + i / 8 * w, m, w, codes);
        for (size_t k = 0; k < m; k++)
            y[i + k] = lut[codes[k]];
        i += m;
    }
}

int epipe_bitpack_tail_clean(const uint8_t *in, size_t n, unsigned w)
{
    size_t bits = (size_t)n * w;
    if (bits % 8 == 0)
        return 1;
    return (in[bits / 8] >> (bits % 8)) == 0;
}
