/* The insert codec: conv and linear compress/restore against direct loops,
 * the initial restore as the compress's pseudo-inverse, the payload checks,
 * finite-difference checks of every backward (inputs and parameters), the
 * built-in SGD, and the errors of the trainable API. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <epipe/epipe.h>

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

static epipe_codec *make(const char *spec)
{
    epipe_codec *c;
    int rc = epipe_codec_create(&c, spec);
    if (rc)
        fail_msg("%s: %s", spec, epipe_last_error());
    return c;
}

/* Encodes x; returns the payload (caller frees) and its length. */
static uint8_t *encode(epipe_codec *c, float *x, int64_t *shape, int ndim, size_t *len)
{
    DLTensor t = view(x, shape, ndim);
    size_t cap;
    assert_int_equal(epipe_codec_max_encoded_size(c, &t, &cap), EPIPE_OK);
    uint8_t *buf = malloc(cap);
    int rc = epipe_codec_encode(c, &t, buf, cap, len);
    if (rc)
        fail_msg("encode: %s", epipe_codec_last_error(c));
    assert_int_equal(*len, cap);
    return buf;
}

static void decode(epipe_codec *c, const uint8_t *buf, size_t len, float *y, int64_t *shape,
                   int ndim)
{
    DLTensor t = view(y, shape, ndim);
    int rc = epipe_codec_decode(c, buf, len, &t);
    if (rc)
        fail_msg("decode: %s", epipe_codec_last_error(c));
}

static float *param(epipe_codec *c, unsigned i, float **grad)
{
    DLTensor *p, *g;
    const char *name;
    int rc = epipe_codec_tensor(c, i, &name, &p, &g);
    if (rc)
        fail_msg("tensor %u: %s", i, epipe_codec_last_error(c));
    assert_string_equal(name, i ? "restore.weight" : "compress.weight");
    if (grad)
        *grad = g->data;
    return p->data;
}

/* ---- forward against direct loops --------------------------------------- */

/* The conv paths work in blocks of output rows (about 256 KiB of patches
 * each): the large case has two, the last one short. */
static void conv_direct(int64_t B, int64_t C, int64_t H, int64_t W, int64_t k, int64_t K)
{
    int64_t Ho = H / k, Wo = W / k;
    int64_t shape[4] = {B, C, H, W};
    size_t n = numel(shape, 4);
    float *x = malloc(n * 4), *y = malloc(n * 4), *want = calloc(n, 4);
    test_fill(x, n, DIST_NORMAL, 1);
    char spec[96];
    snprintf(spec, sizeof spec, "insert:kind=conv,out=%lld,kernel=%lld,seed=7", (long long)K,
             (long long)k);
    epipe_codec *c = make(spec);
    assert_true(epipe_codec_trainable(c));
    assert_int_equal(epipe_codec_id(c), 8);
    size_t len;
    uint8_t *buf = encode(c, x, shape, 4, &len);
    assert_int_equal(len, 16 + (size_t)(B * K * Ho * Wo) * 4);
    const float *E = param(c, 0, NULL);
    /* code[b][o][i][j] = sum_{ch,u,v} E[o][ch][u][v] x[b][ch][i*k+u][j*k+v] */
    for (int64_t b = 0; b < B; b++)
        for (int64_t o = 0; o < K; o++)
            for (int64_t i = 0; i < Ho; i++)
                for (int64_t j = 0; j < Wo; j++) {
                    double s = 0;
                    for (int64_t ch = 0; ch < C; ch++)
                        for (int64_t u = 0; u < k; u++)
                            for (int64_t v = 0; v < k; v++)
                                s += (double)E[((o * C + ch) * k + u) * k + v] *
                                     x[((b * C + ch) * H + i * k + u) * W + j * k + v];
                    float got;
                    memcpy(&got, buf + 16 + 4 * (((b * K + o) * Ho + i) * Wo + j), 4);
                    assert_true(fabs(got - s) < 1e-5);
                }
    /* The receiver: a fresh handle, same seed, builds the same weights; its
     * restore is the transposed convolution with Rt = E. */
    epipe_codec *r = make(spec);
    decode(r, buf, len, y, shape, 4);
    const float *Rt = param(r, 1, NULL);
    assert_memory_equal(Rt, E, (size_t)(K * C * k * k) * 4);
    for (int64_t b = 0; b < B; b++)
        for (int64_t o = 0; o < K; o++)
            for (int64_t i = 0; i < Ho; i++)
                for (int64_t j = 0; j < Wo; j++) {
                    float z;
                    memcpy(&z, buf + 16 + 4 * (((b * K + o) * Ho + i) * Wo + j), 4);
                    for (int64_t ch = 0; ch < C; ch++)
                        for (int64_t u = 0; u < k; u++)
                            for (int64_t v = 0; v < k; v++)
                                want[((b * C + ch) * H + i * k + u) * W + j * k + v] +=
                                    Rt[((o * C + ch) * k + u) * k + v] * z;
                }
    for (size_t i = 0; i < n; i++)
        assert_true(fabsf(y[i] - want[i]) < 1e-5f);
    /* restore(compress(.)) starts as a projection: applying it twice
     * changes nothing, and a patch in E's row space comes back exactly. */
    float *y2 = malloc(n * 4);
    size_t len2;
    uint8_t *buf2 = encode(c, y, shape, 4, &len2);
    decode(r, buf2, len2, y2, shape, 4);
    for (size_t i = 0; i < n; i++)
        assert_true(fabsf(y2[i] - y[i]) < 1e-5f);
    free(buf2), free(y2);
    free(buf), free(x), free(y), free(want);
    epipe_codec_destroy(c), epipe_codec_destroy(r);
}

