/* CRC32C: a portable slicing-by-8 reference and an SSE4.2 fast path that
 * is picked at run time when the CPU has the crc32 instruction. */
#include "crc32c.h"

#include <pthread.h>
#include <string.h>

#define POLY 0x82F63B78u

/* table[k][b]: the CRC of byte b followed by k zero bytes. */
static uint32_t table[8][256];
static pthread_once_t table_once = PTHREAD_ONCE_INIT;

/* The fast path runs three independent crc32 chains over three adjacent
 * blocks of LONG_BLOCK (or SHORT_BLOCK) bytes and joins them. A CRC register
 * is GF(2)-linear in (register, data), so the register after A|B|C from c is
 *     Z(Z(crc(c, A)) ^ crc(0, B)) ^ crc(0, C)
 * where Z moves a register over one block of zero bytes. Z is linear too, so
 * it is four table look-ups: shift_long[k][b] = Z(b << 8k). */
#define LONG_BLOCK 8192
#define SHORT_BLOCK 256
static uint32_t shift_long[4][256];
static uint32_t shift_short[4][256];

/* The raw register (no pre/post inversion) moved over n zero bytes. */
static uint32_t zeros(uint32_t c, size_t n)
{
    while (n--)
        c = (c >> 8) ^ table[0][c & 0xFF];
    return c;
}

static void shift_table_init(uint32_t tab[4][256], size_t n)
{
    uint32_t basis[32];
    for (int i = 0; i < 32; i++)
        basis[i] = zeros(1u << i, n);
    for (int k = 0; k < 4; k++)
        for (uint32_t b = 0; b < 256; b++) {
            uint32_t v = 0;
            for (int j = 0; j < 8; j++)
                if (b & (1u << j))
                    v ^= basis[8 * k + j];
            tab[k][b] = v;
        }
}

static void table_init(void)
{
    for (uint32_t b = 0; b < 256; b++) {
        uint32_t c = b;
        for (int i = 0; i < 8; i++)
            c = (c >> 1) ^ (POLY & (0u - (c & 1u)));
        table[0][b] = c;
    }
    for (uint32_t b = 0; b < 256; b++)
        for (int k = 1; k < 8; k++)
            table[k][b] = (table[k - 1][b] >> 8) ^ table[0][table[k - 1][b] & 0xFF];
    shift_table_init(shift_long, LONG_BLOCK);
    shift_table_init(shift_short, SHORT_BLOCK);
}

