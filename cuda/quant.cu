/* `quant` on CUDA: the tensor's extent by warp-shuffle and block reductions,
 * the table on one thread with the CPU's formulas, then one code+pack pass;
 * byte-identical to the CPU by construction (codecs/inline/quant.h). */
#include <stdio.h>

#include <cooperative_groups.h>

#include "cuda_impl.h"

namespace cg = cooperative_groups;

/* The quantizer's device table after the finalize kernel. */
struct q_dev {
    uint32_t lo, hi; /* extent keys */
    float min, step, inv;
};

__global__ void epipe_cuda_extent(const float *x, uint64_t n, int vec, uint32_t *ext,
                                  epipe_cuda_status *st)
{
    uint32_t lo = 0xffffffffu, hi = 0;
    uint64_t groups = (n + 7) / 8;
    for (uint64_t g = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; g < groups;
         g += (uint64_t)gridDim.x * blockDim.x) {
        float v[8];
        epipe_cuda_load8f(x, n, g, vec, v);
        epipe_cuda_extent_add(v, g * 8, n, lo, hi, st);
    }
    epipe_cuda_block_minmax(lo, hi);
    if (threadIdx.x == 0 && lo <= hi) {
        atomicMin(&ext[0], lo);
        atomicMax(&ext[1], hi);
    }
}

/* The table and its 8 body bytes. */
__global__ void q_finalize(q_dev *t, float levels, int zero, uint8_t *body)
{
    float min, step, inv;
    epipe_cuda_table_of(t->lo, t->hi, levels, zero, &min, &step, &inv);
    t->min = min;
    t->step = step;
    t->inv = inv;
    epipe_cuda_put_f32(body, min);
    epipe_cuda_put_f32(body + 4, step);
}

/* One range's codes: level, pack, w bytes out (fewer for the last). */
__device__ static void code_pack_range(const float *x, uint64_t n, int vec, float min, float inv,
                                       float levels, unsigned w, uint8_t *codes,
                                       uint64_t code_bytes)
{
    epipe_cuda_pack_pass(x, n, vec, w, codes, code_bytes,
                         [=](float v, uint64_t) { return epipe_hd_q_level(v, min, inv, levels); });
}

__global__ void q_code_pack(const float *x, uint64_t n, int vec, const q_dev *t, float levels,
                            unsigned w, uint8_t *codes, uint64_t code_bytes)
{
    code_pack_range(x, n, vec, t->min, t->inv, levels, w, codes, code_bytes);
}

/* The table (min, step) is read from the body, on the device: a decode
 * whose checks are deferred launches before the host has seen it. */
__global__ void q_decode(const uint8_t *body, uint64_t n, unsigned w, int vec, float *y)
{
    float min = epipe_cuda_get_f32(body), step = epipe_cuda_get_f32(body + 4);
    epipe_cuda_unpack_pass(body + 8, n, w, vec, y,
                           [=](uint32_t c) { return epipe_hd_q_value(min, step, c); });
}

/* Encode in one cooperative launch: each block folds the extent of its
 * own range of groups, the grid meets, every block reduces the partial
 * extents to the same table, and each block then packs its range back to
 * front, so that its first reads are the ones it made last, most likely
 * still in L2. */
__global__ void __launch_bounds__(256)
    q_encode_fused(const float *x, uint64_t n, int vec, float levels, int zero, unsigned w,
                   uint8_t *body, uint64_t cb, uint32_t *part, epipe_cuda_status *st)
{
    cg::grid_group grid = cg::this_grid();
    uint64_t groups = (n + 7) / 8;
    uint64_t g0 = groups * blockIdx.x / gridDim.x, g1 = groups * (blockIdx.x + 1) / gridDim.x;
    uint32_t lo = 0xffffffffu, hi = 0;
    for (uint64_t g = g0 + threadIdx.x; g < g1; g += blockDim.x) {
        float v[8];
        epipe_cuda_load8f(x, n, g, vec, v);
        epipe_cuda_extent_add(v, g * 8, n, lo, hi, st);
    }
    epipe_cuda_block_minmax(lo, hi);
    if (threadIdx.x == 0) {
        part[2 * blockIdx.x] = lo;
        part[2 * blockIdx.x + 1] = hi;
    }
    grid.sync();
    lo = 0xffffffffu;
    hi = 0;
    for (unsigned b = threadIdx.x; b < gridDim.x; b += blockDim.x) {
        lo = part[2 * b] < lo ? part[2 * b] : lo;
        hi = part[2 * b + 1] > hi ? part[2 * b + 1] : hi;
    }
    epipe_cuda_block_minmax(lo, hi);
    __shared__ float tab[2];
    if (threadIdx.x == 0) {
        float step, inv;
        epipe_cuda_table_of(lo, hi, levels, zero, &tab[0], &step, &inv);
        tab[1] = inv;
        if (blockIdx.x == 0) {
            epipe_cuda_put_f32(body, tab[0]);
            epipe_cuda_put_f32(body + 4, step);
        }
    }
    __syncthreads();
    float min = tab[0], inv = tab[1];
    epipe_cuda_pack_back(x, n, vec, w, body + 8, cb, g0, g1,
                         [=](float v) { return epipe_hd_q_level(v, min, inv, levels); });
}

