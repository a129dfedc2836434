/* `kmeans` on CUDA. The codebook is the CPU encoder's, fitted on the host
 * by the core's own code (codecs/kmeans.c) from what the device gathers:
 * all values up to the sampling threshold; above it, the extent, the sample
 * at the CPU's positions and the tails (the values beyond the sample's
 * 64th from either end, selected in index order). The codes are then one
 * pass on the device with the CPU's search (codecs/inline/kmeans.h), so
 * the payload is the CPU's byte for byte. The encode waits for its stream
 * (once below the threshold, twice above), and refuses a value that is not
 * finite at once, as the CPU does. Decode: the centroids checked on the
 * host with the CPU's messages, then one table-lookup pass. */
#include <stdio.h>

#include <cub/cub.cuh>

#include "../codecs/inline/kmeans.h"
#include "cuda_impl.h"

/* kmeans's first parameter is bits (codecs/kmeans.c). */
static unsigned km_width(const epipe_codec *c)
{
    return (unsigned)c->p[0];
}

/* The extent as the CPU's epipe_km_extent() gives it: min and max with -0
 * and +0 one key (the key of v + 0.0f), and the first zero's index and sign
 * (index << 1 | sign bit), because an extreme that is 0 is the first zero
 * the CPU met. */
struct km_ext {
    uint32_t lo, hi;
    unsigned long long zero;
};

__global__ void km_ext_init(km_ext *e)
{
    e->lo = 0xffffffffu;
    e->hi = 0;
    e->zero = ~0ull;
}

__global__ void km_extent(const float *x, uint64_t n, int vec, km_ext *e, epipe_cuda_status *st)
{
    uint32_t lo = 0xffffffffu, hi = 0;
    unsigned long long zero = ~0ull;
    epipe_cuda_each_group8(x, n, vec, [&](float *v, uint64_t g) {
        for (unsigned i = 0; i < 8 && g * 8 + i < n; i++) {
            unsigned long long at = g * 8 + i;
            if (v[i] == 0.0f && (at << 1) < zero)
                zero = at << 1 | (epipe_hd_f2u(v[i]) >> 31);
            v[i] += 0.0f; /* -0 and +0: one key */
        }
        epipe_cuda_extent_add(v, g * 8, n, lo, hi, st);
    });
    for (int o = 16; o; o >>= 1) {
        unsigned long long z = __shfl_down_sync(0xffffffffu, zero, o);
        zero = z < zero ? z : zero;
    }
    if ((threadIdx.x & 31) == 0 && zero != ~0ull)
        atomicMin(&e->zero, zero);
    epipe_cuda_block_minmax(lo, hi);
    if (threadIdx.x == 0 && lo <= hi) {
        atomicMin(&e->lo, lo);
        atomicMax(&e->hi, hi);
    }
}

/* The sample, at the CPU's positions. */
__global__ void km_gather(const float *x, uint64_t n, uint64_t m, float *s)
{
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < m;
         i += (uint64_t)gridDim.x * blockDim.x)
        s[i] = x[epipe_hd_km_sample_at(i, n, m)];
}

/* The tails: the values below a or above b. */
struct km_is_tail {
    float a, b;
    __device__ bool operator()(const float &v) const
    {
        return v < a || v > b;
    }
};

/* Eight codes a thread, each the CPU's: the count of midpoints below the
 * value (the midpoints in shared memory). */
__global__ void km_pack(const float *x, uint64_t n, int vec, const double *mid_g, unsigned k,
                        unsigned w, uint8_t *codes, uint64_t cb)
{
    extern __shared__ double mid[];
    for (unsigned i = threadIdx.x; i < k; i += blockDim.x)
        mid[i] = mid_g[i];
    __syncthreads();
    epipe_cuda_pack_pass(x, n, vec, w, codes, cb,
                         [=](float v, uint64_t) { return epipe_hd_km_code(mid, k, v); });
}

__global__ void km_decode(const uint8_t *codes, uint64_t n, unsigned w, const float *cent_g,
                          unsigned k, int vec, float *y)
{
    extern __shared__ float cent[];
    for (unsigned i = threadIdx.x; i < k; i += blockDim.x)
        cent[i] = cent_g[i];
    __syncthreads();
    epipe_cuda_unpack_pass(codes, n, w, vec, y,
                           [=](uint32_t c) { return cent[c]; }); /* w-bit codes: below k */
}

/* A value that is not finite, from the status word read with the sample:
 * refused now, as the CPU refuses it, and the word cleared. */
