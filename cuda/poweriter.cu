/* `poweriter` on CUDA tensors: the products that read the tensor (Q = M P,
 * P = Mᵀ Q, and the rebuild Y = P Qᵀ) as cuBLAS strided-batched GEMMs over
 * the B matrices, and everything small on the host with the CPU codec's
 * own code (the core's pi_* functions): the warm and cold starts, the
 * Householder QR of each rows x r factor, the records and their checks.
 * Only the factors cross PCIe, so the payload is what crosses, as for the
 * other codecs. The GEMMs round differently from OpenBLAS, so payloads
 * are the CPU's within a tolerance (docs/codecs.md), not byte for byte.
 * Without cuBLAS (not found at run time, cuda/cublas.cu) poweriter's CUDA
 * tensors go through host staging instead (cuda_backend() in module.cu). */
#include <stdio.h>
#include <stdlib.h>

#include "cuda_impl.h"

__global__ void pi_check_finite(const float *x, uint64_t n, epipe_cuda_status *st)
{
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)gridDim.x * blockDim.x)
        if (!epipe_hd_finite(x[i]))
            epipe_cuda_note_nonfinite(st, x[i], i);
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
    pi_check_finite<<<epipe_cuda_blocks(n, 256), 256, 0, s>>>(x, n, h->status);
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
    if ((rc = core->pi_start(c, n, hp)) ||
        (rc = copy(c, dp, hp, ps * sizeof(float), cudaMemcpyHostToDevice, "copying P up")))
        return rc;
    const int m = (int)rows, k = (int)cols, rr = (int)r;
    for (uint64_t it = 0; it < v[3]; it++) {
        /* Q = M P: M row-major rows x cols is column-major cols x rows. */
        if ((rc = epipe_cuda_gemm(c, "computing Q = M P", 1, 0, m, rr, k, x, k,
                                  (long long)rows * cols, (const float *)dp, k, (long long)cols * r,
                                  (float *)dq, m, (long long)rows * r, (int)nb)) ||
            (rc = copy(c, hq, dq, qs * sizeof(float), cudaMemcpyDeviceToHost, "copying Q down")) ||
            (rc = wait(c, "waiting for Q")))
            return rc;
        for (uint64_t b = 0; b < nb; b++)
            if ((rc = core->pi_orthonormalize(c, hq + b * rows * r, (unsigned)rows, r, b)))
                return rc;
        /* P = Mᵀ Q */
        if ((rc = copy(c, dq, hq, qs * sizeof(float), cudaMemcpyHostToDevice, "copying Q up")) ||
            (rc = epipe_cuda_gemm(c, "computing P = Mt Q", 0, 0, k, rr, m, x, k,
                                  (long long)rows * cols, (const float *)dq, m, (long long)rows * r,
                                  (float *)dp, k, (long long)cols * r, (int)nb)))
            return rc;
    }
    if ((rc = copy(c, hp, dp, ps * sizeof(float), cudaMemcpyDeviceToHost, "copying P down")) ||
        (rc = wait(c, "waiting for P")) || (rc = core->pi_finish(c, n, hq, hp, body)))
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
