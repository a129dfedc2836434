/* Shared core of the uniform quantizers (quant, sortquant): the step and
 * level formulas, per-chunk tables and the threaded code and decode kernels. */
#ifndef EPIPE_CODECS_QUANTIZE_COMMON_H
#define EPIPE_CODECS_QUANTIZE_COMMON_H

#include <stddef.h>
#include <stdint.h>

#include "../lib/clones.h"
#include "../lib/codec/codec_impl.h"
#include "inline/quant.h"

/* The largest number of chunks a table holds (sortquant split <= 12). */
#define EPIPE_Q_MAX_CHUNKS 4096

/* A quantizer with k = 2^S chunks of q level bits each (bits = S + q).
 * Value x falls in chunk c = #{1 <= j < k : bnd[j] <= x}; its code is
 * (c << q) | level, level = epipe_q_level(x, min[c], inv[c], levels). The
 * decoded value is min[c] + (float)level * step[c]. An empty chunk has
 * min = step = inv = 0. */
typedef struct epipe_qtab {
    unsigned bits, q, k;
    float levels;            /* 2^q - 1 */
    int zero;                /* spec key zero=1: 0 is a level (epipe_q_set_chunk) */
    float *bnd;              /* [k + 1]: bnd[0] = -inf, bnd[k] = +inf */
    float *min, *step, *inv; /* [k] */
} epipe_qtab;

/* Allocates the arrays for `bits` code bits split into 2^split chunks;
 * EPIPE_ENOMEM on failure. epipe_qtab_free() releases them. */
int epipe_qtab_init(epipe_qtab *t, unsigned bits, unsigned split);
void epipe_qtab_free(epipe_qtab *t);

/* The step for a chunk spanning [min, max] with `levels` steps: 0 when
 * max == min, otherwise (max - min) / levels rounded to float, at least
 * FLT_MIN (so 1/step is finite) and small enough that min + levels * step
 * is finite. min and max must be finite. */
static inline float epipe_q_step(float min, float max, float levels)
{
    return epipe_hd_q_step(min, max, levels);
}

/* The level of x in a chunk: round((x - min) * inv), clamped to [0, levels]
 * (halves round up). Fast kernels compute exactly this expression; it is
 * the CUDA kernels' too (inline/quant.h). */
static inline uint32_t epipe_q_level(float x, float min, float inv, float levels)
{
    return epipe_hd_q_level(x, min, inv, levels);
}

/* Sets chunk j from the smallest and largest value it holds (min and max
 * are stored with -0 made +0), or marks it empty. With t->zero set and
 * min < 0 <= max, the grid moves by less than half a step so that level
 * z = round(-min / step) decodes to exactly 0: min becomes -(z * step)
 * (each value still decodes within step/2 of itself). */
void epipe_q_set_chunk(epipe_qtab *t, unsigned j, float min, float max);
void epipe_q_set_empty(epipe_qtab *t, unsigned j);

/* The code of x placed in chunk c. */
static inline uint16_t epipe_q_code(const epipe_qtab *t, float x, unsigned c)
{
    return (uint16_t)(c << t->q | epipe_q_level(x, t->min[c], t->inv[c], t->levels));
}

/* Bytes of the (min f32, step f32) pairs, k of them, that start a body. */
static inline size_t epipe_q_table_bytes(const epipe_qtab *t)
{
    return (size_t)8 * t->k;
}
void epipe_q_write_table(const epipe_qtab *t, uint8_t *body);
/* Reads and validates the pairs (finite min, finite non-negative step,
 * finite min + levels * step) and the code padding bits; EPIPE_EPROTO
 * with a message on the codec otherwise. */
int epipe_q_read_table(epipe_codec *c, epipe_qtab *t, const uint8_t *body, size_t n);

/* Per-chunk extent of x[0..n) on `threads` threads: when chunk j holds
 * values, lo[j] and hi[j] are the smallest and largest of them; when it is
 * empty, lo[j] >= bnd[j + 1]. Returns the index of the first NaN or
 * infinity, or n if none (lo and hi are then meaningless). */
size_t epipe_q_extent(const epipe_qtab *t, const float *x, size_t n, float *lo, float *hi,
                      unsigned threads);
