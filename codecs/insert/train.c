/* insert's training: the backward passes through compress and restore, the
 * parameter tensors the host sees, and the codec's own SGD step. */
#include <cblas.h>
#include <stdlib.h>
#include <string.h>

#include "../../lib/codec/cuda_api.h"
#include "insert.h"

/* ---- training ------------------------------------------------------------ */

static int same_shape(const int64_t *a, int na, const int64_t *b, int nb)
{
    return na == nb && memcmp(a, b, sizeof(int64_t) * (size_t)na) == 0;
}

int epipe_insert_code_shape(epipe_codec *c, const int64_t *shape, int ndim, int64_t *out,
                            int *out_ndim)
{
    struct geom g;
    int rc = epipe_insert_geometry(c, shape, ndim, &g);
    if (rc)
        return rc;
    memcpy(out, shape, sizeof(int64_t) * (size_t)ndim);
    if (kind(c) == KIND_CONV)
        out[1] = g.K, out[2] = g.Ho, out[3] = g.Wo;
    else
        out[ndim - 1] = g.K;
    *out_ndim = ndim;
    return EPIPE_OK;
}

static int check_backward_shapes(epipe_codec *c, const struct slot *s, const char *what,
                                 const int64_t *code_shape, int code_ndim,
                                 const int64_t *full_shape, int full_ndim)
{
    int64_t want[EPIPE_MAX_NDIM];
    int wn;
    int rc = epipe_insert_code_shape(c, s->shape, s->ndim, want, &wn);
    if (rc)
        return rc;
    if (!same_shape(want, wn, code_shape, code_ndim))
        return epipe_codec_fail(c, EPIPE_EINVAL,
                                "insert: the code gradient's shape differs from the code of "
                                "micro-batch %lld's %s",
                                (long long)s->key, what);
    if (!same_shape(s->shape, s->ndim, full_shape, full_ndim))
        return epipe_codec_fail(c, EPIPE_EINVAL,
                                "insert: the %s gradient's shape differs from micro-batch %lld's "
                                "tensor",
                                what, (long long)s->key);
    return EPIPE_OK;
}

/* The same checks for the CUDA module, which keeps its own slots. */
int epipe_insert_cuda_check_backward(epipe_codec *c, int64_t mb, const char *what,
                                     const int64_t *kept, int kept_ndim, const int64_t *code,
                                     int code_ndim, const int64_t *full, int full_ndim)
{
    struct slot s = {.key = mb, .ndim = kept_ndim};
    if (kept_ndim < 0 || kept_ndim > EPIPE_MAX_NDIM)
        return epipe_codec_fail(c, EPIPE_EINVAL, "insert: a kept tensor of %d dimensions",
                                kept_ndim);
    memcpy(s.shape, kept, sizeof(int64_t) * (size_t)kept_ndim);
    return check_backward_shapes(c, &s, what, code, code_ndim, full, full_ndim);
}

static int no_cache(epipe_codec *c, const char *what, int64_t mb)
{
    return epipe_codec_fail(c, EPIPE_ESTATE,
                            "insert: no %s of micro-batch %lld is kept for its backward (set "
                            "EPIPE_CODEC_MICROBATCH to the micro-batch before the %s)",
                            what, (long long)mb, what);
}

int epipe_insert_encode_backward(epipe_codec *c, int64_t mb, const float *gz, const int64_t *zshape,
                                 int zndim, float *gx, const int64_t *xshape, int xndim)
{
    struct insert_state *st = S(c);
    struct slot *s = epipe_insert_cache_find(&st->enc, mb);
    if (!s)
        return no_cache(c, "encode", mb);
    int rc = check_backward_shapes(c, s, "input", zshape, zndim, xshape, xndim);
    struct geom g;
    if (rc || (rc = epipe_insert_geometry(c, s->shape, s->ndim, &g)))
        return rc;
    int64_t K = g.K, P = g.P, Sn = g.S, B = g.B, k = kern(c);
    if (kind(c) == KIND_LINEAR) {
        if (B) {
            /* dE [d][D] += gZ^T [d][N] X [N][D];  gX [N][D] = gZ [N][d] E [d][D] */
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)K, (int)P, (int)B, 1.0f, gz,
                        (int)K, s->buf, (int)P, 1.0f, st->g[0], (int)P);
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)B, (int)P, (int)K, 1.0f, gz,
                        (int)K, st->w[0], (int)P, 0.0f, gx, (int)P);
        }
        s->key = -1;
        return EPIPE_OK;
    }
    int64_t rb = epipe_insert_block_rows(&g);
    float *cols = epipe_insert_grow(&st->tmp, &st->tmp_cap, (size_t)(P * rb * g.Wo));
    if (!cols)
        return epipe_codec_fail(c, EPIPE_ENOMEM, "insert: no scratch memory");
    size_t zn = (size_t)(K * Sn), per = (size_t)(P * Sn);
    for (int64_t b = 0; b < B; b++)
        for (int64_t i0 = 0; i0 < g.Ho; i0 += rb) {
            int64_t i1 = i0 + rb < g.Ho ? i0 + rb : g.Ho, ns = (i1 - i0) * g.Wo;
            const float *gzb = gz + (size_t)b * zn + i0 * g.Wo;
            epipe_insert_im2col(s->buf + (size_t)b * per, &g, k, i0, i1, cols);
            /* dE [K][P] += gZb [K][ns] cols^T [ns][P];  gcols [P][ns] = E^T gZb */
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)K, (int)P, (int)ns, 1.0f, gzb,
                        (int)Sn, cols, (int)ns, 1.0f, st->g[0], (int)P);
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)P, (int)ns, (int)K, 1.0f,
                        st->w[0], (int)P, gzb, (int)Sn, 0.0f, cols, (int)ns);
            epipe_insert_col2im(cols, &g, k, i0, i1, gx + (size_t)b * per);
        }
    s->key = -1;
    return EPIPE_OK;
}

