/* `cast` on CUDA: fp32 to fp16/bf16 with cast's saturation and back, eight
 * values per thread with 16-byte loads and stores, through device scratch. */
#include "../codecs/inline/half.h"
#include "cuda_impl.h"

enum { CAST_BF16 = 1 }; /* the dtype choice index, as codecs/cast.c */

/* Groups of 8 values: two 16-byte loads, one 16-byte store. x and out must
 * be 16-byte aligned; the tail is the scalar kernel's. */
__global__ void cast_encode8(const float4 *x, uint64_t groups, int bf16, uint4 *out)
{
    for (uint64_t g = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; g < groups;
         g += (uint64_t)gridDim.x * blockDim.x) {
        float4 a = x[2 * g], b = x[2 * g + 1];
        float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        uint32_t w[4];
        for (int i = 0; i < 4; i++)
            w[i] = (uint32_t)epipe_hd_cast_encode(bf16, v[2 * i]) |
                   (uint32_t)epipe_hd_cast_encode(bf16, v[2 * i + 1]) << 16;
        out[g] = make_uint4(w[0], w[1], w[2], w[3]);
    }
}

__global__ void cast_encode1(const float *x, uint64_t b, uint64_t n, int bf16, uint16_t *out)
{
    for (uint64_t i = b + blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)gridDim.x * blockDim.x)
        out[i] = epipe_hd_cast_encode(bf16, x[i]);
}

__global__ void cast_decode8(const uint4 *in, uint64_t groups, int bf16, float4 *y)
{
    for (uint64_t g = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; g < groups;
         g += (uint64_t)gridDim.x * blockDim.x) {
        uint4 w = in[g];
        uint32_t u[4] = {w.x, w.y, w.z, w.w};
        float v[8];
        for (int i = 0; i < 4; i++) {
            v[2 * i] = epipe_hd_cast_decode(bf16, (uint16_t)u[i]);
            v[2 * i + 1] = epipe_hd_cast_decode(bf16, (uint16_t)(u[i] >> 16));
        }
        y[2 * g] = make_float4(v[0], v[1], v[2], v[3]);
        y[2 * g + 1] = make_float4(v[4], v[5], v[6], v[7]);
    }
}

__global__ void cast_decode1(const uint16_t *in, uint64_t b, uint64_t n, int bf16, float *y)
{
    for (uint64_t i = b + blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)gridDim.x * blockDim.x)
        y[i] = epipe_hd_cast_decode(bf16, in[i]);
}

static int cast_encode(epipe_codec *c, const float *x, size_t n, uint8_t *body)
{
    if (!n)
        return EPIPE_OK;
    int bf16 = (int)c->p[0] == CAST_BF16, rc;
    cudaStream_t s = epipe_cuda_stream(c);
    void *d;
    if ((rc = epipe_cuda_body_out(c, 0, n * 2, &d)))
        return rc;
    uint64_t groups = epipe_cuda_aligned16(x) && epipe_cuda_aligned16(d) ? n / 8 : 0;
    if (groups)
        cast_encode8<<<epipe_cuda_blocks(groups, 256), 256, 0, s>>>((const float4 *)x, groups, bf16,
                                                                    (uint4 *)d);
    if (groups * 8 < n)
        cast_encode1<<<epipe_cuda_blocks(n - groups * 8, 256), 256, 0, s>>>(x, groups * 8, n, bf16,
                                                                            (uint16_t *)d);
    if ((rc = epipe_cuda_check(c, cudaGetLastError(), "launching the cast kernel")))
        return rc;
    return epipe_cuda_body_flush(c, body, 0, d, n * 2);
}

static int cast_decode(epipe_codec *c, const uint8_t *body, size_t n, float *y)
{
    if (!n)
        return EPIPE_OK;
    int bf16 = (int)c->p[0] == CAST_BF16, rc;
    cudaStream_t s = epipe_cuda_stream(c);
    const void *d;
    if ((rc = epipe_cuda_body_in(c, body, 0, n * 2, &d)))
        return rc;
    uint64_t groups = epipe_cuda_aligned16(y) && epipe_cuda_aligned16(d) ? n / 8 : 0;
    if (groups)
        cast_decode8<<<epipe_cuda_blocks(groups, 256), 256, 0, s>>>((const uint4 *)d, groups, bf16,
                                                                    (float4 *)y);
    if (groups * 8 < n)
        cast_decode1<<<epipe_cuda_blocks(n - groups * 8, 256), 256, 0, s>>>((const uint16_t *)d,
                                                                            groups * 8, n, bf16, y);
    return epipe_cuda_check(c, cudaGetLastError(), "launching the cast kernel");
}

const epipe_codec_backend epipe_cuda_cast = {cast_encode, cast_decode, NULL, NULL, 0, NULL};
