/* `poweriter` on CUDA tensors. Every step runs on the device, and only
 * the payload leaves it: the warm starts are kept in device memory (one
 * buffer per slot, EPIPE_CUDA_PI_SLOTS), the records are written by a
 * kernel, and the CPU codec's host code only plans, keeps the slots'
 * bookkeeping and words the refusals (the core's pi_* functions).
 *
 * The products that read the tensor, matrix by matrix:
 *  - rank <= PI_FUSED_MAX_RANK, Q small enough for shared memory and
 *    enough blocks (pi_fused(); the common case: activations [B,C,H,W]
 *    at rank 1 to 8): Q = M P as
 *    per-tile partial sums (pi_product_q, which also checks every value is
 *    finite), their sum and CholeskyQR2 in one block per matrix
 *    (pi_qr_small), and P = Mᵀ Q (pi_product_p). Three launches an
 *    iteration and the tensor read twice; cuBLAS ran Q = M P for 32
 *    matrices of 32 x 12,544 in 128 blocks at a tenth of the bandwidth.
 *  - otherwise cuBLAS strided-batched GEMMs, each Q orthonormalised on the
 *    device by CholeskyQR2 (G = QᵀQ by a GEMM) up to rank 64, on the host
 *    by the CPU's Householder QR above.
 * CholeskyQR2 (codecs/inline/poweriter.h) gives the Q of the CPU's
 * Householder QR up to rounding; a Q too ill-conditioned for it sends the
 * encode back to its start, on the host's QR, which takes any Q.
 *
 * One wait an encode: after the products and the factors' statistics
 * (pi_factor_stats), the status word says whether an input value or a
 * factor is not finite, a scale overflows, or a Cholesky refused; each is
 * answered as the CPU answers it, before a byte of the payload or of the
 * warm start is written (pi_write_records). The GEMMs and the sums round
 * differently from OpenBLAS, so payloads are the CPU's within a tolerance
 * (docs/codecs.md), not byte for byte.
 *
 * Decoding checks every scale and factor on the device, as the CPU
 * decoder does, and reports the first bad one at the next synchronize (a
 * deferred error, as for topk's entries); the header is checked on the
 * host at once. Up to rank 8 one kernel checks and rebuilds (pi_rebuild);
 * above, pi_unpack checks and a cuBLAS GEMM rebuilds Y = (sP) Qᵀ.
 * Without cuBLAS (not found at run time, cuda/cublas.cu) poweriter's CUDA
 * tensors go through host staging instead (cuda_backend() in module.cu). */
#include <float.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../codecs/inline/half.h"
#include "../codecs/inline/poweriter.h"
#include "cuda_impl.h"

/* Eight values a thread, in 16-byte loads where x is aligned (one value
 * a thread took 38 us for a [32,32,112,112] tensor on an H200, under ncu:
 * about 1.3 TB/s). */
__global__ void pi_check_finite(const float *x, uint64_t n, int vec, epipe_cuda_status *st)
{
    epipe_cuda_each_group8(x, n, vec, [&](float *v, uint64_t g) {
        for (unsigned i = 0; i < 8 && g * 8 + i < n; i++)
            if (!epipe_hd_finite(v[i]))
                epipe_cuda_note_nonfinite(st, v[i], g * 8 + i);
    });
}

/* A value that is not finite, refused at once with the CPU's message. */
static int refuse_nonfinite(epipe_codec *c)
{
    static const char *const names[] = {"NaN", "+inf", "-inf"};
    unsigned long long first;
    int kind, rc = epipe_cuda_take_nonfinite(c, epipe_cuda_h(c)->status_host, &first, &kind);
    if (rc <= 0)
        return rc;
    return epipe_cuda_fail(c, EPIPE_EINVAL,
                           "poweriter: input value at index %llu is %s; poweriter needs finite "
                           "values",
                           first, names[kind]);
}

static int copy(epipe_codec *c, void *dst, const void *src, size_t bytes, cudaMemcpyKind kind,
                const char *what)
{
    return epipe_cuda_check(c, cudaMemcpyAsync(dst, src, bytes, kind, epipe_cuda_stream(c)), what);
}

static int wait(epipe_codec *c, const char *what)
{
    return epipe_cuda_check(c, cudaStreamSynchronize(epipe_cuda_stream(c)), what);
}

/* Whether the records hold fp16 factors (factors=fp16), else fp32. */
static int pi_fp16(const epipe_codec *c)
{
    return (int)c->p[EPIPE_CUDA_PI_FACTORS] == EPIPE_CUDA_PI_F16;
}

/* Up to this rank each Q is orthonormalised on the device (CholeskyQR2,
 * one thread a matrix for the r x r Cholesky); above it, on the host. */
#define PI_DEVICE_QR_MAX_RANK 64

/* Whether a Cholesky of this encode refused a Q (the status word's
 * `refused`): the kernels after it then do nothing, for the host to start
 * over on its own QR. */
__device__ static inline bool pi_refused(const epipe_cuda_status *st)
{
    return *(volatile const unsigned long long *)&st->refused != ~0ull;
}

/* R of each matrix's G = QᵀQ; a refusal (Q ill-conditioned) is noted. */
__global__ void pi_chol_kernel(const float *G, uint64_t nb, unsigned r, float *R,
                               epipe_cuda_status *st)
{
    for (uint64_t b = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; b < nb;
         b += (uint64_t)gridDim.x * blockDim.x)
        if (epipe_hd_pi_chol(G + b * r * r, r, R + b * r * r))
            atomicMin(&st->refused, (unsigned long long)b);
}

