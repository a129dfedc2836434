/* poweriter's fast path: power iteration with OpenBLAS products and a
 * LAPACKE Householder QR for the orthonormalisation, and the rebuild. */
#include <stdint.h>
#include <string.h>

#include <cblas.h>
#include <lapacke.h>

#include "poweriter.h"

/* ---- the fast path: OpenBLAS and LAPACKE ------------------------------ */

/* Orthonormalizes the columns of q (m x r, column-major) in place with a
 * Householder QR, and flips each column so R's diagonal is non-negative
 * (the sign Gram-Schmidt gives, so the two paths agree). */
static int pi_orthonormalize(pi_state *st, float *q, int m, int r)
{
    lapack_int lw = (lapack_int)st->workcap;
    if (LAPACKE_sgeqrf_work(LAPACK_COL_MAJOR, m, r, q, m, st->tau, st->work, lw) != 0)
        return -1;
    /* Keep the signs of R's diagonal in work's tail before sorgqr. */
    float *sign = st->work + st->workcap - (size_t)r;
    lw = (lapack_int)(st->workcap - (size_t)r);
    for (int k = 0; k < r; k++)
        sign[k] = q[(size_t)k * m + k] < 0 ? -1.0f : 1.0f;
    if (LAPACKE_sorgqr_work(LAPACK_COL_MAJOR, m, r, r, q, m, st->tau, st->work, lw) != 0)
        return -1;
    for (int k = 0; k < r; k++)
        if (sign[k] < 0)
            cblas_sscal(m, -1.0f, q + (size_t)k * m, 1);
    return 0;
}

/* The CUDA backend's orthonormalisation of one matrix's q on the host. */
int epipe_pi_cuda_orthonormalize(epipe_codec *c, float *q, unsigned rows, unsigned r, uint64_t b)
{
    pi_state *st = c->state;
    if (epipe_pi_grow(&st->tau, &st->taucap, r) ||
        epipe_pi_grow(&st->work, &st->workcap, 64 * (size_t)r + 64))
        return epipe_codec_fail(c, EPIPE_ENOMEM, "poweriter: out of memory");
    if (pi_orthonormalize(st, q, (int)rows, (int)r))
        return epipe_codec_fail(c, EPIPE_EINVAL, "poweriter: QR failed on matrix %llu",
                                (unsigned long long)b);
    return EPIPE_OK;
}

/* Index of the first NaN or infinity in x[0..n), or n. Unlike
 * epipe_find_nonfinite it reduces with an integer max, which vectorizes
 * without reassociating float sums: the magnitude bits of a float are at
 * least 0x7f800000 exactly when it is not finite. */
static size_t pi_find_nonfinite(const float *x, size_t n)
{
    const uint32_t *u = (const uint32_t *)x;
    const size_t block = 4096;
    for (size_t b = 0; b < n; b += block) {
        size_t e = b + block < n ? b + block : n;
        uint32_t mx = 0;
        for (size_t i = b; i < e; i++) {
            uint32_t v = u[i] & 0x7fffffffu;
            mx = v > mx ? v : mx;
        }
        if (mx >= 0x7f800000u)
            return b + epipe_find_nonfinite(x + b, e - b);
    }
    return n;
}

/* Up to this rank the products run as r matrix-vector products: OpenBLAS's
 * sgemm packs the whole matrix first, which for r <= 4 costs more than
 * reading it r times from cache (measured on [32, 12544] matrices: 0.60x
 * memcpy throughput with sgemv against 0.44x with sgemm at rank 3). */
#define PI_GEMV_MAX_RANK 4

/* q (rows x r, column-major) = M p, for M row-major rows x cols and p
 * column-major cols x r. */
static void pi_mul_mp(const float *m, int rows, int cols, const float *p, int r, float *q)
{
    if (r <= PI_GEMV_MAX_RANK) {
        for (int k = 0; k < r; k++)
            cblas_sgemv(CblasRowMajor, CblasNoTrans, rows, cols, 1.0f, m, cols,
                        p + (size_t)k * cols, 1, 0.0f, q + (size_t)k * rows, 1);
        return;
    }
    /* M row-major rows x cols is column-major cols x rows: q = Mcmᵀ p. */
    cblas_sgemm(CblasColMajor, CblasTrans, CblasNoTrans, rows, r, cols, 1.0f, m, cols, p, cols,
                0.0f, q, rows);
}

/* p (cols x r, column-major) = Mᵀ q. */
static void pi_mul_mtq(const float *m, int rows, int cols, const float *q, int r, float *p)
{
    if (r <= PI_GEMV_MAX_RANK) {
        for (int k = 0; k < r; k++)
            cblas_sgemv(CblasRowMajor, CblasTrans, rows, cols, 1.0f, m, cols, q + (size_t)k * rows,
                        1, 0.0f, p + (size_t)k * cols, 1);
        return;
    }
    cblas_sgemm(CblasColMajor, CblasNoTrans, CblasNoTrans, cols, r, rows, 1.0f, m, cols, q, rows,
                0.0f, p, cols);
}

