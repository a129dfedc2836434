/* `insert:kind=conv|linear,...`: a learned compress/restore pair.
 *
 * conv:   [B,C,H,W] -> code [B,K,H/k,W/k] by a k x k convolution of stride k
 *         (no bias), restored by the transposed convolution.
 * linear: [..., D] -> code [..., d] by a projection, restored by another.
 *
 * Both are one matrix product per patch: with stride = kernel the patches do
 * not overlap, so conv is "im2col, then GEMM" with P = C*k*k values a patch
 * and linear is a GEMM with P = D. The GEMMs run in the system BLAS
 * (cblas_sgemm): a well-kept BLAS beats any loop of ours.
 *
 * Parameters, as matrices (docs/codecs.md gives the tensor shapes):
 *   E  [K][P]  compress weight: code = E . patch       (the sender's)
 *   Rt [K][P]  restore weight:  patch = Rt^T . code    (the receiver's)
 * The two are separate parameter sets; each handle holds both, and trains
 * the one its calls use (encode: E, decode: Rt). Initialisation: E has
 * random orthonormal rows (seed), Rt = E, so restore is E's pseudo-inverse
 * and restore(compress(x)) is the orthogonal projection of each patch.
 *
 * Training keeps, per micro-batch (EPIPE_CODEC_MICROBATCH), a copy of the
 * encoder's input and the decoder's code for the backward.
 *
 * The parameters are created when the channel count (C, or D) is first
 * known: from `in=` at create time, or from the first tensor. A later tensor
 * with another C is refused. The body is the code, fp32 or fp16, in the
 * code's row-major order; nothing else.
 *
 * This file: the parameters, configuration, sizes, the weights' creation and
 * the ops tables; forward.c, train.c and patches.c hold the rest. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../../lib/codec/cuda_api.h"
#include "insert.h"

static const char *const kind_choices[] = {"conv", "linear", NULL};
static const char *const code_choices[] = {"fp32", "fp16", NULL};

static const epipe_param_desc insert_params[] = {
    {.key = "kind",
     .kind = EPIPE_PARAM_CHOICE,
     .min = 0,
     .max = 1,
     .def = KIND_CONV,
     .choices = kind_choices},
    {.key = "out", .kind = EPIPE_PARAM_INT, .min = 0, .max = INSERT_MAX_OUT, .def = 0},
    {.key = "ratio", .kind = EPIPE_PARAM_REAL, .min = 0, .max = 1, .def = 0},
    {.key = "kernel", .kind = EPIPE_PARAM_INT, .min = 1, .max = 64, .def = NAN},
    {.key = "in", .kind = EPIPE_PARAM_INT, .min = 0, .max = INSERT_MAX_OUT, .def = 0},
    {.key = "seed", .kind = EPIPE_PARAM_INT, .min = 0, .max = 4294967295.0, .def = 1},
    {.key = "code",
     .kind = EPIPE_PARAM_CHOICE,
     .min = 0,
     .max = 1,
     .def = CODE_F32,
     .choices = code_choices},
};

static int insert_configure(epipe_codec *c)
{
    if (isnan(c->p[I_KERNEL]))
        c->p[I_KERNEL] = kind(c) == KIND_CONV ? 4 : 1;
    if (kind(c) == KIND_LINEAR && c->p[I_KERNEL] != 1)
        return epipe_fail(EPIPE_EINVAL,
                          "insert: kernel=%g applies to kind=conv only "
                          "(kind=linear projects the last dimension)",
                          c->p[I_KERNEL]);
    if (c->p[I_OUT] > 0 && c->p[I_RATIO] > 0)
        return epipe_fail(EPIPE_EINVAL, "insert: give out= or ratio=, not both");
    if (c->p[I_OUT] == 0 && c->p[I_RATIO] == 0)
        c->p[I_RATIO] = 0.0625;
    c->state = calloc(1, sizeof(struct insert_state));
    if (!c->state)
        return epipe_fail(EPIPE_ENOMEM, "insert: out of memory");
    return EPIPE_OK;
}

/* K for cin channels: out=, or round(ratio * P), at least 1. */
static int64_t out_for(const epipe_codec *c, int64_t cin)
{
    if (c->p[I_OUT] > 0)
        return (int64_t)c->p[I_OUT];
    int64_t P = cin * kern(c) * kern(c);
    double k = floor(c->p[I_RATIO] * (double)P + 0.5);
    return k < 1 ? 1 : (int64_t)k;
}

