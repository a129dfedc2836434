/* Exact order statistics of float arrays by radix select (two histogram
 * passes, no sort), for sortquant's chunk boundaries. */
#ifndef EPIPE_CODECS_SORTQUANT_SELECT_H
#define EPIPE_CODECS_SORTQUANT_SELECT_H

#include <stddef.h>
#include <stdint.h>

/* Scratch memory kept between calls; zero-initialise, free with
 * epipe_sq_select_free(). */
typedef struct sq_select {
    uint32_t *hist; /* [nsub][65536] per sub-range histograms */
    size_t hist_cap;
    uint16_t *cand; /* low halves of the keys in the wanted buckets */
    size_t cand_cap;
    void *aux; /* per-rank and per-slot bookkeeping */
    size_t aux_cap;
} sq_select;

/* The order-preserving key of a float (-0 is keyed as +0). */
static inline uint32_t sq_key(float f)
{
    union {
        float f;
        uint32_t u;
    } c = {.f = f + 0.0f};
    return c.u ^ ((uint32_t)((int32_t)c.u >> 31) | 0x80000000u);
}
static inline float sq_unkey(uint32_t k)
{
    union {
        float f;
        uint32_t u;
    } c = {.u = (k & 0x80000000u) ? k ^ 0x80000000u : ~k};
    return c.f;
}

/* For the R nondecreasing ranks rank[i] < n, finds val[i], the value at that
 * rank in ascending order of x[0..n) (-0 counts as and is returned as +0),
 * and lt[i], the number of x below it. Runs on up to `threads` threads.
 * If nonfinite is not NULL, x is checked on the way: when it holds a NaN or
 * an infinity, *nonfinite becomes 1 and val and lt are not filled; without
 * the check such x give meaningless (but defined) results. Returns 0, or
 * EPIPE_ENOMEM. */
int epipe_sq_select_ranks(sq_select *s, const float *x, size_t n, const uint64_t *rank, size_t R,
                          float *val, uint64_t *lt, unsigned threads, int *nonfinite);
void epipe_sq_select_free(sq_select *s);

#endif
