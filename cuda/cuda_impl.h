/* What the files of the CUDA module share: the per-handle state (device
 * scratch, the deferred status word), error helpers and the backends. */
#ifndef EPIPE_CUDA_CUDA_IMPL_H
#define EPIPE_CUDA_CUDA_IMPL_H

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

extern "C" {
#include "../lib/codec/cuda_api.h"
}

/* The deferred status word, in device memory: kernels that meet a value
 * they cannot encode record the smallest index of each kind (atomicMin);
 * UINT64_MAX = none. Read and cleared by epipe_cuda_synchronize(). */
struct epipe_cuda_status {
    unsigned long long nan, pinf, ninf;
    /* A payload entry a decode kernel refused: entry << 2 | the kind
     * below, the smallest entry first (atomicMin). */
    unsigned long long bad;
    /* insert's encode: the smallest index of a code that is not finite
     * (the input is not, or the products overflow fp32), else that of a
     * code beyond fp16 (code=fp16) with EPIPE_CUDA_CODE_FP16 set. */
    unsigned long long code;
    /* poweriter's encode, read by its own wait and never reported by
     * synchronize: the smallest matrix whose Q the device's Cholesky
     * refused (the encode starts over on the host's QR), and the smallest
     * b << 1 | kind of a matrix whose factors the CPU would refuse (kind
     * 0: not finite; 1: the scale overflows). Adjacent: cleared together. */
    unsigned long long refused, factor;
};
/* The kinds of a bad payload entry; BOUNDS: a poweriter scale or factor
 * that is not finite or is outside its range. */
enum {
    EPIPE_CUDA_BAD_BOUNDS = 0,
    EPIPE_CUDA_BAD_RANGE = 1,
    EPIPE_CUDA_BAD_ORDER = 2,
    EPIPE_CUDA_BAD_VALUE = 3
};
#define EPIPE_CUDA_CODE_FP16 (1ull << 63)

/* A device buffer grown on demand (stream-ordered, on the handle's stream). */
struct epipe_cuda_buf {
    void *p;
    size_t cap;
};

/* c->cuda: one per handle, on the device it is bound to. */
struct epipe_cuda_handle {
    int device;
    epipe_cuda_status *status; /* device */
    epipe_cuda_buf stage;      /* fp32 view of a fp16/bf16 tensor */
    epipe_cuda_buf body;       /* the body before it is copied out */
    epipe_cuda_buf work[3];    /* per-codec work arrays */
    epipe_cuda_buf ef_work;    /* ef=1: x + r, the tensor encoded */
    epipe_cuda_buf grad_out;   /* a backward's fp32 result for a 16-bit gradient */
    void *host;                /* per-codec host scratch (malloc) */
    size_t host_cap;
    /* The call's payload, when it is device memory: the kernels read and
     * write its body in place (dev_body), and the backends' host reads
     * and writes (tables, checks) go to `mirror`, a host image of the body
     * of which only those bytes are ever touched. NULL for host payloads. */
    uint8_t *dev_body;
    size_t body_len;
    uint8_t *mirror;
    size_t mirror_cap;
    uint8_t *pinned; /* staging for the bytes copied into the mirror */
    size_t pinned_cap;
    /* The device payload whose header and host-read bytes the last peek
     * put into the mirror (NULL: none). */
    const uint8_t *peeked;
    size_t peeked_len;
    /* Decodes of device payloads whose checks wait for synchronize
     * (cuda/module.cu, "deferred checks"): the header and the bytes the
     * host checks of each, copied on the stream into `checks` (pinned);
     * a failure of theirs found by an earlier wait (held_rc, held_msg)
     * for the next synchronize; and, during such a decode's backend call,
     * defer_checks = 1: the backend launches without reading the mirror. */
    struct epipe_cuda_pending *pending; /* [EPIPE_CUDA_PENDING_MAX] */
    unsigned npending;
    uint8_t *checks;
    size_t checks_cap, checks_used;
    int held_rc;
    char held_msg[512];
    int defer_checks;
    /* The order of the handle's calls since, so that synchronize returns
     * the first error: seq counts encodes and deferred decodes; enc_seq
     * is the first encode's since the status word was last read (0: none),
     * held_seq the decode's whose failure is held. */
    unsigned long long seq, enc_seq, held_seq;
    epipe_cuda_status *status_host; /* pinned: where synchronize reads it */
    void *blas;                     /* cublasHandle_t, made on first use (cuda/cublas.cu) */
    /* poweriter's warm starts (EPIPE_CUDA_PI_SLOTS buffers, made on first
     * use) and its factors' statistics (cuda/poweriter.cu) */
    epipe_cuda_buf *pi_slots;
    epipe_cuda_buf pi_stats;
    void *dnn; /* insert's cuDNN state, made on first use */
};

