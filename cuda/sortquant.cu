/* `sortquant` on CUDA. mode=sample: the CPU's sample drawn position by
 * position, the boundaries at the CPU's ranks by a radix select (CUB's sort
 * of the sample for over 256 chunks), per-chunk extents, the
 * table on k threads with the CPU's formulas, then one fused classify +
 * quantize + pack pass. mode=fit: the tensor's extent and the same sample
 * on the GPU, the plan on the host by the CPU's own code (a few hundred
 * KiB cross PCIe, and the stream is waited for once), then the same pack
 * pass. Byte-identical to the CPU by construction. */
#include <cooperative_groups.h>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_radix_sort.cuh>
#include <string.h>

#include "../codecs/inline/quant.h"
#include "../codecs/inline/sortquant.h"
#include "cuda_impl.h"
#include "select.cuh"

namespace cg = cooperative_groups;

/* Device table: bnd[k + 1], then lo/hi keys [k], then min, step, inv [k]. */
struct sq_tab {
    float *bnd, *min, *step, *inv;
    uint32_t *lo, *hi;
};

/* By one block's threads: the ends of bnd, every extent empty, and unless
 * `ends_only` (the select writes them) the inner boundaries, sorted's
 * values at the CPU's ranks (INFINITY without sorted). */
__device__ static void sq_bounds_set(const float *sorted, uint64_t m, unsigned k, int ends_only,
                                     sq_tab t)
{
    for (unsigned j = threadIdx.x; j <= k; j += blockDim.x) {
        if (j == 0 || j == k || !ends_only)
            t.bnd[j] = j == 0              ? -INFINITY
                       : j == k || !sorted ? INFINITY
                                           : sorted[epipe_hd_sq_rank(j, m, k)];
        if (j < k) {
            t.lo[j] = 0xffffffffu;
            t.hi[j] = 0;
        }
    }
}

__global__ void sq_bounds(const float *sorted, uint64_t m, unsigned k, sq_tab t)
{
    sq_bounds_set(sorted, m, k, 0, t);
}

/* mode=sample's boundaries without sorting the sample: the keys of ranks
 * epipe_hd_sq_rank(j, m, k), j = 1 .. k - 1, among the m sample keys, by
 * the whole GPU's radix select (sq_select_many(), select.cuh's kernels).
 * CUB's sort of 65,536 values took five launches and about 55 us of a 144 us
 * encode on an H100 (ncu); a select of one block a rank, 94 us for three
 * ranks on an H200. The keys order floats as CUB's sort does, so each
 * boundary is the value the sort put at that rank. */

/* The select's reach: the sample sizes and chunk counts the one-block-a-
 * rank select took (it read the sample once a rank; past 2^18 values CUB's
 * sort was faster), not yet measured again for this one; each rank's
 * histograms take 12 KiB. */
#define SQ_SEL_MAX_M (1u << 18)
#define SQ_SEL_MAX_K ((unsigned)EPIPE_CUDA_MSEL_MAX)

/* The sample's order: CUB's sort's, -0.0 a key of its own below +0.0. */
struct sq_sel_key {
    __device__ uint32_t operator()(float v) const
    {
        return epipe_cuda_key(v);
    }
};

/* Boundary j + 1's rank in the sample. */
struct sq_sel_rank {
    uint64_t m;
    unsigned k;
    __device__ uint32_t operator()(unsigned j) const
    {
        return (uint32_t)epipe_hd_sq_rank(j + 1, m, k); /* m <= 2^24 */
    }
};

/* The select of many ranks (select.cuh): keys[j] = the key of rank
 * rank_of(j) (from 0, ascending; non-decreasing in j, each below m) among
 * key(smp[i]), i < m < 2^32 (the counts are 32-bit), for j < count <=
 * EPIPE_CUDA_MSEL_MAX: enqueued on s, seven launches; scratch holds
 * epipe_cuda_select_many_bytes(count). The launches' error, if any. */
template <class Key, class Rank>
static cudaError_t sq_select_many(const float *smp, uint64_t m, unsigned count, Rank rank_of,
                                  Key key, void *scratch, uint32_t *keys, cudaStream_t s)
{
    uint32_t *h0 = (uint32_t *)scratch, *h1 = h0 + EPIPE_CUDA_SEL_BINS,
             *h2 = h1 + (size_t)count * 2048, *pa = h2 + (size_t)count * 1024, *ra = pa + count,
             *pb = ra + count, *rb = pb + count;
    cudaError_t e = cudaMemsetAsync(scratch, 0, (size_t)(pa - h0) * sizeof(uint32_t), s);
    if (e != cudaSuccess)
        return e;
    uint64_t want = (m + EPIPE_CUDA_MSEL_THREADS - 1) / EPIPE_CUDA_MSEL_THREADS;
    const unsigned blocks = want < 1 ? 1u : want > 1024 ? 1024u : (unsigned)want;
    /* pass 0 writes a, pass 1 reads a and writes b, pass 2 reads b */
    uint32_t *hist[3] = {h0, h1, h2}, *pin[3] = {NULL, pa, pb}, *rin[3] = {NULL, ra, rb},
             *pout[3] = {pa, pb, keys}, *rout[3] = {ra, rb, ra};
    for (int pass = 0; pass < 3; pass++) {
        epipe_cuda_msel_hist<Key><<<blocks, EPIPE_CUDA_MSEL_THREADS, 0, s>>>(
            smp, m, count, pin[pass], pass, hist[pass], key);
        epipe_cuda_msel_find<Rank><<<count, EPIPE_CUDA_SEL_THREADS, 0, s>>>(
            pass, rank_of, pin[pass], rin[pass], hist[pass], pout[pass], rout[pass]);
    }
    return cudaGetLastError();
}

