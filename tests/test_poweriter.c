/* The poweriter codec: near-optimal rank-r error (against a truncated SVD
 * from LAPACKE_sgesvd), exact on rank-r data, warm starts per slot, the
 * fast path against its scalar reference, spec errors, hostile payloads,
 * and the matrix views of [B,C,H,W], [B,T,D], [B,D] and 1-D tensors. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <lapacke.h>

#include <epipe/epipe.h>

#include "../codecs/inline/poweriter.h"
#include "../lib/codec/codec_impl.h"
#include "../lib/codec/cuda_api.h"
#include "tensor.h"
#include "testutil.h"

static DLTensor view(float *x, int64_t *shape, int ndim)
{
    DLTensor t = {
        .data = x, .device = {kDLCPU, 0}, .ndim = ndim, .dtype = {kDLFloat, 32, 1}, .shape = shape};
    return t;
}

static size_t numel(const int64_t *shape, int ndim)
{
    size_t n = 1;
    for (int d = 0; d < ndim; d++)
        n *= (size_t)shape[d];
    return n;
}

/* Encodes x on c and decodes into y; returns the payload (caller frees). */
static uint8_t *roundtrip(epipe_codec *c, float *x, float *y, int64_t *shape, int ndim, size_t *len)
{
    DLTensor tx = view(x, shape, ndim), ty = view(y, shape, ndim);
    size_t cap;
    assert_int_equal(epipe_codec_max_encoded_size(c, &tx, &cap), EPIPE_OK);
    uint8_t *buf = malloc(cap);
    assert_non_null(buf);
    if (epipe_codec_encode(c, &tx, buf, cap, len) != EPIPE_OK)
        fail_msg("encode: %s", epipe_codec_last_error(c));
    assert_int_equal(*len, cap);
    if (y && epipe_codec_decode(c, buf, *len, &ty) != EPIPE_OK)
        fail_msg("decode: %s", epipe_codec_last_error(c));
    return buf;
}

/* B matrices rows x cols: sum of `rank` outer products with strengths
 * 10, 5, 3, ... plus N(0, noise^2). */
static void low_rank(float *x, int nb, int rows, int cols, int rank, double noise, uint64_t seed)
{
    test_rng g;
    test_rng_seed(&g, seed);
    for (int b = 0; b < nb; b++) {
        float *m = x + (size_t)b * rows * cols;
        for (int i = 0; i < rows * cols; i++)
            m[i] = (float)(noise * test_rng_normal(&g));
        for (int k = 0; k < rank; k++) {
            double u[512], v[4096], s = 10.0 / (1 + k);
            for (int i = 0; i < rows; i++)
                u[i] = test_rng_normal(&g) / sqrt(rows);
            for (int j = 0; j < cols; j++)
                v[j] = test_rng_normal(&g) / sqrt(cols) * sqrt(rows * (double)cols);
            for (int i = 0; i < rows; i++)
                for (int j = 0; j < cols; j++)
                    m[i * cols + j] += (float)(s * u[i] * v[j] / sqrt(rows));
        }
    }
}

static double frob_err(const float *a, const float *b, size_t n)
{
    double s = 0;
    for (size_t i = 0; i < n; i++)
        s += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
    return sqrt(s);
}

static double frob(const float *a, size_t n)
{
    double s = 0;
    for (size_t i = 0; i < n; i++)
        s += (double)a[i] * a[i];
    return sqrt(s);
}

/* The best rank-r error over all matrices: the singular values beyond r. */
static double best_error(const float *x, int nb, int rows, int cols, int r)
{
    double e = 0;
    int mn = rows < cols ? rows : cols;
    float *a = malloc(sizeof(float) * rows * cols), *s = malloc(sizeof(float) * mn),
          *sup = malloc(sizeof(float) * mn);
    for (int b = 0; b < nb; b++) {
        memcpy(a, x + (size_t)b * rows * cols, sizeof(float) * rows * cols);
        assert_int_equal(LAPACKE_sgesvd(LAPACK_ROW_MAJOR, 'N', 'N', rows, cols, a, cols, s, NULL, 1,
                                        NULL, 1, sup),
                         0);
        for (int k = r; k < mn; k++)
            e += (double)s[k] * s[k];
    }
    free(a);
    free(s);
    free(sup);
    return sqrt(e);
}

