/* A tiny deterministic multilayer perceptron in plain C. Loops run in a
 * fixed order, so the same inputs give bit-identical results anywhere. */
#include "mlp.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static float hash_unit(uint64_t x) /* deterministic value in [-1, 1) */
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return (float)((double)(x >> 11) * 0x1p-52 - 1.0);
}

int mlp_layer_init(mlp_layer *l, int in, int out, int tanh_act, uint64_t seed)
{
    l->in = in, l->out = out, l->tanh_act = tanh_act;
    l->w = malloc(sizeof(float) * (size_t)(in * out));
    l->gw = calloc((size_t)(in * out), sizeof(float));
    l->b = malloc(sizeof(float) * (size_t)out);
    l->gb = calloc((size_t)out, sizeof(float));
    if (!l->w || !l->gw || !l->b || !l->gb)
        return -1;
    float scale = 1.0f / sqrtf((float)in);
    for (int i = 0; i < in * out; i++)
        l->w[i] = hash_unit(seed * 1000003u + (uint64_t)i) * scale;
    for (int o = 0; o < out; o++)
        l->b[o] = 0.1f * hash_unit(seed * 7919u + 77u + (uint64_t)o);
    return 0;
}

void mlp_layer_free(mlp_layer *l)
{
    free(l->w), free(l->gw), free(l->b), free(l->gb);
    memset(l, 0, sizeof *l);
}

void mlp_layer_forward(const mlp_layer *l, const float *x, int rows, float *y)
{
    for (int r = 0; r < rows; r++)
        for (int o = 0; o < l->out; o++) {
            float s = l->b[o];
            for (int i = 0; i < l->in; i++)
                s += x[r * l->in + i] * l->w[o * l->in + i];
            y[r * l->out + o] = l->tanh_act ? tanhf(s) : s;
        }
}

void mlp_layer_backward(mlp_layer *l, const float *x, const float *y, const float *dy, int rows,
                        float *dx)
{
    for (int r = 0; r < rows; r++) {
        if (dx)
            memset(dx + r * l->in, 0, sizeof(float) * (size_t)l->in);
        for (int o = 0; o < l->out; o++) {
            float yo = y[r * l->out + o];
            float ds = dy[r * l->out + o] * (l->tanh_act ? 1.0f - yo * yo : 1.0f);
            l->gb[o] += ds;
            for (int i = 0; i < l->in; i++) {
                l->gw[o * l->in + i] += ds * x[r * l->in + i];
                if (dx)
                    dx[r * l->in + i] += ds * l->w[o * l->in + i];
            }
        }
    }
}

void mlp_layer_backward_input(const mlp_layer *l, const float *y, const float *dy, int rows,
                              float *dx)
{
    for (int r = 0; r < rows; r++) {
        memset(dx + r * l->in, 0, sizeof(float) * (size_t)l->in);
        for (int o = 0; o < l->out; o++) {
            float yo = y[r * l->out + o];
            float ds = dy[r * l->out + o] * (l->tanh_act ? 1.0f - yo * yo : 1.0f);
            for (int i = 0; i < l->in; i++)
                dx[r * l->in + i] += ds * l->w[o * l->in + i];
        }
    }
}

void mlp_layer_backward_weight(mlp_layer *l, const float *x, const float *y, const float *dy,
                               int rows)
{
    for (int r = 0; r < rows; r++)
        for (int o = 0; o < l->out; o++) {
            float yo = y[r * l->out + o];
            float ds = dy[r * l->out + o] * (l->tanh_act ? 1.0f - yo * yo : 1.0f);
            l->gb[o] += ds;
            for (int i = 0; i < l->in; i++)
                l->gw[o * l->in + i] += ds * x[r * l->in + i];
        }
}

void mlp_layer_sgd(mlp_layer *l, float lr)
{
    for (int i = 0; i < l->in * l->out; i++)
        l->w[i] -= lr * l->gw[i], l->gw[i] = 0;
    for (int o = 0; o < l->out; o++)
        l->b[o] -= lr * l->gb[o], l->gb[o] = 0;
}

void mlp_data(int step, int row, int in_dim, int out_dim, float *x, float *t)
{
    uint64_t base = ((uint64_t)step * 4096u + (uint64_t)row) * 64u;
    float s = 0;
    for (int i = 0; i < in_dim; i++) {
        x[i] = hash_unit(base + (uint64_t)i);
        s += x[i] * (float)(i % 3 - 1);
    }
    for (int o = 0; o < out_dim; o++) /* a smooth function of the input to learn */
        t[o] = 0.5f * sinf(s + (float)o) + 0.25f * x[o % in_dim];
}

double mlp_mse_loss(const float *y, const float *t, int rows, int dim, int batch, float *dy)
{
    double loss = 0;
    for (int i = 0; i < rows * dim; i++) {
        float d = y[i] - t[i];
        loss += 0.5 * (double)d * d;
        dy[i] = d / (float)batch;
    }
    return loss / batch;
}