/* The core's helpers, set at init. */
extern const epipe_cuda_core *epipe_cuda_core_fns;

int epipe_cuda_fail(epipe_codec *c, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* EPIPE_ENOMEM for allocation errors, else EPIPE_EIO, naming the CUDA
 * error and what was being done; EPIPE_OK for cudaSuccess. */
int epipe_cuda_check(epipe_codec *c, cudaError_t e, const char *doing);
/* Clears the deferred status word on the handle's stream, once what it
 * held has been reported. */
int epipe_cuda_status_clear(epipe_codec *c);
/* For the encoders that refuse a value that is not finite at once (kmeans,
 * poweriter), from the status word read to the host: 0 when it holds
 * none; else 1, with the smallest index and its kind (0 NaN, 1 +inf,
 * 2 -inf), and those three fields cleared on the handle's stream (or that
 * clear's error status); a deferred decode error the word holds stays for
 * the next synchronize. Adjacent: nan, pinf, ninf. */
int epipe_cuda_take_nonfinite(epipe_codec *c, const epipe_cuda_status *st,
                              unsigned long long *index, int *kind);
/* The smallest index of a value that is not finite the status holds, of
 * any kind; ~0 for none. */
static inline unsigned long long epipe_cuda_first_nonfinite(const epipe_cuda_status *st)
{
    unsigned long long first = st->nan < st->pinf ? st->nan : st->pinf;
    return st->ninf < first ? st->ninf : first;
}

static inline cudaStream_t epipe_cuda_stream(const epipe_codec *c)
{
    return (cudaStream_t)c->stream;
}
static inline epipe_cuda_handle *epipe_cuda_h(epipe_codec *c)
{
    return (epipe_cuda_handle *)c->cuda;
}
/* At least `bytes` of device memory in b (contents not kept). */
int epipe_cuda_grow(epipe_codec *c, epipe_cuda_buf *b, size_t bytes, void **p);
/* At least `bytes` of host scratch in the handle. */
int epipe_cuda_host(epipe_codec *c, size_t bytes, void **p);

/* The body of the call, as the backends see it: `body` is host memory
 * (the payload itself, or the mirror of a device payload). The kernels
 * write body bytes [off, off + bytes) to *d: the device payload in place,
 * or the handle's scratch, which epipe_cuda_body_flush() then copies into
 * a host payload. Reads are the same: *d is the device payload in place,
 * or the scratch the host bytes were copied to. */
int epipe_cuda_body_out(epipe_codec *c, size_t off, size_t bytes, void **d);
int epipe_cuda_body_flush(epipe_codec *c, uint8_t *body, size_t off, const void *d, size_t bytes);
int epipe_cuda_body_in(epipe_codec *c, const uint8_t *body, size_t off, size_t bytes,
                       const void **d);
/* Bytes the host wrote into the body ([off, off + bytes)): copied into a
 * device payload (a host payload holds them already). */
int epipe_cuda_body_push(epipe_codec *c, const uint8_t *body, size_t off, size_t bytes);

/* Blocks of `kernel` at `threads` a block resident at once on `device`:
 * what a cooperative launch may have; 0 where it cannot launch. Asked once
 * per device: cache is the caller's, one per kernel (0: not asked, -1: no
 * cooperative launch); *entry is set to the device's entry in it (NULL for
 * a device past the cache), for epipe_cuda_coop_launch(). */
int epipe_cuda_coop_blocks(const void *kernel, unsigned threads, int device, int cache[64],
                           int **entry);

/* A cooperative launch for a caller that has a multi-launch path for the
 * same work. 1 when launched; 0 when the launch was refused as one whose
 * blocks cannot all be resident (cudaErrorCooperativeLaunchTooLarge: the
 * context has fewer SMs than the device reports, as an MPS client with a
 * thread percentage or a green context does; or cudaErrorNotSupported):
 * the error is cleared and *entry set to -1, so that this and later calls
 * on the device take the multi-launch path; any other failure is reported
 * (EPIPE_EIO, naming `what`). */
int epipe_cuda_coop_launch(epipe_codec *c, const void *kernel, unsigned blocks, unsigned threads,
                           void **args, cudaStream_t s, int *entry, const char *what);

/* Blocks for n items at `threads` per block, capped so that a grid-stride
 * loop covers the rest. */
static inline unsigned epipe_cuda_blocks(uint64_t n, unsigned threads)
{
    uint64_t b = (n + threads - 1) / threads;
    if (b > 65535u * 4u)
        b = 65535u * 4u;
    return b ? (unsigned)b : 1u;
}

/* ---- device helpers: eight values or eight codes per thread ------------ */

#ifdef __CUDACC__
#include "../codecs/inline/quant.h"

/* Values g*8 .. g*8+7 of x (zeros past n): two 16-byte loads where x is
 * aligned (`vec`, checked once per launch) and the group is whole. */
__device__ static inline void epipe_cuda_load8f(const float *x, uint64_t n, uint64_t g, int vec,
                                                float v[8])
{
    uint64_t j = g * 8;
    if (vec && j + 8 <= n) {
        float4 a = ((const float4 *)x)[2 * g], b = ((const float4 *)x)[2 * g + 1];
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
        v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
        return;
    }
    for (unsigned i = 0; i < 8; i++)
        v[i] = j + i < n ? x[j + i] : 0.0f;
}

__device__ static inline void epipe_cuda_store8f(float *y, uint64_t n, uint64_t g, int vec,
                                                 const float v[8])
{
    uint64_t j = g * 8;
    if (vec && j + 8 <= n) {
        ((float4 *)y)[2 * g] = make_float4(v[0], v[1], v[2], v[3]);
        ((float4 *)y)[2 * g + 1] = make_float4(v[4], v[5], v[6], v[7]);
        return;
    }
    for (unsigned i = 0; i < 8 && j + i < n; i++)
        y[j + i] = v[i];
}

/* Group g of w-bit codes (w <= 16) at byte g*w of `codes` (code_bytes
 * long), as epipe_hd_pack8 lays it out: in 8-, 4- or 2-byte words where w
 * and the address allow, bytes otherwise and for the last group. */
__device__ static inline void epipe_cuda_store_codes(const uint32_t c[8], unsigned w, uint64_t g,
                                                     uint8_t *codes, uint64_t code_bytes)
{
    uint64_t lo, hi, at = g * w;
    epipe_hd_pack8_words(c, w, &lo, &hi);
    uint8_t *p = codes + at;
    uintptr_t a = (uintptr_t)p;
    if (at + w <= code_bytes) {
        if (w % 8 == 0 && a % 8 == 0) {
            ((uint64_t *)p)[0] = lo;
            if (w == 16)
                ((uint64_t *)p)[1] = hi;
            return;
        }
        if (w % 4 == 0 && a % 4 == 0) {
            for (unsigned j = 0; j < w / 4; j++)
                ((uint32_t *)p)[j] = (uint32_t)(j < 2 ? lo >> (32 * j) : hi >> (32 * (j - 2)));
            return;
        }
        if (w % 2 == 0 && a % 2 == 0) {
            for (unsigned j = 0; j < w / 2; j++)
                ((uint16_t *)p)[j] = (uint16_t)(j < 4 ? lo >> (16 * j) : hi >> (16 * (j - 4)));
            return;
        }
    }
    uint64_t m = code_bytes - at < w ? code_bytes - at : w;
    for (unsigned j = 0; j < m; j++)
        p[j] = (uint8_t)(j < 8 ? lo >> (8 * j) : hi >> (8 * (j - 8)));
}

__device__ static inline void epipe_cuda_load_codes(const uint8_t *codes, uint64_t code_bytes,
                                                    unsigned w, uint64_t g, uint32_t c[8])
{
    uint64_t lo = 0, hi = 0, at = g * w;
    const uint8_t *p = codes + at;
    uintptr_t a = (uintptr_t)p;
    if (at + w <= code_bytes && w % 8 == 0 && a % 8 == 0) {
        lo = ((const uint64_t *)p)[0];
        hi = w == 16 ? ((const uint64_t *)p)[1] : 0;
    } else if (at + w <= code_bytes && w % 4 == 0 && a % 4 == 0) {
        for (unsigned j = 0; j < w / 4; j++) {
            uint64_t v = ((const uint32_t *)p)[j];
            if (j < 2)
                lo |= v << (32 * j);
            else
                hi |= v << (32 * (j - 2));
        }
    } else {
        uint64_t m = code_bytes - at < w ? code_bytes - at : w;
        for (unsigned j = 0; j < m; j++) {
            if (j < 8)
                lo |= (uint64_t)p[j] << (8 * j);
            else
                hi |= (uint64_t)p[j] << (8 * (j - 8));
        }
    }
    epipe_hd_unpack8_words(lo, hi, w, c);
}

/* The grid-stride loop over the groups of eight values of x: f(v, g) for
 * each group g this thread takes, v its values (zeros past n). */
template <class F>
__device__ static inline void epipe_cuda_each_group8(const float *x, uint64_t n, int vec, F f)
{
    uint64_t groups = (n + 7) / 8;
    for (uint64_t g = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; g < groups;
         g += (uint64_t)gridDim.x * blockDim.x) {
        float v[8];
        epipe_cuda_load8f(x, n, g, vec, v);
        f(v, g);
    }
}

/* The pass of a pack kernel: the code of value x[j] is code_of(x[j], j)
 * (0 past n), w bits each into codes (code_bytes long). */
template <class F>
__device__ static inline void epipe_cuda_pack_pass(const float *x, uint64_t n, int vec, unsigned w,
                                                   uint8_t *codes, uint64_t code_bytes, F code_of)
{
    epipe_cuda_each_group8(x, n, vec, [&](float *v, uint64_t g) {
        uint32_t c[8];
        for (unsigned i = 0; i < 8; i++)
            c[i] = g * 8 + i < n ? code_of(v[i], g * 8 + i) : 0u;
        epipe_cuda_store_codes(c, w, g, codes, code_bytes);
    });
}

/* The pack pass of a cooperative encode: block b's groups [g0, g1), the
 * range whose extent it folded, last first, so that its first reads are
 * the ones it made last, most likely still in L2. */
template <class F>
__device__ static inline void epipe_cuda_pack_back(const float *x, uint64_t n, int vec, unsigned w,
                                                   uint8_t *codes, uint64_t code_bytes, uint64_t g0,
                                                   uint64_t g1, F code_of)
{
    uint64_t count = g1 - g0;
    for (int64_t r = threadIdx.x < count ? (int64_t)((count - 1 - threadIdx.x) / blockDim.x) : -1;
         r >= 0; r--) {
        uint64_t g = g0 + threadIdx.x + (uint64_t)r * blockDim.x;
        float v[8];
        uint32_t c[8];
        epipe_cuda_load8f(x, n, g, vec, v);
        for (unsigned i = 0; i < 8; i++)
            c[i] = g * 8 + i < n ? code_of(v[i]) : 0u;
        epipe_cuda_store_codes(c, w, g, codes, code_bytes);
    }
}

/* The grid-stride pass of a decode kernel: n w-bit codes to the values
 * value_of(code), eight a thread. */
template <class F>
__device__ static inline void epipe_cuda_unpack_pass(const uint8_t *codes, uint64_t n, unsigned w,
                                                     int vec, float *y, F value_of)
{
    uint64_t groups = (n + 7) / 8, bytes = (n * w + 7) / 8;
    for (uint64_t g = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; g < groups;
         g += (uint64_t)gridDim.x * blockDim.x) {
        uint32_t c[8];
        float v[8];
        epipe_cuda_load_codes(codes, bytes, w, g, c);
        for (unsigned i = 0; i < 8; i++)
            v[i] = value_of(c[i]);
        epipe_cuda_store8f(y, n, g, vec, v);
    }
}

/* Order-preserving keys of finite floats, for min/max by integer atomics
 * (-0 and +0 are two keys: callers add 0.0f to the float they get back). */
__device__ static inline uint32_t epipe_cuda_key(float f)
{
    uint32_t u = __float_as_uint(f);
    return u & 0x80000000u ? ~u : u | 0x80000000u;
}
__host__ __device__ static inline float epipe_cuda_key_float(uint32_t k)
{
    return epipe_hd_u2f(k & 0x80000000u ? k & 0x7fffffffu : ~k);
}

/* The smallest index of each kind of non-finite value, in the status. */
__device__ static inline void epipe_cuda_note_nonfinite(epipe_cuda_status *st, float v,
                                                        unsigned long long i)
{
    atomicMin(v != v ? &st->nan : v > 0 ? &st->pinf : &st->ninf, i);
}

/* Folds values first .. first+7 (those below n) into extent keys. */
__device__ static inline void epipe_cuda_extent_add(const float v[8], uint64_t first, uint64_t n,
                                                    uint32_t &lo, uint32_t &hi,
                                                    epipe_cuda_status *st)
{
    for (unsigned i = 0; i < 8 && first + i < n; i++) {
        if (!epipe_hd_finite(v[i])) {
            epipe_cuda_note_nonfinite(st, v[i], first + i);
            continue;
        }
        uint32_t k = epipe_cuda_key(v[i]);
        lo = k < lo ? k : lo;
        hi = k > hi ? k : hi;
    }
}

/* The block's smallest lo and largest hi, valid in thread 0; every thread
 * of the block must call it. */
__device__ static inline void epipe_cuda_block_minmax(uint32_t &lo, uint32_t &hi)
{
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
    }
    __syncthreads(); /* slo, shi free for the next call */
}