/* The boundaries from the selected keys, the ends, every extent empty. */
__global__ void sq_select_done(const uint32_t *keys, unsigned k, sq_tab t)
{
    sq_bounds_set(NULL, 0, k, 1, t);
    for (unsigned j = threadIdx.x + 1; j < k; j += blockDim.x)
        t.bnd[j] = epipe_cuda_key_float(keys[j - 1]);
}

__global__ void sq_extent(const float *x, uint64_t n, unsigned k, sq_tab t, epipe_cuda_status *st)
{
    extern __shared__ uint32_t sh[]; /* bnd [k+1] as floats, lo [k], hi [k] */
    float *bnd = (float *)sh;
    uint32_t *lo = sh + k + 1, *hi = lo + k;
    for (unsigned j = threadIdx.x; j <= k; j += blockDim.x) {
        bnd[j] = t.bnd[j];
        if (j < k) {
            lo[j] = 0xffffffffu;
            hi[j] = 0;
        }
    }
    __syncthreads();
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)gridDim.x * blockDim.x) {
        float v = x[i];
        if (!epipe_hd_finite(v)) {
            epipe_cuda_note_nonfinite(st, v, i);
            continue;
        }
        unsigned c = epipe_hd_q_chunk(bnd, k, v);
        uint32_t key = epipe_cuda_key(v);
        atomicMin(&lo[c], key);
        atomicMax(&hi[c], key);
    }
    __syncthreads();
    for (unsigned j = threadIdx.x; j < k; j += blockDim.x)
        if (lo[j] <= hi[j]) {
            atomicMin(&t.lo[j], lo[j]);
            atomicMax(&t.hi[j], hi[j]);
        }
}

/* Folds group g's values (those below n) into the K chunk extents lo/hi,
 * kept in registers: the chunk selects by compare, not by index. A
 * non-finite value goes to the status instead. */
template <unsigned K>
__device__ static inline void sq_fold8(const float *v, uint64_t g, uint64_t n, const float *bnd,
                                       uint32_t *lo, uint32_t *hi, epipe_cuda_status *st)
{
    for (unsigned i = 0; i < 8 && g * 8 + i < n; i++) {
        if (!epipe_hd_finite(v[i])) {
            epipe_cuda_note_nonfinite(st, v[i], g * 8 + i);
            continue;
        }
        unsigned ch = epipe_hd_q_chunk(bnd, K, v[i]);
        uint32_t key = epipe_cuda_key(v[i]);
#pragma unroll
        for (unsigned c = 0; c < K; c++)
            if (c == ch) {
                lo[c] = key < lo[c] ? key : lo[c];
                hi[c] = key > hi[c] ? key : hi[c];
            }
    }
}

/* The block's K extents into t.lo/t.hi: one atomic pair a chunk. */
template <unsigned K>
__device__ static inline void sq_extents_out(uint32_t *lo, uint32_t *hi, sq_tab t)
{
#pragma unroll
    for (unsigned c = 0; c < K; c++) {
        epipe_cuda_block_minmax(lo[c], hi[c]);
        if (threadIdx.x == 0 && lo[c] <= hi[c]) {
            atomicMin(&t.lo[c], lo[c]);
            atomicMax(&t.hi[c], hi[c]);
        }
    }
}

/* sq_extent for k <= 16 chunks: each thread keeps the k extents in
 * registers (the chunk selects by compare, not by index), the block
 * reduces them, and only the block's result meets an atomic. With k = 4
 * the shared atomics of sq_extent serialise every value on four words. */
template <unsigned K>
__global__ void sq_extent_k(const float *x, uint64_t n, int vec, sq_tab t, epipe_cuda_status *st)
{
    __shared__ float bnd[K + 1];
    for (unsigned j = threadIdx.x; j <= K; j += blockDim.x)
        bnd[j] = t.bnd[j];
    __syncthreads();
    uint32_t lo[K], hi[K];
#pragma unroll
    for (unsigned q = 0; q < K; q++) {
        lo[q] = 0xffffffffu;
        hi[q] = 0;
    }
    epipe_cuda_each_group8(x, n, vec,
                           [&](float *v, uint64_t g) { sq_fold8<K>(v, g, n, bnd, lo, hi, st); });
    sq_extents_out<K>(lo, hi, t);
}