static int refuse_nonfinite(epipe_codec *c, const epipe_cuda_status *st)
{
    static const char *const names[] = {"nan", "inf", "-inf"}; /* the CPU's %g */
    unsigned long long first;
    int kind, rc = epipe_cuda_take_nonfinite(c, st, &first, &kind);
    if (rc <= 0)
        return rc;
    return epipe_cuda_fail(c, EPIPE_EINVAL, "kmeans: value at index %llu is not finite (%s)", first,
                           names[kind]);
}

/* Above the sampling threshold: the extent, the sample and the tails from
 * the device, the fit on the host. */
static int fit_sampled(epipe_codec *c, const float *x, size_t n, size_t m, uint8_t *body,
                       double *mid, float *hs)
{
    const epipe_cuda_core *core = epipe_cuda_core_fns;
    epipe_cuda_handle *h = epipe_cuda_h(c);
    cudaStream_t s = epipe_cuda_stream(c);
    void *w0, *w1, *w2;
    size_t cub_bytes = 0;
    int rc;
    km_is_tail pick = {0.0f, 0.0f};
    if ((rc = epipe_cuda_check(c,
                               cub::DeviceSelect::If(NULL, cub_bytes, x, (float *)NULL,
                                                     (unsigned long long *)NULL, n, pick, s),
                               "sizing the tail selection")) ||
        (rc = epipe_cuda_grow(c, &h->work[0], sizeof(km_ext) + 16, &w0)) ||
        (rc = epipe_cuda_grow(c, &h->work[1], m * sizeof(float) > cub_bytes ? m * sizeof(float)
                                                                             : cub_bytes,
                              &w1)) ||
        (rc = epipe_cuda_grow(c, &h->work[2], n * sizeof(float), &w2)))
        return rc;
    km_ext *ext = (km_ext *)w0;
    unsigned long long *count = (unsigned long long *)((char *)w0 + sizeof(km_ext));
    km_ext_init<<<1, 1, 0, s>>>(ext);
    km_extent<<<epipe_cuda_extent_blocks(n), 256, 0, s>>>(x, n, epipe_cuda_aligned16(x), ext,
                                                         h->status);
    km_gather<<<epipe_cuda_blocks(m, 256), 256, 0, s>>>(x, n, m, (float *)w1);
    km_ext he;
    if ((rc = epipe_cuda_check(c, cudaGetLastError(), "launching the kmeans extent kernels")) ||
        (rc = epipe_cuda_check(
             c, cudaMemcpyAsync(hs, w1, m * sizeof(float), cudaMemcpyDeviceToHost, s),
             "copying the sample to the host")) ||
        (rc = epipe_cuda_check(
             c, cudaMemcpyAsync(&he, ext, sizeof he, cudaMemcpyDeviceToHost, s),
             "copying the extent to the host")) ||
        (rc = epipe_cuda_check(c,
                               cudaMemcpyAsync(h->status_host, h->status, sizeof *h->status,
                                               cudaMemcpyDeviceToHost, s),
                               "reading the status word")) ||
        (rc = epipe_cuda_check(c, cudaStreamSynchronize(s), "waiting for the sample")) ||
        (rc = refuse_nonfinite(c, h->status_host)))
        return rc;
    float lo = epipe_cuda_key_float(he.lo) + 0.0f, hi = epipe_cuda_key_float(he.hi) + 0.0f;
    float zero = he.zero & 1 ? -0.0f : 0.0f;
    lo = lo == 0.0f ? zero : lo;
    hi = hi == 0.0f ? zero : hi;
    core->km_sample_finish(hs, m, lo, hi, &pick.a, &pick.b);
    unsigned long long t = 0;
    if ((rc = epipe_cuda_check(c,
                               cub::DeviceSelect::If(w1, cub_bytes, x, (float *)w2, count, n, pick,
                                                     s),
                               "selecting the tails")) ||
        (rc = epipe_cuda_check(c, cudaMemcpyAsync(&t, count, sizeof t, cudaMemcpyDeviceToHost, s),
                               "copying the tail count")) ||
        (rc = epipe_cuda_check(c, cudaStreamSynchronize(s), "waiting for the tail count")))
        return rc;
    float *tails = (float *)malloc((t ? t : 1) * sizeof *tails);
    if (!tails)
        return epipe_cuda_fail(c, EPIPE_ENOMEM, "kmeans: no host memory for %llu tail values", t);
    /* on the codec's stream: a plain cudaMemcpy would go on the legacy
     * default stream and wait for the work of every blocking stream (a
     * host's whole compute queue) */
    if ((rc = epipe_cuda_check(c,
                               cudaMemcpyAsync(tails, w2, t * sizeof *tails,
                                               cudaMemcpyDeviceToHost, s),
                               "copying the tails to the host")) == EPIPE_OK &&
        (rc = epipe_cuda_check(c, cudaStreamSynchronize(s), "waiting for the tails")) == EPIPE_OK)
        rc = core->km_fit(c, NULL, n, lo, hi, hs, m, tails, (size_t)t, body, mid);
    free(tails);
    return rc;
}

