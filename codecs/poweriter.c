/* `poweriter:rank=r[,iters=k][,warm=0|1][,factors=fp32|fp16]`: low-rank
 * compression by power (subspace) iteration, as in PowerSGD and the
 * research prototype. A tensor is viewed as B matrices M [rows, cols]; the
 * sender finds Q [rows, r] with orthonormal columns and P = Mᵀ Q [cols, r],
 * keeps P as the start of the next call (per micro-batch slot) and sends
 * both; the receiver rebuilds M ≈ Q Pᵀ. The heavy lifting is OpenBLAS
 * (sgemm) and LAPACKE (sgeqrf + sorgqr); the scalar reference uses plain
 * loops and modified Gram-Schmidt. Layout and rules: docs/codecs.md. */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <cblas.h>
#include <lapacke.h>

#include "../lib/tensor.h"
#include "../lib/codec/codec_impl.h"

enum { PI_RANK, PI_ITERS, PI_WARM, PI_FACTORS };
enum { PI_F32 = 0, PI_F16 = 1 };

static const char *const pi_bool[] = {"0", "1", NULL};
static const char *const pi_factor_types[] = {"fp32", "fp16", NULL};

static const epipe_param_desc pi_params[] = {
    {.key = "rank", .kind = EPIPE_PARAM_INT, .min = 1, .max = 256, .def = NAN},
    {.key = "iters", .kind = EPIPE_PARAM_INT, .min = 1, .max = 64, .def = 1},
    {.key = "warm", .kind = EPIPE_PARAM_CHOICE, .def = 1, .choices = pi_bool},
    {.key = "factors", .kind = EPIPE_PARAM_CHOICE, .def = PI_F32, .choices = pi_factor_types},
};

/* Bytes of the body header: u32 rank, u32 reserved (0), u64 B, rows, cols. */
#define PI_BODY_HEADER 32
/* Warm starts are kept for slots 0..PI_MAX_SLOTS-1; higher slots share
 * slot % PI_MAX_SLOTS. */
#define PI_MAX_SLOTS 256

/* The matrix view of a tensor shape (docs/codecs.md). */
typedef struct pi_view {
    uint64_t nb, rows, cols;
    unsigned r; /* effective rank: min(rank, rows, cols) */
} pi_view;

typedef struct pi_slot {
    pi_view v; /* the view the warm start belongs to */
    float *p;  /* nb blocks of cols x r, column-major; NULL = cold */
    size_t cap;
} pi_slot;

typedef struct pi_state {
    pi_slot slots[PI_MAX_SLOTS];
    float *q, *p, *tau, *work; /* per-matrix scratch */
    size_t qcap, pcap, taucap, workcap;
} pi_state;

/* ---- shapes and sizes ------------------------------------------------- */

static int pi_view_of(const epipe_codec *c, uint64_t n, pi_view *v)
{
    uint64_t nb = 1, rows = 1, cols = 1;
    if (c->ndim == 1) {
        cols = (uint64_t)c->shape[0];
    } else if (c->ndim == 2) {
        rows = (uint64_t)c->shape[0];
        cols = (uint64_t)c->shape[1];
    } else if (c->ndim >= 3) {
        nb = (uint64_t)c->shape[0];
        rows = (uint64_t)c->shape[1];
        for (int d = 2; d < c->ndim; d++) {
            uint64_t s = (uint64_t)c->shape[d];
            if (s && cols > UINT64_MAX / s)
                return EPIPE_EOVERFLOW;
            cols *= s;
        }
    }
    /* The product was already checked to be n by the tensor inspection;
     * check again, cheaply, so a view never disagrees with the count. */
    if ((rows && cols > UINT64_MAX / rows) || (nb && rows * cols > UINT64_MAX / nb) ||
        nb * rows * cols != n)
        return EPIPE_EOVERFLOW;
    uint64_t r = (uint64_t)c->p[PI_RANK];
    if (r > rows)
        r = rows;
    if (r > cols)
        r = cols;
    if (nb == 0)
        r = 0;
    v->nb = nb;
    v->rows = rows;
    v->cols = cols;
    v->r = (unsigned)r;
    return EPIPE_OK;
}

static size_t pi_esize(const epipe_codec *c)
{
    return (int)c->p[PI_FACTORS] == PI_F16 ? 2 : 4;
}

/* Bytes of one matrix's record: its scale, then Q and P. */
static int pi_record_size(const epipe_codec *c, const pi_view *v, uint64_t *bytes)
{
    uint64_t es = pi_esize(c);
    if (v->rows > UINT64_MAX / 2 - v->cols)
        return EPIPE_EOVERFLOW;
    uint64_t f = v->rows + v->cols;
    if (v->r && f > UINT64_MAX / v->r / es)
        return EPIPE_EOVERFLOW;
    *bytes = 4 + f * v->r * es;
    return EPIPE_OK;
}