__global__ void q_init(q_dev *t)
{
    t->lo = 0xffffffffu;
    t->hi = 0;
}

/* ---- rows=1: one range per row of dimension 0 ---------------------------------
 * The body is each row's quant body in turn (size bytes each: min, step,
 * the row's codes padded to a byte), as the CPU's encode_ranges writes it.
 * Three launches whatever the row count: blockIdx.y walks the rows, and
 * each row's blocks fold its extent into its own q_dev, as the one-range
 * kernels do for the tensor. A value's index in the status is its index
 * in the tensor, as the CPU names it. */

__global__ void q_rows_init(q_dev *t, uint64_t rows)
{
    for (uint64_t r = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; r < rows;
         r += (uint64_t)gridDim.x * blockDim.x) {
        t[r].lo = 0xffffffffu;
        t[r].hi = 0;
    }
}

__global__ void q_rows_extent(const float *x, uint64_t rows, uint64_t len, int vec, q_dev *t,
                              epipe_cuda_status *st)
{
    for (uint64_t r = blockIdx.y; r < rows; r += gridDim.y) {
        uint32_t lo = 0xffffffffu, hi = 0;
        epipe_cuda_each_group8(x + r * len, len, vec, [&](float *v, uint64_t g) {
            /* indices shifted by the row's start: the tensor's, for the status */
            epipe_cuda_extent_add(v, r * len + g * 8, r * len + len, lo, hi, st);
        });
        epipe_cuda_block_minmax(lo, hi);
        if (threadIdx.x == 0 && lo <= hi) {
            atomicMin(&t[r].lo, lo);
            atomicMax(&t[r].hi, hi);
        }
    }
}

__global__ void q_rows_finalize(q_dev *t, uint64_t rows, float levels, int zero, uint8_t *body,
                                uint64_t size)
{
    for (uint64_t r = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; r < rows;
         r += (uint64_t)gridDim.x * blockDim.x) {
        float min, step, inv;
        epipe_cuda_table_of(t[r].lo, t[r].hi, levels, zero, &min, &step, &inv);
        t[r].min = min;
        t[r].step = step;
        t[r].inv = inv;
        epipe_cuda_put_f32(body + r * size, min);
        epipe_cuda_put_f32(body + r * size + 4, step);
    }
}

__global__ void q_rows_pack(const float *x, uint64_t rows, uint64_t len, int vec, const q_dev *t,
                            float levels, unsigned w, uint8_t *body, uint64_t size, uint64_t cb)
{
    for (uint64_t r = blockIdx.y; r < rows; r += gridDim.y)
        code_pack_range(x + r * len, len, vec, t[r].min, t[r].inv, levels, w,
                        body + r * size + 8, cb);
}

/* Each row's table is read from the body on the device, after the host
 * has checked every one of them. */
__global__ void q_rows_decode(const uint8_t *body, uint64_t rows, uint64_t len, uint64_t size,
                              unsigned w, int vec, float *y)
{
    for (uint64_t r = blockIdx.y; r < rows; r += gridDim.y) {
        const uint8_t *b = body + r * size;
        float min = epipe_cuda_get_f32(b), step = epipe_cuda_get_f32(b + 4);
        epipe_cuda_unpack_pass(b + 8, len, w, vec, y + r * len,
                               [=](uint32_t c) { return epipe_hd_q_value(min, step, c); });
    }
}

/* The block of a rows launch: a thread per group of eight values of a
 * row, in whole warps, 32 to 256 (short rows, from group=K or a narrow
 * [B, D], would leave most of 256 threads idle). */
static unsigned rows_threads(uint64_t len)
{
    uint64_t groups = (len + 7) / 8, t = (groups + 31) / 32 * 32;
    return t < 32 ? 32 : t > 256 ? 256 : (unsigned)t;
}

