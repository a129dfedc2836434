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
 * code's row-major order; nothing else. */
#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../lib/tensor.h"
#include "../lib/codec/codec_impl.h"

enum { I_KIND, I_OUT, I_RATIO, I_KERNEL, I_IN, I_SEED, I_CODE };
enum { KIND_CONV = 0, KIND_LINEAR = 1 };
enum { CODE_F32 = 0, CODE_F16 = 1 };

static const char *const kind_choices[] = {"conv", "linear", NULL};
static const char *const code_choices[] = {"fp32", "fp16", NULL};

#define INSERT_MAX_OUT 16777215.0 /* 24 bits of the parameter word */

static const epipe_param_desc insert_params[] = {
    {.key = "kind", .kind = EPIPE_PARAM_CHOICE, .min = 0, .max = 1, .def = KIND_CONV,
     .choices = kind_choices},
    {.key = "out", .kind = EPIPE_PARAM_INT, .min = 0, .max = INSERT_MAX_OUT, .def = 0},
    {.key = "ratio", .kind = EPIPE_PARAM_REAL, .min = 0, .max = 1, .def = 0},
    {.key = "kernel", .kind = EPIPE_PARAM_INT, .min = 1, .max = 64, .def = NAN},
    {.key = "in", .kind = EPIPE_PARAM_INT, .min = 0, .max = INSERT_MAX_OUT, .def = 0},
    {.key = "seed", .kind = EPIPE_PARAM_INT, .min = 0, .max = 4294967295.0, .def = 1},
    {.key = "code", .kind = EPIPE_PARAM_CHOICE, .min = 0, .max = 1, .def = CODE_F32,
     .choices = code_choices},
};

/* What a backward needs of one micro-batch's forward. */
struct slot {
    int64_t key;  /* micro-batch; -1 = free */
    int ndim;     /* shape of the tensor encoded (encode) or decoded into (decode) */
    int64_t shape[EPIPE_MAX_NDIM];
    float *buf;   /* encode: a copy of the input; decode: the code [B][K][S]
                     (conv) or [N][K] (linear) */
    size_t cap;
};

struct cache {
    struct slot *s;
    unsigned n;
};

struct insert_state {
    int ready;     /* parameters exist */
    int64_t cin;   /* C (conv) or D (linear) */
    int64_t K, P;  /* code channels; values a patch */
    float *w[2], *g[2], *mom[2]; /* 0: E, 1: Rt, each [K][P] */
    int64_t wshape[2][4];
    DLTensor wt[2], gt[2];
    struct cache enc, dec;
    float *tmp;    /* per-batch patches or code when nothing is cached */
    size_t tmp_cap;
    float *tmp2;
    size_t tmp2_cap;
};

static struct insert_state *S(const epipe_codec *c)
{
    return c->state;
}

static int kind(const epipe_codec *c)
{
    return (int)c->p[I_KIND];
}

static int64_t kern(const epipe_codec *c)
{
    return (int64_t)c->p[I_KERNEL];
}

