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

#include <math.h>

#include "hd.h"

/* Smallest pivot, over G's largest diagonal, the Cholesky accepts: below
 * it Q's condition number is above about 1000, where CholeskyQR2 in fp32
 * loses orthogonality. */
#define EPIPE_PI_CHOL_TOL 1e-6

/* R (r x r, column-major; its upper triangle written) from G (column-major,
 * its upper triangle read), in double arithmetic. 0, or 1 when a pivot is
 * not above EPIPE_PI_CHOL_TOL times G's largest diagonal (or G holds a NaN):
 * R is then unfinished. */
EPIPE_HD int epipe_hd_pi_chol(const float *g, unsigned r, float *R)
{
    double dmax = 0;
    for (unsigned k = 0; k < r; k++)
        dmax = (double)g[k + k * r] > dmax ? (double)g[k + k * r] : dmax;
    if (!(dmax > 0))
        return 1;
    for (unsigned j = 0; j < r; j++)
        for (unsigned i = 0; i <= j; i++) {
            double s = g[i + j * r];
            for (unsigned k = 0; k < i; k++)
                s -= (double)R[k + i * r] * R[k + j * r];
            if (i < j) {
                R[i + j * r] = (float)(s / R[i + i * r]);
            } else {
                if (!(s > EPIPE_PI_CHOL_TOL * dmax))
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
