/* `cast:dtype=fp16|bf16`: each value rounded to nearest even in a 16-bit
 * float type, halving the bytes with no other change. A finite value
 * beyond the type's range saturates to its largest finite value (fp16
 * 65504, bf16 about 3.39e38) instead of becoming infinity; infinities and
 * NaN stay what they are. The fast path (F16C and AVX2 when the CPU has
 * them, threaded) gives the bytes and floats of the scalar reference. */
#include <math.h>
#include <string.h>

#include "../lib/codec/codec_impl.h"
#include "../lib/parallel.h"
#include "../lib/tensor.h"
#include "inline/half.h"
#include "quantize_common.h"

enum { CAST_DTYPE };
enum { CAST_FP16, CAST_BF16 };

static const char *const cast_dtypes[] = {"fp16", "bf16", NULL};

static const epipe_param_desc cast_params[] = {
    {.key = "dtype", .kind = EPIPE_PARAM_CHOICE, .def = CAST_FP16, .choices = cast_dtypes},
};

static uint32_t cast_param_word(const epipe_codec *c)
{
    return (uint32_t)c->p[CAST_DTYPE];
}

static int cast_body_size(const epipe_codec *c, uint64_t n, size_t *bytes)
{
    (void)c;
    if (n > SIZE_MAX / 2)
        return EPIPE_EOVERFLOW;
    *bytes = (size_t)n * 2;
    return EPIPE_OK;
}

/* Bit patterns of the 16-bit types: infinity and the largest finite. */
#define F16_INF 0x7c00u
#define F16_MAX 0x7bffu
#define BF16_INF 0x7f80u
#define BF16_MAX 0x7f7fu

/* ---- scalar reference --------------------------------------------------- */

static void encode_scalar(int bf16, const float *x, size_t n, uint8_t *body)
{
    for (size_t i = 0; i < n; i++) {
        uint16_t h = epipe_hd_cast_encode(bf16, x[i]);
        body[2 * i] = (uint8_t)h;
        body[2 * i + 1] = (uint8_t)(h >> 8);
    }
}

static void decode_scalar(int bf16, const uint8_t *body, size_t n, float *y)
{
    for (size_t i = 0; i < n; i++)
        y[i] = epipe_hd_cast_decode(bf16, (uint16_t)(body[2 * i] | body[2 * i + 1] << 8));
}

static int cast_encode_ref(epipe_codec *c, const float *x, size_t n, uint8_t *body)
{
    encode_scalar((int)c->p[CAST_DTYPE] == CAST_BF16, x, n, body);
    return EPIPE_OK;
}

static int cast_decode_ref(epipe_codec *c, const uint8_t *body, size_t n, float *y)
{
    decode_scalar((int)c->p[CAST_DTYPE] == CAST_BF16, body, n, y);
    return EPIPE_OK;
}

/* ---- x86 kernels ----------------------------------------------------------
 * They handle whole blocks of 16 values; the caller runs the scalar loop on
 * the rest. The payload is little-endian, as x86 is. */

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <immintrin.h>
#define CAST_X86 1
#define X86_FN static __attribute__((target("avx2,f16c")))

/* F16C from CPUID leaf 1 (not every compiler's __builtin_cpu_supports
 * knows it), asked once: 1 yes, 2 no, 0 not asked yet. */
static int f16c(void)
{
    static int known;
    int k = __atomic_load_n(&known, __ATOMIC_RELAXED);
    if (!k) {
        unsigned a, b, c, d;
        k = __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C) ? 1 : 2;
        __atomic_store_n(&known, k, __ATOMIC_RELAXED);
    }
    return k == 1;
}

static int x86_usable(void)
{
    return epipe_q_simd_enabled() && __builtin_cpu_supports("avx2") && f16c();
}

/* vcvtps2ph rounds to nearest even, keeps NaN payloads as the reference
 * does (quiet bit set, top 10 mantissa bits) and overflows to infinity
 * from |x| >= 65520; a finite lane there becomes 0x7bff | sign by
 * subtracting 1 from the infinity's bits. */
X86_FN void f16_encode_x86(const float *x, size_t n, uint8_t *body)
{
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 big = _mm256_set1_ps(65520.0f), inf = _mm256_set1_ps(INFINITY);
    for (size_t i = 0; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i), a = _mm256_and_ps(v, absmask);
        __m256 sat = _mm256_and_ps(_mm256_cmp_ps(a, big, _CMP_GE_OQ),
                                   _mm256_cmp_ps(a, inf, _CMP_LT_OQ));
        __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m256i s = _mm256_castps_si256(sat);
        __m128i s16 = _mm_packs_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        _mm_storeu_si128((__m128i *)(body + 2 * i), _mm_add_epi16(h, s16));
    }
}

/* The reference's integer rounding, 8 lanes at a time. */
static inline __attribute__((always_inline, target("avx2"))) __m256i bf16_lanes(__m256i u)
{
    const __m256i one = _mm256_set1_epi32(1), absm = _mm256_set1_epi32(0x7fffffff);
    const __m256i expinf = _mm256_set1_epi32(0x7f800000), low = _mm256_set1_epi32(0x7fff);
    __m256i a = _mm256_and_si256(u, absm);
    __m256i nan = _mm256_cmpgt_epi32(a, expinf);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(low, odd)), 16);
    __m256i qnan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    r = _mm256_blendv_epi8(r, qnan, nan);
    __m256i rinf = _mm256_cmpeq_epi32(_mm256_and_si256(r, low), _mm256_set1_epi32(BF16_INF));
    __m256i finite = _mm256_cmpgt_epi32(expinf, a);
    return _mm256_add_epi32(r, _mm256_and_si256(rinf, finite)); /* 0x7f80 -> 0x7f7f */
}

