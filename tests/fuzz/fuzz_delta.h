/* What the activation-delta fuzz target and its corpus generator share:
 * the specs, and the priming stream both sides of a boundary have seen. */
#ifndef EPIPE_FUZZ_DELTA_H
#define EPIPE_FUZZ_DELTA_H

#include <stdlib.h>
#include <string.h>

#include <epipe/epipe.h>

static const char *const fuzz_delta_specs[] = {
    "quant:bits=2,delta=1",         "sortquant:bits=4,delta=1", "topk:ratio=0.5,delta=1",
    "cast:dtype=bf16,delta=1",      "kmeans:bits=2,delta=1",    "quant:bits=2,rows=1,delta=1",
    "quant:bits=2,group=2,delta=1",
};
#define FUZZ_DELTA_NSPECS (sizeof fuzz_delta_specs / sizeof fuzz_delta_specs[0])

/* Input layout: byte 0 picks the spec, byte 1 the rows (1..16), byte 2 the
 * values per row (1..64, made even for group=2); the rest is a delta
 * payload's body (after the 16-byte core header, which the target writes). */
#define FUZZ_DELTA_SEL 3

/* The tensor shape bytes 1 and 2 select for spec: rows 1..16, values per
 * row 1..64 (made even for group=2, whose runs must divide a row). */
static inline void fuzz_delta_shape(const char *spec, uint8_t rows_byte, uint8_t cols_byte,
                                    int64_t *rows, int64_t *cols)
{
    *rows = 1 + rows_byte % 16;
    *cols = 1 + cols_byte % 64;
    if (strstr(spec, "group=2"))
        *cols += *cols % 2;
}

/* Encodes rows x cols deterministic values of epoch e for the samples ids
 * with c: *out is malloc'd. 0 on success. */
static int fuzz_delta_encode(epipe_codec *c, int64_t rows, int64_t cols, const uint64_t *ids, int e,
                             uint8_t **out, size_t *len)
{
    size_t n = (size_t)(rows * cols);
    float *x = malloc(n * sizeof *x + 1);
    int64_t shape[2] = {rows, cols};
    DLTensor t = {
        .data = x, .device = {kDLCPU, 0}, .ndim = 2, .dtype = {kDLFloat, 32, 1}, .shape = shape};
    for (size_t i = 0; i < n; i++)
        x[i] = (float)((int)((i * 2654435761u + (unsigned)e * 40503u) % 2001) - 1000) / 300.0f;
    size_t cap = 0;
    *out = NULL;
    int rc = epipe_codec_max_encoded_size(c, &t, &cap);
    if (!rc && !(*out = malloc(cap)))
        rc = EPIPE_ENOMEM;
    if (!rc)
        rc = epipe_codec_set_samples(c, ids, (size_t)rows);
    if (!rc)
        rc = epipe_codec_encode(c, &t, *out, cap, len);
    free(x);
    return rc;
}

/* The priming stream: samples 0..rows-1, epoch 0. */
static void fuzz_delta_prime_ids(uint64_t *ids, int64_t rows)
{
    for (int64_t i = 0; i < rows; i++)
        ids[i] = (uint64_t)i;
}

#endif