static int pi_body_size(const epipe_codec *c, uint64_t n, size_t *bytes)
{
    pi_view v;
    uint64_t rec = 0;
    if (pi_view_of(c, n, &v) || pi_record_size(c, &v, &rec))
        return EPIPE_EOVERFLOW;
    if (v.r == 0) {
        *bytes = PI_BODY_HEADER;
        return EPIPE_OK;
    }
    if (rec && v.nb > (SIZE_MAX - PI_BODY_HEADER) / rec)
        return EPIPE_EOVERFLOW;
    *bytes = (size_t)(PI_BODY_HEADER + v.nb * rec);
    return EPIPE_OK;
}

static uint32_t pi_param_word(const epipe_codec *c)
{
    return (uint32_t)c->p[PI_RANK] | (uint32_t)c->p[PI_FACTORS] << 16;
}

/* The largest scale a record may carry: with |Q|, |P| <= 1 every rebuilt
 * value is at most scale * r, which then stays below FLT_MAX / 2. */
static float pi_max_scale(unsigned r)
{
    return (float)(FLT_MAX / (2.0 * (r ? r : 1)));
}

/* ---- state ------------------------------------------------------------ */

static void pi_release(epipe_codec *c)
{
    pi_state *st = c->state;
    if (!st)
        return;
    for (unsigned i = 0; i < PI_MAX_SLOTS; i++)
        free(st->slots[i].p);
    free(st->q);
    free(st->p);
    free(st->tau);
    free(st->work);
    free(st);
    c->state = NULL;
}

static int pi_configure(epipe_codec *c)
{
    if (isnan(c->p[PI_RANK]))
        return epipe_fail(EPIPE_EINVAL, "poweriter: key 'rank' is required (poweriter:rank=R)");
    c->state = calloc(1, sizeof(pi_state));
    if (!c->state)
        return epipe_fail(EPIPE_ENOMEM, "poweriter: out of memory");
    return EPIPE_OK;
}

static int grow(float **p, size_t *cap, size_t n)
{
    if (*cap >= n)
        return 0;
    float *q = realloc(*p, (n ? n : 1) * sizeof *q);
    if (!q)
        return -1;
    *p = q;
    *cap = n;
    return 0;
}

/* Scratch for one matrix of the view, and the slot's warm start in
 * *slot_out (NULL when warm starts are off). Returns 1 when the slot is
 * cold (new, reset, or for another shape), 0 when it holds a warm start,
 * or an error status. */
static int pi_prepare(epipe_codec *c, const pi_view *v, pi_slot **slot_out)
{
    pi_state *st = c->state;
    size_t r = v->r, wneed = 64 * r + 64;
    *slot_out = NULL;
    if (grow(&st->q, &st->qcap, (size_t)v->rows * r) ||
        grow(&st->p, &st->pcap, (size_t)v->cols * r) || grow(&st->tau, &st->taucap, r) ||
        grow(&st->work, &st->workcap, wneed))
        return epipe_codec_fail(c, EPIPE_ENOMEM, "poweriter: out of memory");
    if ((int)c->p[PI_WARM] == 0)
        return 1;
    pi_slot *s = &st->slots[(c->microbatch > 0 ? (uint64_t)c->microbatch : 0) % PI_MAX_SLOTS];
    *slot_out = s;
    if (s->p && s->v.nb == v->nb && s->v.rows == v->rows && s->v.cols == v->cols &&
        s->v.r == v->r)
        return 0;
    /* A new slot or a new shape: start cold. s->v stays zero (matching no
     * view) until an encode has filled the warm start completely. */
    memset(&s->v, 0, sizeof s->v);
    size_t need = (size_t)v->nb * v->cols * r;
    if (grow(&s->p, &s->cap, need))
        return epipe_codec_fail(c, EPIPE_ENOMEM, "poweriter: no memory for the warm start");
    return 1;
}

/* The deterministic start for a cold matrix: uniform in [-1, 1) from a
 * hash of (row j, column k), the same for every matrix and every call. */
static float pi_start_value(uint64_t j, unsigned k)
{
    uint64_t z = j * 0x9e3779b97f4a7c15ull + (uint64_t)k * 0xbf58476d1ce4e5b9ull + 0x632be59bd9b4e5bull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (float)((double)(z >> 40) * 0x1p-23 - 1.0);
}