/* The extent pass for k chunks on stream s. */
static void sq_extent_launch(const float *x, uint64_t n, unsigned k, sq_tab t,
                             epipe_cuda_status *st, cudaStream_t s)
{
    unsigned blocks = epipe_cuda_extent_blocks(n);
    int vec = epipe_cuda_aligned16(x);
    switch (k) {
    case 1: sq_extent_k<1><<<blocks, 256, 0, s>>>(x, n, vec, t, st); return;
    case 2: sq_extent_k<2><<<blocks, 256, 0, s>>>(x, n, vec, t, st); return;
    case 4: sq_extent_k<4><<<blocks, 256, 0, s>>>(x, n, vec, t, st); return;
    case 8: sq_extent_k<8><<<blocks, 256, 0, s>>>(x, n, vec, t, st); return;
    case 16: sq_extent_k<16><<<blocks, 256, 0, s>>>(x, n, vec, t, st); return;
    }
    size_t sh = sizeof(uint32_t) * (3 * (size_t)k + 1);
    sq_extent<<<epipe_cuda_blocks(n, 256 * 8), 256, sh, s>>>(x, n, k, t, st);
}

/* mode=sample for up to 16 chunks in one cooperative launch, once the
 * boundaries are in t: quant's fused encode with chunks. Each block folds
 * the K extents of its own range of groups in registers (as sq_extent_k)
 * into t.lo/t.hi, one atomic pair a chunk and block; the grid meets; every
 * block makes the same table from them (sq_table's formulas; block 0 also
 * writes it to the body) and packs its range back to front, so
 * that its first reads are the ones it made last, most likely still in L2.
 * The extent and pack kernels read the tensor twice from device memory. */
template <unsigned K>
__global__ void __launch_bounds__(256)
    sq_encode_fused(const float *x, uint64_t n, int vec, unsigned q, float levels, int zero,
                    unsigned w, sq_tab t, uint8_t *body, uint64_t cb, epipe_cuda_status *st)
{
    cg::grid_group grid = cg::this_grid();
    __shared__ float bnd[K + 1], mn[K], iv[K];
    for (unsigned j = threadIdx.x; j <= K; j += blockDim.x)
        bnd[j] = t.bnd[j];
    __syncthreads();
    uint64_t groups = (n + 7) / 8;
    uint64_t g0 = groups * blockIdx.x / gridDim.x, g1 = groups * (blockIdx.x + 1) / gridDim.x;
    uint32_t lo[K], hi[K];
#pragma unroll
    for (unsigned c = 0; c < K; c++) {
        lo[c] = 0xffffffffu;
        hi[c] = 0;
    }
    for (uint64_t g = g0 + threadIdx.x; g < g1; g += blockDim.x) {
        float v[8];
        epipe_cuda_load8f(x, n, g, vec, v);
        sq_fold8<K>(v, g, n, bnd, lo, hi, st);
    }
    sq_extents_out<K>(lo, hi, t);
    grid.sync();
    for (unsigned c = threadIdx.x; c < K; c += blockDim.x) {
        float step;
        epipe_cuda_table_of(t.lo[c], t.hi[c], levels, zero, &mn[c], &step, &iv[c]);
        if (blockIdx.x == 0) {
            epipe_cuda_put_f32(body + 8 * c, mn[c]);
            epipe_cuda_put_f32(body + 8 * c + 4, step);
        }
    }
    __syncthreads();
    epipe_cuda_pack_back(x, n, vec, w, body + 8 * K, cb, g0, g1, [=](float v) {
        unsigned ch = epipe_hd_q_chunk(bnd, K, v);
        return ch << q | epipe_hd_q_level(v, mn[ch], iv[ch], levels);
    });
}

/* From this many values on, sample mode with 2 to 16 chunks takes the
 * cooperative launch (quant's threshold; the tests cover both paths). */
#define SQ_FUSED_MIN (1u << 16)

/* sq_encode_fused for k chunks, and the blocks a cooperative launch of it
 * may have on `device` (0: none, or k not 2, 4, 8 or 16), with their cache
 * entry (epipe_cuda_coop_launch()). */
static const void *sq_fused(unsigned k, int device, int *blocks, int **entry)
{
    static int cache[4][64];
    const void *f = k == 2    ? (const void *)sq_encode_fused<2>
                    : k == 4  ? (const void *)sq_encode_fused<4>
                    : k == 8  ? (const void *)sq_encode_fused<8>
                    : k == 16 ? (const void *)sq_encode_fused<16>
                              : NULL;
    *entry = NULL;
    *blocks =
        f ? epipe_cuda_coop_blocks(f, 256, device, cache[31 - __builtin_clz(k) - 1], entry) : 0;
    return f;
}

/* Each chunk's table from its extent (epipe_q_set_from_extent()), into t
 * and the body. */
__global__ void sq_table(unsigned k, float levels, int zero, sq_tab t, uint8_t *body)
{
    for (unsigned j = threadIdx.x; j < k; j += blockDim.x) {
        epipe_cuda_table_of(t.lo[j], t.hi[j], levels, zero, &t.min[j], &t.step[j], &t.inv[j]);
        epipe_cuda_put_f32(body + 8 * j, t.min[j]);
        epipe_cuda_put_f32(body + 8 * j + 4, t.step[j]);
    }
}