static void conv_matches_direct_loops(void **state)
{
    (void)state;
    epipe_codec *c = make("insert:kind=conv,out=5,kernel=2,seed=7");
    assert_string_equal(epipe_codec_spec(c),
                        "insert:kind=conv,out=5,ratio=0,kernel=2,in=0,seed=7,code=fp32");
    epipe_codec_destroy(c);
    conv_direct(2, 3, 4, 6, 2, 5);
    conv_direct(1, 8, 64, 160, 2, 6); /* two row blocks */
    conv_direct(2, 2, 9, 6, 3, 4);    /* k = 3: the generic split */
}

static void linear_matches_direct_loops(void **state)
{
    (void)state;
    int64_t shape[3] = {3, 2, 6}, N = 6, D = 6, d = 3;
    size_t n = numel(shape, 3);
    float x[36], y[36], y2[36];
    test_fill(x, n, DIST_NORMAL, 2);
    epipe_codec *c = make("insert:kind=linear,ratio=0.5");
    assert_string_equal(epipe_codec_spec(c),
                        "insert:kind=linear,out=0,ratio=0.5,kernel=1,in=0,seed=1,code=fp32");
    DLTensor t = view(x, shape, 3);
    int nd;
    int64_t cs[EPIPE_CODEC_MAX_NDIM];
    assert_int_equal(epipe_codec_code_shape(c, &t, &nd, cs), EPIPE_OK);
    assert_int_equal(nd, 3);
    assert_true(cs[0] == 3 && cs[1] == 2 && cs[2] == d);
    size_t len;
    uint8_t *buf = encode(c, x, shape, 3, &len);
    assert_int_equal(len, 16 + (size_t)(N * d) * 4);
    const float *E = param(c, 0, NULL);
    /* Orthonormal rows. */
    for (int64_t a = 0; a < d; a++)
        for (int64_t b = 0; b < d; b++) {
            double s = 0;
            for (int64_t i = 0; i < D; i++)
                s += (double)E[a * D + i] * E[b * D + i];
            assert_true(fabs(s - (a == b)) < 1e-6);
        }
    for (int64_t r = 0; r < N; r++)
        for (int64_t o = 0; o < d; o++) {
            double s = 0;
            for (int64_t i = 0; i < D; i++)
                s += (double)E[o * D + i] * x[r * D + i];
            float got;
            memcpy(&got, buf + 16 + 4 * (r * d + o), 4);
            assert_true(fabs(got - s) < 1e-5);
        }
    epipe_codec *r = make("insert:kind=linear,ratio=0.5");
    decode(r, buf, len, y, shape, 3);
    size_t len2;
    uint8_t *buf2 = encode(c, y, shape, 3, &len2);
    decode(r, buf2, len2, y2, shape, 3);
    for (size_t i = 0; i < n; i++)
        assert_true(fabsf(y2[i] - y[i]) < 1e-5f);
    free(buf), free(buf2);
    epipe_codec_destroy(c), epipe_codec_destroy(r);
}

