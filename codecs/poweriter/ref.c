/* poweriter's scalar reference: the same power iteration in plain loops,
 * orthonormalised by modified Gram-Schmidt in double, and its rebuild. */
#include <math.h>
#include <stdlib.h>

#include "poweriter.h"

/* ---- the scalar reference: plain loops, modified Gram-Schmidt ---------- */

/* Orthonormalizes q's columns (m x r, column-major) by modified
 * Gram-Schmidt in double. A column that vanishes is completed with the
 * first unit vector e_i that is not yet in the span. */
static void pi_gram_schmidt(float *q, size_t m, unsigned r)
{
    double *col = malloc((m ? m : 1) * sizeof *col * (r ? r : 1));
    if (!col)
        abort(); /* tiny; reference only */
    for (size_t i = 0; i < m * r; i++)
        col[i] = q[i];
    size_t next_e = 0;
    for (unsigned k = 0; k < r; k++) {
        double *a = col + (size_t)k * m;
        for (int pass = 0; pass < 2; pass++) { /* twice is enough (Kahan) */
            for (unsigned j = 0; j < k; j++) {
                const double *e = col + (size_t)j * m;
                double d = 0;
                for (size_t i = 0; i < m; i++)
                    d += e[i] * a[i];
                for (size_t i = 0; i < m; i++)
                    a[i] -= d * e[i];
            }
        }
        double nrm = 0;
        for (size_t i = 0; i < m; i++)
            nrm += a[i] * a[i];
        nrm = sqrt(nrm);
        if (!(nrm > 0)) {
            /* complete the basis */
            for (; next_e < m; next_e++) {
                for (size_t i = 0; i < m; i++)
                    a[i] = i == next_e ? 1.0 : 0.0;
                for (unsigned j = 0; j < k; j++) {
                    const double *e = col + (size_t)j * m;
                    double d = e[next_e];
                    for (size_t i = 0; i < m; i++)
                        a[i] -= d * e[i];
                }
                nrm = 0;
                for (size_t i = 0; i < m; i++)
                    nrm += a[i] * a[i];
                nrm = sqrt(nrm);
                if (nrm > 0.5) {
                    next_e++;
                    break;
                }
            }
        }
        for (size_t i = 0; i < m; i++)
            a[i] /= nrm;
    }
    for (size_t i = 0; i < m * r; i++)
        q[i] = (float)col[i];
    free(col);
}

int epipe_pi_encode_ref(epipe_codec *c, const float *x, size_t n, uint8_t *body)
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
    for (size_t i = 0; i < n; i++)
        if (!isfinite(x[i]))
            return epipe_pi_reject_nonfinite(c, x, i);
    pi_slot *slot;
    int cold = epipe_pi_prepare(c, &v, &slot);
    if (cold < 0)
        return cold;
    pi_state *st = c->state;
    uint64_t rec = 0;
    epipe_pi_record_size(c, &v, &rec);
    size_t rows = v.rows, cols = v.cols, r = v.r, msize = rows * cols, psize = cols * r;
    for (uint64_t b = 0; b < v.nb; b++) {
        const float *m = x + b * msize;
        float *start = slot ? slot->p + b * psize : st->p;
        if (!slot || cold)
            epipe_pi_cold_start(start, v.cols, v.r);
        const float *pin = start;
        for (unsigned it = 0; it < (unsigned)c->p[PI_ITERS]; it++) {
            for (size_t i = 0; i < rows; i++)
                for (size_t k = 0; k < r; k++) {
                    double acc = 0;
                    for (size_t j = 0; j < cols; j++)
                        acc += (double)m[i * cols + j] * pin[k * cols + j];
                    st->q[k * rows + i] = (float)acc;
                }
            pi_gram_schmidt(st->q, rows, v.r);
            for (size_t j = 0; j < cols; j++)
                for (size_t k = 0; k < r; k++) {
                    double acc = 0;
                    for (size_t i = 0; i < rows; i++)
                        acc += (double)m[i * cols + j] * st->q[k * rows + i];
                    st->p[k * cols + j] = (float)acc;
                }
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

int epipe_pi_decode_ref(epipe_codec *c, const uint8_t *body, size_t n, float *y)
{
    pi_view v;
    if (epipe_pi_view_of(c, n, &v))
        return epipe_codec_fail(c, EPIPE_EOVERFLOW, "poweriter: shape does not fit");
    int rc = epipe_pi_check_header(c, body, &v);
    if (rc || v.r == 0)
        return rc;
    pi_state *st = c->state;
    if (epipe_pi_grow(&st->q, &st->qcap, (size_t)v.rows * v.r) ||
        epipe_pi_grow(&st->p, &st->pcap, (size_t)v.cols * v.r))
        return epipe_codec_fail(c, EPIPE_ENOMEM, "poweriter: out of memory");
    uint64_t rec = 0;
    epipe_pi_record_size(c, &v, &rec);
    size_t rows = v.rows, cols = v.cols, r = v.r, msize = rows * cols;
    /* Validate every record before writing anything. */
    float s;
    for (uint64_t b = 0; b < v.nb; b++)
        if ((rc = epipe_pi_read_record(c, &v, b, body + PI_BODY_HEADER + b * rec, &s, st->q,
                                       st->p)))
            return rc;
    for (uint64_t b = 0; b < v.nb; b++) {
        epipe_pi_read_record(c, &v, b, body + PI_BODY_HEADER + b * rec, &s, st->q, st->p);
        for (size_t i = 0; i < rows; i++)
            for (size_t j = 0; j < cols; j++) {
                float acc = 0;
                for (size_t k = 0; k < r; k++)
                    acc += st->q[k * rows + i] * st->p[k * cols + j];
                y[b * msize + i * cols + j] = s * acc;
            }
    }
    return EPIPE_OK;
}