/* The 8 codes of group g, packed to w bits each, at their place (the last
 * group only as far as code_bytes). */
__global__ void sq_code_pack(const float *x, uint64_t n, int vec, unsigned k, unsigned q,
                             float levels, unsigned w, sq_tab t, uint8_t *codes,
                             uint64_t code_bytes)
{
    extern __shared__ float tab[]; /* bnd [k+1], min [k], inv [k] */
    float *bnd = tab, *mn = tab + k + 1, *iv = mn + k;
    for (unsigned j = threadIdx.x; j <= k; j += blockDim.x) {
        bnd[j] = t.bnd[j];
        if (j < k) {
            mn[j] = t.min[j];
            iv[j] = t.inv[j];
        }
    }
    __syncthreads();
    epipe_cuda_pack_pass(x, n, vec, w, codes, code_bytes, [=](float v, uint64_t) {
        unsigned ch = epipe_hd_q_chunk(bnd, k, v);
        return ch << q | epipe_hd_q_level(v, mn[ch], iv[ch], levels);
    });
}

__global__ void sq_decode(const uint8_t *codes, uint64_t n, unsigned k, unsigned q, unsigned w,
                          const uint8_t *table, int vec, float *y)
{
    extern __shared__ float tab[]; /* min [k], step [k] */
    for (unsigned j = threadIdx.x; j < k; j += blockDim.x) {
        const uint8_t *p = table + 8 * j;
        tab[j] = epipe_cuda_get_f32(p);
        tab[k + j] = epipe_cuda_get_f32(p + 4);
    }
    __syncthreads();
    uint64_t groups = (n + 7) / 8, bytes = (n * w + 7) / 8;
    uint32_t mask = (1u << q) - 1u;
    for (uint64_t g = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; g < groups;
         g += (uint64_t)gridDim.x * blockDim.x) {
        uint32_t c[8];
        float v[8];
        epipe_cuda_load_codes(codes, bytes, w, g, c);
        for (unsigned i = 0; i < 8; i++) {
            unsigned ch = c[i] >> q; /* < k: a code has bits = q + split bits */
            v[i] = epipe_hd_q_value(tab[ch], tab[k + ch], c[i] & mask);
        }
        epipe_cuda_store8f(y, n, g, vec, v);
    }
}

/* The tensor's extent as order keys: ext[0] the smallest, ext[1] the
 * largest finite value (ext[0] > ext[1]: none); non-finite values go to the
 * deferred status word. */
__global__ void sq_minmax_init(uint32_t *ext)
{
    ext[0] = 0xffffffffu;
    ext[1] = 0;
}