/* Each row of each Q times its R⁻¹, unless a Cholesky refused. */
__global__ void pi_solve_kernel(float *Q, uint64_t nb, uint64_t rows, unsigned r, const float *R,
                                const epipe_cuda_status *st)
{
    if (pi_refused(st))
        return;
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < nb * rows;
         i += (uint64_t)gridDim.x * blockDim.x) {
        uint64_t b = i / rows;
        epipe_hd_pi_solve_row(Q + b * rows * r + i % rows, rows, r, R + b * r * r);
    }
}

/* ---- the fused products, for ranks up to PI_FUSED_MAX_RANK -------------- */

#define PI_FUSED_MAX_RANK 8
/* X(R) for each rank 1 .. PI_FUSED_MAX_RANK: the ranks the templated
 * kernels (P or Q in registers, R values a row) are built for. */
#define PI_EACH_RANK(X) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8)
/* Q (rows x r floats) in shared memory for pi_qr_small and pi_product_p. */
#define PI_FUSED_MAX_Q 4096
/* A block of 256 threads takes 256 columns of a matrix: pi_product_q 8 a
 * lane for 64 rows (8 a warp), pi_product_p one a thread for every row. */
#define PI_THREADS 256
#define PI_TILE 256
#define PI_ROW_GROUP 64

/* The fused encode needs Q in shared memory, and enough (matrix, tile)
 * blocks for pi_product_p, whose threads each loop over every row: few
 * matrices of few columns and many rows go to cuBLAS instead. */
#define PI_FUSED_MIN_BLOCKS 128

static bool pi_fused(uint64_t nb, uint64_t rows, uint64_t cols, unsigned r)
{
    const uint64_t tiles = (cols + PI_TILE - 1) / PI_TILE;
    return r <= PI_FUSED_MAX_RANK && rows * r <= PI_FUSED_MAX_Q &&
           (nb * tiles >= PI_FUSED_MIN_BLOCKS || rows <= PI_ROW_GROUP);
}

/* Partial sums of Q = M P: part[b][tile][i][k] = the sum over the tile's
 * columns j of M[i][j] P[j][k]. P is `start` (column-major cols x r a
 * matrix: a warm start or the last iteration's P), or the cold start
 * computed in place when start is NULL. check: note every value of the
 * tensor that is not finite in the status word, as pi_check_finite does.
 * A warp takes a row at a time, each lane 8 columns 32 apart (every load
 * a warp makes is 128 contiguous bytes), and reduces its r sums by
 * shuffles: each partial is written by one lane, in a fixed order, so
 * that the result does not depend on scheduling. */
template <unsigned R>
__global__ void __launch_bounds__(PI_THREADS)
    pi_product_q(const float *x, uint64_t nb, uint64_t rows, uint64_t cols, const float *start,
                 uint64_t tiles, uint64_t groups, int check, float *part, epipe_cuda_status *st)
{
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const uint64_t items = nb * groups * tiles;
    for (uint64_t it = blockIdx.x; it < items; it += gridDim.x) {
        const uint64_t tile = it % tiles, g = it / tiles % groups, b = it / tiles / groups;
        float p[8][R];
#pragma unroll
        for (unsigned u = 0; u < 8; u++) {
            const uint64_t j = tile * PI_TILE + u * 32 + lane;
#pragma unroll
            for (unsigned k = 0; k < R; k++)
                p[u][k] = j >= cols ? 0.0f
                          : start   ? start[(b * R + k) * cols + j]
                                    : epipe_hd_pi_start_value(j, k);
        }
        const float *m = x + b * rows * cols;
        for (unsigned t = 0; t < PI_ROW_GROUP / 8; t++) {
            const uint64_t i = g * PI_ROW_GROUP + t * 8 + warp; /* the same for the warp */
            if (i >= rows)
                break;
            float acc[R];
#pragma unroll
            for (unsigned k = 0; k < R; k++)
                acc[k] = 0.0f;
#pragma unroll
            for (unsigned u = 0; u < 8; u++) {
                const uint64_t j = tile * PI_TILE + u * 32 + lane;
                if (j >= cols)
                    break;
                const float v = m[i * cols + j];
                if (check && !epipe_hd_finite(v))
                    epipe_cuda_note_nonfinite(st, v, b * rows * cols + i * cols + j);
#pragma unroll
                for (unsigned k = 0; k < R; k++)
                    acc[k] += v * p[u][k];
            }
#pragma unroll
            for (unsigned k = 0; k < R; k++) {
                for (int o = 16; o; o >>= 1)
                    acc[k] += __shfl_xor_sync(0xffffffffu, acc[k], o);
                if (lane == 0)
                    part[((b * tiles + tile) * rows + i) * R + k] = acc[k];
            }
        }
    }
}

/* pi_product_q for rank r (1 .. PI_FUSED_MAX_RANK): P in registers, 8 x r
 * a thread, so that low ranks keep more blocks resident. */
static void launch_product_q(unsigned r, unsigned blocks, cudaStream_t s, const float *x,
                             uint64_t nb, uint64_t rows, uint64_t cols, const float *start,
                             uint64_t tiles, uint64_t groups, int check, float *part,
                             epipe_cuda_status *st)
{
    /* clang-format would put a line break between the kernel's name and its
     * launch configuration, which the emulator's translation
     * (tests/cudaemu/translate.py) needs together */
    // clang-format off
#define PI_Q_CASE(R)                                                                               \
    case R:                                                                                        \
        pi_product_q<R><<<blocks, PI_THREADS, 0, s>>>(x, nb, rows, cols, start, tiles, groups,     \
                                                      check, part, st);                            \
        break;
    // clang-format on
    switch (r) {
        PI_EACH_RANK(PI_Q_CASE)
    }
#undef PI_Q_CASE
}