static void near_best_rank_r_error(void **state)
{
    (void)state;
    enum { B = 3, T = 24, D = 200, N = B * T * D };
    static float x[N], y[N];
    int64_t shape[3] = {B, T, D};
    low_rank(x, B, T, D, 3, 0.05, 1);
    double best = best_error(x, B, T, D, 3);
    for (int ref = 0; ref < 2; ref++)
        for (int f = 0; f < 2; f++) {
            epipe_codec *c;
            assert_int_equal(
                epipe_codec_create(&c, f ? "poweriter:rank=3,iters=3,factors=fp16,shared=1"
                                         : "poweriter:rank=3,iters=3,shared=1"),
                EPIPE_OK);
            assert_true(epipe_codec_use_reference(c, ref));
            size_t len;
            free(roundtrip(c, x, y, shape, 3, &len));
            double e = frob_err(x, y, N);
            if (!(e <= 1.5 * best))
                fail_msg("ref %d fp16 %d: error %g, best rank-3 error %g", ref, f, e, best);
            epipe_codec_destroy(c);
        }
}

static void exact_on_rank_r_data(void **state)
{
    (void)state;
    enum { B = 2, C = 16, H = 8, W = 8, N = B * C * H * W };
    static float x[N], y[N];
    int64_t shape[4] = {B, C, H, W};
    low_rank(x, B, C, H * W, 2, 0.0, 2);
    const char *specs[] = {"poweriter:rank=2,shared=1", "poweriter:rank=2,iters=2,shared=1",
                           "poweriter:rank=5,shared=1"};
    for (size_t s = 0; s < 3; s++)
        for (int ref = 0; ref < 2; ref++) {
            epipe_codec *c;
            assert_int_equal(epipe_codec_create(&c, specs[s]), EPIPE_OK);
            assert_true(epipe_codec_use_reference(c, ref));
            size_t len;
            free(roundtrip(c, x, y, shape, 4, &len));
            double rel = frob_err(x, y, N) / frob(x, N);
            if (!(rel < 1e-5))
                fail_msg("%s ref %d: relative error %g on rank-2 data", specs[s], ref, rel);
            epipe_codec_destroy(c);
        }
}

/* Slowly changing inputs: the warm start converges over the calls; a cold
 * start every time does not. */
static void warm_start_lowers_error(void **state)
{
    (void)state;
    enum { B = 2, T = 32, D = 256, N = B * T * D };
    static float x0[N], dx[N], x[N], y[N];
    int64_t shape[3] = {B, T, D};
    low_rank(x0, B, T, D, 6, 0.1, 3);
    low_rank(dx, B, T, D, 6, 0.0, 4);
    epipe_codec *w, *cold;
    assert_int_equal(epipe_codec_create(&w, "poweriter:rank=4,shared=1"), EPIPE_OK);
    assert_int_equal(epipe_codec_create(&cold, "poweriter:rank=4,warm=0,shared=1"), EPIPE_OK);
    double first = 0, last = 0, last_cold = 0, best = 0;
    for (int t = 0; t < 8; t++) {
        for (int i = 0; i < N; i++)
            x[i] = x0[i] + 0.01f * (float)t * dx[i];
        size_t len;
        free(roundtrip(w, x, y, shape, 3, &len));
        double e = frob_err(x, y, N);
        free(roundtrip(cold, x, y, shape, 3, &len));
        double ec = frob_err(x, y, N);
        if (t == 0) {
            first = e;
            assert_true(e == ec); /* the first call is a cold start too */
        }
        last = e;
        last_cold = ec;
        best = best_error(x, B, T, D, 4);
    }
    if (!(last < 0.8 * first && last < 0.8 * last_cold && last <= 1.5 * best))
        fail_msg("warm: first %g last %g; cold last %g; best %g", first, last, last_cold, best);
    epipe_codec_destroy(w);
    epipe_codec_destroy(cold);
}