static void fp16_code_halves_the_payload(void **state)
{
    (void)state;
    int64_t shape[4] = {1, 4, 8, 8};
    size_t n = numel(shape, 4);
    float x[256], y[256], y32[256];
    test_fill(x, n, DIST_NORMAL, 3);
    epipe_codec *c = make("insert:kind=conv,out=8,kernel=4,code=fp16");
    epipe_codec *c32 = make("insert:kind=conv,out=8,kernel=4");
    size_t len, len32;
    uint8_t *buf = encode(c, x, shape, 4, &len), *buf32 = encode(c32, x, shape, 4, &len32);
    assert_int_equal(len - 16, (len32 - 16) / 2);
    decode(c, buf, len, y, shape, 4);
    decode(c32, buf32, len32, y32, shape, 4);
    for (size_t i = 0; i < n; i++)
        assert_true(fabsf(y[i] - y32[i]) < 1e-2f);
    /* An fp32 codec refuses the fp16 payload: another parameter word. */
    DLTensor t = view(y, shape, 4);
    assert_int_equal(epipe_codec_decode(c32, buf, len, &t), EPIPE_EPROTO);
    /* A NaN or infinity in the code is refused. */
    buf[16] = 0x00, buf[17] = 0x7c; /* fp16 +inf */
    assert_int_equal(epipe_codec_decode(c, buf, len, &t), EPIPE_EPROTO);
    assert_non_null(strstr(epipe_codec_last_error(c), "NaN or infinity"));
    free(buf), free(buf32);
    epipe_codec_destroy(c), epipe_codec_destroy(c32);
}

static void expect_create(const char *spec, int want, const char *needle)
{
    epipe_codec *c;
    assert_int_equal(epipe_codec_create(&c, spec), want);
    assert_null(c);
    if (!strstr(epipe_last_error(), needle))
        fail_msg("%s: message '%s' lacks '%s'", spec, epipe_last_error(), needle);
}

