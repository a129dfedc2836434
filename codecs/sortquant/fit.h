/* sortquant mode=fit: chunk boundaries and split bits chosen to minimise the
 * modelled MSE of piecewise-uniform quantisation, from a sample's histogram. */
#ifndef EPIPE_CODECS_SORTQUANT_FIT_H
#define EPIPE_CODECS_SORTQUANT_FIT_H

#include <stddef.h>
#include <stdint.h>

/* The most split bits fit chooses or accepts: 16 chunks, the widest table
 * the small-k vector kernels keep in registers. */
#define SQ_FIT_SMAX 4

/* A non-empty bucket of the sample: the top 16 bits of the order key
 * (sq_key() >> 16) and how many sample values have them. */
typedef struct sq_bucket {
    uint32_t key16, count;
} sq_bucket;

/* What the fit chose: S split bits, `used` <= 2^S non-empty chunks (fewer
 * only when the sample has fewer distinct buckets than a fixed S needs),
 * the boundaries bnd[1..used) (bnd[0] unused) and top[j] = the largest
 * float below bnd[j + 1]. Chunk j holds the x with bnd[j] <= x < bnd[j + 1]
 * and is quantised over [bnd[j], top[j]] (the first from the tensor's
 * minimum, the last to its maximum). Every boundary is the smallest float
 * of a bucket that holds sample values, so no used chunk is empty. */
typedef struct sq_plan {
    unsigned S, used;
    float bnd[1u << SQ_FIT_SMAX];
    float top[1u << SQ_FIT_SMAX];
} sq_plan;

/* Scratch kept between calls; zero-initialise, free with epipe_sq_fit_free(). */
typedef struct sq_fit {
    void *mem;
    size_t cap;
    uint32_t *hist; /* the fast path's 65536 bucket counts, kept zero */
    float *sample;  /* the drawn sample, when it is not the whole tensor */
    size_t sample_cap;
} sq_fit;
void epipe_sq_fit_free(sq_fit *f);

/* Plans chunks for the nb buckets b[] (ascending key16, non-empty) of a
 * sample, for `bits` code bits: with fixed >= 0, S = fixed; otherwise the
 * S in 0..smax (2^S no more than the number of bins) whose best chunking
 * has the lowest modelled MSE, ties to the smaller S. A bucket of a NaN or
 * an infinity gives S = 0 (the encoder's extent pass then rejects the
 * input). Deterministic: the fast path and the reference share it. Returns
 * 0 or EPIPE_ENOMEM. */
int epipe_sq_fit_plan(sq_fit *f, const sq_bucket *b, size_t nb, unsigned bits, int fixed,
                      unsigned smax, sq_plan *out);

#endif