/* The sum of v over the block, in thread 0, in a fixed order; every thread
 * of the block calls it. */
template <class T> __device__ static inline T pi_block_sum(T v)
{
    __shared__ T w[PI_THREADS / 32];
    for (int o = 16; o; o >>= 1)
        v += __shfl_down_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0)
        w[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x == 0)
        for (unsigned i = 1; i < blockDim.x / 32; i++)
            v += w[i];
    __syncthreads(); /* w free for the next call */
    return v;
}

/* One block a matrix: Q as the sum of pi_product_q's partials, tile after
 * tile, then orthonormalised by CholeskyQR2 (G = QᵀQ summed in a fixed
 * order, its Cholesky and Q R⁻¹ by the shared functions), into q
 * (column-major rows x r a matrix). A Cholesky that refuses is noted in
 * the status word. */
__global__ void __launch_bounds__(PI_THREADS)
    pi_qr_small(const float *part, uint64_t nb, uint64_t rows, unsigned r, uint64_t tiles, float *q,
                epipe_cuda_status *st)
{
    extern __shared__ float qs[]; /* rows x r, column-major */
    __shared__ float g[PI_FUSED_MAX_RANK * PI_FUSED_MAX_RANK],
        R[PI_FUSED_MAX_RANK * PI_FUSED_MAX_RANK];
    __shared__ int refused;
    for (uint64_t b = blockIdx.x; b < nb; b += gridDim.x) {
        for (uint64_t e = threadIdx.x; e < rows * r; e += blockDim.x) {
            const uint64_t i = e / r;
            const unsigned k = (unsigned)(e % r);
            float sum = 0.0f;
            for (uint64_t t = 0; t < tiles; t++)
                sum += part[((b * tiles + t) * rows + i) * r + k];
            qs[k * rows + i] = sum;
        }
        if (threadIdx.x == 0)
            refused = 0;
        __syncthreads();
        for (int pass = 0; pass < 2 && !refused; pass++) {
            for (unsigned c2 = 0; c2 < r; c2++)
                for (unsigned a = 0; a <= c2; a++) {
                    float acc = 0.0f;
                    for (uint64_t i = threadIdx.x; i < rows; i += blockDim.x)
                        acc += qs[a * rows + i] * qs[c2 * rows + i];
                    acc = pi_block_sum(acc);
                    if (threadIdx.x == 0)
                        g[a + c2 * r] = acc;
                }
            if (threadIdx.x == 0 && epipe_hd_pi_chol(g, r, R)) {
                refused = 1;
                atomicMin(&st->refused, (unsigned long long)b);
            }
            __syncthreads();
            if (refused)
                break;
            for (uint64_t i = threadIdx.x; i < rows; i += blockDim.x)
                epipe_hd_pi_solve_row(qs + i, rows, r, R);
            __syncthreads();
        }
        for (uint64_t e = threadIdx.x; e < rows * r; e += blockDim.x)
            q[b * rows * r + e] = qs[e];
        __syncthreads(); /* qs free for the next matrix */
    }
}

/* P = Mᵀ Q, one column of a matrix a thread: p[b] (column-major cols x r)
 * from q[b] (column-major rows x r, in shared memory). The matrices are
 * taken last first: pi_product_q read them first to last, so the first
 * read here are the likeliest to be in L2 still. */
__global__ void __launch_bounds__(PI_THREADS)
    pi_product_p(const float *x, uint64_t nb, uint64_t rows, uint64_t cols, unsigned r,
                 const float *q, uint64_t tiles, float *p, const epipe_cuda_status *st)
{
    extern __shared__ float qs[];
    if (pi_refused(st))
        return;
    const uint64_t items = nb * tiles;
    for (uint64_t w = blockIdx.x; w < items; w += gridDim.x) {
        const uint64_t it = items - 1 - w, b = it / tiles, tile = it % tiles;
        for (uint64_t e = threadIdx.x; e < rows * r; e += blockDim.x)
            qs[e] = q[b * rows * r + e];
        __syncthreads();
        const uint64_t j = tile * PI_TILE + threadIdx.x;
        if (j < cols) {
            float acc[PI_FUSED_MAX_RANK];
#pragma unroll
            for (unsigned k = 0; k < PI_FUSED_MAX_RANK; k++)
                acc[k] = 0.0f;
            const float *m = x + b * rows * cols + j;
#pragma unroll 4
            for (uint64_t i = 0; i < rows; i++) {
                const float v = m[i * cols];
#pragma unroll
                for (unsigned k = 0; k < PI_FUSED_MAX_RANK; k++)
                    if (k < r)
                        acc[k] += v * qs[k * rows + i];
            }
#pragma unroll
            for (unsigned k = 0; k < PI_FUSED_MAX_RANK; k++)
                if (k < r)
                    p[(b * r + k) * cols + j] = acc[k];
        }
        __syncthreads(); /* qs free for the next item */
    }
}

/* ---- the factors' statistics, the records and the warm starts ----------- */

/* One block a matrix, from its Q (rows x r) and P (cols x r), column-major:
 * scale[b] = max|P| (0 below FLT_MIN, as the CPU sends a vanishing P), and
 * inv[b][k] = 1 / |column k of P| in double (0: the column restarts cold),
 * as the CPU's pi_keep_warm() computes them; a factor that is not finite,
 * or a scale above epipe_hd_pi_max_scale(), noted as factor = b << 1 |
 * kind (0, 1) in the status word, the smallest first. */
