/* `quant` on CUDA: the tensor's extent by warp-shuffle and block reductions,
 * the table on one thread with the CPU's formulas, then one code+pack pass;
 * byte-identical to the CPU by construction (codecs/inline/quant.h). */
#include <stdio.h>

#include "cuda_impl.h"

/* Order-preserving keys of finite floats, for atomicMin/atomicMax. */
__device__ static uint32_t key_of(float f)
{
    uint32_t u = __float_as_uint(f);
    return u & 0x80000000u ? ~u : u | 0x80000000u;
}
__device__ static float float_of(uint32_t k)
{
    return __uint_as_float(k & 0x80000000u ? k & 0x7fffffffu : ~k);
}

/* The quantizer's device table after the finalize kernel. */
struct q_dev {
    uint32_t lo, hi; /* extent keys */
    float min, step, inv;
};

__device__ static void note_nonfinite(epipe_cuda_status *st, float v, unsigned long long i)
{
    unsigned long long *slot = v != v ? &st->nan : v > 0 ? &st->pinf : &st->ninf;
    atomicMin(slot, i);
}

/* Extent of the finite values; non-finite ones go to the status word. */
__global__ void q_extent(const float *x, uint64_t n, q_dev *t, epipe_cuda_status *st)
{
    uint32_t lo = 0xffffffffu, hi = 0;
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)gridDim.x * blockDim.x) {
        float v = x[i];
        if (!epipe_hd_finite(v)) {
            note_nonfinite(st, v, i);
            continue;
        }
        uint32_t k = key_of(v);
        lo = k < lo ? k : lo;
        hi = k > hi ? k : hi;
    }
    for (int o = 16; o; o >>= 1) {
        uint32_t a = __shfl_down_sync(0xffffffffu, lo, o), b = __shfl_down_sync(0xffffffffu, hi, o);
        lo = a < lo ? a : lo;
        hi = b > hi ? b : hi;
    }
    __shared__ uint32_t slo[32], shi[32];
    unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (!lane) {
        slo[warp] = lo;
        shi[warp] = hi;
    }
    __syncthreads();
    if (warp == 0) {
        unsigned nw = blockDim.x >> 5;
        lo = lane < nw ? slo[lane] : 0xffffffffu;
        hi = lane < nw ? shi[lane] : 0;
        for (int o = 16; o; o >>= 1) {
            uint32_t a = __shfl_down_sync(0xffffffffu, lo, o),
                     b = __shfl_down_sync(0xffffffffu, hi, o);
            lo = a < lo ? a : lo;
            hi = b > hi ? b : hi;
        }
        if (!lane) {
            atomicMin(&t->lo, lo);
            atomicMax(&t->hi, hi);
        }
    }
}

__device__ static void put_f32(uint8_t *p, float f)
{
    uint32_t u = __float_as_uint(f);
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(u >> (8 * i));
}

/* The table as epipe_q_set_chunk() makes it, and its 8 body bytes. With no
 * finite value (all were reported) the table is empty. */
__global__ void q_finalize(q_dev *t, float levels, uint8_t *body)
{
    float min = 0.0f, step = 0.0f, inv = 0.0f;
    if (t->lo <= t->hi) {
        min = float_of(t->lo) + 0.0f; /* -0 becomes +0 */
        float max = float_of(t->hi) + 0.0f;
        step = epipe_hd_q_step(min, max, levels);
        inv = step > 0.0f ? 1.0f / step : 0.0f;
    }
    t->min = min;
    t->step = step;
    t->inv = inv;
    put_f32(body, min);
    put_f32(body + 4, step);
}

/* One thread per 8 codes: level, pack, w bytes out (fewer for the last). */
__global__ void q_code_pack(const float *x, uint64_t n, int vec, const q_dev *t, float levels,
                            unsigned w, uint8_t *codes, uint64_t code_bytes)
{
    float min = t->min, inv = t->inv;
    uint64_t groups = (n + 7) / 8;
    for (uint64_t g = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; g < groups;
         g += (uint64_t)gridDim.x * blockDim.x) {
        float v[8];
        uint32_t c[8];
        epipe_cuda_load8f(x, n, g, vec, v);
        for (unsigned i = 0; i < 8; i++)
            c[i] = g * 8 + i < n ? epipe_hd_q_level(v[i], min, inv, levels) : 0u;
        epipe_cuda_store_codes(c, w, g, codes, code_bytes);
    }
}