/* Warm starts are per slot, and a new shape starts cold. */
static void warm_start_per_slot_and_shape(void **state)
{
    (void)state;
    enum { N = 2 * 16 * 40 };
    static float x[N], z[N];
    int64_t shape[3] = {2, 16, 40}, other[3] = {4, 8, 40};
    low_rank(x, 2, 16, 40, 4, 0.1, 5);
    low_rank(z, 2, 16, 40, 4, 0.1, 6);
    epipe_codec *fresh, *c;
    size_t l0, l1;
    assert_int_equal(epipe_codec_create(&fresh, "poweriter:rank=2,shared=1"), EPIPE_OK);
    uint8_t *b0 = roundtrip(fresh, x, NULL, shape, 3, &l0);
    assert_int_equal(epipe_codec_create(&c, "poweriter:rank=2,shared=1"), EPIPE_OK);
    free(roundtrip(c, z, NULL, shape, 3, &l1)); /* slot 0 is now warm from z */
    assert_int_equal(epipe_codec_set_param(c, EPIPE_CODEC_MICROBATCH, 1), EPIPE_OK);
    uint8_t *b1 = roundtrip(c, x, NULL, shape, 3, &l1); /* slot 1: cold */
    assert_int_equal(l0, l1);
    assert_memory_equal(b0, b1, l0);
    free(b1);
    assert_int_equal(epipe_codec_set_param(c, EPIPE_CODEC_MICROBATCH, 0), EPIPE_OK);
    b1 = roundtrip(c, x, NULL, shape, 3, &l1); /* slot 0: warm from z */
    assert_true(memcmp(b0, b1, l0) != 0);
    free(b1);
    free(roundtrip(c, z, NULL, other, 3, &l1)); /* another shape */
    b1 = roundtrip(c, x, NULL, shape, 3, &l1);  /* back: cold again */
    assert_memory_equal(b0, b1, l0);
    free(b1);
    free(b0);
    epipe_codec_destroy(fresh);
    epipe_codec_destroy(c);
}

/* The fast path (OpenBLAS, Householder QR) and the reference (loops,
 * Gram-Schmidt) agree within 1e-4 of max|x| over a warm sequence. */
static void fast_path_agrees_with_reference(void **state)
{
    (void)state;
    enum { B = 3, C = 12, HW = 150, N = B * C * HW };
    static float x[N], yf[N], yr[N];
    int64_t shape[4] = {B, C, 10, 15};
    const char *specs[] = {"poweriter:rank=3,shared=1", "poweriter:rank=6,iters=2,shared=1",
                           "poweriter:rank=2,factors=fp16,shared=1"};
    for (size_t s = 0; s < 3; s++) {
        epipe_codec *f, *r;
        assert_int_equal(epipe_codec_create(&f, specs[s]), EPIPE_OK);
        assert_int_equal(epipe_codec_create(&r, specs[s]), EPIPE_OK);
        assert_true(epipe_codec_use_reference(r, 1));
        for (int t = 0; t < 3; t++) {
            low_rank(x, B, C, HW, 8, 0.05, 10 + (uint64_t)t);
            size_t lf, lr;
            free(roundtrip(f, x, yf, shape, 4, &lf));
            free(roundtrip(r, x, yr, shape, 4, &lr));
            assert_int_equal(lf, lr);
            double d = 0, xm = 0;
            for (int i = 0; i < N; i++) {
                d = fmax(d, fabs((double)yf[i] - yr[i]));
                xm = fmax(xm, fabs((double)x[i]));
            }
            if (!(d <= 1e-4 * xm))
                fail_msg("%s call %d: fast and reference differ by %g (max|x| %g)", specs[s], t, d,
                         xm);
        }
        epipe_codec_destroy(f);
        epipe_codec_destroy(r);
    }
}

/* The module's orthonormalisation: CholeskyQR2 with the shared functions
 * (G = QᵀQ in float as cuBLAS computes it, in double here), and the host's
 * Householder QR for a Q the Cholesky refuses. 0, or the QR's status. */
static int cholesky_qr2(float *q, unsigned rows, unsigned r)
{
    float *g = malloc(sizeof(float) * r * r), *R = malloc(sizeof(float) * r * r);
    int refused = 0;
    for (int pass = 0; pass < 2 && !refused; pass++) {
        for (unsigned i = 0; i < r; i++)
            for (unsigned j = 0; j < r; j++) {
                double acc = 0;
                for (unsigned k = 0; k < rows; k++)
                    acc += (double)q[k + i * rows] * q[k + j * rows];
                g[i + j * r] = (float)acc;
            }
        refused = epipe_hd_pi_chol(g, r, R);
        for (unsigned k = 0; k < rows && !refused; k++)
            epipe_hd_pi_solve_row(q + k, rows, r, R);
    }
    free(g), free(R);
    return refused;
}