static void bad_specs_shapes_and_payloads(void **state)
{
    (void)state;
    expect_create("insert:out=4,ratio=0.5", EPIPE_EINVAL, "not both");
    expect_create("insert:kind=linear,kernel=2", EPIPE_EINVAL, "kind=conv only");
    expect_create("insert:kind=mlp", EPIPE_EINVAL, "conv|linear");
    expect_create("sortquant:bits=8|none", EPIPE_ENOTSUP, "only a trainable codec");
    expect_create("insert:out=2|insert:out=1", EPIPE_ENOTSUP, "must not be trainable");
    expect_create("insert:out=2|quant|none", EPIPE_ENOTSUP, "more than two");
    expect_create("insert:out=2|quant:bits=99", EPIPE_EINVAL, "out of range");

    epipe_codec *c = make("insert:kind=conv,out=4,kernel=4");
    float x[2 * 2 * 6 * 8] = {0}, y[2 * 2 * 6 * 8];
    int64_t odd[4] = {2, 2, 6, 8}, flat[2] = {4, 24}, ok[4] = {2, 2, 4, 4};
    DLTensor t = view(x, odd, 4);
    size_t cap;
    assert_int_equal(epipe_codec_max_encoded_size(c, &t, &cap), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_codec_last_error(c), "divisible by kernel=4"));
    t = view(x, flat, 2);
    assert_int_equal(epipe_codec_max_encoded_size(c, &t, &cap), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_codec_last_error(c), "[B,C,H,W]"));
    epipe_codec *big = make("insert:kind=conv,out=40,kernel=2");
    t = view(x, ok, 4);
    assert_int_equal(epipe_codec_max_encoded_size(big, &t, &cap), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_codec_last_error(big), "would not compress"));
    epipe_codec_destroy(big);

    /* Parameters exist only once C is known; then another C is refused. */
    assert_int_equal(epipe_codec_tensor(c, 0, NULL, NULL, NULL), EPIPE_ESTATE);
    test_fill(x, 64, DIST_NORMAL, 4);
    size_t len;
    uint8_t *buf = encode(c, x, ok, 4, &len);
    assert_int_equal(epipe_codec_tensor(c, 0, NULL, NULL, NULL), EPIPE_OK);
    assert_int_equal(epipe_codec_tensor(c, 2, NULL, NULL, NULL), EPIPE_EINVAL);
    int64_t three[4] = {1, 3, 4, 4};
    t = view(x, three, 4);
    assert_int_equal(epipe_codec_max_encoded_size(c, &t, &cap), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_codec_last_error(c), "parameters are for C=2"));

    /* Payload checks: truncated, trailing bytes, a NaN code. */
    t = view(y, ok, 4);
    assert_int_equal(epipe_codec_decode(c, buf, len - 1, &t), EPIPE_ETRUNC);
    uint8_t *longer = calloc(1, len + 1);
    memcpy(longer, buf, len);
    assert_int_equal(epipe_codec_decode(c, longer, len + 1, &t), EPIPE_EPROTO);
    free(longer);
    const float nan = NAN;
    memcpy(buf + 16 + 8, &nan, 4);
    assert_int_equal(epipe_codec_decode(c, buf, len, &t), EPIPE_EPROTO);
    assert_non_null(strstr(epipe_codec_last_error(c), "code value 2 is not finite"));
    /* A payload made for another out= is refused by its parameter word. */
    epipe_codec *other = make("insert:kind=conv,out=3,kernel=4");
    uint8_t *buf3 = encode(other, x, ok, 4, &len);
    assert_int_equal(epipe_codec_decode(c, buf3, len, &t), EPIPE_EPROTO);
    free(buf3), free(buf);
    epipe_codec_destroy(other);

    /* in= creates the parameters at once. */
    epipe_codec *lin = make("insert:kind=linear,out=2,in=5");
    DLTensor *p;
    assert_int_equal(epipe_codec_tensor(lin, 1, NULL, &p, NULL), EPIPE_OK);
    assert_int_equal(p->ndim, 2);
    assert_true(p->shape[0] == 2 && p->shape[1] == 5);
    epipe_codec_destroy(lin);
    epipe_codec_destroy(c);
}

static void other_codecs_are_not_trainable(void **state)
{
    (void)state;
    epipe_codec *c = make("sortquant:bits=8");
    assert_false(epipe_codec_trainable(c));
    unsigned count = 9;
    float g[4] = {0};
    int64_t s = 4;
    DLTensor t = view(g, &s, 1);
    assert_int_equal(epipe_codec_num_tensors(c, &count), EPIPE_ENOTSUP);
    assert_int_equal(count, 0);
    assert_non_null(strstr(epipe_codec_last_error(c), "no parameters to train"));
    assert_int_equal(epipe_codec_tensor(c, 0, NULL, NULL, NULL), EPIPE_ENOTSUP);
    assert_int_equal(epipe_codec_encode_backward(c, 0, &t, &t), EPIPE_ENOTSUP);
    assert_int_equal(epipe_codec_decode_backward(c, 0, &t, &t), EPIPE_ENOTSUP);
    assert_int_equal(epipe_codec_zero_grad(c), EPIPE_ENOTSUP);
    assert_int_equal(epipe_codec_sgd_step(c, 0.1, 0.9), EPIPE_ENOTSUP);
    int nd;
    int64_t cs[EPIPE_CODEC_MAX_NDIM];
    assert_int_equal(epipe_codec_code_shape(c, &t, &nd, cs), EPIPE_OK);
    assert_true(nd == 1 && cs[0] == 4);
    epipe_codec_destroy(c);
}

/* ---- finite differences --------------------------------------------------
 * L = <G, f(...)> for a fixed random G; f is linear in its input and in its
 * weights, so central differences are exact up to fp32 rounding. */

struct fd {
    const char *spec;
    int ndim;
    int64_t shape[4];
};

static double dot(const float *a, const float *b, size_t n)
{
    double s = 0;
    for (size_t i = 0; i < n; i++)
        s += (double)a[i] * b[i];
    return s;
}