__global__ void __launch_bounds__(PI_THREADS)
    pi_factor_stats(const float *q, const float *p, uint64_t nb, uint64_t rows, uint64_t cols,
                    unsigned r, float *scale, double *inv, epipe_cuda_status *st)
{
    if (pi_refused(st))
        return;
    for (uint64_t b = blockIdx.x; b < nb; b += gridDim.x) {
        float mx = 0.0f;
        int bad = 0;
        for (unsigned k = 0; k < r; k++) {
            const float *col = p + (b * r + k) * cols;
            double ss = 0;
            for (uint64_t j = threadIdx.x; j < cols; j += blockDim.x) {
                const float a = fabsf(col[j]);
                bad |= !(a <= FLT_MAX);
                mx = a > mx ? a : mx;
                ss += (double)col[j] * col[j];
            }
            ss = pi_block_sum(ss);
            if (threadIdx.x == 0)
                inv[b * r + k] = ss > (double)FLT_MIN * FLT_MIN && ss <= DBL_MAX ? 1.0 / sqrt(ss)
                                                                                 : 0.0;
        }
        for (uint64_t e = threadIdx.x; e < rows * r; e += blockDim.x)
            bad |= !(fabsf(q[b * rows * r + e]) <= FLT_MAX);
        /* the largest |P| and any bad factor, as sums of keys and flags */
        __shared__ float wmax[PI_THREADS / 32];
        for (int o = 16; o; o >>= 1)
            mx = fmaxf(mx, __shfl_down_sync(0xffffffffu, mx, o));
        if ((threadIdx.x & 31) == 0)
            wmax[threadIdx.x >> 5] = mx;
        bad = pi_block_sum(bad); /* its __syncthreads publish wmax */
        if (threadIdx.x == 0) {
            for (unsigned i = 1; i < blockDim.x / 32; i++)
                mx = fmaxf(mx, wmax[i]);
            if (bad)
                atomicMin(&st->factor, (unsigned long long)b << 1);
            else if (!(mx <= epipe_hd_pi_max_scale(r)))
                atomicMin(&st->factor, (unsigned long long)b << 1 | 1);
            scale[b] = mx < FLT_MIN ? 0.0f : mx;
        }
        __syncthreads(); /* wmax free for the next matrix */
    }
}

/* A factor value into a record: little-endian fp32 or fp16, in one store
 * where the address allows. */
__device__ static inline void pi_put(uint8_t *at, float v, int fp16)
{
    if (fp16) {
        const uint16_t h = epipe_hd_f32_to_f16(v);
        if (((uintptr_t)at & 1) == 0) {
            *(uint16_t *)at = h;
        } else {
            at[0] = (uint8_t)h;
            at[1] = (uint8_t)(h >> 8);
        }
    } else if (((uintptr_t)at & 3) == 0) {
        *(float *)at = v;
    } else {
        epipe_cuda_put_f32(at, v);
    }
}

__device__ static inline float pi_get(const uint8_t *at, int fp16)
{
    if (fp16)
        return epipe_hd_f16_to_f32(((uintptr_t)at & 1) == 0 ? *(const uint16_t *)at
                                                            : (uint16_t)(at[0] | at[1] << 8));
    return ((uintptr_t)at & 3) == 0 ? *(const float *)at : epipe_cuda_get_f32(at);
}

/* Every record (rec bytes a matrix from recs: its scale, Q row-major, then
 * P / scale row-major, each clamped to [-1, 1], as epipe_pi_write_record()
 * writes them), a value a thread; and, where slot is given, the next warm
 * start: each column of P times its inv, or the cold start. */
__global__ void pi_write_records(const float *q, const float *p, const float *scale,
                                 const double *inv, uint64_t nb, uint64_t rows, uint64_t cols,
                                 unsigned r, int fp16, uint8_t *recs, uint64_t rec, float *slot)
{
    const uint64_t per = 1 + (rows + cols) * r, es = fp16 ? 2 : 4;
    for (uint64_t e = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; e < nb * per;
         e += (uint64_t)gridDim.x * blockDim.x) {
        const uint64_t b = e / per;
        uint64_t o = e % per;
        uint8_t *out = recs + b * rec;
        const float s = scale[b];
        if (o == 0) {
            pi_put(out, s, 0);
            continue;
        }
        o -= 1;
        float v;
        if (o < rows * r) {
            const uint64_t i = o / r;
            const unsigned k = (unsigned)(o % r);
            v = epipe_hd_pi_factor_value(q[(b * r + k) * rows + i], 1.0f);
        } else {
            const uint64_t j = (o - rows * r) / r;
            const unsigned k = (unsigned)((o - rows * r) % r);
            const float f = p[(b * r + k) * cols + j];
            v = epipe_hd_pi_factor_value(f, s > 0.0f ? 1.0f / s : 0.0f);
            if (slot) {
                const double iv = inv[b * r + k];
                slot[(b * r + k) * cols + j] = iv > 0 ? (float)(f * iv)
                                                      : epipe_hd_pi_start_value(j, k);
            }
        }
        pi_put(out + 4 + o * es, v, fp16);
    }
}

/* The cold start of every matrix, for the cuBLAS path. */
__global__ void pi_cold_start(float *p, uint64_t nb, uint64_t cols, unsigned r)
{
    for (uint64_t e = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; e < nb * cols * r;
         e += (uint64_t)gridDim.x * blockDim.x)
        p[e] = epipe_hd_pi_start_value(e % cols, (unsigned)(e / cols % r));
}