/* The grid of a rows launch: up to 64 blocks along a row, the rows along
 * y (at most 65535 at once; the kernels loop for more). */
static dim3 rows_grid(uint64_t rows, uint64_t len)
{
    unsigned bx = epipe_cuda_blocks((len + 7) / 8, rows_threads(len));
    return dim3(bx < 64 ? bx : 64, (unsigned)(rows < 65535 ? rows : 65535));
}

/* From this many values on, encode takes the one cooperative launch (the
 * tests cover both paths: their tensors are on either side). */
#define QUANT_FUSED_MIN (1u << 16)

/* Blocks of q_encode_fused that a cooperative launch may have on `device`,
 * and its cache entry (epipe_cuda_coop_launch()). */
static int fused_blocks(int device, int **entry)
{
    static int cache[64];
    return epipe_cuda_coop_blocks((const void *)q_encode_fused, 256, device, cache, entry);
}

static uint64_t code_bytes(uint64_t n, unsigned w)
{
    return (n * w + 7) / 8;
}

/* rows=1 with rows > 1 (else the one-range path, as on the CPU). */
static int quant_encode_rows(epipe_codec *c, const float *x, uint64_t rows, uint64_t len,
                             uint8_t *body)
{
    unsigned w = (unsigned)c->p[QUANT_BITS];
    int zero = c->p[QUANT_ZERO] != 0;
    float levels = (float)((1u << w) - 1u);
    cudaStream_t s = epipe_cuda_stream(c);
    epipe_cuda_handle *h = epipe_cuda_h(c);
    uint64_t cb = code_bytes(len, w), size = 8 + cb;
    void *d, *tw;
    int rc;
    if ((rc = epipe_cuda_body_out(c, 0, rows * size, &d)) ||
        (rc = epipe_cuda_grow(c, &h->work[0], rows * sizeof(q_dev), &tw)))
        return rc;
    int vec = epipe_cuda_aligned16(x) && len % 4 == 0; /* every row's start aligned */
    dim3 grid = rows_grid(rows, len);
    unsigned rb = epipe_cuda_blocks(rows, 256), rt = rows_threads(len);
    q_rows_init<<<rb, 256, 0, s>>>((q_dev *)tw, rows);
    q_rows_extent<<<grid, rt, 0, s>>>(x, rows, len, vec, (q_dev *)tw, h->status);
    q_rows_finalize<<<rb, 256, 0, s>>>((q_dev *)tw, rows, levels, zero, (uint8_t *)d, size);
    q_rows_pack<<<grid, rt, 0, s>>>(x, rows, len, vec, (const q_dev *)tw, levels, w,
                                    (uint8_t *)d, size, cb);
    if ((rc = epipe_cuda_check(c, cudaGetLastError(), "launching the quant rows kernels")))
        return rc;
    return epipe_cuda_body_flush(c, body, 0, d, rows * size);
}

static int quant_encode(epipe_codec *c, const float *x, size_t n, uint8_t *body)
{
    uint64_t rows, len;
    epipe_codec_ranges(c, n, c->p[QUANT_ROWS] != 0, (uint64_t)c->p[QUANT_GROUP], &rows, &len);
    if (rows > 1)
        return quant_encode_rows(c, x, rows, len, body);
    unsigned w = (unsigned)c->p[QUANT_BITS];
    int zero = c->p[QUANT_ZERO] != 0;
    float levels = (float)((1u << w) - 1u);
    cudaStream_t s = epipe_cuda_stream(c);
    epipe_cuda_handle *h = epipe_cuda_h(c);
    uint64_t cb = code_bytes(n, w);
    void *d, *tw;
    int rc;
    if ((rc = epipe_cuda_body_out(c, 0, 8 + cb, &d)) ||
        (rc = epipe_cuda_grow(c, &h->work[0], sizeof(q_dev), &tw)))
        return rc;
    int *coop;
    int vec = epipe_cuda_aligned16(x), blocks = fused_blocks(h->device, &coop);
    if (n >= QUANT_FUSED_MIN && blocks > 0) {
        void *part;
        if ((rc = epipe_cuda_grow(c, &h->work[1], 2 * sizeof(uint32_t) * (size_t)blocks, &part)))
            return rc;
        uint8_t *b = (uint8_t *)d;
        epipe_cuda_status *st = h->status;
        void *args[] = {(void *)&x, (void *)&n,  (void *)&vec,  (void *)&levels,
                        (void *)&zero, (void *)&w, (void *)&b, (void *)&cb,
                        (void *)&part, (void *)&st};
        rc = epipe_cuda_coop_launch(c, (const void *)q_encode_fused, (unsigned)blocks, 256, args,
                                    s, coop, "launching the quant kernel");
        if (rc)
            return rc < 0 ? rc : epipe_cuda_body_flush(c, body, 0, d, 8 + cb);
    } /* else, or refused: the same work in four launches */
    q_init<<<1, 1, 0, s>>>((q_dev *)tw);
    if (n)
        epipe_cuda_extent<<<epipe_cuda_extent_blocks(n), 256, 0, s>>>(x, n, vec, (uint32_t *)tw,
                                                                      h->status);
    q_finalize<<<1, 1, 0, s>>>((q_dev *)tw, levels, zero, (uint8_t *)d);
    if (n)
        q_code_pack<<<epipe_cuda_blocks((n + 7) / 8, 256), 256, 0, s>>>(
            x, n, vec, (const q_dev *)tw, levels, w, (uint8_t *)d + 8, cb);
    if ((rc = epipe_cuda_check(c, cudaGetLastError(), "launching the quant kernels")))
        return rc;
    return epipe_cuda_body_flush(c, body, 0, d, 8 + cb);
}