/* mode=fit: body is host memory of sq_body_size() bytes. */
static int sq_encode_fit(epipe_codec *c, const float *x, size_t n, uint8_t *body)
{
    epipe_cuda_qtab t;
    if (!n) {
        int rc = epipe_cuda_core_fns->sq_fit_encode(c, NULL, 0, 0, 0.0f, 0.0f, body, &t);
        return rc ? rc : epipe_cuda_body_push(c, body, 0, epipe_cuda_h(c)->body_len);
    }
    unsigned bits = (unsigned)c->p[SQ_BITS];
    uint64_t m = n < (uint64_t)c->p[SQ_SAMPLE] ? n : (uint64_t)c->p[SQ_SAMPLE];
    uint64_t cb = (n * bits + 7) / 8;
    cudaStream_t s = epipe_cuda_stream(c);
    epipe_cuda_handle *h = epipe_cuda_h(c);
    void *d, *tw, *sw, *hw;
    size_t tab_bytes = sizeof(float) * (3 * 16 + 1), ext_at = (tab_bytes + 15) & ~(size_t)15;
    int rc;
    if ((rc = epipe_cuda_grow(c, &h->work[0], ext_at + 2 * sizeof(uint32_t), &tw)) ||
        (rc = epipe_cuda_grow(c, &h->work[1], m * sizeof(float), &sw)) ||
        (rc = epipe_cuda_host(c, 2 * sizeof(uint32_t) + m * sizeof(float), &hw)))
        return rc;
    uint32_t *ext = (uint32_t *)((char *)tw + ext_at), *hext = (uint32_t *)hw;
    float *smp = (float *)sw, *hsmp = (float *)(hext + 2);
    sq_minmax_init<<<1, 1, 0, s>>>(ext);
    epipe_cuda_extent<<<epipe_cuda_extent_blocks(n), 256, 0, s>>>(x, n, epipe_cuda_aligned16(x),
                                                                  ext, h->status);
    if (m < n)
        epipe_cuda_sample<<<epipe_cuda_blocks(m, 256), 256, 0, s>>>(x, n, m, smp);
    if ((rc = epipe_cuda_check(c, cudaGetLastError(), "launching the extent kernels")) ||
        (rc = epipe_cuda_check(
             c, cudaMemcpyAsync(hext, ext, 2 * sizeof(uint32_t), cudaMemcpyDeviceToHost, s),
             "copying the extent to the host")) ||
        (rc = epipe_cuda_check(
             c,
             cudaMemcpyAsync(hsmp, m < n ? smp : x, m * sizeof(float), cudaMemcpyDeviceToHost, s),
             "copying the sample to the host")) ||
        (rc = epipe_cuda_check(c, cudaStreamSynchronize(s), "waiting for the sample")))
        return rc;
    /* No finite value: the deferred status reports the first non-finite
     * one at synchronisation; the plan only needs finite ends meanwhile. */
    float lo = hext[0] <= hext[1] ? epipe_cuda_key_float(hext[0]) : 0.0f;
    float hi = hext[0] <= hext[1] ? epipe_cuda_key_float(hext[1]) : 0.0f;
    if ((rc = epipe_cuda_core_fns->sq_fit_encode(c, hsmp, m, n, lo, hi, body, &t)))
        return rc;
    /* The host wrote the fit word, the table and the padding after the
     * codes; the kernel writes the codes between them. */
    size_t codes_at = 4 + 8ull * t.k;
    if ((rc = epipe_cuda_body_out(c, codes_at, cb, &d)) ||
        (rc = epipe_cuda_body_push(c, body, 0, codes_at)) ||
        (rc = epipe_cuda_body_push(c, body, codes_at + cb, h->body_len - codes_at - cb)))
        return rc;
    sq_tab dt;
    dt.bnd = (float *)tw;
    dt.min = dt.bnd + t.k + 1;
    dt.inv = dt.min + t.k;
    dt.step = NULL;
    dt.lo = dt.hi = NULL;
    /* From pageable memory: each copy has read t's arrays when it returns. */
    if ((rc = epipe_cuda_check(
             c,
             cudaMemcpyAsync(dt.bnd, t.bnd, sizeof(float) * (t.k + 1), cudaMemcpyHostToDevice, s),
             "copying the table to the device")) ||
        (rc = epipe_cuda_check(
             c, cudaMemcpyAsync(dt.min, t.min, sizeof(float) * t.k, cudaMemcpyHostToDevice, s),
             "copying the table to the device")) ||
        (rc = epipe_cuda_check(
             c, cudaMemcpyAsync(dt.inv, t.inv, sizeof(float) * t.k, cudaMemcpyHostToDevice, s),
             "copying the table to the device")))
        return rc;
    sq_code_pack<<<epipe_cuda_blocks((n + 7) / 8, 256 * 4), 256,
                   sizeof(float) * (3 * (size_t)t.k + 1), s>>>(
        x, n, epipe_cuda_aligned16(x), t.k, t.q, t.levels, bits, dt, (uint8_t *)d, cb);
    if ((rc = epipe_cuda_check(c, cudaGetLastError(), "launching the sortquant pack kernel")))
        return rc;
    return epipe_cuda_body_flush(c, body, codes_at, d, cb);
}

static int sq_decode_fit(epipe_codec *c, const uint8_t *body, size_t n, float *y)
{
    epipe_cuda_qtab t;
    int rc = epipe_cuda_core_fns->sq_fit_decode(c, body, n, &t);
    if (rc || !n)
        return rc;
    unsigned bits = (unsigned)c->p[SQ_BITS];
    uint64_t cb = (n * bits + 7) / 8, tb = 8ull * t.k;
    cudaStream_t s = epipe_cuda_stream(c);
    const void *d;
    if ((rc = epipe_cuda_body_in(c, body, 4, tb + cb, &d)))
        return rc;
    sq_decode<<<epipe_cuda_blocks((n + 7) / 8, 256), 256, sizeof(float) * 2 * (size_t)t.k, s>>>(
        (const uint8_t *)d + tb, n, t.k, t.q, bits, (const uint8_t *)d, epipe_cuda_aligned16(y), y);
    return epipe_cuda_check(c, cudaGetLastError(), "launching the sortquant decode kernel");
}

/* ---- mode=exact: a stable radix sort of (key, index) pairs ---------------- */

/* x + 0: both zeros one key, so that equal values keep index order as the
 * CPU's ties by index do (tests/test_inline.c writes this out). */
__global__ void sqx_keys(const float *x, uint64_t n, uint32_t *key, uint32_t *idx,
                         epipe_cuda_status *st)
{
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)gridDim.x * blockDim.x) {
        float v = x[i];
        if (!epipe_hd_finite(v))
            epipe_cuda_note_nonfinite(st, v, i);
        key[i] = epipe_cuda_key(v + 0.0f);
        idx[i] = (uint32_t)i;
    }
}

/* The chunk of every value, by its sorted position (epipe_hd_sq_chunk_at
 * over ranks kept in shared memory). */
__global__ void sqx_chunks(const uint32_t *idx, uint64_t n, unsigned k, uint16_t *chunk)
{
    extern __shared__ uint64_t rank[]; /* [k + 1] */
    for (unsigned j = threadIdx.x; j <= k; j += blockDim.x)
        rank[j] = epipe_hd_sq_rank(j, n, k);
    __syncthreads();
    for (uint64_t p = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; p < n;
         p += (uint64_t)gridDim.x * blockDim.x) {
        unsigned lo = 0, hi = k - 1;
        while (lo < hi) {
            unsigned mid = lo + (hi - lo + 1) / 2;
            if (rank[mid] <= p)
                lo = mid;
            else
                hi = mid - 1;
        }
        chunk[idx[p]] = (uint16_t)lo;
    }
}

