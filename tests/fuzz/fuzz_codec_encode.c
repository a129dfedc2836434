/* Fuzz target: every codec's encoder on hostile tensors. Input layout:
 * byte 0 picks the codec (fuzz_specs.h), byte 1 the tensor's form (bits
 * 0-1: fp32, fp16 or bf16; bits 2-3: byte offset 0-3 from an aligned
 * buffer; bit 4: the transpose of a dense tensor, as strides; bit 5: two
 * threads), byte 2 the row count (1-8), the rest the elements' bytes: any
 * bit pattern, NaN, infinities and denormals included. An encode succeeds
 * or fails with a message; what it wrote fits in max_encoded_size and
 * decodes, with the same handle kind, into a tensor of the same shape; the
 * lossless codec gives back every value that is not a NaN exactly. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <epipe/epipe.h>

#include "fuzz.h"
#include "fuzz_specs.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 3)
        return 0;
    const char *spec = fuzz_specs[data[0] % FUZZ_NSPECS];
    unsigned form = data[1];
    static const DLDataType dtypes[3] = {{kDLFloat, 32, 1}, {kDLFloat, 16, 1}, {kDLBfloat, 16, 1}};
    DLDataType dt = dtypes[(form & 3) % 3];
    size_t esz = dt.bits / 8u, off = (form >> 2) & 3;
    int transposed = (form >> 4) & 1;
    int64_t rows = 1 + data[2] % 8;
    size_t bytes = size - 3;
    int64_t cols = (int64_t)(bytes / esz) / rows;
    if (cols > 4096)
        cols = 4096;
    size_t n = (size_t)(rows * cols);
    epipe_codec *c, *d;
    int created = epipe_codec_create(&c, spec);
#ifndef EPIPE_HAVE_BLAS
    if (created == EPIPE_ENOTSUP)
        return 0; /* poweriter and insert, in a build without the blas feature */
#endif
    if (created != EPIPE_OK || epipe_codec_create(&d, spec) != EPIPE_OK)
        abort(); /* the specs are valid */
    epipe_codec_set_param(c, EPIPE_CODEC_THREADS, (form >> 5) & 1 ? 2 : 1);
    /* the elements, at the byte offset the input asks for */
    unsigned char *buf = malloc(n * esz + off + 1);
    memcpy(buf + off, data + 3, n * esz);
    int64_t shape[2], strides[2];
    DLTensor t = {.data = buf, .byte_offset = off, .device = {kDLCPU, 0}, .ndim = 2, .dtype = dt};
    if (transposed) { /* [cols, rows] read across the rows of the buffer */
        shape[0] = cols, shape[1] = rows;
        strides[0] = 1, strides[1] = cols;
        t.strides = strides;
    } else {
        shape[0] = rows, shape[1] = cols;
    }
    t.shape = shape;
    size_t cap = 0, w = 0;
    int rc = epipe_codec_max_encoded_size(c, &t, &cap);
    if (rc == EPIPE_OK) {
        unsigned char *payload = malloc(cap + 1);
        rc = epipe_codec_encode(c, &t, payload, cap, &w);
        if (rc == EPIPE_OK) {
            if (w > cap)
                abort(); /* wrote past what it said it would need */
            float *y = malloc(n * sizeof *y + 1);
            int64_t yshape[2] = {shape[0], shape[1]};
            DLTensor out = {.data = y,
                            .device = {kDLCPU, 0},
                            .ndim = 2,
                            .dtype = {kDLFloat, 32, 1},
                            .shape = yshape};
            if (epipe_codec_decode(d, payload, w, &out) != EPIPE_OK)
                abort(); /* its own payload must decode */
            if (!strcmp(spec, "none") && dt.bits == 32)
                for (size_t i = 0; i < n; i++) {
                    float x;
                    size_t at = transposed ? (i % (size_t)rows) * (size_t)cols + i / (size_t)rows
                                           : i;
                    memcpy(&x, data + 3 + at * 4, 4);
                    if (!isnan(x) && memcmp(&x, &y[i], 4))
                        abort(); /* lossless is lossless */
                }
            free(y);
        }
        free(payload);
    }
    if (rc != EPIPE_OK && !epipe_codec_last_error(c)[0])
        abort(); /* every refusal says why */
    free(buf);
    epipe_codec_destroy(c);
    epipe_codec_destroy(d);
    return 0;
}