/* Every record's scale and factors checked as epipe_pi_read_record()
 * checks them (a bad one noted in the status word as payload entry
 * b * (1 + (rows + cols) * r) + its place, kind EPIPE_CUDA_BAD_BOUNDS),
 * into q (column-major rows x r a matrix) and p (cols x r, times the
 * scale, as the CPU decoder multiplies it). */
__global__ void pi_unpack(const uint8_t *recs, uint64_t rec, uint64_t nb, uint64_t rows,
                          uint64_t cols, unsigned r, int fp16, float *q, float *p,
                          epipe_cuda_status *st)
{
    const uint64_t per = 1 + (rows + cols) * r, es = fp16 ? 2 : 4;
    for (uint64_t e = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; e < nb * per;
         e += (uint64_t)gridDim.x * blockDim.x) {
        const uint64_t b = e / per;
        uint64_t o = e % per;
        const uint8_t *in = recs + b * rec;
        const float s = pi_get(in, 0);
        if (o == 0) {
            if (!epipe_hd_pi_scale_ok(s, r))
                atomicMin(&st->bad, e << 2 | EPIPE_CUDA_BAD_BOUNDS);
            continue;
        }
        o -= 1;
        const float v = pi_get(in + 4 + o * es, fp16);
        if (!epipe_hd_pi_factor_ok(v))
            atomicMin(&st->bad, e << 2 | EPIPE_CUDA_BAD_BOUNDS);
        if (o < rows * r)
            q[(b * r + o % r) * rows + o / r] = v;
        else
            p[(b * r + (o - rows * r) % r) * cols + (o - rows * r) / r] = v * s;
    }
}

/* The decode up to rank PI_FUSED_MAX_RANK, one kernel: block (b, tile,
 * group) checks and loads matrix b's scale and its group of PI_ROW_GROUP
 * rows of Q (in shared memory), then each thread rebuilds a column j of the
 * tile over those rows, Y[i][j] = sum_k Q[i][k] (s P[j][k]) (its writes
 * coalesced across the block), from P's row j, checked as it is read. Bad
 * values are noted as pi_unpack notes them (the scale and Q by the blocks
 * of the matrix's first tile only). The tensor is written once and the
 * payload read about once, where pi_unpack and a GEMM wrote and read the
 * factors twice more; the groups of rows keep the GPU busy when the
 * matrices are few and narrow. */
template <unsigned R>
__global__ void __launch_bounds__(PI_THREADS)
    pi_rebuild(const uint8_t *recs, uint64_t rec, uint64_t nb, uint64_t rows, uint64_t cols,
               int fp16, uint64_t tiles, uint64_t groups, float *y, epipe_cuda_status *st)
{
    __shared__ float qs[PI_ROW_GROUP * R]; /* the group's rows of Q, row-major */
    __shared__ float scale;
    const uint64_t per = 1 + (rows + cols) * R, es = fp16 ? 2 : 4;
    for (uint64_t it = blockIdx.x; it < nb * tiles * groups; it += gridDim.x) {
        const uint64_t tile = it % tiles, g = it / tiles % groups, b = it / tiles / groups;
        const uint64_t i0 = g * PI_ROW_GROUP,
                       n = rows - i0 < PI_ROW_GROUP ? rows - i0 : PI_ROW_GROUP;
        const uint8_t *in = recs + b * rec;
        for (uint64_t e = threadIdx.x; e < n * R; e += blockDim.x) {
            const float v = pi_get(in + 4 + (i0 * R + e) * es, fp16);
            if (tile == 0 && !epipe_hd_pi_factor_ok(v))
                atomicMin(&st->bad, (b * per + 1 + i0 * R + e) << 2 | EPIPE_CUDA_BAD_BOUNDS);
            qs[e] = v;
        }
        if (threadIdx.x == 0) {
            const float s = pi_get(in, 0);
            if (tile == 0 && g == 0 && !epipe_hd_pi_scale_ok(s, R))
                atomicMin(&st->bad, (b * per) << 2 | EPIPE_CUDA_BAD_BOUNDS);
            scale = s;
        }
        __syncthreads();
        const uint64_t j = tile * PI_TILE + threadIdx.x;
        if (j < cols) {
            float p[R];
#pragma unroll
            for (unsigned k = 0; k < R; k++) {
                const uint64_t e = rows * R + j * R + k;
                const float v = pi_get(in + 4 + e * es, fp16);
                if (!epipe_hd_pi_factor_ok(v))
                    atomicMin(&st->bad, (b * per + 1 + e) << 2 | EPIPE_CUDA_BAD_BOUNDS);
                p[k] = v * scale;
            }
            float *out = y + (b * rows + i0) * cols + j;
            for (uint64_t i = 0; i < n; i++) {
                float acc = 0.0f;
#pragma unroll
                for (unsigned k = 0; k < R; k++)
                    acc += qs[i * R + k] * p[k];
                out[i * cols] = acc;
            }
        }
        __syncthreads(); /* qs and scale free for the next item */
    }
}

/* pi_rebuild for rank r (1 .. PI_FUSED_MAX_RANK). */
static void launch_rebuild(unsigned r, unsigned blocks, cudaStream_t s, const uint8_t *recs,
                           uint64_t rec, uint64_t nb, uint64_t rows, uint64_t cols, int fp16,
                           uint64_t tiles, uint64_t groups, float *y, epipe_cuda_status *st)
{
    // clang-format off
#define PI_R_CASE(R)                                                                               \
    case R:                                                                                        \
        pi_rebuild<R><<<blocks, PI_THREADS, 0, s>>>(recs, rec, nb, rows, cols, fp16, tiles,       \
                                                     groups, y, st);                              \
        break;
    // clang-format on
    switch (r) {
        PI_EACH_RANK(PI_R_CASE)
    }
#undef PI_R_CASE
}