__global__ void q_decode(const uint8_t *codes, uint64_t n, float min, float step, unsigned w,
                         int vec, float *y)
{
    uint64_t groups = (n + 7) / 8, bytes = (n * w + 7) / 8;
    for (uint64_t g = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; g < groups;
         g += (uint64_t)gridDim.x * blockDim.x) {
        uint32_t c[8];
        float v[8];
        epipe_cuda_load_codes(codes, bytes, w, g, c);
        for (unsigned i = 0; i < 8; i++)
            v[i] = epipe_hd_q_value(min, step, c[i]);
        epipe_cuda_store8f(y, n, g, vec, v);
    }
}

__global__ void q_init(q_dev *t)
{
    t->lo = 0xffffffffu;
    t->hi = 0;
}

static uint64_t code_bytes(uint64_t n, unsigned w)
{
    return (n * w + 7) / 8;
}

static int quant_encode(epipe_codec *c, const float *x, size_t n, uint8_t *body)
{
    unsigned w = (unsigned)c->p[0];
    float levels = (float)((1u << w) - 1u);
    cudaStream_t s = epipe_cuda_stream(c);
    epipe_cuda_handle *h = epipe_cuda_h(c);
    uint64_t cb = code_bytes(n, w);
    void *d, *tw;
    int rc;
    if ((rc = epipe_cuda_body_out(c, 0, 8 + cb, &d)) ||
        (rc = epipe_cuda_grow(c, &h->work[0], sizeof(q_dev), &tw)))
        return rc;
    q_init<<<1, 1, 0, s>>>((q_dev *)tw);
    if (n)
        q_extent<<<epipe_cuda_blocks(n, 256 * 8), 256, 0, s>>>(x, n, (q_dev *)tw, h->status);
    q_finalize<<<1, 1, 0, s>>>((q_dev *)tw, levels, (uint8_t *)d);
    if (n)
        q_code_pack<<<epipe_cuda_blocks((n + 7) / 8, 256), 256, 0, s>>>(
            x, n, epipe_cuda_aligned16(x), (const q_dev *)tw, levels, w, (uint8_t *)d + 8, cb);
    if ((rc = epipe_cuda_check(c, cudaGetLastError(), "launching the quant kernels")))
        return rc;
    return epipe_cuda_body_flush(c, body, 0, d, 8 + cb);
}

static float get_f32(const uint8_t *p)
{
    uint32_t u = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
    return epipe_hd_u2f(u);
}

/* The table and the padding bits are host memory: checked here, at once,
 * with the CPU decoder's statuses and messages (quantize_common.c). */
static int quant_decode(epipe_codec *c, const uint8_t *body, size_t n, float *y)
{
    unsigned w = (unsigned)c->p[0];
    float levels = (float)((1u << w) - 1u);
    const char *name = c->ops->name;
    float min = get_f32(body), step = get_f32(body + 4);
    switch (epipe_hd_q_pair_check(min, step, levels)) {
    case 1:
        return epipe_cuda_fail(c, EPIPE_EPROTO, "%s: chunk %u of %u has min %g; it must be finite",
                               name, 0u, 1u, (double)min);
    case 2:
        return epipe_cuda_fail(c, EPIPE_EPROTO,
                               "%s: chunk %u of %u has step %g; it must be finite and >= 0", name,
                               0u, 1u, (double)step);
    case 3:
        return epipe_cuda_fail(c, EPIPE_EPROTO,
                               "%s: chunk %u of %u (min %g, step %g) decodes past the float range",
                               name, 0u, 1u, (double)min, (double)step);
    }
    uint64_t cb = code_bytes(n, w);
    unsigned used = (unsigned)(n * w % 8);
    if (used && (body[8 + cb - 1] >> used))
        return epipe_cuda_fail(c, EPIPE_EPROTO, "%s: padding bits after the last code are not zero",
                               name);
    if (!n)
        return EPIPE_OK;
    cudaStream_t s = epipe_cuda_stream(c);
    const void *d;
    int rc;
    if ((rc = epipe_cuda_body_in(c, body, 8, cb, &d)))
        return rc;
    q_decode<<<epipe_cuda_blocks((n + 7) / 8, 256), 256, 0, s>>>((const uint8_t *)d, n, min, step,
                                                                 w, epipe_cuda_aligned16(y), y);
    return epipe_cuda_check(c, cudaGetLastError(), "launching the quant decode kernel");
}

const epipe_codec_backend epipe_cuda_quant = {quant_encode, quant_decode, NULL, NULL, 0, NULL};