/* CholeskyQR2 gives the Q of the CPU's Householder QR (signs flipped so R's
 * diagonal is positive) within 1e-5, with orthonormal columns, on well
 * and moderately conditioned Q; and refuses a rank-deficient or zero Q,
 * which the host's QR then takes. */
static void cholesky_qr_matches_householder(void **state)
{
    (void)state;
    epipe_codec *c;
    assert_int_equal(epipe_codec_create(&c, "poweriter:rank=8"), EPIPE_OK);
    int64_t shape[2] = {300, 40};
    c->ndim = 2;
    memcpy(c->shape, shape, sizeof shape);
    enum { ROWS = 300 };
    static float q[ROWS * 8], h[ROWS * 8];
    const unsigned ranks[] = {1, 3, 8};
    for (unsigned t = 0; t < 3; t++)
        for (int scaled = 0; scaled < 2; scaled++) {
            unsigned r = ranks[t];
            uint64_t s = 99 + t;
            for (unsigned i = 0; i < ROWS * r; i++) {
                s = s * 6364136223846793005ull + 1442695040888963407ull;
                q[i] = (float)((double)(s >> 11) / 9007199254740992.0 - 0.5);
                if (scaled) /* columns 1 to 100 apart: condition number about 100 */
                    q[i] *= (float)pow(10.0, 2.0 * (i / ROWS) / (r > 1 ? r - 1 : 1));
            }
            memcpy(h, q, sizeof(float) * ROWS * r);
            assert_int_equal(epipe_pi_cuda_orthonormalize(c, h, ROWS, r, 0), EPIPE_OK);
            assert_int_equal(cholesky_qr2(q, ROWS, r), 0);
            double d = 0, o = 0;
            for (unsigned i = 0; i < ROWS * r; i++)
                d = fmax(d, fabs((double)q[i] - h[i]));
            for (unsigned i = 0; i < r; i++)
                for (unsigned j = 0; j < r; j++) {
                    double acc = 0;
                    for (unsigned k = 0; k < ROWS; k++)
                        acc += (double)q[k + i * ROWS] * q[k + j * ROWS];
                    o = fmax(o, fabs(acc - (i == j)));
                }
            if (!(d <= 1e-5) || !(o <= 1e-5))
                fail_msg("rank %u%s: %g from Householder, %g from orthonormal", r,
                         scaled ? " scaled" : "", d, o);
        }
    /* columns of very different lengths but well apart in angle (Q of a
     * warm start: about sigma_k u_k): accepted, and the Householder Q */
    for (unsigned t = 0; t < 2; t++) {
        const unsigned r = 3;
        const double spread[] = {1e4, 1e9};
        uint64_t s = 7 + t;
        for (unsigned i = 0; i < ROWS * r; i++) {
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            q[i] = (float)((double)(s >> 11) / 9007199254740992.0 - 0.5) /
                   (float)pow(spread[t], (double)(i / ROWS) / (r - 1));
        }
        memcpy(h, q, sizeof(float) * ROWS * r);
        assert_int_equal(epipe_pi_cuda_orthonormalize(c, h, ROWS, r, 0), EPIPE_OK);
        assert_int_equal(cholesky_qr2(q, ROWS, r), 0);
        double d = 0;
        for (unsigned i = 0; i < ROWS * r; i++)
            d = fmax(d, fabs((double)q[i] - h[i]));
        if (!(d <= 1e-5))
            fail_msg("columns %g apart in length: %g from Householder", spread[t], d);
    }
    /* a column too short to sum in fp32 (length 1e-16): the host's QR */
    for (unsigned i = 0; i < ROWS; i++)
        q[i + 2 * ROWS] = q[i + 2 * ROWS] * 1e-16f;
    assert_int_equal(cholesky_qr2(q, ROWS, 3), 1);
    /* a repeated column, and zeros: refused */
    for (unsigned i = 0; i < ROWS; i++)
        q[i + ROWS] = q[i];
    assert_int_equal(cholesky_qr2(q, ROWS, 3), 1);
    memset(q, 0, sizeof q);
    assert_int_equal(cholesky_qr2(q, ROWS, 3), 1);
    float nanq[4] = {NAN, 1, 0, 1};
    assert_int_equal(cholesky_qr2(nanq, 2, 2), 1);
    epipe_codec_destroy(c);
}