/* ---- the encode and the decode ------------------------------------------ */

/* The fused iterations (pi_fused()): Q and P of every matrix into dq, dp,
 * from `start` (NULL: the cold start). */
static int iterate_fused(epipe_codec *c, const float *x, const uint64_t v[4], unsigned r,
                         const float *start, float *dq, float *dp)
{
    epipe_cuda_handle *h = epipe_cuda_h(c);
    cudaStream_t s = epipe_cuda_stream(c);
    const uint64_t nb = v[0], rows = v[1], cols = v[2];
    const uint64_t tiles = (cols + PI_TILE - 1) / PI_TILE,
                   groups = (rows + PI_ROW_GROUP - 1) / PI_ROW_GROUP;
    void *part;
    int rc = epipe_cuda_grow(c, &h->work[2], nb * tiles * rows * r * sizeof(float), &part);
    if (rc)
        return rc;
    const size_t qbytes = (size_t)(rows * r * sizeof(float));
    for (uint64_t it = 0; it < v[3]; it++) {
        launch_product_q(r, epipe_cuda_blocks(nb * groups * tiles, 1), s, x, nb, rows, cols,
                         it ? dp : start, tiles, groups, it == 0, (float *)part, h->status);
        pi_qr_small<<<epipe_cuda_blocks(nb, 1), PI_THREADS, qbytes, s>>>(
            (const float *)part, nb, rows, r, tiles, dq, h->status);
        pi_product_p<<<epipe_cuda_blocks(nb * tiles, 1), PI_THREADS, qbytes, s>>>(
            x, nb, rows, cols, r, dq, tiles, dp, h->status);
        if ((rc = epipe_cuda_check(c, cudaGetLastError(), "launching the products")))
            return rc;
    }
    return EPIPE_OK;
}

/* The iterations on cuBLAS (any rank and size), from dp (the start), into
 * dq and dp. Q = M P and P = Mᵀ Q are batched GEMMs on the tensor; each Q
 * is orthonormalised on the device by CholeskyQR2 (device_qr) or on the
 * host by the CPU's Householder QR (Q down and up every iteration: a wait
 * each). */
static int iterate_blas(epipe_codec *c, const float *x, const uint64_t v[4], unsigned r,
                        int device_qr, float *dq, float *dp)
{
    const epipe_cuda_core *core = epipe_cuda_core_fns;
    epipe_cuda_handle *h = epipe_cuda_h(c);
    cudaStream_t s = epipe_cuda_stream(c);
    const uint64_t nb = v[0], rows = v[1], cols = v[2];
    const size_t gs = (size_t)(nb * r * r), qs = (size_t)(nb * rows * r);
    const int m = (int)rows, k = (int)cols, rr = (int)r;
    float *G = NULL, *R = NULL, *hq = NULL;
    int rc;
    void *w;
    if (device_qr) {
        if ((rc = epipe_cuda_grow(c, &h->work[2], 2 * gs * sizeof(float), &w)))
            return rc;
        G = (float *)w, R = G + gs;
    } else {
        if ((rc = epipe_cuda_host(c, qs * sizeof(float), &w)))
            return rc;
        hq = (float *)w;
    }
    for (uint64_t it = 0; it < v[3]; it++) {
        /* Q = M P: M row-major rows x cols is column-major cols x rows. */
        if ((rc = epipe_cuda_gemm(c, "computing Q = M P", 1, 0, m, rr, k, x, k,
                                  (long long)rows * cols, dp, k, (long long)cols * r, dq, m,
                                  (long long)rows * r, (int)nb)))
            return rc;
        for (int pass = 0; device_qr && pass < 2; pass++) {
            if ((rc = epipe_cuda_gemm(c, "computing G = Qt Q", 1, 0, rr, rr, m, dq, m,
                                      (long long)rows * r, dq, m, (long long)rows * r, G, rr,
                                      (long long)r * r, (int)nb)))
                return rc;
            pi_chol_kernel<<<epipe_cuda_blocks(nb, 128), 128, 0, s>>>(G, nb, r, R, h->status);
            pi_solve_kernel<<<epipe_cuda_blocks(nb * rows, 256), 256, 0, s>>>(dq, nb, rows, r, R,
                                                                              h->status);
            if ((rc = epipe_cuda_check(c, cudaGetLastError(), "launching the QR kernels")))
                return rc;
        }
        if (!device_qr) {
            if ((rc = copy(c, hq, dq, qs * sizeof(float), cudaMemcpyDeviceToHost,
                           "copying Q down")) ||
                (rc = wait(c, "waiting for Q")))
                return rc;
            for (uint64_t b = 0; b < nb; b++)
                if ((rc = core->pi_orthonormalize(c, hq + b * rows * r, (unsigned)rows, r, b)))
                    return rc;
            /* from pageable memory: hq has been read when the copy returns */
            if ((rc = copy(c, dq, hq, qs * sizeof(float), cudaMemcpyHostToDevice, "copying Q up")))
                return rc;
        }
        /* P = Mᵀ Q */
        if ((rc = epipe_cuda_gemm(c, "computing P = Mt Q", 0, 0, k, rr, m, x, k,
                                  (long long)rows * cols, dq, m, (long long)rows * r, dp, k,
                                  (long long)cols * r, (int)nb)))
            return rc;
    }
    return EPIPE_OK;
}

/* Sets the status word's poweriter fields (refused, factor) to none. */
static int clear_pi_fields(epipe_codec *c)
{
    epipe_cuda_status *st = epipe_cuda_h(c)->status;
    return epipe_cuda_check(c,
                            cudaMemsetAsync(&st->refused, 0xff,
                                            sizeof st->refused + sizeof st->factor,
                                            epipe_cuda_stream(c)),
                            "clearing the status word");
}