uint32_t epipe_crc32c_ref(uint32_t crc, const void *buf, size_t len)
{
    pthread_once(&table_once, table_init);
    const uint8_t *p = buf;
    uint32_t c = ~crc;
    while (len && ((uintptr_t)p & 7)) {
        c = (c >> 8) ^ table[0][(c ^ *p++) & 0xFF];
        len--;
    }
    for (; len >= 8; len -= 8, p += 8) {
        uint64_t w;
        memcpy(&w, p, 8); /* little-endian hosts only (meson.build checks) */
        w ^= c;
        c = table[7][w & 0xFF] ^ table[6][(w >> 8) & 0xFF] ^ table[5][(w >> 16) & 0xFF] ^
            table[4][(w >> 24) & 0xFF] ^ table[3][(w >> 32) & 0xFF] ^ table[2][(w >> 40) & 0xFF] ^
            table[1][(w >> 48) & 0xFF] ^ table[0][w >> 56];
    }
    while (len--)
        c = (c >> 8) ^ table[0][(c ^ *p++) & 0xFF];
    return ~c;
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <nmmintrin.h>

#define HAVE_HW_PATH 1

static inline uint32_t shift(const uint32_t tab[4][256], uint32_t c)
{
    return tab[0][c & 0xFF] ^ tab[1][(c >> 8) & 0xFF] ^ tab[2][(c >> 16) & 0xFF] ^ tab[3][c >> 24];
}

static inline uint64_t load64(const uint8_t *p)
{
    uint64_t w;
    memcpy(&w, p, 8);
    return w;
}

/* Three chains over blocks of n bytes (n a multiple of 8) while 3n bytes
 * remain; returns the raw register. */
__attribute__((target("sse4.2"))) static inline uint64_t
crc32c_3way(uint64_t c, const uint8_t **pp, size_t *lenp, size_t n, const uint32_t tab[4][256])
{
    const uint8_t *p = *pp;
    size_t len = *lenp;
    while (len >= 3 * n) {
        uint64_t c1 = 0, c2 = 0;
        const uint8_t *end = p + n;
        do {
            c = _mm_crc32_u64(c, load64(p));
            c1 = _mm_crc32_u64(c1, load64(p + n));
            c2 = _mm_crc32_u64(c2, load64(p + 2 * n));
            p += 8;
        } while (p < end);
        c = shift(tab, (uint32_t)c) ^ (uint32_t)c1;
        c = shift(tab, (uint32_t)c) ^ (uint32_t)c2;
        p += 2 * n;
        len -= 3 * n;
    }
    *pp = p;
    *lenp = len;
    return c;
}

__attribute__((target("sse4.2"))) static uint32_t crc32c_sse42(uint32_t crc, const uint8_t *p,
                                                               size_t len)
{
    uint64_t c = ~crc;
    while (len && ((uintptr_t)p & 7)) {
        c = _mm_crc32_u8((uint32_t)c, *p++);
        len--;
    }
    if (len >= 3 * SHORT_BLOCK) {
        pthread_once(&table_once, table_init);
        c = crc32c_3way(c, &p, &len, LONG_BLOCK, shift_long);
        c = crc32c_3way(c, &p, &len, SHORT_BLOCK, shift_short);
    }
    /* The tail (under 768 bytes): one dependent chain. */
    for (; len >= 8; len -= 8, p += 8)
        c = _mm_crc32_u64(c, load64(p));
    while (len--)
        c = _mm_crc32_u8((uint32_t)c, *p++);
    return ~(uint32_t)c;
}

/* The single-chain loop the three-way path replaced: for comparison in
 * tests and benchmarks. */
__attribute__((target("sse4.2"))) static uint32_t crc32c_sse42_1way(uint32_t crc, const uint8_t *p,
                                                                    size_t len)
{
    uint64_t c = ~crc;
    while (len && ((uintptr_t)p & 7)) {
        c = _mm_crc32_u8((uint32_t)c, *p++);
        len--;
    }
    for (; len >= 8; len -= 8, p += 8)
        c = _mm_crc32_u64(c, load64(p));
    while (len--)
        c = _mm_crc32_u8((uint32_t)c, *p++);
    return ~(uint32_t)c;
}

int epipe_crc32c_hw_available(void)
{
    return __builtin_cpu_supports("sse4.2") ? 1 : 0;
}

uint32_t epipe_crc32c_hw(uint32_t crc, const void *buf, size_t len)
{
    if (!epipe_crc32c_hw_available())
        return epipe_crc32c_ref(crc, buf, len);
    return crc32c_sse42(crc, buf, len);
}

uint32_t epipe_crc32c_hw_1way(uint32_t crc, const void *buf, size_t len)
{
    if (!epipe_crc32c_hw_available())
        return epipe_crc32c_ref(crc, buf, len);
    return crc32c_sse42_1way(crc, buf, len);
}
#else
int epipe_crc32c_hw_available(void)
{
    return 0;
}

uint32_t epipe_crc32c_hw(uint32_t crc, const void *buf, size_t len)
{
    return epipe_crc32c_ref(crc, buf, len);
}

uint32_t epipe_crc32c_hw_1way(uint32_t crc, const void *buf, size_t len)
{
    return epipe_crc32c_ref(crc, buf, len);
}
#endif

uint32_t epipe_crc32c(uint32_t crc, const void *buf, size_t len)
{
#ifdef HAVE_HW_PATH
    /* __builtin_cpu_supports reads a word libgcc filled at start-up. */
    if (__builtin_cpu_supports("sse4.2"))
        return crc32c_sse42(crc, buf, len);
#endif
    return epipe_crc32c_ref(crc, buf, len);
}