/* Encoder's L(x, E) = <G, code(x)>. */
static double enc_loss(epipe_codec *c, float *x, const struct fd *f, const float *G, size_t nz)
{
    int64_t shape[4];
    memcpy(shape, f->shape, sizeof shape);
    size_t len;
    uint8_t *buf = encode(c, x, shape, f->ndim, &len);
    assert_int_equal(len, 16 + nz * 4);
    float *z = malloc(nz * 4);
    memcpy(z, buf + 16, nz * 4);
    double l = dot(G, z, nz);
    free(z), free(buf);
    return l;
}

static void check_close(double fd, double an, const char *what, size_t i)
{
    if (fabs(fd - an) > 2e-3 * fmax(1.0, fabs(fd)))
        fail_msg("%s[%zu]: finite difference %.6g vs backward %.6g", what, i, fd, an);
}

static void fd_encoder(const struct fd *f)
{
    epipe_codec *c = make(f->spec);
    int64_t shape[4], zs[EPIPE_CODEC_MAX_NDIM];
    memcpy(shape, f->shape, sizeof shape);
    size_t n = numel(shape, f->ndim);
    float *x = malloc(n * 4), *gx = malloc(n * 4);
    test_fill(x, n, DIST_NORMAL, 11);
    DLTensor xt = view(x, shape, f->ndim);
    int zn;
    assert_int_equal(epipe_codec_code_shape(c, &xt, &zn, zs), EPIPE_OK);
    size_t nz = numel(zs, zn);
    float *G = malloc(nz * 4);
    test_fill(G, nz, DIST_NORMAL, 12);
    /* Forward with the micro-batch kept, then the backward. */
    assert_int_equal(epipe_codec_set_param(c, EPIPE_CODEC_MICROBATCH, 3), EPIPE_OK);
    enc_loss(c, x, f, G, nz);
    assert_int_equal(epipe_codec_set_param(c, EPIPE_CODEC_MICROBATCH, -1), EPIPE_OK);
    DLTensor gt = view(G, zs, zn), gxt = view(gx, shape, f->ndim);
    assert_int_equal(epipe_codec_encode_backward(c, 2, &gt, &gxt), EPIPE_ESTATE);
    int rc = epipe_codec_encode_backward(c, 3, &gt, &gxt);
    if (rc)
        fail_msg("encode_backward: %s", epipe_codec_last_error(c));
    /* Consumed: a second backward of the same micro-batch is refused. */
    assert_int_equal(epipe_codec_encode_backward(c, 3, &gt, &gxt), EPIPE_ESTATE);
    float *gE, *E = param(c, 0, &gE);
    float *gR;
    param(c, 1, &gR);
    DLTensor *pt;
    epipe_codec_tensor(c, 0, NULL, &pt, NULL);
    size_t ne = numel(pt->shape, pt->ndim);
    for (size_t i = 0; i < ne; i++)
        assert_true(gR[i] == 0.0f); /* the encoder trains compress only */
    const float h = 1e-2f;
    for (size_t i = 0; i < n; i += 1 + n / 37) {
        float keep = x[i];
        x[i] = keep + h;
        double lp = enc_loss(c, x, f, G, nz);
        x[i] = keep - h;
        double lm = enc_loss(c, x, f, G, nz);
        x[i] = keep;
        check_close((lp - lm) / (2 * h), gx[i], "grad_input", i);
    }
    for (size_t i = 0; i < ne; i += 1 + ne / 37) {
        float keep = E[i];
        E[i] = keep + h;
        double lp = enc_loss(c, x, f, G, nz);
        E[i] = keep - h;
        double lm = enc_loss(c, x, f, G, nz);
        E[i] = keep;
        check_close((lp - lm) / (2 * h), gE[i], "grad compress.weight", i);
    }
    /* Gradients accumulate until zero_grad. */
    float g0 = gE[0];
    assert_int_equal(epipe_codec_set_param(c, EPIPE_CODEC_MICROBATCH, 0), EPIPE_OK);
    enc_loss(c, x, f, G, nz);
    assert_int_equal(epipe_codec_encode_backward(c, 0, &gt, &gxt), EPIPE_OK);
    assert_true(fabsf(gE[0] - 2 * g0) <= 1e-5f * fmaxf(1.0f, fabsf(g0)));
    assert_int_equal(epipe_codec_zero_grad(c), EPIPE_OK);
    assert_true(gE[0] == 0.0f);
    free(x), free(gx), free(G);
    epipe_codec_destroy(c);
}