/* For the tests: EPIPE_CUDA_TEST_NO_RESTART=1 turns a Cholesky's refusal
 * into an error instead of a restart on the host's QR, which gives the
 * right factors whatever the device computed: a test on well-conditioned
 * tensors sets it to see the device's own path give them. */
static bool no_restart(void)
{
    const char *v = getenv("EPIPE_CUDA_TEST_NO_RESTART");
    return v && *v && strcmp(v, "0");
}

/* Slot `index`'s device buffer for `count` floats: *warm stays 1 only when
 * it already held that many (a start the core says is this view's). */
static int slot_buffer(epipe_codec *c, int index, size_t count, int *warm, float **out)
{
    epipe_cuda_handle *h = epipe_cuda_h(c);
    if (!h->pi_slots &&
        !(h->pi_slots = (epipe_cuda_buf *)calloc(EPIPE_CUDA_PI_SLOTS, sizeof *h->pi_slots)))
        return epipe_cuda_fail(c, EPIPE_ENOMEM, "poweriter: out of host memory");
    epipe_cuda_buf *b = &h->pi_slots[index];
    if (!b->p || b->cap < count * sizeof(float))
        *warm = 0;
    void *p;
    int rc = epipe_cuda_grow(c, b, count * sizeof(float), &p);
    *out = (float *)p;
    return rc;
}

/* The encode up to its one wait: the products (fused, or on cuBLAS with
 * the device's QR where device_qr, else the host's), the finiteness of
 * the input and the factors' statistics, and the status word read. */
static int factorize(epipe_codec *c, const float *x, size_t n, const uint64_t v[4], unsigned r,
                     int path, const float *start, float *dq, float *dp, float *scale, double *inv)
{
    epipe_cuda_handle *h = epipe_cuda_h(c);
    cudaStream_t s = epipe_cuda_stream(c);
    const uint64_t nb = v[0], rows = v[1], cols = v[2];
    int rc;
    if (path == 0) {
        rc = iterate_fused(c, x, v, r, start, dq, dp);
    } else {
        pi_check_finite<<<epipe_cuda_blocks((n + 7) / 8, 256), 256, 0, s>>>(
            x, n, epipe_cuda_aligned16(x), h->status);
        if (!start)
            pi_cold_start<<<epipe_cuda_blocks(nb * cols * r, 256), 256, 0, s>>>(dp, nb, cols, r);
        rc = start ? copy(c, dp, start, nb * cols * r * sizeof(float), cudaMemcpyDeviceToDevice,
                          "copying the warm start")
                   : EPIPE_OK;
        if (!rc)
            rc = epipe_cuda_check(c, cudaGetLastError(), "launching the finiteness check");
        if (!rc)
            rc = iterate_blas(c, x, v, r, path == 1, dq, dp);
    }
    if (rc)
        return rc;
    pi_factor_stats<<<epipe_cuda_blocks(nb, 1), PI_THREADS, 0, s>>>(dq, dp, nb, rows, cols, r,
                                                                    scale, inv, h->status);
    if ((rc = epipe_cuda_check(c, cudaGetLastError(), "launching the factors' statistics")) ||
        (rc = copy(c, h->status_host, h->status, sizeof *h->status, cudaMemcpyDeviceToHost,
                   "reading the status word")))
        return rc;
    return wait(c, "waiting for the factors");
}

static int encode_slot(epipe_codec *c, const float *x, size_t n, uint8_t *body, const uint64_t v[4],
                       unsigned r, size_t len, int index, int warm);

static int pi_encode(epipe_codec *c, const float *x, size_t n, uint8_t *body)
{
    const epipe_cuda_core *core = epipe_cuda_core_fns;
    uint64_t v[4];
    unsigned r;
    size_t len;
    int rc = core->pi_plan(c, n, body, v, &r, &len);
    if (rc || r == 0)
        return rc ? rc : epipe_cuda_body_push(c, body, 0, len);
    int index, warm;
    if ((rc = core->pi_slot(c, n, &index, &warm)))
        return rc;
    /* From here on every exit marks the slot: warm for this view after a
     * success, cold after a failure (its buffer may have been reallocated,
     * or half written). */
    rc = encode_slot(c, x, n, body, v, r, len, index, warm);
    core->pi_commit(c, n, rc == EPIPE_OK);
    return rc;
}

/* pi_encode's work once the slot is known (index, -1 for none; warm: its
 * buffer holds this view's start). */
