/* Dense layers on the BLAS (cblas_sgemm), the softmax cross-entropy head and
 * SGD with momentum. Row-major throughout: a micro-batch is [rows][width]. */
#include "model.h"

#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

static uint64_t mix(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    return x ^ (x >> 33);
}

static float gauss(uint64_t key) /* deterministic N(0,1) draw */
{
    double u = ((double)(mix(key) >> 11) + 0.5) * 0x1p-53;
    double v = (double)(mix(key ^ 0x5bd1e995ull) >> 11) * 0x1p-53;
    return (float)(sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v));
}

static int layer_init(dense_layer *l, int in, int out, int relu, uint64_t seed)
{
    size_t nw = (size_t)in * (size_t)out;
    l->in = in, l->out = out, l->relu = relu;
    l->w = malloc(nw * sizeof(float));
    l->gw = calloc(nw, sizeof(float));
    l->vw = calloc(nw, sizeof(float));
    l->b = calloc((size_t)out, sizeof(float));
    l->gb = calloc((size_t)out, sizeof(float));
    l->vb = calloc((size_t)out, sizeof(float));
    if (!l->w || !l->gw || !l->vw || !l->b || !l->gb || !l->vb)
        return -1;
    float scale = sqrtf(2.0f / (float)in);
    for (size_t i = 0; i < nw; i++)
        l->w[i] = gauss(seed * 0x9e3779b97f4a7c15ull + i) * scale;
    return 0;
}

static void layer_free(dense_layer *l)
{
    free(l->w), free(l->gw), free(l->vw), free(l->b), free(l->gb), free(l->vb);
}

int model_init(stage_model *m, const int *dims, int n, int l0, int l1, int rows, int mbs,
               uint64_t seed)
{
    memset(m, 0, sizeof *m);
    if (l1 - l0 > MODEL_MAX_LAYERS || mbs > MODEL_MAX_MB || l0 < 0 || l1 > n)
        return -1;
    m->nlayers = l1 - l0;
    m->rows = rows;
    m->mbs = mbs;
    int widest = 0;
    for (int l = l0; l <= l1; l++)
        widest = dims[l] > widest ? dims[l] : widest;
    for (int k = 0; k < m->nlayers; k++)
        if (layer_init(&m->layers[k], dims[l0 + k], dims[l0 + k + 1], l0 + k + 1 < n,
                       seed + (uint64_t)(l0 + k) * 1000003u))
            return -1;
    for (int mb = 0; mb < mbs; mb++)
        for (int k = 0; k <= m->nlayers; k++)
            if (!(m->act[mb][k] = malloc(sizeof(float) * (size_t)rows * (size_t)dims[l0 + k])))
                return -1;
    size_t scratch = sizeof(float) * (size_t)rows * (size_t)widest;
    m->grad[0] = malloc(scratch);
    m->grad[1] = malloc(scratch);
    m->dx = malloc(scratch);
    return m->grad[0] && m->grad[1] && m->dx ? 0 : -1;
}

void model_free(stage_model *m)
{
    for (int k = 0; k < m->nlayers; k++)
        layer_free(&m->layers[k]);
    for (int mb = 0; mb < m->mbs; mb++)
        for (int k = 0; k <= m->nlayers; k++)
            free(m->act[mb][k]), free(m->g[mb][k]);
    free(m->grad[0]), free(m->grad[1]), free(m->dx);
    memset(m, 0, sizeof *m);
}

const float *model_forward(stage_model *m, int mb, const float *x, int rows)
{
    memcpy(m->act[mb][0], x, sizeof(float) * (size_t)rows * (size_t)m->layers[0].in);
    for (int k = 0; k < m->nlayers; k++) {
        dense_layer *l = &m->layers[k];
        float *y = m->act[mb][k + 1];
        for (int r = 0; r < rows; r++)
            memcpy(y + (size_t)r * l->out, l->b, sizeof(float) * (size_t)l->out);
        /* y[rows][out] += x[rows][in] * w^T */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, l->out, l->in, 1.0f,
                    m->act[mb][k], l->in, l->w, l->in, 1.0f, y, l->out);
        if (l->relu)
            for (size_t i = 0; i < (size_t)rows * (size_t)l->out; i++)
                y[i] = y[i] > 0 ? y[i] : 0;
    }
    return m->act[mb][m->nlayers];
}

const float *model_backward(stage_model *m, int mb, const float *dy, int rows, int want_dx)
{
    for (int k = m->nlayers - 1; k >= 0; k--) {
        dense_layer *l = &m->layers[k];
        float *g = m->grad[k % 2];
        const float *y = m->act[mb][k + 1], *x = m->act[mb][k];
        size_t n = (size_t)rows * (size_t)l->out;
        memcpy(g, dy, n * sizeof(float));
        if (l->relu)
            for (size_t i = 0; i < n; i++)
                if (y[i] <= 0)
                    g[i] = 0;
        /* gw[out][in] += g^T[out][rows] x[rows][in]; gb += column sums */
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, l->out, l->in, rows, 1.0f, g, l->out,
                    x, l->in, 1.0f, l->gw, l->in);
        for (int r = 0; r < rows; r++)
            for (int o = 0; o < l->out; o++)
                l->gb[o] += g[(size_t)r * l->out + o];
        if (k == 0 && !want_dx)
            return NULL;
        /* dx[rows][in] = g[rows][out] w[out][in] */
        float *dx = k == 0 ? m->dx : m->grad[(k + 1) % 2];
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, l->in, l->out, 1.0f, g, l->out,
                    l->w, l->in, 0.0f, dx, l->in);
        dy = dx;
    }
    return m->dx;
}