/* Decoder's L(z, Rt) = <G, restore(z)>; z is written into a payload. */
static double dec_loss(epipe_codec *c, uint8_t *buf, size_t len, const struct fd *f, const float *G,
                       float *y)
{
    int64_t shape[4];
    memcpy(shape, f->shape, sizeof shape);
    decode(c, buf, len, y, shape, f->ndim);
    return dot(G, y, numel(shape, f->ndim));
}

static void fd_decoder(const struct fd *f)
{
    epipe_codec *c = make(f->spec);
    int64_t shape[4], zs[EPIPE_CODEC_MAX_NDIM];
    memcpy(shape, f->shape, sizeof shape);
    size_t n = numel(shape, f->ndim);
    float *x = malloc(n * 4), *y = malloc(n * 4), *G = malloc(n * 4);
    test_fill(x, n, DIST_NORMAL, 21);
    test_fill(G, n, DIST_NORMAL, 22);
    size_t len;
    uint8_t *buf = encode(c, x, shape, f->ndim, &len); /* a payload of the right layout */
    DLTensor xt = view(x, shape, f->ndim);
    int zn;
    assert_int_equal(epipe_codec_code_shape(c, &xt, &zn, zs), EPIPE_OK);
    size_t nz = numel(zs, zn);
    float *z = malloc(nz * 4), *gz = malloc(nz * 4);
    test_fill(z, nz, DIST_NORMAL, 23);
    memcpy(buf + 16, z, nz * 4);
    /* The restore weights: perturb them away from E so that they are
     * generic, then check the backward there. */
    float *gR, *R = param(c, 1, &gR);
    DLTensor *pt;
    epipe_codec_tensor(c, 1, NULL, &pt, NULL);
    size_t nr = numel(pt->shape, pt->ndim);
    float *noise = malloc(nr * 4);
    test_fill(noise, nr, DIST_NORMAL, 24);
    for (size_t i = 0; i < nr; i++)
        R[i] += 0.3f * noise[i];
    free(noise);
    assert_int_equal(epipe_codec_set_param(c, EPIPE_CODEC_MICROBATCH, 5), EPIPE_OK);
    dec_loss(c, buf, len, f, G, y);
    assert_int_equal(epipe_codec_set_param(c, EPIPE_CODEC_MICROBATCH, -1), EPIPE_OK);
    DLTensor Gt = view(G, shape, f->ndim), gzt = view(gz, zs, zn);
    int rc = epipe_codec_decode_backward(c, 5, &Gt, &gzt);
    if (rc)
        fail_msg("decode_backward: %s", epipe_codec_last_error(c));
    /* A wrong code-gradient shape is refused. */
    assert_int_equal(epipe_codec_set_param(c, EPIPE_CODEC_MICROBATCH, 6), EPIPE_OK);
    dec_loss(c, buf, len, f, G, y);
    DLTensor wrong = view(gz, shape, f->ndim);
    assert_int_equal(epipe_codec_decode_backward(c, 6, &Gt, &wrong), EPIPE_EINVAL);
    assert_int_equal(epipe_codec_set_param(c, EPIPE_CODEC_MICROBATCH, -1), EPIPE_OK);
    float *gE;
    param(c, 0, &gE);
    for (size_t i = 0; i < nr; i++)
        assert_true(gE[i] == 0.0f); /* the decoder trains restore only */
    const float h = 1e-2f;
    for (size_t i = 0; i < nz; i += 1 + nz / 37) {
        float keep = z[i];
        z[i] = keep + h;
        memcpy(buf + 16, z, nz * 4);
        double lp = dec_loss(c, buf, len, f, G, y);
        z[i] = keep - h;
        memcpy(buf + 16, z, nz * 4);
        double lm = dec_loss(c, buf, len, f, G, y);
        z[i] = keep;
        memcpy(buf + 16, z, nz * 4);
        check_close((lp - lm) / (2 * h), gz[i], "grad_code", i);
    }
    for (size_t i = 0; i < nr; i += 1 + nr / 37) {
        float keep = R[i];
        R[i] = keep + h;
        double lp = dec_loss(c, buf, len, f, G, y);
        R[i] = keep - h;
        double lm = dec_loss(c, buf, len, f, G, y);
        R[i] = keep;
        check_close((lp - lm) / (2 * h), gR[i], "grad restore.weight", i);
    }
    /* SGD with momentum, PyTorch's form: v = m v + g; w -= lr v. */
    float w0 = R[1], g = gR[1];
    assert_int_equal(epipe_codec_sgd_step(c, 0.5, 0.9), EPIPE_OK);
    assert_true(fabsf(R[1] - (w0 - 0.5f * g)) < 1e-6f);
    assert_int_equal(epipe_codec_sgd_step(c, 0.5, 0.9), EPIPE_OK);
    assert_true(fabsf(R[1] - (w0 - 0.5f * g - 0.5f * (0.9f * g + g))) < 1e-5f);
    assert_int_equal(epipe_codec_sgd_step(c, -1, 0.9), EPIPE_EINVAL);
    assert_int_equal(epipe_codec_sgd_step(c, 0.1, 1.0), EPIPE_EINVAL);
    free(x), free(y), free(G), free(z), free(gz), free(buf);
    epipe_codec_destroy(c);
}

