/* `poweriter` on CUDA tensors: the products that read the tensor (Q = M P,
 * P = Mᵀ Q, and the rebuild Y = P Qᵀ) as cuBLAS strided-batched GEMMs over
 * the B matrices; each Q orthonormalised on the device by CholeskyQR2
 * (G = QᵀQ by a batched GEMM, its Cholesky and Q R⁻¹ by the shared
 * functions of codecs/inline/poweriter.h), the Q the CPU's Householder QR
 * gives up to rounding; and everything small on the host with the CPU
 * codec's own code (the core's pi_* functions): the warm and cold starts,
 * the records and their checks. A Q too ill-conditioned for CholeskyQR
 * (or a rank above 64) takes the host's Householder QR, as before.
 * Only the factors cross PCIe, so the payload is what crosses, as for the
 * other codecs. The GEMMs round differently from OpenBLAS, so payloads
 * are the CPU's within a tolerance (docs/codecs.md), not byte for byte.
 * Without cuBLAS (not found at run time, cuda/cublas.cu) poweriter's CUDA
 * tensors go through host staging instead (cuda_backend() in module.cu). */
#include <stdio.h>
#include <stdlib.h>

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

/* Up to this rank each Q is orthonormalised on the device (CholeskyQR2,
 * one thread a matrix for the r x r Cholesky); above it, on the host. */
#define PI_DEVICE_QR_MAX_RANK 64

/* R of each matrix's G = QᵀQ; a refusal (Q ill-conditioned) sets *flag. */
__global__ void pi_chol_kernel(const float *G, uint64_t nb, unsigned r, float *R, int *flag)
{
    for (uint64_t b = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; b < nb;
         b += (uint64_t)gridDim.x * blockDim.x)
        if (epipe_hd_pi_chol(G + b * r * r, r, R + b * r * r))
            atomicOr(flag, 1);
}

/* Each row of each Q times its R⁻¹, unless a Cholesky refused. */
__global__ void pi_solve_kernel(float *Q, uint64_t nb, uint64_t rows, unsigned r, const float *R,
                                const int *flag)
{
    if (*(volatile const int *)flag)
        return;
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < nb * rows;
         i += (uint64_t)gridDim.x * blockDim.x) {
        uint64_t b = i / rows;
        epipe_hd_pi_solve_row(Q + b * rows * r + i % rows, rows, r, R + b * r * r);
    }
}

/* The power iterations from the start in dp, leaving each matrix's Q and P
 * in hq and hp. Q = M P and P = Mᵀ Q are batched GEMMs on the tensor; each
 * Q is orthonormalised on the device by CholeskyQR2 (device_qr: nothing
 * crosses PCIe until the end, and the stream is waited for once) or on the
 * host by the CPU's Householder QR (Q down and up every iteration).
 * *refused = 1 when a Cholesky refused a Q (nearly rank-deficient), for
 * the caller to start over on the host's QR, which takes any Q. */
static int iterate(epipe_codec *c, const float *x, const uint64_t v[4], unsigned r, int device_qr,
                   float *dq, float *dp, float *hq, float *hp, int *refused)
{
    const epipe_cuda_core *core = epipe_cuda_core_fns;
    epipe_cuda_handle *h = epipe_cuda_h(c);
    cudaStream_t s = epipe_cuda_stream(c);
    const uint64_t nb = v[0], rows = v[1], cols = v[2];
    const size_t gs = (size_t)(nb * r * r), qs = (size_t)(nb * rows * r),
                 ps = (size_t)(nb * cols * r);
    const int m = (int)rows, k = (int)cols, rr = (int)r;
    float *G = NULL, *R = NULL;
    int *flag = NULL, flag_host = 0, rc;
    if (device_qr) {
        void *w;
        if ((rc = epipe_cuda_grow(c, &h->work[2], 2 * gs * sizeof(float) + sizeof(int), &w)))
            return rc;
        G = (float *)w, R = G + gs, flag = (int *)(R + gs);
        if ((rc = epipe_cuda_check(c, cudaMemsetAsync(flag, 0, sizeof(int), s),
                                   "clearing the flag")))
            return rc;
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
            pi_chol_kernel<<<epipe_cuda_blocks(nb, 128), 128, 0, s>>>(G, nb, r, R, flag);
            pi_solve_kernel<<<epipe_cuda_blocks(nb * rows, 256), 256, 0, s>>>(dq, nb, rows, r, R,
                                                                              flag);
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
            if ((rc = copy(c, dq, hq, qs * sizeof(float), cudaMemcpyHostToDevice, "copying Q up")))
                return rc;
        }
        /* P = Mᵀ Q */
        if ((rc = epipe_cuda_gemm(c, "computing P = Mt Q", 0, 0, k, rr, m, x, k,
                                  (long long)rows * cols, dq, m, (long long)rows * r, dp, k,
                                  (long long)cols * r, (int)nb)))
            return rc;
    }
    if ((device_qr &&
         ((rc = copy(c, hq, dq, qs * sizeof(float), cudaMemcpyDeviceToHost, "copying Q down")) ||
          (rc = copy(c, &flag_host, flag, sizeof flag_host, cudaMemcpyDeviceToHost,
                     "reading the QR's flag")))) ||
        (rc = copy(c, hp, dp, ps * sizeof(float), cudaMemcpyDeviceToHost, "copying P down")) ||
        (rc = wait(c, "waiting for the factors")))
        return rc;
    *refused = flag_host != 0;
    return EPIPE_OK;
}

