/* Shared test helpers: deterministic random data and DLTensor views. */
#ifndef EPIPE_TESTUTIL_H
#define EPIPE_TESTUTIL_H

#include <dlpack/dlpack.h>
#include <stddef.h>
#include <stdint.h>

enum test_dist { DIST_NORMAL, DIST_RELU, DIST_LOGNORMAL, DIST_UNIFORM };

/* xorshift64* generator: the same seed gives the same stream everywhere. */
typedef struct {
    uint64_t s;
} test_rng;
void test_rng_seed(test_rng *r, uint64_t seed);
uint64_t test_rng_next(test_rng *r);
double test_rng_uniform(test_rng *r); /* [0, 1) */
double test_rng_normal(test_rng *r);

/* Fills x[0..n) from a distribution: N(0,1), max(0, N(0,1)), exp(N(0,1))
 * with a random sign (heavy-tailed), or U(-1, 1). */
void test_fill(float *x, size_t n, enum test_dist d, uint64_t seed);

/* A dense 1-D fp32 view of x[0..n). The shape lives in *shape_store. */
DLTensor test_view_f32(float *x, int64_t *shape_store, size_t n);
/* A dense fp32 CPU tensor of `ndim` dimensions over x; shape is borrowed. */
DLTensor test_view_f32_nd(float *x, int64_t *shape, int ndim);

double test_mse(const float *a, const float *b, size_t n);

/* Codec helpers for cmocka tests: each fails the test, with the library's
 * message, on any error. `threads` sets EPIPE_CODEC_THREADS; `ref` routes
 * through the codec's scalar reference. */
struct epipe_codec;
typedef struct {
    uint8_t *buf; /* malloc'd; the caller frees it */
    size_t len;
} test_payload;
struct epipe_codec *test_codec(const char *spec, int threads, int ref);
/* Encodes x[0..n) as a 1-D tensor with a fresh codec of `spec`. */
test_payload test_encode(const char *spec, float *x, size_t n, int threads, int ref);
/* Encodes the tensor t (any shape) with a fresh codec of `spec`. */
test_payload test_encode_view(const char *spec, const DLTensor *t, int threads, int ref);
/* Decodes p into y[0..n) with a fresh codec of `spec`. */
void test_decode(const char *spec, const test_payload *p, float *y, size_t n, int threads, int ref);
/* Decoding p with c, through the fast path and the scalar reference, must
 * give EPIPE_EPROTO with a message that contains `needle`. */
void test_expect_rejected(struct epipe_codec *c, const uint8_t *p, size_t len, DLTensor *t,
                          const char *needle);
/* The same for a fresh codec of `spec` decoding p into n values. */
void test_expect_proto(const char *spec, const test_payload *p, size_t n, const char *needle);

/* A sealed activation message of the n floats at x from rank src to dst,
 * made as the stage makes one (codec none; the wire header's codec fields
 * read from the payload header). The caller owns it (epipe_msg_free, or a
 * send, which takes it). Fails the test when anything does. */
struct epipe_msg *test_activation_msg(unsigned src, unsigned dst, uint64_t step, uint32_t mb,
                                      const float *x, size_t n);

/* Runs fn(arg) in a child of fork() (the test's output flushed first, so
 * that the child does not write it again) and returns the exit status the
 * child's return value gave, or minus the signal that killed it. For checks
 * that change the whole process: limits, signal dispositions, stderr. */
int test_in_child(int (*fn)(const void *arg), const void *arg);

/* A TCP port on 127.0.0.1 that was free a moment ago (bound, read, closed). */
unsigned test_free_port(void);

#endif