static const struct fd fd_cases[] = {
    {"insert:kind=conv,out=5,kernel=2", 4, {2, 3, 4, 6}},
    {"insert:kind=conv,out=3,kernel=1", 4, {2, 4, 3, 3}},
    {"insert:kind=conv,ratio=0.25,kernel=3", 4, {1, 2, 6, 3}},
    {"insert:kind=conv,out=6,kernel=2", 4, {1, 8, 64, 160}}, /* two row blocks */
    {"insert:kind=linear,out=4", 3, {3, 2, 7}},
    {"insert:kind=linear,out=1", 1, {5}},
};

static void encoder_gradients_match_finite_differences(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof fd_cases / sizeof fd_cases[0]; i++)
        fd_encoder(&fd_cases[i]);
}

static void decoder_gradients_match_finite_differences(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof fd_cases / sizeof fd_cases[0]; i++)
        fd_decoder(&fd_cases[i]);
}

/* A half-precision gradient tensor is staged through fp32. */
static void backward_takes_half_tensors(void **state)
{
    (void)state;
    epipe_codec *c = make("insert:kind=linear,out=2");
    int64_t shape[2] = {2, 4}, zs[2] = {2, 2};
    float x[8], gx[8], G[4] = {1, -2, 0.5f, 3};
    test_fill(x, 8, DIST_NORMAL, 31);
    epipe_codec_set_param(c, EPIPE_CODEC_MICROBATCH, 0);
    size_t len;
    free(encode(c, x, shape, 2, &len));
    epipe_codec_set_param(c, EPIPE_CODEC_MICROBATCH, 1);
    free(encode(c, x, shape, 2, &len));
    DLTensor gt = view(G, zs, 2), gxt = view(gx, shape, 2);
    assert_int_equal(epipe_codec_encode_backward(c, 0, &gt, &gxt), EPIPE_OK);
    uint16_t g16[4], gx16[8];
    for (int i = 0; i < 4; i++)
        g16[i] = (uint16_t)(i == 0 ? 0x3c00 : i == 1 ? 0xc000 : i == 2 ? 0x3800 : 0x4200);
    DLTensor h = {
        .data = g16, .device = {kDLCPU, 0}, .ndim = 2, .dtype = {kDLFloat, 16, 1}, .shape = zs};
    DLTensor hx = {
        .data = gx16, .device = {kDLCPU, 0}, .ndim = 2, .dtype = {kDLFloat, 16, 1}, .shape = shape};
    assert_int_equal(epipe_codec_encode_backward(c, 1, &h, &hx), EPIPE_OK);
    for (int i = 0; i < 8; i++) {
        /* fp16 -> f32 by hand for normal numbers */
        uint16_t b = gx16[i];
        int e = (b >> 10) & 31;
        float m = (float)(b & 1023) / 1024.0f;
        float v = e ? ldexpf(1.0f + m, e - 15) : ldexpf(m, -14);
        if (b & 0x8000)
            v = -v;
        assert_true(fabsf(v - gx[i]) < 2e-3f * fmaxf(1.0f, fabsf(gx[i])));
    }
    epipe_codec_destroy(c);
}