/* The host's part of the CUDA backend (cuda/poweriter.cu keeps the warm
 * starts in device memory and does the rest in kernels): a slot is warm
 * for the module only after it committed that view, cold again after a
 * failed encode, a new view or a CPU encode, and a CPU encode never starts
 * from what the module committed; the refusals of factors carry the CPU
 * encoder's messages; the header check is the CPU decoder's. */
static void cuda_host_side(void **state)
{
    (void)state;
    enum { B = 4, R = 12, C = 40, N = B * R * C };
    static float x[N];
    static uint8_t pw[1 << 16], pf[1 << 16];
    epipe_codec *c, *fresh, *off;
    assert_int_equal(epipe_codec_create(&c, "poweriter:rank=3"), EPIPE_OK);
    assert_int_equal(epipe_codec_create(&fresh, "poweriter:rank=3"), EPIPE_OK);
    assert_int_equal(epipe_codec_create(&off, "poweriter:rank=3,warm=0"), EPIPE_OK);
    int64_t shape[3] = {B, R, C};
    c->ndim = off->ndim = 3;
    memcpy(c->shape, shape, sizeof shape);
    memcpy(off->shape, shape, sizeof shape);
    int index = 0, warm = 1;
    assert_int_equal(epipe_pi_cuda_slot(off, N, &index, &warm), EPIPE_OK);
    assert_true(index == -1 && warm == 0);
    epipe_pi_cuda_commit(off, N, 1); /* no slot: nothing to mark */

    c->microbatch = 300; /* slots wrap at 256 */
    assert_int_equal(epipe_pi_cuda_slot(c, N, &index, &warm), EPIPE_OK);
    assert_true(index == 300 % 256 && warm == 0);
    epipe_pi_cuda_commit(c, N, 1);
    assert_int_equal(epipe_pi_cuda_slot(c, N, &index, &warm), EPIPE_OK);
    assert_true(index == 300 % 256 && warm == 1);
    int64_t half[3] = {B, R, C / 2}; /* another view */
    memcpy(c->shape, half, sizeof half);
    assert_int_equal(epipe_pi_cuda_slot(c, N / 2, &index, &warm), EPIPE_OK);
    assert_int_equal(warm, 0);
    assert_int_equal(epipe_pi_cuda_slot(c, N, &index, &warm), EPIPE_EOVERFLOW); /* not its n */
    memcpy(c->shape, shape, sizeof shape);
    epipe_pi_cuda_commit(c, N, 0); /* a failed encode */
    assert_int_equal(epipe_pi_cuda_slot(c, N, &index, &warm), EPIPE_OK);
    assert_int_equal(warm, 0);

    /* committed by the module, then encoded on the CPU: the CPU starts
     * cold (a fresh codec's payload), and the module's slot is cold */
    epipe_pi_cuda_commit(c, N, 1);
    low_rank(x, B, R, C, 6, 0.05, 41);
    DLTensor t = view(x, shape, 3);
    size_t w = 0, wf = 0;
    fresh->microbatch = 300;
    assert_int_equal(epipe_codec_encode(c, &t, pw, sizeof pw, &w), EPIPE_OK);
    assert_int_equal(epipe_codec_encode(fresh, &t, pf, sizeof pf, &wf), EPIPE_OK);
    assert_true(w == wf && memcmp(pw, pf, w) == 0);
    assert_int_equal(epipe_pi_cuda_slot(c, N, &index, &warm), EPIPE_OK);
    assert_int_equal(warm, 0);

    /* the refusals, with the CPU encoder's messages */
    assert_int_equal(epipe_pi_cuda_refuse(c, N, 2, 0, 0.0f), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_codec_last_error(c), "matrix 2: the power iteration gave "
                                                      "non-finite factors"));
    assert_int_equal(epipe_pi_cuda_refuse(c, N, 3, 1, 3e38f), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_codec_last_error(c), "matrix 3: its factors overflow (scale"));

    /* the header: the CPU's passes, another view's does not */
    assert_int_equal(epipe_pi_cuda_check_header(c, pw + 16, N), EPIPE_OK);
    pw[16] = 2; /* rank 2 */
    assert_int_equal(epipe_pi_cuda_check_header(c, pw + 16, N), EPIPE_EPROTO);
    assert_non_null(strstr(epipe_codec_last_error(c), "payload holds 4 matrices 12x40 at rank 2"));
    epipe_codec_destroy(c);
    epipe_codec_destroy(fresh);
    epipe_codec_destroy(off);
}