/* Chunk j spans sorted positions [rank(j), rank(j + 1)): its extent is
 * their first and last key. */
__global__ void sqx_extent(const uint32_t *key, uint64_t n, unsigned k, sq_tab t)
{
    for (unsigned j = threadIdx.x; j < k; j += blockDim.x) {
        uint64_t a = epipe_hd_sq_rank(j, n, k), b = epipe_hd_sq_rank(j + 1, n, k);
        t.lo[j] = a < b ? key[a] : 0xffffffffu;
        t.hi[j] = a < b ? key[b - 1] : 0;
    }
}

__global__ void sqx_pack(const float *x, const uint16_t *chunk, uint64_t n, int vec, unsigned k,
                         unsigned q, float levels, unsigned w, sq_tab t, uint8_t *codes,
                         uint64_t code_bytes)
{
    extern __shared__ float tab[]; /* min [k], inv [k] */
    float *mn = tab, *iv = tab + k;
    for (unsigned j = threadIdx.x; j < k; j += blockDim.x) {
        mn[j] = t.min[j];
        iv[j] = t.inv[j];
    }
    __syncthreads();
    epipe_cuda_pack_pass(x, n, vec, w, codes, code_bytes, [=](float v, uint64_t j) {
        unsigned ch = chunk[j];
        return ch << q | epipe_hd_q_level(v, mn[ch], iv[ch], levels);
    });
}

static int sq_encode_exact(epipe_codec *c, const float *x, size_t n, uint8_t *body)
{
    if (n > 0xffffffffull)
        return epipe_cuda_fail(c, EPIPE_ENOTSUP,
                               "sortquant: mode=exact on a CUDA tensor takes at most 2^32 - 1 "
                               "values (this one has %zu); use mode=fit or mode=sample",
                               n);
    unsigned bits = (unsigned)c->p[SQ_BITS], split = (unsigned)c->p[SQ_SPLIT];
    unsigned k = 1u << split, q = bits - split;
    float levels = (float)((1u << q) - 1u);
    uint64_t cb = (n * bits + 7) / 8, tb = 8ull * k;
    cudaStream_t s = epipe_cuda_stream(c);
    epipe_cuda_handle *h = epipe_cuda_h(c);
    size_t sort_bytes = 0;
    int rc;
    if (n && (rc = epipe_cuda_check(c,
                                    cub::DeviceRadixSort::SortPairs(
                                        NULL, sort_bytes, (uint32_t *)NULL, (uint32_t *)NULL,
                                        (uint32_t *)NULL, (uint32_t *)NULL, (int64_t)n),
                                    "sizing the sort")))
        return rc;
    size_t arrays = (16 * (size_t)n + 255) & ~(size_t)255;
    size_t tab_bytes = sizeof(float) * (4 * (size_t)k + 1) + sizeof(uint32_t) * 2 * k;
    void *d, *tw, *sw, *cw;
    if ((rc = epipe_cuda_body_out(c, 0, tb + cb, &d)) ||
        (rc = epipe_cuda_grow(c, &h->work[0], tab_bytes, &tw)) ||
        (rc = epipe_cuda_grow(c, &h->work[1], arrays + sort_bytes + 256, &sw)) ||
        (rc = epipe_cuda_grow(c, &h->work[2], 2 * (size_t)n + 16, &cw)))
        return rc;
    sq_tab t;
    t.bnd = (float *)tw;
    t.min = t.bnd + k + 1;
    t.step = t.min + k;
    t.inv = t.step + k;
    t.lo = (uint32_t *)(t.inv + k);
    t.hi = t.lo + k;
    unsigned tpb = k < 1024 ? (k < 32 ? 32 : k) : 1024;
    if (!n) {
        sq_bounds<<<1, tpb, 0, s>>>(NULL, 0, k, t); /* every chunk empty */
    } else {
        uint32_t *key = (uint32_t *)sw, *idx = key + n, *skey = idx + n, *sidx = skey + n;
        sqx_keys<<<epipe_cuda_blocks(n, 256), 256, 0, s>>>(x, n, key, idx, h->status);
        if ((rc = epipe_cuda_check(c,
                                   cub::DeviceRadixSort::SortPairs((char *)sw + arrays, sort_bytes,
                                                                   key, skey, idx, sidx, (int64_t)n,
                                                                   0, 32, s),
                                   "sorting the values")))
            return rc;
        sqx_chunks<<<epipe_cuda_blocks(n, 256), 256, sizeof(uint64_t) * (k + 1), s>>>(
            sidx, n, k, (uint16_t *)cw);
        sqx_extent<<<1, tpb, 0, s>>>(skey, n, k, t);
    }
    sq_table<<<1, tpb, 0, s>>>(k, levels, c->p[SQ_ZERO] != 0, t, (uint8_t *)d);
    if (n)
        sqx_pack<<<epipe_cuda_blocks((n + 7) / 8, 256), 256, sizeof(float) * 2 * (size_t)k, s>>>(
            x, (const uint16_t *)cw, n, epipe_cuda_aligned16(x), k, q, levels, bits, t,
            (uint8_t *)d + tb, cb);
    if ((rc = epipe_cuda_check(c, cudaGetLastError(), "launching the sortquant kernels")))
        return rc;
    return epipe_cuda_body_flush(c, body, 0, d, tb + cb);
}

