/* Fuzz target: the activation-delta wrapper (spec key delta=1) on hostile
 * bodies, decoded by a decoder that holds rows for some samples. */
#include <stdlib.h>
#include <string.h>

#include <epipe/epipe.h>

#include "fuzz.h"
#include "fuzz_delta.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < FUZZ_DELTA_SEL)
        return 0;
    const char *spec = fuzz_delta_specs[data[0] % FUZZ_DELTA_NSPECS];
    int64_t rows, cols;
    fuzz_delta_shape(spec, data[1], data[2], &rows, &cols);
    epipe_codec *enc, *dec;
    if (epipe_codec_create(&enc, spec) || epipe_codec_create(&dec, spec))
        abort(); /* the specs above are valid */
    uint64_t ids[16];
    fuzz_delta_prime_ids(ids, rows);
    uint8_t *p0;
    size_t len0;
    float *out = malloc((size_t)(rows * cols) * sizeof *out);
    int64_t shape[2] = {rows, cols};
    DLTensor t = {
        .data = out, .device = {kDLCPU, 0}, .ndim = 2, .dtype = {kDLFloat, 32, 1}, .shape = shape};
    if (fuzz_delta_encode(enc, rows, cols, ids, 0, &p0, &len0) ||
        epipe_codec_decode(dec, p0, len0, &t))
        abort(); /* the priming stream is valid */
    size_t len = 16 + size - FUZZ_DELTA_SEL;
    uint8_t *p = malloc(len);
    memcpy(p, p0, 16); /* the header of a valid payload of this shape */
    memcpy(p + 16, data + FUZZ_DELTA_SEL, size - FUZZ_DELTA_SEL);
    for (int k = 0; k < 2; k++) { /* again, on the state the first left */
        int rc = epipe_codec_decode(dec, p, len, &t);
        if (rc != EPIPE_OK && epipe_codec_last_error(dec)[0] == '\0')
            abort(); /* every failure must say why */
    }
    free(p), free(p0), free(out);
    epipe_codec_destroy(enc), epipe_codec_destroy(dec);
    return 0;
}