static void expect_spec_error(const char *spec, const char *needle)
{
    epipe_codec *c = (epipe_codec *)1;
    int rc = epipe_codec_create(&c, spec);
    if (rc != EPIPE_EINVAL || c != NULL || !strstr(epipe_last_error(), needle))
        fail_msg("spec '%s': rc %d, message '%s', expected EINVAL mentioning '%s'", spec, rc,
                 epipe_last_error(), needle);
}

static void spec_errors_name_the_key(void **state)
{
    (void)state;
    expect_spec_error("poweriter", "'rank'");
    expect_spec_error("poweriter:iters=2", "'rank'");
    expect_spec_error("poweriter:rank=0", "'rank'");
    expect_spec_error("poweriter:rank=257", "'rank'");
    expect_spec_error("poweriter:rank=2.5", "'rank'");
    expect_spec_error("poweriter:rank=3,iters=0", "'iters'");
    expect_spec_error("poweriter:rank=3,warm=2", "'warm'");
    expect_spec_error("poweriter:rank=3,factors=bf16", "'factors'");
    expect_spec_error("poweriter:rank=3,size=4", "'size'");
    epipe_codec *c;
    assert_int_equal(epipe_codec_create(&c, "poweriter:rank=3"), EPIPE_OK);
    assert_string_equal(epipe_codec_spec(c), "poweriter:rank=3,iters=1,warm=1,factors=fp32");
    assert_int_equal(epipe_codec_id(c), 7);
    /* Non-finite input is named by its index; huge values are refused. */
    float x[64];
    int64_t shape[3] = {1, 8, 8};
    for (int i = 0; i < 64; i++)
        x[i] = (float)i;
    x[37] = NAN;
    DLTensor t = view(x, shape, 3);
    uint8_t buf[1024];
    size_t n;
    for (int ref = 0; ref < 2; ref++) {
        assert_true(epipe_codec_use_reference(c, ref));
        assert_int_equal(epipe_codec_encode(c, &t, buf, sizeof buf, &n), EPIPE_EINVAL);
        assert_non_null(strstr(epipe_codec_last_error(c), "index 37 is NaN"));
    }
    for (int i = 0; i < 64; i++)
        x[i] = 3e38f;
    assert_int_equal(epipe_codec_encode(c, &t, buf, sizeof buf, &n), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_codec_last_error(c), "overflow"));
    epipe_codec_destroy(c);
}

static void expect_rejected(epipe_codec *c, const uint8_t *p, size_t len, DLTensor *t,
                            const char *needle)
{
    for (int ref = 0; ref < 2; ref++) {
        assert_true(epipe_codec_use_reference(c, ref));
        int rc = epipe_codec_decode(c, p, len, t);
        if (rc != EPIPE_EPROTO || !strstr(epipe_codec_last_error(c), needle))
            fail_msg("rc %d, message '%s', expected EPROTO mentioning '%s'", rc,
                     epipe_codec_last_error(c), needle);
    }
}

static void put_f32(uint8_t *p, float f)
{
    union {
        float f;
        uint32_t u;
    } b = {.f = f};
    epipe_put_u32(p, b.u);
}