/* "insert|quant": the code is quantized; each link's header is in the
 * payload and checked; training goes through the first link. */
static void chains_quantize_the_code(void **state)
{
    (void)state;
    epipe_codec *ch = make("insert:kind=linear,out=4|sortquant:bits=8");
    epipe_codec *plain = make("insert:kind=linear,out=4");
    assert_string_equal(epipe_codec_name(ch), "chain");
    assert_int_equal(epipe_codec_id(ch), 64);
    assert_true(epipe_codec_trainable(ch));
    assert_non_null(strstr(epipe_codec_spec(ch), "|sortquant:bits=8,mode=fit"));
    epipe_codec *again = make(epipe_codec_spec(ch));
    assert_string_equal(epipe_codec_spec(again), epipe_codec_spec(ch));
    epipe_codec_destroy(again);
    int64_t shape[2] = {64, 16};
    float x[1024], y[1024], yp[1024];
    test_fill(x, 1024, DIST_NORMAL, 41);
    size_t len, plen;
    epipe_codec_set_param(ch, EPIPE_CODEC_MICROBATCH, 0);
    uint8_t *buf = encode(ch, x, shape, 2, &len), *pbuf = encode(plain, x, shape, 2, &plen);
    assert_int_equal(buf[0], 64);
    assert_int_equal(buf[16], 8);
    assert_int_equal(buf[32], 4); /* sortquant */
    assert_true(len < plen / 3);
    epipe_codec *rx = make("insert:kind=linear,out=4|sortquant:bits=8");
    epipe_codec_set_param(rx, EPIPE_CODEC_MICROBATCH, 0);
    decode(rx, buf, len, y, shape, 2);
    decode(plain, pbuf, plen, yp, shape, 2);
    assert_true(test_mse(y, yp, 1024) < 1e-3 * test_mse(yp, (float[1024]){0}, 1024));
    /* Headers of both links are checked, and the inner payload. */
    DLTensor t = view(y, shape, 2);
    for (size_t off = 0; off < 48; off++) {
        buf[off] ^= 0x40;
        int rc = epipe_codec_decode(rx, buf, len, &t);
        int count = (off >= 8 && off < 16) || (off >= 40 && off < 48); /* EINVAL: dst's count */
        if (count ? rc != EPIPE_EINVAL : rc != EPIPE_EPROTO && rc != EPIPE_EVERSION)
            fail_msg("byte %zu flipped: %s", off, epipe_status_name(rc));
        buf[off] ^= 0x40;
    }
    assert_int_equal(epipe_codec_decode(rx, buf, len - 1, &t), EPIPE_ETRUNC);
    assert_int_equal(epipe_codec_decode(plain, buf, len, &t), EPIPE_EPROTO);
    /* Backward through the chain: the quantizer is the identity. */
    float gz[256], gx[1024];
    int64_t zs[2] = {64, 4};
    test_fill(gz, 256, DIST_NORMAL, 42);
    DLTensor gzt = view(gz, zs, 2), gxt = view(gx, shape, 2);
    assert_int_equal(epipe_codec_encode_backward(ch, 0, &gzt, &gxt), EPIPE_OK);
    assert_int_equal(epipe_codec_decode_backward(rx, 0, &gxt, &gzt), EPIPE_OK);
    free(buf), free(pbuf);
    epipe_codec_destroy(ch), epipe_codec_destroy(plain), epipe_codec_destroy(rx);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(conv_matches_direct_loops),
        cmocka_unit_test(linear_matches_direct_loops),
        cmocka_unit_test(fp16_code_halves_the_payload),
        cmocka_unit_test(bad_specs_shapes_and_payloads),
        cmocka_unit_test(other_codecs_are_not_trainable),
        cmocka_unit_test(encoder_gradients_match_finite_differences),
        cmocka_unit_test(decoder_gradients_match_finite_differences),
        cmocka_unit_test(backward_takes_half_tensors),
        cmocka_unit_test(chains_quantize_the_code),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
