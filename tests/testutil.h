/* Shared test helpers: deterministic random data and DLTensor views. */
#ifndef EPIPE_TESTUTIL_H
#define EPIPE_TESTUTIL_H

#include <dlpack/dlpack.h>
#include <stddef.h>
#include <stdint.h>

enum test_dist { DIST_NORMAL, DIST_RELU, DIST_LOGNORMAL, DIST_UNIFORM };

/* xorshift64* generator: the same seed gives the same stream everywhere. */
typedef struct { uint64_t s; } test_rng;
void test_rng_seed(test_rng *r, uint64_t seed);
uint64_t test_rng_next(test_rng *r);
double test_rng_uniform(test_rng *r); /* [0, 1) */
double test_rng_normal(test_rng *r);

/* Fills x[0..n) from a distribution: N(0,1), max(0, N(0,1)), exp(N(0,1))
 * with a random sign (heavy-tailed), or U(-1, 1). */
void test_fill(float *x, size_t n, enum test_dist d, uint64_t seed);

/* A dense 1-D fp32 view of x[0..n). The shape lives in *shape_store. */
DLTensor test_view_f32(float *x, int64_t *shape_store, size_t n);

double test_mse(const float *a, const float *b, size_t n);

#endif