static int kmeans_encode(epipe_codec *c, const float *x, size_t n, uint8_t *body)
{
    const epipe_cuda_core *core = epipe_cuda_core_fns;
    unsigned w = km_width(c), k = 1u << w;
    uint64_t cb = (n * (uint64_t)w + 7) / 8, tab = 4ull * k;
    size_t m = core->km_sample_size(c, n);
    epipe_cuda_handle *h = epipe_cuda_h(c);
    cudaStream_t s = epipe_cuda_stream(c);
    void *hw;
    int rc = epipe_cuda_host(c, k * sizeof(double) + m * sizeof(float), &hw);
    if (rc)
        return rc;
    double *mid = (double *)hw;
    float *hs = (float *)(mid + k);
    if (m == n) { /* all values to the host: the CPU's fit as it is */
        if ((rc = epipe_cuda_check(
                 c, cudaMemcpyAsync(hs, x, n * sizeof(float), cudaMemcpyDeviceToHost, s),
                 "copying the values to the host")) ||
            (rc = epipe_cuda_check(c, cudaStreamSynchronize(s), "waiting for the values")) ||
            (rc = core->km_fit(c, hs, n, 0.0f, 0.0f, NULL, 0, NULL, 0, body, mid)))
            return rc;
    } else if ((rc = fit_sampled(c, x, n, m, body, mid, hs))) {
        return rc;
    }
    /* The host wrote the centroids; the kernel writes the codes after them. */
    if ((rc = epipe_cuda_body_push(c, body, 0, tab)) || !n)
        return rc;
    void *d, *dmid;
    if ((rc = epipe_cuda_grow(c, &h->work[0], k * sizeof(double), &dmid)) ||
        (rc = epipe_cuda_body_out(c, tab, cb, &d)))
        return rc;
    /* From pageable memory: mid has been read when the copy returns. */
    if ((rc = epipe_cuda_check(
             c, cudaMemcpyAsync(dmid, mid, k * sizeof(double), cudaMemcpyHostToDevice, s),
             "copying the midpoints to the device")))
        return rc;
    km_pack<<<epipe_cuda_blocks((n + 7) / 8, 256), 256, k * sizeof(double), s>>>(
        x, n, epipe_cuda_aligned16(x), (const double *)dmid, k, w, (uint8_t *)d, cb);
    if ((rc = epipe_cuda_check(c, cudaGetLastError(), "launching the kmeans pack kernel")))
        return rc;
    return epipe_cuda_body_flush(c, body, tab, d, cb);
}

static int kmeans_decode(epipe_codec *c, const uint8_t *body, size_t n, float *y)
{
    unsigned w = km_width(c), k = 1u << w;
    uint64_t cb = (n * (uint64_t)w + 7) / 8, tab = 4ull * k;
    epipe_cuda_handle *h = epipe_cuda_h(c);
    cudaStream_t s = epipe_cuda_stream(c);
    void *hc, *dc;
    const void *d;
    int rc;
    if ((rc = epipe_cuda_host(c, k * sizeof(float), &hc)) ||
        (rc = epipe_cuda_core_fns->km_read_table(c, body, n, (float *)hc)) || !n ||
        (rc = epipe_cuda_grow(c, &h->work[0], k * sizeof(float), &dc)) ||
        (rc = epipe_cuda_body_in(c, body, tab, cb, &d)) ||
        (rc = epipe_cuda_check(
             c, cudaMemcpyAsync(dc, hc, k * sizeof(float), cudaMemcpyHostToDevice, s),
             "copying the centroids to the device")))
        return rc;
    km_decode<<<epipe_cuda_blocks((n + 7) / 8, 256), 256, k * sizeof(float), s>>>(
        (const uint8_t *)d, n, w, (const float *)dc, k, epipe_cuda_aligned16(y), y);
    return epipe_cuda_check(c, cudaGetLastError(), "launching the kmeans decode kernel");
}

const epipe_codec_backend epipe_cuda_kmeans = {kmeans_encode, kmeans_decode, NULL, NULL, 0, NULL};