X86_FN void bf16_encode_x86(const float *x, size_t n, uint8_t *body)
{
    for (size_t i = 0; i + 16 <= n; i += 16) {
        __m256i a = bf16_lanes(_mm256_loadu_si256((const __m256i *)(x + i)));
        __m256i b = bf16_lanes(_mm256_loadu_si256((const __m256i *)(x + i + 8)));
        __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xd8);
        _mm256_storeu_si256((__m256i *)(body + 2 * i), p);
    }
}

/* vcvtph2ps is exact; only a signalling NaN may differ (the reference
 * keeps it signalling), so a group holding one is left to the scalar loop. */
X86_FN size_t f16_decode_x86(const uint8_t *body, size_t n, float *y)
{
    const __m128i expm = _mm_set1_epi16(0x7c00), mantm = _mm_set1_epi16(0x03ff);
    const __m128i quiet = _mm_set1_epi16(0x0200);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm_loadu_si128((const __m128i *)(body + 2 * i));
        __m128i snan = _mm_and_si128(
            _mm_cmpeq_epi16(_mm_and_si128(h, expm), expm),
            _mm_andnot_si128(_mm_cmpeq_epi16(_mm_and_si128(h, mantm), _mm_setzero_si128()),
                             _mm_cmpeq_epi16(_mm_and_si128(h, quiet), _mm_setzero_si128())));
        if (!_mm_testz_si128(snan, snan))
            decode_scalar(0, body + 2 * i, 8, y + i);
        else
            _mm256_storeu_ps(y + i, _mm256_cvtph_ps(h));
    }
    return i;
}

X86_FN void bf16_decode_x86(const uint8_t *body, size_t n, float *y)
{
    for (size_t i = 0; i + 8 <= n; i += 8) {
        __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(body + 2 * i)));
        _mm256_storeu_si256((__m256i *)(y + i), _mm256_slli_epi32(h, 16));
    }
}
#else
#define CAST_X86 0
#endif

/* ---- fast path: the kernels on threads ---------------------------------- */

typedef struct cast_job {
    int bf16, x86;
    const float *x;
    float *y;
    uint8_t *body;
    const uint8_t *in;
    size_t n;
} cast_job;

static void encode_task(void *p, unsigned task, unsigned ntasks)
{
    const cast_job *j = p;
    size_t b, e, done = 0;
    epipe_split_range(j->n, ntasks, task, 16, &b, &e);
#if CAST_X86
    if (j->x86) {
        done = (e - b) / 16 * 16;
        if (j->bf16)
            bf16_encode_x86(j->x + b, done, j->body + 2 * b);
        else
            f16_encode_x86(j->x + b, done, j->body + 2 * b);
    }
#endif
    encode_scalar(j->bf16, j->x + b + done, e - b - done, j->body + 2 * (b + done));
}

static void decode_task(void *p, unsigned task, unsigned ntasks)
{
    const cast_job *j = p;
    size_t b, e, done = 0;
    epipe_split_range(j->n, ntasks, task, 16, &b, &e);
#if CAST_X86
    if (j->x86) {
        done = (e - b) / 8 * 8;
        if (j->bf16)
            bf16_decode_x86(j->in + 2 * b, done, j->y + b);
        else
            f16_decode_x86(j->in + 2 * b, done, j->y + b);
    }
#endif
    decode_scalar(j->bf16, j->in + 2 * (b + done), e - b - done, j->y + b + done);
}

static int cast_encode(epipe_codec *c, const float *x, size_t n, uint8_t *body)
{
    cast_job j = {.bf16 = (int)c->p[CAST_DTYPE] == CAST_BF16, .x = x, .body = body, .n = n};
#if CAST_X86
    j.x86 = x86_usable();
#endif
    epipe_parallel_run(epipe_codec_workers(c, n), encode_task, &j);
    return EPIPE_OK;
}

static int cast_decode(epipe_codec *c, const uint8_t *body, size_t n, float *y)
{
    cast_job j = {.bf16 = (int)c->p[CAST_DTYPE] == CAST_BF16, .in = body, .y = y, .n = n};
#if CAST_X86
    j.x86 = x86_usable();
#endif
    epipe_parallel_run(epipe_codec_workers(c, n), decode_task, &j);
    return EPIPE_OK;
}

static const epipe_codec_backend cast_cpu = {
    .encode = cast_encode,
    .decode = cast_decode,
    .encode_ref = cast_encode_ref,
    .decode_ref = cast_decode_ref,
};

const epipe_codec_ops epipe_codec_cast = {
    .name = "cast",
    .id = EPIPE_CODEC_ID_CAST,
    .params = cast_params,
    .nparams = 1,
    .param_word = cast_param_word,
    .body_size = cast_body_size,
    .cpu = &cast_cpu,
};