/* Fills g (struct geom, insert.h) for a tensor of that shape. */
int epipe_insert_geometry(epipe_codec *c, const int64_t *shape, int ndim, struct geom *g)
{
    memset(g, 0, sizeof *g);
    int64_t k = kern(c);
    if (kind(c) == KIND_CONV) {
        if (ndim != 4)
            return epipe_codec_fail(c, EPIPE_EINVAL,
                                    "insert: kind=conv takes [B,C,H,W] tensors; this one has "
                                    "%d dimensions",
                                    ndim);
        g->B = shape[0], g->cin = shape[1], g->H = shape[2], g->W = shape[3];
        if (g->H % k || g->W % k)
            return epipe_codec_fail(c, EPIPE_EINVAL,
                                    "insert: H=%lld and W=%lld must both be divisible by "
                                    "kernel=%lld (stride = kernel)",
                                    (long long)g->H, (long long)g->W, (long long)k);
        g->Ho = g->H / k, g->Wo = g->W / k, g->S = g->Ho * g->Wo;
    } else {
        if (ndim < 1)
            return epipe_codec_fail(c, EPIPE_EINVAL,
                                    "insert: kind=linear takes [..., D] tensors; this one is a "
                                    "scalar");
        g->cin = shape[ndim - 1];
        g->B = 1;
        for (int d = 0; d + 1 < ndim; d++)
            g->B *= shape[d];
        g->S = 1;
    }
    if (g->cin < 1)
        return epipe_codec_fail(c, EPIPE_EINVAL, "insert: the channel dimension is 0");
    if (g->cin > (int64_t)INSERT_MAX_OUT || (kind(c) == KIND_CONV && g->cin > (1 << 20)))
        return epipe_codec_fail(c, EPIPE_EINVAL, "insert: %lld channels is too many",
                                (long long)g->cin);
    g->P = g->cin * k * k;
    g->K = out_for(c, g->cin);
    /* The BLAS takes int dimensions. */
    if (g->B > INT32_MAX || g->S > INT32_MAX || g->P > INT32_MAX)
        return epipe_codec_fail(c, EPIPE_EINVAL,
                                "insert: a dimension of %lld x %lld x %lld exceeds what one "
                                "GEMM call takes (2^31-1)",
                                (long long)g->B, (long long)g->P, (long long)g->S);
    if (g->K > g->P)
        return epipe_codec_fail(c, EPIPE_EINVAL,
                                "insert: out=%lld exceeds the %lld values of a patch "
                                "(C=%lld x %lldx%lld): that would not compress",
                                (long long)g->K, (long long)g->P, (long long)g->cin, (long long)k,
                                (long long)k);
    if (S(c)->ready && g->cin != S(c)->cin)
        return epipe_codec_fail(c, EPIPE_EINVAL,
                                "insert: this codec's parameters are for %s=%lld; the tensor "
                                "has %lld",
                                kind(c) == KIND_CONV ? "C" : "D", (long long)S(c)->cin,
                                (long long)g->cin);
    return EPIPE_OK;
}

/* The parameter word: bit 0 kind, bit 1 fp16 code, bits 2-7 kernel-1,
 * bits 8-31 K (0 if the shape is unusable, so nothing matches it). */
static uint32_t insert_param_word(const epipe_codec *c)
{
    uint32_t w = (uint32_t)kind(c) | (uint32_t)c->p[I_CODE] << 1 | (uint32_t)(kern(c) - 1) << 2;
    int64_t cin = 0;
    if (kind(c) == KIND_CONV && c->ndim == 4)
        cin = c->shape[1];
    else if (kind(c) == KIND_LINEAR && c->ndim >= 1)
        cin = c->shape[c->ndim - 1];
    if (S(c)->ready)
        cin = S(c)->cin;
    if (cin >= 1 && cin <= (int64_t)INSERT_MAX_OUT) {
        int64_t K = out_for(c, cin);
        if (K <= (int64_t)INSERT_MAX_OUT)
            w |= (uint32_t)K << 8;
    }
    return w;
}

