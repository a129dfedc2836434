/* topk internals shared by codecs/topk.c and its AVX2 kernels
 * (codecs/topk_x86.c): the job of one encode and the magnitude key. */
#ifndef EPIPE_CODECS_TOPK_IMPL_H
#define EPIPE_CODECS_TOPK_IMPL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define TOPK_BINS 65536
#define TOPK_BAD_BIN 0x7f80u /* epipe_topk_mag() >> 16 of infinity; NaN is above */

typedef struct topk_job {
    const float *x;
    size_t n;
    unsigned nt;
    uint32_t *hist;        /* [nt][TOPK_BINS], per range (< 2^32 entries) */
    uint32_t bin;          /* pass 2: the top-16-bit bin B */
    uint16_t *cand;        /* pass 2: low 16 bits of bin B's entries */
    uint64_t *coff;        /* pass 2: per range offset into cand */
    uint32_t thr;          /* pass 3: the threshold T */
    uint64_t *off, *quota; /* pass 3: per range output offset and == T to keep */
    uint8_t *idx, *val;
    unsigned w;
    int x86;           /* pass 3 may use AVX2 */
    uint32_t wlo, whi; /* window pass: the magnitudes collected */
    uint32_t *wcand;   /* window pass: [nt][wcap] magnitudes in the window */
    size_t wcap;
    uint64_t *wabove, *wcount, *wbad; /* per range: > whi, in window, non-finite */
} topk_job;

/* Entries staged per run of the emit pass (its local buffers hold two). */
#define TOPK_RUN 256

/* Magnitude as an integer: for finite floats, clearing the sign bit gives
 * bits whose unsigned order is the order of |x| (+0 and -0 are equal). */
static inline uint32_t epipe_topk_mag(float v)
{
    union {
        float f;
        uint32_t u;
    } b = {.f = v};
    return b.u & 0x7fffffffu;
}

#if defined(__x86_64__) && defined(__GNUC__) && defined(__BYTE_ORDER__) &&                         \
    __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define TOPK_X86 1
/* The emit pass for 32-bit indices over [b, e) from output entry o with
 * `quota` entries equal to T to keep, and the window pass of range t. */
void epipe_topk_emit_avx2(topk_job *j, size_t b, size_t e, uint64_t o, uint64_t quota);
void epipe_topk_window_avx2(topk_job *j, size_t b, size_t e, unsigned t);
#else
#define TOPK_X86 0
#endif

#endif
