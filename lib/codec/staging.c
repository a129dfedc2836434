/* Dtype staging for the CPU backend: dense fp32 views of any-strided fp32,
 * fp16 and bf16 host tensors, through the handle's scratch buffer (and, for
 * the backward calls, of CUDA tensors, through host copies). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "cuda_core.h"

static float *scratch(epipe_codec *c, size_t n)
{
    if (c->scratch_cap < n) {
        float *p = realloc(c->scratch, n * sizeof *p);
        if (!p)
            return NULL;
        c->scratch = p;
        c->scratch_cap = n;
    }
    return c->scratch;
}

/* The kernels read and write such a tensor in place: dense fp32 whose
 * first element is 4-byte aligned (DLPack allows any byte_offset; a tensor
 * whose data do not start on an element boundary is staged like a strided
 * one, element by element with memcpy). */
static int dense_f32(const DLTensor *t, enum epipe_dtype dt)
{
    return dt == EPIPE_DTYPE_F32 && epipe_tensor_is_dense(t) &&
           ((uintptr_t)t->data + t->byte_offset) % sizeof(float) == 0;
}

int epipe_codec_stage_in(epipe_codec *c, const DLTensor *src, uint64_t n, enum epipe_dtype dt,
                         const float **x)
{
    if (dense_f32(src, dt)) {
        *x = (const float *)((const char *)src->data + src->byte_offset);
        return EPIPE_OK;
    }
    float *s = scratch(c, n);
    if (!s && n)
        return epipe_codec_fail(c, EPIPE_ENOMEM, "%s: no memory to stage %llu values", c->ops->name,
                                (unsigned long long)n);
    epipe_tensor_read_f32(src, s, n);
    *x = s;
    return EPIPE_OK;
}

int epipe_codec_stage_out(epipe_codec *c, DLTensor *dst, uint64_t n, enum epipe_dtype dt, float **y)
{
    if (dense_f32(dst, dt)) {
        *y = (float *)((char *)dst->data + dst->byte_offset);
        return EPIPE_OK;
    }
    float *s = scratch(c, n);
    if (!s && n)
        return epipe_codec_fail(c, EPIPE_ENOMEM, "%s: no memory to stage %llu values", c->ops->name,
                                (unsigned long long)n);
    *y = s;
    return EPIPE_OK;
}

void epipe_codec_stage_out_done(DLTensor *dst, const float *y, uint64_t n)
{
    if (y != (const float *)((const char *)dst->data + dst->byte_offset))
        epipe_tensor_write_f32(dst, y, n);
}

int epipe_codec_f32_view(epipe_codec *c, const DLTensor *t, const char *what, uint64_t n,
                         enum epipe_dtype dt, float **out, float **owned, int fill)
{
    *owned = NULL;
    if (epipe_tensor_is_cuda(t)) { /* a host copy (lib/codec/cuda_staged.c) */
        int rc = epipe_codec_staged_f32_in(c, t, what, n, dt, owned, fill);
        *out = *owned;
        return rc;
    }
    if (dense_f32(t, dt)) {
        *out = (float *)((char *)t->data + t->byte_offset);
        return EPIPE_OK;
    }
    if (n > SIZE_MAX / sizeof(float) || !(*owned = malloc(n ? (size_t)n * sizeof(float) : 1)))
        return epipe_codec_fail(c, EPIPE_ENOMEM, "%s: no memory to stage %s", c->ops->name, what);
    if (fill)
        epipe_tensor_read_f32(t, *owned, (size_t)n);
    *out = *owned;
    return EPIPE_OK;
}

int epipe_codec_f32_view_done(epipe_codec *c, DLTensor *t, const char *what, uint64_t n,
                              enum epipe_dtype dt, const float *owned)
{
    if (!owned)
        return EPIPE_OK; /* the view was t's own memory */
    if (epipe_tensor_is_cuda(t))
        return epipe_codec_staged_f32_out(c, t, what, n, dt, owned);
    epipe_tensor_write_f32(t, owned, (size_t)n);
    return EPIPE_OK;
}

size_t epipe_find_nonfinite(const float *x, size_t n)
{
    /* A float is NaN or infinite exactly when its exponent bits are all
     * ones. Testing the bit patterns with integer operations vectorises
     * without reassociating float arithmetic; only a bad block is scanned
     * again for the index. */
    const size_t block = 4096;
    for (size_t b = 0; b < n; b += block) {
        size_t e = b + block < n ? b + block : n;
        uint32_t bad = 0;
        for (size_t i = b; i < e; i++) {
            uint32_t u;
            memcpy(&u, &x[i], sizeof u);
            bad |= (uint32_t)((u & 0x7f800000u) == 0x7f800000u);
        }
        if (bad)
            for (size_t i = b; i < e; i++)
                if (!isfinite(x[i]))
                    return i;
    }
    return n;
}
