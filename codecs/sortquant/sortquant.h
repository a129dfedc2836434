/* sortquant internals shared by the fast path and the scalar reference:
 * parameters, the rank and sample-position formulas, the codec's state. */
#ifndef EPIPE_CODECS_SORTQUANT_H
#define EPIPE_CODECS_SORTQUANT_H

#include <stddef.h>
#include <stdint.h>

#include "../../lib/codec/codec_impl.h"
#include "../inline/sortquant.h"
#include "../quantize_common.h"
#include "fit.h"
#include "select.h"

/* The parameter word: B | S << 8, and for mode=fit the fit layout flag and,
 * when S is chosen per tensor, the chosen flag (S is then the largest S the
 * encoder may choose). docs/codecs.md, "sortquant". */
#define SQ_WORD_FIT (1u << 16)
#define SQ_WORD_CHOSEN (1u << 17)

typedef struct sq_state {
    epipe_qtab tab;
    float *lut; /* 2^bits decoded values */
    sq_select sel;
    void *work; /* ranks, order statistics, extents, tie counters */
    size_t work_cap;
    /* mode=fit: one table per split S in 0..fit_smax; fit_fixed is the
     * split given in the spec, or -1 when it is chosen per tensor. */
    epipe_qtab ftab[SQ_FIT_SMAX + 1];
    unsigned fit_smax;
    int fit_fixed;
    sq_fit fit;
} sq_state;

/* floor(j * n / k) without overflow, for j <= k <= 4096: where chunk j of k
 * starts in sorted order in exact mode, and which sample order statistic
 * bounds chunk j in sample mode. */
static inline uint64_t sq_rank(uint64_t j, uint64_t n, unsigned k)
{
    return epipe_hd_sq_rank(j, n, k);
}

static inline uint64_t sq_mix(uint64_t z)
{
    return epipe_hd_sq_mix(z);
}

/* Sample mode reads m = min(n, sample) values: sample k is a pseudo-random
 * position in the k-th of m equal strata of [0, n), stratum k being
 * [floor(k n / m), floor((k+1) n / m)), the offset in it
 * ((mix(k) >> 32) * len) >> 32 for a stratum of len values (mix(k) % len
 * past 2^32). With m == n, every value once, in order. The CUDA kernel
 * computes each position directly (epipe_hd_sq_sample_pos); test_inline
 * checks that both give the same sample. */
static inline void sq_sample_gather(const float *x, uint64_t n, uint64_t m, float *out)
{
    /* Positions run PF ahead of the loads, so that many cache and TLB misses
     * are in flight at once: the reads are scattered over all of x. */
    enum { PF = 32 };
    uint64_t q = n / m, r = n % m, lo = 0, rem = 0, pos[PF];
    for (uint64_t k = 0; k < m + PF; k++) {
        if (k >= PF)
            out[k - PF] = x[pos[k % PF]];
        if (k >= m)
            continue;
        uint64_t len = q;
        rem += r;
        if (rem >= m) {
            rem -= m;
            len++;
        }
        uint64_t z = sq_mix(k);
        pos[k % PF] = lo + (len <= 0xffffffffu ? ((z >> 32) * len) >> 32 : z % len);
        __builtin_prefetch(x + pos[k % PF]);
        lo += len;
    }
}

static inline uint64_t sq_sample_count(uint64_t n, double sample)
{
    return n < (uint64_t)sample ? n : (uint64_t)sample;
}

/* mode=fit (fit.c): the fast encoder; the check of a body's fit word,
 * table and padding, giving the table of its split; a plan's boundaries
 * and chunk ranges put into table t, for n values spanning [min, max]; the
 * fit word, table and padding written. */
int epipe_sq_encode_fit(epipe_codec *c, const float *x, size_t n, uint8_t *body);
/* The largest split a fit body of n values may hold: the fixed split, or
 * the configured largest lowered until the 8·2^S table bytes are at most
 * an eighth of the code bytes (small tensors get small tables). */
static inline unsigned sq_fit_smax_for(const sq_state *st, unsigned bits, uint64_t n)
{
    if (st->fit_fixed >= 0)
        return (unsigned)st->fit_fixed;
    unsigned S = st->fit_smax;
    uint64_t codes = n / 8 * bits + (n % 8 * bits + 7) / 8;
    while (S > 0 && (64ull << S) > codes)
        S--;
    return S;
}
int epipe_sq_fit_read(epipe_codec *c, const uint8_t *body, size_t n, epipe_qtab **t);
/* The host's part of a fit encode, shared by the CPU encoder and the CUDA
 * module: from the sample s[0..m) of the n values, whose extent is
 * [lo, hi] (finite), the plan and its table (*t, in the handle's state),
 * and every byte of the body but the codes: the fit word, the table and
 * the padding after the codes. n = 0 writes the empty body. */
int epipe_sq_fit_host(epipe_codec *c, const float *s, size_t m, size_t n, float lo, float hi,
                      uint8_t *body, epipe_qtab **t);
/* Room for an m-value sample in the handle's fit scratch; NULL if none. */
float *epipe_sq_fit_sample_buf(sq_state *st, size_t m);
void epipe_sq_fit_set_chunks(epipe_qtab *t, const sq_plan *pl, size_t n, float min, float max);
void epipe_sq_fit_finish(const sq_state *st, unsigned S, size_t n, uint8_t *body);

int epipe_sq_encode_ref(epipe_codec *c, const float *x, size_t n, uint8_t *body);
int epipe_sq_decode_ref(epipe_codec *c, const uint8_t *body, size_t n, float *y);

#endif
