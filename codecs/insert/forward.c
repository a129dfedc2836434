/* insert's forward: the code bytes (fp32 or fp16), compress (encode) and
 * restore (decode), one GEMM per patch block in the system BLAS. */
#include <cblas.h>
#include <math.h>
#include <string.h>

#include "insert.h"

/* ---- code bytes ---------------------------------------------------------- */

static void put_code(const epipe_codec *c, const float *z, size_t n, uint8_t *out)
{
    if (c->p[I_CODE] == CODE_F16) {
        for (size_t i = 0; i < n; i++) {
            uint16_t h = epipe_f32_to_f16(z[i]);
            out[2 * i] = (uint8_t)h, out[2 * i + 1] = (uint8_t)(h >> 8);
        }
    } else {
        memcpy(out, z, n * 4); /* little-endian host (meson.build) */
    }
}

/* Reads n code values; EPIPE_EPROTO for a NaN or infinity: an encoder
 * never writes one (it refuses non-finite input, and codes beyond the fp16
 * range with code=fp16). */
static int get_code(epipe_codec *c, const uint8_t *in, size_t n, float *z, size_t base)
{
    if (c->p[I_CODE] == CODE_F16) {
        for (size_t i = 0; i < n; i++) {
            uint16_t h = (uint16_t)(in[2 * i] | in[2 * i + 1] << 8);
            if ((h & 0x7c00) == 0x7c00)
                return epipe_codec_fail(c, EPIPE_EPROTO,
                                        "insert: code value %zu is fp16 NaN or infinity (0x%04x)",
                                        base + i, h);
            z[i] = epipe_f16_to_f32(h);
        }
        return EPIPE_OK;
    }
    memcpy(z, in, n * 4);
    size_t bad = epipe_find_nonfinite(z, n);
    if (bad < n)
        return epipe_codec_fail(c, EPIPE_EPROTO, "insert: code value %zu is not finite",
                                base + bad);
    return EPIPE_OK;
}

static int check_code_range(epipe_codec *c, const float *z, size_t n)
{
    if (c->p[I_CODE] != CODE_F16)
        return EPIPE_OK;
    for (size_t i = 0; i < n; i++)
        if (!(fabsf(z[i]) < 65520.0f))
            return epipe_codec_fail(c, EPIPE_EINVAL,
                                    "insert: code value %zu (%g) does not fit fp16 (code=fp16)", i,
                                    (double)z[i]);
    return EPIPE_OK;
}

/* ---- encode and decode ------------------------------------------------- */

/* A NaN or infinity in the input always makes one in the code (x*w is
 * inf or NaN for any w), so checking the code, 1/ratio times smaller,
 * finds bad input; the input is scanned only then, to name the index. */
static int refuse_nonfinite(epipe_codec *c, const float *x, size_t n)
{
    size_t bad = epipe_find_nonfinite(x, n);
    if (bad < n)
        return epipe_codec_fail(c, EPIPE_EINVAL, "insert: value at index %zu is not finite", bad);
    return epipe_codec_fail(c, EPIPE_EINVAL,
                            "insert: the code overflows fp32 (the input is too large)");
}

/* The code of x (c->shape) into z, all of it: the encoder, and the first
 * link of a chain. Keeps x for the backward when EPIPE_CODEC_MICROBATCH is
 * set. Refuses non-finite input (and, with code=fp16, codes beyond fp16). */
int epipe_insert_forward_code(epipe_codec *c, const float *x, size_t n, float *z)
{
    struct insert_state *st = S(c);
    struct geom g;
    int rc = epipe_insert_geometry(c, c->shape, c->ndim, &g);
    if (rc || (rc = epipe_insert_ensure_params(c, g.cin)))
        return rc;
    int64_t k = kern(c), K = g.K, P = g.P, Sn = g.S, B = g.B;
    if (c->microbatch >= 0) { /* keep the input for the backward */
        struct slot *keep = epipe_insert_cache_take(&st->enc, c->microbatch, n);
        if (!keep)
            return epipe_codec_fail(c, EPIPE_ENOMEM, "insert: no memory to keep the input");
        keep->ndim = c->ndim;
        memcpy(keep->shape, c->shape, sizeof(int64_t) * (size_t)c->ndim);
        memcpy(keep->buf, x, n * sizeof(float));
    }
    size_t zn = (size_t)(B * K * Sn);
    if (kind(c) == KIND_LINEAR) {
        /* Z [N][d] = X [N][D] E^T */
        if (B)
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)B, (int)K, (int)P, 1.0f, x,
                        (int)P, st->w[0], (int)P, 0.0f, z, (int)K);
    } else {
        int64_t rb = epipe_insert_block_rows(&g);
        float *cols = epipe_insert_grow(&st->tmp, &st->tmp_cap, (size_t)(P * rb * g.Wo));
        if (!cols)
            return epipe_codec_fail(c, EPIPE_ENOMEM, "insert: no scratch memory");
        size_t per_in = (size_t)(g.cin * g.H * g.W), per_z = (size_t)(K * Sn);
        for (int64_t b = 0; b < B; b++)
            for (int64_t i0 = 0; i0 < g.Ho; i0 += rb) {
                int64_t i1 = i0 + rb < g.Ho ? i0 + rb : g.Ho, ns = (i1 - i0) * g.Wo;
                epipe_insert_im2col(x + (size_t)b * per_in, &g, k, i0, i1, cols);
                /* Zb[:, block] [K][ns] = E [K][P] . cols [P][ns] */
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)K, (int)ns, (int)P,
                            1.0f, st->w[0], (int)P, cols, (int)ns, 0.0f,
                            z + (size_t)b * per_z + i0 * g.Wo, (int)Sn);
            }
    }
    if (epipe_find_nonfinite(z, zn) < zn)
        return refuse_nonfinite(c, x, n);
    return check_code_range(c, z, zn);
}

