/* insert's caches, scratch and conv patch layout: the per-micro-batch slots
 * a backward reads, and im2col/col2im between a sample and its patches. */
#include <stdlib.h>
#include <string.h>

#include "insert.h"

/* ---- caches and scratch ------------------------------------------------- */

float *epipe_insert_grow(float **p, size_t *cap, size_t n)
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
struct slot *epipe_insert_cache_take(struct cache *ca, int64_t key, size_t n)
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
    if (!epipe_insert_grow(&s->buf, &s->cap, n ? n : 1))
        return NULL;
    s->key = key;
    return s;
}

struct slot *epipe_insert_cache_find(struct cache *ca, int64_t key)
{
    for (unsigned i = 0; i < ca->n; i++)
        if (ca->s[i].key == key)
            return &ca->s[i];
    return NULL;
}

void epipe_insert_cache_free(struct cache *ca)
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
int64_t epipe_insert_block_rows(const struct geom *g)
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
#define SPLIT(K)                                                                                   \
    case K:                                                                                        \
        for (int64_t j = 0; j < Wo; j++)                                                           \
            for (int64_t v = 0; v < K; v++)                                                        \
                dst[v * stride + j] = src[j * K + v];                                              \
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
#define JOIN(K)                                                                                    \
    case K:                                                                                        \
        for (int64_t j = 0; j < Wo; j++)                                                           \
            for (int64_t v = 0; v < K; v++)                                                        \
                dst[j * K + v] = src[v * stride + j];                                              \
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
void epipe_insert_im2col(const float *xb, const struct geom *g, int64_t k, int64_t i0, int64_t i1,
                         float *cols)
{
    int64_t ns = (i1 - i0) * g->Wo;
    for (int64_t ch = 0; ch < g->cin; ch++)
        for (int64_t u = 0; u < k; u++)
            for (int64_t i = i0; i < i1; i++)
                split_row(xb + (ch * g->H + i * k + u) * g->W,
                          cols + ((ch * k + u) * k) * ns + (i - i0) * g->Wo, ns, g->Wo, k);
}

void epipe_insert_col2im(const float *cols, const struct geom *g, int64_t k, int64_t i0, int64_t i1,
                         float *yb)
{
    int64_t ns = (i1 - i0) * g->Wo;
    for (int64_t ch = 0; ch < g->cin; ch++)
        for (int64_t u = 0; u < k; u++)
            for (int64_t i = i0; i < i1; i++)
                join_row(cols + ((ch * k + u) * k) * ns + (i - i0) * g->Wo,
                         yb + (ch * g->H + i * k + u) * g->W, ns, g->Wo, k);
}
