/* poweriter's payload: the body header and each matrix's record (its scale,
 * Q and P as fp32 or fp16), written by the encoders and checked on decode. */
#include <float.h>
#include <math.h>

#include "../inline/poweriter.h"
#include "poweriter.h"

/* ---- writing and reading records -------------------------------------- */

static void pi_put_f32(uint8_t *p, float f)
{
    union {
        float f;
        uint32_t u;
    } b = {.f = f};
    epipe_put_u32(p, b.u);
}

static float pi_get_f32(const uint8_t *p)
{
    union {
        float f;
        uint32_t u;
    } b = {.u = epipe_get_u32(p)};
    return b.f;
}

void epipe_pi_write_header(uint8_t *body, const pi_view *v)
{
    epipe_put_u32(body, v->r);
    epipe_put_u32(body + 4, 0);
    epipe_put_u64(body + 8, v->nb);
    epipe_put_u64(body + 16, v->rows);
    epipe_put_u64(body + 24, v->cols);
}

/* Writes a factor stored column-major (n x r) as row-major n x r values,
 * multiplied by mul and clamped to [-1, 1]. Returns the bytes written. */
static size_t pi_write_factor(uint8_t *out, const float *f, uint64_t n, unsigned r, float mul,
                              int fp16)
{
    size_t es = fp16 ? 2 : 4;
    for (uint64_t i = 0; i < n; i++)
        for (unsigned k = 0; k < r; k++) {
            float v = epipe_hd_pi_factor_value(f[(size_t)k * n + i], mul);
            uint8_t *o = out + (i * r + k) * es;
            if (fp16) {
                uint16_t h = epipe_f32_to_f16(v);
                o[0] = (uint8_t)h;
                o[1] = (uint8_t)(h >> 8);
            } else {
                pi_put_f32(o, v);
            }
        }
    return (size_t)n * r * es;
}

/* Matrix b's factors, from their largest |P| s and whether all of them
 * are finite: EPIPE_EINVAL naming it when they cannot be sent. */
int epipe_pi_check_factors(epipe_codec *c, uint64_t b, float s, int finite, unsigned r)
{
    if (!finite)
        return epipe_codec_fail(c, EPIPE_EINVAL,
                                "poweriter: matrix %llu: the power iteration gave non-finite "
                                "factors: its values overflow fp32 products (about 1e37 and "
                                "up cannot be sent as low-rank factors)",
                                (unsigned long long)b);
    if (!(s <= epipe_hd_pi_max_scale(r)))
        return epipe_codec_fail(c, EPIPE_EINVAL,
                                "poweriter: matrix %llu: its factors overflow (scale %g); values "
                                "this large (about 1e37 and up) cannot be sent as low-rank factors",
                                (unsigned long long)b, (double)s);
    return EPIPE_OK;
}

/* Writes matrix b's record: the scale s = max|P|, Q, then P / s. */
int epipe_pi_write_record(epipe_codec *c, const pi_view *v, uint64_t b, const float *q,
                          const float *p, uint8_t *rec)
{
    unsigned r = v->r;
    int fp16 = (int)c->p[PI_FACTORS] == PI_F16;
    float s = 0;
    int finite = 1;
    size_t np = (size_t)v->cols * r, nq = (size_t)v->rows * r;
    for (size_t i = 0; i < np; i++) {
        float a = fabsf(p[i]);
        finite &= a <= FLT_MAX;
        s = a > s ? a : s;
    }
    for (size_t i = 0; i < nq; i++)
        finite &= fabsf(q[i]) <= FLT_MAX;
    int rc = epipe_pi_check_factors(c, b, s, finite, r);
    if (rc)
        return rc;
    /* A matrix whose P is all below FLT_MIN (a vanishing gradient) is sent
     * as zero: 1/s would overflow to inf and make 0*inf = NaN factors. */
    if (s < FLT_MIN)
        s = 0;
    pi_put_f32(rec, s);
    size_t off = 4 + pi_write_factor(rec + 4, q, v->rows, r, 1.0f, fp16);
    pi_write_factor(rec + off, p, v->cols, r, s > 0 ? 1.0f / s : 0.0f, fp16);
    return EPIPE_OK;
}