/* One range's table and the padding bits of its len codes (host memory),
 * with the CPU decoder's statuses and messages (quantize_common.c). */
static int check_range(epipe_codec *c, const uint8_t *body, uint64_t len)
{
    unsigned w = (unsigned)c->p[QUANT_BITS];
    float levels = (float)((1u << w) - 1u);
    const char *name = c->ops->name;
    float min = epipe_cuda_get_f32(body), step = epipe_cuda_get_f32(body + 4);
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
    uint64_t cb = code_bytes(len, w);
    unsigned used = (unsigned)(len * w % 8);
    if (used && (body[8 + cb - 1] >> used))
        return epipe_cuda_fail(c, EPIPE_EPROTO, "%s: padding bits after the last code are not zero",
                               name);
    return EPIPE_OK;
}

/* The tables and the padding bits (host memory), row after row as the
 * CPU does. */
int epipe_cuda_quant_check(epipe_codec *c, const uint8_t *body, size_t n)
{
    uint64_t rows, len;
    epipe_codec_ranges(c, n, c->p[QUANT_ROWS] != 0, (uint64_t)c->p[QUANT_GROUP], &rows, &len);
    uint64_t size = 8 + code_bytes(len, (unsigned)c->p[QUANT_BITS]);
    int rc;
    for (uint64_t r = 0; r < rows; r++)
        if ((rc = check_range(c, body + r * size, len)))
            return rc;
    return EPIPE_OK;
}

/* Checked at once, before any kernel runs, unless the module defers the
 * checks (a device payload): the kernels read the tables on the device. */
static int quant_decode(epipe_codec *c, const uint8_t *body, size_t n, float *y)
{
    unsigned w = (unsigned)c->p[QUANT_BITS];
    uint64_t rows, len;
    epipe_codec_ranges(c, n, c->p[QUANT_ROWS] != 0, (uint64_t)c->p[QUANT_GROUP], &rows, &len);
    uint64_t cb = code_bytes(len, w), size = 8 + cb;
    int rc;
    if (!epipe_cuda_h(c)->defer_checks && (rc = epipe_cuda_quant_check(c, body, n)))
        return rc;
    if (!n)
        return EPIPE_OK;
    cudaStream_t s = epipe_cuda_stream(c);
    const void *d;
    if (rows > 1) {
        if ((rc = epipe_cuda_body_in(c, body, 0, rows * size, &d)))
            return rc;
        q_rows_decode<<<rows_grid(rows, len), rows_threads(len), 0, s>>>(
            (const uint8_t *)d, rows, len, size, w, epipe_cuda_aligned16(y) && len % 4 == 0, y);
        return epipe_cuda_check(c, cudaGetLastError(), "launching the quant rows decode kernel");
    }
    if ((rc = epipe_cuda_body_in(c, body, 0, 8 + cb, &d)))
        return rc;
    q_decode<<<epipe_cuda_blocks((n + 7) / 8, 256), 256, 0, s>>>((const uint8_t *)d, n, w,
                                                                 epipe_cuda_aligned16(y), y);
    return epipe_cuda_check(c, cudaGetLastError(), "launching the quant decode kernel");
}

const epipe_codec_backend epipe_cuda_quant = {quant_encode, quant_decode, NULL, NULL, 0, NULL};