/* ext[0] = smallest, ext[1] = largest key of the finite values of x (set
 * them to 0xffffffff and 0 first); non-finite values go to the status.
 * One atomic pair per block: same-address atomics from every warp cost
 * more than the pass (cuda/quant.cu). */
__global__ void epipe_cuda_extent(const float *x, uint64_t n, int vec, uint32_t *ext,
                                  epipe_cuda_status *st);
/* Its grid for n values. */
static inline unsigned epipe_cuda_extent_blocks(uint64_t n)
{
    return epipe_cuda_blocks((n + 7) / 8, 256 * 16);
}

/* The table as epipe_q_set_chunk() makes it, from the extent keys (an
 * empty extent, lo > hi, makes the empty table); zero=1 moves min so that
 * 0 is a level, as the CPU does (quant, and each chunk of sortquant). */
__device__ static inline void epipe_cuda_table_of(uint32_t lo, uint32_t hi, float levels, int zero,
                                                  float *min, float *step, float *inv)
{
    *min = *step = *inv = 0.0f;
    if (lo <= hi) {
        *min = epipe_cuda_key_float(lo) + 0.0f; /* -0 becomes +0 */
        float max = epipe_cuda_key_float(hi) + 0.0f;
        *step = epipe_hd_q_step(*min, max, levels);
        if (zero)
            *min = epipe_hd_q_zero_min(*min, max, *step, levels);
        *inv = *step > 0.0f ? 1.0f / *step : 0.0f;
    }
}