/* Fills min/step/inv from an extent: chunk j is non-empty iff lo[j] <
 * bnd[j + 1], and then spans [lo[j], hi[j]]. */
void epipe_q_set_from_extent(epipe_qtab *t, const float *lo, const float *hi);

/* Called on each block of up to EPIPE_Q_BLOCK codes after the kernel
 * classified it by value, to move values whose chunk is not decided by
 * value alone (ties at a sortquant exact boundary). Blocks of one task come
 * in index order; task is the index of the task in [0, threads). */
typedef void (*epipe_q_fixup_fn)(void *ctx, unsigned task, const float *x, size_t i0, size_t cnt,
                                 uint16_t *codes);
#define EPIPE_Q_BLOCK 2048
/* The range of x that task `task` of `threads` codes; every pass that must
 * agree with epipe_q_encode's blocks uses it. */
void epipe_q_task_range(size_t n, unsigned threads, unsigned task, size_t *begin, size_t *end);

/* Codes x[0..n) by value and packs them at t->bits bits into out. */
void epipe_q_encode(const epipe_qtab *t, const float *x, size_t n, uint8_t *out, unsigned threads,
                    epipe_q_fixup_fn fixup, void *fixup_ctx);

/* Decodes n packed codes into y. lut has room for 2^bits floats. */
void epipe_q_decode(const epipe_qtab *t, const uint8_t *codes, size_t n, float *y, float *lut,
                    unsigned threads);
/* The plain scalar decoder: one code at a time, read bit by bit. */
void epipe_q_decode_ref(const epipe_qtab *t, const uint8_t *codes, size_t n, float *y);

/* ---- helpers for the vector kernels (quantize_common.c, select.c) ------ */

/* Hot kernels are built twice, for AVX2 and for the baseline, and picked
 * at load time (EPIPE_CLONES, lib/clones.h); both round exactly like the
 * scalar references. */
#define Q_INLINE static inline __attribute__((always_inline))

/* GCC vector extensions: 8 lanes, two SSE registers on the baseline.
 * Macros rather than functions: a function taking or returning a 32-byte
 * vector draws -Wpsabi on the baseline clone. */
typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));
#define VL 8
#define vsplat(a) ((vf){(a), (a), (a), (a), (a), (a), (a), (a)})
#define vsplati(a) ((vi){(a), (a), (a), (a), (a), (a), (a), (a)})
#define vsel(m, a, b) ((vf)((((vi)(a)) & (m)) | (((vi)(b)) & ~(m))))

/* AVX2 kernels (quantize_x86.c) for k <= 16, used when the CPU has AVX2;
 * each returns 0 when it does not handle k. */
#if defined(__x86_64__) && defined(__GNUC__)
#define EPIPE_Q_X86 1
int epipe_q_avx2_usable(void);
int epipe_q_extent_avx2(const float *x, size_t n, const float *bnd, unsigned k, float *lo,
                        float *hi, float *bad);
int epipe_q_code_avx2(const float *x, size_t n, const epipe_qtab *t, uint16_t *code);
#else
#define EPIPE_Q_X86 0
#endif

/* Tests and epipe-bench: 0 makes the kernels above use their generic
 * (baseline vector) versions, so both can be checked against the scalar
 * references on one machine. Returns the previous setting; default 1.
 * Process-wide by design (it selects an instruction set, not a result: both
 * versions give the same bits, which is what the tests check) and atomic:
 * any thread may flip it at any time; a kernel call reads it once per
 * chunk, so a call running meanwhile may mix both versions, with identical
 * output. Not exported; codec handles have their own per-handle switch to
 * the scalar reference (epipe_codec_use_reference, codec_impl.h). */
int epipe_q_set_simd(int on);
/* The current setting; cast's and topk's x86 kernels follow it too, and
 * it sets lib/bitpack's switch (epipe_bitpack_set_simd). */
int epipe_q_simd_enabled(void);

/* Rejects NaN and infinity by index (EPIPE_EINVAL on the codec). */
int epipe_q_reject_nonfinite(epipe_codec *c, const float *x, size_t n, size_t bad);

#endif