static int insert_configure(epipe_codec *c)
{
    if (isnan(c->p[I_KERNEL]))
        c->p[I_KERNEL] = kind(c) == KIND_CONV ? 4 : 1;
    if (kind(c) == KIND_LINEAR && c->p[I_KERNEL] != 1)
        return epipe_fail(EPIPE_EINVAL, "insert: kernel=%g applies to kind=conv only "
                          "(kind=linear projects the last dimension)", c->p[I_KERNEL]);
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

/* The geometry of a tensor of c->shape: rows B (conv: batch; linear: all
 * leading dims), channels cin, spatial positions S a row (linear: 1), and
 * the code's channel count K. Sets the codec's message on error. */
struct geom {
    int64_t B, cin, H, W, Ho, Wo, S, P, K;
};

static int geometry(epipe_codec *c, const int64_t *shape, int ndim, struct geom *g)
{
    memset(g, 0, sizeof *g);
    int64_t k = kern(c);
    if (kind(c) == KIND_CONV) {
        if (ndim != 4)
            return epipe_codec_fail(c, EPIPE_EINVAL,
                                    "insert: kind=conv takes [B,C,H,W] tensors; this one has "
                                    "%d dimensions", ndim);
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
                                (long long)g->K, (long long)g->P, (long long)g->cin,
                                (long long)k, (long long)k);
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
    int rc = geometry(mc, c->shape, c->ndim, &g);
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
 * Uniform draws and sqrt only, so every machine gets the same bits. */
static void init_orthonormal(float *E, int64_t K, int64_t P, uint64_t seed)
{
    double *m = malloc(sizeof(double) * (size_t)(K * P));
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

static int ensure_params(epipe_codec *c, int64_t cin)
{
    struct insert_state *st = S(c);
    if (st->ready)
        return EPIPE_OK;
    int64_t k = kern(c), P = cin * k * k, K = out_for(c, cin);
    if (K > P)
        return epipe_codec_fail(c, EPIPE_EINVAL, "insert: out=%lld exceeds the %lld values of "
                                "a patch: that would not compress", (long long)K, (long long)P);
    size_t n = (size_t)(K * P);
    for (int i = 0; i < 2; i++) {
        free(st->w[i]), free(st->g[i]); /* a failed earlier attempt */
        st->w[i] = malloc(n * sizeof(float));
        st->g[i] = calloc(n, sizeof(float));
        if (!st->w[i] || !st->g[i])
            return epipe_codec_fail(c, EPIPE_ENOMEM, "insert: no memory for %zu parameters", n);
    }
    init_orthonormal(st->w[0], K, P, (uint64_t)c->p[I_SEED]);
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

/* ---- caches and scratch ------------------------------------------------- */

static float *grow(float **p, size_t *cap, size_t n)
{
    if (*cap < n) {
        float *q = realloc(*p, n * sizeof *q);
        if (!q)
            return NULL;
        *p = q, *cap = n;
    }
    return *p;
}

/* The slot for key (reused if it exists), sized for n floats. */
static struct slot *cache_take(struct cache *ca, int64_t key, size_t n)
{
    struct slot *free_slot = NULL, *s = NULL;
    for (unsigned i = 0; i < ca->n; i++) {
        if (ca->s[i].key == key)
            s = &ca->s[i];
        else if (ca->s[i].key < 0 && !free_slot)
            free_slot = &ca->s[i];
    }
    if (!s)
        s = free_slot;
    if (!s) {
        struct slot *ns = realloc(ca->s, (ca->n + 1) * sizeof *ns);
        if (!ns)
            return NULL;
        ca->s = ns;
        s = &ca->s[ca->n++];
        memset(s, 0, sizeof *s);
        s->key = -1;
    }
    if (!grow(&s->buf, &s->cap, n ? n : 1))
        return NULL;
    s->key = key;
    return s;
}

static struct slot *cache_find(struct cache *ca, int64_t key)
{
    for (unsigned i = 0; i < ca->n; i++)
        if (ca->s[i].key == key)
            return &ca->s[i];
    return NULL;
}

static void cache_free(struct cache *ca)
{
    for (unsigned i = 0; i < ca->n; i++)
        free(ca->s[i].buf);
    free(ca->s);
    ca->s = NULL, ca->n = 0;
}

/* ---- patch layout -------------------------------------------------------
 * Sample b's patches as a [P][S] matrix: p = (c*k + u)*k + v, s = i*Wo + j,
 * value x[b][c][i*k+u][j*k+v]. The conv paths work on blocks of output
 * rows i in [i0, i1): a [P][(i1-i0)*Wo] slice that stays in the L2 cache
 * between the copy and the GEMM. */

/* Output rows a block: about 256 KiB of patches. */
static int64_t block_rows(const struct geom *g)
{
    int64_t r = ((int64_t)1 << 16) / (g->P * g->Wo);
    return r < 1 ? 1 : r > g->Ho ? g->Ho : r;
}

/* d[v][j] = src[j*k + v]: one input row split into its k phases. A
 * constant k lets the compiler turn this into vector shuffles. */
static inline void split_row(const float *restrict src, float *restrict dst, int64_t stride,
                             int64_t Wo, int64_t k)
{
    switch (k) {
#define SPLIT(K)                                                                                 \
    case K:                                                                                      \
        for (int64_t j = 0; j < Wo; j++)                                                         \
            for (int64_t v = 0; v < K; v++)                                                      \
                dst[v * stride + j] = src[j * K + v];                                            \
        return;
        SPLIT(1)
        SPLIT(2)
        SPLIT(4)
        SPLIT(8)
#undef SPLIT
    default:
        for (int64_t v = 0; v < k; v++)
            for (int64_t j = 0; j < Wo; j++)
                dst[v * stride + j] = src[j * k + v];
    }
}

static inline void join_row(const float *restrict src, float *restrict dst, int64_t stride,
                            int64_t Wo, int64_t k)
{
    switch (k) {
#define JOIN(K)                                                                                  \
    case K:                                                                                      \
        for (int64_t j = 0; j < Wo; j++)                                                         \
            for (int64_t v = 0; v < K; v++)                                                      \
                dst[j * K + v] = src[v * stride + j];                                            \
        return;
        JOIN(1)
        JOIN(2)
        JOIN(4)
        JOIN(8)
#undef JOIN
    default:
        for (int64_t v = 0; v < k; v++)
            for (int64_t j = 0; j < Wo; j++)
                dst[j * k + v] = src[v * stride + j];
    }
}

/* cols [P][ns], ns = (i1-i0)*Wo, from sample xb's rows i0..i1. */
static void im2col(const float *xb, const struct geom *g, int64_t k, int64_t i0, int64_t i1,
                   float *cols)
{
    int64_t ns = (i1 - i0) * g->Wo;
    for (int64_t ch = 0; ch < g->cin; ch++)
        for (int64_t u = 0; u < k; u++)
            for (int64_t i = i0; i < i1; i++)
                split_row(xb + (ch * g->H + i * k + u) * g->W,
                          cols + ((ch * k + u) * k) * ns + (i - i0) * g->Wo, ns, g->Wo, k);
}

static void col2im(const float *cols, const struct geom *g, int64_t k, int64_t i0, int64_t i1,
                   float *yb)
{
    int64_t ns = (i1 - i0) * g->Wo;
    for (int64_t ch = 0; ch < g->cin; ch++)
        for (int64_t u = 0; u < k; u++)
            for (int64_t i = i0; i < i1; i++)
                join_row(cols + ((ch * k + u) * k) * ns + (i - i0) * g->Wo,
                         yb + (ch * g->H + i * k + u) * g->W, ns, g->Wo, k);
}

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
                                    "insert: code value %zu (%g) does not fit fp16 (code=fp16)",
                                    i, (double)z[i]);
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
static int insert_forward_code(epipe_codec *c, const float *x, size_t n, float *z)
{
    struct insert_state *st = S(c);
    struct geom g;
    int rc = geometry(c, c->shape, c->ndim, &g);
    if (rc || (rc = ensure_params(c, g.cin)))
        return rc;
    int64_t k = kern(c), K = g.K, P = g.P, Sn = g.S, B = g.B;
    if (c->microbatch >= 0) { /* keep the input for the backward */
        struct slot *keep = cache_take(&st->enc, c->microbatch, n);
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
        int64_t rb = block_rows(&g);
        float *cols = grow(&st->tmp, &st->tmp_cap, (size_t)(P * rb * g.Wo));
        if (!cols)
            return epipe_codec_fail(c, EPIPE_ENOMEM, "insert: no scratch memory");
        size_t per_in = (size_t)(g.cin * g.H * g.W), per_z = (size_t)(K * Sn);
        for (int64_t b = 0; b < B; b++)
            for (int64_t i0 = 0; i0 < g.Ho; i0 += rb) {
                int64_t i1 = i0 + rb < g.Ho ? i0 + rb : g.Ho, ns = (i1 - i0) * g.Wo;
                im2col(x + (size_t)b * per_in, &g, k, i0, i1, cols);
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
static int insert_restore_code(epipe_codec *c, const float *z, float *y)
{
    struct insert_state *st = S(c);
    struct geom g;
    int rc = geometry(c, c->shape, c->ndim, &g);
    if (rc || (rc = ensure_params(c, g.cin)))
        return rc;
    int64_t k = kern(c), K = g.K, P = g.P, Sn = g.S, B = g.B;
    size_t zn_all = (size_t)(B * K * Sn);
    if (c->microbatch >= 0) {
        struct slot *keep = cache_find(&st->dec, c->microbatch);
        if (!keep || keep->buf != z) {
            if (!(keep = cache_take(&st->dec, c->microbatch, zn_all)))
                return epipe_codec_fail(c, EPIPE_ENOMEM, "insert: no memory to keep the code");
            memcpy(keep->buf, z, zn_all * sizeof(float));
        }
        keep->ndim = c->ndim;
        memcpy(keep->shape, c->shape, sizeof(int64_t) * (size_t)c->ndim);
    }
    if (kind(c) == KIND_LINEAR) {
        /* Y [N][D] = Z [N][d] Rt [d][D] */
        if (B)
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)B, (int)P, (int)K, 1.0f,
                        z, (int)K, st->w[1], (int)P, 0.0f, y, (int)P);
        return EPIPE_OK;
    }
    int64_t rb = block_rows(&g);
    size_t zn = (size_t)(K * Sn), per_out = (size_t)(g.cin * g.H * g.W);
    float *cols = grow(&st->tmp, &st->tmp_cap, (size_t)(P * rb * g.Wo));
    if (!cols)
        return epipe_codec_fail(c, EPIPE_ENOMEM, "insert: no scratch memory");
    for (int64_t b = 0; b < B; b++)
        for (int64_t i0 = 0; i0 < g.Ho; i0 += rb) {
            int64_t i1 = i0 + rb < g.Ho ? i0 + rb : g.Ho, ns = (i1 - i0) * g.Wo;
            /* cols [P][ns] = Rt^T [P][K] . Zb[:, block] [K][ns] */
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)P, (int)ns, (int)K, 1.0f,
                        st->w[1], (int)P, z + (size_t)b * zn + i0 * g.Wo, (int)Sn, 0.0f, cols,
                        (int)ns);
            col2im(cols, &g, k, i0, i1, y + (size_t)b * per_out);
        }
    return EPIPE_OK;
}

static int insert_encode(epipe_codec *c, const float *x, size_t n, uint8_t *body)
{
    struct insert_state *st = S(c);
    struct geom g;
    int rc = geometry(c, c->shape, c->ndim, &g);
    if (rc)
        return rc;
    size_t zn = (size_t)(g.B * g.K * g.S);
    float *z = grow(&st->tmp2, &st->tmp2_cap, zn ? zn : 1);
    if (!z)
        return epipe_codec_fail(c, EPIPE_ENOMEM, "insert: no scratch memory");
    if ((rc = insert_forward_code(c, x, n, z)))
        return rc;
    put_code(c, z, zn, body);
    return EPIPE_OK;
}

static int insert_decode(epipe_codec *c, const uint8_t *body, size_t n, float *y)
{
    struct insert_state *st = S(c);
    struct geom g;
    (void)n;
    int rc = geometry(c, c->shape, c->ndim, &g);
    if (rc)
        return rc;
    size_t zn = (size_t)(g.B * g.K * g.S);
    /* Read the code straight into the slot the backward will use. */
    struct slot *keep = NULL;
    if (c->microbatch >= 0 && !(keep = cache_take(&st->dec, c->microbatch, zn)))
        return epipe_codec_fail(c, EPIPE_ENOMEM, "insert: no memory to keep the code");
    float *z = keep ? keep->buf : grow(&st->tmp2, &st->tmp2_cap, zn ? zn : 1);
    if (!z)
        return epipe_codec_fail(c, EPIPE_ENOMEM, "insert: no scratch memory");
    if ((rc = get_code(c, body, zn, z, 0)) || (rc = insert_restore_code(c, z, y))) {
        if (keep)
            keep->key = -1;
        return rc;
    }
    return EPIPE_OK;
}

/* ---- training ------------------------------------------------------------ */

static int same_shape(const int64_t *a, int na, const int64_t *b, int nb)
{
    return na == nb && memcmp(a, b, sizeof(int64_t) * (size_t)na) == 0;
}

static int insert_code_shape(epipe_codec *c, const int64_t *shape, int ndim, int64_t *out,
                             int *out_ndim)
{
    struct geom g;
    int rc = geometry(c, shape, ndim, &g);
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
                                 const int64_t *code_shape, int code_ndim, const int64_t *full_shape,
                                 int full_ndim)
{
    int64_t want[EPIPE_MAX_NDIM];
    int wn;
    int rc = insert_code_shape(c, s->shape, s->ndim, want, &wn);
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

static int no_cache(epipe_codec *c, const char *what, int64_t mb)
{
    return epipe_codec_fail(c, EPIPE_ESTATE,
                            "insert: no %s of micro-batch %lld is kept for its backward (set "
                            "EPIPE_CODEC_MICROBATCH to the micro-batch before the %s)",
                            what, (long long)mb, what);
}

static int insert_encode_backward(epipe_codec *c, int64_t mb, const float *gz,
                                  const int64_t *zshape, int zndim, float *gx,
                                  const int64_t *xshape, int xndim)
{
    struct insert_state *st = S(c);
    struct slot *s = cache_find(&st->enc, mb);
    if (!s)
        return no_cache(c, "encode", mb);
    int rc = check_backward_shapes(c, s, "input", zshape, zndim, xshape, xndim);
    struct geom g;
    if (rc || (rc = geometry(c, s->shape, s->ndim, &g)))
        return rc;
    int64_t K = g.K, P = g.P, Sn = g.S, B = g.B, k = kern(c);
    if (kind(c) == KIND_LINEAR) {
        if (B) {
            /* dE [d][D] += gZ^T [d][N] X [N][D];  gX [N][D] = gZ [N][d] E [d][D] */
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)K, (int)P, (int)B, 1.0f, gz,
                        (int)K, s->buf, (int)P, 1.0f, st->g[0], (int)P);
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)B, (int)P, (int)K, 1.0f,
                        gz, (int)K, st->w[0], (int)P, 0.0f, gx, (int)P);
        }
        s->key = -1;
        return EPIPE_OK;
    }
    int64_t rb = block_rows(&g);
    float *cols = grow(&st->tmp, &st->tmp_cap, (size_t)(P * rb * g.Wo));
    if (!cols)
        return epipe_codec_fail(c, EPIPE_ENOMEM, "insert: no scratch memory");
    size_t zn = (size_t)(K * Sn), per = (size_t)(P * Sn);
    for (int64_t b = 0; b < B; b++)
        for (int64_t i0 = 0; i0 < g.Ho; i0 += rb) {
            int64_t i1 = i0 + rb < g.Ho ? i0 + rb : g.Ho, ns = (i1 - i0) * g.Wo;
            const float *gzb = gz + (size_t)b * zn + i0 * g.Wo;
            im2col(s->buf + (size_t)b * per, &g, k, i0, i1, cols);
            /* dE [K][P] += gZb [K][ns] cols^T [ns][P];  gcols [P][ns] = E^T gZb */
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)K, (int)P, (int)ns, 1.0f,
                        gzb, (int)Sn, cols, (int)ns, 1.0f, st->g[0], (int)P);
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)P, (int)ns, (int)K, 1.0f,
                        st->w[0], (int)P, gzb, (int)Sn, 0.0f, cols, (int)ns);
            col2im(cols, &g, k, i0, i1, gx + (size_t)b * per);
        }
    s->key = -1;
    return EPIPE_OK;
}