static void pi_cold_start(float *p, uint64_t cols, unsigned r)
{
    for (unsigned k = 0; k < r; k++)
        for (uint64_t j = 0; j < cols; j++)
            p[k * cols + j] = pi_start_value(j, k);
}

/* Scales each column of p (cols x r, column-major) to unit length for the
 * next call's start; a zero column gets the cold start again. */
static void pi_keep_warm(float *dst, const float *p, uint64_t cols, unsigned r)
{
    for (unsigned k = 0; k < r; k++) {
        const float *col = p + (size_t)k * cols;
        float *out = dst + (size_t)k * cols;
        double ss = 0;
        for (uint64_t j = 0; j < cols; j++)
            ss += (double)col[j] * col[j];
        /* A column too small to normalise in float (1/norm would overflow
         * to inf and turn its zeros into NaN) restarts like a cold one. */
        if (!(ss > (double)FLT_MIN * FLT_MIN) || !isfinite(ss)) {
            for (uint64_t j = 0; j < cols; j++)
                out[j] = pi_start_value(j, k);
            continue;
        }
        double inv = 1.0 / sqrt(ss);
        for (uint64_t j = 0; j < cols; j++)
            out[j] = (float)(col[j] * inv);
    }
}

/* ---- writing and reading records -------------------------------------- */

static void pi_put_f32(uint8_t *p, float f)
{
    union { float f; uint32_t u; } b = {.f = f};
    epipe_put_u32(p, b.u);
}

static float pi_get_f32(const uint8_t *p)
{
    union { float f; uint32_t u; } b = {.u = epipe_get_u32(p)};
    return b.f;
}

static void pi_write_header(uint8_t *body, const pi_view *v)
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
            float v = f[(size_t)k * n + i] * mul;
            v = v > 1.0f ? 1.0f : v < -1.0f ? -1.0f : v;
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

/* Writes matrix b's record: the scale s = max|P|, Q, then P / s. */
static int pi_write_record(epipe_codec *c, const pi_view *v, uint64_t b, const float *q,
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
    if (!finite)
        return epipe_codec_fail(c, EPIPE_EINVAL,
                                "poweriter: matrix %llu: the power iteration gave non-finite "
                                "factors: its values overflow fp32 products (about 1e37 and "
                                "up cannot be sent as low-rank factors)",
                                (unsigned long long)b);
    if (!(s <= pi_max_scale(r)))
        return epipe_codec_fail(c, EPIPE_EINVAL,
                                "poweriter: matrix %llu: its factors overflow (scale %g); values "
                                "this large (about 1e37 and up) cannot be sent as low-rank factors",
                                (unsigned long long)b, (double)s);
    /* A matrix whose P is all below FLT_MIN (a vanishing gradient) is sent
     * as zero: 1/s would overflow to inf and make 0*inf = NaN factors. */
    if (s < FLT_MIN)
        s = 0;
    pi_put_f32(rec, s);
    size_t off = 4 + pi_write_factor(rec + 4, q, v->rows, r, 1.0f, fp16);
    pi_write_factor(rec + off, p, v->cols, r, s > 0 ? 1.0f / s : 0.0f, fp16);
    return EPIPE_OK;
}

static int pi_check_header(epipe_codec *c, const uint8_t *body, const pi_view *v)
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
static int pi_read_factor(epipe_codec *c, const uint8_t *in, uint64_t n, unsigned r, int fp16,
                          float *f, uint64_t b, const char *which)
{
    size_t es = fp16 ? 2 : 4;
    for (uint64_t i = 0; i < n; i++)
        for (unsigned k = 0; k < r; k++) {
            const uint8_t *o = in + (i * r + k) * es;
            float v = fp16 ? epipe_f16_to_f32((uint16_t)(o[0] | o[1] << 8)) : pi_get_f32(o);
            if (!(fabsf(v) <= 1.0f))
                return epipe_codec_fail(c, EPIPE_EPROTO,
                                        "poweriter: matrix %llu: %s[%llu][%u] is %g; factors "
                                        "must be finite and within [-1, 1]",
                                        (unsigned long long)b, which, (unsigned long long)i, k,
                                        (double)v);
            f[(size_t)k * n + i] = v;
        }
    return EPIPE_OK;
}

static int pi_read_scale(epipe_codec *c, const uint8_t *rec, unsigned r, uint64_t b, float *s)
{
    *s = pi_get_f32(rec);
    if (!(*s >= 0.0f && *s <= pi_max_scale(r)) || signbit(*s))
        return epipe_codec_fail(c, EPIPE_EPROTO,
                                "poweriter: matrix %llu: scale %g is not in [0, %g]",
                                (unsigned long long)b, (double)*s, (double)pi_max_scale(r));
    return EPIPE_OK;
}

