/* Fuzz target: every codec's decoder on hostile payloads. Input layout:
 * byte 0 picks the codec (fuzz_specs.h), bytes 1-2 the element count of the
 * destination (little-endian, at most 4096), the rest is the payload. A
 * per-row spec (fuzz_spec_per_row) decodes into [r, n / r], r = 1 + byte
 * 2 % 8; every other into [n]. */
#include <stdlib.h>

#include <epipe/epipe.h>

#include "fuzz.h"
#include "fuzz_specs.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 3)
        return 0;
    const char *spec = fuzz_specs[data[0] % FUZZ_NSPECS];
    int64_t n = (data[1] | data[2] << 8) % 4097;
    epipe_codec *c;
    int created = epipe_codec_create(&c, spec);
#ifndef EPIPE_HAVE_BLAS
    if (created == EPIPE_ENOTSUP)
        return 0; /* poweriter and insert, in a build without the blas feature */
#endif
    if (created != EPIPE_OK)
        abort(); /* the specs above are valid */
    float *out = malloc((size_t)n * sizeof *out + 1);
    int64_t shape[2] = {n, 1};
    int ndim = 1;
    if (fuzz_spec_per_row(spec)) {
        shape[0] = 1 + data[2] % 8;
        shape[1] = n / shape[0];
        ndim = 2;
    }
    DLTensor t = {.data = out,
                  .device = {kDLCPU, 0},
                  .ndim = ndim,
                  .dtype = {kDLFloat, 32, 1},
                  .shape = shape};
    int rc = epipe_codec_decode(c, data + 3, size - 3, &t);
    if (rc != EPIPE_OK && epipe_codec_last_error(c)[0] == '\0')
        abort(); /* every failure must say why */
    free(out);
    epipe_codec_destroy(c);
    return 0;
}