static int sq_encode(epipe_codec *c, const float *x, size_t n, uint8_t *body)
{
    int rc;
    if ((int)c->p[SQ_MODE] == SQ_MODE_FIT)
        return sq_encode_fit(c, x, n, body);
    if ((int)c->p[SQ_MODE] == SQ_MODE_EXACT)
        return sq_encode_exact(c, x, n, body);
    unsigned bits = (unsigned)c->p[SQ_BITS], split = (unsigned)c->p[SQ_SPLIT];
    unsigned k = 1u << split, q = bits - split;
    float levels = (float)((1u << q) - 1u);
    uint64_t m = n < (uint64_t)c->p[SQ_SAMPLE] ? n : (uint64_t)c->p[SQ_SAMPLE];
    uint64_t cb = (n * bits + 7) / 8, tb = 8ull * k;
    cudaStream_t s = epipe_cuda_stream(c);
    epipe_cuda_handle *h = epipe_cuda_h(c);
    void *d, *tw, *sw;
    size_t sort_bytes = 0;
    /* k = 1 needs no boundary (sq_bounds); else the select, or CUB's sort */
    int select = k >= 2 && k <= SQ_SEL_MAX_K && m <= SQ_SEL_MAX_M;
    int sort = k >= 2 && !select;
    if (m && sort &&
        (rc = epipe_cuda_check(c,
                               cub::DeviceRadixSort::SortKeys(NULL, sort_bytes, (float *)NULL,
                                                              (float *)NULL, (int64_t)m),
                               "sizing the sample sort")))
        return rc;
    size_t tab_bytes = sizeof(float) * (4 * (size_t)k + 1) + sizeof(uint32_t) * 2 * k;
    if ((rc = epipe_cuda_body_out(c, 0, tb + cb, &d)) ||
        (rc = epipe_cuda_grow(c, &h->work[0], tab_bytes, &tw)) ||
        (rc = epipe_cuda_grow(c, &h->work[1],
                              2 * m * sizeof(float) + 256 + sort_bytes +
                                  (select ? epipe_cuda_select_many_bytes(k - 1) + 4 * k : 0),
                              &sw)))
        return rc;
    sq_tab t;
    t.bnd = (float *)tw;
    t.min = t.bnd + k + 1;
    t.step = t.min + k;
    t.inv = t.step + k;
    t.lo = (uint32_t *)(t.inv + k);
    t.hi = t.lo + k;
    unsigned tpb = k < 1024 ? (k < 32 ? 32 : k) : 1024;
    /* split = 12: the tables take 3 * 4096 + 1 words, past the 48 KiB a
     * kernel gets without asking. */
    int shared = (int)(sizeof(float) * (3 * (size_t)k + 1));
    if (shared > 48 * 1024 &&
        ((rc = epipe_cuda_check(
              c,
              cudaFuncSetAttribute(sq_extent, cudaFuncAttributeMaxDynamicSharedMemorySize, shared),
              "raising the shared memory limit")) ||
         (rc = epipe_cuda_check(c,
                                cudaFuncSetAttribute(sq_code_pack,
                                                     cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                     shared),
                                "raising the shared memory limit"))))
        return rc;
    if (!n) {
        sq_bounds<<<1, tpb, 0, s>>>(NULL, 0, k, t); /* no sample: every chunk empty */
    } else {
        float *smp = (float *)sw, *sorted = smp + m;
        void *tmp = (char *)sw + ((2 * m * sizeof(float) + 255) & ~(size_t)255);
        if (k >= 2)
            epipe_cuda_sample<<<epipe_cuda_blocks(m, 256), 256, 0, s>>>(x, n, m, smp);
        if (select) {
            uint32_t *keys = (uint32_t *)tmp;
            if ((rc = epipe_cuda_check(c,
                                       sq_select_many(smp, m, k - 1, sq_sel_rank{m, k},
                                                      sq_sel_key(), keys + k, keys, s),
                                       "launching the sample's select")))
                return rc;
            sq_select_done<<<1, tpb, 0, s>>>(keys, k, t);
            int blocks, *coop;
            const void *fused = sq_fused(k, h->device, &blocks, &coop);
            if (n >= SQ_FUSED_MIN && blocks > 0) {
                int vec = epipe_cuda_aligned16(x), zero = c->p[SQ_ZERO] != 0;
                uint8_t *b = (uint8_t *)d;
                epipe_cuda_status *st = h->status;
                void *args[] = {(void *)&x,    (void *)&n,  (void *)&vec, (void *)&q,
                                (void *)&levels, (void *)&zero, (void *)&bits, (void *)&t,
                                (void *)&b,    (void *)&cb, (void *)&st};
                if ((rc = epipe_cuda_check(c, cudaGetLastError(),
                                           "launching the sortquant kernels")))
                    return rc;
                rc = epipe_cuda_coop_launch(c, fused, (unsigned)blocks, 256, args, s, coop,
                                            "launching the sortquant kernel");
                if (rc)
                    return rc < 0 ? rc : epipe_cuda_body_flush(c, body, 0, d, tb + cb);
            } /* else, or refused: the extents, then the code and pack passes */
        } else if (sort) {
            if ((rc = epipe_cuda_check(c,
                                       cub::DeviceRadixSort::SortKeys(tmp, sort_bytes, smp, sorted,
                                                                      (int64_t)m, 0, 32, s),
                                       "sorting the sample")))
                return rc;
            sq_bounds<<<1, tpb, 0, s>>>(sorted, m, k, t);
        } else {
            sq_bounds<<<1, tpb, 0, s>>>(NULL, 0, k, t); /* one chunk: only the ends */
        }
        sq_extent_launch(x, n, k, t, h->status, s);
    }
    sq_table<<<1, tpb, 0, s>>>(k, levels, c->p[SQ_ZERO] != 0, t, (uint8_t *)d);
    if (n)
        sq_code_pack<<<epipe_cuda_blocks((n + 7) / 8, 256 * 4), 256,
                       sizeof(float) * (3 * (size_t)k + 1), s>>>(
            x, n, epipe_cuda_aligned16(x), k, q, levels, bits, t, (uint8_t *)d + tb, cb);
    if ((rc = epipe_cuda_check(c, cudaGetLastError(), "launching the sortquant kernels")))
        return rc;
    return epipe_cuda_body_flush(c, body, 0, d, tb + cb);
}