static int insert_decode_backward(epipe_codec *c, int64_t mb, const float *gy,
                                  const int64_t *yshape, int yndim, float *gz,
                                  const int64_t *zshape, int zndim)
{
    struct insert_state *st = S(c);
    struct slot *s = cache_find(&st->dec, mb);
    if (!s)
        return no_cache(c, "decode", mb);
    int rc = check_backward_shapes(c, s, "output", zshape, zndim, yshape, yndim);
    struct geom g;
    if (rc || (rc = geometry(c, s->shape, s->ndim, &g)))
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
    int64_t rb = block_rows(&g);
    float *cols = grow(&st->tmp, &st->tmp_cap, (size_t)(P * rb * g.Wo));
    if (!cols)
        return epipe_codec_fail(c, EPIPE_ENOMEM, "insert: no scratch memory");
    size_t zn = (size_t)(K * Sn), per = (size_t)(P * Sn);
    for (int64_t b = 0; b < B; b++)
        for (int64_t i0 = 0; i0 < g.Ho; i0 += rb) {
            int64_t i1 = i0 + rb < g.Ho ? i0 + rb : g.Ho, ns = (i1 - i0) * g.Wo;
            const float *zb = s->buf + (size_t)b * zn + i0 * g.Wo;
            im2col(gy + (size_t)b * per, &g, k, i0, i1, cols);
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

static int insert_tensor(epipe_codec *c, unsigned i, const char **name, DLTensor **param,
                         DLTensor **grad)
{
    static const char *const names[2] = {"compress.weight", "restore.weight"};
    struct insert_state *st = S(c);
    if (!st->ready && c->p[I_IN] > 0) {
        int rc = ensure_params(c, (int64_t)c->p[I_IN]);
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

static void insert_zero_grad(epipe_codec *c)
{
    struct insert_state *st = S(c);
    if (!st->ready)
        return;
    for (int i = 0; i < 2; i++)
        memset(st->g[i], 0, sizeof(float) * (size_t)(st->K * st->P));
}

static int insert_sgd(epipe_codec *c, float lr, float momentum)
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

static void insert_release(epipe_codec *c)
{
    struct insert_state *st = S(c);
    if (!st)
        return;
    for (int i = 0; i < 2; i++)
        free(st->w[i]), free(st->g[i]), free(st->mom[i]);
    cache_free(&st->enc);
    cache_free(&st->dec);
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
    .forward_code = insert_forward_code,
    .restore_code = insert_restore_code,
    .tensor = insert_tensor,
    .encode_backward = insert_encode_backward,
    .decode_backward = insert_decode_backward,
    .zero_grad = insert_zero_grad,
    .sgd_step = insert_sgd,
};

static const epipe_codec_backend insert_cpu = {
    .encode = insert_encode,
    .decode = insert_decode,
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
    .code_shape = insert_code_shape,
    .ntensors = insert_ntensors,
    .release = insert_release,
    .cpu = &insert_cpu,
};
