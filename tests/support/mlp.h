/* A tiny deterministic multilayer perceptron in plain C: the model the
 * pipeline proof tests train in one process and split across stages. */
#ifndef EPIPE_TESTS_MLP_H
#define EPIPE_TESTS_MLP_H

#include <stddef.h>
#include <stdint.h>

typedef struct mlp_layer {
    int in, out;
    int tanh_act;   /* 1: y = tanh(xW^T + b); 0: linear */
    float *w, *b;   /* [out][in], [out] */
    float *gw, *gb; /* gradients, accumulated until mlp_layer_sgd */
} mlp_layer;

/* Weights from a fixed seed: the same seed gives the same layer anywhere. */
int mlp_layer_init(mlp_layer *l, int in, int out, int tanh_act, uint64_t seed);
void mlp_layer_free(mlp_layer *l);

/* y[rows][out] = act(x[rows][in] W^T + b). */
void mlp_layer_forward(const mlp_layer *l, const float *x, int rows, float *y);
/* Given x, y from the forward and dy = dL/dy: accumulates gw, gb in row
 * order and writes dx = dL/dx (dx may be NULL on the first layer). */
void mlp_layer_backward(mlp_layer *l, const float *x, const float *y, const float *dy, int rows,
                        float *dx);
/* The same backward split in two, with the same arithmetic (bit-identical
 * results): the input gradient dx alone, and later the gradients of W and b. */
void mlp_layer_backward_input(const mlp_layer *l, const float *y, const float *dy, int rows,
                              float *dx);
void mlp_layer_backward_weight(mlp_layer *l, const float *x, const float *y, const float *dy,
                               int rows);
/* w -= lr * gw, b -= lr * gb, then zeroes the gradients. */
void mlp_layer_sgd(mlp_layer *l, float lr);

/* The data set: input row r of batch `step`, target row r, deterministic. */
void mlp_data(int step, int row, int in_dim, int out_dim, float *x, float *t);

/* Loss 0.5*sum((y-t)^2)/batch over `rows` rows, and dy = (y-t)/batch. */
double mlp_mse_loss(const float *y, const float *t, int rows, int dim, int batch, float *dy);

#endif