static void corrupt_payloads_are_rejected(void **state)
{
    (void)state;
    enum { B = 2, T = 6, D = 10, N = B * T * D };
    float x[N], y[N];
    int64_t shape[3] = {B, T, D};
    low_rank(x, B, T, D, 3, 0.1, 7);
    for (int f = 0; f < 2; f++) {
        epipe_codec *c;
        assert_int_equal(epipe_codec_create(&c, f ? "poweriter:rank=2,factors=fp16,shared=1"
                                                  : "poweriter:rank=2,shared=1"),
                         EPIPE_OK);
        size_t len, es = f ? 2 : 4;
        uint8_t *good = roundtrip(c, x, y, shape, 3, &len);
        /* 16-byte header, 32-byte body header, then B records. */
        assert_int_equal(len, 16 + 32 + B * (4 + (T + D) * 2 * es));
        uint8_t *p = malloc(len);
        DLTensor t = view(y, shape, 3);
        const size_t body = 16, rec0 = body + 32, q0 = rec0 + 4, p0 = q0 + T * 2 * es;
#define RESET() memcpy(p, good, len)
        RESET();
        p[body + 4] = 1;
        expect_rejected(c, p, len, &t, "reserved");
        RESET();
        p[body] = 1; /* rank */
        expect_rejected(c, p, len, &t, "rank");
        RESET();
        p[body + 16] ^= 3; /* rows */
        expect_rejected(c, p, len, &t, "dst views as");
        RESET();
        put_f32(p + rec0, NAN);
        expect_rejected(c, p, len, &t, "scale");
        RESET();
        put_f32(p + rec0, -1.0f);
        expect_rejected(c, p, len, &t, "scale");
        RESET();
        put_f32(p + rec0, 3e38f);
        expect_rejected(c, p, len, &t, "scale");
        RESET();
        if (f) {
            p[q0] = 0x00, p[q0 + 1] = 0x7c; /* fp16 +inf */
            expect_rejected(c, p, len, &t, "Q[0][0]");
            RESET();
            p[p0 + 2] = 0x00, p[p0 + 3] = 0x3e; /* 1.5 */
            expect_rejected(c, p, len, &t, "P[0][1]");
        } else {
            put_f32(p + q0, 1.5f);
            expect_rejected(c, p, len, &t, "Q[0][0]");
            RESET();
            put_f32(p + p0 + 4, NAN);
            expect_rejected(c, p, len, &t, "P[0][1]");
        }
        RESET();
        assert_int_equal(epipe_codec_decode(c, p, len - 1, &t), EPIPE_ETRUNC);
        /* dst viewed differently: [B*T, D] is one matrix of another size. */
        int64_t flat[2] = {B * T, D};
        DLTensor tf = view(y, flat, 2);
        assert_int_not_equal(epipe_codec_decode(c, p, len, &tf), EPIPE_OK);
        assert_int_equal(epipe_codec_decode(c, p, len, &t), EPIPE_OK);
#undef RESET
        free(p);
        free(good);
        epipe_codec_destroy(c);
    }
}

/* Body sizes follow the documented views, and every view round-trips. */
static void shapes_and_views(void **state)
{
    (void)state;
    static float x[4096], y[4096];
    static const struct {
        int ndim;
        int64_t shape[4];
        uint64_t nb, rows, cols;
    } cases[] = {
        {4, {2, 3, 4, 5}, 2, 3, 20}, /* [B,C,H,W] -> B x [C, HW] */
        {3, {2, 7, 9}, 2, 7, 9},     /* [B,T,D] -> B x [T, D] */
        {2, {6, 11}, 1, 6, 11},      /* [B,D] -> one [B, D] */
        {1, {13}, 1, 1, 13},         /* 1-D -> one row */
        {0, {0}, 1, 1, 1},           /* scalar */
        {3, {0, 4, 4}, 0, 4, 4},     /* empty */
        {2, {5, 0}, 1, 5, 0},        /* empty */
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        size_t n = numel(cases[k].shape, cases[k].ndim);
        test_fill(x, n, DIST_NORMAL, 20 + k);
        epipe_codec *c;
        assert_int_equal(epipe_codec_create(&c, "poweriter:rank=4,shared=1"), EPIPE_OK);
        int64_t shape[4];
        memcpy(shape, cases[k].shape, sizeof shape);
        size_t len;
        uint8_t *p = roundtrip(c, x, y, shape, cases[k].ndim, &len);
        uint64_t r = 4;
        r = r < cases[k].rows ? r : cases[k].rows;
        r = r < cases[k].cols ? r : cases[k].cols;
        if (cases[k].nb == 0)
            r = 0;
        size_t want = 16 + 32 +
                      (r ? cases[k].nb * (4 + (cases[k].rows + cases[k].cols) * r * 4) : 0);
        assert_int_equal(len, want);
        assert_int_equal(epipe_get_u32(p + 16), r);
        assert_int_equal(epipe_get_u64(p + 24), cases[k].nb);
        assert_int_equal(epipe_get_u64(p + 32), cases[k].rows);
        assert_int_equal(epipe_get_u64(p + 40), cases[k].cols);
        /* rank >= min(rows, cols) is clamped and then lossless (up to rounding) */
        if (r && r == (cases[k].rows < cases[k].cols ? cases[k].rows : cases[k].cols))
            assert_true(frob_err(x, y, n) <= 1e-5 * frob(x, n) + 1e-30);
        free(p);
        epipe_codec_destroy(c);
    }
}