/* y (c->shape) restored from the code z: the decoder, and the first link
 * of a chain. Keeps z for the backward when EPIPE_CODEC_MICROBATCH is set
 * (z may already be the kept copy). */
int epipe_insert_restore_code(epipe_codec *c, const float *z, float *y)
{
    struct insert_state *st = S(c);
    struct geom g;
    int rc = epipe_insert_geometry(c, c->shape, c->ndim, &g);
    if (rc || (rc = epipe_insert_ensure_params(c, g.cin)))
        return rc;
    int64_t k = kern(c), K = g.K, P = g.P, Sn = g.S, B = g.B;
    size_t zn_all = (size_t)(B * K * Sn);
    if (c->microbatch >= 0) {
        struct slot *keep = epipe_insert_cache_find(&st->dec, c->microbatch);
        if (!keep || keep->buf != z) {
            if (!(keep = epipe_insert_cache_take(&st->dec, c->microbatch, zn_all)))
                return epipe_codec_fail(c, EPIPE_ENOMEM, "insert: no memory to keep the code");
            memcpy(keep->buf, z, zn_all * sizeof(float));
        }
        keep->ndim = c->ndim;
        memcpy(keep->shape, c->shape, sizeof(int64_t) * (size_t)c->ndim);
    }
    if (kind(c) == KIND_LINEAR) {
        /* Y [N][D] = Z [N][d] Rt [d][D] */
        if (B)
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)B, (int)P, (int)K, 1.0f, z,
                        (int)K, st->w[1], (int)P, 0.0f, y, (int)P);
        return EPIPE_OK;
    }
    int64_t rb = epipe_insert_block_rows(&g);
    size_t zn = (size_t)(K * Sn), per_out = (size_t)(g.cin * g.H * g.W);
    float *cols = epipe_insert_grow(&st->tmp, &st->tmp_cap, (size_t)(P * rb * g.Wo));
    if (!cols)
        return epipe_codec_fail(c, EPIPE_ENOMEM, "insert: no scratch memory");
    for (int64_t b = 0; b < B; b++)
        for (int64_t i0 = 0; i0 < g.Ho; i0 += rb) {
            int64_t i1 = i0 + rb < g.Ho ? i0 + rb : g.Ho, ns = (i1 - i0) * g.Wo;
            /* cols [P][ns] = Rt^T [P][K] . Zb[:, block] [K][ns] */
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)P, (int)ns, (int)K, 1.0f,
                        st->w[1], (int)P, z + (size_t)b * zn + i0 * g.Wo, (int)Sn, 0.0f, cols,
                        (int)ns);
            epipe_insert_col2im(cols, &g, k, i0, i1, y + (size_t)b * per_out);
        }
    return EPIPE_OK;
}

int epipe_insert_encode(epipe_codec *c, const float *x, size_t n, uint8_t *body)
{
    struct insert_state *st = S(c);
    struct geom g;
    int rc = epipe_insert_geometry(c, c->shape, c->ndim, &g);
    if (rc)
        return rc;
    size_t zn = (size_t)(g.B * g.K * g.S);
    float *z = epipe_insert_grow(&st->tmp2, &st->tmp2_cap, zn ? zn : 1);
    if (!z)
        return epipe_codec_fail(c, EPIPE_ENOMEM, "insert: no scratch memory");
    if ((rc = epipe_insert_forward_code(c, x, n, z)))
        return rc;
    put_code(c, z, zn, body);
    return EPIPE_OK;
}

int epipe_insert_decode(epipe_codec *c, const uint8_t *body, size_t n, float *y)
{
    struct insert_state *st = S(c);
    struct geom g;
    (void)n;
    int rc = epipe_insert_geometry(c, c->shape, c->ndim, &g);
    if (rc)
        return rc;
    size_t zn = (size_t)(g.B * g.K * g.S);
    /* Read the code straight into the slot the backward will use. */
    struct slot *keep = NULL;
    if (c->microbatch >= 0 && !(keep = epipe_insert_cache_take(&st->dec, c->microbatch, zn)))
        return epipe_codec_fail(c, EPIPE_ENOMEM, "insert: no memory to keep the code");
    float *z = keep ? keep->buf : epipe_insert_grow(&st->tmp2, &st->tmp2_cap, zn ? zn : 1);
    if (!z)
        return epipe_codec_fail(c, EPIPE_ENOMEM, "insert: no scratch memory");
    if ((rc = get_code(c, body, zn, z, 0)) || (rc = epipe_insert_restore_code(c, z, y))) {
        if (keep)
            keep->key = -1;
        return rc;
    }
    return EPIPE_OK;
}