static int encode_slot(epipe_codec *c, const float *x, size_t n, uint8_t *body, const uint64_t v[4],
                       unsigned r, size_t len, int index, int warm)
{
    const epipe_cuda_core *core = epipe_cuda_core_fns;
    epipe_cuda_handle *h = epipe_cuda_h(c);
    cudaStream_t s = epipe_cuda_stream(c);
    const uint64_t nb = v[0], rows = v[1], cols = v[2], rec = (len - EPIPE_CUDA_PI_HEADER) / nb;
    const size_t qs = (size_t)(nb * rows * r), ps = (size_t)(nb * cols * r);
    float *slot = NULL;
    void *dq, *dp, *stats;
    int rc;
    if ((index >= 0 && (rc = slot_buffer(c, index, ps, &warm, &slot))) ||
        (rc = epipe_cuda_grow(c, &h->work[0], qs * sizeof(float), &dq)) ||
        (rc = epipe_cuda_grow(c, &h->work[1], ps * sizeof(float), &dp)) ||
        (rc = epipe_cuda_grow(c, &h->pi_stats, nb * (sizeof(float) + r * sizeof(double)), &stats)))
        return rc;
    double *inv = (double *)stats;
    float *scale = (float *)(inv + nb * r);
    const float *start = warm ? slot : NULL;
    /* 0 fused, 1 cuBLAS with the device's QR, 2 with the host's; a Q the
     * device's Cholesky refuses sends the encode back to its start on
     * the host's QR (the starts are unchanged: nothing is written before
     * the wait). */
    int path = pi_fused(nb, rows, cols, r) ? 0 : r <= PI_DEVICE_QR_MAX_RANK ? 1 : 2;
    for (;;) {
        if ((rc = clear_pi_fields(c)) ||
            (rc = factorize(c, x, n, v, r, path, start, (float *)dq, (float *)dp, scale, inv)))
            break;
        if ((rc = refuse_nonfinite(c)))
            break;
        if (h->status_host->refused == ~0ull || path == 2)
            break;
        if (no_restart()) {
            rc = epipe_cuda_fail(c, EPIPE_EIO,
                                 "poweriter: the device's Cholesky refused matrix %llu's Q, and "
                                 "EPIPE_CUDA_TEST_NO_RESTART forbids the host's QR",
                                 h->status_host->refused);
            break;
        }
        path = 2;
    }
    const unsigned long long bad = h->status_host->factor;
    if (!rc && bad != ~0ull) {
        float sb = 0;
        if (!(rc = copy(c, &sb, scale + (bad >> 1), sizeof sb, cudaMemcpyDeviceToHost,
                        "reading the scale")) &&
            !(rc = wait(c, "reading the scale")) && !(rc = clear_pi_fields(c)))
            rc = core->pi_refuse(c, n, bad >> 1, (int)(bad & 1), sb);
    }
    void *recs;
    if (!rc && !(rc = epipe_cuda_body_out(c, EPIPE_CUDA_PI_HEADER, nb * rec, &recs))) {
        pi_write_records<<<epipe_cuda_blocks(nb * (1 + (rows + cols) * r), 256), 256, 0, s>>>(
            (const float *)dq, (const float *)dp, scale, inv, nb, rows, cols, r, pi_fp16(c),
            (uint8_t *)recs, rec, slot);
        if (!(rc = epipe_cuda_check(c, cudaGetLastError(), "launching the records")) &&
            !(rc = epipe_cuda_body_flush(c, body, EPIPE_CUDA_PI_HEADER, recs, nb * rec)))
            rc = epipe_cuda_body_push(c, body, 0, EPIPE_CUDA_PI_HEADER);
    }
    return rc;
}

static int pi_decode(epipe_codec *c, const uint8_t *body, size_t n, float *y)
{
    const epipe_cuda_core *core = epipe_cuda_core_fns;
    epipe_cuda_handle *h = epipe_cuda_h(c);
    cudaStream_t s = epipe_cuda_stream(c);
    uint64_t v[4];
    unsigned r;
    size_t len;
    int rc = core->pi_plan(c, n, NULL, v, &r, &len);
    /* the body's header is checked at once, unless the module defers it:
     * the launch below depends on the plan only */
    if (rc || (!h->defer_checks && (rc = core->pi_check_header(c, body, n))) || r == 0)
        return rc;
    const uint64_t nb = v[0], rows = v[1], cols = v[2], rec = (len - EPIPE_CUDA_PI_HEADER) / nb;
    const size_t qs = (size_t)(nb * rows * r), ps = (size_t)(nb * cols * r);
    const void *recs;
    void *dq, *dp;
    if (r <= PI_FUSED_MAX_RANK) {
        const uint64_t tiles = (cols + PI_TILE - 1) / PI_TILE,
                       groups = (rows + PI_ROW_GROUP - 1) / PI_ROW_GROUP;
        if ((rc = epipe_cuda_body_in(c, body, EPIPE_CUDA_PI_HEADER, nb * rec, &recs)))
            return rc;
        launch_rebuild(r, epipe_cuda_blocks(nb * tiles * groups, 1), s, (const uint8_t *)recs, rec,
                       nb, rows, cols, pi_fp16(c), tiles, groups, y, h->status);
        return epipe_cuda_check(c, cudaGetLastError(), "launching the rebuild");
    }
    if ((rc = epipe_cuda_grow(c, &h->work[0], qs * sizeof(float), &dq)) ||
        (rc = epipe_cuda_grow(c, &h->work[1], ps * sizeof(float), &dp)) ||
        (rc = epipe_cuda_body_in(c, body, EPIPE_CUDA_PI_HEADER, nb * rec, &recs)))
        return rc;
    pi_unpack<<<epipe_cuda_blocks(nb * (1 + (rows + cols) * r), 256), 256, 0, s>>>(
        (const uint8_t *)recs, rec, nb, rows, cols, r, pi_fp16(c), (float *)dq, (float *)dp,
        h->status);
    if ((rc = epipe_cuda_check(c, cudaGetLastError(), "launching the factors' checks")))
        return rc;
    /* Y = s Q Pᵀ: row-major rows x cols is column-major cols x rows = (sP) Qᵀ. */
    return epipe_cuda_gemm(c, "rebuilding Y = Q Pt", 0, 1, (int)cols, (int)rows, (int)r,
                           (const float *)dp, (int)cols, (long long)cols * r, (const float *)dq,
                           (int)rows, (long long)rows * r, y, (int)cols, (long long)rows * cols,
                           (int)nb);
}

const epipe_codec_backend epipe_cuda_poweriter = {pi_encode, pi_decode, NULL, NULL, 1, NULL};