static size_t code_bytes(const epipe_codec *c)
{
    return c->p[I_CODE] == CODE_F16 ? 2 : 4;
}

static int insert_body_size(const epipe_codec *c, uint64_t n, size_t *bytes)
{
    struct geom g;
    epipe_codec *mc = (epipe_codec *)c; /* only its message is written */
    int rc = epipe_insert_geometry(mc, c->shape, c->ndim, &g);
    if (rc)
        return rc;
    uint64_t count = (uint64_t)g.B * (uint64_t)g.P * (uint64_t)g.S;
    if (count != n)
        return epipe_codec_fail(mc, EPIPE_EINVAL, "insert: shape holds %llu values, not %llu",
                                (unsigned long long)count, (unsigned long long)n);
    uint64_t code = (uint64_t)g.B * (uint64_t)g.K * (uint64_t)g.S;
    if (code > SIZE_MAX / code_bytes(c))
        return EPIPE_EOVERFLOW;
    *bytes = (size_t)code * code_bytes(c);
    return EPIPE_OK;
}

/* ---- parameters --------------------------------------------------------- */

static uint64_t splitmix(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* E: K random rows, orthonormalised (modified Gram-Schmidt in double).
 * Uniform draws and sqrt only, so every machine gets the same bits.
 * 0, or -1 when there is no memory for the double-precision rows. */
static int init_orthonormal(float *E, int64_t K, int64_t P, uint64_t seed)
{
    double *m = malloc(sizeof(double) * (size_t)(K * P));
    if (!m)
        return -1;
    uint64_t s = seed * 0x2545f4914f6cdd1dull + 1;
    for (int64_t r = 0; r < K; r++) {
        for (;;) {
            double *v = m + r * P;
            for (int64_t i = 0; i < P; i++)
                v[i] = (double)(splitmix(&s) >> 11) * 0x1p-52 - 1.0;
            for (int pass = 0; pass < 2; pass++) /* twice is enough (Kahan) */
                for (int64_t q = 0; q < r; q++) {
                    const double *u = m + q * P;
                    double d = 0;
                    for (int64_t i = 0; i < P; i++)
                        d += u[i] * v[i];
                    for (int64_t i = 0; i < P; i++)
                        v[i] -= d * u[i];
                }
            double nn = 0;
            for (int64_t i = 0; i < P; i++)
                nn += v[i] * v[i];
            if (nn > 1e-6) { /* else draw again: v was (nearly) in the span */
                double inv = 1.0 / sqrt(nn);
                for (int64_t i = 0; i < P; i++)
                    v[i] *= inv;
                break;
            }
        }
    }
    for (int64_t i = 0; i < K * P; i++)
        E[i] = (float)m[i];
    free(m);
    return 0;
}

static void view(DLTensor *t, float *data, int64_t *shape, int ndim)
{
    memset(t, 0, sizeof *t);
    t->data = data;
    t->device.device_type = kDLCPU;
    t->ndim = ndim;
    t->dtype.code = kDLFloat;
    t->dtype.bits = 32;
    t->dtype.lanes = 1;
    t->shape = shape;
}

int epipe_insert_ensure_params(epipe_codec *c, int64_t cin)
{
    struct insert_state *st = S(c);
    if (st->ready)
        return EPIPE_OK;
    int64_t k = kern(c), P = cin * k * k, K = out_for(c, cin);
    if (K > P)
        return epipe_codec_fail(c, EPIPE_EINVAL,
                                "insert: out=%lld exceeds the %lld values of "
                                "a patch: that would not compress",
                                (long long)K, (long long)P);
    size_t n = (size_t)(K * P);
    for (int i = 0; i < 2; i++) {
        free(st->w[i]), free(st->g[i]); /* a failed earlier attempt */
        st->w[i] = malloc(n * sizeof(float));
        st->g[i] = calloc(n, sizeof(float));
        if (!st->w[i] || !st->g[i])
            return epipe_codec_fail(c, EPIPE_ENOMEM, "insert: no memory for %zu parameters", n);
    }
    if (init_orthonormal(st->w[0], K, P, (uint64_t)c->p[I_SEED]))
        return epipe_codec_fail(c, EPIPE_ENOMEM, "insert: no memory to draw %zu parameters", n);
    memcpy(st->w[1], st->w[0], n * sizeof(float)); /* orthonormal rows: pinv = transpose */
    int nd = kind(c) == KIND_CONV ? 4 : 2;
    for (int i = 0; i < 2; i++) {
        /* conv: compress [K,C,k,k] (Conv2d), restore [K,C,k,k] (ConvTranspose2d);
         * linear: compress [d,D] (y = x W^T), restore [d,D] (y = z W). */
        int64_t *sh = st->wshape[i];
        sh[0] = K, sh[1] = cin, sh[2] = k, sh[3] = k;
        view(&st->wt[i], st->w[i], sh, nd);
        view(&st->gt[i], st->g[i], sh, nd);
    }
    st->cin = cin, st->K = K, st->P = P;
    st->ready = 1;
    return EPIPE_OK;
}

/* The module's view of a CUDA tensor of that shape (cuda/insert.cu): the
 * CPU's checks and messages, and the parameters it would use. */
int epipe_insert_cuda_plan(epipe_codec *c, const int64_t *shape, int ndim, uint64_t n,
                           epipe_cuda_insert_view *v)
{
    struct geom g;
    int rc = epipe_insert_geometry(c, shape, ndim, &g);
    if (rc || (rc = epipe_insert_ensure_params(c, g.cin)))
        return rc;
    uint64_t count = (uint64_t)g.B * (uint64_t)g.P * (uint64_t)g.S;
    if (count != n)
        return epipe_codec_fail(c, EPIPE_EINVAL, "insert: shape holds %llu values, not %llu",
                                (unsigned long long)count, (unsigned long long)n);
    v->conv = kind(c) == KIND_CONV;
    v->code16 = c->p[I_CODE] == CODE_F16;
    v->B = g.B, v->C = g.cin, v->H = g.H, v->W = g.W, v->K = g.K, v->k = kern(c);
    v->E = S(c)->w[0], v->Rt = S(c)->w[1];
    v->gE = S(c)->g[0], v->gRt = S(c)->g[1];
    return EPIPE_OK;
}

static void insert_release(epipe_codec *c)
{
    struct insert_state *st = S(c);
    if (!st)
        return;
    for (int i = 0; i < 2; i++)
        free(st->w[i]), free(st->g[i]), free(st->mom[i]);
    epipe_insert_cache_free(&st->enc);
    epipe_insert_cache_free(&st->dec);
    free(st->tmp), free(st->tmp2);
    free(st);
    c->state = NULL;
}

static unsigned insert_ntensors(const epipe_codec *c)
{
    (void)c;
    return 2;
}

static const epipe_codec_train_ops insert_train = {
    .forward_code = epipe_insert_forward_code,
    .restore_code = epipe_insert_restore_code,
    .tensor = epipe_insert_tensor,
    .encode_backward = epipe_insert_encode_backward,
    .decode_backward = epipe_insert_decode_backward,
    .zero_grad = epipe_insert_zero_grad,
    .sgd_step = epipe_insert_sgd,
};

static const epipe_codec_backend insert_cpu = {
    .encode = epipe_insert_encode,
    .decode = epipe_insert_decode,
    .train = &insert_train,
};

const epipe_codec_ops epipe_codec_insert = {
    .name = "insert",
    .id = EPIPE_CODEC_ID_INSERT,
    .params = insert_params,
    .nparams = sizeof insert_params / sizeof insert_params[0],
    .configure = insert_configure,
    .param_word = insert_param_word,
    .body_size = insert_body_size,
    .code_shape = epipe_insert_code_shape,
    .ntensors = insert_ntensors,
    .release = insert_release,
    .cpu = &insert_cpu,
};