/* A matrix of zeros or of values below FLT_MIN (a vanishing gradient)
 * encodes to finite factors and decodes to (near) zero, not NaN. */
static void tiny_and_zero_matrices(void **state)
{
    (void)state;
    enum { B = 3, R = 8, C = 16 };
    float x[B * R * C], y[B * R * C];
    int64_t shape[3] = {B, R, C};
    for (int i = 0; i < B * R * C; i++)
        x[i] = i < R * C ? 0.0f : i < 2 * R * C ? (i % C == 3 ? 3e-40f : 0.0f) : (float)(i % 7) - 3;
    for (int ref = 0; ref < 2; ref++) {
        epipe_codec *c;
        assert_int_equal(epipe_codec_create(&c, "poweriter:rank=2,shared=1"), EPIPE_OK);
        assert_true(epipe_codec_use_reference(c, ref));
        size_t len;
        free(roundtrip(c, x, y, shape, 3, &len));
        free(roundtrip(c, x, y, shape, 3, &len)); /* again, from the warm start it kept */
        for (int i = 0; i < 2 * R * C; i++)
            assert_true(fabsf(y[i]) < 1e-30f);
        for (int i = 2 * R * C; i < B * R * C; i++)
            assert_true(isfinite(y[i]));
        epipe_codec_destroy(c);
    }
}

/* A 2-D [B,D] tensor is one matrix whose factors its B rows (samples)
 * would share: below rank B it is refused by name, with what to use
 * instead; at rank >= B, with shared=1, or as per-sample matrices it is
 * coded. */
static void shared_rows_refused(void **state)
{
    (void)state;
    float x[16 * 128], y[16 * 128];
    for (int i = 0; i < 16 * 128; i++)
        x[i] = (float)((i * 37) % 101) / 50.0f - 1.0f;
    int64_t flat[2] = {16, 128}, per_sample[3] = {16, 8, 16};
    uint8_t buf[65536];
    size_t n;
    for (int ref = 0; ref < 2; ref++) {
        epipe_codec *c;
        assert_int_equal(epipe_codec_create(&c, "poweriter:rank=4"), EPIPE_OK);
        assert_true(epipe_codec_use_reference(c, ref));
        DLTensor t = view(x, flat, 2);
        assert_int_equal(epipe_codec_encode(c, &t, buf, sizeof buf, &n), EPIPE_EINVAL);
        const char *msg = epipe_codec_last_error(c);
        if (!strstr(msg, "[16,128]") || !strstr(msg, "all 16 rows") || !strstr(msg, "shared=1") ||
            !strstr(msg, "[B,C,H,W]"))
            fail_msg("message '%s' does not say why and what to use instead", msg);
        t = view(x, per_sample, 3); /* 16 matrices [8,16]: each sample its own factors */
        assert_int_equal(epipe_codec_encode(c, &t, buf, sizeof buf, &n), EPIPE_OK);
        epipe_codec_destroy(c);
    }
    const char *fine[] = {"poweriter:rank=16", "poweriter:rank=4,shared=1"};
    for (int k = 0; k < 2; k++) {
        epipe_codec *c;
        assert_int_equal(epipe_codec_create(&c, fine[k]), EPIPE_OK);
        size_t len;
        free(roundtrip(c, x, y, flat, 2, &len));
        if (k == 1)
            assert_string_equal(epipe_codec_spec(c),
                                "poweriter:rank=4,iters=1,warm=1,factors=fp32,shared=1");
        epipe_codec_destroy(c);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(shared_rows_refused),
        cmocka_unit_test(near_best_rank_r_error),
        cmocka_unit_test(tiny_and_zero_matrices),
        cmocka_unit_test(exact_on_rank_r_data),
        cmocka_unit_test(warm_start_lowers_error),
        cmocka_unit_test(warm_start_per_slot_and_shape),
        cmocka_unit_test(fast_path_agrees_with_reference),
        cmocka_unit_test(cholesky_qr_matches_householder),
        cmocka_unit_test(cuda_host_side),
        cmocka_unit_test(spec_errors_name_the_key),
        cmocka_unit_test(corrupt_payloads_are_rejected),
        cmocka_unit_test(shapes_and_views),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