static int pi_reject_nonfinite(epipe_codec *c, const float *x, size_t at)
{
    return epipe_codec_fail(c, EPIPE_EINVAL,
                            "poweriter: input value at index %zu is %s; poweriter needs finite "
                            "values",
                            at, isnan(x[at]) ? "NaN" : x[at] > 0 ? "+inf" : "-inf");
}

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
            cblas_sgemv(CblasRowMajor, CblasTrans, rows, cols, 1.0f, m, cols,
                        q + (size_t)k * rows, 1, 0.0f, p + (size_t)k * cols, 1);
        return;
    }
    cblas_sgemm(CblasColMajor, CblasNoTrans, CblasNoTrans, cols, r, rows, 1.0f, m, cols, q, rows,
                0.0f, p, cols);
}

/* The end of one matrix's encode, shared by the fast path and the
 * reference: writes its record from the state's Q and P and keeps P as the
 * slot's next start; a record that cannot be written sends the slot back
 * to a cold start rather than leaving it half updated. */
static int pi_finish_matrix(epipe_codec *c, const pi_view *v, uint64_t b, pi_slot *slot,
                            float *start, uint8_t *rec)
{
    pi_state *st = c->state;
    int rc = pi_write_record(c, v, b, st->q, st->p, rec);
    if (rc) {
        if (slot)
            memset(&slot->v, 0, sizeof slot->v);
        return rc;
    }
    if (slot)
        pi_keep_warm(start, st->p, v->cols, v->r);
    return EPIPE_OK;
}

static int pi_encode(epipe_codec *c, const float *x, size_t n, uint8_t *body)
{
    pi_view v;
    if (pi_view_of(c, n, &v))
        return epipe_codec_fail(c, EPIPE_EOVERFLOW, "poweriter: shape does not fit");
    pi_write_header(body, &v);
    if (v.r == 0)
        return EPIPE_OK;
    pi_slot *slot;
    int cold = pi_prepare(c, &v, &slot);
    if (cold < 0)
        return cold;
    pi_state *st = c->state;
    const int rows = (int)v.rows, cols = (int)v.cols, r = (int)v.r;
    if (v.rows > INT32_MAX || v.cols > INT32_MAX || v.rows * v.cols > (uint64_t)INT64_MAX)
        return epipe_codec_fail(c, EPIPE_EINVAL, "poweriter: matrix %llux%llu is too large for BLAS",
                                (unsigned long long)v.rows, (unsigned long long)v.cols);
    uint64_t rec = 0;
    pi_record_size(c, &v, &rec);
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
            return pi_reject_nonfinite(c, x, b * msize + bad);
        }
        float *start = slot ? slot->p + b * psize : st->p;
        if (!slot || cold)
            pi_cold_start(start, v.cols, v.r);
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
        int rc = pi_finish_matrix(c, &v, b, slot, start, body + PI_BODY_HEADER + b * rec);
        if (rc)
            return rc;
    }
    if (slot)
        slot->v = v; /* warm from now on */
    return EPIPE_OK;
}

static int pi_decode(epipe_codec *c, const uint8_t *body, size_t n, float *y)
{
    pi_view v;
    if (pi_view_of(c, n, &v))
        return epipe_codec_fail(c, EPIPE_EOVERFLOW, "poweriter: shape does not fit");
    int rc = pi_check_header(c, body, &v);
    if (rc || v.r == 0)
        return rc;
    if (v.rows > INT32_MAX || v.cols > INT32_MAX)
        return epipe_codec_fail(c, EPIPE_EINVAL, "poweriter: matrix %llux%llu is too large for BLAS",
                                (unsigned long long)v.rows, (unsigned long long)v.cols);
    pi_state *st = c->state;
    if (grow(&st->q, &st->qcap, (size_t)v.rows * v.r) ||
        grow(&st->p, &st->pcap, (size_t)v.cols * v.r))
        return epipe_codec_fail(c, EPIPE_ENOMEM, "poweriter: out of memory");
    int fp16 = (int)c->p[PI_FACTORS] == PI_F16;
    uint64_t rec = 0;
    pi_record_size(c, &v, &rec);
    size_t msize = (size_t)v.rows * v.cols, qbytes = (size_t)v.rows * v.r * pi_esize(c);
    for (uint64_t b = 0; b < v.nb; b++) {
        const uint8_t *p = body + PI_BODY_HEADER + b * rec;
        float s;
        if ((rc = pi_read_scale(c, p, v.r, b, &s)) ||
            (rc = pi_read_factor(c, p + 4, v.rows, v.r, fp16, st->q, b, "Q")) ||
            (rc = pi_read_factor(c, p + 4 + qbytes, v.cols, v.r, fp16, st->p, b, "P")))
            return rc;
        /* Y = s Q Pᵀ, row-major rows x cols = column-major cols x rows = s P Qᵀ. */
        cblas_sgemm(CblasColMajor, CblasNoTrans, CblasTrans, (int)v.cols, (int)v.rows, (int)v.r,
                    s, st->p, (int)v.cols, st->q, (int)v.rows, 0.0f, y + b * msize, (int)v.cols);
    }
    return EPIPE_OK;
}

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

