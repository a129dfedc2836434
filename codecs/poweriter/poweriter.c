/* `poweriter:rank=r[,iters=k][,warm=0|1][,factors=fp32|fp16]`: low-rank
 * compression by power (subspace) iteration, as in PowerSGD and the
 * research prototype. A tensor is viewed as B matrices M [rows, cols]; the
 * sender finds Q [rows, r] with orthonormal columns and P = Mᵀ Q [cols, r],
 * keeps P as the start of the next call (per micro-batch slot) and sends
 * both; the receiver rebuilds M ≈ Q Pᵀ. The heavy lifting is OpenBLAS
 * (sgemm) and LAPACKE (sgeqrf + sorgqr); the scalar reference uses plain
 * loops and modified Gram-Schmidt. Layout and rules: docs/codecs.md.
 *
 * This file: the parameters, sizes, state and warm starts, and the ops
 * tables; payload.c, lowrank.c and ref.c hold the rest. */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../inline/poweriter.h"
#include "poweriter.h"

static const char *const pi_factor_types[] = {"fp32", "fp16", NULL};

static const epipe_param_desc pi_params[] = {
    {.key = "rank", .kind = EPIPE_PARAM_INT, .min = 1, .max = 256, .def = NAN},
    {.key = "iters", .kind = EPIPE_PARAM_INT, .min = 1, .max = 64, .def = 1},
    {.key = "warm", .kind = EPIPE_PARAM_CHOICE, .def = 1, .choices = epipe_param_bool},
    {.key = "factors", .kind = EPIPE_PARAM_CHOICE, .def = PI_F32, .choices = pi_factor_types},
    /* 1: a 2-D tensor may be one matrix whose factors its rows share */
    {.key = "shared",
     .kind = EPIPE_PARAM_CHOICE,
     .def = 0,
     .choices = epipe_param_bool,
     .quiet_default = 1},
};

/* ---- shapes and sizes ------------------------------------------------- */

int epipe_pi_view_of(const epipe_codec *c, uint64_t n, pi_view *v)
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

int epipe_pi_check_shared(epipe_codec *c, const pi_view *v)
{
    if (c->ndim != 2 || v->r >= v->rows || c->p[PI_SHARED] != 0)
        return EPIPE_OK;
    return epipe_codec_fail(c, EPIPE_EINVAL,
                            "poweriter: [%llu,%llu] is one matrix: all %llu rows (samples) "
                            "would share rank-%u factors, which erases what tells them apart "
                            "(training collapses); use [B,C,H,W] or [B,T,D] tensors, "
                            "rank>=%llu, another codec, or shared=1",
                            (unsigned long long)v->rows, (unsigned long long)v->cols,
                            (unsigned long long)v->rows, v->r, (unsigned long long)v->rows);
}

/* Bytes of one matrix's record: its scale, then Q and P. */
int epipe_pi_record_size(const epipe_codec *c, const pi_view *v, uint64_t *bytes)
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
    if (epipe_pi_view_of(c, n, &v) || epipe_pi_record_size(c, &v, &rec))
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

int epipe_pi_grow(float **p, size_t *cap, size_t n)
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

/* The warm-start slot of c's micro-batch, or NULL when warm starts are off. */
static pi_slot *pi_slot_of(epipe_codec *c)
{
    pi_state *st = c->state;
    if ((int)c->p[PI_WARM] == 0)
        return NULL;
    return &st->slots[(c->microbatch > 0 ? (uint64_t)c->microbatch : 0) % PI_MAX_SLOTS];
}

/* Whether the slot's warm start is for view v. */
static int pi_slot_holds(const pi_slot *s, const pi_view *v)
{
    return s->v.nb == v->nb && s->v.rows == v->rows && s->v.cols == v->cols && s->v.r == v->r;
}

/* Scratch for one matrix of the view, and the slot's warm start in
 * *slot_out (NULL when warm starts are off). Returns 1 when the slot is
 * cold (new, reset, or for another shape), 0 when it holds a warm start,
 * or an error status. */
int epipe_pi_prepare(epipe_codec *c, const pi_view *v, pi_slot **slot_out)
{
    pi_state *st = c->state;
    size_t r = v->r, wneed = 64 * r + 64;
    *slot_out = NULL;
    if (epipe_pi_grow(&st->q, &st->qcap, (size_t)v->rows * r) ||
        epipe_pi_grow(&st->p, &st->pcap, (size_t)v->cols * r) ||
        epipe_pi_grow(&st->tau, &st->taucap, r) || epipe_pi_grow(&st->work, &st->workcap, wneed))
        return epipe_codec_fail(c, EPIPE_ENOMEM, "poweriter: out of memory");
    pi_slot *s = pi_slot_of(c);
    if (!s)
        return 1;
    *slot_out = s;
    if (s->p && !s->on_device && pi_slot_holds(s, v))
        return 0;
    /* A new slot or a new shape: start cold. s->v stays zero (matching no
     * view) until an encode has filled the warm start completely. */
    memset(&s->v, 0, sizeof s->v);
    size_t need = (size_t)v->nb * v->cols * r;
    if (epipe_pi_grow(&s->p, &s->cap, need))
        return epipe_codec_fail(c, EPIPE_ENOMEM, "poweriter: no memory for the warm start");
    return 1;
}

void epipe_pi_cold_start(float *p, uint64_t cols, unsigned r)
{
    for (unsigned k = 0; k < r; k++)
        for (uint64_t j = 0; j < cols; j++)
            p[k * cols + j] = epipe_hd_pi_start_value(j, k);
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
                out[j] = epipe_hd_pi_start_value(j, k);
            continue;
        }
        double inv = 1.0 / sqrt(ss);
        for (uint64_t j = 0; j < cols; j++)
            out[j] = (float)(col[j] * inv);
    }
}