int epipe_pi_encode(epipe_codec *c, const float *x, size_t n, uint8_t *body)
{
    pi_view v;
    if (epipe_pi_view_of(c, n, &v))
        return epipe_codec_fail(c, EPIPE_EOVERFLOW, "poweriter: shape does not fit");
    int rc = epipe_pi_check_shared(c, &v);
    if (rc)
        return rc;
    epipe_pi_write_header(body, &v);
    if (v.r == 0)
        return EPIPE_OK;
    pi_slot *slot;
    int cold = epipe_pi_prepare(c, &v, &slot);
    if (cold < 0)
        return cold;
    pi_state *st = c->state;
    const int rows = (int)v.rows, cols = (int)v.cols, r = (int)v.r;
    if (v.rows > INT32_MAX || v.cols > INT32_MAX || v.rows * v.cols > (uint64_t)INT64_MAX)
        return epipe_codec_fail(c, EPIPE_EINVAL,
                                "poweriter: matrix %llux%llu is too large for BLAS",
                                (unsigned long long)v.rows, (unsigned long long)v.cols);
    uint64_t rec = 0;
    epipe_pi_record_size(c, &v, &rec);
    size_t msize = (size_t)v.rows * v.cols, psize = (size_t)v.cols * v.r;
    for (uint64_t b = 0; b < v.nb; b++) {
        const float *m = x + b * msize;
        /* Checked matrix by matrix, so the products find it in cache. A
         * failure here leaves the earlier matrices' warm starts updated:
         * the slot is reset to a cold start instead. */
        size_t bad = pi_find_nonfinite(m, msize);
        if (bad < msize) {
            if (slot)
                memset(&slot->v, 0, sizeof slot->v);
            return epipe_pi_reject_nonfinite(c, x, b * msize + bad);
        }
        float *start = slot ? slot->p + b * psize : st->p;
        if (!slot || cold)
            epipe_pi_cold_start(start, v.cols, v.r);
        const float *pin = start;
        for (unsigned it = 0; it < (unsigned)c->p[PI_ITERS]; it++) {
            pi_mul_mp(m, rows, cols, pin, r, st->q); /* Q = M P */
            if (pi_orthonormalize(st, st->q, rows, r)) {
                if (slot)
                    memset(&slot->v, 0, sizeof slot->v);
                return epipe_codec_fail(c, EPIPE_EINVAL, "poweriter: QR failed on matrix %llu",
                                        (unsigned long long)b);
            }
            pi_mul_mtq(m, rows, cols, st->q, r, st->p); /* P = Mᵀ Q */
            pin = st->p;
        }
        rc = epipe_pi_finish_matrix(c, &v, b, slot, start, st->q, st->p,
                                    body + PI_BODY_HEADER + b * rec);
        if (rc)
            return rc;
    }
    if (slot)
        slot->v = v, slot->on_device = 0; /* warm from now on */
    return EPIPE_OK;
}

int epipe_pi_decode(epipe_codec *c, const uint8_t *body, size_t n, float *y)
{
    pi_view v;
    if (epipe_pi_view_of(c, n, &v))
        return epipe_codec_fail(c, EPIPE_EOVERFLOW, "poweriter: shape does not fit");
    int rc = epipe_pi_check_header(c, body, &v);
    if (rc || v.r == 0)
        return rc;
    if (v.rows > INT32_MAX || v.cols > INT32_MAX)
        return epipe_codec_fail(c, EPIPE_EINVAL,
                                "poweriter: matrix %llux%llu is too large for BLAS",
                                (unsigned long long)v.rows, (unsigned long long)v.cols);
    pi_state *st = c->state;
    if (epipe_pi_grow(&st->q, &st->qcap, (size_t)v.rows * v.r) ||
        epipe_pi_grow(&st->p, &st->pcap, (size_t)v.cols * v.r))
        return epipe_codec_fail(c, EPIPE_ENOMEM, "poweriter: out of memory");
    uint64_t rec = 0;
    epipe_pi_record_size(c, &v, &rec);
    size_t msize = (size_t)v.rows * v.cols;
    for (uint64_t b = 0; b < v.nb; b++) {
        float s;
        if ((rc = epipe_pi_read_record(c, &v, b, body + PI_BODY_HEADER + b * rec, &s, st->q,
                                       st->p)))
            return rc;
        /* Y = s Q Pᵀ, row-major rows x cols = column-major cols x rows = s P Qᵀ. */
        cblas_sgemm(CblasColMajor, CblasNoTrans, CblasTrans, (int)v.cols, (int)v.rows, (int)v.r, s,
                    st->p, (int)v.cols, st->q, (int)v.rows, 0.0f, y + b * msize, (int)v.cols);
    }
    return EPIPE_OK;
}