int epipe_insert_decode_backward(epipe_codec *c, int64_t mb, const float *gy, const int64_t *yshape,
                                 int yndim, float *gz, const int64_t *zshape, int zndim)
{
    struct insert_state *st = S(c);
    struct slot *s = epipe_insert_cache_find(&st->dec, mb);
    if (!s)
        return no_cache(c, "decode", mb);
    int rc = check_backward_shapes(c, s, "output", zshape, zndim, yshape, yndim);
    struct geom g;
    if (rc || (rc = epipe_insert_geometry(c, s->shape, s->ndim, &g)))
        return rc;
    int64_t K = g.K, P = g.P, Sn = g.S, B = g.B, k = kern(c);
    if (kind(c) == KIND_LINEAR) {
        if (B) {
            /* dRt [d][D] += Z^T [d][N] gY [N][D];  gZ [N][d] = gY [N][D] Rt^T [D][d] */
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)K, (int)P, (int)B, 1.0f,
                        s->buf, (int)K, gy, (int)P, 1.0f, st->g[1], (int)P);
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)B, (int)K, (int)P, 1.0f, gy,
                        (int)P, st->w[1], (int)P, 0.0f, gz, (int)K);
        }
        s->key = -1;
        return EPIPE_OK;
    }
    int64_t rb = epipe_insert_block_rows(&g);
    float *cols = epipe_insert_grow(&st->tmp, &st->tmp_cap, (size_t)(P * rb * g.Wo));
    if (!cols)
        return epipe_codec_fail(c, EPIPE_ENOMEM, "insert: no scratch memory");
    size_t zn = (size_t)(K * Sn), per = (size_t)(P * Sn);
    for (int64_t b = 0; b < B; b++)
        for (int64_t i0 = 0; i0 < g.Ho; i0 += rb) {
            int64_t i1 = i0 + rb < g.Ho ? i0 + rb : g.Ho, ns = (i1 - i0) * g.Wo;
            const float *zb = s->buf + (size_t)b * zn + i0 * g.Wo;
            epipe_insert_im2col(gy + (size_t)b * per, &g, k, i0, i1, cols);
            /* dRt [K][P] += Zb [K][ns] gcols^T [ns][P];  gZb [K][ns] = Rt [K][P] gcols [P][ns] */
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)K, (int)P, (int)ns, 1.0f, zb,
                        (int)Sn, cols, (int)ns, 1.0f, st->g[1], (int)P);
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)K, (int)ns, (int)P, 1.0f,
                        st->w[1], (int)P, cols, (int)ns, 0.0f, gz + (size_t)b * zn + i0 * g.Wo,
                        (int)Sn);
        }
    s->key = -1;
    return EPIPE_OK;
}

static int not_ready(epipe_codec *c)
{
    return epipe_codec_fail(c, EPIPE_ESTATE,
                            "insert: the parameters are created when the channel count is "
                            "known: give in=C (or in=D) in the spec, or encode or decode a "
                            "tensor first");
}

int epipe_insert_tensor(epipe_codec *c, unsigned i, const char **name, DLTensor **param,
                        DLTensor **grad)
{
    static const char *const names[2] = {"compress.weight", "restore.weight"};
    struct insert_state *st = S(c);
    if (!st->ready && c->p[I_IN] > 0) {
        int rc = epipe_insert_ensure_params(c, (int64_t)c->p[I_IN]);
        if (rc)
            return rc;
    }
    if (!st->ready)
        return not_ready(c);
    if (name)
        *name = names[i];
    if (param)
        *param = &st->wt[i];
    if (grad)
        *grad = &st->gt[i];
    return EPIPE_OK;
}

void epipe_insert_zero_grad(epipe_codec *c)
{
    struct insert_state *st = S(c);
    if (!st->ready)
        return;
    for (int i = 0; i < 2; i++)
        memset(st->g[i], 0, sizeof(float) * (size_t)(st->K * st->P));
}

int epipe_insert_sgd(epipe_codec *c, float lr, float momentum)
{
    struct insert_state *st = S(c);
    if (!st->ready)
        return EPIPE_OK; /* nothing trained yet */
    size_t n = (size_t)(st->K * st->P);
    for (int i = 0; i < 2; i++) {
        if (momentum != 0.0f && !st->mom[i]) {
            if (!(st->mom[i] = calloc(n, sizeof(float))))
                return epipe_codec_fail(c, EPIPE_ENOMEM, "insert: no memory for momentum");
        }
        float *w = st->w[i], *g = st->g[i], *v = st->mom[i];
        if (momentum != 0.0f) {
            for (size_t j = 0; j < n; j++) {
                v[j] = momentum * v[j] + g[j];
                w[j] -= lr * v[j];
            }
        } else {
            for (size_t j = 0; j < n; j++)
                w[j] -= lr * g[j];
        }
    }
    return EPIPE_OK;
}
