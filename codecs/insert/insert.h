/* insert internals shared by its files: the parameter indices, the state
 * (parameters, per-micro-batch caches, scratch), the geometry and patch helpers. */
#ifndef EPIPE_CODECS_INSERT_H
#define EPIPE_CODECS_INSERT_H

#include <stddef.h>
#include <stdint.h>

#include "../../lib/codec/codec_impl.h"
#include "../../lib/tensor.h"

enum { I_KIND, I_OUT, I_RATIO, I_KERNEL, I_IN, I_SEED, I_CODE };
enum { KIND_CONV = 0, KIND_LINEAR = 1 };
enum { CODE_F32 = 0, CODE_F16 = 1 };

#define INSERT_MAX_OUT 16777215.0 /* 24 bits of the parameter word */

/* What a backward needs of one micro-batch's forward. */
struct slot {
    int64_t key; /* micro-batch; -1 = free */
    int ndim;    /* shape of the tensor encoded (encode) or decoded into (decode) */
    int64_t shape[EPIPE_MAX_NDIM];
    float *buf; /* encode: a copy of the input; decode: the code [B][K][S]
                     (conv) or [N][K] (linear) */
    size_t cap;
};

struct cache {
    struct slot *s;
    unsigned n;
};

struct insert_state {
    int ready;                   /* parameters exist */
    int64_t cin;                 /* C (conv) or D (linear) */
    int64_t K, P;                /* code channels; values a patch */
    float *w[2], *g[2], *mom[2]; /* 0: E, 1: Rt, each [K][P] */
    int64_t wshape[2][4];
    DLTensor wt[2], gt[2];
    struct cache enc, dec;
    float *tmp; /* per-batch patches or code when nothing is cached */
    size_t tmp_cap;
    float *tmp2;
    size_t tmp2_cap;
};

static inline struct insert_state *S(const epipe_codec *c)
{
    return c->state;
}

static inline int kind(const epipe_codec *c)
{
    return (int)c->p[I_KIND];
}

static inline int64_t kern(const epipe_codec *c)
{
    return (int64_t)c->p[I_KERNEL];
}

/* The geometry of a tensor of c->shape: rows B (conv: batch; linear: all
 * leading dims), channels cin, spatial positions S a row (linear: 1), and
 * the code's channel count K. Sets the codec's message on error. */
struct geom {
    int64_t B, cin, H, W, Ho, Wo, S, P, K;
};

/* insert.c: the geometry, and the parameters once C (or D) is known. */
int epipe_insert_geometry(epipe_codec *c, const int64_t *shape, int ndim, struct geom *g);
int epipe_insert_ensure_params(epipe_codec *c, int64_t cin);

/* patches.c: caches, scratch, and the conv patch layout. */
float *epipe_insert_grow(float **p, size_t *cap, size_t n);
struct slot *epipe_insert_cache_take(struct cache *ca, int64_t key, size_t n);
struct slot *epipe_insert_cache_find(struct cache *ca, int64_t key);
void epipe_insert_cache_free(struct cache *ca);
int64_t epipe_insert_block_rows(const struct geom *g);
void epipe_insert_im2col(const float *xb, const struct geom *g, int64_t k, int64_t i0, int64_t i1,
                         float *cols);
void epipe_insert_col2im(const float *cols, const struct geom *g, int64_t k, int64_t i0, int64_t i1,
                         float *yb);

/* forward.c: the code bytes, compress and restore. */
int epipe_insert_forward_code(epipe_codec *c, const float *x, size_t n, float *z);
int epipe_insert_restore_code(epipe_codec *c, const float *z, float *y);
int epipe_insert_encode(epipe_codec *c, const float *x, size_t n, uint8_t *body);
int epipe_insert_decode(epipe_codec *c, const uint8_t *body, size_t n, float *y);

/* train.c: the backward passes and the trained parameters. */
int epipe_insert_code_shape(epipe_codec *c, const int64_t *shape, int ndim, int64_t *out,
                            int *out_ndim);
int epipe_insert_encode_backward(epipe_codec *c, int64_t mb, const float *gz, const int64_t *zshape,
                                 int zndim, float *gx, const int64_t *xshape, int xndim);
int epipe_insert_decode_backward(epipe_codec *c, int64_t mb, const float *gy, const int64_t *yshape,
                                 int yndim, float *gz, const int64_t *zshape, int zndim);
int epipe_insert_tensor(epipe_codec *c, unsigned i, const char **name, DLTensor **param,
                        DLTensor **grad);
void epipe_insert_zero_grad(epipe_codec *c);
int epipe_insert_sgd(epipe_codec *c, float lr, float momentum);

#endif