static int pi_encode(epipe_codec *c, const float *x, size_t n, uint8_t *body)
{
    const epipe_cuda_core *core = epipe_cuda_core_fns;
    epipe_cuda_handle *h = epipe_cuda_h(c);
    cudaStream_t s = epipe_cuda_stream(c);
    uint64_t v[4];
    unsigned r;
    size_t len;
    int rc = core->pi_plan(c, n, body, v, &r, &len);
    if (rc || r == 0)
        return rc ? rc : epipe_cuda_body_push(c, body, 0, len);
    const uint64_t nb = v[0], rows = v[1], cols = v[2];
    const size_t qs = (size_t)(nb * rows * r), ps = (size_t)(nb * cols * r);
    /* The CPU refuses a value that is not finite before it starts. */
    pi_check_finite<<<epipe_cuda_blocks((n + 7) / 8, 256), 256, 0, s>>>(
        x, n, epipe_cuda_aligned16(x), h->status);
    if ((rc = epipe_cuda_check(c, cudaGetLastError(), "launching the finiteness check")) ||
        (rc = copy(c, h->status_host, h->status, sizeof *h->status, cudaMemcpyDeviceToHost,
                   "reading the status word")) ||
        (rc = wait(c, "waiting for the finiteness check")) || (rc = refuse_nonfinite(c)))
        return rc;
    void *hw, *dq, *dp;
    if ((rc = epipe_cuda_host(c, (qs + ps) * sizeof(float), &hw)) ||
        (rc = epipe_cuda_grow(c, &h->work[0], qs * sizeof(float), &dq)) ||
        (rc = epipe_cuda_grow(c, &h->work[1], ps * sizeof(float), &dp)))
        return rc;
    float *hq = (float *)hw, *hp = hq + qs;
    /* The device's QR where the rank allows; a Q it refuses sends the
     * encode back to its start, on the host's QR (which refuses none). */
    int device_qr = r <= PI_DEVICE_QR_MAX_RANK, refused = 0;
    do {
        if ((rc = core->pi_start(c, n, hp)) ||
            (rc = copy(c, dp, hp, ps * sizeof(float), cudaMemcpyHostToDevice, "copying P up")) ||
            (rc = iterate(c, x, v, r, device_qr, (float *)dq, (float *)dp, hq, hp, &refused)))
            return rc;
        device_qr = 0;
    } while (refused);
    if ((rc = core->pi_finish(c, n, hq, hp, body)))
        return rc;
    return epipe_cuda_body_push(c, body, 0, len);
}

static int pi_decode(epipe_codec *c, const uint8_t *body, size_t n, float *y)
{
    const epipe_cuda_core *core = epipe_cuda_core_fns;
    epipe_cuda_handle *h = epipe_cuda_h(c);
    uint64_t v[4];
    unsigned r;
    size_t len;
    int rc = core->pi_plan(c, n, NULL, v, &r, &len);
    if (rc || r == 0)
        return rc ? rc : core->pi_read(c, body, n, NULL, NULL); /* the header's checks */
    const uint64_t nb = v[0], rows = v[1], cols = v[2];
    const size_t qs = (size_t)(nb * rows * r), ps = (size_t)(nb * cols * r);
    void *hw, *dq, *dp;
    if ((rc = epipe_cuda_host(c, (qs + ps) * sizeof(float), &hw)))
        return rc;
    float *hq = (float *)hw, *hp = hq + qs;
    if ((rc = core->pi_read(c, body, n, hq, hp)) ||
        (rc = epipe_cuda_grow(c, &h->work[0], qs * sizeof(float), &dq)) ||
        (rc = epipe_cuda_grow(c, &h->work[1], ps * sizeof(float), &dp)) ||
        (rc = copy(c, dq, hq, qs * sizeof(float), cudaMemcpyHostToDevice, "copying Q up")) ||
        (rc = copy(c, dp, hp, ps * sizeof(float), cudaMemcpyHostToDevice, "copying P up")))
        return rc;
    /* Y = s Q Pᵀ: row-major rows x cols is column-major cols x rows = (sP) Qᵀ. */
    /* The copies from pageable host memory have read hq and hp when they
     * return, so the next call may reuse them: the GEMM stays enqueued. */
    return epipe_cuda_gemm(c, "rebuilding Y = Q Pt", 0, 1, (int)cols, (int)rows, (int)r,
                           (const float *)dp, (int)cols, (long long)cols * r, (const float *)dq,
                           (int)rows, (long long)rows * r, y, (int)cols, (long long)rows * cols,
                           (int)nb);
}

const epipe_codec_backend epipe_cuda_poweriter = {pi_encode, pi_decode, NULL, NULL, 1, NULL};
