/* poweriter's orthonormalisation as CholeskyQR, per matrix, for the CUDA
 * kernels (cuda/poweriter.cu) and the tests that check them on the CPU:
 * with G = QᵀQ (r x r), R upper with RᵀR = G, and Q R⁻¹ has orthonormal
 * columns and R a positive diagonal: the Q the CPU's Householder QR gives
 * with its signs flipped so (codecs/poweriter/lowrank.c), up to rounding.
 * Twice (CholeskyQR2) it is orthonormal to working precision while Q is
 * well conditioned; the Cholesky refuses a Q that is not, for the host's
 * Householder QR to take. */
#ifndef EPIPE_CODECS_INLINE_POWERITER_H
#define EPIPE_CODECS_INLINE_POWERITER_H

#include <float.h>
#include <math.h>

#include "hd.h"

/* The deterministic start of a cold matrix: uniform in [-1, 1) from a hash
 * of (row j of P, column k), the same for every matrix and every call. */
EPIPE_HD float epipe_hd_pi_start_value(uint64_t j, unsigned k)
{
    uint64_t z = j * 0x9e3779b97f4a7c15ull + (uint64_t)k * 0xbf58476d1ce4e5b9ull +
                 0x632be59bd9b4e5bull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (float)((double)(z >> 40) * 0x1p-23 - 1.0);
}

/* The largest scale a record may carry: with |Q|, |P| <= 1 every rebuilt
 * value is at most scale * r, which then stays below FLT_MAX / 2. */
EPIPE_HD float epipe_hd_pi_max_scale(unsigned r)
{
    return (float)(FLT_MAX / (2.0 * (r ? r : 1)));
}

/* A record's scale as a decoder accepts it: in [0, epipe_hd_pi_max_scale(r)],
 * not -0. */
EPIPE_HD int epipe_hd_pi_scale_ok(float s, unsigned r)
{
    return s >= 0.0f && s <= epipe_hd_pi_max_scale(r) && !(epipe_hd_f2u(s) >> 31);
}

/* A record's factor value as a decoder accepts it: finite, in [-1, 1]. */
EPIPE_HD int epipe_hd_pi_factor_ok(float v)
{
    return fabsf(v) <= 1.0f;
}

/* A factor value as a record holds it: f times mul, clamped to [-1, 1]. */
EPIPE_HD float epipe_hd_pi_factor_value(float f, float mul)
{
    float v = f * mul;
    return v > 1.0f ? 1.0f : v < -1.0f ? -1.0f : v;
}

/* Smallest pivot, over its own diagonal of G, the Cholesky accepts: the
 * squared sine of the angle between column j of Q and the span of the
 * columns before it. Below it Q with its columns scaled to unit length has
 * a condition number above about 1000, where CholeskyQR2 in fp32 loses
 * orthogonality. Columns of very different lengths alone do not count:
 * CholeskyQR does not see the scaling of the columns (Q D has the Q factor
 * of Q), and in warm power iteration Q's columns are about sigma_k u_k. */
#define EPIPE_PI_CHOL_TOL 1e-6

/* R (r x r, column-major; its upper triangle written) from G (column-major,
 * its upper triangle read), in double arithmetic. 0, or 1 when a pivot is
 * not above EPIPE_PI_CHOL_TOL times its diagonal of G (a column too close
 * to the span of those before it), a diagonal is below about 2e-31 (a
 * zero or vanishing column), or G holds a NaN: R is then unfinished. */
EPIPE_HD int epipe_hd_pi_chol(const float *g, unsigned r, float *R)
{
    /* A column whose squared length is this close to fp32's underflow
     * (length about 1e-15) was summed into G with subnormal products: its
     * pivot means little, and the host's Householder QR takes it. */
    const double tiny = (double)FLT_MIN * 16777216.0;
    for (unsigned k = 0; k < r; k++)
        if (!((double)g[k + k * r] >= tiny))
            return 1;
    for (unsigned j = 0; j < r; j++)
        for (unsigned i = 0; i <= j; i++) {
            double s = g[i + j * r];
            for (unsigned k = 0; k < i; k++)
                s -= (double)R[k + i * r] * R[k + j * r];
            if (i < j) {
                R[i + j * r] = (float)(s / R[i + i * r]);
            } else {
                if (!(s > EPIPE_PI_CHOL_TOL * (double)g[j + j * r]))
                    return 1;
                R[j + j * r] = (float)sqrt(s);
            }
        }
    return 0;
}

/* One row of Q (r values `stride` apart: Q column-major, stride = rows)
 * times R⁻¹, in place: x_j = (q_j - sum_{k<j} x_k R[k][j]) / R[j][j]. */
EPIPE_HD void epipe_hd_pi_solve_row(float *q, uint64_t stride, unsigned r, const float *R)
{
    for (unsigned j = 0; j < r; j++) {
        double s = q[j * stride];
        for (unsigned k = 0; k < j; k++)
            s -= (double)q[k * stride] * R[k + j * r];
        q[j * stride] = (float)(s / R[j + j * r]);
    }
}

#endif