/* A little-endian fp32 into a body. */
__device__ static inline void epipe_cuda_put_f32(uint8_t *p, float f)
{
    uint32_t u = __float_as_uint(f);
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(u >> (8 * i));
}

/* A little-endian fp32 of a body (tables), on either side. */
__host__ __device__ static inline float epipe_cuda_get_f32(const uint8_t *p)
{
    return epipe_hd_u2f((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
                        (uint32_t)p[3] << 24);
}

__host__ __device__ static inline int epipe_cuda_aligned16(const void *p)
{
    return ((uintptr_t)p & 15u) == 0;
}
#endif

/* The backends, by codec. */
/* Deferred checks (cuda/module.cu): whether sortquant's decode of c can
 * launch before its tables are checked (mode sample and exact: its kernel
 * reads them from the device; fit plans the launch from them), and the
 * host checks quant's and sortquant's decoders make of a body (the
 * mirror), with the CPU's statuses and messages. */
int epipe_cuda_sq_defers(const epipe_codec *c);
int epipe_cuda_quant_check(epipe_codec *c, const uint8_t *body, size_t n);
int epipe_cuda_sq_check(epipe_codec *c, const uint8_t *body, size_t n);

extern const epipe_codec_backend epipe_cuda_none;
extern const epipe_codec_backend epipe_cuda_cast;
extern const epipe_codec_backend epipe_cuda_quant;
extern const epipe_codec_backend epipe_cuda_sortquant;
extern const epipe_codec_backend epipe_cuda_topk;
extern const epipe_codec_backend epipe_cuda_kmeans;
extern const epipe_codec_backend epipe_cuda_poweriter;
extern const epipe_codec_backend epipe_cuda_insert;
/* cuBLAS, opened once on first use (cuda/cublas.cu): 1 when it is there;
 * one strided-batched SGEMM (column-major, alpha 1, beta 0, ta/tb 1 to
 * transpose A/B) on the handle's stream, its error a status naming
 * `doing`; and h->blas destroyed. */
int epipe_cuda_blas_available(void);
int epipe_cuda_gemm(epipe_codec *c, const char *doing, int ta, int tb, int m, int n, int k,
                    const float *a, int lda, long long sa, const float *b, int ldb, long long sb,
                    float *out, int ldc, long long sc, int batch);
void epipe_cuda_blas_release(epipe_cuda_handle *h);
/* cuDNN, opened once on first use (cuda/insert.cu): 1 when it is there;
 * and h->dnn (insert's cuDNN state, device weights and the tensors kept
 * for its backward) released. */
int epipe_cuda_dnn_available(void);
void epipe_cuda_dnn_release(epipe_cuda_handle *h);

#endif