int epipe_pi_check_header(epipe_codec *c, const uint8_t *body, const pi_view *v)
{
    uint32_t r = epipe_get_u32(body), res = epipe_get_u32(body + 4);
    uint64_t nb = epipe_get_u64(body + 8), rows = epipe_get_u64(body + 16),
             cols = epipe_get_u64(body + 24);
    if (res != 0)
        return epipe_codec_fail(c, EPIPE_EPROTO, "poweriter: reserved field is %u, not 0", res);
    if (r != v->r || nb != v->nb || rows != v->rows || cols != v->cols)
        return epipe_codec_fail(c, EPIPE_EPROTO,
                                "poweriter: payload holds %llu matrices %llux%llu at rank %u; "
                                "dst views as %llu matrices %llux%llu at rank %u",
                                (unsigned long long)nb, (unsigned long long)rows,
                                (unsigned long long)cols, r, (unsigned long long)v->nb,
                                (unsigned long long)v->rows, (unsigned long long)v->cols, v->r);
    return EPIPE_OK;
}

/* Reads a row-major n x r factor into column-major floats, rejecting any
 * value that is not finite or has |v| > 1. */
int epipe_pi_read_factor(epipe_codec *c, const uint8_t *in, uint64_t n, unsigned r, int fp16,
                         float *f, uint64_t b, const char *which)
{
    size_t es = fp16 ? 2 : 4;
    for (uint64_t i = 0; i < n; i++)
        for (unsigned k = 0; k < r; k++) {
            const uint8_t *o = in + (i * r + k) * es;
            float v = fp16 ? epipe_f16_to_f32((uint16_t)(o[0] | o[1] << 8)) : pi_get_f32(o);
            if (!epipe_hd_pi_factor_ok(v))
                return epipe_codec_fail(c, EPIPE_EPROTO,
                                        "poweriter: matrix %llu: %s[%llu][%u] is %g; factors "
                                        "must be finite and within [-1, 1]",
                                        (unsigned long long)b, which, (unsigned long long)i, k,
                                        (double)v);
            f[(size_t)k * n + i] = v;
        }
    return EPIPE_OK;
}

int epipe_pi_read_scale(epipe_codec *c, const uint8_t *rec, unsigned r, uint64_t b, float *s)
{
    *s = pi_get_f32(rec);
    if (!epipe_hd_pi_scale_ok(*s, r))
        return epipe_codec_fail(
            c, EPIPE_EPROTO, "poweriter: matrix %llu: scale %g is not in [0, %g]",
            (unsigned long long)b, (double)*s, (double)epipe_hd_pi_max_scale(r));
    return EPIPE_OK;
}

int epipe_pi_read_record(epipe_codec *c, const pi_view *v, uint64_t b, const uint8_t *rec, float *s,
                         float *q, float *p)
{
    int fp16 = (int)c->p[PI_FACTORS] == PI_F16;
    size_t qbytes = (size_t)v->rows * v->r * pi_esize(c);
    int rc;
    if ((rc = epipe_pi_read_scale(c, rec, v->r, b, s)) ||
        (rc = epipe_pi_read_factor(c, rec + 4, v->rows, v->r, fp16, q, b, "Q")))
        return rc;
    return epipe_pi_read_factor(c, rec + 4 + qbytes, v->cols, v->r, fp16, p, b, "P");
}

int epipe_pi_reject_nonfinite(epipe_codec *c, const float *x, size_t at)
{
    return epipe_codec_fail(c, EPIPE_EINVAL,
                            "poweriter: input value at index %zu is %s; poweriter needs finite "
                            "values",
                            at,
                            isnan(x[at]) ? "NaN"
                            : x[at] > 0  ? "+inf"
                                         : "-inf");
}