int epipe_cuda_sq_defers(const epipe_codec *c)
{
    return (int)c->p[SQ_MODE] != SQ_MODE_FIT;
}

/* An exact or sample body's table and padding bits (host memory): the
 * CPU's checks and messages. */
int epipe_cuda_sq_check(epipe_codec *c, const uint8_t *body, size_t n)
{
    unsigned bits = (unsigned)c->p[SQ_BITS], split = (unsigned)c->p[SQ_SPLIT];
    unsigned k = 1u << split, q = bits - split;
    float levels = (float)((1u << q) - 1u);
    const char *name = c->ops->name;
    for (unsigned j = 0; j < k; j++) { /* the CPU's checks and messages */
        float min = epipe_cuda_get_f32(body + 8 * j), step = epipe_cuda_get_f32(body + 8 * j + 4);
        switch (epipe_hd_q_pair_check(min, step, levels)) {
        case 1:
            return epipe_cuda_fail(c, EPIPE_EPROTO,
                                   "%s: chunk %u of %u has min %g; it must be finite", name, j, k,
                                   (double)min);
        case 2:
            return epipe_cuda_fail(c, EPIPE_EPROTO,
                                   "%s: chunk %u of %u has step %g; it must be finite and >= 0",
                                   name, j, k, (double)step);
        case 3:
            return epipe_cuda_fail(
                c, EPIPE_EPROTO,
                "%s: chunk %u of %u (min %g, step %g) decodes past the float range", name, j, k,
                (double)min, (double)step);
        }
    }
    uint64_t cb = (n * bits + 7) / 8, tb = 8ull * k;
    unsigned used = (unsigned)(n * bits % 8);
    if (used && (body[tb + cb - 1] >> used))
        return epipe_cuda_fail(c, EPIPE_EPROTO, "%s: padding bits after the last code are not zero",
                               name);
    return EPIPE_OK;
}

/* Checked at once, unless the module defers the checks (a device payload
 * of mode sample or exact): the kernel reads the table on the device. */
static int sq_decode_cuda(epipe_codec *c, const uint8_t *body, size_t n, float *y)
{
    int rc;
    if ((int)c->p[SQ_MODE] == SQ_MODE_FIT)
        return sq_decode_fit(c, body, n, y);
    /* exact and sample bodies are one format: a table, then the codes */
    unsigned bits = (unsigned)c->p[SQ_BITS], split = (unsigned)c->p[SQ_SPLIT];
    unsigned k = 1u << split, q = bits - split;
    if (!epipe_cuda_h(c)->defer_checks && (rc = epipe_cuda_sq_check(c, body, n)))
        return rc;
    uint64_t cb = (n * bits + 7) / 8, tb = 8ull * k;
    if (!n)
        return EPIPE_OK;
    cudaStream_t s = epipe_cuda_stream(c);
    const void *d;
    if ((rc = epipe_cuda_body_in(c, body, 0, tb + cb, &d)))
        return rc;
    sq_decode<<<epipe_cuda_blocks((n + 7) / 8, 256), 256, sizeof(float) * 2 * (size_t)k, s>>>(
        (const uint8_t *)d + tb, n, k, q, bits, (const uint8_t *)d, epipe_cuda_aligned16(y), y);
    return epipe_cuda_check(c, cudaGetLastError(), "launching the sortquant decode kernel");
}

const epipe_codec_backend epipe_cuda_sortquant = {sq_encode, sq_decode_cuda, NULL, NULL, 0, NULL};