int model_enable_split(stage_model *m)
{
    for (int mb = 0; mb < m->mbs; mb++)
        for (int k = 0; k < m->nlayers; k++)
            if (!m->g[mb][k] &&
                !(m->g[mb][k] = malloc(sizeof(float) * (size_t)m->rows * (size_t)m->layers[k].out)))
                return -1;
    return 0;
}

const float *model_backward_input(stage_model *m, int mb, const float *dy, int rows, int want_dx)
{
    for (int k = m->nlayers - 1; k >= 0; k--) {
        dense_layer *l = &m->layers[k];
        float *g = m->g[mb][k];
        const float *y = m->act[mb][k + 1];
        size_t n = (size_t)rows * (size_t)l->out;
        memcpy(g, dy, n * sizeof(float));
        if (l->relu)
            for (size_t i = 0; i < n; i++)
                if (y[i] <= 0)
                    g[i] = 0;
        if (k == 0 && !want_dx)
            return NULL;
        float *dx = k == 0 ? m->dx : m->grad[(k + 1) % 2];
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, l->in, l->out, 1.0f, g, l->out,
                    l->w, l->in, 0.0f, dx, l->in);
        dy = dx;
    }
    return m->dx;
}

void model_backward_weight(stage_model *m, int mb, int rows)
{
    for (int k = m->nlayers - 1; k >= 0; k--) {
        dense_layer *l = &m->layers[k];
        const float *g = m->g[mb][k], *x = m->act[mb][k];
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, l->out, l->in, rows, 1.0f, g, l->out,
                    x, l->in, 1.0f, l->gw, l->in);
        for (int r = 0; r < rows; r++)
            for (int o = 0; o < l->out; o++)
                l->gb[o] += g[(size_t)r * l->out + o];
    }
}

void model_sgd(stage_model *m, float lr, float momentum)
{
    for (int k = 0; k < m->nlayers; k++) {
        dense_layer *l = &m->layers[k];
        size_t nw = (size_t)l->in * (size_t)l->out;
        for (size_t i = 0; i < nw; i++) {
            l->vw[i] = momentum * l->vw[i] + l->gw[i];
            l->w[i] -= lr * l->vw[i];
            l->gw[i] = 0;
        }
        for (int o = 0; o < l->out; o++) {
            l->vb[o] = momentum * l->vb[o] + l->gb[o];
            l->b[o] -= lr * l->vb[o];
            l->gb[o] = 0;
        }
    }
}

double softmax_xent(const float *logits, const uint8_t *labels, int rows, int classes, int batch,
                    float *dlogits, int *correct)
{
    double loss = 0;
    for (int r = 0; r < rows; r++) {
        const float *z = logits + (size_t)r * classes;
        float *d = dlogits + (size_t)r * classes;
        int best = 0;
        float zmax = z[0];
        for (int c = 1; c < classes; c++)
            if (z[c] > zmax)
                zmax = z[c], best = c;
        double sum = 0;
        for (int c = 0; c < classes; c++)
            sum += exp((double)(z[c] - zmax));
        for (int c = 0; c < classes; c++) {
            double p = exp((double)(z[c] - zmax)) / sum;
            d[c] = (float)((p - (c == labels[r] ? 1.0 : 0.0)) / batch);
        }
        loss += log(sum) - (double)(z[labels[r]] - zmax);
        *correct += best == labels[r];
    }
    return loss;
}

void model_set_blas_threads(int n)
{
#ifdef OPENBLAS_VERSION
    openblas_set_num_threads(n);
#else
    (void)n;
#endif
}

int model_stash_keep(const stage_model *m, weight_stash *st, uint64_t version)
{
    for (int l = 0; l < m->nlayers; l++) {
        const dense_layer *L = &m->layers[l];
        size_t nw = sizeof(float) * (size_t)L->in * (size_t)L->out;
        size_t nb = sizeof(float) * (size_t)L->out;
        if (!st->w[l] && (!(st->w[l] = malloc(nw)) || !(st->b[l] = malloc(nb))))
            return -1;
        memcpy(st->w[l], L->w, nw);
        memcpy(st->b[l], L->b, nb);
    }
    st->set = 1, st->version = version;
    return 0;
}

void model_stash_swap(stage_model *m, weight_stash *st)
{
    for (int l = 0; l < m->nlayers; l++) {
        dense_layer *L = &m->layers[l];
        float *w = L->w, *b = L->b;
        L->w = st->w[l], L->b = st->b[l];
        st->w[l] = w, st->b[l] = b;
    }
}

void model_stash_free(weight_stash *st)
{
    for (int l = 0; l < MODEL_MAX_LAYERS; l++)
        free(st->w[l]), free(st->b[l]);
    memset(st, 0, sizeof *st);
}