static int pi_encode_ref(epipe_codec *c, const float *x, size_t n, uint8_t *body)
{
    pi_view v;
    if (pi_view_of(c, n, &v))
        return epipe_codec_fail(c, EPIPE_EOVERFLOW, "poweriter: shape does not fit");
    pi_write_header(body, &v);
    if (v.r == 0)
        return EPIPE_OK;
    for (size_t i = 0; i < n; i++)
        if (!isfinite(x[i]))
            return pi_reject_nonfinite(c, x, i);
    pi_slot *slot;
    int cold = pi_prepare(c, &v, &slot);
    if (cold < 0)
        return cold;
    pi_state *st = c->state;
    uint64_t rec = 0;
    pi_record_size(c, &v, &rec);
    size_t rows = v.rows, cols = v.cols, r = v.r, msize = rows * cols, psize = cols * r;
    for (uint64_t b = 0; b < v.nb; b++) {
        const float *m = x + b * msize;
        float *start = slot ? slot->p + b * psize : st->p;
        if (!slot || cold)
            pi_cold_start(start, v.cols, v.r);
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
        int rc = pi_finish_matrix(c, &v, b, slot, start, body + PI_BODY_HEADER + b * rec);
        if (rc)
            return rc;
    }
    if (slot)
        slot->v = v; /* warm from now on */
    return EPIPE_OK;
}

static int pi_decode_ref(epipe_codec *c, const uint8_t *body, size_t n, float *y)
{
    pi_view v;
    if (pi_view_of(c, n, &v))
        return epipe_codec_fail(c, EPIPE_EOVERFLOW, "poweriter: shape does not fit");
    int rc = pi_check_header(c, body, &v);
    if (rc || v.r == 0)
        return rc;
    pi_state *st = c->state;
    if (grow(&st->q, &st->qcap, (size_t)v.rows * v.r) ||
        grow(&st->p, &st->pcap, (size_t)v.cols * v.r))
        return epipe_codec_fail(c, EPIPE_ENOMEM, "poweriter: out of memory");
    int fp16 = (int)c->p[PI_FACTORS] == PI_F16;
    uint64_t rec = 0;
    pi_record_size(c, &v, &rec);
    size_t rows = v.rows, cols = v.cols, r = v.r, msize = rows * cols;
    size_t qbytes = rows * r * pi_esize(c);
    /* Validate every record before writing anything. */
    for (uint64_t b = 0; b < v.nb; b++) {
        const uint8_t *p = body + PI_BODY_HEADER + b * rec;
        float s;
        if ((rc = pi_read_scale(c, p, v.r, b, &s)) ||
            (rc = pi_read_factor(c, p + 4, v.rows, v.r, fp16, st->q, b, "Q")) ||
            (rc = pi_read_factor(c, p + 4 + qbytes, v.cols, v.r, fp16, st->p, b, "P")))
            return rc;
    }
    for (uint64_t b = 0; b < v.nb; b++) {
        const uint8_t *p = body + PI_BODY_HEADER + b * rec;
        float s;
        pi_read_scale(c, p, v.r, b, &s);
        pi_read_factor(c, p + 4, v.rows, v.r, fp16, st->q, b, "Q");
        pi_read_factor(c, p + 4 + qbytes, v.cols, v.r, fp16, st->p, b, "P");
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

static const epipe_codec_backend poweriter_cpu = {
    .encode = pi_encode,
    .decode = pi_decode,
    .encode_ref = pi_encode_ref,
    .decode_ref = pi_decode_ref,
    .ref_approximate = 1,
};

const epipe_codec_ops epipe_codec_poweriter = {
    .name = "poweriter",
    .id = EPIPE_CODEC_ID_POWERITER,
    .params = pi_params,
    .nparams = 4,
    .configure = pi_configure,
    .param_word = pi_param_word,
    .body_size = pi_body_size,
    .release = pi_release,
    .cpu = &poweriter_cpu,
};