/* The end of one matrix's encode, shared by the fast path, the reference
 * and the CUDA backend: writes its record from Q and P and keeps P as the
 * slot's next start; a record that cannot be written sends the slot back
 * to a cold start rather than leaving it half updated. */
int epipe_pi_finish_matrix(epipe_codec *c, const pi_view *v, uint64_t b, pi_slot *slot,
                           float *start, const float *q, const float *p, uint8_t *rec)
{
    int rc = epipe_pi_write_record(c, v, b, q, p, rec);
    if (rc) {
        if (slot)
            memset(&slot->v, 0, sizeof slot->v);
        return rc;
    }
    if (slot)
        pi_keep_warm(start, p, v->cols, v->r);
    return EPIPE_OK;
}

/* ---- the host's part of the CUDA backend (cuda/poweriter.cu) --------- */

/* The view of n values (c->shape: matrices, rows, cols, then the
 * iteration count), checked as the CPU encoder checks it when body is
 * given (the encoder's call, which writes the body's header into it) and
 * as the decoder does when it is NULL; *bytes: the body's size. */
int epipe_pi_cuda_plan(epipe_codec *c, uint64_t n, uint8_t *body, uint64_t view[4], unsigned *r,
                       size_t *bytes)
{
    pi_view v;
    if (epipe_pi_view_of(c, n, &v) || pi_body_size(c, n, bytes))
        return epipe_codec_fail(c, EPIPE_EOVERFLOW, "poweriter: shape does not fit");
    /* the encoder's refusal only: the CPU decoder takes any view */
    int rc = body ? epipe_pi_check_shared(c, &v) : EPIPE_OK;
    if (rc)
        return rc;
    if (v.rows > INT32_MAX || v.cols > INT32_MAX || v.nb > INT32_MAX)
        return epipe_codec_fail(c, EPIPE_EINVAL,
                                "poweriter: %llu matrices %llux%llu are too many or too large "
                                "for cuBLAS",
                                (unsigned long long)v.nb, (unsigned long long)v.rows,
                                (unsigned long long)v.cols);
    if (body)
        epipe_pi_write_header(body, &v);
    view[0] = v.nb, view[1] = v.rows, view[2] = v.cols;
    view[3] = (uint64_t)c->p[PI_ITERS];
    *r = v.r;
    return EPIPE_OK;
}

/* The warm-start slot of c's micro-batch for a CUDA encode of n values:
 * *index (PI_MAX_SLOTS of them; -1 when warm starts are off) and *warm, 1
 * when the module's device copy of that slot holds the start for this
 * view (the module keeps the starts themselves). */
int epipe_pi_cuda_slot(epipe_codec *c, uint64_t n, int *index, int *warm)
{
    pi_view v;
    if (epipe_pi_view_of(c, n, &v))
        return epipe_codec_fail(c, EPIPE_EOVERFLOW, "poweriter: shape does not fit");
    pi_slot *s = pi_slot_of(c);
    pi_state *st = c->state;
    *index = s ? (int)(s - st->slots) : -1;
    *warm = s && s->on_device && pi_slot_holds(s, &v);
    return EPIPE_OK;
}

/* After a CUDA encode of n values: ok, the slot holds the device's warm
 * start for this view from now on; else it starts cold next time. */
void epipe_pi_cuda_commit(epipe_codec *c, uint64_t n, int ok)
{
    pi_view v;
    pi_slot *s = pi_slot_of(c);
    if (!s)
        return;
    memset(&s->v, 0, sizeof s->v);
    if (ok && epipe_pi_view_of(c, n, &v) == EPIPE_OK)
        s->v = v, s->on_device = 1;
}

/* The CPU encoder's refusal of matrix b's factors (kind 0: not finite,
 * 1: the scale s overflows), with its message. */
int epipe_pi_cuda_refuse(epipe_codec *c, uint64_t n, uint64_t b, int kind, float s)
{
    pi_view v;
    if (epipe_pi_view_of(c, n, &v))
        return epipe_codec_fail(c, EPIPE_EOVERFLOW, "poweriter: shape does not fit");
    int rc = epipe_pi_check_factors(c, b, s, kind != 0, v.r);
    return rc ? rc
              : epipe_codec_fail(c, EPIPE_EINVAL, "poweriter: matrix %llu refused",
                                 (unsigned long long)b);
}

/* A body's header checked as the CPU decoder checks it (its records are
 * checked by the decode kernel). */
int epipe_pi_cuda_check_header(epipe_codec *c, const uint8_t *body, uint64_t n)
{
    pi_view v;
    if (epipe_pi_view_of(c, n, &v))
        return epipe_codec_fail(c, EPIPE_EOVERFLOW, "poweriter: shape does not fit");
    return epipe_pi_check_header(c, body, &v);
}

static const epipe_codec_backend poweriter_cpu = {
    .encode = epipe_pi_encode,
    .decode = epipe_pi_decode,
    .encode_ref = epipe_pi_encode_ref,
    .decode_ref = epipe_pi_decode_ref,
    .ref_approximate = 1,
};

const epipe_codec_ops epipe_codec_poweriter = {
    .name = "poweriter",
    .id = EPIPE_CODEC_ID_POWERITER,
    .params = pi_params,
    .nparams = sizeof pi_params / sizeof pi_params[0],
    .configure = pi_configure,
    .param_word = pi_param_word,
    .body_size = pi_body_size,
    .release = pi_release,
    .cpu = &poweriter_cpu,
};
